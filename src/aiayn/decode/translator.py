"""Translate text with a trained model directory: tokenize, batch, search, detokenize.

:class:`Translator` is the Python API behind ``aiayn translate`` and ``aiayn evaluate`` and the
validation BLEU of training. In the style of CTranslate2, it takes a list of sentences and
search options (:class:`aiayn.decode.search.DecodingOptions`, or its fields as keywords) and returns
one :class:`TranslationResult` per sentence::

    translator = Translator("runs/en-de/model", device="cuda")
    [result] = translator.translate(["Hello world!"], beam_size=5, return_attention=True)
    result.text, result.score, result.attention  # (T, S) encoder-decoder attention

Ensembles. ``Translator(["run1/model", "run2/model"])`` decodes with several models trained
with the same tokenizer as one, averaging their next-token probabilities at every step
(:class:`aiayn.decode.ensemble.Ensemble`).

Backends. What runs the model is a backend (:mod:`aiayn.decode.backends`): PyTorch (a model
directory, an ensemble, or a model in memory), ONNX Runtime or CTranslate2. ``Translator(path)``
loads whichever ``path`` holds (an aiayn model directory, ``aiayn export --to onnx`` or
``--to ctranslate2``: `aiayn.decode.backends.loading.load_backend`); :meth:`Translator.from_backend`
takes a backend already built. The translator keeps what they share, so that every backend
tokenizes, truncates, limits output lengths and batches alike, and asks the backend what it
can do (attention maps, scoring, batches side by side) rather than what it is.

How a call runs. Each sentence becomes a source as :mod:`aiayn.decode.sources` says (ids +
EOS, cut to what the model accepts, its output-length limit). Blank sentences get an empty
result without running the model. The others are sorted by length, so that a batch holds
sentences of similar length and little padding, grouped into batches of at most
``max_tokens`` padded source tokens × rows per sentence (the beam size;
`aiayn.decode.costs.padded_batches`), decoded by the backend, and returned in input order.
What a call will cost, before it runs, is `aiayn.decode.costs.DecodingCosts`'s to say.

Imports. The PyTorch and ONNX backends (and torch) are imported where a translator is built
on them, so that one over CTranslate2 (``aiayn translate --backend ctranslate2``) starts without
importing torch.

Process-wide settings are the caller's: a translator never sets PyTorch's thread count
(``aiayn.runtime.configure`` does, for the programs that own their process).

Shapes: S source length (EOS included), T output length (EOS included), L layers, H heads.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.decode.backends import Backend
from aiayn.decode.backends.loading import load_backend
from aiayn.decode.costs import padded_batches
from aiayn.decode.options import DecodingOptions
from aiayn.decode.results import (
    Hypothesis,
    SentenceAttention,
    TranslationHypothesis,
    TranslationResult,
    empty_result,
    translation_result,
)
from aiayn.decode.sources import Source, SourceLimits, prepare_sources
from aiayn.errors import CheckpointError, UserValueError
from aiayn.text.lines import one_line, read_lines
from aiayn.text.tokenizer import PAD_ID, SplitTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

    from aiayn.decode.scoring import PairScore
    from aiayn.decode.workers import Workers

__all__ = [
    "SentenceAttention",
    "TranslationHypothesis",
    "TranslationResult",
    "Translator",
    "one_line",
    "read_lines",
]


class Translator:
    """A model and its tokenizer, ready to translate batches of sentences.

    Attributes:
        backend: What runs the model (:mod:`aiayn.decode.backends`).
        model: The `Transformer` (evaluation mode while translating); the first of an ensemble;
            for an export, a stand-in holding its `ModelConfig`.
        models: Every model: ``[model]``, or an ensemble's models.
        tokenizer: The shared source/target SentencePiece model.
        device: Where the model runs: a `torch.device`, or for CTranslate2 its device name
            ("cpu", "cuda").
        max_tokens: Batch budget: padded source tokens × rows per sentence (beam size).
        source_limits: What the model accepts (`aiayn.decode.sources.SourceLimits`): the
            longest source, and with learned positions the longest output.
        metadata: The model directory's ``metadata.json`` (languages, step, ...), or {}; the
            first directory's for an ensemble.
        model_dir: The directory loaded (the first of an ensemble), or None for
            :meth:`from_model`.
        model_dirs: Every directory loaded.
    """

    def __init__(
        self,
        model_dir: str | Path | Sequence[str | Path],
        *,
        device: str | torch.device = "cpu",
        max_tokens: int = 4096,
        threads: int = 0,
        int8: bool = False,
        bf16: bool = False,
        onednn: bool | None = None,
        workers: int = 1,
        worker_threads: int = 1,
        compute_type: str | None = None,
    ) -> None:
        """Loads a model directory (or a run directory's ``model/``, checksums verified) or an
        export, whichever ``model_dir`` holds (`aiayn.decode.backends.loading.load_backend`).

        Args:
            model_dir: Written by training, ``aiayn average`` or ``save_model_dir``; an ONNX
                export (``aiayn.interop.export_onnx``, run by onnxruntime); a CTranslate2
                export (``aiayn.interop.export_ctranslate2``, run by CTranslate2:
                `aiayn.decode.backends.ctranslate2` says what it refuses); or a list of model
                directories, to decode with their ensemble. An ensemble's models must have
                been trained with the same tokenizer.
            device: "cpu", "cuda", "cuda:1", ...
            max_tokens: Batch budget in padded source tokens × beam size. A sentence that alone
                exceeds it is translated in a batch of its own.
            threads: For an ONNX export, onnxruntime's intra-op threads (its sessions' own);
                for a CTranslate2 export, its CPU threads in all; 0 leaves the runtime's
                default. PyTorch's threads belong to the process, so a translator leaves them
                as they are: set them with ``aiayn.runtime.configure(threads=N)`` (as ``aiayn
                translate`` does).
            int8: Quantize every linear layer to int8 weights with dynamic int8 activations
                (``torch.ao.quantization.quantize_dynamic``), CPU only: faster, slightly
                different outputs (BENCHMARKS.md states the measured difference).
            bf16: Run the model in bfloat16 (weights and activations; log-probabilities are
                still computed in float32): on GPUs, and on CPUs with native bf16
                (AVX512-BF16, AMX), where it pays for wide models (`base`) more than for narrow
                ones; slightly different outputs (BENCHMARKS.md).
            onednn: In float32 on an x86-64 CPU, run the linear layers on weights pre-packed
                for oneDNN (`decode.packing.pack_linear_layers`): the same function up to
                float32 rounding; slower than the default on the CPUs measured (1.05x the
                default's time on an AMD EPYC, 1.05x MKL's on an Intel Xeon; BENCHMARKS.md),
                kept as an option for other CPUs. False runs
                MKL's products (PyTorch's own) on the weights stored transposed, which MKL
                reads faster than `nn.Linear`'s transposed view (0.95x the decoding time on an
                Intel Xeon); None (the default) runs MKL's on Intel CPUs, and on other x86-64
                CPUs oneDNN's for the pre-softmax projection and MKL's for the rest, the
                fastest mix measured on an AMD EPYC (`decode.packing.decoding_kernels`).
            workers: On a CPU, decode this many batches at once, each in a process of its
                own forked from this one for the call (Linux; :mod:`aiayn.decode.workers`),
                with ``worker_threads`` PyTorch threads each: Marian's and CTranslate2's way
                of using several cores (``inter_threads``), faster than threads inside one
                search (BENCHMARKS.md). The outputs are those of one process. Sampling
                always decodes in this process (its seeded draws follow the batch order). For
                a CTranslate2 export, the batches it decodes at once in threads of its own
                (``inter_threads``), sharing ``threads``.
            compute_type: A CTranslate2 export's compute type ("int8", "float32", ...);
                None: as the export stores the weights.

        Raises:
            CheckpointError: The directory is missing or incomplete (e.g. no model.safetensors),
                a file is corrupt, the tokenizer does not fit the model, or an ensemble's
                models do not share their tokenizer and target vocabulary.
            TokenizerError: The tokenizer model cannot be read.
            UserValueError: An option out of range, or one this kind of model does not take
                (int8 for an export, compute_type for an aiayn model directory, ...).
        """
        per_worker = worker_threads
        if isinstance(per_worker, bool) or not isinstance(per_worker, int) or per_worker < 1:
            raise UserValueError(f"worker_threads ({per_worker!r}) must be a positive integer")
        loaded = load_backend(
            model_dir,
            device=device,
            threads=threads,
            int8=int8,
            bf16=bf16,
            onednn=onednn,
            workers=workers,
            compute_type=compute_type,
        )
        self._setup(
            loaded.backend, loaded.tokenizer, max_tokens, loaded.metadata, loaded.model_dirs
        )
        self.workers, self.worker_threads = loaded.worker_processes, worker_threads

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer: Tokenizer, *, max_tokens: int = 4096
    ) -> Translator:
        """A translator over an in-memory model (e.g. during training, for validation BLEU).

        The model stays where it is (device, dtype). DDP and ``torch.compile`` wrappers are
        looked through. ``translate`` switches the model to evaluation mode and restores its
        previous mode afterwards, so a training loop can call it between updates; for the same
        reason its linear layers are used as they are, not packed for oneDNN. On a CPU a search
        runs the attention kernels of `acceleration.use_cpu_attention`, and the model's own
        come back after it.
        """
        from aiayn.decode.backends.pytorch import PyTorchBackend
        from aiayn.model_dir import unwrap

        return cls.from_backend(PyTorchBackend([unwrap(model)]), tokenizer, max_tokens=max_tokens)

    @classmethod
    def from_backend(
        cls,
        backend: Backend,
        tokenizer: Tokenizer | SplitTokenizer,
        *,
        max_tokens: int = 4096,
        metadata: dict[str, Any] | None = None,
        model_dirs: Sequence[str | Path] = (),
    ) -> Translator:
        """A translator over a backend already built (:mod:`aiayn.decode.backends`); the
        constructor builds the one a directory holds.

        Args:
            backend: Runs the model.
            tokenizer: The model's tokenizer.
            max_tokens: Batch budget, as for the constructor.
            metadata: What ``metadata`` shows.
            model_dirs: Where the model came from, for ``model_dirs`` and ``repr``.
        """
        translator = cls.__new__(cls)
        translator._setup(
            backend, tokenizer, max_tokens, metadata or {}, [Path(d) for d in model_dirs]
        )
        return translator

    def _setup(
        self,
        backend: Backend,
        tokenizer: Tokenizer | SplitTokenizer,
        max_tokens: int,
        metadata: dict[str, Any],
        model_dirs: list[Path],
    ) -> None:
        for model in backend.models:
            config = model.config
            if tokenizer.vocab_size > min(config.src_vocab_size, config.tgt_vocab_size):
                raise CheckpointError(
                    f"the tokenizer has {tokenizer.vocab_size} pieces but the model's "
                    f"vocabularies have {config.src_vocab_size} (source) and "
                    f"{config.tgt_vocab_size} (target)"
                )
            if config.pad_id != PAD_ID:
                raise CheckpointError(f"the model's pad_id ({config.pad_id}) must be {PAD_ID}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserValueError(f"max_tokens ({max_tokens!r}) must be a positive integer")
        self.backend = backend
        self.models: list[Any] = list(backend.models)
        self.model = self.models[0]
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.metadata = dict(metadata)
        self.model_dirs = list(model_dirs)
        self.model_dir = self.model_dirs[0] if self.model_dirs else None
        self.device = backend.device
        self.source_limits = SourceLimits.of(model.config for model in self.models)
        self.workers, self.worker_threads = 1, 1  # the constructor's may differ

    @property
    def returns_attention(self) -> bool:
        """Whether ``translate(..., return_attention=True)`` can give attention maps: one
        PyTorch model can; an ensemble, an ONNX or a CTranslate2 export cannot."""
        return self.backend.returns_attention

    def batches(
        self, sentences: Sequence[str], options: DecodingOptions | None = None
    ) -> list[list[int]]:
        """The batches :meth:`translate` decodes ``sentences`` in, as lists of their indices,
        in the order it runs them (blank sentences are in none): for a caller that acts
        between batches, as training's validation asks between them whether to stop."""
        options = options or DecodingOptions()
        sources = self._prepare(list(sentences), options, first_number=1, warn=False)
        return [[source.index for source in batch] for batch in self._batches(sources, options)]

    # -- the public API ------------------------------------------------------------------------

    def translate(
        self,
        sentences: Sequence[str],
        options: DecodingOptions | None = None,
        *,
        return_attention: bool | Sequence[str] = False,
        seed: int | None = None,
        progress: Callable[[int], None] | None = None,
        **overrides: Any,
    ) -> list[TranslationResult]:
        """Translates sentences; returns one result per sentence, in input order.

        The search options are a :class:`~aiayn.decode.search.DecodingOptions` (None: the paper's
        defaults, §6.1) and, in CTranslate2's style, any of its fields as keywords on top:
        ``translate(sentences, beam_size=5, n_best=2)``. The keywords are not spelled out in
        this signature so that the options, their defaults and their checks live in one
        place; an unknown keyword is a TypeError, a value out of range a ValueError naming
        the field.

        Long inputs are truncated, not rejected. A source longer than the model can take,
        ``max_positions − 1`` subword tokens (plus EOS), keeps only its first
        ``max_positions − 1`` tokens, with a logged warning and ``result.truncated`` set. With
        learned positional embeddings (which cannot extend past ``max_positions``) the output
        length is also capped at ``max_positions − 1`` tokens before EOS.

        Args:
            sentences: Plain text, one sentence per entry. Blank entries give an empty result
                without running the model.
            options: How to decode; beam_size 1 selects greedy search, ``sampling`` sampling
                (then ``n_best`` independent samples per sentence, sorted by log-probability).
            return_attention: Fill ``attention`` and ``attention_maps`` (one extra
                teacher-forced pass per batch): True for every kind of map, or the kinds
                to make ("encoder", "decoder", "cross"; the others are None).
            seed: Seed of the sampling generator, for reproducible samples (given the same
                inputs and ``max_tokens``); None uses PyTorch's global generator.
            progress: Called with the number of sentences just finished, after each batch
                (blank sentences count at once), e.g. a progress bar's ``update``.
            **overrides: Fields of :class:`~aiayn.decode.search.DecodingOptions` replacing those of
                ``options``.

        Raises:
            ValueError: An option is out of range.
            TypeError: A keyword is not a field of ``DecodingOptions``.
        """
        options = replace(options or DecodingOptions(), **overrides)
        with self._workers(options, return_attention) as workers:
            return self._translate(
                sentences,
                options,
                return_attention=return_attention,
                seed=seed,
                first_number=1,
                progress=progress,
                workers=workers,
            )

    def translate_iterable(
        self,
        sentences: Iterable[str],
        options: DecodingOptions | None = None,
        *,
        chunk_size: int = 1024,
        return_attention: bool = False,
        seed: int | None = None,
        progress: Callable[[int], None] | None = None,
        **overrides: Any,
    ) -> Iterator[TranslationResult]:
        """Translates a stream (e.g. the lines of a file) chunk by chunk, in input order.

        Reads ``chunk_size`` sentences, translates them with :meth:`translate` (sorting and
        batching within the chunk), yields their results, and goes on, so memory stays bounded.
        Results come a chunk at a time; ``progress`` is called after every batch. Blank lines
        give empty results. Warnings about truncated sentences count sentences from 1 over the
        whole stream, i.e. line numbers.

        Args:
            sentences: Any iterable of sentences.
            options, return_attention, progress, **overrides: As for :meth:`translate`.
            chunk_size: Sentences per chunk; larger chunks sort better.
            seed: As for :meth:`translate`; with sampling, chunk k uses ``seed + k``.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
        options = replace(options or DecodingOptions(), **overrides)
        stream = iter(sentences)
        number = 1
        with self._workers(options, return_attention) as workers:  # one pool for the stream
            for k in itertools.count():
                chunk = list(itertools.islice(stream, chunk_size))
                if not chunk:
                    return
                yield from self._translate(
                    chunk,
                    options,
                    return_attention=return_attention,
                    seed=None if seed is None else seed + k,
                    first_number=number,
                    progress=progress,
                    workers=workers,
                )
                number += len(chunk)

    def score(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[PairScore]:
        """The model's log-probability of each target given its source: no search, one
        teacher-forced pass per batch (fairseq's ``--score-reference``); an ensemble scores
        with the mean of its models' probabilities. See :mod:`aiayn.decode.scoring`.

        Args:
            sources, targets: Line-aligned plain text.
            progress: Called with the number of pairs just scored, after each batch.

        Raises:
            ValueError: The counts differ, or a target is too long for learned positions.
        """
        if isinstance(sources, str) or isinstance(targets, str):
            raise TypeError("score() takes lists of sentences, not single strings")
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        if not self.backend.supports_scoring:
            raise UserValueError("scoring needs the PyTorch model: load the aiayn model directory")
        pairs = zip(sources, targets, strict=True)
        return list(
            self.backend.score(self.tokenizer, pairs, max_tokens=self.max_tokens, progress=progress)
        )

    # -- one call --------------------------------------------------------------------------------

    def _translate(
        self,
        sentences: Sequence[str],
        options: DecodingOptions,
        *,
        return_attention: bool,
        seed: int | None,
        first_number: int,
        progress: Callable[[int], None] | None = None,
        workers: Workers | None = None,
    ) -> list[TranslationResult]:
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        self.backend.check(options, return_attention=return_attention)
        if options.shortlist and (missing := self.backend.shortlist_missing()):
            raise UserValueError(f"shortlist=True, but {missing}")
        sentences = list(sentences)
        results = [empty_result() for _ in sentences]
        sources = self._prepare(sentences, options, first_number)
        if progress is not None and len(sentences) > len(sources):
            progress(len(sentences) - len(sources))  # the blank ones are done
        if not sources:
            return results
        generator = None
        if options.sampling and seed is not None:
            generator = self.backend.seed(seed)
        batches = list(self._batches(sources, options))
        runs: Iterable[list[TranslationResult]]
        if workers is not None:
            runs = workers.map(batches)
        elif self.backend.concurrency > 1 and not options.sampling:
            runs = self._side_by_side(batches, options)
        else:
            runs = (self._run(batch, options, return_attention, generator) for batch in batches)
        for batch, run in zip(batches, runs, strict=True):
            for source, result in zip(batch, run, strict=True):
                results[source.index] = result
            if progress is not None:
                progress(len(batch))
        return results

    def _prepare(
        self, sentences: list[str], options: DecodingOptions, first_number: int, warn: bool = True
    ) -> list[Source]:
        """The non-blank sentences as sources (`aiayn.decode.sources.prepare_sources`)."""
        return prepare_sources(
            self.tokenizer,
            self.source_limits,
            sentences,
            options.max_len_a,
            options.max_len_b,
            first_number=first_number,
            warn=warn,
        )

    def _batches(self, sources: list[Source], options: DecodingOptions) -> Iterator[list[Source]]:
        """Longest first, cut when the padded budget (sentences × the longest's ids × rows
        per sentence) would pass ``max_tokens`` or the length limit changes (search takes one
        ``max_len_a``/``max_len_b`` per batch)."""
        rows = options.rows_per_sentence
        return padded_batches(
            sources,
            lambda source: len(source.ids) * rows,
            self.max_tokens,
            key=lambda source: (source.max_len_a, source.max_len_b),
        )

    def _workers(
        self, options: DecodingOptions, return_attention: bool
    ) -> contextlib.AbstractContextManager[Workers | None]:
        """The worker processes a call decodes in (forked at its first batch but one), or
        None: one process, as for sampling, whose seeded draws follow the batch order."""
        if self.workers < 2 or options.sampling:
            return contextlib.nullcontext()
        from aiayn.decode.workers import Workers

        def run(batch: list[Source]) -> list[TranslationResult]:
            return self._run(batch, options, return_attention, None)

        return Workers(run, workers=self.workers, threads=self.worker_threads)

    def _side_by_side(
        self, batches: list[list[Source]], options: DecodingOptions
    ) -> Iterator[list[TranslationResult]]:
        """Every batch submitted at once to a backend that decodes several side by side
        (CTranslate2 with ``workers``: `CTranslate2Backend.submit`); results in batch order."""
        waits = [
            self.backend.submit([s.ids for s in batch], self._batch_options(batch, options))
            for batch in batches
        ]
        for batch, wait in zip(batches, waits, strict=True):
            yield self._results(batch, wait(), None)

    def _batch_options(self, batch: list[Source], options: DecodingOptions) -> DecodingOptions:
        """`options` with the batch's length limit (one per batch: see `_batches`)."""
        return replace(options, max_len_a=batch[0].max_len_a, max_len_b=batch[0].max_len_b)

    def _results(
        self,
        batch: list[Source],
        nbest: list[list[Hypothesis]],
        maps: Sequence[SentenceAttention | None] | None,
    ) -> list[TranslationResult]:
        """The batch's results, in batch order, from its hypotheses (and attention maps)."""
        maps = maps if maps is not None else [None] * len(batch)
        return [
            translation_result(self.tokenizer, s.ids, hyps, m, truncated=s.truncated)
            for s, hyps, m in zip(batch, nbest, maps, strict=True)
        ]

    def _run(
        self,
        batch: list[Source],
        options: DecodingOptions,
        return_attention: bool,
        generator: torch.Generator | None,
    ) -> list[TranslationResult]:
        """Decodes one batch on the backend and turns the hypotheses into results, in batch
        order."""
        sources = [s.ids for s in batch]
        nbest = self.backend.search(sources, self._batch_options(batch, options), generator)
        maps = None
        if return_attention:
            kinds = None if return_attention is True else tuple(return_attention)
            maps = self.backend.attention(sources, [hyps[0].tokens for hyps in nbest], kinds)
        return self._results(batch, nbest, maps)

    def __repr__(self) -> str:
        where: Any = [str(d) for d in self.model_dirs] or ["in-memory model"]
        where = where[0] if len(where) == 1 else where
        return f"Translator({where!r}, device={str(self.device)!r})"
