"""A readable description of a model: its architecture and a parameter count per component.

What ``aiayn info`` prints: the hyperparameters in the paper's names and where the parameters
go (embeddings, attention, feed-forward), so a config can be checked against Table 3 before
training.

The counts come from the config alone (`parameter_shapes`), not from a model built on the meta
device: ``aiayn info`` then imports no torch and answers in a fraction of a second, also with
``-m``, whose config.json is checked against its weights' header as it is read.
"""

from __future__ import annotations

import math

from aiayn.config import ModelConfig

_COMPONENTS = (
    ("src_embed.", "source embedding (§3.4)"),
    ("tgt_embed.", "target embedding (§3.4)"),
    ("positions.", "learned positional embedding (Table 3 E)"),
    ("encoder.final_norm.", "final layer norms (pre-norm)"),
    ("decoder.final_norm.", "final layer norms (pre-norm)"),
    ("output_projection.", "pre-softmax linear (§3.4)"),
)
_SUBLAYERS = (
    ("self_attn.", "self-attention"),
    ("cross_attn.", "encoder-decoder attention"),
    ("feed_forward.", "feed-forward"),
    ("sublayer.norm.", "layer norms"),
)


def component_of(name: str, config: ModelConfig) -> str:
    """The component a parameter name belongs to, e.g. 'decoder × 6: self-attention'."""
    if name.startswith("src_embed.") and config.share_embeddings == "all":
        return "shared embedding: source = target = pre-softmax (§3.4)"
    if name.startswith("tgt_embed.") and config.share_embeddings == "decoder":
        return "target embedding = pre-softmax (§3.4)"
    for prefix, label in _COMPONENTS:
        if name.startswith(prefix):
            return label
    stack = name.split(".", 1)[0]
    layers = config.n_encoder_layers if stack == "encoder" else config.n_decoder_layers
    for key, label in _SUBLAYERS:
        if key in name:
            return f"{stack} × {layers}: {label}"
    return name


def parameter_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter of ``Transformer(config)`` with its shape, in the model's order and a
    shared one once under its first name, as ``named_parameters`` yields them (a test holds the
    two to each other for every architectural choice of the config)."""
    c, d = config, config.d_model

    def linear(name: str, d_in: int, d_out: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (d_out, d_in)), (f"{name}.bias", (d_out,))]

    def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (d,)), (f"{name}.bias", (d,))]

    def layer(prefix: str, attentions: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
        qk, v = c.n_heads * c.d_k, c.n_heads * c.d_v
        rows = []
        for attention in attentions:  # W^Q, W^K, W^V, W^O of §3.2.2
            for proj, d_in, d_out in (("q", d, qk), ("k", d, qk), ("v", d, v), ("out", v, d)):
                rows += linear(f"{prefix}.{attention}.{proj}_proj", d_in, d_out)
        rows += linear(f"{prefix}.feed_forward.linear1", d, c.d_ff)  # Eq. 2
        rows += linear(f"{prefix}.feed_forward.linear2", c.d_ff, d)
        for sublayer in (*attentions, "feed_forward"):
            rows += norm(f"{prefix}.{sublayer}_sublayer.norm")
        return rows

    shapes = [("src_embed.embedding.weight", (c.src_vocab_size, d))]
    if c.share_embeddings != "all":
        shapes.append(("tgt_embed.embedding.weight", (c.tgt_vocab_size, d)))
    if c.positional_encoding == "learned":
        shapes.append(("positions.embedding.weight", (c.max_positions, d)))
    stacks = (
        ("encoder", c.n_encoder_layers, ("self_attn",)),
        ("decoder", c.n_decoder_layers, ("self_attn", "cross_attn")),
    )
    for stack, n_layers, attentions in stacks:
        for i in range(n_layers):
            shapes += layer(f"{stack}.layers.{i}", attentions)
        if c.norm_first:
            shapes += norm(f"{stack}.final_norm")
    if c.share_embeddings == "none":
        shapes.append(("output_projection.weight", (c.tgt_vocab_size, d)))
    if c.target_side_output:  # fixed, set from the data: the target side's pieces
        shapes.append(("output_projection.bias", (c.tgt_vocab_size,)))
    return shapes


def parameter_table(config: ModelConfig) -> list[tuple[str, int]]:
    """(component, count) rows in model order; a shared parameter is counted once."""
    counts: dict[str, int] = {}
    for name, shape in parameter_shapes(config):
        component = component_of(name, config)
        counts[component] = counts.get(component, 0) + math.prod(shape)
    return list(counts.items())


def describe(config: ModelConfig) -> str:
    """Architecture lines and the parameter table, as printed by `aiayn info`."""
    c = config
    norm = "pre-norm (x + Sublayer(LayerNorm(x)))" if c.norm_first else "post-norm (§3.1)"
    lines = [
        "Transformer (Vaswani et al., 2017)",
        f"  encoder: N={c.n_encoder_layers}  decoder: N={c.n_decoder_layers}",
        f"  d_model={c.d_model}  d_ff={c.d_ff}  h={c.n_heads}  d_k={c.d_k}  d_v={c.d_v}",
        f"  dropout={c.dropout}  attention_dropout={c.attention_dropout}  {norm}",
        f"  positions: {c.positional_encoding} (max {c.max_positions})",
        f"  vocabulary: source {c.src_vocab_size:,}, target {c.tgt_vocab_size:,}; "
        f"weight sharing: {c.share_embeddings}"
        + ("; output layer: the target side's pieces" if c.target_side_output else ""),
        "",
    ]
    rows = parameter_table(config)
    total = sum(n for _, n in rows)
    width = max(len(name) for name, _ in rows)
    lines.append(f"  {'component':<{width}}  {'parameters':>12}  {'share':>6}")
    for name, n in rows:
        lines.append(f"  {name:<{width}}  {n:>12,}  {100 * n / total:>5.1f}%")
    lines.append(f"  {'total':<{width}}  {total:>12,}  ({total / 1e6:.1f}M)")
    return "\n".join(lines)
