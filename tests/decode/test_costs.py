"""Tests for aiayn.decode.costs: the padded-batch cut, and prices that count what translate
feeds the model and the lengths its search runs to.

The models have random weights: outputs are garbage but deterministic, which is all these
properties need.
"""

from __future__ import annotations

import pytest

from aiayn.decode.costs import DecodingCosts, padded_batches
from aiayn.decode.options import DecodingOptions
from aiayn.decode.translator import Translator
from aiayn.text.tokenizer import Tokenizer
from model_dirs import CORPUS, tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), CORPUS)


def translator_of(tokenizer: Tokenizer, **config: object) -> Translator:
    model = tiny_model(
        tokenizer.vocab_size, preset="tiny", seed=1234, **{"max_positions": 64, **config}
    )
    return Translator.from_model(model, tokenizer)


def costs_of(translator: Translator) -> DecodingCosts:
    return DecodingCosts(translator.tokenizer, translator.source_limits)


def test_padded_batches_cut_longest_first_within_the_budget_and_where_the_key_changes() -> None:
    items = [3, 9, 4, 9, 2, 1]
    assert list(padded_batches(items, lambda n: n, 20)) == [[9, 9], [4, 3, 2, 1]]
    assert list(padded_batches([30, 2], lambda n: n, 20)) == [[30], [2]]  # alone over it
    by_parity = list(padded_batches(items, lambda n: n, 100, key=lambda n: n % 2))
    assert by_parity == [[9, 9], [4], [3], [2], [1]]
    assert list(padded_batches([], lambda n: n, 20)) == []


def test_cost_counts_the_source_tokens_translate_feeds_the_model(tokenizer: Tokenizer) -> None:
    translator = translator_of(tokenizer)
    sentences = ["the cat", " ", " ".join(CORPUS * 4), "  a dog  "]
    results = translator.translate(sentences, beam_size=1, max_len_b=1)
    fed = sum(len(r.src_tokens) for r in results if r.src_tokens)  # truncated, with </s>
    costs = costs_of(translator)
    assert costs.cost(sentences, rows_per_sentence=3) == 3 * fed
    assert costs.cost([" "], rows_per_sentence=4) == 0


def test_costs_are_per_sentence_in_the_unit_of_rows_per_sentence(tokenizer: Tokenizer) -> None:
    costs = costs_of(translator_of(tokenizer))
    sentences = ["the cat", " ", " ".join(CORPUS * 4), "  a dog  "]
    lengths = {"max_len_a": 0.5, "max_len_b": 3}
    bounds = costs.search_bounds(sentences, **lengths)
    assert costs.costs(sentences, 2) == [2 * s for s, _ in bounds]
    assert costs.costs(sentences, 2, **lengths) == [2 * s * t for s, t in bounds]
    assert costs.cost(sentences, 2, **lengths) == sum(costs.costs(sentences, 2, **lengths))
    sampling = DecodingOptions(sampling=True, n_best=3)
    assert costs.costs(["the cat"], sampling.rows_per_sentence) == [3 * bounds[0][0]]


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_search_bounds_are_the_lengths_the_search_runs_to(
    tokenizer: Tokenizer, positions: str
) -> None:
    """Random weights rarely emit EOS, so greedy outputs run to the limit: S and T (with EOS)
    are what translate fed and produced, including under learned positions' cap."""
    translator = translator_of(tokenizer, positional_encoding=positions, max_positions=16)
    costs = costs_of(translator)
    sentences = ["the cat", " ", " ".join(CORPUS), "a dog"]
    lengths = {"max_len_a": 0.5, "max_len_b": 3}
    results = translator.translate(sentences, beam_size=1, **lengths)
    bounds = costs.search_bounds(sentences, **lengths)
    assert bounds[1] == (0, 0)
    for (s, t), result in zip(bounds, results, strict=True):
        if s:
            assert s == len(result.src_tokens) and len(result.token_ids) + 1 <= t
    assert any(len(r.token_ids) + 1 == t for r, (_, t) in zip(results, bounds, strict=True) if t)
    assert costs.cost(sentences, 3, **lengths) == 3 * sum(s * t for s, t in bounds)
