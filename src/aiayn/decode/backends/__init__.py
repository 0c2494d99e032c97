"""The runtimes a `Translator` decodes on, behind one small protocol.

A `Translator` owns what every runtime shares: tokenizing, truncating long sources, the
output-length limit, sorting and batching sentences by length, and turning hypotheses into
results. A backend owns what differs: running a batch of source ids to n-best hypotheses.

- `aiayn.decode.backends.pytorch`: an aiayn `Transformer`, or an ensemble of them, under
  `aiayn.decode.search` (the default; the only backend that can return attention maps).
- `aiayn.decode.backends.onnx`: the graphs of ``aiayn export --to onnx`` run by onnxruntime,
  under the same search.
- `aiayn.decode.backends.ctranslate2`: a directory of ``aiayn export --to ctranslate2``,
  decoded by CTranslate2's own search.

The peer runtimes are optional (``pip install -e '.[export]'``): their modules import them only
when a backend is built, through `aiayn.extras.require`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.decode import search
from aiayn.decode.options import DecodingOptions
from aiayn.decode.results import SentenceAttention
from aiayn.decode.search import Hypothesis
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

__all__ = ["AIAYN_FILE", "Backend", "ExportedModel", "HasConfig", "pad", "search_with"]

AIAYN_FILE = "aiayn.json"  # what an export adds for aiayn: the ModelConfig and metadata


class HasConfig(Protocol):
    config: ModelConfig


class Backend(Protocol):
    """What `Translator` needs from a runtime.

    Sources reach a backend as lists of token ids ending with EOS, already truncated to what
    the model accepts and grouped into batches that share one output-length limit
    (``options.max_len_a`` and ``options.max_len_b``), so a backend only decodes.

    Attributes:
        models: The model (or an ensemble's models), each with the ``config`` from which
            `Translator` reads the source-length limit and the positional encoding; what
            ``Translator.models`` shows.
        device: Where the model runs (a sampling generator is made there).
        returns_attention: Whether `attention` gives maps: one PyTorch model does; an
            ensemble or an exported model does not.
    """

    models: Sequence[HasConfig]
    device: torch.device

    @property
    def returns_attention(self) -> bool: ...

    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        """Called once per call, before any batch: raises ValueError, naming the option, for
        what this backend cannot decode (so nothing is half done)."""
        ...

    def seed(self, seed: int) -> torch.Generator | None:
        """Seeds sampling for one call; returns the generator that `search` is then given, or
        None where the runtime keeps its own (CTranslate2)."""
        ...

    def search(
        self,
        sources: list[list[int]],
        options: DecodingOptions,
        generator: torch.Generator | None,
    ) -> list[list[Hypothesis]]:
        """Each source's n-best hypotheses (tokens without BOS and EOS), best first, in the
        order of ``sources``."""
        ...

    def attention(
        self, sources: list[list[int]], outputs: list[list[int]]
    ) -> list[SentenceAttention]:
        """The attention maps of each source and its output (tokens without BOS and EOS);
        only where `returns_attention`."""
        ...


class ExportedModel:
    """A model that runs outside PyTorch, as `Translator` shows it (``translator.model``): its
    `ModelConfig` (source-length limit, positions) and the device its inputs go to."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device


def pad(rows: list[list[int]], device: torch.device) -> Tensor:
    """Right-pads id lists into a (B, longest) long tensor."""
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def search_with(
    model: search.IncrementalModel,
    sources: list[list[int]],
    options: DecodingOptions,
    generator: torch.Generator | None,
    device: torch.device,
) -> list[list[Hypothesis]]:
    """aiayn's own search over any `search.IncrementalModel` (a model, an ensemble, ONNX
    sessions): ``n_best`` samples per sentence sorted by log-probability with ``sampling``,
    else greedy search for beam size 1, else beam search."""
    src = pad(sources, device)  # (B, S)
    ids: dict[str, Any] = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
    if options.sampling:
        n = options.n_best
        samples = search.sample(
            model,
            src.repeat_interleave(n, dim=0),
            options=options,
            generator=generator,
            **ids,
        )
        return [
            sorted(samples[i * n : (i + 1) * n], key=lambda h: -h.score)
            for i in range(len(sources))
        ]
    if options.beam_size == 1:
        return [[h] for h in search.greedy_search(model, src, options=options, **ids)]
    return search.beam_search(model, src, options=options, **ids)
