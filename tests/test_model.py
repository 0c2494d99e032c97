"""Tests for aiayn.model: parity with `torch.nn.Transformer`, fused vs explicit attention, cached
decoding (the cache's reorders: tests/test_cache.py), causality and padding, §3.5 positional
encodings, Table 3 parameter counts, §3.4 weight sharing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.attention import MultiHeadAttention
from aiayn.config import ModelConfig, preset
from aiayn.model import (
    PositionwiseFeedForward,
    SinusoidalPositionalEncoding,
    Transformer,
    sinusoidal_positional_encoding,
)
from model_dirs import tiny_model

PAD = 0
SRC_LENGTHS = (7, 4, 5)  # a padded source batch: S = 7
T = 6

VARIANTS = [
    pytest.param({}, id="post-norm"),
    pytest.param({"norm_first": True}, id="pre-norm"),
    pytest.param({"positional_encoding": "learned"}, id="learned-positions"),
]


def padded_tokens(lengths: tuple[int, ...], vocab: int, width: int | None = None) -> Tensor:
    """(B, width) random real tokens (never PAD), right-padded to `width` (default: max len)."""
    width = width or max(lengths)
    tokens = torch.randint(1, vocab, (len(lengths), width))
    for row, n in enumerate(lengths):
        tokens[row, n:] = PAD
    return tokens


def batch(model: Transformer) -> tuple[Tensor, Tensor]:
    c = model.config
    src = padded_tokens(SRC_LENGTHS, c.src_vocab_size)
    tgt = torch.randint(1, c.tgt_vocab_size, (len(SRC_LENGTHS), T))
    return src, tgt


def perturb_(model: nn.Module) -> None:
    """Move biases and LayerNorm gains/shifts off their 0/1 init, so that parity tests would
    notice a LayerNorm or bias that is missing, misplaced or mapped to the wrong place."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))


# -- parity with torch.nn.Transformer ---------------------------------------------------------


def copy_attention_(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(
        torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
    )
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    theirs.out_proj.bias.copy_(ours.out_proj.bias)


def copy_norm_(ours: nn.Module, theirs: nn.LayerNorm) -> None:
    theirs.load_state_dict(ours.state_dict())


def torch_transformer_like(model: Transformer) -> nn.Transformer:
    """`nn.Transformer` with `model`'s weights: post-norm with no final norm, pre-norm with one
    (as ours; the stock nn.Transformer always adds a final norm)."""
    c = model.config
    assert c.d_k == c.d_v == c.d_model // c.n_heads  # what nn.Transformer supports
    kwargs: dict[str, Any] = dict(
        d_model=c.d_model,
        nhead=c.n_heads,
        dim_feedforward=c.d_ff,
        dropout=0.0,
        activation="relu",
        layer_norm_eps=c.layer_norm_eps,
        batch_first=True,
        norm_first=c.norm_first,
    )

    def final_norm() -> nn.LayerNorm | None:
        return nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.norm_first else None

    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(**kwargs),
        c.n_encoder_layers,
        norm=final_norm(),
        enable_nested_tensor=False,
    )
    decoder = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(**kwargs), c.n_decoder_layers, norm=final_norm()
    )
    reference = nn.Transformer(
        d_model=c.d_model,
        nhead=c.n_heads,
        batch_first=True,
        custom_encoder=encoder,
        custom_decoder=decoder,
    )
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.layers, encoder.layers, strict=True):
            copy_attention_(ours.self_attn, theirs.self_attn)
            theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
            theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
            copy_norm_(ours.self_attn_sublayer.norm, theirs.norm1)
            copy_norm_(ours.feed_forward_sublayer.norm, theirs.norm2)
        for ours, theirs in zip(model.decoder.layers, decoder.layers, strict=True):
            copy_attention_(ours.self_attn, theirs.self_attn)
            copy_attention_(ours.cross_attn, theirs.multihead_attn)
            theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
            theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
            copy_norm_(ours.self_attn_sublayer.norm, theirs.norm1)
            copy_norm_(ours.cross_attn_sublayer.norm, theirs.norm2)
            copy_norm_(ours.feed_forward_sublayer.norm, theirs.norm3)
        if c.norm_first:
            copy_norm_(model.encoder.final_norm, encoder.norm)
            copy_norm_(model.decoder.final_norm, decoder.norm)
    return reference.eval()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_matches_torch_nn_transformer(norm_first: bool) -> None:
    model = tiny_model(norm_first=norm_first, share_embeddings="none")
    perturb_(model)
    reference = torch_transformer_like(model)
    src, tgt = batch(model)
    src_key_mask = model.src_key_mask(src)
    assert src_key_mask is not None  # the batch is padded

    with torch.no_grad():
        logits = model(src, tgt)
        memory, _ = model.encode(src)
        # Our embeddings (×√d_model), positions and output projection around nn.Transformer.
        src_x = model.src_embed(src) + model.positions(src.size(1))
        tgt_x = model.tgt_embed(tgt) + model.positions(tgt.size(1))
        ignore = ~src_key_mask  # PyTorch's padding masks are True = ignore
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        expected_memory = reference.encoder(src_x, src_key_padding_mask=ignore)
        hidden = reference(
            src_x,
            tgt_x,
            tgt_mask=causal,
            src_key_padding_mask=ignore,
            memory_key_padding_mask=ignore,
            tgt_is_causal=True,
        )
        expected_logits = model.output_projection(hidden)

    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        memory[src_key_mask], expected_memory[src_key_mask], atol=1e-5, rtol=0
    )


# -- fused vs explicit attention; attention maps ----------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_forward_and_forward_with_attention_agree(norm_first: bool) -> None:
    model = tiny_model(norm_first=norm_first)
    src, tgt = batch(model)
    with torch.no_grad():
        fused = model(src, tgt)
        explicit, _ = model.forward_with_attention(src, tgt)
    assert fused.shape == (len(SRC_LENGTHS), T, model.config.tgt_vocab_size)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)


def test_attention_maps_not_asked_for_are_neither_computed_nor_kept() -> None:
    """The encoder's (L, B, H, S, S) maps were made and kept for every answer with attention,
    though the server returns the cross-attention only: memory its limit did not count."""
    model = tiny_model(n_encoder_layers=2, n_decoder_layers=3)
    src, tgt = batch(model)
    made: dict[str, int] = {"encoder": 0, "decoder": 0, "cross": 0}

    def counter(kind: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: tuple[Tensor, Tensor | None]) -> None:
            made[kind] += output[1] is not None  # the probabilities, if this call made them

        return hook

    for layer in model.encoder.layers:
        layer.self_attn.register_forward_hook(counter("encoder"))
    for layer in model.decoder.layers:
        layer.self_attn.register_forward_hook(counter("decoder"))
        layer.cross_attn.register_forward_hook(counter("cross"))
    with torch.no_grad():
        every_logits, every = model.forward_with_attention(src, tgt)
        assert made == {"encoder": 2, "decoder": 3, "cross": 3}
        made.update(encoder=0, decoder=0, cross=0)
        logits, maps = model.forward_with_attention(src, tgt, kinds=("cross",))
    assert made == {"encoder": 0, "decoder": 0, "cross": 3}
    assert maps.encoder is None and maps.decoder is None
    torch.testing.assert_close(maps.cross, every.cross, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, every_logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="unknown attention kinds"):
        model.forward_with_attention(src, tgt, kinds=("self",))


def test_attention_maps_shapes_and_probabilities() -> None:
    model = tiny_model(n_encoder_layers=2, n_decoder_layers=3)
    src, tgt = batch(model)
    b, s, h = len(SRC_LENGTHS), src.size(1), model.config.n_heads
    with torch.no_grad():
        _, maps = model.forward_with_attention(src, tgt)
    assert maps.encoder.shape == (2, b, h, s, s)
    assert maps.decoder.shape == (3, b, h, T, T)
    assert maps.cross.shape == (3, b, h, T, s)
    for probs in (maps.encoder, maps.decoder, maps.cross):
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)
    above_diagonal = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    assert (maps.decoder[..., above_diagonal] == 0).all()
    assert (maps.decoder[..., ~above_diagonal] > 0).all()
    padded_key = (src == PAD)[None, :, None, None, :]  # (1, B, 1, 1, S)
    assert (maps.encoder.masked_select(padded_key) == 0).all()
    assert (maps.cross.masked_select(padded_key) == 0).all()
    assert (maps.cross.masked_select(~padded_key) > 0).all()


# -- incremental decoding with the cache ------------------------------------------------------


def decode_stepwise(model: Transformer, src: Tensor, tgt: Tensor) -> Tensor:
    """encode → init_cache → decode_step per position: log-probs (B, T, V)."""
    memory, src_key_mask = model.encode(src)
    cache = model.init_cache(memory, src_key_mask, max_len=tgt.size(1))
    log_probs = [model.decode_step(tgt[:, t], cache) for t in range(tgt.size(1))]
    assert cache.length == tgt.size(1)
    return torch.stack(log_probs, dim=1)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_cached_decoding_equals_full_forward(overrides: dict[str, Any]) -> None:
    model = tiny_model(**overrides)
    perturb_(model)
    src, tgt = batch(model)
    with torch.no_grad():
        expected = model(src, tgt).log_softmax(-1)
        stepwise = decode_stepwise(model, src, tgt)
    torch.testing.assert_close(stepwise, expected, atol=1e-5, rtol=0)


def test_decoding_and_forward_follow_fused_adam_updates_between_searches() -> None:
    """Validate, update with fused Adam (which leaves `Tensor._version` alone), validate again:
    the second pass must see the new weights, as a freshly loaded copy of the model does."""
    model = tiny_model()
    src, tgt = batch(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    for _ in range(2):
        with torch.no_grad():
            model(src, tgt)
            decode_stepwise(model, src, tgt)
        model.train()
        model(src, tgt).log_softmax(-1).mean().neg().backward()
        optimizer.step()
        model.eval()
    fresh = tiny_model()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), fresh(src, tgt), atol=0, rtol=0)
        torch.testing.assert_close(
            decode_stepwise(model, src, tgt), decode_stepwise(fresh, src, tgt), atol=0, rtol=0
        )


def test_decode_step_refuses_a_full_cache() -> None:
    model = tiny_model()
    src, tgt = batch(model)
    with torch.no_grad():
        memory, src_key_mask = model.encode(src)
        cache = model.init_cache(memory, src_key_mask, max_len=1)
        model.decode_step(tgt[:, 0], cache)
        with pytest.raises(ValueError, match="full"):
            model.decode_step(tgt[:, 1], cache)


# -- causality and padding --------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["fused", "explicit"])
def test_decoder_is_causal(attention: str) -> None:
    model = tiny_model()
    src, tgt = batch(model)

    def logits_of(tgt: Tensor) -> Tensor:
        if attention == "fused":
            return model(src, tgt)
        return model.forward_with_attention(src, tgt)[0]

    with torch.no_grad():
        before = logits_of(tgt)
        for changed in range(T):
            other = tgt.clone()
            other[:, changed] = other[:, changed] % (model.config.tgt_vocab_size - 1) + 1
            assert (other[:, changed] != tgt[:, changed]).all()
            after = logits_of(other)
            torch.testing.assert_close(after[:, :changed], before[:, :changed], atol=1e-6, rtol=0)
            assert not torch.allclose(after[:, changed], before[:, changed], atol=1e-4)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_source_padding_changes_nothing(norm_first: bool) -> None:
    model = tiny_model(norm_first=norm_first)
    src = padded_tokens((5, 5), model.config.src_vocab_size)  # no padding: no mask at all
    tgt = torch.randint(1, model.config.tgt_vocab_size, (2, T))
    padded_src = torch.cat([src, torch.full((2, 3), PAD)], dim=1)
    with torch.no_grad():
        memory, mask = model.encode(src)
        padded_memory, padded_mask = model.encode(padded_src)
        logits, padded_logits = model(src, tgt), model(padded_src, tgt)
    assert mask is None and padded_mask is not None
    torch.testing.assert_close(padded_memory[:, :5], memory, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded_logits, logits, atol=1e-5, rtol=0)


def test_a_source_padding_hint_gives_what_asking_the_tensor_does() -> None:
    """`src_padded`, known on the host (`Batch.src_padded`), spares the read back of the
    source (a wait for a GPU): the same mask as asking, None without padding, the same outputs."""
    model = tiny_model()
    padded, tgt = batch(model)
    full = padded_tokens((5, 5, 5), model.config.src_vocab_size)
    assert model.src_key_mask(full) is None and model.src_key_mask(full, padded=False) is None
    assert torch.equal(model.src_key_mask(padded, padded=True), model.src_key_mask(padded))
    with torch.no_grad():
        for src, hint in ((padded, True), (full, False)):
            assert torch.equal(model(src, tgt, src_padded=hint), model(src, tgt))


def test_a_padded_row_equals_the_same_sentence_alone() -> None:
    model = tiny_model()
    src, tgt = batch(model)
    row, n = 1, SRC_LENGTHS[1]
    with torch.no_grad():
        in_batch = model(src, tgt)[row]
        alone = model(src[row : row + 1, :n], tgt[row : row + 1])[0]
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)


# -- embeddings and positional encoding (§3.4, §3.5) ------------------------------------------


def reference_positional_encoding(length: int, d_model: int) -> list[list[float]]:
    """§3.5 word for word, in Python floats (float64)."""
    table = []
    for pos in range(length):
        row = []
        for j in range(d_model):
            two_i = j - j % 2
            angle = pos / 10000 ** (two_i / d_model)
            row.append(math.sin(angle) if j % 2 == 0 else math.cos(angle))
        table.append(row)
    return table


@pytest.mark.parametrize("d_model", [16, 15, 512])
def test_sinusoids_match_section_3_5(d_model: int) -> None:
    length = 200
    ours = sinusoidal_positional_encoding(length, d_model)
    assert ours.shape == (length, d_model) and ours.dtype == torch.float32
    expected = torch.tensor(reference_positional_encoding(length, d_model), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, atol=1e-6, rtol=0)


def rotation(k: int, d_model: int) -> Tensor:
    """M_k: block-diagonal 2×2 rotations by k·ω_i, ω_i = 1 / 10000^(2i/d_model), so that
    (sin, cos)(ω(pos + k)) = M_k-block · (sin, cos)(ω pos) for every pos."""
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(0, d_model, 2):
        theta = k / 10000 ** (i / d_model)
        c, s = math.cos(theta), math.sin(theta)
        m[i : i + 2, i : i + 2] = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
    return m


@pytest.mark.parametrize("k", [1, 2, 7, 50, 300])
def test_pe_at_pos_plus_k_is_a_fixed_linear_map_of_pe_at_pos(k: int) -> None:
    d_model, length = 64, 400
    pe = sinusoidal_positional_encoding(length + k, d_model).double()  # (length + k, D)
    m_k = rotation(k, d_model)
    torch.testing.assert_close(pe[k:], pe[:length] @ m_k.T, atol=1e-6, rtol=0)
    assert not torch.allclose(pe[k:], pe[:length], atol=1e-2)  # the map is not the identity


def test_sinusoidal_module_extends_past_max_positions() -> None:
    module = SinusoidalPositionalEncoding(d_model=8, max_positions=10)
    torch.testing.assert_close(module(5, offset=3), sinusoidal_positional_encoding(8, 8)[3:])
    torch.testing.assert_close(module(6, offset=12), sinusoidal_positional_encoding(18, 8)[12:])


def test_learned_positions_refuse_sequences_past_max_positions() -> None:
    model = tiny_model(positional_encoding="learned", max_positions=8)
    tokens = torch.ones(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=r"max_positions \(8\)"):
        model.encode(tokens)


def test_odd_d_model_works() -> None:
    model = tiny_model(d_model=15, n_heads=3)
    src, tgt = batch(model)
    with torch.no_grad():
        assert model(src, tgt).shape == (len(SRC_LENGTHS), T, model.config.tgt_vocab_size)
        torch.testing.assert_close(
            decode_stepwise(model, src, tgt), model(src, tgt).log_softmax(-1), atol=1e-5, rtol=0
        )


def test_embeddings_are_scaled_by_sqrt_d_model_and_pad_is_zero() -> None:
    model = tiny_model()
    tokens = torch.tensor([[3, 5, PAD]])
    weight = model.src_embed.embedding.weight
    torch.testing.assert_close(model.src_embed(tokens), weight[tokens] * math.sqrt(32))
    assert (weight[PAD] == 0).all()
    assert weight[1:].std().item() == pytest.approx(32**-0.5, rel=0.1)


def _bounds(linear: nn.Linear) -> tuple[float, float, float]:
    """(largest |weight|, largest |bias|, Xavier-uniform's bound) of a linear layer."""
    fan_out, fan_in = linear.weight.shape
    xavier = math.sqrt(6 / (fan_in + fan_out))
    return linear.weight.abs().max().item(), linear.bias.abs().max().item(), xavier


@pytest.mark.parametrize("norm_first", [False, True])
def test_init_schemes_draw_what_they_say(norm_first: bool) -> None:
    torch.manual_seed(0)
    xavier = tiny_model(d_model=64, d_ff=256, norm_first=norm_first)
    torch.manual_seed(0)
    fairseq = tiny_model(d_model=64, d_ff=256, norm_first=norm_first, init="fairseq")
    for model, attention_gain in ((xavier, 1.0), (fairseq, 2**-0.5)):
        for module in model.modules():
            if isinstance(module, MultiHeadAttention):
                for linear in (module.q_proj, module.k_proj, module.v_proj):
                    weight, bias, bound = _bounds(linear)
                    # uniform on ±gain·bound: its largest draw is close to the bound
                    assert 0.9 * attention_gain * bound < weight <= attention_gain * bound
                    assert (bias > 0) == (model is fairseq)
                weight, bias, bound = _bounds(module.out_proj)
                assert 0.9 * bound < weight <= bound and bias == 0
            if isinstance(module, PositionwiseFeedForward):
                for linear in (module.linear1, module.linear2):
                    weight, bias, bound = _bounds(linear)
                    if model is fairseq:
                        bound = linear.weight.shape[1] ** -0.5  # nn.Linear's U(±1/√fan_in)
                        assert 0.9 * bound < bias <= bound
                    else:
                        assert bias == 0
                    assert 0.9 * bound < weight <= bound
    # the rest is drawn alike: embeddings N(0, d^-½) with a zero padding row
    for model in (xavier, fairseq):
        weight = model.src_embed.embedding.weight
        assert (weight[PAD] == 0).all()
        assert weight[1:].std().item() == pytest.approx(64**-0.5, rel=0.1)


def test_an_unknown_init_is_refused() -> None:
    with pytest.raises(ValueError, match=r"init \('kaiming'\) must be one of xavier, fairseq"):
        ModelConfig(src_vocab_size=10, tgt_vocab_size=10, init="kaiming")


def test_dropout_is_active_only_in_training() -> None:
    model = tiny_model()
    src, tgt = batch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), model(src, tgt), atol=0, rtol=0)
        model.train()
        assert not torch.allclose(model(src, tgt), model(src, tgt), atol=1e-4)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_residual_dropout_zeroes_a_fraction_p_and_scales_the_rest(
    p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§5.4 with the keep-mask drawn as U[0, 1) ≥ p: the distribution and scaling of
    `nn.Dropout` (its zeros a fraction p, the rest x / (1 − p)), the gradient the same mask,
    a different mask on each call, the same one for the same seed, identity in eval mode."""
    from aiayn.model import Dropout

    def no_f_dropout(*args: Any, **kwargs: Any) -> Tensor:
        raise AssertionError("F.dropout called: the CPU training path was not taken")

    dropout = Dropout(p).train()
    monkeypatch.setattr(F, "dropout", no_f_dropout)
    x = torch.full((400, 500), 2.0, requires_grad=True)
    torch.manual_seed(0)
    y = dropout(x)
    zeros = (y == 0).float().mean().item()
    assert zeros == pytest.approx(p, abs=0.005)  # 200,000 draws: std 0.001
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 2.0 / (1.0 - p)))
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach() / 2.0)
    torch.manual_seed(0)
    torch.testing.assert_close(dropout(x), y, rtol=0, atol=0)
    assert not torch.equal(dropout(x), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dropout(x.detach().bfloat16()).dtype == torch.bfloat16
    monkeypatch.undo()
    dropout.eval()
    assert dropout(x) is x  # in eval mode, x itself, without a call into PyTorch
    assert torch.equal(Dropout(1.0).train()(x), torch.zeros_like(x))  # as nn.Dropout
    assert torch.equal(Dropout(0.0).train()(x), x)


# -- parameter counts: Table 3 ----------------------------------------------------------------

JOINT_VOCAB = 37000  # §5.1: a shared source-target vocabulary of about 37000 tokens (EN-DE)

# Table 3 rows: (paper's count in millions, changes to "base").
TABLE_3: dict[str, tuple[int, dict[str, Any]]] = {
    "base": (65, {}),
    "A: h=1, d_k=d_v=512": (65, dict(n_heads=1, d_k=512, d_v=512)),
    "A: h=4, d_k=d_v=128": (65, dict(n_heads=4, d_k=128, d_v=128)),
    "A: h=16, d_k=d_v=32": (65, dict(n_heads=16, d_k=32, d_v=32)),
    "A: h=32, d_k=d_v=16": (65, dict(n_heads=32, d_k=16, d_v=16)),
    "B: d_k=16": (58, dict(d_k=16)),
    "B: d_k=32": (60, dict(d_k=32)),
    "C: N=2": (36, dict(n_encoder_layers=2, n_decoder_layers=2)),
    "C: N=4": (50, dict(n_encoder_layers=4, n_decoder_layers=4)),
    "C: N=8": (80, dict(n_encoder_layers=8, n_decoder_layers=8)),
    "C: d_model=256, d_k=d_v=32": (28, dict(d_model=256, d_k=32, d_v=32)),
    "C: d_model=1024, d_k=d_v=128": (168, dict(d_model=1024, d_k=128, d_v=128)),
    "C: d_ff=1024": (53, dict(d_ff=1024)),
    "C: d_ff=4096": (90, dict(d_ff=4096)),
    # Learned positions add max_positions × d_model = 1024 × 512 = 524,288 parameters.
    "E: positional embedding": (65, dict(positional_encoding="learned")),
    "big": (213, dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3)),
}
SAME_WIDTH_ROWS = [row for row, (_, c) in TABLE_3.items() if "d_model" not in c]
OTHER_WIDTH_ROWS = ["base"] + [row for row, (_, c) in TABLE_3.items() if "d_model" in c]

# Our exact counts. At d_model = 512 they sit ~2M below the paper's (63.1M for base); the gap
# scales with d_model (≈ +4M at 1024, ≈ +1M at 256), as if the paper's vocabulary were ~4k
# larger than 37000. Differences between rows of the same width match the paper's to < 1M.
OURS = {
    "base": 63_082_496,
    "A: h=1, d_k=d_v=512": 63_082_496,
    "A: h=4, d_k=d_v=128": 63_082_496,
    "A: h=16, d_k=d_v=32": 63_082_496,
    "A: h=32, d_k=d_v=16": 63_082_496,
    "B: d_k=16": 55_990_784,
    "B: d_k=32": 58_354_688,
    "C: N=2": 33_656_832,
    "C: N=4": 48_369_664,
    "C: N=8": 77_795_328,
    "C: d_model=256, d_k=d_v=32": 26_834_944,
    "C: d_model=1024, d_k=d_v=128": 163_889_152,
    "C: d_ff=1024": 50_487_296,
    "C: d_ff=4096": 88_272_896,
    "E: positional embedding": 63_606_784,
    "big": 214_245_376,
}


def count_parameters(row: str) -> int:
    """Parameters of the real model for a Table 3 row, built on the meta device (no memory)."""
    _, changes = TABLE_3[row]
    config = preset("base", src_vocab_size=JOINT_VOCAB, share_embeddings="all", **changes)
    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() for p in model.parameters())  # a shared Parameter is counted once


def analytic_count(row: str) -> int:
    """The same count from the formulas of §3: embeddings (once, shared), per-layer attention,
    FFN and LayerNorms, plus learned positions for row (E)."""
    _, changes = TABLE_3[row]
    c = preset("base", src_vocab_size=JOINT_VOCAB, **changes)
    d, h = c.d_model, c.n_heads
    attention = 2 * (d * h * c.d_k + h * c.d_k) + (d * h * c.d_v + h * c.d_v) + (h * c.d_v * d + d)
    ffn = d * c.d_ff + c.d_ff + c.d_ff * d + d
    layer_norm = 2 * d
    encoder_layer = attention + ffn + 2 * layer_norm
    decoder_layer = 2 * attention + ffn + 3 * layer_norm
    positions = c.max_positions * d if c.positional_encoding == "learned" else 0
    return (
        JOINT_VOCAB * d
        + c.n_encoder_layers * encoder_layer
        + c.n_decoder_layers * decoder_layer
        + positions
    )


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return {row: count_parameters(row) for row in TABLE_3}


def test_parameter_counts_are_exactly_the_analytic_ones(counts: dict[str, int]) -> None:
    assert counts == OURS
    assert {row: analytic_count(row) for row in TABLE_3} == OURS


@pytest.mark.parametrize("row", SAME_WIDTH_ROWS)
def test_table_3_differences_from_base(counts: dict[str, int], row: str) -> None:
    """Rows at d_model = 512 differ from base by the paper's difference, within ±1M."""
    paper, paper_base = TABLE_3[row][0] * 1e6, TABLE_3["base"][0] * 1e6
    ours = counts[row] - counts["base"]
    assert abs(ours - (paper - paper_base)) <= 1e6, (row, ours / 1e6, (paper - paper_base) / 1e6)


@pytest.mark.parametrize("row", OTHER_WIDTH_ROWS)
def test_table_3_counts_within_5_percent(counts: dict[str, int], row: str) -> None:
    paper = TABLE_3[row][0] * 1e6
    assert counts[row] == pytest.approx(paper, rel=0.05), (row, counts[row] / 1e6, paper / 1e6)


# -- weight sharing (§3.4) --------------------------------------------------------------------


def shared_weights(model: Transformer) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    return (
        model.src_embed.embedding.weight,
        model.tgt_embed.embedding.weight,
        model.output_projection.weight,
    )


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        ("all", (True, True, True)),  # (src is tgt, tgt is out, src is out)
        ("decoder", (False, True, False)),
        ("none", (False, False, False)),
    ],
)
def test_weight_sharing_uses_one_parameter(share: str, expected: tuple[bool, bool, bool]) -> None:
    model = tiny_model(share_embeddings=share)
    src_w, tgt_w, out_w = shared_weights(model)
    assert (src_w is tgt_w, tgt_w is out_w, src_w is out_w) == expected
    n_matrices = 3 - sum(expected[:2])
    d, v = model.config.d_model, model.config.src_vocab_size
    separate = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.size(0) == v)
    assert separate == n_matrices * v * d

    # A training step keeps shared weights shared (and identical), and moves them.
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = [w.detach().clone() for w in shared_weights(model)]
    src, tgt = batch(model)
    model(src, tgt).logsumexp(-1).mean().backward()
    optimizer.step()
    after = shared_weights(model)
    assert (after[0] is after[1], after[1] is after[2], after[0] is after[2]) == expected
    if expected[1]:
        torch.testing.assert_close(after[1], after[2], atol=0, rtol=0)
    for old, new in zip(before, after, strict=True):
        assert not torch.equal(old, new)


# -- search on the real model: the batched, pruned cache = one sentence at a time -----------


class _CountingModel:
    """A Transformer seen through search's protocol, recording the rows of every step."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.rows = model, []

    def encode(self, src: Tensor):
        return self.model.encode(src)

    def init_cache(self, memory: Tensor, mask: Tensor | None, max_len: int):
        return self.model.init_cache(memory, mask, max_len)

    def decode_step(self, tokens: Tensor, cache) -> Tensor:
        self.rows.append(tokens.numel())
        return self.model.decode_step(tokens, cache)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_search_on_the_model_is_the_same_batched_and_pruned_as_alone(beam_size: int) -> None:
    """Finished sentences leave the batch (their cache rows and encoder K/V are dropped);
    what remains must decode exactly as it would alone. Maximum lengths = source lengths, so
    the sentences end at different steps."""
    from aiayn.decode.search import DecodingOptions, beam_search

    model = tiny_model()
    perturb_(model)
    src, _ = batch(model)
    ids = dict(bos_id=2, eos_id=3, pad_id=PAD)
    options = DecodingOptions(beam_size=beam_size, max_len_a=1.0, max_len_b=0)
    with torch.no_grad():
        counting = _CountingModel(model)
        batched = beam_search(counting, src, **ids, options=options)
        widest = counting.rows.index(max(counting.rows))
        assert min(counting.rows[widest:]) < max(counting.rows), "no sentence left the batch"
        for row, hyps in enumerate(batched):
            length = int((src[row] != PAD).sum())
            [alone] = beam_search(
                _CountingModel(model), src[row : row + 1, :length], **ids, options=options
            )
            assert [h.tokens for h in hyps] == [h.tokens for h in alone]
            for a, b in zip(hyps, alone, strict=True):
                assert a.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize(("activation", "function"), [("gelu", F.gelu), ("swish", F.silu)])
def test_feed_forward_activation_for_imported_models(activation, function):
    ffn = PositionwiseFeedForward(8, 16, activation)
    x = torch.randn(2, 3, 8)
    assert torch.equal(ffn(x), ffn.linear2(function(ffn.linear1(x))))


def test_a_model_about_to_be_loaded_skips_drawing_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = tiny_model().config

    def no_draw(self: Transformer) -> None:
        raise AssertionError("reset_parameters ran")

    monkeypatch.setattr(Transformer, "reset_parameters", no_draw)
    drawn = []
    real_reset = nn.Linear.reset_parameters
    monkeypatch.setattr(  # PyTorch's own draw, as nn.Linear is made
        nn.Linear,
        "reset_parameters",
        lambda self: drawn.append(self.weight.device.type) or real_reset(self),
    )
    model = Transformer(config, initialize=False)  # what load_model_dir builds
    assert model.output_projection.weight is model.tgt_embed.embedding.weight  # still tied
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
    assert not model.positions.table.is_meta
    torch.testing.assert_close(  # the sinusoids are computed, never loaded
        model.positions.table, sinusoidal_positional_encoding(config.max_positions, config.d_model)
    )
    assert drawn and set(drawn) == {"meta"}  # drawn on the meta device only: no values
    with pytest.raises(AssertionError, match="reset_parameters ran"):
        Transformer(config)


def test_a_model_loaded_from_its_directory_computes_what_the_saved_one_did(tmp_path) -> None:
    """`Transformer(initialize=False)` (memory without values) and then the strict load:
    every weight the saved model's, the same outputs, tied weights still one parameter; an
    untied pre-softmax projection too."""
    from aiayn.model_dir import load_model_dir, save_model_dir

    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"")  # never read here
    for share in ("all", "none"):
        model = tiny_model(50, share_embeddings=share)
        directory = save_model_dir(tmp_path / share, model, tokenizer_file=tokenizer)
        loaded = load_model_dir(directory).model
        src, tgt = torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (2, 5))
        with torch.inference_mode():
            assert torch.equal(loaded(src, tgt), model(src, tgt))
        saved = dict(model.named_parameters())
        assert all(torch.equal(p, saved[name]) for name, p in loaded.named_parameters())
        tied = loaded.output_projection.weight is loaded.tgt_embed.embedding.weight
        assert tied is (share == "all")
