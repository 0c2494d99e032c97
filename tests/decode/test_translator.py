"""Tests for aiayn.decode.translator: batching is invisible (sorted, budgeted, order restored),
cached
decoding equals a from-scratch loop, attention equals a teacher-forced pass, long inputs are
truncated, and model directories that cannot be loaded fail clearly.

The models have random weights: outputs are garbage but deterministic, which is all these
properties need.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiayn import acceleration
from aiayn.attention import MultiHeadAttention, fused_attention
from aiayn.decode import search
from aiayn.decode.costs import DecodingCosts
from aiayn.decode.search import DecodingOptions
from aiayn.decode.translator import Translator, one_line, read_lines
from aiayn.model import Transformer
from aiayn.model_dir import CheckpointError, save_model_dir
from aiayn.text.corpus import DataError
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from model_dirs import CORPUS, EN_DE, tiny_model, train_tokenizer

SENTENCES = [
    "the cat sat",
    "",
    "a dog barked at the moon all night and the cat sat on the mat",
    "hello",
    "   ",
    "wir übersetzen kurze sätze",
    "the mat",
]
FAST = {"max_len_b": 6}  # random models rarely emit EOS: keep outputs short


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), CORPUS)


def build_model(tokenizer: Tokenizer, **overrides: object) -> Transformer:
    return tiny_model(
        tokenizer.vocab_size, preset="tiny", seed=1234, **{"max_positions": 64, **overrides}
    )


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> Transformer:
    return build_model(tokenizer)


@pytest.fixture(scope="module")
def translator(model: Transformer, tokenizer: Tokenizer) -> Translator:
    return Translator.from_model(model, tokenizer)


@pytest.fixture(scope="module")
def model_dir(
    tmp_path_factory: pytest.TempPathFactory, model: Transformer, tokenizer: Tokenizer
) -> Path:
    directory = tmp_path_factory.mktemp("models") / "model"
    save_model_dir(directory, model, tokenizer_file=tokenizer.model_file, metadata=EN_DE)
    return directory


def assert_same_results(actual: list, expected: list) -> None:
    """Same texts and tokens; scores equal up to float32 rounding (1e-5, relative for sums)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.text == e.text
        assert a.token_ids == e.token_ids
        assert a.score == pytest.approx(e.score, rel=1e-6, abs=1e-5)
        assert a.log_prob == pytest.approx(e.log_prob, rel=1e-6, abs=1e-5)
        assert [h.token_ids for h in a.hypotheses] == [h.token_ids for h in e.hypotheses]


# -- batching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("beam_size", [4, 1], ids=["beam", "greedy"])
def test_batched_translation_equals_one_sentence_at_a_time(
    translator: Translator, beam_size: int
) -> None:
    batched = translator.translate(SENTENCES, beam_size=beam_size, **FAST)
    alone = [translator.translate([s], beam_size=beam_size, **FAST)[0] for s in SENTENCES]
    assert_same_results(batched, alone)
    assert [r.text for r in batched if r.token_ids]  # the model did run


def test_input_order_is_restored(translator: Translator) -> None:
    forward = translator.translate(SENTENCES, **FAST)
    backward = translator.translate(SENTENCES[::-1], **FAST)
    assert_same_results(backward[::-1], forward)
    # Sources differ, so (with random weights) their outputs differ: order is observable.
    assert len({tuple(r.token_ids) for r in forward if r.token_ids}) > 1


def test_a_small_token_budget_splits_batches_without_changing_results(
    model: Transformer, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = search.beam_search

    def spy(model: Transformer, src_tokens: torch.Tensor, **kwargs: object) -> list:
        calls.append(src_tokens.size(0))
        return real(model, src_tokens, **kwargs)

    monkeypatch.setattr(search, "beam_search", spy)
    one_batch = Translator.from_model(model, tokenizer).translate(SENTENCES, **FAST)
    assert calls == [5]  # the five non-blank sentences
    calls.clear()
    several = Translator.from_model(model, tokenizer, max_tokens=40).translate(SENTENCES, **FAST)
    assert len(calls) > 1 and sum(calls) == 5
    assert_same_results(several, one_batch)


def test_blank_sentences_give_empty_results_without_running_the_model(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(search, "beam_search", fail)
    results = translator.translate(["", "  ", "\t"], n_best=2)
    assert [r.text for r in results] == ["", "", ""]
    assert all(r.hypotheses[0].text == "" and r.attention is None for r in results)
    assert translator.translate([]) == []


def test_translate_iterable_keeps_order_across_chunks(translator: Translator) -> None:
    expected = translator.translate(SENTENCES, **FAST)
    streamed = list(translator.translate_iterable(iter(SENTENCES), chunk_size=2, **FAST))
    assert_same_results(streamed, expected)


# -- search -----------------------------------------------------------------------------------


def reference_greedy(model: Transformer, src_ids: list[int], max_len: int) -> tuple[list, float]:
    """Greedy decoding that recomputes `model(src, prefix)` from scratch at every step."""
    src = torch.tensor([src_ids])
    prefix, log_prob = [BOS_ID], 0.0
    for step in range(max_len + 1):
        with torch.no_grad():
            log_probs = F.log_softmax(model(src, torch.tensor([prefix]))[0, -1].float(), dim=-1)
        log_probs[[PAD_ID, BOS_ID]] = -math.inf
        token = EOS_ID if step == max_len else int(log_probs.argmax())
        log_prob += float(log_probs[token])
        if token == EOS_ID:
            break
        prefix.append(token)
    return prefix[1:], log_prob


def test_cached_greedy_decoding_equals_an_uncached_loop(
    translator: Translator, model: Transformer, tokenizer: Tokenizer
) -> None:
    sentences = [s for s in SENTENCES if s.strip()]
    results = translator.translate(sentences, beam_size=1, max_len_b=10)
    for sentence, result in zip(sentences, results, strict=True):
        src_ids = source_ids(translator, sentence)
        tokens, log_prob = reference_greedy(model, src_ids, max_len=len(src_ids) + 10)
        assert result.token_ids == tokens
        assert result.log_prob == pytest.approx(log_prob, abs=1e-4)
        assert result.score == result.log_prob  # no length penalty in greedy search


def test_beam_scores_equal_a_teacher_forced_pass(
    translator: Translator, model: Transformer
) -> None:
    results = translator.translate(SENTENCES, n_best=3, **FAST)
    for sentence, result in zip(SENTENCES, results, strict=True):
        if not sentence.strip():
            continue
        src = torch.tensor([source_ids(translator, sentence)])
        for hyp in result.hypotheses:
            tgt = torch.tensor([[BOS_ID, *hyp.token_ids]])
            with torch.no_grad():
                log_probs = F.log_softmax(model(src, tgt)[0].float(), dim=-1)  # (T, V)
            labels = torch.tensor([*hyp.token_ids, EOS_ID])
            log_prob = float(log_probs.gather(1, labels[:, None]).sum())
            assert hyp.log_prob == pytest.approx(log_prob, abs=1e-4)
            penalty = (len(hyp.token_ids) + 1) ** 1.0  # the default: |Y|^1, EOS counted
            assert hyp.score == pytest.approx(hyp.log_prob / penalty, abs=1e-5)


def source_ids(translator: Translator, sentence: str) -> list[int]:
    return [*translator.tokenizer.encode(sentence), EOS_ID]


def test_n_best_lists_are_sorted_and_headed_by_the_result(translator: Translator) -> None:
    [result] = translator.translate(["the cat sat on the mat"], beam_size=4, n_best=3, **FAST)
    scores = [h.score for h in result.hypotheses]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    best = result.hypotheses[0]
    assert (best.text, best.token_ids, best.score) == (result.text, result.token_ids, result.score)
    assert best.tokens == result.tokens == translator.tokenizer.pieces(result.token_ids)


def test_sampling_is_reproducible_with_a_seed(translator: Translator) -> None:
    options = dict(sampling=True, n_best=3, seed=7, top_k=20, **FAST)
    first = translator.translate(SENTENCES, **options)
    again = translator.translate(SENTENCES, **options)
    assert_same_results(again, first)
    for result in first:
        scores = [h.log_prob for h in result.hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len(result.hypotheses) == (3 if result.token_ids else 1)


# -- attention --------------------------------------------------------------------------------


def test_attention_equals_a_teacher_forced_pass(translator: Translator, model: Transformer) -> None:
    results = translator.translate(SENTENCES, return_attention=True, **FAST)
    cfg = model.config
    for sentence, result in zip(SENTENCES, results, strict=True):
        if not sentence.strip():
            assert result.attention is None and result.attention_maps is None
            continue
        src_ids = source_ids(translator, sentence)
        assert result.src_tokens == translator.tokenizer.pieces(src_ids)
        s, t = len(src_ids), len(result.token_ids) + 1
        assert result.src_tokens[-1] == result.tgt_tokens[-1] == "</s>"
        assert len(result.tgt_tokens) == t
        maps = result.attention_maps
        assert maps.encoder.shape == (cfg.n_encoder_layers, cfg.n_heads, s, s)
        assert maps.decoder.shape == (cfg.n_decoder_layers, cfg.n_heads, t, t)
        assert maps.cross.shape == (cfg.n_decoder_layers, cfg.n_heads, t, s)
        assert result.attention.shape == (t, s)
        torch.testing.assert_close(result.attention.sum(-1), torch.ones(t))
        # Alone, without the batch's padding.
        src = torch.tensor([src_ids])
        tgt = torch.tensor([[BOS_ID, *result.token_ids]])
        with torch.no_grad():
            _, expected = model.forward_with_attention(src, tgt)
        torch.testing.assert_close(maps.encoder, expected.encoder[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(maps.decoder, expected.decoder[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(maps.cross, expected.cross[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            result.attention, expected.cross[-1, 0].mean(0), atol=1e-5, rtol=0
        )


def test_attention_does_not_change_the_translation(translator: Translator) -> None:
    plain = translator.translate(SENTENCES, **FAST)
    with_attention = translator.translate(SENTENCES, return_attention=True, **FAST)
    assert_same_results(with_attention, plain)


# -- long inputs ------------------------------------------------------------------------------


def test_long_sentences_are_truncated_with_a_warning(
    translator: Translator, caplog: pytest.LogCaptureFixture
) -> None:
    long = " ".join(CORPUS * 4)
    with caplog.at_level(logging.WARNING, logger="aiayn.decode.sources"):
        results = translator.translate(["the cat", long], beam_size=1, max_len_b=2)
    assert not results[0].truncated and results[1].truncated
    assert len(results[1].src_tokens) == translator.model.config.max_positions  # + </s>
    assert "sentence 2 has" in caplog.text and "first 63 tokens" in caplog.text


@pytest.mark.parametrize("options", [DecodingOptions(), DecodingOptions(beam_size=1)])
def test_batches_are_those_translate_runs(tokenizer: Tokenizer, options: DecodingOptions) -> None:
    """Longest first, within the budget of padded source tokens × rows, blank ones in none;
    translating a batch alone runs it as one model call."""
    translator = Translator.from_model(build_model(tokenizer), tokenizer, max_tokens=40)
    batches = translator.batches(SENTENCES, options)
    assert sorted(i for batch in batches for i in batch) == [0, 2, 3, 5, 6]
    pricing = DecodingCosts(translator.tokenizer, translator.source_limits)
    costs = pricing.costs(SENTENCES, options.rows_per_sentence)
    for batch in batches:
        assert len(batch) * max(costs[i] for i in batch) <= 40 or len(batch) == 1
    widths = [costs[batch[0]] for batch in batches]
    assert widths == sorted(widths, reverse=True) and len(batches) > 1
    calls = []
    for batch in batches:
        translator.translate([SENTENCES[i] for i in batch], options, progress=calls.append, **FAST)
    assert calls == [len(batch) for batch in batches]


def test_batches_count_a_long_sentence_as_truncated(tokenizer: Tokenizer) -> None:
    """A sentence cut to max_positions − 1 tokens is batched by the ids translate feeds the
    model, not by its length before the cut."""
    model = build_model(tokenizer, max_positions=16)
    translator = Translator.from_model(model, tokenizer, max_tokens=40)
    sentences = [" ".join(CORPUS), "the cat"]  # the first: far more than 15 tokens
    calls: list[int] = []
    translator.translate(sentences, beam_size=1, max_len_b=2, progress=calls.append)
    assert calls == [2]  # 2 × 16 padded ids fit 40: one call
    assert translator.batches(sentences, DecodingOptions(beam_size=1)) == [[0, 1]]


def test_learned_positions_cap_the_output_length(tokenizer: Tokenizer) -> None:
    model = build_model(tokenizer, positional_encoding="learned", max_positions=12)
    translator = Translator.from_model(model, tokenizer)
    long = " ".join(CORPUS)
    # "the cat" may produce len + 3 tokens; the long one would need far more than 11 positions.
    results = translator.translate(["the cat", long], beam_size=2, max_len_b=3)
    assert results[1].truncated and len(results[1].src_tokens) == 12
    assert len(results[1].token_ids) <= 11
    assert len(results[0].token_ids) <= len(results[0].src_tokens) + 3


# -- options and construction -----------------------------------------------------------------


def test_options_are_checked(translator: Translator) -> None:
    with pytest.raises(ValueError, match=r"n_best \(5\) must be <= beam_size \(4\)"):
        translator.translate(["x"], n_best=5)
    with pytest.raises(ValueError, match="length_penalty_kind"):
        translator.translate(["x"], length_penalty_kind="linear")
    with pytest.raises(ValueError, match="beam_size"):
        translator.translate(["x"], beam_size=0)
    with pytest.raises(ValueError, match="top_p"):
        translator.translate(["x"], sampling=True, top_p=0)
    with pytest.raises(TypeError, match="not a single string"):
        translator.translate("a sentence")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="beam_sise"):
        translator.translate(["x"], beam_sise=2)
    with pytest.raises(ValueError, match=r"temperature \(0\)"):
        list(translator.translate_iterable(["x"], sampling=True, temperature=0))


def test_options_and_keyword_overrides_are_the_same_request(translator: Translator) -> None:
    by_keywords = translator.translate(SENTENCES, beam_size=2, n_best=2, **FAST)
    by_options = translator.translate(SENTENCES, DecodingOptions(beam_size=2, n_best=2, **FAST))
    assert_same_results(by_options, by_keywords)
    overridden = translator.translate(SENTENCES, DecodingOptions(beam_size=2, n_best=2), **FAST)
    assert_same_results(overridden, by_keywords)


def test_translate_restores_the_training_mode(model: Transformer, tokenizer: Tokenizer) -> None:
    model.train()
    try:
        Translator.from_model(model, tokenizer).translate(["the cat"], beam_size=1, max_len_b=2)
        assert model.training
    finally:
        model.eval()


def test_a_search_on_a_cpu_runs_the_cpu_attention_kernels_and_leaves_the_model_its_own(
    model: Transformer, tokenizer: Tokenizer, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding opts in to `acceleration.cpu_attention` (a decoding step's few queries take two
    bmm): for the models it loads for good, for a model it is given during each search only."""
    queries: list[int] = []
    real = acceleration.cpu_attention

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        queries.append(q.size(-2))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(acceleration, "cpu_attention", counted)
    Translator.from_model(model, tokenizer).translate(["the cat"], beam_size=2, max_len_b=2)
    assert 1 in queries  # decoder self-attention at a step: one query per hypothesis
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert {m.kernel for m in attentions} == {fused_attention}
    loaded = Translator(model_dir).model
    assert {m.kernel for m in loaded.modules() if isinstance(m, MultiHeadAttention)} == {counted}


def test_a_model_directory_loads_and_translates_like_the_model(
    model_dir: Path, translator: Translator
) -> None:
    loaded = Translator(model_dir)
    assert loaded.metadata["tgt_lang"] == "de"
    assert_same_results(
        loaded.translate(SENTENCES, **FAST), translator.translate(SENTENCES, **FAST)
    )


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model directory not found"):
        Translator(tmp_path / "nope")


def test_incomplete_model_directory_is_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in model_dir.iterdir():
        if file.name != "model.safetensors":
            (broken / file.name).write_bytes(file.read_bytes())
    with pytest.raises(CheckpointError, match=r"missing model\.safetensors"):
        Translator(broken)


# -- lines ------------------------------------------------------------------------------------


def test_read_lines_names_the_line_of_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes("\ufeffok\r\n\nzwei\n".encode() + b"dr\xffei\n")
    lines = read_lines(path)
    assert [next(lines), next(lines), next(lines)] == ["ok", "", "zwei"]
    with pytest.raises(DataError, match=r"in\.txt:4: invalid UTF-8"):
        next(lines)


def test_one_line_removes_line_breaks() -> None:
    assert one_line("a\nb\r\nc") == "a b  c"


def test_int8_quantizes_every_linear_layer_and_stays_close_to_fp32(
    model_dir: Path, model: Transformer
) -> None:
    from aiayn.acceleration import quantize_int8

    quantized = quantize_int8(model)
    linears = [m for m in quantized.modules() if type(m) is torch.nn.Linear]
    assert linears == []  # every nn.Linear was replaced by its dynamic int8 version
    assert any(type(p) is torch.nn.Linear for p in model.modules())  # the original is intact
    src = torch.tensor([[5, 6, 7, 8, EOS_ID]])
    tgt = torch.tensor([[BOS_ID, 9, 10, 11]])
    with torch.inference_mode():
        reference = model.eval()(src, tgt).log_softmax(-1)
        approx = quantized(src, tgt).log_softmax(-1)
    assert not torch.equal(reference, approx)
    torch.testing.assert_close(approx, reference, atol=0.01, rtol=0.03)  # within 3%
    int8 = Translator(model_dir, int8=True)
    assert all(  # --int8 quantizes self-attention's W^Q, W^K, W^V as one product
        type(layer.self_attn.qkv_proj) is torch.ao.nn.quantized.dynamic.Linear
        for layer in [*int8.model.encoder.layers, *int8.model.decoder.layers]
    )
    [result] = int8.translate(["hello world"], beam_size=2)
    assert isinstance(result.text, str)
    in_place = copy.deepcopy(model)
    assert quantize_int8(in_place, in_place=True) is in_place  # a translator's own model
    assert [type(m) for m in in_place.modules()] == [type(m) for m in quantized.modules()]
    with torch.inference_mode():
        torch.testing.assert_close(in_place(src, tgt).log_softmax(-1), approx)


def test_a_cpu_translator_packs_its_linear_layers_for_onednn_or_mkl(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--onednn: oneDNN's packed weights; --no-onednn: MKL's, stored transposed; by default on
    an AMD CPU, oneDNN's for the pre-softmax projection and MKL's for the rest. The same outputs
    every way."""
    from aiayn.acceleration import onednn_linear_missing
    from aiayn.decode import packing
    from aiayn.decode.packing import PackedLinear, mkl_missing

    if onednn_linear_missing() is not None or mkl_missing() is not None:
        pytest.skip(onednn_linear_missing() or mkl_missing())

    def kernels(translator: Translator) -> set[str]:
        return {m.kernel for m in translator.model.modules() if type(m) is PackedLinear}

    assert kernels(Translator(model_dir)) == set()  # the tiny model's layers: too small
    monkeypatch.setattr(packing, "MIN_PACKED_FEATURES", 1)  # the tiny model's layers too
    packed = Translator(model_dir, onednn=True)
    plain = Translator(model_dir, onednn=False)
    assert kernels(packed) == {"onednn"} and kernels(plain) == {"mkl"}
    monkeypatch.setattr(packing, "cpu_vendor", lambda: "AuthenticAMD")  # the mix
    default = Translator(model_dir)
    assert default.model.output_projection.kernel == "onednn"
    others = [m for m in default.model.modules() if type(m) is PackedLinear]
    assert {m.kernel for m in others if m is not default.model.output_projection} == {"mkl"}
    for beam_size in (4, 1):
        expected = plain.translate(SENTENCES, beam_size=beam_size, **FAST)
        assert_same_results(default.translate(SENTENCES, beam_size=beam_size, **FAST), expected)
        assert_same_results(packed.translate(SENTENCES, beam_size=beam_size, **FAST), expected)
        assert_same_results(packed.translate(SENTENCES, beam_size=beam_size, **FAST), expected)
    [with_maps] = packed.translate(["hello world"], beam_size=2, return_attention=True)
    assert with_maps.attention is not None


def test_int8_is_refused_off_the_cpu(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="CPU only"):
        Translator(model_dir, device="cuda", int8=True)


def test_bf16_runs_the_model_in_bfloat16_and_stays_close_to_fp32(
    model_dir: Path, model: Transformer
) -> None:
    bf16 = Translator(model_dir, bf16=True)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    src = torch.tensor([[5, 6, 7, 8, EOS_ID]])
    with torch.inference_mode():
        reference = model.eval()
        memory, mask = reference.encode(src)
        expected = reference.decode_step(
            torch.tensor([BOS_ID]), reference.init_cache(memory, mask, 2)
        )
        memory, mask = bf16.model.encode(src)
        got = bf16.model.decode_step(torch.tensor([BOS_ID]), bf16.model.init_cache(memory, mask, 2))
    assert got.dtype == torch.float32  # log-probabilities in float32 whatever the model's dtype
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    [result] = bf16.translate(["hello world"], beam_size=2, return_attention=True)
    assert isinstance(result.text, str) and result.attention is not None


def test_int8_and_bf16_are_exclusive(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="one of int8 and bf16"):
        Translator(model_dir, int8=True, bf16=True)
