"""The ONNX Runtime backend: the graphs of ``aiayn export --to onnx`` under aiayn's own search.

An export (`aiayn.interop.onnx.export_onnx`) holds ``encoder.onnx`` (source ids → every decoder
layer's encoder-decoder keys/values, projected once), ``decoder_step.onnx`` (one token per row,
its position, the cache so far → log-probabilities and the cache one position longer), the
tokenizer and ``aiayn.json``. `OnnxModel` runs the graphs with onnxruntime behind the
`search.IncrementalModel` protocol, with `OnnxCache` as its `ReorderableCache`, so aiayn's own
greedy and beam search (and sampling) run on them, and ``Translator(export_dir)`` translates
with them: the same tokens as the PyTorch model (tests). Attention maps need the PyTorch model.

Threads. ``threads`` are onnxruntime's intra-op threads, its sessions' own. PyTorch's, which run
only the search's small operators here, are the process's: a program that runs an export is
best off giving PyTorch one (``aiayn.runtime.configure(threads=1)``, as ``aiayn translate``
does), since with both on every core PyTorch's OpenMP threads spin-wait after each operator
and take the cores from onnxruntime's, slowing it down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.decode.backends import (
    AIAYN_FILE,
    DECODER_STEP_FILE,
    ENCODER_FILE,
    Backend,
    ExportedModel,
)
from aiayn.decode.options import DecodingOptions
from aiayn.decode.results import Hypothesis
from aiayn.decode.search import search_with
from aiayn.errors import CorruptCheckpointError, UserValueError, first_line
from aiayn.extras import require
from aiayn.model_dir import TOKENIZER_FILE, CheckpointError
from aiayn.text.tokenizer import PAD_ID, VOCAB_FILE, SplitTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DECODER_STEP_FILE",
    "ENCODER_FILE",
    "OnnxBackend",
    "OnnxCache",
    "OnnxModel",
    "load_onnx_export",
]


class OnnxCache:
    """The decoder state between ONNX steps; search sees only `reorder` (ReorderableCache).

    Attributes:
        self_k, self_v: (L, R, H, t, d) self-attention keys/values of the positions so far.
        cross_k, cross_v: (L, N, H, S, d) encoder-decoder keys/values, one per sentence.
        src_key_mask: (N, S) True = real source token.
        length: Positions fed so far (t).
    """

    def __init__(self, self_k, self_v, cross_k, cross_v, src_key_mask) -> None:
        self.self_k, self.self_v = self_k, self_v
        self.cross_k, self.cross_v = cross_k, cross_v
        self.src_key_mask = src_key_mask
        self.length = 0

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> OnnxCache:
        """Keep rows `index` and sentences `sentences` (see `search.ReorderableCache`)."""
        self.self_k = self.self_k.index_select(1, index)
        self.self_v = self.self_v.index_select(1, index)
        if sentences is not None:
            self.cross_k = self.cross_k.index_select(1, sentences)
            self.cross_v = self.cross_v.index_select(1, sentences)
            self.src_key_mask = self.src_key_mask.index_select(0, sentences)
        return self


class OnnxModel(ExportedModel):
    """An `export_onnx` directory run by onnxruntime, as a `search.IncrementalModel`."""

    def __init__(self, export_dir: str | Path, *, threads: int = 0) -> None:
        [ort] = require("export", "onnxruntime", needed_by="running an ONNX export")
        directory = Path(export_dir)
        try:
            aiayn = json.loads((directory / AIAYN_FILE).read_text(encoding="utf-8"))
        except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{directory / AIAYN_FILE} is corrupt: {error}") from None
        super().__init__(ModelConfig.from_dict(aiayn["config"]), torch.device("cpu"))
        self.metadata = aiayn.get("metadata", {})
        self.positions = int(aiayn["positions"])
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        self.encoder, self.decoder = (
            _session(ort, directory / name, options, providers)
            for name in (ENCODER_FILE, DECODER_STEP_FILE)
        )

    def encode(self, src_tokens: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """Source ids (N, S) → the encoder-decoder keys/values (the "memory" search passes on
        to `init_cache`) and the source mask."""
        cross_k, cross_v = self.encoder.run(None, {"src_tokens": src_tokens.cpu().numpy()})
        return (torch.from_numpy(cross_k), torch.from_numpy(cross_v)), src_tokens != PAD_ID

    def init_cache(
        self, memory: tuple[Tensor, Tensor], src_key_mask: Tensor | None, max_len: int
    ) -> OnnxCache:
        cross_k, cross_v = memory
        c = self.config
        l, n, h = cross_k.shape[:3]
        if max_len > self.positions:
            raise UserValueError(
                f"outputs of up to {max_len} positions, but the export's positional table has "
                f"{self.positions}: lower max_len_a/max_len_b"
            )
        empty_k = cross_k.new_zeros(l, n, h, 0, c.d_k)
        empty_v = cross_v.new_zeros(l, n, h, 0, c.d_v)
        if src_key_mask is None:
            src_key_mask = torch.ones(n, cross_k.size(3), dtype=torch.bool)
        return OnnxCache(empty_k, empty_v, cross_k, cross_v, src_key_mask)

    def decode_step(self, tokens: Tensor, cache: OnnxCache) -> Tensor:
        log_probs, cache.self_k, cache.self_v = (
            torch.from_numpy(a)
            for a in self.decoder.run(
                None,
                {
                    "tokens": tokens.cpu().numpy(),
                    "position": torch.tensor([cache.length]).numpy(),
                    "self_k": cache.self_k.numpy(),
                    "self_v": cache.self_v.numpy(),
                    "cross_k": cache.cross_k.numpy(),
                    "cross_v": cache.cross_v.numpy(),
                    "src_key_mask": cache.src_key_mask.numpy(),
                },
            )
        )
        cache.length += 1
        return log_probs


def _session(ort: Any, path: Path, options: Any, providers: list[str]) -> Any:
    """onnxruntime's session of the graph ``path``; a missing, truncated or foreign graph is a
    `CorruptCheckpointError` naming it (onnxruntime's own errors are not a user error)."""
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as error:  # onnxruntime's NoSuchFile, InvalidProtobuf, Fail, ...
        raise CorruptCheckpointError(
            f"{path}: onnxruntime cannot load it ({first_line(error)}): a damaged export "
            "(write it again with aiayn export --to onnx) or one this onnxruntime cannot run "
            "(upgrade it)"
        ) from None


def load_onnx_export(
    export_dir: str | Path, *, threads: int = 0
) -> tuple[OnnxModel, Tokenizer | SplitTokenizer]:
    """The model and tokenizer of an `export_onnx` directory (what `Translator` loads).

    `threads` > 0: onnxruntime runs the graphs on that many threads; 0 leaves its default.
    PyTorch's threads are left as they are (see the module docstring).
    """
    directory = Path(export_dir)
    model = OnnxModel(directory, threads=threads)
    joint = directory / TOKENIZER_FILE
    tokenizer = load_tokenizer(joint if joint.is_file() else directory / VOCAB_FILE)
    return model, tokenizer


class OnnxBackend(Backend):
    """An `OnnxModel` decoded by aiayn's search (`Translator`'s backend for an ONNX export)."""

    def __init__(self, model: OnnxModel) -> None:
        self.model = model
        self.models = [model]
        self.device = model.device

    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        if return_attention:
            raise UserValueError(
                "an ONNX export cannot return per-head attention maps (return_attention=True); "
                "translate with the PyTorch model directory for them"
            )

    def seed(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def search(
        self,
        sources: list[list[int]],
        options: DecodingOptions,
        generator: torch.Generator | None,
    ) -> list[list[Hypothesis]]:
        return search_with(self.model, sources, options, generator, self.device)
