"""The CTranslate2 backend: a directory of ``aiayn export --to ctranslate2``, decoded by
CTranslate2's own search.

`Translator` drives it like any backend: the same ``translate`` options and
`TranslationResult`s (``Translator(export_dir)`` builds such a Translator).
Sources go in as pieces, without ``</s>`` (the export sets CTranslate2's ``add_source_eos``);
hypotheses come back as pieces, mapped to aiayn's ids through the export's vocabulary.

What CTranslate2 cannot do is refused with a clear error, not approximated: per-head attention
maps, the GNMT length penalty with beam search (CTranslate2 divides by ``|Y| ** α``, as
aiayn's default ``length_penalty_kind="power"`` does), and ``stopping="exact"``. Beam search
stops by CTranslate2's own rule, aiayn's ``stopping="finished"`` (a sentence is done at
``beam_size`` finished hypotheses), whatever ``stopping`` says: the default, ``"heuristic"``,
is not refused, so that the default options decode. Sampling runs CTranslate2's sampler, so
samples differ from the PyTorch model's for the same seed.

Length limit. aiayn's is per sentence, CTranslate2's per call: each batch is one call at the
batch's largest limit (+ 1 step for EOS), and a hypothesis that runs past its own sentence's
limit is cut to it afterwards (`CTranslate2Backend.search`). Outputs that end before their
limit are CTranslate2's; at the limit, beam search can pick another hypothesis than aiayn's
search, which forces EOS there during the search.

Threads. ``threads`` are the CPU threads of the whole translator. With ``workers`` > 1 they are
shared among that many translators of CTranslate2's (``inter_threads``, ``intra_threads`` =
threads / workers): `Translator` then submits every batch of a call at once
(`CTranslate2Backend.submit`) and CTranslate2 decodes as many side by side as it has
translators, which is what its own API does with ``inter_threads`` (faster than one translator
on two threads: BENCHMARKS.md, Translating a file). The outputs are those of one translator:
each batch is still one call. Sampling submits one batch at a time. In a process where PyTorch
has already run on several threads, CTranslate2 decodes 1.15-1.9x slower (both run OpenMP
threads, more of them than cores; docs/interop.md): give PyTorch one thread before any PyTorch
work (``aiayn.runtime.configure(threads=1)``, as ``aiayn translate --backend ctranslate2`` does
before it converts a model directory), or translate in a process of its own. This module, and
`Translator` over it, import no torch: with an export, or a model directory whose export is
cached, the command never loads PyTorch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import ModelConfig
from aiayn.decode.backends import AIAYN_FILE, EXTRA_POSITIONS, VMAP_FILE, Backend, ExportedModel
from aiayn.decode.options import DecodingOptions, max_output_length
from aiayn.decode.results import Hypothesis
from aiayn.errors import CheckpointError, CorruptCheckpointError, UserValueError, first_line
from aiayn.extras import require
from aiayn.runtime import auto_device
from aiayn.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SOURCE_SPM_FILE,
    VOCAB_FILE,
    SplitTokenizer,
    Tokenizer,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_ERROR", "CTranslate2Backend", "cuda_available", "vocabulary"]


def vocabulary(tokenizer: Tokenizer | SplitTokenizer, size: int) -> list[str]:
    """The piece of every id 0..size-1 (ids past the tokenizer's, if any, get filler names):
    the vocabulary an export registers, and how the backend maps pieces back to ids."""
    pieces = tokenizer.pieces(range(min(size, tokenizer.vocab_size)))
    return pieces + [f"<unused{i}>" for i in range(len(pieces), size)]


def cuda_available() -> bool:
    """Whether CTranslate2 has a CUDA GPU to run on: what ``device="auto"`` asks
    (`aiayn.runtime.auto_device`). CTranslate2's own count, not PyTorch's: its wheel has CUDA
    where PyTorch may be a CPU build, and this path imports no torch."""
    [ctranslate2] = require("export", "ctranslate2", needed_by="running a CTranslate2 export")
    return ctranslate2.get_cuda_device_count() > 0


DEVICE_ERROR = re.compile(r"cuda|cublas|cudnn", re.IGNORECASE)
"""What CTranslate2's errors about a GPU it cannot compute on say (its wheel built for another
CUDA than the machine's), as opposed to an export it cannot load."""


class CTranslate2Backend(Backend):
    """A `ctranslate2.Translator` over an export, with the export's tokenizer and config.

    Attributes:
        translator: The `ctranslate2.Translator`.
        tokenizer: The export's tokenizer (``source.spm``, or a split tokenizer's files).
        metadata: The exported model directory's metadata.
        models: One stand-in (`ExportedModel`) holding the exported `ModelConfig`.
        device: The device it runs on ("cpu", "cuda", "cuda:N"), a string: no torch here.
        concurrency: ``workers``: batches decoded side by side (`submit`).
    """

    def __init__(
        self,
        ct2_dir: str | Path,
        *,
        device: str = "cpu",
        compute_type: str = "default",
        threads: int = 0,
        workers: int = 1,
    ) -> None:
        """Loads an export.

        Args:
            ct2_dir: Written by `aiayn.interop.export_ctranslate2`.
            device: "cpu", "cuda" or "cuda:N" (CTranslate2's device and ``device_index``), or
                "auto": a GPU where CTranslate2 counts one (`cuda_available`), else the CPU. On
                a GPU, one step on one token is decoded at once, so that a GPU CTranslate2
                cannot compute on raises here (a ``RuntimeError``, CTranslate2's).
            compute_type: CTranslate2's compute type ("default" = as stored, "int8",
                "float32", ...).
            threads: CPU threads in all; 0 = CTranslate2's default (``intra_threads`` 0) with
                one worker, one thread per worker with more.
            workers: CTranslate2's ``inter_threads``: how many batches it decodes at once,
                each on ``threads / workers`` threads of its own (`submit`).

        Raises:
            CheckpointError: The directory has no readable ``aiayn.json``.
            UserValueError: ``workers`` is not a positive integer.
        """
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise UserValueError(f"workers ({workers!r}) must be a positive integer")
        [self._ctranslate2] = require(
            "export", "ctranslate2", needed_by="running a CTranslate2 export"
        )
        directory = Path(ct2_dir)
        try:
            aiayn = json.loads((directory / AIAYN_FILE).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"{directory} is not an aiayn CTranslate2 export (no readable {AIAYN_FILE}: "
                f"{error}); write one with export_ctranslate2"
            ) from None
        config = ModelConfig.from_dict(aiayn["config"])
        if aiayn["tokenizer"] == "split":
            self.tokenizer: Tokenizer | SplitTokenizer = SplitTokenizer.load(directory / VOCAB_FILE)
        else:
            self.tokenizer = Tokenizer.load(directory / SOURCE_SPM_FILE)
        self.metadata: dict[str, Any] = aiayn.get("metadata", {})
        if device == "auto":
            device = auto_device(cuda_available)
        kind, _, index = device.partition(":")
        try:
            self.translator = self._ctranslate2.Translator(
                str(directory),
                device=kind,
                device_index=int(index or 0),
                compute_type=compute_type,
                intra_threads=threads if workers == 1 else max(1, threads // workers),
                inter_threads=workers,
            )
        except ValueError as error:  # a compute type it does not know, or cannot run there
            raise UserValueError(
                f"compute_type ({compute_type!r}) on {device}: {first_line(error)}"
            ) from None
        except RuntimeError as error:
            reason = first_line(error)
            if DEVICE_ERROR.search(reason):
                raise  # the device's, not the export's (the CLI may fall back to the CPU)
            raise CorruptCheckpointError(
                f"{directory}: CTranslate2 cannot load this export ({reason}); write it again "
                "with aiayn export --to ctranslate2"
            ) from None
        self.concurrency = workers  # batches decoded at once (see `submit`)
        self.has_vmap = (directory / VMAP_FILE).is_file()  # the model's lexical shortlist
        self._token_ids: dict[str, int] = {}
        for i, piece in enumerate(vocabulary(self.tokenizer, config.tgt_vocab_size)):
            self._token_ids.setdefault(piece, i)
        self.device = device  # CTranslate2's name for it: no torch is imported on this path
        self.models = [ExportedModel(config, self.device)]
        if kind != "cpu":
            self._first_product()

    def _first_product(self) -> None:
        """One decoding step on one token, so that a GPU CTranslate2 cannot compute on fails
        here rather than at the first sentence: CTranslate2 opens cuBLAS at its first matrix
        product, not when it loads the model (a wheel built for CUDA 12 on a CUDA 13 machine
        loads, then raises "libcublas.so.12 is not found")."""
        piece = next(iter(self._token_ids))
        self.translator.translate_batch([[piece]], beam_size=1, max_decoding_length=1)

    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        if return_attention:
            raise UserValueError(
                "the CTranslate2 backend cannot return per-head attention maps "
                "(return_attention=True); use Translator on the aiayn model directory"
            )
        beam = not options.sampling and options.beam_size > 1
        if beam and options.stopping == "exact":
            raise UserValueError(
                "CTranslate2 ends a sentence's beam search at beam_size finished hypotheses "
                "(stopping='finished'); it has no exact stopping rule (stopping='exact')"
            )
        if beam and options.length_penalty_kind == "gnmt" and options.length_penalty != 0:
            raise UserValueError(
                "CTranslate2 ranks beam hypotheses by log_prob / |Y| ** α, not GNMT's "
                "((5 + |Y|) / 6) ** α: pass length_penalty_kind='power' (or length_penalty=0)"
            )

    def shortlist_missing(self) -> str | None:
        if self.has_vmap:
            return None
        return (
            f"the export has no {VMAP_FILE} (its model had no lexical shortlist: add one with "
            "aiayn shortlist and export again)"
        )

    def seed(self, seed: int) -> None:
        """Seeds CTranslate2's own sampler (it takes no generator).

        CTranslate2 seeds each of its threads' generators once, when the thread first draws:
        a seed gives the same samples in a fresh process, not a second time in the same one.
        """
        self._ctranslate2.set_random_seed(seed)

    def search(
        self,
        sources: list[list[int]],
        options: DecodingOptions,
        generator: torch.Generator | None,
    ) -> list[list[Hypothesis]]:
        """Each source's n-best hypotheses, from one CTranslate2 call for the whole batch.

        aiayn's output-length limit is per sentence (`max_output_length` tokens, then EOS);
        CTranslate2 takes one per call (``max_decoding_length``, in steps, EOS counting as
        one). The call gets the batch's largest limit + 1 steps, so that any sentence may
        end with EOS right after its limit's tokens; then a hypothesis longer than its own
        sentence's limit is cut to it (`_cut_to_limits`). One call per distinct limit would
        make a batch of sentences of many lengths into many small calls (BENCHMARKS.md: 1.48x
        the time of CTranslate2's own API on the same export).
        """
        return self.submit(sources, options)()

    def submit(
        self, sources: list[list[int]], options: DecodingOptions
    ) -> Callable[[], list[list[Hypothesis]]]:
        """Starts decoding a batch (as `search` does) and returns at once a function that
        waits for its hypotheses. Batches submitted one after another are decoded side by
        side, as many at a time as the backend has ``workers``."""
        limits = [
            max_output_length(len(ids), options.max_len_a, options.max_len_b) for ids in sources
        ]
        positions = self.models[0].config.max_positions + EXTRA_POSITIONS  # the export's table
        if max(limits) + 1 > positions:
            raise UserValueError(
                f"outputs of up to {max(limits) + 1} positions, but the export's positional "
                f"table has {positions}: lower max_len_a/max_len_b"
            )
        tokens = [self.tokenizer.pieces(ids[:-1]) for ids in sources]  # CTranslate2 adds </s>
        kwargs: dict[str, Any] = dict(
            max_decoding_length=max(limits) + 1,  # + EOS
            min_decoding_length=options.min_len,  # tokens before EOS may come, as aiayn's
            return_scores=True,
            max_batch_size=0,
            suppress_sequences=[[piece] for piece in self.tokenizer.pieces([PAD_ID, BOS_ID])],
            use_vmap=options.shortlist and self.has_vmap,  # the model's shortlist (vmap.txt)
        )
        alpha = 0.0 if options.length_penalty_kind == "none" else options.length_penalty
        if options.sampling:
            n = options.n_best
            tokens = [t for t in tokens for _ in range(n)]
            limits = [limit for limit in limits for _ in range(n)]
            kwargs |= dict(
                beam_size=1,
                sampling_topk=options.top_k,
                sampling_topp=options.top_p,
                sampling_temperature=options.temperature,
            )
        else:
            n = 1
            kwargs |= dict(
                beam_size=options.beam_size,
                num_hypotheses=options.n_best,
                length_penalty=alpha if options.beam_size > 1 else 0.0,
            )
        pending = self.translator.translate_batch(tokens, asynchronous=True, **kwargs)

        def hypotheses() -> list[list[Hypothesis]]:
            outputs = [output.result() for output in pending]
            alpha = kwargs.get("length_penalty", 0.0)
            hyps = self._cut_to_limits(tokens, outputs, limits, alpha)
            if n > 1:
                hyps = [
                    sorted(
                        (h for hs in hyps[i * n : (i + 1) * n] for h in hs), key=lambda h: -h.score
                    )
                    for i in range(len(sources))
                ]
            return hyps

        return hypotheses

    def _cut_to_limits(
        self, tokens: list[list[str]], outputs: list[Any], limits: list[int], alpha: float
    ) -> list[list[Hypothesis]]:
        """Each output row's hypotheses, a hypothesis longer than the row's limit cut to it.

        A cut hypothesis ends as aiayn's search ends one at its limit: its first ``limit``
        tokens, then EOS, ``log_prob`` counting those tokens and EOS (CTranslate2's
        ``score_batch``, one call for all the cut ones, without the renormalisation over the
        banned ``<pad>``/``<s>``, as aiayn's), ``score`` = ``log_prob / (limit + 1) ** α``.
        Only which hypothesis comes out can differ from aiayn's search, and only for outputs
        that reach the limit: aiayn forces EOS there during the search, so in beam search the
        forced ending competes with the other hypotheses, where here CTranslate2 ranked the
        longer hypothesis that was cut afterwards. Greedy search picks each token alone, so
        its cut outputs are aiayn's. The hypotheses of a row with a cut one are ranked by
        score again, and one that repeats a better one's tokens is dropped (an n-best list
        can come out shorter).
        """
        hyps = [
            [
                self._hypothesis(pieces, score, alpha)
                for pieces, score in zip(out.hypotheses, out.scores, strict=True)
            ]
            for out in outputs
        ]
        cut = [
            (row, rank)
            for row, limit in enumerate(limits)
            for rank, hyp in enumerate(hyps[row])
            if len(hyp.tokens) > limit
        ]
        if not cut:
            return hyps
        kept = [hyps[row][rank].tokens[: limits[row]] for row, rank in cut]
        scored = self.translator.score_batch(
            [tokens[row] for row, _ in cut],
            [self.tokenizer.pieces(ids) for ids in kept],
            max_batch_size=0,
        )
        for (row, rank), ids, result in zip(cut, kept, scored, strict=True):
            log_prob = float(sum(result.log_probs))  # the kept tokens' and EOS's
            hyps[row][rank] = Hypothesis(ids, log_prob / float(len(ids) + 1) ** alpha, log_prob)
        for row in sorted({row for row, _ in cut}):
            distinct: dict[tuple[int, ...], Hypothesis] = {}
            for hyp in sorted(hyps[row], key=lambda h: -h.score):
                distinct.setdefault(tuple(hyp.tokens), hyp)
            hyps[row] = list(distinct.values())
        return hyps

    def _hypothesis(self, pieces: list[str], score: float, alpha: float) -> Hypothesis:
        ids = [self._token_ids.get(p, 1) for p in pieces]
        if ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        log_prob = score * float(len(ids) + 1) ** alpha
        return Hypothesis(tokens=ids, score=score, log_prob=log_prob)
