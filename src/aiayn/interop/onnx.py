"""ONNX: the encoder and one decoder step (with its self-attention cache) as ONNX graphs.

`export_onnx` writes ``encoder.onnx`` (source ids → every decoder layer's encoder-decoder
keys/values, projected once), ``decoder_step.onnx`` (one token per row, its position, the
cache so far → log-probabilities and the cache one position longer), the tokenizer files,
and ``aiayn.json`` (`ModelConfig`, metadata, opset). Running them is decoding's business:
``Translator(export_dir)`` loads the directory like a model directory and decodes with
onnxruntime under aiayn's own search (`aiayn.decode.backends.onnx`, whose `OnnxModel` this
module re-exports): the same tokens as the PyTorch model (tests). Attention maps
(``return_attention``) need the PyTorch model.

Graph inputs/outputs (L layers, N sentences, R = N·K rows, H heads, S source, t positions so
far; float32, ids int64):

    encoder.onnx       src_tokens (N, S) → cross_k (L, N, H, S, d_k), cross_v (L, N, H, S, d_v)
    decoder_step.onnx  tokens (R,), position (1,), self_k (L, R, H, t, d_k), self_v,
                       cross_k, cross_v, src_key_mask (N, S) bool
                       → log_probs (R, V), self_k (L, R, H, t + 1, d_k), self_v

Attention in the step is the explicit softmax(QKᵀ/√d_k)V that aiayn's decoding uses on CPUs.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.decode.backends import AIAYN_FILE, EXTRA_POSITIONS
from aiayn.decode.backends.onnx import (  # OnnxModel re-exported: aiayn.interop.OnnxModel
    DECODER_STEP_FILE,
    ENCODER_FILE,
    OnnxModel,
)
from aiayn.errors import UserValueError
from aiayn.extras import require
from aiayn.model import Transformer, sinusoidal_positional_encoding
from aiayn.model_dir import TOKENIZER_FILE as TOKENIZER_FILE_NAME
from aiayn.model_dir import load_model_dir
from aiayn.text.tokenizer import PAD_ID, tokenizer_files

logger = logging.getLogger(__name__)

OPSET = 18


# --------------------------------------------------------------------------------------------
# The two graphs, as modules over the model's own layers
# --------------------------------------------------------------------------------------------


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Eq. 1, explicitly: (.., T, d_k), (.., S, d_k), (.., S, d_v) → (.., T, d_v)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def _merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, d) → (B, T, H·d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class _Encoder(nn.Module):
    def __init__(self, model: Transformer, table: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("table", table)

    def forward(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        m = self.model
        src_key_mask = src_tokens != m.config.pad_id  # (N, S)
        x = m.src_embed(src_tokens) + self.table[: src_tokens.size(1)]
        # With the probabilities asked for, the layers compute Eq. 1 as written (the maps are
        # left unused), like the step's `_attention`, not PyTorch's fused kernel.
        memory, _ = m.encoder(x, src_key_mask, need_weights=True)
        kv = [layer.cross_attn.project_key_value(memory) for layer in m.decoder.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


class _DecoderStep(nn.Module):
    def __init__(self, model: Transformer, table: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("table", table)

    def forward(
        self,
        tokens: Tensor,
        position: Tensor,
        self_k: Tensor,
        self_v: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        src_key_mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        m = self.model
        x = m.tgt_embed(tokens[:, None]) + self.table.index_select(0, position)  # (R, 1, D)
        n = cross_k.size(1)
        mask = src_key_mask[:, None, None, :]  # (N, 1, 1, S)
        new_k, new_v = [], []
        for i, layer in enumerate(m.decoder.layers):

            def self_attention(h: Tensor, i: int = i, layer: nn.Module = layer):
                q, k, v = layer.self_attn.project_qkv(h)  # (R, H, 1, d)
                keys = torch.cat([self_k[i], k], dim=2)
                values = torch.cat([self_v[i], v], dim=2)
                new_k.append(keys)
                new_v.append(values)
                out = _attention(q, keys, values, None)
                return layer.self_attn.out_proj(_merge_heads(out)), None

            def cross_attention(h: Tensor, i: int = i, layer: nn.Module = layer):
                q = layer.cross_attn.project_query(h.reshape(n, -1, h.size(-1)))  # (N, H, K, d)
                out = _attention(q, cross_k[i], cross_v[i], mask)
                return layer.cross_attn.out_proj(_merge_heads(out)).reshape(h.shape), None

            x, _ = layer.self_attn_sublayer(x, self_attention)
            x, _ = layer.cross_attn_sublayer(x, cross_attention)
            x, _ = layer.feed_forward_sublayer(
                x, lambda h, layer=layer: (layer.feed_forward(h), None)
            )
        x = m.decoder.final_norm(x)
        log_probs = F.log_softmax(m.output_projection(x[:, 0]).float(), dim=-1)
        return log_probs, torch.stack(new_k), torch.stack(new_v)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def export_onnx(model_dir: str | Path, out_dir: str | Path, opset: int = OPSET) -> Path:
    """Write `model_dir` as ``encoder.onnx`` + ``decoder_step.onnx`` (ONNX opset `opset`)
    next to its tokenizer and ``aiayn.json``; `Translator(out_dir)` loads the result.

    Returns:
        `out_dir`.
    """
    loaded = load_model_dir(model_dir)
    out_dir = write_onnx_graphs(loaded.model, out_dir, opset=opset, metadata=loaded.metadata)
    files = tokenizer_files(loaded.tokenizer_file)
    for file in files:
        shutil.copyfile(file, out_dir / (file.name if len(files) > 1 else TOKENIZER_FILE_NAME))
    logger.debug("exported %s to ONNX (opset %d) -> %s", model_dir, opset, out_dir)
    return out_dir


def _example_inputs(c: ModelConfig) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Inputs to trace the encoder and the decoder step with: sizes all different, none 0 or
    1, so that the exporter keeps every dynamic dimension apart."""
    l, h = c.n_decoder_layers, c.n_heads
    n, k, s, t = 2, 3, 5, 4  # sentences, beam, source length, positions so far
    src = torch.full((n, s), 5, dtype=torch.long)
    src[1, -1] = PAD_ID
    step_args = (
        torch.full((n * k,), 5, dtype=torch.long),
        torch.tensor([t]),
        torch.randn(l, n * k, h, t, c.d_k),
        torch.randn(l, n * k, h, t, c.d_v),
        torch.randn(l, n, h, s, c.d_k),
        torch.randn(l, n, h, s, c.d_v),
        src != PAD_ID,
    )
    return src, step_args


def write_onnx_graphs(
    model: Transformer, out_dir: str | Path, *, opset: int = OPSET, metadata: dict | None = None
) -> Path:
    """The graphs and ``aiayn.json`` of `export_onnx`, from a model in memory (no tokenizer:
    `OnnxModel(out_dir)` runs on token ids, as the benchmarks do)."""
    require("export", "onnx", "onnxscript", needed_by="exporting to ONNX")
    c, model = model.config, model.float().eval()
    if c.positional_encoding == "sinusoidal":
        table = sinusoidal_positional_encoding(c.max_positions + EXTRA_POSITIONS, c.d_model)
    else:
        table = model.positions.embedding.weight.detach().clone()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src, step_args = _example_inputs(c)
    dim = torch.export.Dim
    sentences, source, rows, past = dim("N"), dim("S"), dim("R"), dim("t")
    with torch.no_grad():
        torch.onnx.export(
            _Encoder(model, table).eval(),
            (src,),
            str(out_dir / ENCODER_FILE),
            input_names=["src_tokens"],
            output_names=["cross_k", "cross_v"],
            dynamic_shapes={"src_tokens": {0: sentences, 1: source}},
            opset_version=opset,
            dynamo=True,
            external_data=False,
        )
        torch.onnx.export(
            _DecoderStep(model, table).eval(),
            step_args,
            str(out_dir / DECODER_STEP_FILE),
            input_names=[
                "tokens", "position", "self_k", "self_v", "cross_k", "cross_v", "src_key_mask"
            ],
            output_names=["log_probs", "new_self_k", "new_self_v"],
            dynamic_shapes={
                "tokens": {0: rows},
                "position": None,
                "self_k": {1: rows, 3: past},
                "self_v": {1: rows, 3: past},
                "cross_k": {1: sentences, 3: source},
                "cross_v": {1: sentences, 3: source},
                "src_key_mask": {0: sentences, 1: source},
            },
            opset_version=opset,
            dynamo=True,
            external_data=False,
        )  # fmt: skip
    written = _opset_of(out_dir / ENCODER_FILE), _opset_of(out_dir / DECODER_STEP_FILE)
    if written != (opset, opset):
        raise UserValueError(
            f"opset ({opset}): PyTorch's exporter wrote the graphs in opset "
            f"{' and '.join(map(str, sorted(set(written))))} (it converts only to the opsets "
            f"it supports); ask for that, or leave the opset to its default ({OPSET})"
        )
    aiayn = {
        "config": c.to_dict(),
        "metadata": metadata or {},
        "opset": opset,
        "positions": table.size(0),
    }
    (out_dir / AIAYN_FILE).write_text(json.dumps(aiayn, indent=2) + "\n")
    return out_dir


def _opset_of(graph: Path) -> int:
    """The ONNX opset (the default domain's) a graph file was written in."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


__all__ = ["OPSET", "OnnxModel", "export_onnx", "write_onnx_graphs"]
