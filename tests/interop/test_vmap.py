"""A model's lexical shortlist exported as CTranslate2's vocabulary map (``vmap.txt``), which the
CTranslate2 backend decodes with under ``shortlist=True`` as aiayn's own search does."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.decode.backends.ctranslate2 import vocabulary
from aiayn.decode.shortlist import build_shortlist_from_text, model_shortlist, write_shortlist
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.model_dir import load_model_dir
from aiayn.text.tokenizer import Tokenizer
from model_dirs import CORPUS, tiny_model_dir

ctranslate2 = pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")

from aiayn.interop.ctranslate2 import export_ctranslate2  # noqa: E402

SENTENCES = ["the cat sat on the mat", "hello world", "a dog barked at the moon all night"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tiny_model_dir(tmp_path_factory.mktemp("vmap"), eos_scale=4.0)
    config = load_model_dir(directory).config
    pairs = [(CORPUS[i], CORPUS[i + 3]) for i in range(3)] + [(CORPUS[6], CORPUS[7])]
    shortlist = build_shortlist_from_text(
        pairs,
        Tokenizer.load(directory / "tokenizer.model"),
        src_vocab_size=config.src_vocab_size,
        tgt_vocab_size=config.tgt_vocab_size,
        per_source=5,
        frequent=5,
    )
    write_shortlist(directory, shortlist)
    return directory


@pytest.fixture(scope="module")
def export(model_dir: Path) -> Path:
    return export_ctranslate2(model_dir, model_dir.parent / "ct2")


def test_the_vocabulary_map_holds_the_shortlist(model_dir: Path, export: Path):
    config = load_model_dir(model_dir).config
    shortlist = model_shortlist(model_dir, config.tgt_vocab_size)
    assert shortlist is not None
    tokens = vocabulary(Tokenizer.load(model_dir / "tokenizer.model"), config.tgt_vocab_size)
    lines = (export / "vmap.txt").read_text(encoding="utf-8").splitlines()
    rules = dict(line.split("\t") for line in lines)
    assert rules.pop("").split(" ") == [tokens[i] for i in shortlist.always.tolist()]
    expected = {
        tokens[s]: " ".join(tokens[t] for t in shortlist.targets_of(s).tolist())
        for s in range(shortlist.src_vocab_size)
        if shortlist.targets_of(s).size
    }
    assert rules == expected


def test_ctranslate2_decodes_with_it_as_aiayns_search_does(model_dir: Path, export: Path):
    ours = Translator(model_dir)
    theirs = Translator(export)
    assert theirs.backend.shortlist_missing() is None
    kwargs = dict(beam_size=1, max_len_b=12, shortlist=True)
    got = theirs.translate(SENTENCES, **kwargs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ours.translate(SENTENCES, **kwargs)]
    allowed = ours.backend.shortlist.allowed([ours.tokenizer.encode(s) for s in SENTENCES])
    for result in got:  # one batch: what any of its sources allows
        assert set(result.token_ids) <= set(allowed.tolist())


def test_an_export_without_a_shortlist_has_no_map_and_refuses_the_option(tmp_path: Path):
    export = export_ctranslate2(tiny_model_dir(tmp_path), tmp_path / "ct2")
    assert not (export / "vmap.txt").exists()
    with pytest.raises(UserValueError, match=r"no vmap\.txt"):
        Translator(export).translate(["hello"], beam_size=1, shortlist=True)
