"""Search against a fake model whose next-token probabilities are set by hand (as fairseq does).

The fake's distribution is a function of (source, prefix), its cache keeps one prefix per row and
checks every call: the first token fed is BOS, no EOS/pad/BOS is fed after it, no position
beyond the cache's capacity is written, and every row of a step has the same length.
"""

from __future__ import annotations

import itertools
import math
import random
import typing
from collections.abc import Callable

import pytest
import torch

from aiayn.decode import search
from aiayn.decode.options import LengthPenaltyKind
from aiayn.decode.search import (
    MAX_FINITE_LENGTH_PENALTY,
    DecodingOptions,
    Hypothesis,
    beam_search,
    gnmt_length_penalty,
    greedy_search,
    length_penalty_fn,
    no_length_penalty,
    power_length_penalty,
    sample,
)

PAD, BOS, EOS = 0, 1, 2
A, B, C, D = 3, 4, 5, 6
IDS = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}

# (source without padding, generated prefix without BOS) -> probabilities over the vocabulary
Probs = Callable[[tuple[int, ...], tuple[int, ...]], list[float]]


class FakeCache:
    """Per-row prefixes; checks that search keeps rows grouped by sentence (the protocol)."""

    def __init__(
        self,
        sources: list[tuple[int, ...]],
        prefixes: list[list[int]],
        max_len: int,
        row_sentence: list[int] | None = None,
    ):
        self.sources = sources
        self.prefixes = prefixes
        self.max_len = max_len
        self.length = len(prefixes[0]) if prefixes else 0
        self.row_sentence = list(range(len(sources))) if row_sentence is None else row_sentence

    def reorder(self, index: torch.Tensor, sentences: torch.Tensor | None = None) -> FakeCache:
        assert index.dtype == torch.long and index.dim() == 1
        rows = index.tolist()
        n_old = len(set(self.row_sentence))
        kept = list(range(n_old)) if sentences is None else sentences.tolist()
        assert len(rows) % len(kept) == 0, "rows cannot be grouped by sentence"
        k = len(rows) // len(kept)
        for i, row in enumerate(rows):
            assert self.row_sentence[row] == kept[i // k], "a row left its sentence's group"
        return FakeCache(
            [self.sources[i] for i in rows],
            [list(self.prefixes[i]) for i in rows],
            self.max_len,
            [i // k for i in range(len(rows))],
        )


class FakeModel:
    """Implements search.IncrementalModel; records the number of rows of every decode_step."""

    def __init__(self, probs: Probs, vocab_size: int) -> None:
        self.probs = probs
        self.vocab_size = vocab_size
        self.batch_sizes: list[int] = []

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = src_tokens.ne(PAD)
        return src_tokens.unsqueeze(-1).float(), None if bool(mask.all()) else mask

    def init_cache(
        self, memory: torch.Tensor, src_key_mask: torch.Tensor | None, max_len: int
    ) -> FakeCache:
        sources = [tuple(t for t in row if t != PAD) for row in memory.squeeze(-1).long().tolist()]
        return FakeCache(sources, [[] for _ in sources], max_len)

    def decode_step(self, tokens: torch.Tensor, cache: FakeCache) -> torch.Tensor:
        assert tokens.shape == (len(cache.prefixes),)
        assert cache.length < cache.max_len, "fed past the cache's capacity"
        self.batch_sizes.append(tokens.numel())
        out = []
        for row, token in enumerate(tokens.tolist()):
            prefix = cache.prefixes[row]
            assert len(prefix) == cache.length
            if not prefix:
                assert token == BOS
            else:
                assert token not in (PAD, BOS, EOS)
            prefix.append(token)
            out.append(self.probs(cache.sources[row], tuple(prefix[1:])))
        cache.length += 1
        return torch.tensor(out, dtype=torch.float64).log().float()

    def sequence_log_prob(self, source: tuple[int, ...], tokens: list[int]) -> float:
        """log P(tokens + EOS | source) under the fake, in float64."""
        total = 0.0
        for t, token in enumerate([*tokens, EOS]):
            total += math.log(self.probs(source, tuple(tokens[:t]))[token])
        return total


def table_model(entries: dict[tuple[int, ...], dict[int, float]], vocab_size: int = 7) -> FakeModel:
    """Same distribution for every source; a prefix not in ``entries`` is followed by EOS."""

    def probs(source: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
        row = [0.0] * vocab_size
        for token, p in entries.get(prefix, {EOS: 1.0}).items():
            row[token] = p
        return row

    return FakeModel(probs, vocab_size)


def random_model(seed: int, vocab_size: int = 7, eos_weight: float = 0.3) -> FakeModel:
    """Random but deterministic distributions. Pad and BOS get large probabilities, which search
    must ignore; EOS grows likelier with the prefix length, faster for short sources."""

    def probs(source: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(str((seed, source, prefix)))
        w = [rng.random() ** 2 + 0.01 for _ in range(vocab_size)]
        w[PAD] += 1.0
        w[BOS] += 1.0
        w[EOS] *= eos_weight * (1 + len(prefix)) * 4 / (1 + len(source))
        total = sum(w)
        return [x / total for x in w]

    return FakeModel(probs, vocab_size)


def src(*rows: list[int]) -> torch.Tensor:
    """Right-pad rows with PAD into a (B, S) batch."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def random_sources(seed: int, n: int, max_len: int = 6, vocab_size: int = 7) -> torch.Tensor:
    rng = random.Random(seed)
    rows = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_len))] for _ in range(n)
    ]
    return src(*rows)


def assert_well_formed(h: Hypothesis) -> None:
    assert all(t not in (PAD, BOS, EOS) for t in h.tokens)
    assert math.isfinite(h.log_prob)


def gnmt(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


# ------------------------------------------------------------------------------------------
# Length penalties and argument checks
# ------------------------------------------------------------------------------------------


def test_length_penalties() -> None:
    assert gnmt_length_penalty(1, 0.6) == 1.0
    assert gnmt_length_penalty(7, 1.0) == 2.0
    assert gnmt_length_penalty(13, 0.5) == pytest.approx(math.sqrt(3))
    assert gnmt_length_penalty(30, 0.0) == 1.0
    assert power_length_penalty(4, 0.5) == 2.0
    assert power_length_penalty(9, 0.0) == 1.0
    assert no_length_penalty(9, 2.0) == 1.0
    assert length_penalty_fn("gnmt") is gnmt_length_penalty
    with pytest.raises(ValueError, match="'gnmt', 'power', 'none'"):
        length_penalty_fn("average")


# ------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_size": 0}, r"beam_size \(0\) must be an integer >= 1"),
        ({"beam_size": 2.0}, r"beam_size \(2\.0\) must be an integer"),
        ({"beam_size": True}, r"beam_size \(True\) must be an integer"),
        ({"n_best": 0}, r"n_best \(0\) must be an integer >= 1"),
        ({"beam_size": 2, "n_best": 3}, r"n_best \(3\) must be <= beam_size \(2\)"),
        ({"length_penalty": -0.1}, r"length_penalty \(-0\.1\) must be a number between 0"),
        ({"length_penalty": math.nan}, r"length_penalty \(nan\)"),
        ({"length_penalty": math.inf}, r"length_penalty \(inf\)"),
        ({"length_penalty": 400.0}, r"length_penalty \(400\.0\) .* between 0 and 10"),
        ({"length_penalty": "0.6"}, r"length_penalty \('0\.6'\)"),
        ({"length_penalty_kind": "wu"}, r"length_penalty_kind \('wu'\) .* 'gnmt', 'power', 'none'"),
        ({"max_len_a": -1.0}, r"max_len_a \(-1\.0\) must be a finite number >= 0"),
        ({"max_len_b": math.inf}, r"max_len_b \(inf\) must be a finite number >= 0"),
        ({"max_len_b": math.nan}, r"max_len_b \(nan\)"),
        ({"min_len": -1}, r"min_len \(-1\) must be an integer >= 0"),
        ({"min_len": 1.0}, r"min_len \(1\.0\) must be an integer >= 0"),
        ({"sampling": "yes"}, r"sampling \('yes'\) must be True or False"),
        ({"temperature": 0.0}, r"temperature \(0\.0\) must be a finite number > 0"),
        ({"temperature": -1.0}, r"temperature \(-1\.0\)"),
        ({"temperature": math.inf}, r"temperature \(inf\)"),
        ({"top_k": -1}, r"top_k \(-1\) must be an integer >= 0"),
        ({"top_k": 1.5}, r"top_k \(1\.5\) must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p \(0\.0\) must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p \(1\.5\) must be in \(0, 1\]"),
        ({"top_p": math.nan}, r"top_p \(nan\)"),
    ],
)
def test_decoding_options_name_the_field_and_value_out_of_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodingOptions(**kwargs)


def test_decoding_options_bounds() -> None:
    # With sampling, n_best counts samples and may exceed the beam size.
    assert DecodingOptions(sampling=True, n_best=8).rows_per_sentence == 8
    assert DecodingOptions(beam_size=5).rows_per_sentence == 5
    # The largest α accepted cannot overflow a length penalty, even for very long outputs.
    for penalty in (gnmt_length_penalty, power_length_penalty):
        assert math.isfinite(penalty(100_000, MAX_FINITE_LENGTH_PENALTY))
    with pytest.raises(OverflowError):
        power_length_penalty(5, 500.0)  # what an unbounded α did


def test_every_length_penalty_kind_of_the_options_exists() -> None:
    assert tuple(search.LENGTH_PENALTIES) == typing.get_args(LengthPenaltyKind)


def test_decoding_options_are_hashable_and_compare_by_value() -> None:
    assert DecodingOptions(beam_size=2) == DecodingOptions(beam_size=2)
    assert len({DecodingOptions(), DecodingOptions(), DecodingOptions(top_k=5)}) == 2


def test_beam_search_refuses_sampling_options() -> None:
    with pytest.raises(ValueError, match="sampling"):
        beam_search(random_model(0), src([A]), **IDS, options=DecodingOptions(sampling=True))


# ------------------------------------------------------------------------------------------
# Beam search on hand-set distributions
# ------------------------------------------------------------------------------------------

# Greedy takes A (0.6) and then EOS (0.4): P = 0.24. B (0.4) then EOS (0.9) has P = 0.36.
GREEDY_IS_WRONG = {
    (): {A: 0.6, B: 0.4},
    (A,): {EOS: 0.4, A: 0.3, B: 0.3},
    (B,): {EOS: 0.9, A: 0.05, B: 0.05},
}


def test_greedy_is_wrong_and_beam_finds_the_better_sequence() -> None:
    model = table_model(GREEDY_IS_WRONG)
    (greedy,) = greedy_search(model, src([C]), **IDS)
    assert greedy.tokens == [A]
    assert greedy.log_prob == pytest.approx(math.log(0.24))
    assert greedy.score == greedy.log_prob

    for beam_size in (2, 3, 4):  # the paper's penalty (|Y|^1 would prefer a longer output)
        gnmt = DecodingOptions(beam_size=beam_size, length_penalty_kind="gnmt", length_penalty=0.6)
        (hyps,) = beam_search(model, src([C]), **IDS, options=gnmt)
        (best,) = hyps
        assert best.tokens == [B]
        assert best.log_prob == pytest.approx(math.log(0.36))
        assert best.score == pytest.approx(math.log(0.36) / ((5 + 2) / 6) ** 0.6)

    one = DecodingOptions(beam_size=1, length_penalty_kind="gnmt", length_penalty=0.6)
    (hyps,) = beam_search(model, src([C]), **IDS, options=one)
    assert hyps[0].tokens == [A]


# Short: A EOS, P = 0.5 * 0.7 = 0.35. Long: B B B EOS, P = 0.5 * 0.9 * 0.9 * 0.8 = 0.324.
SHORT_OR_LONG = {
    (): {A: 0.5, B: 0.5},
    (A,): {EOS: 0.7, C: 0.3},
    (B,): {B: 0.9, EOS: 0.1},
    (B, B): {B: 0.9, EOS: 0.1},
    (B, B, B): {EOS: 0.8, B: 0.2},
}


@pytest.mark.parametrize(
    ("kind", "alpha", "winner"),
    [
        ("gnmt", 0.0, [A]),
        ("none", 1.0, [A]),
        ("power", 0.0, [A]),
        # log P: short -1.0498, long -1.1270; gnmt divides by (7/6)^α and (9/6)^α.
        ("gnmt", 0.2, [A]),
        ("gnmt", 0.6, [B, B, B]),
        ("gnmt", 1.0, [B, B, B]),
        # power divides by 2^α and 4^α: it favours length more than gnmt at the same α.
        ("power", 0.2, [B, B, B]),
        ("power", 0.6, [B, B, B]),
    ],
)
def test_length_penalty_decides_between_short_and_long(
    kind: str, alpha: float, winner: list[int]
) -> None:
    lp = {"gnmt": gnmt, "power": lambda n, a: n**a, "none": lambda n, a: 1.0}[kind]
    expected = {
        (A,): math.log(0.35) / lp(2, alpha),
        (B, B, B): math.log(0.324) / lp(4, alpha),
    }
    (hyps,) = beam_search(
        table_model(SHORT_OR_LONG),
        src([D]),
        **IDS,
        options=DecodingOptions(
            beam_size=4, n_best=4, length_penalty=alpha, length_penalty_kind=kind
        ),
    )
    assert hyps[0].tokens == winner
    by_tokens = {tuple(h.tokens): h.score for h in hyps}
    for tokens, score in expected.items():
        assert by_tokens[tokens] == pytest.approx(score, rel=1e-5)


# ------------------------------------------------------------------------------------------
# EOS and maximum length
# ------------------------------------------------------------------------------------------


def test_immediate_eos_gives_empty_tokens_with_min_len_0() -> None:
    model = table_model({(): {EOS: 0.6, A: 0.4}})
    # GNMT's penalty, α 0.6: |Y|^1 would rank [A] + EOS (log 0.4 / 2) above the empty output.
    options = DecodingOptions(n_best=2, min_len=0, length_penalty_kind="gnmt", length_penalty=0.6)
    (hyps,) = beam_search(model, src([C, D]), **IDS, options=options)
    assert hyps[0].tokens == []
    assert hyps[0].log_prob == pytest.approx(math.log(0.6))
    assert hyps[0].score == pytest.approx(math.log(0.6))  # gnmt(1) == 1
    assert hyps[1].tokens == [A]
    (greedy,) = greedy_search(model, src([C, D]), **IDS, options=options)
    assert greedy.tokens == []


def test_no_output_is_empty_by_default_in_any_strategy() -> None:
    """min_len 1 (fairseq's --min-len): EOS may not come first, so the empty hypothesis, the
    model's best here, gives way to the best non-empty one; its log-probability stays the
    model's (EOS's mass is not spread over the other tokens)."""
    model = table_model({(): {EOS: 0.6, A: 0.4}})
    (hyps,) = beam_search(model, src([C, D]), **IDS, options=DecodingOptions(n_best=2))
    assert [h.tokens for h in hyps] == [[A]]  # nothing else has a probability
    assert hyps[0].log_prob == pytest.approx(math.log(0.4))
    assert greedy_search(model, src([C, D]), **IDS)[0].tokens == [A]
    generator = torch.Generator().manual_seed(0)
    samples = sample(model, src(*[[C, D]] * 20), **IDS, generator=generator)
    assert all(s.tokens == [A] for s in samples)
    generator = torch.Generator().manual_seed(0)
    anything = DecodingOptions(sampling=True, min_len=0)
    samples = sample(model, src(*[[C, D]] * 20), **IDS, options=anything, generator=generator)
    assert [] in [s.tokens for s in samples]  # 0.6 each: all 20 non-empty has p = 1e-8


@pytest.mark.parametrize("beam_size", [1, 3])
def test_min_len_holds_eos_back_until_then_and_the_maximum_length_wins(beam_size: int) -> None:
    model = table_model({(): {EOS: 0.9, A: 0.1}, (A,): {EOS: 0.9, B: 0.1}, (A, B): {EOS: 1.0}})

    def tokens(**options: typing.Any) -> list[int]:
        options = DecodingOptions(beam_size=beam_size, **options)
        if beam_size == 1:
            return greedy_search(model, src([C, D]), **IDS, options=options)[0].tokens
        return beam_search(model, src([C, D]), **IDS, options=options)[0][0].tokens

    assert tokens(min_len=0) == []
    assert tokens() == [A]
    assert tokens(min_len=2) == [A, B]
    assert tokens(min_len=2, max_len_a=0, max_len_b=1) == [A]  # EOS forced after one token
    assert tokens(max_len_a=0, max_len_b=0) == []


def constant_model(p_eos: float) -> FakeModel:
    def probs(source: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
        return [0.0, 0.0, p_eos, 1 - p_eos, 0.0, 0.0, 0.0]

    return FakeModel(probs, 7)


def test_max_length_forces_eos() -> None:
    # Source lengths 2 and 4 -> max_len = int(1.0 * src_len + 1) = 3 and 5 tokens before EOS.
    sources = src([C, C], [C, D, C, D])
    model = constant_model(p_eos=0.01)
    greedy = greedy_search(
        model, sources, **IDS, options=DecodingOptions(max_len_a=1.0, max_len_b=1)
    )
    assert [h.tokens for h in greedy] == [[A] * 3, [A] * 5]
    assert greedy[0].log_prob == pytest.approx(3 * math.log(0.99) + math.log(0.01))

    # With α = 1 longer is better here, so the best hypothesis is the longest allowed one.
    model = constant_model(p_eos=0.01)
    beams = beam_search(
        model,
        sources,
        **IDS,
        options=DecodingOptions(
            length_penalty_kind="gnmt", length_penalty=1.0, n_best=4, max_len_b=1
        ),
    )
    for hyps, max_len in zip(beams, (3, 5), strict=True):
        assert hyps[0].tokens == [A] * max_len
        assert all(len(h.tokens) <= max_len for h in hyps)
        assert hyps[0].score == pytest.approx(
            (max_len * math.log(0.99) + math.log(0.01)) / gnmt(max_len + 1, 1.0)
        )
    # BOS + 5 tokens fed for the longer sentence; the step that forces EOS is the last.
    assert len(model.batch_sizes) == 6

    # max_len_a scales the source length; the result is truncated to an int.
    (h,) = greedy_search(
        constant_model(0.01),
        src([C, C, C]),
        **IDS,
        options=DecodingOptions(max_len_a=0.5, max_len_b=0.9),
    )
    assert h.tokens == [A] * 2  # int(0.5 * 3 + 0.9) = 2


def test_pad_and_bos_are_never_generated_even_when_likely() -> None:
    # Pad and BOS get most of the mass; EOS is the only other option after the first token.
    model = table_model({(): {PAD: 0.5, BOS: 0.3, A: 0.15, B: 0.05}, (A,): {PAD: 0.5, EOS: 0.5}})
    (hyps,) = beam_search(model, src([C]), **IDS, options=DecodingOptions(n_best=2))
    assert [h.tokens for h in hyps] == [[A], [B]]
    assert hyps[0].log_prob == pytest.approx(math.log(0.15 * 0.5))  # the model's own log-probs
    (greedy,) = greedy_search(model, src([C]), **IDS)
    assert greedy.tokens == [A]
    for seed in range(5):
        (s,) = sample(model, src([C]), **IDS, generator=torch.Generator().manual_seed(seed))
        assert s.tokens in ([A], [B])


# ------------------------------------------------------------------------------------------
# n-best lists, beam 1 == greedy, batching, early stopping
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gnmt", "power", "none"])
def test_n_best_lists_are_sorted_distinct_and_correctly_scored(kind: str) -> None:
    lp = length_penalty_fn(kind)
    for seed in range(4):
        model = random_model(seed)
        sources = random_sources(seed, 3)
        beams = beam_search(
            model,
            sources,
            **IDS,
            options=DecodingOptions(
                beam_size=5, n_best=5, length_penalty=0.8, length_penalty_kind=kind
            ),
        )
        for row, hyps in zip(sources.tolist(), beams, strict=True):
            source = tuple(t for t in row if t != PAD)
            assert len(hyps) == 5
            assert len({tuple(h.tokens) for h in hyps}) == 5
            scores = [h.score for h in hyps]
            assert scores == sorted(scores, reverse=True)
            for h in hyps:
                assert_well_formed(h)
                assert h.log_prob == pytest.approx(
                    model.sequence_log_prob(source, h.tokens), abs=1e-4
                )
                assert h.score == pytest.approx(h.log_prob / lp(len(h.tokens) + 1, 0.8), abs=1e-5)


def test_beam_size_one_without_penalty_is_greedy() -> None:
    for seed in range(8):
        sources = random_sources(100 + seed, 5)
        greedy = greedy_search(random_model(seed), sources, **IDS)
        beams = beam_search(
            random_model(seed),
            sources,
            **IDS,
            options=DecodingOptions(beam_size=1, length_penalty=0.0),
        )
        for g, (b,) in zip(greedy, beams, strict=True):
            assert b.tokens == g.tokens
            assert b.log_prob == pytest.approx(g.log_prob, abs=1e-5)


def test_batched_equals_one_sentence_at_a_time_and_the_batch_shrinks() -> None:
    # Short sources make EOS likely early; long ones keep going.
    sources = src([A], [C, D, A, B, C, D, A, B, C, D], [B, B], [D, C, B, A, A, B, C, D, D], [C])
    model = random_model(7, eos_weight=0.5)
    beams = beam_search(
        model, sources, **IDS, options=DecodingOptions(beam_size=3, n_best=3, length_penalty=0.6)
    )
    sizes = model.batch_sizes
    assert sizes[0] == 5  # a single beam per sentence at the first step
    assert sizes[1] == 5 * 3
    assert all(a >= b for a, b in itertools.pairwise(sizes[1:]))
    assert sizes[-1] < sizes[1]  # finished sentences were dropped

    model = random_model(7, eos_weight=0.5)
    greedy = greedy_search(model, sources, **IDS)
    assert model.batch_sizes[0] == 5 and model.batch_sizes[-1] < 5
    assert all(a >= b for a, b in itertools.pairwise(model.batch_sizes))

    for i in range(sources.size(0)):
        one = sources[i : i + 1, : int(sources[i].ne(PAD).sum())]  # no padding at all
        (alone,) = beam_search(
            random_model(7, eos_weight=0.5),
            one,
            **IDS,
            options=DecodingOptions(beam_size=3, n_best=3, length_penalty=0.6),
        )
        assert [h.tokens for h in alone] == [h.tokens for h in beams[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in beams[i]])
        (g,) = greedy_search(random_model(7, eos_weight=0.5), one, **IDS)
        assert g.tokens == greedy[i].tokens


def test_best_child_keeps_its_parents_row_and_later_children_take_childless_rows() -> None:
    # Beams ranked best first; parents are rows 0..3. Row 3 has no child, row 2 has two.
    log_prob = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    parent = torch.tensor([[2, 0, 2, 1]])
    tokens = torch.tensor([[[10], [11], [12], [13]]])
    by_row = search._in_parent_rows(log_prob, parent, tokens)
    assert by_row[1].tolist() == [[0, 1, 2, 2]]  # only row 3 changes (a copy of row 2)
    assert by_row[0].tolist() == [[-2.0, -4.0, -1.0, -3.0]]
    assert by_row[2].tolist() == [[[11], [13], [10], [12]]]
    # Two sentences: three children of one parent; an empty (-inf) slot, which copies the best
    # beam's parent as `_keep_live` fills it, is one more later child.
    log_prob = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -math.inf]])
    parent = torch.tensor([[1, 1, 1, 0], [3, 2, 3, 3]])
    by_row = search._in_parent_rows(log_prob, parent, torch.zeros(2, 4, 0, dtype=torch.long))
    assert by_row[1].tolist() == [[0, 1, 1, 1], [3, 3, 2, 3]]
    assert by_row[0].tolist() == [[-4.0, -1.0, -2.0, -3.0], [-3.0, -math.inf, -2.0, -1.0]]
    assert search._survivors([False, True, False, True, False]) == [0, 4, 2]
    assert search._survivors([True, True]) == []


def test_reorders_move_only_rows_the_cache_can_copy_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the expansion to W beams, every row that a reorder moves comes from a row that
    stays where it is or lies past the new last row, the condition under which the decoder
    cache copies only moved rows, in place; and most rows do not move."""
    seen: list[tuple[int, list[int]]] = []
    reorder = FakeCache.reorder

    def recording(self: FakeCache, index: torch.Tensor, sentences: torch.Tensor | None = None):
        seen.append((len(self.prefixes), index.tolist()))
        return reorder(self, index, sentences)

    monkeypatch.setattr(FakeCache, "reorder", recording)
    sources = random_sources(3, 8, max_len=8)
    beam_search(
        random_model(5, eos_weight=0.5), sources, **IDS, options=DecodingOptions(beam_size=4)
    )
    assert seen.pop(0) == (8, [i for i in range(8) for _ in range(4)])  # the expansion
    greedy_search(random_model(5, eos_weight=0.5), sources, **IDS)
    moved_total = rows_total = 0
    for _, index in seen:
        moved = [i for i, source in enumerate(index) if source != i]
        assert all(index[s] == s for s in (index[i] for i in moved) if s < len(index)), index
        moved_total, rows_total = moved_total + len(moved), rows_total + len(index)
    assert 0 < moved_total < rows_total / 2
    assert any(len(index) < n for n, index in seen)  # sentences were dropped too


def test_sampling_keeps_the_sentences_in_input_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.multinomial` draws row by row: if finished sentences were refilled from the back,
    a seeded generator would give later sentences other samples than it used to."""
    seen: list[list[int]] = []
    reorder = FakeCache.reorder

    def recording(self: FakeCache, index: torch.Tensor, sentences: torch.Tensor | None = None):
        seen.append(index.tolist())
        return reorder(self, index, sentences)

    monkeypatch.setattr(FakeCache, "reorder", recording)
    sources = random_sources(3, 8, max_len=8)
    sample(random_model(5, eos_weight=0.5), sources, **IDS, generator=torch.Generator())
    assert seen and all(index == sorted(index) for index in seen)
    assert any(index != list(range(len(index))) for index in seen)  # not only the last rows


@pytest.mark.parametrize("min_len", [0, 1, 2])
@pytest.mark.parametrize(("kind", "alpha"), [("gnmt", 0.6), ("gnmt", 2.0), ("power", 1.0)])
def test_beam_with_room_for_everything_matches_exhaustive_search(
    kind: str, alpha: float, min_len: int
) -> None:
    # Two output tokens, max 3 before EOS: 1 + 2 + 4 + 8 = 15 sequences, of which those of
    # min_len tokens or more may be output. With W = 16 every candidate is within the top W,
    # so beam search must return exactly the full ranking of those.
    lp = length_penalty_fn(kind)
    for seed in range(3):
        model = random_model(seed, vocab_size=5)
        source = (A, B, A)
        ranked = sorted(
            (
                (model.sequence_log_prob(source, list(toks)) / lp(n + 1, alpha), list(toks))
                for n in range(min_len, 4)
                for toks in itertools.product((A, B), repeat=n)
            ),
            key=lambda x: -x[0],
        )
        (hyps,) = beam_search(
            model,
            src(list(source)),
            **IDS,
            options=DecodingOptions(
                beam_size=16,
                n_best=15,
                length_penalty=alpha,
                length_penalty_kind=kind,
                max_len_a=0.0,
                max_len_b=3,
                min_len=min_len,
            ),
        )
        assert [h.tokens for h in hyps] == [toks for _, toks in ranked]
        assert [h.score for h in hyps] == pytest.approx([s for s, _ in ranked], abs=1e-5)


@pytest.mark.parametrize(
    ("kind", "alpha"),
    [("gnmt", 0.0), ("gnmt", 0.6), ("gnmt", 1.0), ("power", 0.6), ("power", 1.0), ("none", 0.0)],
)
def test_early_stopping_does_not_change_results(
    kind: str, alpha: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(seed: int) -> tuple[list[list[Hypothesis]], int]:
        model = random_model(seed, eos_weight=0.6)
        beams = beam_search(
            model,
            random_sources(seed, 4),
            **IDS,
            options=DecodingOptions(
                beam_size=3,
                n_best=3,
                length_penalty=alpha,
                length_penalty_kind=kind,
                max_len_b=12,
                stopping="exact",
            ),
        )
        return beams, sum(model.batch_sizes)

    seeds = range(6)
    early = [run(seed) for seed in seeds]
    # Without the bound a sentence only ends once nothing is left alive (at its max length).
    monkeypatch.setattr(search, "_done", lambda best_live, *_: best_live.isneginf().tolist())
    full = [run(seed) for seed in seeds]
    for (beams_early, _), (beams_full, _) in zip(early, full, strict=True):
        for e, f in zip(beams_early, beams_full, strict=True):
            assert [h.tokens for h in e] == [h.tokens for h in f]
            assert [h.score for h in e] == pytest.approx([h.score for h in f])
    assert sum(work for _, work in early) < sum(work for _, work in full)


# An EOS at once (0.5) beats A (0.2) at the first step, but A C EOS (0.2, 3 tokens) wins under
# power α = 1 (-1.61 / 3 > -0.69 / 1): only a search that goes on after one finished
# hypothesis finds it.
LATE_WINNER = {(): {EOS: 0.5, A: 0.2, B: 0.17, C: 0.13}, (A,): {C: 1.0}, (A, C): {EOS: 1.0}}


@pytest.mark.parametrize(
    ("stopping", "tokens", "steps"),
    [("exact", [A, C], 3), ("heuristic", [], 1), ("finished", [], 1)],
)
def test_each_stopping_rule_stops_where_it_says(stopping: str, tokens: list[int], steps: int):
    """W = 1, source length 1, max_len 11 (lp = 12 at most). After step 1 the finished ()
    scores ln 0.5 = -0.69 and the live A has ln 0.2 = -1.61: `finished` stops (W finished);
    `heuristic` stops too (A ended at the next step: -1.61 / 2 = -0.80 <= -0.69); `exact` goes
    on (-1.61 / 12 = -0.13 > -0.69) and finds A C, scored -1.61 / 3 = -0.54. (min_len 0: the
    empty output is the one that finishes first.)"""
    model = table_model(LATE_WINNER)
    options = DecodingOptions(
        beam_size=1, length_penalty=1.0, length_penalty_kind="power", max_len_b=10,
        stopping=stopping, min_len=0,
    )  # fmt: skip
    [[best]] = beam_search(model, src([A]), **IDS, options=options)
    assert best.tokens == tokens
    assert len(model.batch_sizes) == steps


@pytest.mark.parametrize("stopping", ["exact", "heuristic", "finished"])
def test_a_sentence_with_nothing_left_alive_stops_at_once(stopping: str) -> None:
    """W = 2: A is the only first token and EOS the only token after it. At step 2 the
    sentence keeps one hypothesis, fewer than W, and nothing is alive: it is done then, under
    every rule, not decoded on to its maximum length (11 steps)."""
    model = table_model({(): {A: 1.0}})
    options = DecodingOptions(beam_size=2, n_best=2, max_len_b=10, stopping=stopping)
    [hypotheses] = beam_search(model, src([A]), **IDS, options=options)
    assert [h.tokens for h in hypotheses] == [[A]]
    assert model.batch_sizes == [1, 2]


@pytest.mark.parametrize("stopping", ["finished", "heuristic"])
def test_stopping_early_keeps_w_finished_hypotheses_and_saves_steps(stopping: str) -> None:
    """On random models, the two early rules return W hypotheses per sentence (or fewer only
    where nothing else was possible), never decode more rows than the exact rule, and agree
    with it on most best outputs."""
    same = total = 0
    for seed in range(8):
        sources = random_sources(seed, 4)
        outputs, rows = {}, {}
        for rule in ("exact", stopping):
            model = random_model(seed, eos_weight=0.6)
            options = DecodingOptions(beam_size=3, n_best=3, max_len_b=12, stopping=rule)
            outputs[rule] = beam_search(model, sources, **IDS, options=options)
            rows[rule] = sum(model.batch_sizes)
        assert rows[stopping] <= rows["exact"]
        for early, exact in zip(outputs[stopping], outputs["exact"], strict=True):
            assert len(early) == len(exact) == 3
            same += early[0].tokens == exact[0].tokens
            total += 1
    assert same >= total // 2


def test_decoding_options_refuse_an_unknown_stopping_rule() -> None:
    with pytest.raises(ValueError, match="stopping \\('never'\\) must be one of 'exact'"):
        DecodingOptions(stopping="never")


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------


def test_sampling_with_top_k_1_or_tiny_top_p_is_greedy() -> None:
    for seed in range(5):
        sources = random_sources(200 + seed, 4)
        greedy = greedy_search(random_model(seed), sources, **IDS)
        for kwargs in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "temperature": 3.0}):
            sampled = sample(
                random_model(seed),
                sources,
                **IDS,
                generator=torch.Generator().manual_seed(0),
                options=DecodingOptions(**kwargs),
            )
            assert [h.tokens for h in sampled] == [h.tokens for h in greedy]
            assert [h.log_prob for h in sampled] == pytest.approx([h.log_prob for h in greedy])


def test_sampling_is_reproducible_with_a_seeded_generator() -> None:
    sources = random_sources(3, 8)

    def draw(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [h.tokens for h in sample(random_model(3), sources, **IDS, generator=generator)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


FIRST_TOKEN = {(): {A: 0.5, B: 0.3, C: 0.2}}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {A: 0.5, B: 0.3, C: 0.2}),
        ({"top_k": 2}, {A: 0.5 / 0.8, B: 0.3 / 0.8, C: 0.0}),
        ({"top_p": 0.7}, {A: 0.5 / 0.8, B: 0.3 / 0.8, C: 0.0}),  # A alone holds 0.5 < 0.7
        ({"top_p": 0.5}, {A: 1.0, B: 0.0, C: 0.0}),
        # p ** (1 / T), renormalised
        ({"temperature": 2.0}, {A: 0.7071 / 1.7020, B: 0.5477 / 1.7020, C: 0.4472 / 1.7020}),
    ],
)
def test_sampling_frequencies(kwargs: dict, expected: dict[int, float]) -> None:
    n = 3000
    hyps = sample(
        table_model(FIRST_TOKEN),
        src(*[[D]] * n),
        **IDS,
        generator=torch.Generator().manual_seed(0),
        options=DecodingOptions(**kwargs),
    )
    for token, p in expected.items():
        freq = sum(h.tokens == [token] for h in hyps) / n
        assert freq == pytest.approx(p, abs=0.03)
    # log_prob is the model's, before temperature and filtering.
    assert {round(h.log_prob, 4) for h in hyps} <= {round(math.log(p), 4) for p in (0.5, 0.3, 0.2)}


# --------------------------------------------------------------------------------------------
# Candidate selection: top-k over chunk maxima, then over the best chunks
# --------------------------------------------------------------------------------------------


def test_chunk_size_divides_the_vocabulary_or_is_none() -> None:
    assert search._chunk_size(8000) == 64
    assert search._chunk_size(32000) == 64
    assert search._chunk_size(58101) == 107  # 3 · 107 · 181
    assert search._chunk_size(7) is None
    assert search._chunk_size(8009) is None  # a prime


@pytest.mark.parametrize(
    ("n", "k", "v", "beam_size"),
    [(5, 4, 8000, 4), (3, 2, 2048, 5), (7, 3, 640, 3), (2, 4, 58101, 4)],
)
def test_chunked_candidates_are_one_top_k_over_every_sum(
    n: int, k: int, v: int, beam_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same candidates, values and order as one top-k over the K·V sums of each sentence,
    with -inf where search puts it: banned tokens, a row forced to EOS, a beam that is -inf."""
    gen = torch.Generator().manual_seed(n * v + k)
    log_probs = torch.randn(n * k, v, generator=gen).log_softmax(dim=1)
    beam_log_prob = -torch.rand(n, k, generator=gen) * 5
    beam_log_prob[0, -1] = -math.inf  # an empty beam slot
    force_eos = torch.zeros(n * k, dtype=torch.bool)
    force_eos[k] = True  # the first beam of the second sentence is at its maximum length
    search._restrict_(log_probs, search._never_output(BOS, EOS, PAD, "cpu"), EOS, force_eos)

    plain = search._select_candidates_plain(beam_log_prob, log_probs, beam_size)
    monkeypatch.setattr(search, "_select_candidates_plain", None)  # the chunked path or fail
    chunked = search._select_candidates(beam_log_prob, log_probs, beam_size)
    assert torch.equal(chunked.log_prob, plain.log_prob)  # bit for bit, sorted alike
    finite = plain.log_prob.isfinite()
    assert torch.equal(chunked.parent[finite], plain.parent[finite])
    assert torch.equal(chunked.token[finite], plain.token[finite])
    assert chunked.token[~finite].lt(v).all() and chunked.parent[~finite].lt(k).all()


@pytest.mark.parametrize("beam_size", [1, 4, 5])
def test_beam_search_is_the_same_with_and_without_chunked_candidates(
    beam_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(seed: int) -> tuple[list[list[Hypothesis]], list[int]]:
        model = random_model(seed, vocab_size=1024, eos_weight=0.3)
        options = DecodingOptions(beam_size=beam_size, n_best=beam_size, max_len_b=8)
        beams = beam_search(model, random_sources(seed, 3, vocab_size=1024), **IDS, options=options)
        return beams, model.batch_sizes

    chunked = [run(seed) for seed in range(3)]
    monkeypatch.setattr(search, "_chunk_size", lambda v: None)
    plain = [run(seed) for seed in range(3)]
    assert chunked == plain
