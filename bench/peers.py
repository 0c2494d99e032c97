"""The peers of `bench_peers.py`, built with the same shapes as an aiayn model.

- `nn.Transformer`: `bench_train_step.ReferenceTransformer` (a plain PyTorch reference).
- Hugging Face `MarianMTModel` (+ `generate`): the same sizes, random weights, post-norm, ReLU,
  sinusoidal positions, embeddings ×√d_model, one matrix shared by both embeddings and the
  pre-softmax projection: the architecture of the paper as HF ships it.
- CTranslate2: our model's own weights converted to a CTranslate2 `TransformerSpec` (post-norm,
  ReLU, our sinusoidal table), so CTranslate2 decodes the very same function; `check_parity`
  confirms that its greedy output equals ours.

Each peer is optional (`pip install '.[bench]'`); `available()` says why one is missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def available(module: str) -> str | None:
    """None if `module` imports, else the reason it does not (shown in the report)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken install raising anything else
        return f"{module} not installed ({type(error).__name__}: {error}); pip install '.[bench]'"
    return None


def version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "?")


# --------------------------------------------------------------------------------------------
# Hugging Face MarianMTModel
# --------------------------------------------------------------------------------------------


def marian(config: ModelConfig) -> torch.nn.Module:
    """A randomly initialised `MarianMTModel` with the shapes of `config`."""
    from transformers import MarianConfig, MarianMTModel

    hf_config = MarianConfig(
        vocab_size=config.tgt_vocab_size,
        d_model=config.d_model,
        encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function="relu",
        max_position_embeddings=config.max_positions,
        scale_embedding=True,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )
    return MarianMTModel(hf_config)


class MarianForTraining(torch.nn.Module):
    """`MarianMTModel` with aiayn's training signature: (source, shifted target) → logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=src_tokens, decoder_input_ids=tgt_tokens).logits


# --------------------------------------------------------------------------------------------
# CTranslate2, converted from an aiayn model
# --------------------------------------------------------------------------------------------


def vocabulary(size: int) -> list[str]:
    """Token strings for ids 0..size-1, with CTranslate2's names for the special tokens."""
    names = {PAD_ID: "<blank>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
    return [names.get(i, f"t{i}") for i in range(size)]


def _array(tensor: torch.Tensor):
    """A NumPy *copy*: the converter quantizes arrays in place, which must not reach our model."""
    return tensor.detach().float().cpu().numpy().copy()


def _linear(spec, *linears: torch.nn.Linear) -> None:
    """Set a CTranslate2 LinearSpec from one or several (fused, row-stacked) nn.Linear."""
    spec.weight = _array(torch.cat([m.weight for m in linears]))
    if linears[0].bias is not None:
        spec.bias = _array(torch.cat([m.bias for m in linears]))


def _layer_norm(spec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def ct2_spec(model: Transformer):
    """A CTranslate2 `TransformerSpec` holding `model`'s weights."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.config
    if c.positional_encoding != "sinusoidal" or c.d_k * c.n_heads != c.d_model:
        raise ValueError("the CTranslate2 export needs sinusoidal positions and d_k = d_model/h")
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers),
        c.n_heads,
        pre_norm=c.norm_first,
        activation=common_spec.Activation.RELU,
    )
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    spec.config.decoder_start_token = "<s>"
    table = _array(model.positions.table)
    for side, embed, stack in (
        (spec.encoder, model.src_embed, model.encoder),
        (spec.decoder, model.tgt_embed, model.decoder),
    ):
        embeddings = side.embeddings if isinstance(side.embeddings, list) else [side.embeddings]
        embeddings[0].weight = _array(embed.embedding.weight)
        side.scale_embeddings = True
        side.position_encodings.encodings = table
        if c.norm_first:
            _layer_norm(side.layer_norm, stack.final_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder.layers, strict=True):
        attn = layer.self_attn
        _linear(layer_spec.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(layer_spec.self_attention.linear[1], attn.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_sublayer.norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.feed_forward_sublayer.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder.layers, strict=True):
        attn, cross = layer.self_attn, layer.cross_attn
        _linear(layer_spec.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(layer_spec.self_attention.linear[1], attn.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_sublayer.norm)
        _linear(layer_spec.attention.linear[0], cross.q_proj)
        _linear(layer_spec.attention.linear[1], cross.k_proj, cross.v_proj)
        _linear(layer_spec.attention.linear[2], cross.out_proj)
        _layer_norm(layer_spec.attention.layer_norm, layer.cross_attn_sublayer.norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.feed_forward_sublayer.norm)
    spec.decoder.projection.weight = _array(model.output_projection.weight)
    spec.register_source_vocabulary(vocabulary(c.src_vocab_size))
    spec.register_target_vocabulary(vocabulary(c.tgt_vocab_size))
    return spec


def ct2_convert(model: Transformer, output_dir: Path, quantization: str | None) -> Path:
    """Write `model` as a CTranslate2 model directory (weights stored as `quantization`)."""
    from ctranslate2.converters.converter import Converter

    class _FromAiayn(Converter):
        def _load(self):
            return ct2_spec(model)

    return Path(_FromAiayn().convert(str(output_dir), quantization=quantization, force=True))


def ct2_translator(model_dir: Path, compute_type: str, threads: int):
    import ctranslate2

    return ctranslate2.Translator(
        str(model_dir),
        device="cpu",
        compute_type=compute_type,
        intra_threads=threads,
        inter_threads=1,
    )


def ct2_tokens(src: torch.Tensor, size: int) -> list[list[str]]:
    names = vocabulary(size)
    return [[names[i] for i in row] for row in src.tolist()]


def ct2_ids(outputs, size: int) -> list[list[int]]:
    index = {name: i for i, name in enumerate(vocabulary(size))}
    return [[index[t] for t in out.hypotheses[0]] for out in outputs]
