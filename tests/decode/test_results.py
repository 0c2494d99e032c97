"""Tests for aiayn.decode.results: what a translation returns, built from a search's token ids,
and each sentence's attention maps cut out of a padded batch's."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from aiayn.decode.results import (
    Hypothesis,
    cut_attention,
    empty_result,
    translation_result,
)
from aiayn.text.tokenizer import EOS_ID, Tokenizer
from model_dirs import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_a_blank_input_has_one_empty_hypothesis() -> None:
    result = empty_result()
    assert (result.text, result.score, result.log_prob) == ("", 0.0, 0.0)
    assert [h.text for h in result.hypotheses] == [""]


def test_the_result_is_its_best_hypothesis_in_text_and_pieces(tokenizer: Tokenizer) -> None:
    best, other = tokenizer.encode("the cat sat"), tokenizer.encode("hello world")
    source = [*tokenizer.encode("die katze"), EOS_ID]
    hyps = [Hypothesis(best, -1.0, -2.0), Hypothesis(other, -3.0, -4.0)]
    result = translation_result(tokenizer, source, hyps, truncated=True)
    assert (result.text, result.score, result.log_prob) == ("the cat sat", -1.0, -2.0)
    assert result.token_ids == best and result.tokens == tokenizer.pieces(best)
    assert [h.text for h in result.hypotheses] == ["the cat sat", "hello world"]
    assert result.src_tokens[-1] == result.tgt_tokens[-1] == "</s>"
    assert result.tgt_tokens[:-1] == result.tokens
    assert result.truncated and result.attention is None and result.attention_maps is None


def test_attention_is_the_last_layers_cross_attention_averaged_over_heads(
    tokenizer: Tokenizer,
) -> None:
    cross = torch.rand(2, 4, 3, 5)  # (L, H, T, S)
    maps = SimpleNamespace(encoder=None, decoder=None, cross=cross)
    result = translation_result(tokenizer, [EOS_ID], [Hypothesis([], 0.0, 0.0)], maps)
    assert result.attention is not None
    assert torch.equal(result.attention, cross[-1].mean(dim=0))


def test_each_sentence_gets_its_maps_without_padding() -> None:
    layers, batch, heads, s, t = 2, 3, 4, 6, 5
    maps = SimpleNamespace(
        encoder=torch.rand(layers, batch, heads, s, s),
        decoder=None,  # a kind not asked for
        cross=torch.rand(layers, batch, heads, t, s).to(torch.bfloat16),
    )
    cut = cut_attention(maps, source_lengths=[6, 2, 4], output_lengths=[1, 5, 3])
    assert [c.encoder.shape[-2:] for c in cut] == [(6, 6), (2, 2), (4, 4)]
    assert [c.cross.shape[-2:] for c in cut] == [(1, 6), (5, 2), (3, 4)]
    assert all(c.decoder is None and c.cross.dtype == torch.float32 for c in cut)
    assert torch.equal(cut[1].cross, maps.cross[:, 1, :, :5, :2].float())


def test_results_import_no_torch() -> None:
    """The CTranslate2 backend decodes without torch, and builds these results."""
    code = "import sys, aiayn.decode.results; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
