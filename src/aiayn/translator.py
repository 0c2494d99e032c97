"""Translate text with a trained model directory: tokenize, batch, search, detokenize.

:class:`Translator` is the Python API behind ``aiayn translate`` and ``aiayn evaluate`` and the
validation BLEU of training. In the style of CTranslate2, it takes a list of sentences and
keyword-only search options and returns one :class:`TranslationResult` per sentence::

    translator = Translator("runs/en-de/model", device="cuda")
    [result] = translator.translate(["Hello world!"], beam_size=4, return_attention=True)
    result.text, result.score, result.attention  # (T, S) encoder-decoder attention

How a call runs. Each sentence is encoded with the tokenizer and followed by EOS, exactly as
training presents sources (``aiayn.batching.collate``). Blank sentences get an empty result without
running the model. The others are sorted by length, so that a batch holds sentences of similar
length and little padding, grouped into batches of at most ``max_tokens`` padded source tokens
× rows per sentence (the beam size), decoded with :mod:`aiayn.search` under
``torch.inference_mode()``, and returned in input order.

Shapes: S source length (EOS included), T output length (EOS included), L layers, H heads.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from aiayn import search
from aiayn.acceleration import native_bf16_cpu
from aiayn.checkpoint import CheckpointError, load_model_dir, unwrap
from aiayn.data import decode_line
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "SentenceAttention",
    "TranslationHypothesis",
    "TranslationResult",
    "Translator",
    "one_line",
    "read_lines",
]


def quantize_int8(model: Transformer) -> Transformer:
    """A copy of `model` whose `nn.Linear` layers hold int8 weights (dynamic quantization).

    Attention, layer norms and embeddings stay float32; the pre-softmax projection is quantized
    like every other linear layer (in the copy it no longer shares storage with the embedding).
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its successor
        return torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=False
        )


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SentenceAttention:
    """Every attention map of one sentence, without padding, for pictures and alignments.

    Computed by one teacher-forced ``Transformer.forward_with_attention`` pass over the source
    and ``[BOS] + output``; because decoder self-attention is causal (§3.2.3), these are the
    probabilities incremental decoding used for the best hypothesis.

    Attributes:
        encoder: (L, H, S, S) encoder self-attention.
        decoder: (L, H, T, T) masked decoder self-attention; row t is the input position whose
            next token is output token t (row 0 is BOS).
        cross: (L, H, T, S) encoder-decoder attention.
    """

    encoder: Tensor
    decoder: Tensor
    cross: Tensor


@dataclass(frozen=True)
class TranslationHypothesis:
    """One entry of the n-best list.

    Attributes:
        text: Detokenized output.
        tokens: Output subword pieces, without EOS.
        token_ids: Output ids, without BOS and EOS.
        score: Ranking score: ``log_prob`` divided by the length penalty (beam search), or
            ``log_prob`` itself (greedy search and sampling).
        log_prob: Model log-probability of the tokens and the final EOS.
    """

    text: str
    tokens: list[str]
    token_ids: list[int]
    score: float
    log_prob: float


@dataclass(frozen=True)
class TranslationResult:
    """The translation of one input sentence; ``text``, ``score``, ... are the best hypothesis'.

    Attributes:
        text: Detokenized best output ("" for a blank input).
        tokens: Its subword pieces, without EOS.
        token_ids: Its ids, without BOS and EOS.
        score: Its ranking score (see :class:`TranslationHypothesis`); 0 for a blank input.
        log_prob: Its log-probability; 0 for a blank input.
        hypotheses: The n-best list, best first; ``hypotheses[0]`` is the best. A blank input
            has a single empty hypothesis.
        src_tokens: Source pieces fed to the model, ``</s>`` included (after truncation).
        tgt_tokens: Output pieces, ``</s>`` included: the labels of ``attention``'s rows.
        attention: (T, S) encoder-decoder attention of the last decoder layer averaged over
            heads, for the best hypothesis; only with ``return_attention=True``.
        attention_maps: Every layer's and head's maps; only with ``return_attention=True``.
        truncated: The source was longer than the model accepts and was cut.
    """

    text: str
    tokens: list[str]
    token_ids: list[int]
    score: float
    log_prob: float
    hypotheses: list[TranslationHypothesis]
    src_tokens: list[str] = field(default_factory=list)
    tgt_tokens: list[str] = field(default_factory=list)
    attention: Tensor | None = None
    attention_maps: SentenceAttention | None = None
    truncated: bool = False


def _empty_result() -> TranslationResult:
    empty = TranslationHypothesis(text="", tokens=[], token_ids=[], score=0.0, log_prob=0.0)
    return TranslationResult(
        text="", tokens=[], token_ids=[], score=0.0, log_prob=0.0, hypotheses=[empty]
    )


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SearchOptions:
    """The keyword options of :meth:`Translator.translate`, validated once per call."""

    beam_size: int = 4
    length_penalty: float = 0.6
    length_penalty_kind: str = "gnmt"
    max_len_a: float = 1.0
    max_len_b: float = 50
    n_best: int = 1
    return_attention: bool = False
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        search.length_penalty_fn(self.length_penalty_kind)  # raises on an unknown kind
        if isinstance(self.beam_size, bool) or not isinstance(self.beam_size, int):
            raise ValueError(f"beam_size ({self.beam_size!r}) must be an integer")
        if self.beam_size < 1:
            raise ValueError(f"beam_size ({self.beam_size}) must be >= 1")
        if isinstance(self.n_best, bool) or not isinstance(self.n_best, int) or self.n_best < 1:
            raise ValueError(f"n_best ({self.n_best!r}) must be an integer >= 1")
        if not self.sampling and self.n_best > self.beam_size:
            raise ValueError(
                f"n_best ({self.n_best}) must be <= beam_size ({self.beam_size}); "
                "raise the beam size or use sampling"
            )
        if not self.length_penalty >= 0:
            raise ValueError(f"length_penalty ({self.length_penalty}) must be >= 0")
        if self.sampling:
            if not self.temperature > 0:
                raise ValueError(f"temperature ({self.temperature}) must be > 0")
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
                raise ValueError(f"top_k ({self.top_k!r}) must be an integer >= 0 (0 = no limit)")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p ({self.top_p}) must be in (0, 1] (1 = no limit)")

    @property
    def rows_per_sentence(self) -> int:
        """Decoder rows one sentence occupies: W beams, n_best samples, or 1 for greedy."""
        if self.sampling:
            return self.n_best
        return self.beam_size


@dataclass(frozen=True)
class _Source:
    """One non-blank input sentence, ready for the model."""

    index: int  # position in the input
    ids: list[int]  # source ids + EOS
    max_len_a: float  # output length limit of this sentence (see Translator._length_limit)
    max_len_b: float
    truncated: bool


# --------------------------------------------------------------------------------------------
# The translator
# --------------------------------------------------------------------------------------------


class Translator:
    """A model and its tokenizer, ready to translate batches of sentences.

    Attributes:
        model: The `Transformer` (evaluation mode while translating).
        tokenizer: The shared source/target SentencePiece model.
        device: Where the model runs.
        max_tokens: Batch budget: padded source tokens × rows per sentence (beam size).
        metadata: The model directory's ``metadata.json`` (languages, step, ...), or {}.
        model_dir: The directory loaded, or None for :meth:`from_model`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        max_tokens: int = 4096,
        threads: int = 0,
        int8: bool = False,
        bf16: bool = False,
    ) -> None:
        """Loads a model directory (or a run directory's ``model/``), checksums verified.

        Args:
            model_dir: Written by training, ``aiayn average`` or ``save_model_dir``.
            device: "cpu", "cuda", "cuda:1", ...
            max_tokens: Batch budget in padded source tokens × beam size. A sentence that alone
                exceeds it is translated in a batch of its own.
            threads: CPU threads for PyTorch (``torch.set_num_threads``, which is process-wide);
                0 leaves PyTorch's default.
            int8: Quantize every linear layer to int8 weights with dynamic int8 activations
                (``torch.ao.quantization.quantize_dynamic``), CPU only: faster, slightly
                different outputs (BENCHMARKS.md states the measured difference).
            bf16: Run the model in bfloat16 (weights and activations; log-probabilities are
                still computed in float32): about 1.6x faster on CPUs with native bf16
                (AVX512-BF16, AMX) and on GPUs, slightly different outputs (BENCHMARKS.md).

        Raises:
            CheckpointError: The directory is missing or incomplete (e.g. no model.safetensors),
                a file is corrupt, or the tokenizer does not fit the model.
            TokenizerError: The tokenizer model cannot be read.
        """
        if threads < 0:
            raise ValueError(f"threads ({threads}) must be >= 0 (0 = PyTorch's default)")
        if threads > 0:
            torch.set_num_threads(threads)
        if int8 and torch.device(device).type != "cpu":
            raise ValueError(f"int8 dynamic quantization runs on the CPU only, not on {device}")
        if int8 and bf16:
            raise ValueError("choose one of int8 and bf16")
        loaded = load_model_dir(model_dir, device=device)
        tokenizer = Tokenizer.load(loaded.tokenizer_file)
        model = loaded.model
        if int8:
            model = quantize_int8(model)
        elif bf16:
            if torch.device(device).type == "cpu" and not native_bf16_cpu():
                logger.warning("this CPU has no native bf16 arithmetic: bf16 will be slower")
            model = model.to(torch.bfloat16)
        self._setup(model, tokenizer, max_tokens, loaded.metadata, loaded.directory)

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer: Tokenizer, *, max_tokens: int = 4096
    ) -> Translator:
        """A translator over an in-memory model (e.g. during training, for validation BLEU).

        The model stays where it is (device, dtype). DDP and ``torch.compile`` wrappers are
        looked through. ``translate`` switches the model to evaluation mode and restores its
        previous mode afterwards, so a training loop can call it between updates.
        """
        translator = cls.__new__(cls)
        translator._setup(unwrap(model), tokenizer, max_tokens, {}, None)
        return translator

    def _setup(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        max_tokens: int,
        metadata: dict[str, Any],
        model_dir: Path | None,
    ) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"expected an aiayn Transformer, got {type(model).__name__}")
        config = model.config
        if tokenizer.vocab_size > min(config.src_vocab_size, config.tgt_vocab_size):
            raise CheckpointError(
                f"the tokenizer has {tokenizer.vocab_size} pieces but the model's vocabularies "
                f"have {config.src_vocab_size} (source) and {config.tgt_vocab_size} (target)"
            )
        if config.pad_id != PAD_ID:
            raise CheckpointError(f"the model's pad_id ({config.pad_id}) must be {PAD_ID}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens ({max_tokens!r}) must be a positive integer")
        self.model: Transformer = model
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.metadata = dict(metadata)
        self.model_dir = model_dir
        self.device = next(model.parameters()).device

    @property
    def max_source_tokens(self) -> int:
        """Longest source the model accepts, in subword tokens before EOS: max_positions − 1."""
        return self.model.config.max_positions - 1

    def cost(
        self,
        sentences: Sequence[str],
        rows_per_sentence: int,
        *,
        max_len_a: float | None = None,
        max_len_b: float | None = None,
    ) -> int:
        """Source tokens the model will see (after truncation, EOS included) × decoder rows
        per sentence (the beam size, or the samples): the unit of a batch budget. With
        ``max_len_a`` and ``max_len_b``, also × the most output tokens (EOS included) the
        search may run: a bound on the work of a call, whatever the model prefers.

        It follows :meth:`_prepare`'s rules (blank sentences cost nothing, long ones count
        as truncated) and the search's length limit, so that a caller that budgets work, such
        as the server, cannot drift from what :meth:`translate` runs.
        """
        if max_len_a is None and max_len_b is None:
            texts = [text for text in (s.strip() for s in sentences) if text]
            lengths = (len(ids) for ids in self.tokenizer.encode_batch(texts))
            return rows_per_sentence * sum(min(n, self.max_source_tokens) + 1 for n in lengths)
        a = 1.0 if max_len_a is None else max_len_a
        b = 50.0 if max_len_b is None else max_len_b
        bounds = self.search_bounds(sentences, max_len_a=a, max_len_b=b)
        return rows_per_sentence * sum(s * t for s, t in bounds)

    def search_bounds(
        self, sentences: Sequence[str], *, max_len_a: float = 1.0, max_len_b: float = 50
    ) -> list[tuple[int, int]]:
        """(S, T) per sentence, as the search will see it: source tokens after truncation and
        the most output tokens, both with EOS; (0, 0) for a blank sentence.

        T is ``int(a * S + b)`` (at least 0) plus EOS, the rule of the search
        (``search._max_output_lengths``), under :meth:`_length_limit`'s cap. S × T bounds a
        sentence's attention map, and S × T × rows the work of its search.
        """
        texts = [s.strip() for s in sentences]
        encoded = iter(self.tokenizer.encode_batch([text for text in texts if text]))
        bounds = []
        for text in texts:
            if not text:
                bounds.append((0, 0))
                continue
            src_len = min(len(next(encoded)), self.max_source_tokens) + 1
            a, b = self._length_limit(src_len, max_len_a, max_len_b)
            bounds.append((src_len, max(0, int(a * src_len + b)) + 1))
        return bounds

    # -- the public API ------------------------------------------------------------------------

    def translate(
        self,
        sentences: Sequence[str],
        *,
        beam_size: int = 4,
        length_penalty: float = 0.6,
        length_penalty_kind: str = "gnmt",
        max_len_a: float = 1.0,
        max_len_b: float = 50,
        n_best: int = 1,
        return_attention: bool = False,
        sampling: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[TranslationResult]:
        """Translates sentences; returns one result per sentence, in input order.

        Long inputs are truncated, not rejected. A source longer than the model can take,
        ``max_positions − 1`` subword tokens (plus EOS), keeps only its first
        ``max_positions − 1`` tokens, with a logged warning and ``result.truncated`` set. With
        learned positional embeddings (which cannot extend past ``max_positions``) the output
        length is also capped at ``max_positions − 1`` tokens before EOS.

        Args:
            sentences: Plain text, one sentence per entry. Blank entries give an empty result
                without running the model.
            beam_size: W; 1 selects greedy search (§6.1 uses 4).
            length_penalty: α of the length penalty (§6.1: 0.6).
            length_penalty_kind: "gnmt" (the paper's ``((5 + |Y|) / 6) ** α``), "power"
                (``|Y| ** α``) or "none".
            max_len_a: The output may have up to ``int(max_len_a * S + max_len_b)`` tokens
                before EOS, S being the source length with EOS (§6.1: input length + 50).
            max_len_b: See ``max_len_a``.
            n_best: Hypotheses per sentence in ``result.hypotheses`` (≤ beam_size; with
                sampling, the number of independent samples, sorted by log-probability).
            return_attention: Fill ``attention`` and ``attention_maps`` (one extra
                teacher-forced pass per batch).
            sampling: Sample (ancestral sampling) instead of searching; ``beam_size`` and the
                length penalty are then unused.
            temperature: Sampling temperature (> 0).
            top_k: Sample among the k most probable tokens; 0 = no limit.
            top_p: Nucleus sampling threshold in (0, 1]; 1 = no limit.
            seed: Seed of the sampling generator, for reproducible samples (given the same
                inputs and ``max_tokens``); None uses PyTorch's global generator.

        Raises:
            ValueError: An option is out of range.
        """
        options = _SearchOptions(
            beam_size=beam_size,
            length_penalty=length_penalty,
            length_penalty_kind=length_penalty_kind,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            n_best=n_best,
            return_attention=return_attention,
            sampling=sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        return self._translate(sentences, options, first_number=1)

    def translate_iterable(
        self, sentences: Iterable[str], *, chunk_size: int = 1024, **options: Any
    ) -> Iterator[TranslationResult]:
        """Translates a stream (e.g. the lines of a file) chunk by chunk, in input order.

        Reads ``chunk_size`` sentences, translates them with :meth:`translate` (sorting and
        batching within the chunk), yields their results, and goes on, so memory stays bounded
        and a long file shows progress. Blank lines give empty results. Warnings about
        truncated sentences count sentences from 1 over the whole stream, i.e. line numbers.

        Args:
            sentences: Any iterable of sentences.
            chunk_size: Sentences per chunk; larger chunks sort better.
            **options: Any keyword option of :meth:`translate`. With sampling, chunk k uses
                ``seed + k``.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
        base = _SearchOptions(**options)
        stream = iter(sentences)
        number = 1
        for k in itertools.count():
            chunk = list(itertools.islice(stream, chunk_size))
            if not chunk:
                return
            seed = None if base.seed is None else base.seed + k
            yield from self._translate(chunk, replace(base, seed=seed), first_number=number)
            number += len(chunk)

    # -- one call --------------------------------------------------------------------------------

    def _translate(
        self, sentences: Sequence[str], options: _SearchOptions, first_number: int
    ) -> list[TranslationResult]:
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        sentences = list(sentences)
        results = [_empty_result() for _ in sentences]
        sources = self._prepare(sentences, options, first_number)
        if not sources:
            return results
        generator = None
        if options.sampling and options.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(options.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for batch in self._batches(sources, options):
                    for source, result in zip(
                        batch, self._run(batch, options, generator), strict=True
                    ):
                        results[source.index] = result
        finally:
            self.model.train(was_training)
        return results

    def _prepare(
        self, sentences: list[str], options: _SearchOptions, first_number: int
    ) -> list[_Source]:
        """Encodes the non-blank sentences, + EOS, truncated to what the model accepts."""
        texts = [s.strip() for s in sentences]
        indices = [i for i, text in enumerate(texts) if text]
        encoded = self.tokenizer.encode_batch([texts[i] for i in indices])
        limit = self.max_source_tokens
        sources = []
        for i, ids in zip(indices, encoded, strict=True):
            truncated = len(ids) > limit
            if truncated:
                logger.warning(
                    "sentence %d has %d tokens, more than the model accepts "
                    "(max_positions - 1 = %d); translating only its first %d tokens",
                    first_number + i,
                    len(ids),
                    limit,
                    limit,
                )
                ids = ids[:limit]
            src_ids = [*ids, EOS_ID]
            max_len_a, max_len_b = self._length_limit(
                len(src_ids), options.max_len_a, options.max_len_b
            )
            sources.append(_Source(i, src_ids, max_len_a, max_len_b, truncated))
        return sources

    def _length_limit(self, src_len: int, a: float, b: float) -> tuple[float, float]:
        """(max_len_a, max_len_b) for one source: the caller's, or a hard cap of
        max_positions − 1 output tokens when learned positions could not go further (the
        decoder then sees BOS + max_positions − 1 tokens = max_positions positions)."""
        config = self.model.config
        if config.positional_encoding != "learned":
            return a, b
        cap = config.max_positions - 1
        if int(a * src_len + b) > cap:
            return 0.0, float(cap)
        return a, b

    def _batches(self, sources: list[_Source], options: _SearchOptions) -> Iterator[list[_Source]]:
        """Longest first, cut when the padded budget would be exceeded or the length limit
        changes (search takes one ``max_len_a``/``max_len_b`` per batch)."""
        rows = options.rows_per_sentence
        ordered = sorted(sources, key=lambda s: -len(s.ids))
        batch: list[_Source] = []
        for source in ordered:
            if batch:
                width = len(batch[0].ids)  # the longest, since sorted
                over = (len(batch) + 1) * width * rows > self.max_tokens
                limit_changed = (source.max_len_a, source.max_len_b) != (
                    batch[0].max_len_a,
                    batch[0].max_len_b,
                )
                if over or limit_changed:
                    yield batch
                    batch = []
            batch.append(source)
        if batch:
            yield batch

    def _run(
        self,
        batch: list[_Source],
        options: _SearchOptions,
        generator: torch.Generator | None,
    ) -> list[TranslationResult]:
        """Searches one batch and turns the hypotheses into results, in batch order."""
        src = _pad([s.ids for s in batch], self.device)  # (B, S)
        ids = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
        lengths = {"max_len_a": batch[0].max_len_a, "max_len_b": batch[0].max_len_b}
        if options.sampling:
            n = options.n_best
            samples = search.sample(
                self.model,
                src.repeat_interleave(n, dim=0),
                temperature=options.temperature,
                top_k=options.top_k,
                top_p=options.top_p,
                generator=generator,
                **ids,
                **lengths,
            )
            nbest = [
                sorted(samples[i * n : (i + 1) * n], key=lambda h: -h.score)
                for i in range(len(batch))
            ]
        elif options.beam_size == 1:
            nbest = [[h] for h in search.greedy_search(self.model, src, **ids, **lengths)]
        else:
            nbest = search.beam_search(
                self.model,
                src,
                beam_size=options.beam_size,
                length_penalty=options.length_penalty,
                length_penalty_kind=options.length_penalty_kind,
                n_best=options.n_best,
                **ids,
                **lengths,
            )
        maps: list[SentenceAttention | None] = [None] * len(batch)
        if options.return_attention:
            maps = self._attention(src, batch, [hyps[0].tokens for hyps in nbest])
        return [
            self._result(source, hyps, attention)
            for source, hyps, attention in zip(batch, nbest, maps, strict=True)
        ]

    def _attention(
        self, src: Tensor, batch: list[_Source], outputs: list[list[int]]
    ) -> list[SentenceAttention | None]:
        """One teacher-forced pass over ``[BOS] + output`` for the whole batch, cut per sentence.

        Target padding on the right changes nothing before it, as decoder self-attention is
        causal; source padding is masked.
        """
        tgt = _pad([[BOS_ID, *tokens] for tokens in outputs], self.device)  # (B, T)
        _, maps = self.model.forward_with_attention(src, tgt)
        encoder, decoder, cross = (
            m.float().cpu() for m in (maps.encoder, maps.decoder, maps.cross)
        )
        cut: list[SentenceAttention | None] = []
        for row, (source, tokens) in enumerate(zip(batch, outputs, strict=True)):
            s, t = len(source.ids), len(tokens) + 1
            cut.append(
                SentenceAttention(
                    encoder=encoder[:, row, :, :s, :s],  # (L, H, S, S)
                    decoder=decoder[:, row, :, :t, :t],  # (L, H, T, T)
                    cross=cross[:, row, :, :t, :s],  # (L, H, T, S)
                )
            )
        return cut

    def _result(
        self,
        source: _Source,
        hyps: list[search.Hypothesis],
        maps: SentenceAttention | None,
    ) -> TranslationResult:
        candidates = [
            TranslationHypothesis(
                text=self.tokenizer.decode(h.tokens),
                tokens=self.tokenizer.pieces(h.tokens),
                token_ids=list(h.tokens),
                score=h.score,
                log_prob=h.log_prob,
            )
            for h in hyps
        ]
        best = candidates[0]
        return TranslationResult(
            text=best.text,
            tokens=best.tokens,
            token_ids=best.token_ids,
            score=best.score,
            log_prob=best.log_prob,
            hypotheses=candidates,
            src_tokens=self.tokenizer.pieces(source.ids),
            tgt_tokens=self.tokenizer.pieces([*best.token_ids, EOS_ID]),
            attention=None if maps is None else maps.cross[-1].mean(dim=0),  # (T, S)
            attention_maps=maps,
            truncated=source.truncated,
        )

    def __repr__(self) -> str:
        where = self.model_dir if self.model_dir is not None else "in-memory model"
        return f"Translator({str(where)!r}, device={str(self.device)!r})"


def _pad(rows: list[list[int]], device: torch.device) -> Tensor:
    """Right-pads id lists into a (B, max length) long tensor."""
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


# --------------------------------------------------------------------------------------------
# Reading and writing lines
# --------------------------------------------------------------------------------------------


def read_lines(source: str | Path | BinaryIO, name: str | None = None) -> Iterator[str]:
    """Yields the lines of a UTF-8 file or binary stream, without their line endings.

    Lines are split on ``\\n`` bytes only (as ``wc -l`` and ``aiayn.data.count_lines`` do),
    and a UTF-8 byte-order mark on the first line is dropped.

    Args:
        source: A path, or an open binary stream such as ``sys.stdin.buffer``.
        name: How messages name a stream (default: its ``name`` attribute).

    Raises:
        DataError: A line is not valid UTF-8; the message names the file and 1-based line.
        FileNotFoundError: The path does not exist.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"input file {path} does not exist")
        with path.open("rb") as f:
            yield from read_lines(f, name=str(path))
        return
    label = Path(name or getattr(source, "name", "<stream>"))
    for lineno, raw in enumerate(source, start=1):
        yield decode_line(raw, label, lineno).rstrip("\r\n")


def one_line(text: str) -> str:
    """``text`` with line breaks replaced by spaces, so one output line per input line holds
    even if the model generated a newline (possible through byte-fallback pieces)."""
    return text.replace("\r", " ").replace("\n", " ")
