"""Decoding: beam search with a length penalty (§6.1), greedy search and sampling.

Search sees the model only through :class:`IncrementalModel` (``encode``, ``init_cache``,
``decode_step``) and the decoder cache only through ``reorder``. Expanding a sentence to W beams,
following beams back to their parents and dropping finished sentences are all the same
operation: a selection of cache rows. Every step feeds all live rows of all unfinished sentences
to a single ``decode_step`` call, and the batch shrinks as sentences finish. Beam and greedy
search choose the selection so that few rows move, since the decoder cache copies only the rows
that change (on a CPU): a parent's best child stays in its parent's row
(:func:`_in_parent_rows`), and a finished sentence's rows are refilled from the back of the
batch (:func:`_survivors`). Between steps, the order of beams and sentences means nothing;
sampling keeps its sentences in input order, so that a seeded generator draws the same numbers.

Options. :class:`DecodingOptions` holds every search option with the paper's defaults and
validates them once; the strategies, :class:`aiayn.decode.translator.Translator`, ``aiayn
translate``'s flags and validation BLEU during training all take their defaults from it. It is
defined in :mod:`aiayn.decode.options`, which imports no torch, so that the CLI builds its flags
fast; so is :class:`Hypothesis`, what a search returns (:mod:`aiayn.decode.results`).

Entry point. :func:`search_with` runs the strategy the options ask for over lists of source ids
(right-padded by :func:`pad`): what the PyTorch and ONNX backends call.

Part of the vocabulary. Given ``vocab``, the sorted target ids a model's steps score (a
shortlist's, :mod:`aiayn.decode.restricted`), every strategy restricts, ranks and samples over
those V' columns and maps the columns it chooses back to ids.

Lengths. The length of a hypothesis counts its generated tokens including EOS (BOS is not
generated). A sentence with ``src_len`` non-pad source tokens may generate
``max_len = int(max_len_a * src_len + max_len_b)`` tokens, at least 0
(:func:`aiayn.decode.options.max_output_length`); the next token is then forced to be EOS, so
the longest hypothesis is ``max_len`` tokens + EOS. The defaults (a = 1, b = 50) are the
paper's "maximum output length of input length + 50" (§6.1). EOS may not be generated before
``min_len`` tokens (fairseq's ``--min-len``; default 1: no empty output), unless ``max_len`` is
shorter: the maximum wins.

Shapes: B sentences in the batch, N of them still unfinished, W beam size, K live beams per
sentence at the current step (1 at the first step, up to W after), V vocabulary, t tokens
generated so far.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from aiayn.decode.options import (
    LENGTH_PENALTIES,
    MAX_FINITE_LENGTH_PENALTY,
    DecodingOptions,
    LengthPenalty,
    gnmt_length_penalty,
    length_penalty_fn,
    max_output_length,
    no_length_penalty,
    power_length_penalty,
)
from aiayn.decode.results import Hypothesis
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

__all__ = [
    "LENGTH_PENALTIES",
    "MAX_FINITE_LENGTH_PENALTY",
    "DecodingOptions",
    "Hypothesis",
    "IncrementalModel",
    "ReorderableCache",
    "beam_search",
    "gnmt_length_penalty",
    "greedy_search",
    "length_penalty_fn",
    "no_length_penalty",
    "pad",
    "power_length_penalty",
    "sample",
    "search_with",
]


# --------------------------------------------------------------------------------------------
# What search needs from a model
# --------------------------------------------------------------------------------------------


class ReorderableCache(Protocol):
    """Per-row decoder state (self-attention K/V so far, cross-attention K/V of the memory)."""

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> ReorderableCache:
        """Keep rows ``index`` (R',) and source sentences ``sentences`` (N',; None: all).

        Row i of the result is row ``index[i]`` (rows may repeat or vanish). Rows stay grouped
        by sentence: with K' = R'/N', rows j·K'..(j+1)·K'-1 are hypotheses of sentence
        ``sentences[j]``. May work in place: only the returned cache is used afterwards.
        """
        ...


class IncrementalModel(Protocol):
    """An encoder-decoder that decodes one target position at a time."""

    def encode(self, src_tokens: Tensor) -> tuple[Any, Tensor | None]:
        """(B, S) source ids -> memory (B, S, D) and src_key_mask (B, S), True = real token.

        Search never looks inside ``memory``, it only hands it to ``init_cache``: an ensemble
        (:mod:`aiayn.decode.ensemble`) passes every model's memory this way.
        """
        ...

    def init_cache(
        self, memory: Any, src_key_mask: Tensor | None, max_len: int
    ) -> ReorderableCache:
        """A cache for up to ``max_len`` target positions (BOS included)."""
        ...

    def decode_step(self, tokens: Tensor, cache: ReorderableCache) -> Tensor:
        """Feed (B,) tokens at position ``cache.length`` (updating the cache in place) and
        return (B, V) float32 log-probabilities of the next token: a new tensor, which the
        search may overwrite (it restricts it in place)."""
        ...


# --------------------------------------------------------------------------------------------
# Pieces shared by every strategy
# --------------------------------------------------------------------------------------------


def _max_output_lengths(
    src_tokens: Tensor, pad_id: int, max_len_a: float, max_len_b: float
) -> Tensor:
    """(B,) number of tokens each sentence may generate before EOS is forced."""
    src_len = src_tokens.ne(pad_id).sum(dim=1).tolist()
    max_len = [max_output_length(n, max_len_a, max_len_b) for n in src_len]
    return torch.tensor(max_len, dtype=torch.long, device=src_tokens.device)


def _never_output(
    bos_id: int,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    *,
    too_short: bool = False,
    vocab: Tensor | None = None,
) -> Tensor:
    """Ids that may never be generated: pad and BOS (unless one of them doubles as EOS); with
    ``too_short`` (a step before ``min_len``), EOS as well. With ``vocab``, their columns among
    the ids it scores (`_columns`; those it lacks cannot be generated anyway)."""
    banned = ({pad_id, bos_id} - {eos_id}) | ({eos_id} if too_short else set())
    ids = torch.tensor(sorted(banned), dtype=torch.long, device=device)
    return ids if vocab is None else _columns(vocab, ids)


def _columns(vocab: Tensor, ids: Tensor) -> Tensor:
    """The columns of ``ids`` among a step's (V',) sorted ``vocab``, leaving out the ids it
    does not hold."""
    at = torch.searchsorted(vocab, ids).clamp(max=vocab.numel() - 1)
    return at[vocab[at].eq(ids)]


def _eos_column(vocab: Tensor | None, eos_id: int) -> int:
    """Where EOS's log-probability lies in a step's scores: its id, or its column in
    ``vocab``, which must hold it (a sentence must be able to end)."""
    if vocab is None:
        return eos_id
    column = _columns(vocab, torch.tensor([eos_id], device=vocab.device))
    if column.numel() == 0:
        raise ValueError(f"the decoding vocabulary must hold EOS ({eos_id})")
    return int(column)


def _check_vocab(vocab: Tensor | None) -> None:
    if vocab is None:
        return
    if vocab.dim() != 1 or vocab.numel() == 0 or bool((vocab[1:] <= vocab[:-1]).any()):
        raise ValueError("vocab must be a 1-D tensor of distinct ids in increasing order")


def _restrict_(scores: Tensor, banned: Tensor, eos: int, force_eos: Tensor | None) -> Tensor:
    """In place: set banned tokens to -inf everywhere, and every token but EOS to -inf in rows
    that have reached their maximum length (``force_eos``, (rows,) bool; None where the search
    knows that none has), EOS keeping its log-probability there even where ``banned`` holds it
    (the maximum length wins over ``min_len``). Returns ``scores``. ``banned`` and ``eos`` are
    columns of ``scores``: ids, or their places in a search's ``vocab``.

    ``scores`` (rows, V) are the log-probabilities a ``decode_step`` returned (a new tensor,
    the search's to change); adding a beam's cumulative log-probability afterwards keeps the
    -inf, since x + (-inf) = -inf. Rows at their maximum length are rare, so they are rewritten
    only when there are some, not masked over the whole (rows, V) tensor at every step.
    """
    rows = None
    if force_eos is not None and bool(force_eos.any()):
        rows = force_eos.nonzero().squeeze(1)
        eos_scores = scores[rows, eos]  # a copy (advanced indexing), taken before any ban
    scores.index_fill_(1, banned, -math.inf)
    if rows is not None:
        scores[rows] = -math.inf
        scores[rows, eos] = eos_scores
    return scores


def _float(log_probs: Tensor) -> Tensor:
    """A step's log-probabilities in float32 (`Tensor.float` is a call into PyTorch even when
    they already are, as every model here returns them)."""
    return log_probs if log_probs.dtype == torch.float32 else log_probs.float()


def _check_ids(src_tokens: Tensor) -> None:
    if src_tokens.dim() != 2:
        raise ValueError(f"src_tokens must be (B, S), got shape {tuple(src_tokens.shape)}")


# --------------------------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------------------------


@dataclass
class _Candidates:
    """The best extensions of each sentence's beams at one step, best first."""

    log_prob: Tensor  # (N, C) cumulative log-probability, -inf for impossible extensions
    parent: Tensor  # (N, C) index of the beam (0..K-1) each candidate extends
    token: Tensor  # (N, C) the token it appends


def _select_candidates(beam_log_prob: Tensor, log_probs: Tensor, beam_size: int) -> _Candidates:
    """Top 2·W extensions of each sentence over its K live beams × V tokens, by cumulative
    log-probability ``beam_log_prob + log_probs``.

    2·W is enough to leave W candidates that do not end in EOS, since at most K ≤ W do.

    The plain way adds every beam's log-probability to its V scores and takes the top 2·W of
    each sentence's K·V sums, and CPU top-k is slow: about 15 times the time of a maximum over
    the same numbers. So (when some chunk size divides V) each beam's V scores are cut into
    chunks; the top 2·W elements lie in the 2·W chunks with the largest maxima (any other chunk
    has 2·W larger elements before its maximum), so the top-k runs over chunk maxima and then
    over 2·W chunks. Float addition is monotonic, so the maximum of a chunk's sums is its
    maximum plus the beam's log-probability, and every candidate's sum is computed as the plain
    way computes it: the same values. Only the order among exactly equal sums may differ, as
    top-k leaves it unspecified (a test checks both ways against each other).

    Args:
        beam_log_prob: (N, K) cumulative log-probabilities of the live beams.
        log_probs: (N·K, V) next-token log-probabilities, restricted (`_restrict_`).
    """
    n, k = beam_log_prob.shape
    v = log_probs.size(1)
    want = min(2 * beam_size, k * v)
    chunk = _chunk_size(v)
    if chunk is None or k * (v // chunk) < 4 * want:
        return _select_candidates_plain(beam_log_prob, log_probs, beam_size)
    m = v // chunk  # chunks per beam
    chunk_max = log_probs.view(n, k, m, chunk).amax(dim=3)  # (N, K, M)
    bound = (beam_log_prob.unsqueeze(2) + chunk_max).view(n, k * m)
    chunks = bound.topk(want, dim=1).indices  # (N, C): beam · M + chunk, over K·M
    rows = torch.arange(n, device=log_probs.device).unsqueeze(1) * (k * m)  # (N, 1)
    values = log_probs.view(n * k * m, chunk).index_select(0, (rows + chunks).view(-1))
    sums = beam_log_prob.gather(1, chunks // m).unsqueeze(2) + values.view(n, want, chunk)
    top, at = sums.view(n, want * chunk).topk(want, dim=1)  # (N, C), sorted
    picked = chunks.gather(1, at // chunk)  # (N, C) the chunk of each candidate
    return _Candidates(log_prob=top, parent=picked // m, token=(picked % m) * chunk + at % chunk)


def _select_candidates_plain(
    beam_log_prob: Tensor, log_probs: Tensor, beam_size: int
) -> _Candidates:
    """`_select_candidates` by one top-k over every sentence's K·V sums."""
    n, k = beam_log_prob.shape
    v = log_probs.size(1)
    total = (beam_log_prob.unsqueeze(2) + log_probs.view(n, k, v)).view(n, k * v)
    top, flat = total.topk(min(2 * beam_size, k * v), dim=1)  # (N, C), sorted
    return _Candidates(log_prob=top, parent=flat // v, token=flat % v)


@functools.cache
def _chunk_size(vocab_size: int) -> int | None:
    """The divisor of V nearest 64 within 16..256 (chunks for `_select_candidates`), or None.
    Cached: every beam-search step asks it."""
    divisors = [c for c in range(16, 257) if vocab_size % c == 0]
    return min(divisors, key=lambda c: abs(c - 64)) if divisors else None


def _finish(
    cands: _Candidates,
    tokens: Tensor,
    sentence: Tensor,
    finished: list[list[Hypothesis]],
    worst_kept: Tensor,
    *,
    eos_id: int,
    beam_size: int,
    length_penalty: LengthPenalty,
    alpha: float,
) -> bool:
    """Turn candidates that end in EOS *within the top W* into finished hypotheses; returns
    whether a sentence keeps W of them now.

    As in fairseq, an EOS ranked W+1..2W is not a hypothesis: those ranks only refill the live
    beam. (tensor2tensor finishes EOS anywhere in the top 2·W.) With this rule beam search with
    W = 1 and no length penalty is exactly greedy search.

    Args:
        tokens: (N, K, t) tokens of the live beams.
        sentence: (N,) index of each unfinished sentence in the input batch.
        finished: per input sentence, its best ``beam_size`` hypotheses, best first (updated).
        worst_kept: (B,) float64 on the CPU, per input sentence the score of its worst kept
            hypothesis once it keeps ``beam_size`` of them, else -inf (updated).
    """
    w = min(beam_size, cands.token.size(1))
    ends = cands.token[:, :w].eq(eos_id) & cands.log_prob[:, :w].isfinite()  # (N, w)
    if not bool(ends.any()):
        return False
    row, rank = ends.nonzero(as_tuple=True)
    parent = cands.parent[row, rank]
    ended = zip(
        sentence[row].tolist(),
        tokens[row, parent].tolist(),
        cands.log_prob[row, rank].tolist(),
        strict=True,
    )
    worst: dict[int, float] = {}  # the sentences that keep W now: their worst kept score
    for i, toks, log_prob in ended:
        score = log_prob / length_penalty(len(toks) + 1, alpha)
        kept = finished[i]
        kept.append(Hypothesis(tokens=toks, score=score, log_prob=log_prob))
        kept.sort(key=lambda h: -h.score)  # stable: on a tie the earlier hypothesis stays first
        del kept[beam_size:]
        if len(kept) == beam_size:
            worst[i] = kept[-1].score
    if worst:  # one write for every sentence, not a call into PyTorch per sentence
        index = torch.tensor(list(worst), dtype=torch.long)
        worst_kept.index_put_((index,), torch.tensor(list(worst.values()), dtype=torch.float64))
    return bool(worst)


def _keep_live(
    cands: _Candidates, tokens: Tensor, *, eos_id: int, beam_size: int
) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The new live beams: the best W candidates that do not end in EOS.

    Args:
        tokens: (N, K, t) tokens of the current live beams.

    Returns:
        (N, K') cumulative log-probabilities, best first; (N, K') the beam each extends;
        (N, K', t + 1) their tokens. K' = W unless a sentence has fewer candidates. And
        whether some slot has no possible extension (-inf: a sentence may have nothing alive).
    """
    live = cands.log_prob.masked_fill(cands.token.eq(eos_id), -math.inf)
    log_prob, pick = live.topk(min(beam_size, live.size(1)), dim=1)  # (N, K')
    parent = cands.parent.gather(1, pick)
    token = cands.token.gather(1, pick)
    # A slot with no possible extension (-inf) copies the best beam, so that the model is only
    # ever fed real prefixes; its -inf log-prob keeps it from ever being chosen.
    empty = log_prob.isneginf()
    some_empty = bool(empty.any())
    if some_empty:
        parent = torch.where(empty, parent[:, :1], parent)
        token = torch.where(empty, token[:, :1], token)
    rows = torch.arange(parent.size(0), device=parent.device).unsqueeze(1)  # (N, 1)
    tokens = torch.cat([tokens[rows, parent], token.unsqueeze(2)], dim=2)
    return log_prob, parent, tokens, some_empty


def _in_parent_rows(
    log_prob: Tensor, parent: Tensor, tokens: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The new live beams (N, K) put in the cache rows that move the fewest rows.

    Each beam's first child in ``parent`` (the best, as `_keep_live` ranks them) takes over its
    parent's row, so that row keeps its cached keys and values in place; the further children
    of a parent take the rows of beams that left no child. The decoder cache then copies only
    those. Search needs no ranking of the live beams, only where each one is.

    Args:
        log_prob: (N, K) cumulative log-probabilities of the new beams.
        parent: (N, K) the row (0..K-1) of the beam each extends.
        tokens: (N, K, t) their tokens.

    Returns:
        The three, reordered along K so that beam r lives in row r.
    """
    before = _earlier(parent.size(1), parent.device)  # [j, i]: i < j
    sibling_before = (parent.unsqueeze(2).eq(parent.unsqueeze(1)) & before).any(2)  # (N, K)
    has_child = torch.zeros_like(sibling_before).scatter_(1, parent, True)  # (N, K) by row
    free_rows = has_child.argsort(dim=1, stable=True)  # rows without a child first
    later_child = sibling_before.cumsum(1) - 1  # 0, 1, ... among later children
    row = torch.where(sibling_before, free_rows.gather(1, later_child.clamp(min=0)), parent)
    beam = row.argsort(dim=1)  # (N, K) the beam that lives in each row
    return (
        log_prob.gather(1, beam),
        parent.gather(1, beam),
        tokens.gather(1, beam.unsqueeze(2).expand_as(tokens)),
    )


@functools.cache
def _earlier(k: int, device: torch.device) -> Tensor:
    """(K, K) bool, [j, i] = i < j: which beams rank before which (`_in_parent_rows`). Cached:
    every beam-search step asks it, and nothing writes to it."""
    return torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)


def _survivors(done: list[bool]) -> list[int]:
    """The sentences not done, in the order that moves the fewest cache rows: a sentence
    stays in its slot if the shorter batch still has that slot, and the slots of done
    sentences are filled from the back."""
    n_left = len(done) - sum(done)
    back = (j for j in range(n_left, len(done)) if not done[j])
    return [next(back) if done[j] else j for j in range(n_left)]


def _done(best_live: Tensor, worst_kept: Tensor, bound_lp: Tensor, stopping: str) -> list[bool]:
    """The stopping rule (see :func:`beam_search`) for each unfinished sentence at once.

    Args:
        best_live: (N,) cumulative log-probability of each sentence's best live beam.
        worst_kept: (N,) float64 score of its worst kept hypothesis; -inf until it keeps W.
        bound_lp: (N,) float64 length penalty that the rule divides ``best_live`` by.
    """
    best = best_live.double().cpu()
    full = worst_kept.isfinite()  # W finished hypotheses
    # exact, heuristic: the best live beam's best reachable score cannot beat the worst kept
    done = full if stopping == "finished" else full & (best / bound_lp <= worst_kept)
    return (done | best.isneginf()).tolist()  # nothing alive: EOS was forced at max length


@torch.inference_mode()
def beam_search(
    model: IncrementalModel,
    src_tokens: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    options: DecodingOptions | None = None,
    vocab: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search with the paper's settings by default (§6.1, :class:`DecodingOptions`).

    Each step extends the K live beams of every unfinished sentence by every token, keeps the
    top 2·W candidates (:func:`_select_candidates`), turns those among the top W that end in EOS
    into finished hypotheses scored ``log_prob / lp(length)`` (:func:`_finish`), and keeps the
    best W that do not end in EOS as the new live beams (:func:`_keep_live`). The first step
    starts from a single beam per sentence. Pad and BOS are never generated, nor EOS before
    ``min_len`` tokens.

    Stopping rule (``options.stopping``). A sentence is done when it has reached its maximum
    length (EOS was forced, nothing is left alive), or when it has ``beam_size`` finished
    hypotheses and

    - ``"exact"``: no live beam can still beat the worst of them,
      ``best_live_log_prob / lp(max_len + 1) <= worst_finished_score``. The bound holds because
      log-probabilities only decrease as tokens are added and, for α ≥ 0, the gnmt and power
      penalties only grow with length, so the best score any descendant can reach is its
      current log-probability divided by the largest penalty. It never changes the result.
    - ``"finished"``: nothing more (fairseq, CTranslate2 and Marian stop here). A live beam
      that would have scored better later is lost, but no step is spent looking for it.
    - ``"heuristic"`` (the default): no live beam could beat the worst of them if it ended at
      the next step, ``best_live_log_prob / lp(t + 2) <= worst_finished_score`` after t + 1
      generated tokens (Hugging Face's ``early_stopping=False``). On the Bible validation set
      (809 sentences, `small`, beam 4) it gave exactly the outputs of ``"exact"`` with 27%
      fewer decoder rows, where ``"finished"`` changed 7 (BENCHMARKS.md; docs/deviations.md).

    Done sentences are dropped from the batch.

    Args:
        model: See :class:`IncrementalModel`.
        src_tokens: (B, S) source ids, right-padded with ``pad_id``.
        bos_id: Token fed first to the decoder.
        eos_id: Token that ends a hypothesis.
        pad_id: Source padding token.
        options: beam_size (W), length_penalty (α), length_penalty_kind, max_len_a,
            max_len_b, min_len, n_best and stopping are used; None = the defaults. The length
            penalty is applied to |Y|, the length including EOS.
        vocab: (V',) the target ids, sorted, that the model's ``decode_step`` scores, column j
            being id ``vocab[j]`` (a model restricted to a shortlist:
            `aiayn.decode.restricted.RestrictedModel`); it must hold EOS. None: every id.

    Returns:
        For each source row, in input order, up to ``n_best`` hypotheses, best first. A list is
        shorter only if the model gives zero probability to every other continuation.
    """
    _check_ids(src_tokens)
    _check_vocab(vocab)
    options = options or DecodingOptions()
    if options.sampling:
        raise ValueError("these options ask for sampling: call sample(), not beam_search()")
    beam_size, length_penalty, n_best = options.beam_size, options.length_penalty, options.n_best
    lp_fn = length_penalty_fn(options.length_penalty_kind)

    device = src_tokens.device
    b = src_tokens.size(0)
    memory, src_key_mask = model.encode(src_tokens)
    max_len = _max_output_lengths(src_tokens, pad_id, options.max_len_a, options.max_len_b)
    # (B,) float64 on the CPU, by input sentence: the largest penalty each may reach
    max_final_lp = torch.tensor([lp_fn(m + 1, length_penalty) for m in max_len.tolist()])
    cache = model.init_cache(memory, src_key_mask, int(max_len.max()) + 1 if b else 1)
    banned = _never_output(bos_id, eos_id, pad_id, device, vocab=vocab)
    too_short = _never_output(bos_id, eos_id, pad_id, device, too_short=True, vocab=vocab)
    eos_column = _eos_column(vocab, eos_id)

    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    worst_kept = torch.full((b,), -math.inf, dtype=torch.float64)  # (B,) see _finish
    sentence = torch.arange(b, device=device)  # (N,)
    tokens = torch.empty(b, 1, 0, dtype=torch.long, device=device)  # (N, K, t)
    beam_log_prob = torch.zeros(b, 1, device=device)  # (N, K)
    prev = torch.full((b,), bos_id, dtype=torch.long, device=device)  # (N*K,)
    # Asked in Python, not of tensors at every step: no row is forced to EOS before step
    # `first_forced`, and no sentence is done before one of them keeps W hypotheses or has
    # nothing alive (`_keep_live` says; EOS forced at a sentence's maximum length leaves it so).
    first_forced = int(max_len.min()) if b else 0
    some_full = False
    step = 0
    while sentence.numel() > 0:
        n, k = beam_log_prob.shape
        force_eos = max_len.le(step).repeat_interleave(k) if step >= first_forced else None
        log_probs = _float(model.decode_step(prev, cache))  # (N·K, V), ours to change
        limit = too_short if step < options.min_len else banned
        _restrict_(log_probs, limit, eos_column, force_eos)
        cands = _select_candidates(beam_log_prob, log_probs, beam_size)
        if vocab is not None:  # columns to ids
            cands.token = vocab[cands.token]
        some_full |= _finish(
            cands,
            tokens,
            sentence,
            finished,
            worst_kept,
            eos_id=eos_id,
            beam_size=beam_size,
            length_penalty=lp_fn,
            alpha=length_penalty,
        )
        beam_log_prob, parent, tokens, some_empty = _keep_live(
            cands, tokens, eos_id=eos_id, beam_size=beam_size
        )

        keep = None  # (N',) the sentences that go on; None: all of them
        if some_full or some_empty:
            on_cpu = sentence.cpu()
            if options.stopping == "heuristic":
                bound_lp = torch.full((n,), lp_fn(step + 2, length_penalty), dtype=torch.float64)
            else:
                bound_lp = max_final_lp[on_cpu]
            # the live beams are ranked best first until _in_parent_rows
            done = _done(beam_log_prob[:, 0], worst_kept[on_cpu], bound_lp, options.stopping)
            if any(done):
                keep = torch.tensor(_survivors(done), dtype=torch.long, device=device)
                if keep.numel() == 0:
                    break
        if parent.size(1) == k:
            beam_log_prob, parent, tokens = _in_parent_rows(beam_log_prob, parent, tokens)
        # One row selection follows beams to their parents and drops done sentences.
        rows = torch.arange(0, n * k, k, device=device).unsqueeze(1) + parent  # (N, K)
        if keep is not None:
            rows = rows[keep]
            sentence, max_len = sentence[keep], max_len[keep]
            tokens, beam_log_prob = tokens[keep], beam_log_prob[keep]
        cache = cache.reorder(rows.view(-1), keep)
        prev = tokens[:, :, -1].reshape(-1)
        step += 1
    return [hyps[:n_best] for hyps in finished]


# --------------------------------------------------------------------------------------------
# One hypothesis per sentence: greedy search and sampling
# --------------------------------------------------------------------------------------------


def _decode_one_per_row(
    model: IncrementalModel,
    src_tokens: Tensor,
    choose: Callable[[Tensor], Tensor],
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    options: DecodingOptions,
    in_input_order: bool = False,
    vocab: Tensor | None = None,
) -> list[Hypothesis]:
    """The decoding loop of greedy search and sampling; ``choose`` is the strategy.

    ``choose`` maps (N, V) log-probabilities (pad and BOS already -inf, EOS too before
    ``options.min_len`` tokens, EOS forced at max length) to (N,) next tokens (columns of
    ``vocab`` where given: `beam_search`). Rows are dropped from the batch as soon as they emit
    EOS; the rows left keep their input order with ``in_input_order``, else `_survivors`' order.
    """
    _check_ids(src_tokens)
    _check_vocab(vocab)
    device = src_tokens.device
    b = src_tokens.size(0)
    memory, src_key_mask = model.encode(src_tokens)
    max_len = _max_output_lengths(src_tokens, pad_id, options.max_len_a, options.max_len_b)
    cache = model.init_cache(memory, src_key_mask, int(max_len.max()) + 1 if b else 1)
    banned = _never_output(bos_id, eos_id, pad_id, device, vocab=vocab)
    too_short = _never_output(bos_id, eos_id, pad_id, device, too_short=True, vocab=vocab)
    eos_column = _eos_column(vocab, eos_id)

    results: list[Hypothesis | None] = [None] * b
    sentence = torch.arange(b, device=device)  # (N,)
    tokens = torch.empty(b, 0, dtype=torch.long, device=device)  # (N, t)
    log_prob = torch.zeros(b, device=device)  # (N,)
    prev = torch.full((b,), bos_id, dtype=torch.long, device=device)  # (N,)
    first_forced = int(max_len.min()) if b else 0  # no row is forced to EOS before
    step = 0
    while sentence.numel() > 0:
        log_probs = _float(model.decode_step(prev, cache))  # (N, V), ours to change
        force_eos = max_len.le(step) if step >= first_forced else None
        limit = too_short if step < options.min_len else banned
        _restrict_(log_probs, limit, eos_column, force_eos)
        token = choose(log_probs)  # (N,)
        log_prob = log_prob + log_probs.gather(1, token.unsqueeze(1)).squeeze(1)
        if vocab is not None:  # columns to ids
            token = vocab[token]
        ended = token.eq(eos_id)
        if bool(ended.any()):
            ended_rows = zip(
                sentence[ended].tolist(),
                tokens[ended].tolist(),
                log_prob[ended].tolist(),
                strict=True,
            )
            for i, toks, lp in ended_rows:
                results[i] = Hypothesis(tokens=toks, score=lp, log_prob=lp)
            done = ended.tolist()
            left = [j for j, d in enumerate(done) if not d] if in_input_order else _survivors(done)
            keep = torch.tensor(left, dtype=torch.long, device=device)
            if keep.numel() == 0:
                break
            cache = cache.reorder(keep, keep)
            sentence, max_len, tokens = sentence[keep], max_len[keep], tokens[keep]
            log_prob, token = log_prob[keep], token[keep]
        tokens = torch.cat([tokens, token.unsqueeze(1)], dim=1)
        prev = token
        step += 1
    return [h for h in results if h is not None]


@torch.inference_mode()
def greedy_search(
    model: IncrementalModel,
    src_tokens: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    options: DecodingOptions | None = None,
    vocab: Tensor | None = None,
) -> list[Hypothesis]:
    """Batched greedy search: the most probable next token at every step.

    A sentence stops at its first EOS (or when EOS is forced at max length, see the module
    docstring) and is dropped from the batch. Of ``options`` (None = the defaults) only the
    length limits max_len_a, max_len_b and min_len are used; ``vocab`` is `beam_search`'s.
    Returns one hypothesis per source row, in input order; its score is its log-probability
    (no length penalty).
    """

    def argmax(log_probs: Tensor) -> Tensor:
        return log_probs.argmax(dim=1)

    return _decode_one_per_row(
        model,
        src_tokens,
        argmax,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        options=options or DecodingOptions(),
        vocab=vocab,
    )


def _filter_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Keep the ``top_k`` largest logits of each row (ties with the k-th are kept)."""
    kth = logits.topk(min(top_k, logits.size(1)), dim=1).values[:, -1:]  # (N, 1)
    return logits.masked_fill(logits < kth, -math.inf)


def _filter_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most probable tokens
    whose probability reaches ``top_p``. The most probable token is always kept."""
    sorted_logits, order = logits.sort(dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # probability of the tokens ranked above
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


@torch.inference_mode()
def sample(
    model: IncrementalModel,
    src_tokens: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    options: DecodingOptions | None = None,
    generator: torch.Generator | None = None,
    vocab: Tensor | None = None,
) -> list[Hypothesis]:
    """Batched ancestral sampling, with temperature, then top-k, then nucleus (top-p) filtering.

    One sample per source row: to draw n per sentence, repeat the rows (``options.n_best`` and
    ``options.sampling`` are not read here).

    Args:
        options: temperature (log-probabilities are divided by it before filtering), top_k,
            top_p (nucleus filtering after temperature and top-k), max_len_a, max_len_b and
            min_len are used; None = the defaults (plain sampling).
        generator: For reproducible samples; must live on the device of ``src_tokens``.
        vocab: `beam_search`'s: samples are drawn from the distribution renormalised over it.

    Returns:
        One hypothesis per source row, in input order. ``log_prob`` and ``score`` are the
        model's log-probability of the sample, before temperature and filtering.
    """
    options = options or DecodingOptions()
    temperature, top_k, top_p = options.temperature, options.top_k, options.top_p

    def draw(log_probs: Tensor) -> Tensor:
        logits = log_probs / temperature
        if top_k > 0:
            logits = _filter_top_k(logits, top_k)
        if top_p < 1:
            logits = _filter_top_p(logits, top_p)
        probs = logits.softmax(dim=1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return _decode_one_per_row(
        model,
        src_tokens,
        draw,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        options=options or DecodingOptions(),
        in_input_order=True,  # the rows `torch.multinomial` draws for stay those of a seed
        vocab=vocab,
    )


# --------------------------------------------------------------------------------------------
# The search the options ask for, over lists of ids (what `aiayn.decode.backends` use)
# --------------------------------------------------------------------------------------------


def pad(rows: list[list[int]], device: torch.device) -> Tensor:
    """Right-pads id lists into a (B, longest) long tensor."""
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def search_with(
    model: IncrementalModel,
    sources: list[list[int]],
    options: DecodingOptions,
    generator: torch.Generator | None,
    device: torch.device,
    vocab: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """aiayn's own search over any `IncrementalModel` (a model, an ensemble, ONNX
    sessions): ``n_best`` samples per sentence sorted by log-probability with ``sampling``,
    else greedy search for beam size 1, else beam search; ``vocab`` is `beam_search`'s."""
    src = pad(sources, device)  # (B, S)
    ids: dict[str, Any] = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID, "vocab": vocab}
    if options.sampling:
        n = options.n_best
        samples = sample(
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
        return [[h] for h in greedy_search(model, src, options=options, **ids)]
    return beam_search(model, src, options=options, **ids)
