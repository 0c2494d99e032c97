"""`aiayn.errors.UserError` and the CLI's one rule: an error the user can fix is one line with
exit status 2; anything else is a bug in aiayn, shown with its traceback and a line asking for a
report, exit status 1.

The one-line errors of each command are tested where the command is (``tests/cli``,
``tests/text/prepare``, ...); here, each family of user errors is raised from a step that
`aiayn translate` calls, and so is what is not the user's: a ``ValueError`` from inside torch.
"""

from __future__ import annotations

import atexit
import errno
import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import torch

import aiayn.cli.translate
from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.decode.evaluation import EvaluationError
from aiayn.decode.options import DecodingOptions
from aiayn.errors import UserError, UserFileNotFoundError, UserValueError
from aiayn.extras import MissingExtra
from aiayn.interop.marian import MarianFormatError
from aiayn.model_dir import CheckpointError, CorruptCheckpointError, DiskFullError
from aiayn.text.corpus import DataError
from aiayn.text.prepare import PrepareError
from aiayn.text.tokenizer import TokenizerError
from aiayn.train.rundir import RunDirectoryError, RunDirectoryLocked
from aiayn.train.trainer import TrainingError

REPORT = "this is a bug in aiayn, not a mistake of yours: please report it with the traceback above"


@pytest.mark.parametrize(
    ("error_class", "old_base"),
    [
        (UserValueError, ValueError),
        (UserFileNotFoundError, FileNotFoundError),
        (CheckpointError, RuntimeError),
        (CorruptCheckpointError, RuntimeError),
        (DiskFullError, RuntimeError),
        (TokenizerError, ValueError),
        (DataError, ValueError),
        (PrepareError, ValueError),
        (EvaluationError, ValueError),
        (MarianFormatError, ValueError),
        (MissingExtra, ImportError),
        (ConfigError, ValueError),
        (RunDirectoryError, RuntimeError),
        (RunDirectoryLocked, RuntimeError),
        (TrainingError, RuntimeError),
    ],
)
def test_user_errors_keep_the_base_that_callers_catch(
    error_class: type[Exception], old_base: type[Exception]
) -> None:
    assert issubclass(error_class, UserError) and issubclass(error_class, old_base)
    with pytest.raises(old_base, match=r"^why$"):
        raise error_class("why")


def test_invalid_decoding_options_are_a_user_value_error_with_the_same_message() -> None:
    with pytest.raises(UserValueError, match=r"^beam_size \(0\) must be an integer >= 1$"):
        DecodingOptions(beam_size=0)


# -- the CLI ------------------------------------------------------------------------------


@pytest.fixture
def translate_argv(tmp_path: Path) -> list[str]:
    """`aiayn translate` up to loading the model, which the tests replace."""
    source = tmp_path / "in.txt"
    source.write_text("hello\n", encoding="utf-8")
    return ["translate", "-m", str(tmp_path / "model"), "-i", str(source), "--threads", "1"]


def load_raising(monkeypatch: pytest.MonkeyPatch, raise_it: Callable[[], object]) -> None:
    """Make `aiayn translate`'s loading of the model call ``raise_it()``."""

    def load_translator(args: object) -> None:
        raise_it()

    monkeypatch.setattr(aiayn.cli.translate, "load_translator", load_translator)


def _raise(error: BaseException) -> Callable[[], None]:
    def raise_it() -> None:
        raise error

    return raise_it


@pytest.mark.parametrize(
    "error",
    [
        UserValueError("--alignment cannot be combined with --n-best"),
        UserFileNotFoundError("input file x.txt does not exist"),
        CheckpointError("model directory not found: runs/nope"),
        CorruptCheckpointError("runs/m: missing model.safetensors"),
        DiskFullError("No space left on device writing runs/m: ..."),
        TokenizerError("tokenizer not found: t.model"),
        DataError("in.txt:3: NUL byte at byte 0 of the line (binary data?)"),
        PrepareError("output folder out is a file"),
        EvaluationError("nothing to score: in.txt is empty"),
        MissingExtra("aiayn serve needs fastapi, which is not installed: ..."),
        # An OSError about a path: what a user gave is missing, not theirs, or the disk is full.
        PermissionError(errno.EACCES, "Permission denied", "/root/out.txt"),
        IsADirectoryError(errno.EISDIR, "Is a directory", "runs"),
        OSError(errno.ENOSPC, "No space left on device", "out.txt"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_the_user_can_fix_is_one_line_with_exit_status_2(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
) -> None:
    load_raising(monkeypatch, _raise(error))
    assert main(translate_argv) == 2
    assert capsys.readouterr().err == f"aiayn translate: error: {error}\n"


def test_a_file_that_open_cannot_find_is_one_line_naming_it(
    translate_argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = tmp_path / "no" / "such.txt"
    load_raising(monkeypatch, lambda: missing.read_text(encoding="utf-8"))
    assert main(translate_argv) == 2
    expected = f"aiayn translate: error: [Errno 2] No such file or directory: '{missing}'\n"
    assert capsys.readouterr().err == expected


def test_real_user_errors_of_translate_stay_one_line(
    translate_argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No monkeypatching: a missing input file, a model directory that is not there, an
    invalid decoding option."""
    missing_input = [*translate_argv[:4], str(tmp_path / "missing.txt")]
    assert main(missing_input) == 2
    err = capsys.readouterr().err
    assert err == f"aiayn translate: error: input file {tmp_path / 'missing.txt'} does not exist\n"

    assert main(translate_argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn translate: error: model directory not found: ")
    assert err.count("\n") == 1

    assert main([*translate_argv, "--beam-size", "0"]) == 2
    assert capsys.readouterr().err == (
        "aiayn translate: error: beam_size (0) must be an integer >= 1\n"
    )


def _value_error_inside_torch() -> None:
    logits, targets = torch.zeros(2, 5), torch.zeros(3, dtype=torch.long)
    torch.nn.functional.cross_entropy(logits, targets)  # batch sizes differ: ValueError


@pytest.mark.parametrize(
    "raise_it",
    [
        _value_error_inside_torch,
        _raise(ValueError("src_tokens must be (B, S), got shape (3,)")),
        _raise(FileNotFoundError("a path aiayn built itself, no file name attached")),
        _raise(RuntimeError("shape mismatch")),
        _raise(IndexError("list index out of range")),
    ],
    ids=["ValueError-in-torch", "ValueError", "FileNotFoundError-no-filename", "RuntimeError",
         "IndexError"],
)  # fmt: skip
def test_an_error_that_is_not_the_users_shows_its_traceback_and_asks_for_a_report(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raise_it: Callable[[], object],
) -> None:
    load_raising(monkeypatch, raise_it)
    assert main(translate_argv) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in load_translator" in err  # where it was raised, as Python prints it
    assert lines[-1] == f"aiayn translate: {REPORT}"
    assert "aiayn translate: error:" not in err


def test_verbose_adds_the_traceback_to_a_user_error_and_keeps_exit_status_2(
    translate_argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    load_raising(monkeypatch, _raise(UserValueError("--alignment cannot be combined")))
    assert main(["-v", *translate_argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "aiayn translate: error: --alignment cannot be combined"


def test_ctrl_c_is_exit_status_130_without_a_traceback(
    translate_argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    load_raising(monkeypatch, _raise(KeyboardInterrupt()))
    assert main(translate_argv) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_the_aiayn_program_exits_1_with_the_traceback_then_the_report_line(
    tmp_path: Path,
) -> None:
    """As the installed ``aiayn`` runs it (``sys.exit(main())``), in a process of its own."""
    source = tmp_path / "in.txt"
    source.write_text("hello\n", encoding="utf-8")
    argv = ["translate", "-m", str(tmp_path / "model"), "-i", str(source), "--threads", "1"]
    code = (
        "import sys, aiayn.cli.translate as t\n"
        "def load_translator(args):\n"
        "    raise ValueError('boom')\n"
        "t.load_translator = load_translator\n"
        "from aiayn.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    lines = run.stderr.splitlines()
    assert run.returncode == 1, run.stderr
    assert "Traceback (most recent call last):" in lines
    assert lines[-2:] == ["ValueError: boom", f"aiayn translate: {REPORT}"]


class _Exited(Exception):
    """What the test's stand-in for ``os._exit`` raises, with the status it was given."""

    def __init__(self, status: int) -> None:
        self.status = status


BAD_MODEL = ["aiayn", "translate", "-m", "no-such-model", "-i", "x"]
"""A command line on which `main` returns 2 (a user error) without loading anything."""


@pytest.fixture
def exit_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`entry_point`'s ways out, recorded instead of taken (this is pytest's process): the exit
    handlers it runs, and ``os._exit``, which raises `_Exited`. The process is made to look
    as the executable's does: one thread, nothing watching it (pytest may run a thread or a
    tracer of its own)."""
    calls: list[str] = []
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("atexit"))

    def hard_exit(status: int) -> NoReturn:
        calls.append("os._exit")
        raise _Exited(status)

    monkeypatch.setattr(os, "_exit", hard_exit)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(sys, "gettrace", lambda: None)
    monkeypatch.setattr(sys, "getprofile", lambda: None)
    if hasattr(sys, "monitoring"):
        monkeypatch.setattr(sys.monitoring, "get_tool", lambda tool_id: None)
    monkeypatch.setattr(sys, "argv", BAD_MODEL)
    return calls


def run_entry_point(expected: type[BaseException]) -> BaseException:
    """`entry_point` in this process, expecting it to raise ``expected``; checks that it froze
    the collector first (and unfreezes it: this process goes on collecting)."""
    from aiayn.cli import entry_point

    gc.unfreeze()
    try:
        with pytest.raises(expected) as exited:
            entry_point()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    return exited.value


def test_the_aiayn_executable_runs_the_exit_handlers_then_ends_at_once_with_mains_status(
    exit_calls: list[str],
) -> None:
    """`entry_point` (the installed ``aiayn``, ``python -m aiayn``), with no other thread
    running: the exit handlers, then ``os._exit`` with what `main` returned, the collector
    frozen first (`entry_point`'s docstring)."""
    exited = run_entry_point(_Exited)
    assert isinstance(exited, _Exited) and exited.status == 2
    assert exit_calls == ["atexit", "os._exit"]


def test_the_aiayn_executable_ends_at_once_with_standard_output_closed(
    exit_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python started with file descriptor 1 closed (``aiayn train ... >&-``) has no
    ``sys.stdout``: nothing to flush there, and the command's status stands."""
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "__stdout__", None)
    exited = run_entry_point(_Exited)
    assert isinstance(exited, _Exited) and exited.status == 2


def test_the_aiayn_executable_lets_a_system_exit_pass_through(
    exit_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--version`` (argparse's own exit) and any command's ``SystemExit``: Python's exit."""
    monkeypatch.setattr(sys, "argv", ["aiayn", "--version"])
    exited = run_entry_point(SystemExit)
    assert isinstance(exited, SystemExit) and exited.code == 0
    assert exit_calls == []


def test_the_aiayn_executable_exits_the_usual_way_while_another_thread_runs(
    exit_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread still running may still be writing: Python's own exit waits for it."""
    monkeypatch.setattr(threading, "active_count", lambda: len(threading.enumerate()))
    done = threading.Event()
    thread = threading.Thread(target=done.wait)
    thread.start()
    try:
        exited = run_entry_point(SystemExit)
    finally:
        done.set()
        thread.join()
    assert isinstance(exited, SystemExit) and exited.code == 2
    assert exit_calls == []


WATCHERS = {
    "a profiler (cProfile)": lambda m: m.setattr(sys, "getprofile", lambda: object()),
    "a tracer (trace, coverage)": lambda m: m.setattr(sys, "gettrace", lambda: object()),
    "an interactive prompt to come (python -i)": lambda m: m.setattr(
        sys, "flags", types.SimpleNamespace(inspect=1)
    ),
}
if hasattr(sys, "monitoring"):  # Python >= 3.12
    WATCHERS["a tool of sys.monitoring"] = lambda m: m.setattr(
        sys.monitoring, "get_tool", lambda tool_id: "profiler" if tool_id == 2 else None
    )


@pytest.mark.parametrize("watcher", list(WATCHERS))
def test_the_aiayn_executable_exits_the_usual_way_while_something_watches_it(
    watcher: str, exit_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profiler, tracer or prompt that wraps the program does its work after the program
    returns to it (``python -m cProfile -m aiayn ...`` writes its profile then)."""
    WATCHERS[watcher](monkeypatch)
    exited = run_entry_point(SystemExit)
    assert isinstance(exited, SystemExit) and exited.code == 2
    assert exit_calls == []


def test_the_aiayn_executable_exits_the_usual_way_when_its_output_cannot_be_flushed(
    exit_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed pipe on standard output: Python's own exit reports it."""

    class ClosedPipe(io.StringIO):
        def flush(self) -> None:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    exited = run_entry_point(SystemExit)
    assert isinstance(exited, SystemExit) and exited.code == 2
    assert exit_calls == ["atexit"]


def as_the_executable(marker: Path, extra: str = "") -> str:
    """Python code that runs ``python -m aiayn`` on its own arguments, as the executable does,
    after ``extra``, recording in ``marker`` the status `os._exit` was called with (so that a
    test knows the quick exit was the way out)."""
    return (
        "import os, pathlib, runpy, sys\n"
        f"{extra}"
        "real_exit = os._exit\n"
        "def recorded_exit(status):\n"
        f"    pathlib.Path({str(marker)!r}).write_text(str(status))\n"
        "    real_exit(status)\n"
        "os._exit = recorded_exit\n"
        "sys.argv = ['aiayn', *sys.argv[1:]]\n"
        "runpy.run_module('aiayn', run_name='__main__')\n"
    )


def test_the_aiayn_executable_flushes_what_c_code_printed_before_ending_at_once(
    tmp_path: Path,
) -> None:
    """A library's ``printf`` to a pipe sits in C's buffer until the process flushes it
    (unless ``PYTHONUNBUFFERED`` turned C's buffering off too)."""
    marker = tmp_path / "os-exit"
    code = as_the_executable(
        marker, "import ctypes\nctypes.CDLL(None).printf(b'printed by C\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = subprocess.run(
        [sys.executable, "-c", code, *BAD_MODEL[1:]],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert marker.read_text() == "2"
    assert run.stdout == "printed by C\n"


def test_the_aiayn_executable_loses_nothing_by_ending_at_once(tmp_path: Path) -> None:
    """``python -m aiayn translate`` in a process of its own, as users run it, ending by the
    quick exit: every line on standard output (a pipe) and in the ``-o`` file (decoded by
    worker processes), exit status 0, and an exit handler run."""
    from model_dirs import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "run", eos_scale=4.0)
    lines = [f"the cat sat on the mat {i}" for i in range(40)]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    handler = tmp_path / "atexit-ran"
    marker = tmp_path / "os-exit"
    code = as_the_executable(
        marker,
        f"import atexit\natexit.register(pathlib.Path({str(handler)!r}).write_text, 'yes')\n",
    )
    common = ["translate", "-m", str(model_dir), "-i", str(source), "--no-progress"]
    to_pipe = subprocess.run(
        [sys.executable, "-c", code, *common, "--threads", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert to_pipe.returncode == 0, to_pipe.stderr
    assert marker.read_text() == "0"
    assert handler.read_text() == "yes"
    assert len(to_pipe.stdout.splitlines()) == len(lines)
    marker.unlink()
    out = tmp_path / "out.txt"  # and with two worker processes, a batch a sentence
    workers = ["--threads", "2", "--workers", "2", "--max-tokens", "64"]
    to_file = subprocess.run(
        [sys.executable, "-c", code, *common, *workers, "-o", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert to_file.returncode == 0, to_file.stderr
    assert marker.read_text() == "0"
    assert out.read_text(encoding="utf-8") == to_pipe.stdout


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError(errno.EFBIG, "File too large"),
    ],
    ids=lambda error: errno.errorcode[error.errno],
)
def test_a_full_disk_or_quota_that_names_no_file_is_one_line_too(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: OSError,
) -> None:
    """A failed ``write`` names no file: a full disk, a quota or a size limit is still the
    user's to fix, and the line says what it is."""
    load_raising(monkeypatch, _raise(error))
    assert main(translate_argv) == 2
    assert capsys.readouterr().err == (
        f"aiayn translate: error: {error.strerror}: a file could not be written (the disk is "
        "full, or a quota or a file size limit is reached)\n"
    )


def test_a_write_limit_reached_by_train_is_one_line(tmp_path: Path) -> None:
    """``aiayn train`` under a file size limit (RLIMIT_FSIZE, as a quota): the tokenizer it
    writes is over it, and the write's OSError, which names no file, is one line, exit 2."""
    import resource

    from model_dirs import CORPUS

    (tmp_path / "a.en").write_text("\n".join(CORPUS[:3] * 20) + "\n")
    (tmp_path / "a.de").write_text("\n".join(CORPUS[3:6] * 20) + "\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    argv = ["train", "--src", "a.en", "--tgt", "a.de", "--out-dir", "run", "--vocab-size", "300"]
    run = subprocess.run(
        [sys.executable, "-m", "aiayn", *argv, "--preset", "tiny", "--no-progress"],
        preexec_fn=limit,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (
        "aiayn train: error: File too large: a file could not be written (the disk is full, or "
        "a quota or a file size limit is reached)"
    )
    assert "Traceback" not in run.stderr


def _loses_ctrl_c(then: Callable[[], object]) -> Callable[[], None]:
    """A load that Ctrl-C reaches inside a library that loses it (as numpy's import does when
    it is interrupted half-way under torch's), then goes on with ``then``."""

    def load() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the KeyboardInterrupt is raised here...
        except KeyboardInterrupt:
            pass  # ... and lost
        then()

    return load


def test_ctrl_c_that_a_library_loses_still_ends_the_command(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C is raised again until the command ends by it: 130, not a command that goes on."""
    went_on = []

    def work() -> None:
        for _ in range(50):  # 5 s of work, if nothing stops it
            time.sleep(0.1)
        went_on.append(True)

    load_raising(monkeypatch, _loses_ctrl_c(work))
    assert main(translate_argv) == 130
    assert not went_on  # stopped before its 5 s of work ended
    assert capsys.readouterr().err.endswith("interrupted\n")


def test_an_error_of_what_ctrl_c_stopped_half_way_is_an_interruption_not_a_bug(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """numpy interrupted while it is imported fails the next import of it ("cannot load module
    more than once per process"): after Ctrl-C, that is the interruption, not a bug."""
    load_raising(
        monkeypatch,
        _loses_ctrl_c(_raise(ImportError("cannot load module more than once per process"))),
    )
    assert main(translate_argv) == 130
    err = capsys.readouterr().err
    assert err.endswith("interrupted\n") and REPORT not in err


def test_a_closed_standard_output_ends_the_command_quietly_with_status_141(tmp_path: Path) -> None:
    """``aiayn translate ... | head``: once the reader has gone, the command stops without a
    traceback or a report of a bug, with the status a shell gives ``yes | head`` (141), as the
    executable runs it; the same when `main` is called."""
    from model_dirs import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "run", eos_scale=4.0)
    source = tmp_path / "in.txt"
    source.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    argv = ["translate", "-m", str(model_dir), "-i", str(source), "--threads", "1", "--no-progress"]
    commands = {
        "python -m aiayn": [sys.executable, "-m", "aiayn", *argv],
        "main()": [
            sys.executable,
            "-c",
            f"import sys\nfrom aiayn.cli import main\nsys.exit(main({argv!r}))",
        ],
    }
    for name, command in commands.items():
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # before it writes a line: the reader has gone
        stderr = process.stderr.read()
        assert process.wait(timeout=300) == 141, (name, stderr)
        assert "Traceback" not in stderr and "bug" not in stderr, (name, stderr)


def test_a_broken_pipe_that_is_not_standard_output_is_still_a_bug(
    translate_argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A BrokenPipeError from some other pipe (a worker's, a socket) keeps its traceback."""
    load_raising(monkeypatch, _raise(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert main(translate_argv) == 1
    assert REPORT in capsys.readouterr().err
