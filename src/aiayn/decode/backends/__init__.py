"""The runtimes a `Translator` decodes on, behind one small interface, and the one way to load
them from a directory.

A `Translator` owns what every runtime shares: tokenizing, truncating long sources, the
output-length limit, sorting and batching sentences by length, and turning hypotheses into
results. A backend owns what differs: running a batch of source ids to n-best hypotheses, and
says what else it can do (`Backend`: attention maps, scoring, batches side by side).

- `aiayn.decode.backends.pytorch`: an aiayn `Transformer`, or an ensemble of them, under
  `aiayn.decode.search` (the default; the only backend that can return attention maps or score).
- `aiayn.decode.backends.onnx`: the graphs of ``aiayn export --to onnx`` run by onnxruntime,
  under the same search.
- `aiayn.decode.backends.ctranslate2`: a directory of ``aiayn export --to ctranslate2``,
  decoded by CTranslate2's own search.

`aiayn.decode.backends.loading.load_backend` tells them apart by the files a directory holds
(`export_kind`) and loads the one it is: what ``Translator(directory)`` runs.

The peer runtimes are optional (``pip install -e '.[export]'``): their modules import them only
when a backend is built, through `aiayn.extras.require`. Nothing here imports torch: the
CTranslate2 backend decodes without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from aiayn.config import ModelConfig
    from aiayn.decode.options import DecodingOptions
    from aiayn.decode.results import Hypothesis, SentenceAttention
    from aiayn.decode.scoring import PairScore
    from aiayn.text.tokenizer import SplitTokenizer, Tokenizer

__all__ = [
    "AIAYN_FILE",
    "CTRANSLATE2_FILE",
    "DECODER_STEP_FILE",
    "ENCODER_FILE",
    "EXTRA_POSITIONS",
    "VMAP_FILE",
    "Backend",
    "ExportedModel",
    "HasConfig",
    "export_kind",
]

AIAYN_FILE = "aiayn.json"  # what an export adds for aiayn: the ModelConfig and metadata
ENCODER_FILE = "encoder.onnx"  # an ONNX export's graphs (`aiayn.interop.onnx.export_onnx`)
DECODER_STEP_FILE = "decoder_step.onnx"
CTRANSLATE2_FILE = "model.bin"  # CTranslate2's weights (`aiayn.interop.export_ctranslate2`)
VMAP_FILE = "vmap.txt"  # CTranslate2's vocabulary map: the model's lexical shortlist, if any

EXTRA_POSITIONS = 512
"""Rows of an export's positional table past ``max_positions``. aiayn extends its sinusoids
on the fly; an exported model's table is fixed and must hold the outputs too (up to source + 50
tokens by default), so CTranslate2, ONNX and Hugging Face exports get ``max_positions +
EXTRA_POSITIONS`` positions (`aiayn.interop` writes them; the backends check outputs against
them)."""


class HasConfig(Protocol):
    config: ModelConfig


class Backend(ABC):
    """What `Translator` needs from a runtime, and what the runtime can do beyond decoding.

    Sources reach a backend as lists of token ids ending with EOS, already truncated to what
    the model accepts and grouped into batches that share one output-length limit
    (``options.max_len_a`` and ``options.max_len_b``), so a backend only decodes.

    Every backend states its capabilities; the defaults here are those of a backend that only
    decodes, one batch at a time.

    Attributes:
        models: The model (or an ensemble's models), each with the ``config`` from which
            `Translator` reads the source-length limit and the positional encoding; what
            ``Translator.models`` shows.
        device: Where the model runs (a sampling generator is made there): a `torch.device`,
            or for CTranslate2 its own device name ("cpu", "cuda"), since that backend
            decodes without importing torch.
        returns_attention: Whether `attention` gives maps: one PyTorch model does; an
            ensemble or an exported model does not.
        supports_scoring: Whether `score` scores given translations (the PyTorch models).
        concurrency: How many batches `submit` decodes side by side (CTranslate2 with
            ``workers``); `Translator` then submits every batch of a call at once, unless it
            samples.
    """

    models: Sequence[HasConfig]
    device: torch.device | str
    returns_attention: bool = False
    supports_scoring: bool = False
    concurrency: int = 1

    @abstractmethod
    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        """Called once per call, before any batch: raises ValueError, naming the option, for
        what this backend cannot decode (so nothing is half done)."""

    def shortlist_missing(self) -> str | None:
        """Why this backend cannot decode with ``options.shortlist`` (`Translator` refuses such
        a call, naming it), or None if it can. Here: it has no shortlist."""
        return f"{type(self).__name__} has no lexical shortlist"

    @abstractmethod
    def seed(self, seed: int) -> torch.Generator | None:
        """Seeds sampling for one call; returns the generator that `search` is then given, or
        None where the runtime keeps its own (CTranslate2)."""

    @abstractmethod
    def search(
        self,
        sources: list[list[int]],
        options: DecodingOptions,
        generator: torch.Generator | None,
    ) -> list[list[Hypothesis]]:
        """Each source's n-best hypotheses (tokens without BOS and EOS), best first, in the
        order of ``sources``."""

    def submit(
        self, sources: list[list[int]], options: DecodingOptions
    ) -> Callable[[], list[list[Hypothesis]]]:
        """Starts decoding a batch (as `search` does, unseeded) and returns a function that
        waits for its hypotheses; batches submitted one after another are decoded
        `concurrency` at a time. Here: decoded at once."""
        hypotheses = self.search(sources, options, None)
        return lambda: hypotheses

    def attention(
        self,
        sources: list[list[int]],
        outputs: list[list[int]],
        kinds: Sequence[str] | None = None,
    ) -> list[SentenceAttention]:
        """The attention maps of each source and its output (tokens without BOS and EOS): of
        `kinds` ("encoder", "decoder", "cross"; None: all), None for the others; only where
        `returns_attention` (`check` refuses the call otherwise)."""
        raise NotImplementedError(f"{type(self).__name__} returns no attention maps")

    def score(
        self,
        tokenizer: Tokenizer | SplitTokenizer,
        pairs: Iterable[tuple[str, str]],
        *,
        max_tokens: int,
        progress: Callable[[int], None] | None,
    ) -> Iterator[PairScore]:
        """Each (source, target) pair's log-probability, teacher-forced
        (`aiayn.decode.scoring`); only where `supports_scoring`."""
        raise NotImplementedError(f"{type(self).__name__} does not score")


class ExportedModel:
    """A model that runs outside PyTorch, as `Translator` shows it (``translator.model``): its
    `ModelConfig` (source-length limit, positions) and the device its inputs go to."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = device


def export_kind(path: str | Path) -> Literal["onnx", "ctranslate2"] | None:
    """What `path` holds: an ONNX export ("onnx"), a CTranslate2 export ("ctranslate2"), or
    neither (None: an aiayn model or run directory, or nothing)."""
    directory = Path(path)
    if (directory / DECODER_STEP_FILE).is_file():
        return "onnx"
    if (directory / CTRANSLATE2_FILE).is_file():  # without aiayn.json: refused when loaded
        return "ctranslate2"
    return None
