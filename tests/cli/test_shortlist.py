"""`aiayn shortlist` adds a lexical shortlist to a model directory, which `aiayn translate
--shortlist` decodes with (off by default), and `aiayn export --to ctranslate2` writes as a
vocabulary map."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.cli import shortlist as shortlist_command
from aiayn.decode import shortlist
from aiayn.decode.shortlist import SHORTLIST_FILE, model_shortlist
from aiayn.decode.translator import Translator, one_line
from aiayn.model_dir import load_model_dir, verify
from model_dirs import CORPUS, tiny_model_dir

FAST = ["--beam-size", "2", "--max-len-b", "5", "--threads", "1"]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_the_commands_defaults_are_the_librarys():
    assert shortlist_command.PER_SOURCE == shortlist.DEFAULT_PER_SOURCE
    assert shortlist_command.FREQUENT == shortlist.DEFAULT_FREQUENT


def test_shortlist_then_translate_with_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model_dir = tiny_model_dir(tmp_path / "m", eos_scale=4.0)
    src = write_lines(tmp_path / "train.en", CORPUS[:3] + CORPUS[6:7])
    tgt = write_lines(tmp_path / "train.de", CORPUS[3:6] + CORPUS[7:8])
    run_dir = model_dir.parent  # a run directory's model/ is found as in every command
    argv = ["shortlist", "-m", str(run_dir), "--src", str(src), "--tgt", str(tgt)]
    assert main([*argv, "--per-source", "4", "--frequent", "3"]) == 0
    assert "wrote the shortlist" in capsys.readouterr().out
    verify(model_dir)
    built = model_shortlist(model_dir, load_model_dir(model_dir).config.tgt_vocab_size)
    assert built is not None and (built.per_source, built.frequent) == (4, 3)

    lines = write_lines(tmp_path / "in.en", ["the cat sat", "hello world"])
    out = tmp_path / "out.de"
    translate = ["translate", "-m", str(model_dir), "-i", str(lines), "-o", str(out), *FAST]
    assert main([*translate, "--shortlist"]) == 0
    results = Translator(model_dir).translate(
        ["the cat sat", "hello world"], beam_size=2, max_len_b=5, shortlist=True
    )
    assert out.read_text(encoding="utf-8") == "".join(one_line(r.text) + "\n" for r in results)
    assert main([*translate, "--no-shortlist"]) == 0


def test_translate_shortlist_without_one_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    model_dir = tiny_model_dir(tmp_path / "m")
    assert not (model_dir / SHORTLIST_FILE).exists()
    lines = write_lines(tmp_path / "in.en", ["hello"])
    assert main(["translate", "-m", str(model_dir), "-i", str(lines), *FAST, "--shortlist"]) == 2
    assert "no lexical shortlist" in capsys.readouterr().err


def test_shortlist_refuses_unaligned_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model_dir = tiny_model_dir(tmp_path / "m")
    src = write_lines(tmp_path / "a", CORPUS[:2])
    tgt = write_lines(tmp_path / "b", CORPUS[:3])
    assert main(["shortlist", "-m", str(model_dir), "--src", str(src), "--tgt", str(tgt)]) == 2
    assert "not aligned" in capsys.readouterr().err
    assert not (model_dir / SHORTLIST_FILE).exists()
