"""`ModelConfig.target_side_output`: the pre-softmax projection scores only the target side's
pieces (a fixed bias of `OUTSIDE_TARGET_SIDE` for the others). Its loss over those rows alone
is the whole logits' loss with the bias; a run counts the pieces from its targets, keeps them on
resume; decoding restricted to them is the full search; the exports carry the bias."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.config import ConfigError, preset
from aiayn.decode.backends.pytorch import PyTorchBackend
from aiayn.decode.translator import Translator
from aiayn.loss import label_smoothed_loss
from aiayn.model import OUTSIDE_TARGET_SIDE, Transformer
from aiayn.model_dir import load_model_dir, save_model_dir
from aiayn.text.tokenizer import EOS_ID, PAD_ID, Tokenizer
from interop_models import INTEROP_MODEL
from model_dirs import tiny_model_dir
from train.test_trainer import cli_args, make_config


def test_the_loss_over_the_target_side_is_the_whole_logits_loss_with_the_bias():
    model = Transformer(preset("tiny", src_vocab_size=50, target_side_output=True)).eval()
    side = torch.tensor([EOS_ID, 5, 7, 9, 11, 20, 30, 40])
    model.set_target_side(side)
    assert model.target_side().tolist() == [PAD_ID, *side.tolist()]
    assert not model.output_projection.bias.requires_grad
    src, shifted = torch.randint(4, 50, (3, 6)), torch.randint(4, 50, (3, 5))
    target = side[torch.randint(0, len(side), (3, 5))]
    target[0, -1] = PAD_ID
    target[1, 2] = 13  # outside the target side (validation data only): left out as padding

    sums = model(src, shifted, target, label_smoothing=0.1)
    sums.loss.backward()
    chunked = model.tgt_embed.embedding.weight.grad.clone()
    model.zero_grad()
    allowed = model.output_projection.bias == 0
    kept = torch.where(allowed[target], target, PAD_ID)
    plain = label_smoothed_loss(
        model(src, shifted), kept, epsilon=0.1, pad_id=PAD_ID, allowed=allowed
    )
    plain.loss.backward()
    torch.testing.assert_close(sums.loss, plain.loss)
    torch.testing.assert_close(sums.nll, plain.nll)
    assert sums.n_tokens == plain.n_tokens == 13
    torch.testing.assert_close(chunked, model.tgt_embed.embedding.weight.grad)
    # The pieces outside have probability 0 in float32, their log-probability finite.
    log_probs = model(src, shifted).log_softmax(-1)
    assert bool((log_probs.exp()[..., ~allowed] == 0).all())
    assert bool(log_probs.isfinite().all())


def test_a_model_without_it_has_no_bias_and_scores_every_piece():
    model = Transformer(preset("tiny", src_vocab_size=50))
    assert model.output_projection.bias is None and model.target_side() is None
    with pytest.raises(ValueError, match="target_side_output is False"):
        model.set_target_side(torch.tensor([EOS_ID]))


def test_bpe_dropout_is_refused_beside_it(tmp_path: Path):
    corpus = (tmp_path / "a", tmp_path / "b")
    with pytest.raises(ConfigError, match="target_side_output needs bpe_dropout 0"):
        make_config(corpus, tmp_path, bpe_dropout=0.1, model={"target_side_output": True})


def _split_corpus(directory: Path, n: int = 48) -> tuple[Path, Path]:
    """Sources of the letters a–l, targets of m–x: the two sides share no piece."""
    rng = random.Random(0)
    src, tgt = directory / "train.src", directory / "train.tgt"
    src_lines, tgt_lines = [], []
    for _ in range(n):
        k = rng.randint(3, 6)
        src_lines.append(" ".join(rng.choices("abcdefghijkl", k=k)))
        tgt_lines.append(" ".join(rng.choices("mnopqrstuvwx", k=k)))
    src.write_text("".join(f"{line}\n" for line in src_lines), encoding="utf-8")
    tgt.write_text("".join(f"{line}\n" for line in tgt_lines), encoding="utf-8")
    return src, tgt


def test_a_run_scores_its_targets_pieces_keeps_them_on_resume_and_decodes_over_them(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
):
    corpus = _split_corpus(tmp_path)
    run = tmp_path / "run"
    values = dict(model={"target_side_output": True}, valid_src=str(corpus[0]))
    values |= dict(valid_tgt=str(corpus[1]), max_steps=4, save_every=2)
    assert main(cli_args(make_config(corpus, run, **values))) == 0
    tokenizer = Tokenizer.load(run / "tokenizer.model")
    lines = corpus[1].read_text(encoding="utf-8").splitlines()
    counted = {i for ids in tokenizer.encode_batch(lines) for i in ids} | {EOS_ID, PAD_ID}
    side = load_model_dir(run / "model").model.target_side().tolist()
    assert side == sorted(counted)
    assert {i for ids in tokenizer.encode_batch(["a b c"]) for i in ids} - set(side)  # a, b, c

    values["max_steps"] = 6
    assert main([*cli_args(make_config(corpus, run, **values)), "--resume"]) == 0
    resumed = load_model_dir(run / "model").model
    assert resumed.target_side().tolist() == side
    assert set(resumed.output_projection.bias.tolist()) == {0.0, OUTSIDE_TARGET_SIDE}
    assert "outside the target side" not in caplog.text

    # Validation targets given anew on resume, of pieces outside the side: said, not hidden.
    values |= dict(max_steps=7, valid_tgt=str(corpus[0]))
    assert main([*cli_args(make_config(corpus, run, **values)), "--resume"]) == 0
    assert "outside the target side the output layer scores" in caplog.text

    # Fine-tuning it with BPE-dropout is refused in one line, before anything is written.
    finetune = make_config(
        corpus, tmp_path / "ft", vocab_size=tokenizer.vocab_size, bpe_dropout=0.1, model={}
    )
    assert main([*cli_args(finetune), "--init-from", str(run / "model")]) == 2
    assert "cannot fine-tune" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "ft").exists()

    # Decoding restricted to the target side (the loader's) is the search over every piece,
    # in float32 and in int8 (its quantized projection's rows).
    for int8 in (False, True):
        restricted = Translator(run / "model", onednn=False, int8=int8)
        backend = restricted.backend
        assert backend.target_side.tolist() == side
        whole = PyTorchBackend(backend.models)  # the same (packed) model, every piece scored
        assert whole.target_side is None
        sources = ["a b c d", "e f g", "h i j k l"]
        for beam_size in (1, 4):
            ours = restricted.translate(sources, beam_size=beam_size)
            restricted.backend = whole
            full = restricted.translate(sources, beam_size=beam_size)
            restricted.backend = backend
            assert [r.token_ids for r in ours] == [r.token_ids for r in full], int8
            for a, b in zip(ours, full, strict=True):
                assert a.score == pytest.approx(b.score, abs=1e-4)
                assert set(a.token_ids) <= set(side)


def test_a_target_side_of_every_piece_decodes_as_the_plain_search():
    model = Transformer(preset("tiny", src_vocab_size=50, target_side_output=True)).eval()
    every = torch.arange(model.config.tgt_vocab_size)
    model.set_target_side(every)
    backend = PyTorchBackend([model], target_side=model.target_side())
    assert backend.target_side is None and backend._decoder is model


def test_the_target_side_of_a_model_made_in_inference_mode():
    with torch.inference_mode():
        model = Transformer(preset("tiny", src_vocab_size=50, target_side_output=True))
        assert model.output_projection.bias.is_inference()
        assert len(model.target_side()) == model.config.tgt_vocab_size  # a zero bias: all
        model.set_target_side(torch.tensor([EOS_ID, 5, 7]))
        assert model.target_side().tolist() == [PAD_ID, EOS_ID, 5, 7]


def _side_model_dir(directory: Path) -> Path:
    """A tiny random model directory whose target side is the pieces of German lines."""
    model_dir = tiny_model_dir(directory, target_side_output=True, **INTEROP_MODEL)
    loaded = load_model_dir(model_dir)
    tokenizer = Tokenizer.load(loaded.tokenizer_file)
    german = ["die katze sass auf der matte", "hallo welt, das ist ein kleiner test"]
    ids = sorted({i for ids in tokenizer.encode_batch(german) for i in ids} | {EOS_ID})
    loaded.model.set_target_side(torch.tensor(ids))
    return save_model_dir(model_dir, loaded.model, tokenizer_file=loaded.tokenizer_file)


def test_the_ctranslate2_export_carries_the_bias(tmp_path: Path):
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.interop.ctranslate2 import CTranslate2Translator, export_ctranslate2

    model_dir = _side_model_dir(tmp_path)
    export = export_ctranslate2(model_dir, tmp_path / "ct2")
    side = set(load_model_dir(model_dir).model.target_side().tolist())
    sources = ["the cat sat on the mat", "hello world", "we translate"]
    ours = Translator(model_dir, onednn=False).translate(sources, beam_size=1)
    theirs = CTranslate2Translator(export).translate(sources, beam_size=1)
    assert [r.token_ids for r in theirs] == [r.token_ids for r in ours]
    assert all(set(r.token_ids) <= side for r in ours)


def test_the_hf_marian_export_carries_the_bias_and_imports_back(tmp_path: Path):
    pytest.importorskip("transformers", reason="optional: pip install -e '.[export]'")
    from aiayn.interop.marian import export_hf, import_marian

    model_dir = _side_model_dir(tmp_path)
    hf_dir = export_hf(model_dir, tmp_path / "hf")
    back = load_model_dir(import_marian(hf_dir, tmp_path / "back")).model
    original = load_model_dir(model_dir).model
    assert back.config.target_side_output
    assert torch.equal(back.output_projection.bias, original.output_projection.bias)


def test_a_marian_bias_that_leaves_out_end_of_sentence_is_refused(tmp_path: Path):
    pytest.importorskip("transformers", reason="optional: pip install -e '.[export]'")
    from transformers import MarianMTModel

    from aiayn.interop.marian import MarianFormatError, export_hf, import_marian

    hf_dir = export_hf(_side_model_dir(tmp_path), tmp_path / "hf")
    hf = MarianMTModel.from_pretrained(hf_dir, local_files_only=True)
    hf.final_logits_bias[0, hf.config.eos_token_id] = OUTSIDE_TARGET_SIDE
    hf.save_pretrained(hf_dir)
    with pytest.raises(MarianFormatError, match=r"^final_logits_bias: a target side must score"):
        import_marian(hf_dir, tmp_path / "back")
