"""Scoring given translations: the score is the teacher-forced NLL that training computes, pair
by pair, whatever the batching; an ensemble scores with the mean of its models' probabilities."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.decode.scoring import score_pairs
from aiayn.loss import label_smoothed_loss
from aiayn.model import Transformer
from aiayn.text.batching import collate
from aiayn.text.tokenizer import PAD_ID, Tokenizer
from model_dirs import tiny_model, train_tokenizer

CORPUS = ["the cat sat on the mat", "a dog barked at the moon", "die katze sass auf der matte"]
PAIRS = [
    ("the cat sat", "die katze sass"),
    ("a dog", ""),  # an empty target: EOS alone
    ("", "der mond"),  # an empty source: EOS alone
    ("the moon barked at the cat on the mat", "der hund"),
    ("mat", "die matte auf der katze sass der hund"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(tmp_path_factory.mktemp("scoring"), CORPUS)


def reference_nll(
    model: Transformer, tokenizer: Tokenizer, src: str, tgt: str
) -> tuple[float, int]:
    """The NLL training computes for one pair: label_smoothed_loss with ε = 0."""
    [src_ids, tgt_ids] = tokenizer.encode_batch([src, tgt])
    batch = collate([(src_ids, tgt_ids)])
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in)
    sums = label_smoothed_loss(logits, batch.tgt_out, epsilon=0.0, pad_id=PAD_ID)
    return float(sums.nll), sums.n_tokens


@pytest.mark.parametrize("max_tokens,chunk_size", [(4096, 4096), (12, 2)])
def test_score_is_the_teacher_forced_nll_of_each_pair(
    tokenizer: Tokenizer, max_tokens: int, chunk_size: int
) -> None:
    model = tiny_model(tokenizer.vocab_size)
    done: list[int] = []
    scores = list(
        score_pairs(
            model, tokenizer, PAIRS, max_tokens=max_tokens, chunk_size=chunk_size,
            progress=done.append,
        )
    )  # fmt: skip
    assert sum(done) == len(PAIRS)
    for (src, tgt), score in zip(PAIRS, scores, strict=True):
        nll, n_tokens = reference_nll(model, tokenizer, src, tgt)
        assert score.log_prob == pytest.approx(-nll, abs=1e-4)
        assert score.n_tokens == n_tokens == len(tokenizer.encode_batch([tgt])[0]) + 1
        assert score.perplexity == pytest.approx(math.exp(nll / n_tokens), rel=1e-4)
        assert not score.truncated


def test_ensemble_score_is_the_log_of_the_mean_probability(tokenizer: Tokenizer) -> None:
    torch.manual_seed(1)
    models = [tiny_model(tokenizer.vocab_size), tiny_model(tokenizer.vocab_size)]
    [score] = score_pairs(models, tokenizer, [PAIRS[0]])
    [src_ids, tgt_ids] = tokenizer.encode_batch(list(PAIRS[0]))
    batch = collate([(src_ids, tgt_ids)])
    with torch.no_grad():
        probs = [F.softmax(m(batch.src, batch.tgt_in), dim=-1) for m in models]  # (1, T, V)
    mean = (probs[0] + probs[1]) / 2
    expected = mean.gather(-1, batch.tgt_out.unsqueeze(-1)).log().sum()
    assert score.log_prob == pytest.approx(float(expected), abs=1e-4)


def test_long_sources_are_cut_and_too_long_targets_refused(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    long = " ".join(CORPUS * 3)
    model = tiny_model(tokenizer.vocab_size, max_positions=8, positional_encoding="learned")
    [score] = score_pairs(model, tokenizer, [(long, "die katze")])
    assert score.truncated and "source 1 has" in caplog.text
    cut = tokenizer.decode(tokenizer.encode_batch([long])[0][:7])
    [same] = score_pairs(model, tokenizer, [(cut, "die katze")])
    assert same.log_prob == pytest.approx(score.log_prob, abs=1e-5)
    with pytest.raises(ValueError, match=r"target 2 has \d+ tokens, more than the model accepts"):
        list(score_pairs(model, tokenizer, [("a", "b"), ("the cat", long)]))


def test_translator_score(tokenizer: Tokenizer) -> None:
    from aiayn.decode.translator import Translator

    model = tiny_model(tokenizer.vocab_size)
    translator = Translator.from_model(model, tokenizer)
    sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    assert translator.score(sources, targets) == list(score_pairs(model, tokenizer, PAIRS))
    with pytest.raises(ValueError, match="5 sources but 4 targets"):
        translator.score(sources, targets[:4])
