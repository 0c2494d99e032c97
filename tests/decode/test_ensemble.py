"""Ensemble decoding: the ensemble is the mixture (mean of probabilities) of its models, checked
against a fake model whose probabilities are that mixture, set by hand; an ensemble of a real
model with itself decodes exactly as the model."""

from __future__ import annotations

import pytest
import torch

from aiayn.decode.ensemble import Ensemble
from aiayn.decode.search import DecodingOptions, beam_search, greedy_search, sample

# The hand-set fakes of the search tests (tests/ is on sys.path under pytest).
from decode.test_search import IDS, FakeModel, random_model, random_sources
from model_dirs import tiny_model


def mixture(models: list[FakeModel]) -> FakeModel:
    """A fake whose probabilities are the mean of ``models``' probabilities."""

    def probs(source: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
        rows = [m.probs(source, prefix) for m in models]
        return [sum(column) / len(rows) for column in zip(*rows, strict=True)]

    return FakeModel(probs, models[0].vocab_size)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_ensemble_decodes_as_the_mean_of_the_models_probabilities(beam_size: int) -> None:
    models = [random_model(seed) for seed in (1, 2, 3)]
    sources = random_sources(seed=4, n=6)
    options = DecodingOptions(beam_size=beam_size, n_best=beam_size, max_len_b=5)
    search = beam_search if beam_size > 1 else greedy_search
    got = search(Ensemble(models), sources, options=options, **IDS)
    expected = search(mixture(models), sources, options=options, **IDS)
    if beam_size == 1:
        got, expected = [[h] for h in got], [[h] for h in expected]
    for hyps, want in zip(got, expected, strict=True):
        assert [h.tokens for h in hyps] == [h.tokens for h in want]
        assert [h.log_prob for h in hyps] == pytest.approx([h.log_prob for h in want], abs=1e-5)
        assert [h.score for h in hyps] == pytest.approx([h.score for h in want], abs=1e-5)


def test_sampling_from_an_ensemble_draws_from_the_mixture() -> None:
    models = [random_model(seed) for seed in (1, 2)]
    sources = random_sources(seed=5, n=4)
    options = DecodingOptions(sampling=True, max_len_b=5)
    runs = []
    for model in (Ensemble(models), mixture(models)):
        generator = torch.Generator().manual_seed(0)
        runs.append(sample(model, sources, options=options, generator=generator, **IDS))
    assert [h.tokens for h in runs[0]] == [h.tokens for h in runs[1]]


def test_ensemble_of_a_model_with_itself_is_the_model() -> None:
    model = tiny_model()
    sources = torch.randint(3, 23, (5, 7))
    sources[1, 4:] = sources[3, 2:] = 0  # padding
    twice = Ensemble([model, model])
    for beam_size in (1, 4):
        options = DecodingOptions(beam_size=beam_size, n_best=beam_size, max_len_b=8)
        search = beam_search if beam_size > 1 else greedy_search
        got, expected = (search(m, sources, options=options, **IDS) for m in (twice, model))
        if beam_size == 1:
            got, expected = [[h] for h in got], [[h] for h in expected]
        for hyps, want in zip(got, expected, strict=True):
            assert [h.tokens for h in hyps] == [h.tokens for h in want]
            assert [h.score for h in hyps] == pytest.approx([h.score for h in want], abs=1e-5)


def test_models_with_different_vocabulary_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"vocabularies differ in size \(\[23, 30\]\)"):
        Ensemble([tiny_model(), tiny_model(30)])
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])
