"""Decoding over part of the vocabulary (`aiayn.decode.restricted`, the search's ``vocab``): the
full search restricted to the allowed ids, checked against a plain reference (the full model's
log-probabilities renormalised over them, -inf elsewhere, under the unchanged search), and the
shortlist option of `Translator`."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from aiayn.acceleration import quantize_int8
from aiayn.decode.options import DecodingOptions
from aiayn.decode.packing import pack_linear_layers
from aiayn.decode.restricted import RestrictedModel, project_onto
from aiayn.decode.search import beam_search, greedy_search, sample
from aiayn.decode.shortlist import Shortlist, build_shortlist_from_text, write_shortlist
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.model import Transformer
from aiayn.model_dir import load_model_dir
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from model_dirs import CORPUS, tiny_model_dir

IDS = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
OPTIONS = DecodingOptions(beam_size=4, max_len_b=12)
SENTENCES = ["the cat sat on the mat", "hello world", "a dog barked at the moon all night"]


class Renormalised:
    """The plain reference: the full model's log-probabilities renormalised over `vocab`,
    -inf elsewhere, for the search as it is."""

    def __init__(self, model: Transformer, vocab: Tensor) -> None:
        self.model, self.vocab = model, vocab

    def encode(self, src_tokens: Tensor) -> Any:
        return self.model.encode(src_tokens)

    def init_cache(self, memory: Any, src_key_mask: Tensor | None, max_len: int) -> Any:
        return self.model.init_cache(memory, src_key_mask, max_len)

    def decode_step(self, tokens: Tensor, cache: Any) -> Tensor:
        full = self.model.decode_step(tokens, cache)
        kept = full[:, self.vocab]
        out = torch.full_like(full, -math.inf)
        out[:, self.vocab] = kept - kept.logsumexp(dim=1, keepdim=True)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("restricted"), eos_scale=4.0)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Transformer:
    return load_model_dir(model_dir).model


@pytest.fixture(scope="module")
def src(model_dir: Path) -> Tensor:
    tokenizer = Tokenizer.load(model_dir / "tokenizer.model")
    rows = [[*tokenizer.encode(s), EOS_ID] for s in SENTENCES]
    out = torch.full((len(rows), max(map(len, rows))), PAD_ID)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def partial_vocab(model: Transformer, seed: int = 0) -> Tensor:
    """About a third of the ids, EOS among them."""
    generator = torch.Generator().manual_seed(seed)
    v = model.config.tgt_vocab_size
    keep = torch.rand(v, generator=generator) < 0.33
    keep[EOS_ID] = True
    return keep.nonzero().squeeze(1)


def test_restricted_log_probs_are_the_full_ones_renormalised(model: Transformer, src: Tensor):
    vocab = partial_vocab(model)
    models = {"float32": model, "int8": quantize_int8(model)}
    for kernel in ("mkl", "onednn"):  # where they run
        with contextlib.suppress(RuntimeError, ValueError):
            models[kernel] = pack_linear_layers(model, min_features=1, kernel=kernel)
    prev = torch.full((src.size(0),), BOS_ID)
    for name, m in models.items():
        with torch.inference_mode():
            memory, mask = m.encode(src)
            full = m.decode_step(prev, m.init_cache(memory, mask, 4))
            restricted = RestrictedModel(m, vocab)
            got = restricted.decode_step(prev, restricted.init_cache(memory, mask, 4))
        kept = full[:, vocab]
        torch.testing.assert_close(
            got, kept - kept.logsumexp(1, keepdim=True), rtol=1e-5, atol=1e-5, msg=name
        )


@pytest.mark.parametrize("per_row", [False, True])
def test_an_int8_projection_keeps_its_rows_integers(per_row: bool):
    """The int8 layer of the kept rows gives exactly the full layer's columns."""
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(32, 50, bias=not per_row))
    if not per_row:  # quantize_int8's is per row; a layer's own qconfig comes first
        linear[0].qconfig = torch.ao.quantization.default_dynamic_qconfig
    projection = quantize_int8(linear)[0]
    scheme = torch.per_channel_affine if per_row else torch.per_tensor_affine
    assert projection.weight().qscheme() == scheme
    assert isinstance(projection, torch.ao.nn.quantized.dynamic.Linear)
    vocab = torch.tensor([0, 3, 4, 17, 49])
    project = project_onto(projection, vocab)
    assert isinstance(project, torch.ao.nn.quantized.dynamic.Linear)
    assert project.out_features == len(vocab)
    x = torch.randn(6, 32)
    with torch.inference_mode():
        assert torch.equal(project(x), projection(x)[:, vocab])


def test_a_float16_dynamic_projection_keeps_its_columns():
    """Dynamic quantization to float16 is no int8 layer: every output, then the columns."""
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(32, 50, bias=False))
    projection = torch.ao.quantization.quantize_dynamic(linear, {torch.nn.Linear}, torch.float16)[0]
    vocab = torch.tensor([1, 2, 30])
    x = torch.randn(4, 32)
    with torch.inference_mode():
        assert torch.equal(project_onto(projection, vocab)(x), projection(x)[:, vocab])


@pytest.mark.parametrize("search", [beam_search, greedy_search])
def test_every_id_allowed_gives_the_full_search(model: Transformer, src: Tensor, search: Any):
    every = torch.arange(model.config.tgt_vocab_size)
    full = search(model, src, options=OPTIONS, **IDS)
    restricted = search(RestrictedModel(model, every), src, options=OPTIONS, vocab=every, **IDS)
    assert restricted == full


@pytest.mark.parametrize("search", [beam_search, greedy_search])
def test_a_partial_vocabulary_is_the_full_search_restricted(
    model: Transformer, src: Tensor, search: Any
):
    vocab = partial_vocab(model)
    got = search(RestrictedModel(model, vocab), src, options=OPTIONS, vocab=vocab, **IDS)
    expected = search(Renormalised(model, vocab), src, options=OPTIONS, **IDS)
    allowed = set(vocab.tolist())
    nested = [h if isinstance(h, list) else [h] for h in got]
    wanted = [h if isinstance(h, list) else [h] for h in expected]
    for hyps, refs in zip(nested, wanted, strict=True):
        assert [h.tokens for h in hyps] == [r.tokens for r in refs]
        for h, r in zip(hyps, refs, strict=True):
            assert set(h.tokens) <= allowed
            assert h.score == pytest.approx(r.score, rel=1e-5, abs=1e-5)
            assert h.log_prob == pytest.approx(r.log_prob, rel=1e-5, abs=1e-5)


def test_samples_are_drawn_from_the_allowed_ids(model: Transformer, src: Tensor):
    vocab = partial_vocab(model, seed=1)
    options = DecodingOptions(sampling=True, max_len_b=12)
    generator = torch.Generator().manual_seed(0)
    restricted = RestrictedModel(model, vocab)
    samples = sample(restricted, src, options=options, generator=generator, vocab=vocab, **IDS)
    assert all(set(h.tokens) <= set(vocab.tolist()) for h in samples)


def test_a_vocabulary_must_hold_eos_and_be_sorted(model: Transformer, src: Tensor):
    no_eos = torch.tensor([i for i in range(8) if i != EOS_ID])
    with pytest.raises(ValueError, match="EOS"):
        greedy_search(RestrictedModel(model, no_eos), src, vocab=no_eos, **IDS)
    unsorted = torch.tensor([5, EOS_ID])
    with pytest.raises(ValueError, match="increasing"):
        greedy_search(RestrictedModel(model, unsorted), src, vocab=unsorted, **IDS)


# -- Translator(..., shortlist=True) -------------------------------------------------------------


@pytest.fixture
def shortlisted_dir(tmp_path: Path) -> Path:
    """A tiny model directory with the shortlist of the corpus' English-German pairs."""
    directory = tiny_model_dir(tmp_path, eos_scale=4.0)
    loaded = load_model_dir(directory)
    pairs = [(CORPUS[i], CORPUS[i + 3]) for i in range(3)] + [(CORPUS[6], CORPUS[7])]
    shortlist = build_shortlist_from_text(
        pairs,
        Tokenizer.load(directory / "tokenizer.model"),
        src_vocab_size=loaded.config.src_vocab_size,
        tgt_vocab_size=loaded.config.tgt_vocab_size,
        per_source=5,
        frequent=5,
    )
    write_shortlist(directory, shortlist)
    return directory


def test_translate_with_the_shortlist_emits_only_what_it_allows(shortlisted_dir: Path):
    translator = Translator(shortlisted_dir)
    shortlist = translator.backend.shortlist
    assert shortlist is not None
    for beam_size in (1, 4):
        results = translator.translate(SENTENCES, beam_size=beam_size, max_len_b=12, shortlist=True)
        # one batch: each sentence may use what any of the batch's sources allows
        allowed = shortlist.allowed([translator.tokenizer.encode(s) for s in SENTENCES])
        assert len(allowed) < translator.models[0].config.tgt_vocab_size
        for result in results:
            assert set(result.token_ids) <= set(allowed.tolist())


def test_a_shortlist_of_every_id_translates_as_none(shortlisted_dir: Path):
    translator = Translator(shortlisted_dir)
    v = translator.models[0].config.tgt_vocab_size
    full = translator.translate(SENTENCES, max_len_b=12)
    translator.backend.shortlist = Shortlist(
        offsets=np.zeros(translator.models[0].config.src_vocab_size + 1, dtype=np.int64),
        targets=np.zeros(0, dtype=np.int32),
        always=np.arange(v, dtype=np.int32),
        tgt_vocab_size=v,
        per_source=1,
        frequent=v,
    )
    every = translator.translate(SENTENCES, max_len_b=12, shortlist=True)
    assert [(r.token_ids, r.score) for r in every] == [(r.token_ids, r.score) for r in full]


def test_the_shortlist_is_off_by_default_and_refused_without_one(tmp_path: Path):
    assert DecodingOptions().shortlist is False
    translator = Translator(tiny_model_dir(tmp_path))
    assert translator.backend.shortlist is None
    with pytest.raises(UserValueError, match="no lexical shortlist"):
        translator.translate(["hello"], shortlist=True)
    with pytest.raises(UserValueError, match="shortlist"):
        DecodingOptions(shortlist="yes")  # type: ignore[arg-type]
