"""The peers of `bench_peers.py`, built with the same shapes as an aiayn model.

- `nn.Transformer`: `bench_train_step.ReferenceTransformer` (a plain PyTorch reference).
- Hugging Face `MarianMTModel` (+ `generate`): the same sizes, random weights, post-norm, ReLU,
  sinusoidal positions, embeddings ×√d_model, one matrix shared by both embeddings and the
  pre-softmax projection: the architecture of the paper as HF ships it.
- CTranslate2: our model's own weights converted to a CTranslate2 `TransformerSpec` by
  `aiayn.interop.ctranslate2` (post-norm, ReLU, our sinusoidal table), so CTranslate2 decodes
  the very same function; the run confirms that its greedy output equals ours.

Each peer is optional (`pip install '.[bench]'`); `available()` says why one is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID


def available(module: str) -> str | None:
    """None if `module` imports, else the reason it does not (shown in the report)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken install raising anything else
        return f"{module} not installed ({type(error).__name__}: {error}); pip install '.[bench]'"
    return None


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or "missing", without importing it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


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
# CTranslate2, converted from an aiayn model (aiayn.interop.ctranslate2)
# --------------------------------------------------------------------------------------------


def vocabulary(size: int) -> list[str]:
    """Token strings for ids 0..size-1, as the conversion names them (no tokenizer here)."""
    from aiayn.interop.ctranslate2 import id_tokens

    return id_tokens(size)


def ct2_convert(model: Transformer, output_dir: Path, quantization: str | None) -> Path:
    """Write `model` as a CTranslate2 model directory (weights stored as `quantization`)."""
    from aiayn.interop.ctranslate2 import convert_model

    return convert_model(model, output_dir, quantization)


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
