"""Tests for aiayn.text.tokenizer: a real SentencePiece model trained on a tiny generated corpus."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import sentencepiece as spm

from aiayn.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SplitTokenizer,
    Tokenizer,
    TokenizerError,
    stripped,
)
from interop_models import split_tokenizer_files

EN_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "dog",
    "runs",
    "fast",
    "over",
    "old",
    "bridge",
    "twenty",
    "one",
]
DE_WORDS = [
    "der",
    "Hund",
    "läuft",
    "schnell",
    "über",
    "die",
    "alte",
    "Brücke",
    "einundzwanzig",
    "Straße",
    "Katze",
]
ES_WORDS = ["¿Qué?", "¡Hola!", "mañana", "niño", "año", "corazón"]


def write_corpus(path: Path, words: list[str], n_lines: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = (" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(n_lines))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    return [
        write_corpus(root / "train.en", EN_WORDS, 300, seed=1),
        write_corpus(root / "train.de", DE_WORDS + ES_WORDS, 300, seed=2),
    ]


@pytest.fixture(scope="module")
def tokenizer(corpus: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_file = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return Tokenizer.train(corpus, model_file, vocab_size=400)


def test_special_ids_are_fixed(tokenizer: Tokenizer) -> None:
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tokenizer.pieces([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]


def test_train_writes_model_and_vocab(tokenizer: Tokenizer) -> None:
    assert tokenizer.model_file.is_file()
    vocab_lines = tokenizer.model_file.with_suffix(".vocab").read_text("utf-8").splitlines()
    assert len(vocab_lines) == tokenizer.vocab_size
    assert vocab_lines[0].split("\t")[0] == "<pad>"


@pytest.mark.parametrize(
    "text",
    [
        "the cat sat on a mat",
        "der Hund läuft über die Brücke",
        "einundzwanzig",
        "¿Qué? ¡Hola! mañana",
        "unseen chars: 😀 ж 漢字 ω",
        "",
    ],
)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_unseen_characters_do_not_become_unk(tokenizer: Tokenizer) -> None:
    # Byte fallback: an emoji is encoded as its UTF-8 bytes, never <unk>.
    assert UNK_ID not in tokenizer.encode("😀")


def test_unseen_characters_without_byte_fallback_map_to_unk(
    corpus: list[Path], tmp_path: Path
) -> None:
    tok = Tokenizer.train(corpus, tmp_path / "t.model", vocab_size=120, byte_fallback=False)
    ids = tok.encode("cat 😀")
    assert UNK_ID in ids
    assert "cat" in tok.decode(ids)


def test_max_piece_length_bounds_every_piece(corpus: list[Path], tmp_path: Path) -> None:
    """The default allows long pieces on this corpus; a bound of 4 keeps every piece ≤ 4."""
    kwargs = dict(vocab_size=200, byte_fallback=False)
    default = Tokenizer.train(corpus, tmp_path / "a.model", **kwargs)
    bounded = Tokenizer.train(corpus, tmp_path / "b.model", max_piece_length=4, **kwargs)

    def longest(tok: Tokenizer) -> int:
        pieces = tok.pieces(range(4, tok.vocab_size))  # the special pieces excluded
        return max(len(piece) for piece in pieces)

    assert longest(default) > 4
    assert longest(bounded) <= 4
    with pytest.raises(TokenizerError, match=r"max_piece_length \(0\) must be at least 1"):
        Tokenizer.train(corpus, tmp_path / "c.model", max_piece_length=0, **kwargs)


def test_encode_adds_no_bos_or_eos(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the cat")
    assert BOS_ID not in ids and EOS_ID not in ids


def test_encode_batch_matches_encode(tokenizer: Tokenizer) -> None:
    texts = ["the cat", "", "der Hund läuft", "¿Qué?"]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode_batch([]) == []


def test_decode_skips_pad_bos_eos_but_does_not_stop_at_eos(tokenizer: Tokenizer) -> None:
    a, b = tokenizer.encode("the cat"), tokenizer.encode("der Hund")
    ids = [BOS_ID, *a, EOS_ID, *b, EOS_ID, PAD_ID, PAD_ID]
    assert tokenizer.decode(ids) == tokenizer.decode(a + b)
    assert "Hund" in tokenizer.decode(ids)


def test_decode_rejects_out_of_range_ids(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_pieces_concatenate_to_the_text(tokenizer: Tokenizer) -> None:
    pieces = tokenizer.pieces(tokenizer.encode("the cat sat"))
    assert "".join(pieces).replace("▁", " ").strip() == "the cat sat"


def test_training_is_deterministic(corpus: list[Path], tmp_path: Path) -> None:
    a = Tokenizer.train(corpus, tmp_path / "a.model", vocab_size=300, max_sentences=200, seed=3)
    b = Tokenizer.train(corpus, tmp_path / "b.model", vocab_size=300, max_sentences=200, seed=3)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.sha256 == b.sha256


def test_load_reproduces_the_trained_model(tokenizer: Tokenizer) -> None:
    loaded = Tokenizer.load(tokenizer.model_file)
    assert loaded.vocab_size == tokenizer.vocab_size
    assert loaded.sha256 == tokenizer.sha256
    text = "der Hund 😀 einundzwanzig"
    assert loaded.encode(text) == tokenizer.encode(text)


def test_sha256_is_the_hash_of_the_file(tokenizer: Tokenizer) -> None:
    import hashlib

    assert tokenizer.sha256 == hashlib.sha256(tokenizer.model_file.read_bytes()).hexdigest()


def test_too_large_vocab_warns_and_shrinks(
    corpus: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="aiayn.text.tokenizer"):
        tok = Tokenizer.train(corpus, tmp_path / "t.model", vocab_size=50_000)
    assert tok.vocab_size < 50_000
    assert str(tok.vocab_size) in caplog.text


def test_too_small_vocab_is_a_clear_error(corpus: list[Path], tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"vocab_size \(20\) is too small.*train\.en"):
        Tokenizer.train(corpus, tmp_path / "t.model", vocab_size=20)
    assert not (tmp_path / "t.model").exists()


def test_empty_training_file_is_named(corpus: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.de"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"empty\.de is empty"):
        Tokenizer.train([corpus[0], empty], tmp_path / "t.model", vocab_size=300)


def test_missing_training_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"nope\.txt does not exist"):
        Tokenizer.train([tmp_path / "nope.txt"], tmp_path / "t.model", vocab_size=300)


def test_load_missing_model_names_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"missing\.model does not exist"):
        Tokenizer.load(tmp_path / "missing.model")


def test_load_corrupt_model_names_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(TokenizerError, match=r"bad\.model is not a valid SentencePiece model"):
        Tokenizer.load(bad)


def test_load_rejects_foreign_special_ids(corpus: list[Path], tmp_path: Path) -> None:
    import sentencepiece as spm

    # SentencePiece's defaults (unk=0, bos=1, eos=2, no pad) would silently break padding.
    spm.SentencePieceTrainer.train(
        input=[str(p) for p in corpus],
        model_prefix=str(tmp_path / "foreign"),
        vocab_size=60,
        minloglevel=2,
    )
    with pytest.raises(TokenizerError, match=r"foreign\.model has special ids"):
        Tokenizer.load(tmp_path / "foreign.model")


def test_train_or_reuse_remakes_only_for_another_recipe(tmp_path: Path) -> None:
    """The vocabulary of a run directory is reused for the same settings and files, remade for
    others, and kept whatever they are with `keep` (a resumed run's weights depend on it)."""
    src, tgt = tmp_path / "a.txt", tmp_path / "b.txt"
    for path in (src, tgt):
        path.write_text("a b c d e f g h\n" * 20, encoding="utf-8")
    model_file = tmp_path / "run" / "tokenizer.model"
    model_file.parent.mkdir()
    settings = dict(src=src, tgt=tgt, vocab_size=300, seed=1)
    first = Tokenizer.train_or_reuse(model_file, **settings)
    record = json.loads(model_file.with_suffix(".json").read_text())
    assert record["files"] == [[str(f.resolve()), f.stat().st_size] for f in (src, tgt)]
    mtime = model_file.stat().st_mtime_ns
    assert Tokenizer.train_or_reuse(model_file, **settings).sha256 == first.sha256
    assert model_file.stat().st_mtime_ns == mtime  # reused, not trained again
    kept = Tokenizer.train_or_reuse(model_file, **{**settings, "seed": 2}, keep=True)
    assert model_file.stat().st_mtime_ns == mtime and kept.sha256 == first.sha256
    Tokenizer.train_or_reuse(model_file, **{**settings, "seed": 2})
    assert json.loads(model_file.with_suffix(".json").read_text())["seed"] == 2


def test_a_corrupt_record_of_what_a_vocabulary_was_made_from_is_named(tmp_path: Path) -> None:
    """A TokenizerError naming the file (one line from the CLI), not a bare JSONDecodeError."""
    src = tmp_path / "a.txt"
    src.write_text("a b c d e f g h\n" * 20, encoding="utf-8")
    model_file = tmp_path / "tokenizer.model"
    Tokenizer.train_or_reuse(model_file, src=src, tgt=src, vocab_size=300, seed=1)
    model_file.with_suffix(".json").write_text('{"seed": 1', encoding="utf-8")  # cut short
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not valid JSON: "):
        Tokenizer.train_or_reuse(model_file, src=src, tgt=src, vocab_size=300, seed=1)


def test_a_joint_tokenizer_encodes_targets_as_sources(tokenizer: Tokenizer) -> None:
    texts = ["the cat", "der Hund"]
    assert tokenizer.encode_target_batch(texts) == tokenizer.encode_batch(texts)
    assert tokenizer.encode_target("der Hund") == tokenizer.encode("der Hund")


def test_a_split_tokenizer_encodes_targets_with_the_target_model(tmp_path: Path) -> None:
    vocab_file = split_tokenizer_files(tmp_path)
    tokenizer = SplitTokenizer.load(vocab_file)
    target = spm.SentencePieceProcessor(model_file=str(tmp_path / "target.spm"))
    text = "die katze sass auf der matte"
    ids = tokenizer.encode_target(text)
    assert tokenizer.pieces(ids) == target.encode(text, out_type=str)
    assert ids != tokenizer.encode(text)  # the source model cuts German otherwise
    assert tokenizer.encode_target_batch([text, "hallo"]) == [ids, tokenizer.encode_target("hallo")]
    assert tokenizer.decode(ids) == text


def test_a_text_of_only_whitespace_and_format_characters_is_blank() -> None:
    for text in ["", " \t\n", "\u200b", "\u200d \u2060", "\ufeff", "\u00ad", "\U000e0001"]:
        assert stripped(text) == "", repr(text)
    for text, kept in [(" a\u200b ", "a\u200b"), ("\u200bb", "\u200bb"), ("\u00a0x", "x")]:
        assert stripped(text) == kept
