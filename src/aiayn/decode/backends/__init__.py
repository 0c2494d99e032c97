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
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # no torch is imported here: the CTranslate2 backend decodes without it
    import torch

    from aiayn.config import ModelConfig
    from aiayn.decode.options import DecodingOptions
    from aiayn.decode.results import Hypothesis, SentenceAttention

__all__ = ["AIAYN_FILE", "EXTRA_POSITIONS", "Backend", "ExportedModel", "HasConfig"]

AIAYN_FILE = "aiayn.json"  # what an export adds for aiayn: the ModelConfig and metadata

EXTRA_POSITIONS = 512
"""Rows of an export's positional table past ``max_positions``. aiayn extends its sinusoids
on the fly; an exported model's table is fixed and must hold the outputs too (up to source + 50
tokens by default), so CTranslate2, ONNX and Hugging Face exports get ``max_positions +
EXTRA_POSITIONS`` positions (`aiayn.interop` writes them; the backends check outputs against
them)."""


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
        device: Where the model runs (a sampling generator is made there): a `torch.device`,
            or for CTranslate2 its own device name ("cpu", "cuda"), since that backend
            decodes without importing torch.
        returns_attention: Whether `attention` gives maps: one PyTorch model does; an
            ensemble or an exported model does not.

    A backend that decodes several batches side by side (CTranslate2 with ``workers``) also
    has ``concurrency`` (how many) and ``submit(sources, options)``, which starts a batch and
    returns a function that waits for its hypotheses: `Translator` then submits every batch
    of a call at once, unless it samples.
    """

    models: Sequence[HasConfig]
    device: torch.device | str

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

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = device
