"""A readable description of a model: its architecture and a parameter count per component.

What ``aiayn info`` prints: the hyperparameters in the paper's names and where the parameters
go (embeddings, attention, feed-forward), so a config can be checked against Table 3 before
training.
"""

from __future__ import annotations

from torch import nn

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


def parameter_table(model: nn.Module, config: ModelConfig) -> list[tuple[str, int]]:
    """(component, count) rows in model order; a shared `Parameter` is counted once."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():  # yields each shared Parameter once
        component = component_of(name, config)
        counts[component] = counts.get(component, 0) + param.numel()
    return list(counts.items())


def describe(model: nn.Module, config: ModelConfig) -> str:
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
        f"weight sharing: {c.share_embeddings}",
        "",
    ]
    rows = parameter_table(model, config)
    total = sum(n for _, n in rows)
    width = max(len(name) for name, _ in rows)
    lines.append(f"  {'component':<{width}}  {'parameters':>12}  {'share':>6}")
    for name, n in rows:
        lines.append(f"  {name:<{width}}  {n:>12,}  {100 * n / total:>5.1f}%")
    lines.append(f"  {'total':<{width}}  {total:>12,}  ({total / 1e6:.1f}M)")
    return "\n".join(lines)
