"""Tests for `aiayn translate` and `aiayn evaluate`: one output line per input line in order,
n-best format, stdin/stdout and the interactive prompt, and clear errors (exit status 2) for
bad models and bad input. Runs `main([...])` in-process on a tiny random model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

from aiayn import runtime
from aiayn.cli import main
from aiayn.decode.evaluation import score
from aiayn.decode.translator import Translator, one_line
from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import Tokenizer
from model_dirs import EN_DE, tiny_model, tiny_model_dir

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon",
    "die katze sass auf der matte",
    "ein hund bellte den mond an",
]
MAX_POSITIONS = 16
LONG = " ".join(CORPUS * 3)  # far more than MAX_POSITIONS - 1 tokens
LINES = ["the cat", "", "a dog barked", LONG, "", "der mond"]
FAST = ["--beam-size", "2", "--max-len-b", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli")
    return tiny_model_dir(directory, CORPUS, max_positions=MAX_POSITIONS, metadata=EN_DE)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def expected_output(model_dir: Path, lines: list[str]) -> str:
    results = Translator(model_dir).translate(lines, beam_size=2, max_len_b=3)
    return "".join(one_line(r.text) + "\n" for r in results)


def set_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class TerminalInput(io.TextIOWrapper):
    """Standard input that says it is a terminal, typed ``data`` (bytes: what a terminal
    passes on, valid UTF-8 or not; a str is encoded)."""

    def __init__(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        super().__init__(io.BytesIO(raw), encoding="utf-8")

    def isatty(self) -> bool:
        return True


# -- translate --------------------------------------------------------------------------------


def test_translate_file_keeps_order_line_count_and_empty_lines(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = write_lines(tmp_path / "in.txt", LINES)
    out = tmp_path / "out.txt"
    assert main(["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), *FAST]) == 0
    text = out.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert len(lines) == len(LINES) + 1 and lines[-1] == ""
    assert lines[1] == lines[4] == ""
    assert all(lines[i] for i in (0, 2, 3, 5))
    assert text == expected_output(model_dir, LINES)
    # The long line was truncated, with a warning that names it, not rejected.
    assert "sentence 4 has" in caplog.text and f"first {MAX_POSITIONS - 1} tokens" in caplog.text


def test_translate_stdin_to_stdout(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_stdin(monkeypatch, "".join(f"{line}\n" for line in LINES).encode())
    assert main(["translate", "-m", str(model_dir), *FAST]) == 0
    assert capsys.readouterr().out == expected_output(model_dir, LINES)


def test_n_best_format(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_lines(tmp_path / "in.txt", ["the cat", "", "a dog"])
    args = ["translate", "-m", str(model_dir), "-i", str(src), "--n-best", "2", *FAST]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    parsed = [re.fullmatch(r"(\d+) \|\|\| (.*) \|\|\| (-?\d+\.\d{4})", line) for line in lines]
    assert all(parsed), lines
    assert [int(m.group(1)) for m in parsed] == [0, 0, 1, 2, 2]
    assert lines[2] == "1 |||  ||| 0.0000"  # an empty line has one empty hypothesis
    for i in (0, 3):
        assert float(parsed[i].group(3)) >= float(parsed[i + 1].group(3))  # best first
    first = Translator(model_dir).translate(["the cat"], beam_size=2, max_len_b=3, n_best=2)[0]
    assert [m.group(2) for m in parsed[:2]] == [one_line(h.text) for h in first.hypotheses]


def test_interactive_prompt_until_end_of_input(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", TerminalInput("the cat\n\na dog barked\n"))
    assert main(["translate", "-m", str(model_dir), *FAST]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected_output(model_dir, ["the cat", "", "a dog barked"])
    assert captured.err.count("> ") == 4  # three sentences, then end of input


def test_interactive_line_that_is_not_utf8_is_one_error_and_the_session_goes_on(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old CLI: a TypeError from the tokenizer, and the traceback of a bug, for a line typed in
    another encoding; a NUL passed, where a file's NUL is refused."""
    monkeypatch.setattr(sys, "stdin", TerminalInput(b"caf\xe9\nthe cat\nnul \0 here\n"))
    assert main(["translate", "-m", str(model_dir), *FAST]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected_output(model_dir, ["the cat"])
    assert "error: <stdin>:1: invalid UTF-8 at byte 3" in captured.err
    assert "error: <stdin>:3: NUL byte" in captured.err and "Traceback" not in captured.err


def test_closed_standard_input_is_one_line(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``aiayn translate <&-``: Python's sys.stdin is None (it was an AttributeError)."""
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["translate", "-m", str(model_dir), *FAST]) == 2
    assert "standard input is closed: give the sentences with -i FILE" in capsys.readouterr().err


def test_empty_input_gives_empty_output(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, out = write_lines(tmp_path / "empty.txt", []), tmp_path / "out.txt"
    assert main(["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out)]) == 0
    assert out.read_bytes() == b""
    set_stdin(monkeypatch, b"")
    assert main(["translate", "-m", str(model_dir)]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_progress_bar_on_a_terminal_only_and_the_output_is_the_same(
    command: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    ref = write_lines(tmp_path / "ref.txt", LINES)
    if command == "translate":
        args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), *FAST]
    else:
        args = ["evaluate", "-m", str(model_dir), "--src", str(src), "--ref", str(ref)]
        args += ["-o", str(out), *FAST]
    outputs, errors = [], []
    for stderr, flags in [
        (Terminal(), []),
        (Terminal(), ["--no-progress"]),
        (io.StringIO(), []),  # not a terminal
    ]:
        monkeypatch.setattr(sys, "stderr", stderr)
        assert main([*args, *flags]) == 0
        outputs.append(out.read_bytes())
        errors.append(stderr.getvalue())
    assert f"{len(LINES)}/{len(LINES)}" in errors[0] and "line/s" in errors[0]
    assert "/s]" not in errors[1] and "/s]" not in errors[2]
    assert outputs[0] == outputs[1] == outputs[2]


def test_progress_counts_every_batch_and_blank_line(model_dir: Path) -> None:
    done: list[int] = []
    translator = Translator(model_dir, max_tokens=8)  # one sentence per batch
    results = translator.translate_iterable(
        LINES, chunk_size=4, beam_size=2, max_len_b=3, progress=done.append
    )
    assert len(list(results)) == len(LINES)
    assert sum(done) == len(LINES) and len(done) == 6  # 1 + 3 batches, then 1 + 1


def test_no_progress_bar_when_the_translations_go_to_the_terminal(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stderr, stdout = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(sys, "stdout", stdout)
    src = write_lines(tmp_path / "in.txt", LINES[:3])
    assert main(["translate", "-m", str(model_dir), "-i", str(src), *FAST]) == 0
    assert stdout.getvalue() == expected_output(model_dir, LINES[:3])
    assert "/s]" not in stderr.getvalue()


# -- errors -----------------------------------------------------------------------------------


def run_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_flags_that_would_do_nothing_are_refused(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Old CLI: sampling's flags without --sampling, --alignment-layer without --alignment,
    and `info -m` with a preset's flags were taken and did nothing."""
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    translate = ["translate", "-m", str(model_dir), "-i", str(src), *FAST]
    err = run_error([*translate, "--top-k", "5", "--top-p", "0.5"], capsys)
    assert "--top-k, --top-p are for sampling, which --sampling asks for" in err
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert main([*translate, "--seed", "1"]) == 0  # harmless: a warning
    assert "--seed is for sampling (--sampling): beam search does not use it" in caplog.text
    err = run_error([*translate, "--alignment-layer", "0"], capsys)
    assert "--alignment-layer chooses the layer of --alignment: add it" in err
    assert main([*translate, "--sampling", "--top-k", "5", "--seed", "1"]) == 0
    err = run_error(["info", "-m", str(model_dir), "--set", "n_heads=16"], capsys)
    assert "--set describes a preset; with -m the model directory's own architecture" in err


def test_a_checksums_file_that_is_not_an_object_is_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old CLI: valid JSON of another shape ('[]') was an AttributeError, a bug's traceback."""
    damaged = tmp_path / "model"
    shutil.copytree(model_dir, damaged)
    (damaged / "checksums.json").write_text("[]\n", encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    err = run_error(["translate", "-m", str(damaged), "-i", str(src), *FAST], capsys)
    assert "checksums.json is corrupt: not an object of file names and SHA-256 digests" in err


def test_missing_model_dir_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.txt", ["hello"])
    err = run_error(["translate", "-m", str(tmp_path / "nope"), "-i", str(src)], capsys)
    assert "aiayn translate: error: model directory not found" in err and "nope" in err


def test_model_dir_without_weights_is_a_clear_error(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in model_dir.iterdir():
        if file.name != "model.safetensors":
            (broken / file.name).write_bytes(file.read_bytes())
    src = write_lines(tmp_path / "in.txt", ["hello"])
    err = run_error(["translate", "-m", str(broken), "-i", str(src)], capsys)
    assert "missing model.safetensors" in err


def test_invalid_utf8_names_the_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"the cat\nthe \xff dog\n")
    err = run_error(["translate", "-m", str(model_dir), "-i", str(src), *FAST], capsys)
    assert "in.txt:2: invalid UTF-8" in err


@pytest.mark.parametrize("command", ["translate", "evaluate", "score"])
def test_a_failure_part_way_leaves_an_existing_output_as_it_was(
    command: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old CLI: the output was opened for writing before the input had been read, so a bad line
    found part way emptied the user's existing file (and left the lines before it)."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"the cat\nthe \xff dog\n")
    ref = write_lines(tmp_path / "ref.txt", ["a", "b"])
    out = tmp_path / "out.txt"
    out.write_text("PRECIOUS\n", encoding="utf-8")
    args = {
        "translate": ["-i", str(src), *FAST],
        "evaluate": ["--src", str(src), "--ref", str(ref), *FAST],
        "score": ["--src", str(src), "--tgt", str(ref)],
    }[command]
    err = run_error([command, "-m", str(model_dir), *args, "-o", str(out)], capsys)
    assert "in.txt:2: invalid UTF-8" in err
    assert out.read_text(encoding="utf-8") == "PRECIOUS\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt", "ref.txt"]


def test_output_over_a_hard_link_or_the_redirected_input_keeps_the_input(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old CLI: ``-o`` a hard link of ``-i``, or ``-o FILE < FILE``, emptied the input before
    it was read, and wrote an empty translation (exit status 0)."""
    lines = ["the cat", "a dog barked"]
    src = write_lines(tmp_path / "in.txt", lines)
    link = tmp_path / "link.txt"
    link.hardlink_to(src)
    assert main(["translate", "-m", str(model_dir), "-i", str(src), "-o", str(link), *FAST]) == 0
    assert src.read_text(encoding="utf-8") == "".join(f"{line}\n" for line in lines)
    assert link.read_text(encoding="utf-8") == expected_output(model_dir, lines)
    same = write_lines(tmp_path / "same.txt", lines)
    with same.open("rb") as stdin:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stdin, encoding="utf-8"))
        assert main(["translate", "-m", str(model_dir), "-o", str(same), *FAST]) == 0
    assert same.read_text(encoding="utf-8") == expected_output(model_dir, lines)


def test_output_keeps_its_permissions_and_is_written_through_a_symbolic_link(
    model_dir: Path, tmp_path: Path
) -> None:
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    target = tmp_path / "target.txt"
    target.write_text("old\n", encoding="utf-8")
    target.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert main(["translate", "-m", str(model_dir), "-i", str(src), "-o", str(link), *FAST]) == 0
    assert link.is_symlink() and (target.stat().st_mode & 0o777) == 0o640
    assert target.read_text(encoding="utf-8") == expected_output(model_dir, ["the cat"])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_is_one_line_naming_the_output(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old CLI: ``OSError: [Errno 28] No space left on device``, reported as a bug in aiayn."""
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", "/dev/full", *FAST]
    assert "cannot write /dev/full: No space left on device" in run_error(args, capsys)
    full = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 (closed below, quietly)
    sys_stdout, sys.stdout = sys.stdout, full
    try:
        status = main(["translate", "-m", str(model_dir), "-i", str(src), *FAST])
    finally:
        sys.stdout = sys_stdout
        with contextlib.suppress(OSError):  # what is left in its buffer fails again
            full.close()
    assert status == 2
    assert "cannot write standard output: No space left on device" in capsys.readouterr().err


def test_input_from_a_pipe_is_read_and_a_directory_is_named(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-i <(...)``, ``-i /dev/stdin`` and named pipes are not regular files; they were refused
    as missing, and so was a directory."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    lines = ["the cat", "a dog barked"]
    writer = threading.Thread(target=write_lines, args=(fifo, lines), daemon=True)
    writer.start()
    out = tmp_path / "out.txt"
    try:
        status = main(["translate", "-m", str(model_dir), "-i", str(fifo), "-o", str(out), *FAST])
    finally:
        writer.join(10)
        if writer.is_alive():  # nobody opened the pipe: a reader lets the writer end
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert status == 0
    assert out.read_text(encoding="utf-8") == expected_output(model_dir, lines)
    err = run_error(["translate", "-m", str(model_dir), "-i", str(tmp_path)], capsys)
    assert f"input file {tmp_path} is a directory, not a file" in err
    ref = write_lines(tmp_path / "ref.txt", lines)
    args = ["evaluate", "-m", str(model_dir), "--src", str(fifo), "--ref", str(ref)]
    assert "is not a regular file (a pipe?): this command reads it twice" in run_error(args, capsys)


def test_evaluate_refuses_a_tokenizer_sacrebleu_lacks_before_translating(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old CLI: a KeyError from sacreBLEU, a bug's traceback, after translating the whole set."""
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    args = ["evaluate", "-m", str(tmp_path / "no-model"), "--src", str(src), "--ref", str(src)]
    err = run_error([*args, "--tokenize", "bogus"], capsys)  # before the model is looked for
    assert "tokenize ('bogus') is not one of sacreBLEU's tokenizers: " in err and "13a" in err


def test_missing_input_and_bad_options_are_clear_errors(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = run_error(["translate", "-m", str(model_dir), "-i", str(tmp_path / "no.txt")], capsys)
    assert "no.txt does not exist" in err
    src = write_lines(tmp_path / "in.txt", ["hello"])
    args = ["translate", "-m", str(model_dir), "-i", str(src), "--n-best", "3", "--beam-size", "2"]
    assert "n_best (3) must be <= beam_size (2)" in run_error(args, capsys)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "--device gpu: give cpu, cuda, cuda:N or auto"),
        ("cuda:x", "--device cuda:x: give cpu, cuda, cuda:N or auto"),
    ],
)
def test_a_device_this_machine_lacks_is_a_one_line_error(
    model_dir: Path, device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = run_error(["translate", "-m", str(model_dir), "--device", device, *FAST], capsys)
    assert message in err and "Traceback" not in err and "bug in aiayn" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = run_error(["translate", "-m", str(model_dir), "--device", "cuda", *FAST], capsys)
    assert "--device cuda: this machine has no CUDA GPU for PyTorch" in err
    assert "use --device cpu" in err and "Traceback" not in err


# -- evaluate ---------------------------------------------------------------------------------


def test_evaluate_prints_scores_and_writes_hypotheses(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "dev.en", ["the cat", "a dog barked"])
    ref = write_lines(tmp_path / "dev.de", ["die katze", "ein hund bellte"])
    hyp = tmp_path / "dev.hyp"
    args = ["evaluate", "-m", str(model_dir), "--src", str(src), "--ref", str(ref)]
    assert main([*args, "-o", str(hyp), "--json", *FAST]) == 0
    report = json.loads(capsys.readouterr().out)
    hypotheses = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    assert hypotheses == expected_output(model_dir, ["the cat", "a dog barked"]).split("\n")[:-1]
    expected = score(hypotheses, [["die katze", "ein hund bellte"]])
    assert report["bleu"] == pytest.approx(expected.bleu)
    assert report["chrf"] == pytest.approx(expected.chrf)
    assert report["bleu_signature"] == expected.bleu_signature
    assert report["hypotheses_file"] == str(hyp)

    assert main([*args, "-o", str(hyp), *FAST]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("BLEU|nrefs:1|") and out[1].startswith("chrF2|nrefs:1|")


def test_evaluate_with_mismatched_counts_names_files_and_counts(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "dev.en", ["the cat", "a dog", "hello"])
    ref = write_lines(tmp_path / "dev.de", ["die katze", "ein hund"])
    args = ["evaluate", "-m", str(model_dir), "--src", str(src), "--ref", str(ref)]
    err = run_error([*args, "-o", str(tmp_path / "hyp"), *FAST], capsys)
    assert "dev.en has 3 lines" in err and "dev.de has 2 lines" in err
    assert not (tmp_path / "hyp").exists()


def test_translate_int8_flag(model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("hello world\n\nthe cat\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    args = ["translate", "-m", str(model_dir), "-i", str(source), "-o", str(out), "--int8"]
    assert main(args) == 0
    assert len(out.read_text(encoding="utf-8").split("\n")) == 4  # 3 lines + final newline


def test_translate_no_onednn_flag_gives_the_same_output(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiayn.decode import packing

    monkeypatch.setattr(packing, "MIN_PACKED_FEATURES", 1)  # pack the tiny model's layers
    source = write_lines(tmp_path / "in.txt", ["hello world", "", "the cat"])
    outputs = []
    for flags in (["--onednn"], ["--no-onednn"]):
        out = tmp_path / f"out{len(flags)}.txt"
        args = ["translate", "-m", str(model_dir), "-i", str(source), "-o", str(out)]
        assert main([*args, "--beam-size", "2", "--max-len-b", "4", *flags]) == 0
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1] and len(outputs[0].split("\n")) == 4


def test_threads_default_to_the_idle_cores_and_0_leaves_pytorchs_default(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "decoding_threads", lambda: 1)
    src, out = write_lines(tmp_path / "in.txt", ["the cat"]), tmp_path / "out.txt"
    args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out)]
    args += ["--beam-size", "2", "--max-len-b", "3"]
    torch.set_num_threads(2)
    assert main(args) == 0
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert main([*args, "--threads", "0"]) == 0
    assert torch.get_num_threads() == 2


def test_the_commands_keep_freed_memory_and_the_translator_does_not(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocator's setting belongs to the process: `aiayn translate` and `evaluate` make
    it (`runtime.keep_freed_memory`), a `Translator` built by a program does not."""
    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    src, ref = (
        write_lines(tmp_path / "in.txt", ["the cat"]),
        write_lines(tmp_path / "ref.txt", ["x"]),
    )
    Translator(model_dir).translate(["the cat"], beam_size=2, max_len_b=3)
    assert calls == []
    common = ["-m", str(model_dir), "-o", str(tmp_path / "out.txt"), *FAST]
    assert main(["translate", "-i", str(src), *common]) == 0
    assert calls == [1]
    assert main(["evaluate", "--src", str(src), "--ref", str(ref), *common]) == 0
    assert calls == [1, 1]


def test_threads_given_beyond_the_free_cores_are_taken_with_a_warning(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--threads 2 while another process keeps one of 2 cores busy: decoded on 2 threads as
    asked, with a warning naming what fits; on an idle machine, no warning."""
    monkeypatch.setattr(runtime, "_available_cores", lambda: 2)
    src, out = write_lines(tmp_path / "in.txt", ["the cat"]), tmp_path / "out.txt"
    args = ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), "--threads", "2"]
    args += ["--beam-size", "2", "--max-len-b", "3", "--workers", "1"]
    for load, warned in ((1.2, True), (0.0, False)):
        monkeypatch.setattr(runtime, "busy_cores", lambda load=load: load)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aiayn"):
            assert main(args) == 0
        assert torch.get_num_threads() == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        crowded = [m for m in warnings if m.startswith("--threads 2: other processes keep")]
        assert bool(crowded) is warned, warnings
        assert not warned or "1 would fit" in crowded[0]


def test_the_batch_budget_defaults_by_device_and_refuses_what_is_not_positive(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-tokens: 4096 on a CPU, 16384 on a GPU (where a larger budget decoded faster,
    the same outputs: BENCHMARKS.md, GPU) unless given; 0 is refused naming the flag."""
    from aiayn.cli import build_parser
    from aiayn.cli.common import CPU_MAX_TOKENS, GPU_MAX_TOKENS, load_translator, max_tokens

    parse = build_parser().parse_args
    args = parse(["translate", "-m", str(model_dir), "--device", "cpu", "--threads", "1"])
    assert load_translator(args).max_tokens == CPU_MAX_TOKENS == 4096
    assert max_tokens(args, on_cpu=False) == GPU_MAX_TOKENS == 16384
    args = parse(["translate", "-m", str(model_dir), "--device", "cpu", "--max-tokens", "100"])
    assert max_tokens(args, on_cpu=False) == 100
    assert load_translator(args).max_tokens == 100
    if importlib.util.find_spec("ctranslate2") is not None:  # its backend: the same default
        flags = ["--backend", "ctranslate2", "--device", "cpu", "--threads", "1"]
        args = parse(["translate", "-m", str(model_dir), *flags])
        assert load_translator(args).max_tokens == CPU_MAX_TOKENS
    with pytest.raises(SystemExit) as exit_info:  # argparse's error, naming the flag
        main(["translate", "-m", str(model_dir), "--max-tokens", "0", *FAST])
    assert exit_info.value.code == 2
    assert "argument --max-tokens: 0 is not a positive integer" in capsys.readouterr().err


# -- ensembles --------------------------------------------------------------------------------


def save_model(directory: Path, tokenizer_file: Path, seed: int) -> Path:
    model = tiny_model(
        Tokenizer.load(tokenizer_file).vocab_size,
        preset="tiny",
        seed=seed,
        max_positions=MAX_POSITIONS,
    )
    return save_model_dir(directory, model, tokenizer_file=tokenizer_file)


@pytest.fixture(scope="module")
def other_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other weights, the same tokenizer as ``model_dir``."""
    directory = tmp_path_factory.mktemp("other")
    return save_model(directory / "model", model_dir / "tokenizer.model", seed=1)


def test_ensemble_of_a_model_with_itself_translates_as_the_model(
    model_dir: Path, tmp_path: Path
) -> None:
    src = write_lines(tmp_path / "in.txt", LINES)
    for beam in ("1", "3"):
        outputs = []
        for models in (["-m", str(model_dir)], ["-m", str(model_dir), "-m", str(model_dir)]):
            out = tmp_path / "out.txt"
            args = ["translate", *models, "-i", str(src), "-o", str(out), "--n-best", beam]
            assert main([*args, "--beam-size", beam, "--max-len-b", "4", "--threads", "1"]) == 0
            outputs.append(out.read_text(encoding="utf-8").splitlines())
        single, twice = ([line.split(" ||| ") for line in lines] for lines in outputs)
        assert [row[:2] for row in twice] == [row[:2] for row in single]  # the same text
        scores = [[float(row[2]) for row in rows] for rows in (single, twice)]
        assert scores[1] == pytest.approx(scores[0], abs=2e-4)  # printed with 4 decimals


def test_ensemble_of_two_models_through_translate_and_evaluate(
    model_dir: Path, other_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ["the cat", "", "a dog barked"]
    translator = Translator([model_dir, other_model_dir])
    results = translator.translate(lines, beam_size=2, max_len_b=3)
    assert [bool(r.text) for r in results] == [True, False, True]
    assert all(r.log_prob <= 0 for r in results)
    src, out = write_lines(tmp_path / "in.txt", lines), tmp_path / "out.txt"
    models = ["-m", str(model_dir), "-m", str(other_model_dir)]
    assert main(["translate", *models, "-i", str(src), "-o", str(out), *FAST]) == 0
    assert out.read_text(encoding="utf-8") == "".join(one_line(r.text) + "\n" for r in results)

    ref = write_lines(tmp_path / "ref.txt", ["die katze", "", "ein hund bellte"])
    args = ["evaluate", *models, "--src", str(src), "--ref", str(ref), "-o", str(out)]
    assert main([*args, "--json", *FAST]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ensemble"] == [str(model_dir), str(other_model_dir)]
    assert out.read_text(encoding="utf-8") == "".join(one_line(r.text) + "\n" for r in results)


def test_ensemble_refuses_models_with_another_tokenizer_and_alignments(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_lines(tmp_path / "corpus.txt", ["völlig andere wörter hier"] * 5 + CORPUS)
    tokenizer = Tokenizer.train([corpus], tmp_path / "other.model", vocab_size=310)
    foreign = save_model(tmp_path / "foreign", tokenizer.model_file, seed=2)
    src = write_lines(tmp_path / "in.txt", ["the cat"])
    args = ["translate", "-m", str(model_dir), "-m", str(foreign), "-i", str(src), *FAST]
    err = run_error(args, capsys)
    assert "cannot ensemble" in err and "tokenizers differ" in err and str(foreign) in err
    args = ["translate", "-m", str(model_dir), "-m", str(model_dir), "-i", str(src), *FAST]
    err = run_error([*args, "--alignment"], capsys)
    assert "an ensemble has no attention maps" in err


# -- score ------------------------------------------------------------------------------------


def test_score_writes_one_line_per_pair_and_the_corpus_totals(
    model_dir: Path, other_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources, targets = ["the cat", "", "a dog barked"], ["die katze", "der mond", ""]
    src, tgt = write_lines(tmp_path / "s.en", sources), write_lines(tmp_path / "t.de", targets)
    out = tmp_path / "scores.tsv"
    args = ["score", "-m", str(model_dir), "--src", str(src), "--tgt", str(tgt), "--threads", "1"]
    assert main([*args, "-o", str(out)]) == 0
    expected = Translator(model_dir).score(sources, targets)
    rows = [line.split("\t") for line in out.read_text(encoding="utf-8").splitlines()]
    assert [float(r[0]) for r in rows] == pytest.approx([s.log_prob for s in expected], abs=1e-4)
    assert [int(r[1]) for r in rows] == [s.n_tokens for s in expected]
    assert [float(r[2]) for r in rows] == pytest.approx([s.perplexity for s in expected], rel=1e-3)
    err = capsys.readouterr().err
    n_tokens, total = sum(s.n_tokens for s in expected), sum(s.log_prob for s in expected)
    assert f"scored 3 pairs: {n_tokens} target tokens (EOS included), log-probability " in err
    assert f"perplexity {math.exp(-total / n_tokens):.2f}" in err

    assert main([*args, "--json", "-m", str(other_model_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ensemble = Translator([model_dir, other_model_dir]).score(sources, targets)
    assert [json.loads(line)["log_prob"] for line in lines] == pytest.approx(
        [s.log_prob for s in ensemble], abs=1e-6
    )
    assert set(json.loads(lines[0])) == {"log_prob", "tokens", "perplexity", "truncated"}

    short = write_lines(tmp_path / "short.de", targets[:2])
    err = run_error(["score", "-m", str(model_dir), "--src", str(src), "--tgt", str(short)], capsys)
    assert "s.en has 3 lines but" in err and "short.de has 2 lines" in err


def test_a_line_of_only_format_characters_is_a_blank_line(model_dir: Path, tmp_path: Path) -> None:
    """Zero-width characters (Unicode Cf: U+200B, U+200D, U+FEFF) show nothing: a line of
    them is blank, its output line empty, as an empty line's (they were translated into
    invented words)."""
    src = write_lines(tmp_path / "in.txt", ["the cat", "\u200b", "\ufeff\u200d \u2060", ""])
    out = tmp_path / "out.txt"
    assert main(["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), *FAST]) == 0
    assert out.read_text(encoding="utf-8").split("\n")[1:] == ["", "", "", ""]
