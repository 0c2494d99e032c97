"""Tests for aiayn.interop.marian: an export that transformers loads offline and that
translates as aiayn does; an import of a Marian directory written by transformers' own
`save_pretrained` (OPUS-MT's layout: separate source/target SentencePiece models, swish, pad
as decoder start) that translates as transformers does; export → import is lossless; and what
either side cannot represent is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.decode.translator import Translator
from aiayn.model_dir import load_model_dir, read_model_config
from interop_models import CORPUS, INTEROP_MODEL, SENTENCES, split_spm_files, spm_pieces
from model_dirs import tiny_model_dir

transformers = pytest.importorskip("transformers", reason="optional: pip install -e '.[export]'")

from transformers import MarianConfig, MarianMTModel, MarianTokenizer  # noqa: E402

from aiayn.interop.marian import MarianFormatError, export_hf, import_marian  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("marian"), **INTEROP_MODEL)


@pytest.fixture(scope="module")
def hf_dir(model_dir: Path) -> Path:
    return export_hf(model_dir, model_dir.parent / "hf")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Translator:
    return Translator(model_dir)


def hf_greedy(model, tokenizer, sentence: str) -> tuple[list[int], str]:
    """transformers' greedy output (ids after the decoder start, EOS dropped) and its text,
    with aiayn's length limit: source tokens with EOS, + 50."""
    inputs = tokenizer([sentence], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, num_beams=1, max_new_tokens=inputs.input_ids.size(1) + 50)
    ids = out[0, 1:].tolist()
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    return (ids[:-1] if ids[-1] == model.config.eos_token_id else ids), text


# -- export -----------------------------------------------------------------------------------


def test_export_loads_offline_and_greedy_outputs_are_identical(hf_dir: Path, reference):
    model = MarianMTModel.from_pretrained(hf_dir, local_files_only=True).eval()
    tokenizer = MarianTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ours = reference.translate(SENTENCES, beam_size=1)
    ended = 0
    for sentence, result in zip(SENTENCES, ours, strict=True):
        if not sentence:
            continue
        assert tokenizer([sentence]).input_ids[0] == [*reference.tokenizer.encode(sentence), 3]
        ids, text = hf_greedy(model, tokenizer, sentence)
        assert ids == result.token_ids
        assert text == result.text.strip()  # MarianTokenizer strips (random outputs: tabs)
        ended += len(ids) < len(result.src_tokens) + 50
    assert ended >= 1  # not every output ran into the length limit


def test_export_logits_agree_despite_the_fixed_layer_norm_eps(hf_dir: Path, reference):
    """Marian's LayerNorm ε is 1e-5, aiayn's 1e-6: the logits differ by about 1e-6."""
    model = MarianMTModel.from_pretrained(hf_dir, local_files_only=True).eval()
    src = torch.tensor([[*reference.tokenizer.encode("the cat sat on the mat"), 3]])
    tgt = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        theirs = model(input_ids=src, decoder_input_ids=tgt).logits
        ours = reference.model(src, tgt)
    assert torch.allclose(theirs, ours, atol=1e-4)
    assert json.loads((hf_dir / "config.json").read_text())["aiayn_layer_norm_eps"] == 1e-6


def test_export_runs_in_the_translation_pipeline(hf_dir: Path, reference):
    """transformers 4's pipeline (`make test` runs this file on transformers 4 too). Its own
    default of beam 4 overrides the export's num_beams=1, so greedy is asked for."""
    try:
        translate = transformers.pipeline("translation", model=str(hf_dir))
    except KeyError as error:  # transformers 5 removed the task
        pytest.skip(f"transformers {transformers.__version__} has no translation pipeline: {error}")
    sentences = [sentence for sentence in SENTENCES if sentence]
    for sentence, result in zip(
        sentences, reference.translate(sentences, beam_size=1), strict=True
    ):
        [out] = translate([sentence], num_beams=1, max_new_tokens=len(result.src_tokens) + 50)
        assert out["translation_text"] == result.text.strip()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"norm_first": True}, "norm_first"),
        ({"positional_encoding": "learned"}, "positional_encoding"),
        ({"share_embeddings": "decoder"}, "share_embeddings"),
    ],
)
def test_export_refuses_what_marian_cannot_represent(tmp_path: Path, overrides, field):
    model_dir = tiny_model_dir(tmp_path, **{**INTEROP_MODEL, **overrides})
    with pytest.raises(MarianFormatError, match=rf"^{field} \("):
        export_hf(model_dir, tmp_path / "hf")


def test_export_then_import_is_lossless(hf_dir: Path, model_dir: Path, reference, tmp_path):
    back = import_marian(hf_dir, tmp_path / "back")
    assert read_model_config(back) == read_model_config(model_dir)
    original = load_model_dir(model_dir).model.state_dict()
    for name, tensor in load_model_dir(back).model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    translator = Translator(back)
    for options in ({"beam_size": 1}, {"beam_size": 4}):
        theirs = [r.text for r in translator.translate(SENTENCES, **options)]
        assert theirs == [r.text for r in reference.translate(SENTENCES, **options)]


# -- import -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def opus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Marian directory as OPUS-MT ships them, written by transformers itself: separate
    source/target SentencePiece models, one vocab.json with ``</s>`` 0, ``<unk>`` 1 and
    ``<pad>`` last, decoding starting with ``<pad>``, swish; random weights."""
    directory = tmp_path_factory.mktemp("opus")
    source, target = split_spm_files(directory)
    pieces = ["</s>", "<unk>", *spm_pieces(source), *spm_pieces(target)]
    pieces = [*dict.fromkeys(pieces), "<pad>"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    hf = directory / "hf"
    tokenizer = MarianTokenizer(
        source_spm=str(source), target_spm=str(target), vocab=str(directory / "vocab.json")
    )
    tokenizer.save_pretrained(hf)
    pad = len(pieces) - 1
    config = MarianConfig(
        vocab_size=len(pieces),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",
        max_position_embeddings=128,
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=None,
        bad_words_ids=[[pad]],
    )
    model = MarianMTModel(config).eval()
    # Weights drawn here, not by transformers' initialiser, which differs between versions
    # (`make test` runs this file on transformers 4 and 5); the sinusoids stay transformers'.
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() > 1 and "embed_positions" not in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)
        model.model.shared.weight[0] *= 4  # ends outputs with </s>, as tiny_model_dir does
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.forced_eos_token_id = None
    model.save_pretrained(hf)
    return hf


def test_import_translates_as_transformers_does(opus_dir: Path, tmp_path: Path):
    aiayn_dir = import_marian(opus_dir, tmp_path / "imported")
    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (aiayn_dir / name).is_file()
    assert not (aiayn_dir / "tokenizer.model").exists()
    config = read_model_config(aiayn_dir)
    assert (config.activation, config.layer_norm_eps) == ("swish", 1e-5)

    model = MarianMTModel.from_pretrained(opus_dir, local_files_only=True).eval()
    tokenizer = MarianTokenizer.from_pretrained(opus_dir, local_files_only=True)
    translator = Translator(aiayn_dir)
    ours = translator.translate(SENTENCES, beam_size=1)
    assert sum(len(r.token_ids) > 0 for r in ours) >= 3
    for sentence, result in zip(SENTENCES, ours, strict=True):
        if not sentence:
            continue
        ids, text = hf_greedy(model, tokenizer, sentence)
        assert tokenizer.convert_ids_to_tokens(ids) == result.tokens
        assert text == result.text.strip()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("activation_function", "tanh"),
        ("normalize_before", True),
        ("scale_embedding", False),
        ("static_position_embeddings", False),
        ("tie_word_embeddings", False),
        ("decoder_ffn_dim", 128),
    ],
)
def test_import_refuses_what_aiayn_cannot_represent(opus_dir: Path, tmp_path, field, value):
    changed = tmp_path / "changed"
    shutil.copytree(opus_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    config[field] = value
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(MarianFormatError, match=rf"^{field} \({value!r}\): "):
        import_marian(changed, tmp_path / "out")


def test_an_imported_model_fine_tunes_with_its_split_tokenizer(opus_dir: Path, tmp_path: Path):
    """`aiayn import` then `aiayn train --init-from`: the run carries source.spm, target.spm
    and vocab.json; targets are cut with target.spm; the result translates."""
    from aiayn.cli import main
    from aiayn.text.corpus import ParallelDataset
    from aiayn.text.tokenizer import SplitTokenizer

    imported = tmp_path / "imported"
    assert main(["import", str(opus_dir), "-o", str(imported)]) == 0
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("\n".join([*CORPUS[:3], CORPUS[6]] * 4) + "\n", encoding="utf-8")
    tgt.write_text("\n".join([*CORPUS[3:6], CORPUS[7]] * 4) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    flags = ["--src", str(src), "--tgt", str(tgt), "--valid-src", str(src), "--valid-tgt"]
    flags += [str(tgt), "--valid-bleu", "--out-dir", str(run), "--init-from", str(imported)]
    flags += ["--max-steps", "3", "--warmup-steps", "4", "--max-len", "64", "--max-tokens"]
    flags += ["256", "--valid-every", "0", "--save-every", "0", "--threads", "1", "--no-progress"]
    assert main(["train", *flags]) == 0

    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (run / "model" / name).read_bytes() == (imported / name).read_bytes()
    assert not (run / "model" / "tokenizer.model").exists()
    tokenizer = SplitTokenizer.load(run / "vocab.json")
    [cache] = (run / "data" / "train").iterdir()
    _, first_target = ParallelDataset(cache)[0]
    assert first_target.tolist() == tokenizer.encode_target(CORPUS[3])
    assert first_target.tolist() != tokenizer.encode(CORPUS[3])  # not source.spm's pieces
    assert read_model_config(run / "model") == read_model_config(imported)

    [result] = Translator(run).translate(["the cat sat"], beam_size=2)
    assert result.src_tokens[:-1] == tokenizer.pieces(tokenizer.encode("the cat sat"))

    shutil.rmtree(imported)  # a resume continues from the run's checkpoint and its tokenizer
    assert main(["train", "--resume", "--out-dir", str(run), "--max-steps", "4"]) == 0
    assert load_model_dir(run).metadata["step"] == 4
    assert main(["average", str(run), "-n", "2", "-o", str(tmp_path / "averaged")]) == 0
    assert (tmp_path / "averaged" / "vocab.json").is_file()  # the split tokenizer goes along
