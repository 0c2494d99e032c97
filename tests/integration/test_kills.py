"""A command killed at any moment leaves nothing behind: no process of aiayn's still running, and
no temporary file beside its output that the next run to the same output does not remove.

Each test starts ``python -m aiayn ...`` as a real process, kills it (SIGKILL: nothing of
aiayn's runs after it), and looks at what is left: the processes it had forked, from ``/proc``,
and the files beside its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.decode.workers import fork_missing
from model_dirs import CORPUS, tiny_model_dir

pytestmark = pytest.mark.skipif(fork_missing() is not None, reason=str(fork_missing()))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("kills"), eos_scale=0.2, max_positions=256)


@pytest.fixture(scope="module")
def big_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Enough sentences for a tiny model to decode for minutes."""
    source = tmp_path_factory.mktemp("input") / "in.txt"
    source.write_text("\n".join(CORPUS * 2000) + "\n", encoding="utf-8")
    return source


def aiayn(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "aiayn", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (zombies included), from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (ended, waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


def test_decoding_workers_end_when_translate_is_killed(
    model_dir: Path, big_input: Path, tmp_path: Path
) -> None:
    """``aiayn translate --workers 2`` killed with SIGKILL mid-work: its workers end too."""
    out = tmp_path / "out.txt"
    process = aiayn(
        "translate", "-m", str(model_dir), "-i", str(big_input), "-o", str(out),
        "--threads", "2", "--workers", "2", "--max-tokens", "64", "--no-progress",
    )  # fmt: skip
    workers: set[int] = set()
    try:
        wait_for(lambda: len(children(process.pid)) >= 2, 120, "the workers to start")
        workers = children(process.pid)
        time.sleep(0.5)  # decoding
        kill(process)
        wait_for(lambda: not any(map(running, workers)), 5, f"workers {workers} to end")
    finally:
        if process.poll() is None:
            kill(process)
        for pid in filter(running, workers):  # what a failure left: not for the next test
            os.kill(pid, signal.SIGKILL)


def test_a_killed_worker_is_one_line_with_exit_status_1(
    model_dir: Path, big_input: Path, tmp_path: Path
) -> None:
    """A decoding worker killed from outside (as for memory) is neither the user's mistake
    (exit 2) nor a bug (a traceback and a request for a report): one line saying what to lower,
    exit 1, and no output file or part of one."""
    out = tmp_path / "out.txt"
    process = aiayn(
        "translate", "-m", str(model_dir), "-i", str(big_input), "-o", str(out),
        "--workers", "2", "--max-tokens", "64", "--no-progress",
    )  # fmt: skip
    try:
        wait_for(lambda: len(children(process.pid)) >= 2, 120, "the workers to start")
        time.sleep(0.5)
        os.kill(min(children(process.pid)), signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill(process)
    lines = stderr.decode().strip().splitlines()
    assert process.returncode == 1, stderr
    assert lines[-1].startswith("aiayn translate: error: a decoding worker process died"), lines
    assert "Traceback" not in stderr.decode() and "bug" not in stderr.decode()
    assert list(tmp_path.iterdir()) == []


def dead_pid() -> int:
    """The PID of a process that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


PART = re.compile(r"\..+\.(tmp|old)-\d+")


def dot_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_translate_killed_while_writing_leaves_a_part_the_next_run_removes(
    model_dir: Path, big_input: Path, tmp_path: Path
) -> None:
    """``aiayn translate -o OUT`` killed mid-work: OUT is as it was, and its temporary file,
    which the kill left, is removed by the next run to OUT."""
    out = tmp_path / "out.txt"
    out.write_text("kept\n")
    process = aiayn(
        "translate", "-m", str(model_dir), "-i", str(big_input), "-o", str(out),
        "--workers", "1", "--threads", "1", "--max-tokens", "64", "--no-progress",
    )  # fmt: skip
    try:
        wait_for(lambda: dot_files(tmp_path), 120, "the output to be opened")
        time.sleep(0.5)  # decoding, the output open
    finally:
        kill(process)
    assert out.read_text() == "kept\n"
    assert len(dot_files(tmp_path)) == 1  # the temporary file: nothing removes it at a SIGKILL
    small = tmp_path / "small.txt"
    small.write_text("the cat\n")
    again = aiayn("translate", "-m", str(model_dir), "-i", str(small), "-o", str(out))
    assert again.wait(timeout=120) == 0, again.stderr.read() if again.stderr else ""
    assert dot_files(tmp_path) == []
    assert len(out.read_text().splitlines()) == 1


def test_average_and_export_remove_what_killed_writers_of_their_output_left(
    model_dir: Path, tmp_path: Path
) -> None:
    """A temporary directory and a moved-aside one that a killed ``average`` or ``export`` left
    beside ``-o`` (made here by hand, under the PID of a process that has ended) are removed by
    the next run to it; a live process's part is kept."""
    from aiayn.cli import main
    from aiayn.model_dir import save_model_dir, tokenizer_file_of
    from aiayn.text.tokenizer import Tokenizer
    from model_dirs import tiny_model

    run = tmp_path / "run"
    tokenizer = Tokenizer.load(tokenizer_file_of(model_dir))
    for step, seed in ((1, 1), (2, 2)):
        save_model_dir(
            run / "checkpoints" / f"step_{step:08d}",
            tiny_model(tokenizer.vocab_size, preset="tiny", seed=seed),
            tokenizer_file=tokenizer.model_file,
            metadata={"step": step},
        )
    outputs = tmp_path / "outputs"
    commands = {"averaged": ["average", str(run), "-n", "2"]}
    if importlib.util.find_spec("ctranslate2") is not None:
        commands["ct2"] = ["export", str(model_dir), "--to", "ctranslate2"]
    for name, argv in commands.items():
        output = outputs / name
        assert main([*argv, "-o", str(output)]) == 0
        dead, live = dead_pid(), os.getppid()
        for kind, pid in (("tmp", dead), ("old", dead), ("tmp", live)):
            (outputs / f".{name}.{kind}-{pid}").mkdir()
            (outputs / f".{name}.{kind}-{pid}" / "junk").write_text("partial")
        assert main([*argv, "-o", str(output)]) == 0
        assert dot_files(outputs) == [f".{name}.tmp-{live}"], name
        (outputs / f".{name}.tmp-{live}" / "junk").unlink()
        (outputs / f".{name}.tmp-{live}").rmdir()


def _argv(command: str, model_dir: Path, source: Path, out: Path) -> list[str]:
    given = {"translate": ["-i", str(source)], "evaluate": ["--src", str(source)]}
    given["evaluate"] += ["--ref", str(source)]
    given["score"] = ["--src", str(source), "--tgt", str(source)]
    workers = ["--workers", "2", "--max-tokens", "64"] if command != "score" else []
    return [command, "-m", str(model_dir), *given[command], "-o", str(out), *workers]


@pytest.mark.parametrize("moment", ["loading", "working"])
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("command", ["translate", "evaluate", "score"])
def test_a_decoding_command_stopped_at_any_moment_leaves_nothing_running_or_behind(
    command: str,
    signal_number: int,
    moment: str,
    model_dir: Path,
    big_input: Path,
    tmp_path: Path,
) -> None:
    """``translate``, ``evaluate`` and ``score`` killed (SIGKILL), terminated (SIGTERM) or
    interrupted (Ctrl-C) while loading or while working, its output open: no process of theirs
    is left, their output is as it was, and a second run to the same output leaves no
    temporary file beside it."""
    out = tmp_path / "out" / "result.txt"
    out.parent.mkdir()
    out.write_text("kept\n")
    process = aiayn(*_argv(command, model_dir, big_input, out), "--no-progress")
    descendants: set[int] = set()
    try:
        if moment == "loading":
            time.sleep(0.5)
        else:
            wait_for(lambda: dot_files(out.parent), 120, "the output to be opened")
            time.sleep(0.5)
            descendants = children(process.pid)
        process.send_signal(signal_number)
        process.wait(timeout=60)
        wait_for(lambda: not any(map(running, descendants)), 5, f"{descendants} to end")
    finally:
        if process.poll() is None:
            kill(process)
        for pid in filter(running, descendants):
            os.kill(pid, signal.SIGKILL)
    assert out.read_text() == "kept\n"
    small = tmp_path / "small.txt"
    small.write_text("the cat\n")
    again = aiayn(*_argv(command, model_dir, small, out))
    assert again.wait(timeout=120) == 0, again.stderr.read() if again.stderr else ""
    assert dot_files(out.parent) == []


# -- the writers: average, export, import, prepare --------------------------------------------


@pytest.fixture(scope="module")
def writers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each writer's command but its output: ``average`` of two checkpoints and ``export`` of
    one to CTranslate2 (where installed), models wider than tiny so that writing them takes a
    while; ``import`` of an ``export --to hf``; ``prepare`` of a local copy of a 200,000-pair
    dataset in the Hub's format."""
    from aiayn.cli import main
    from aiayn.model_dir import save_model_dir, tokenizer_file_of
    from aiayn.text.tokenizer import Tokenizer
    from model_dirs import tiny_model

    inputs = tmp_path_factory.mktemp("writers")
    run = inputs / "run"
    tokenizer = Tokenizer.load(tokenizer_file_of(model_dir))
    for step in (1, 2):
        save_model_dir(
            run / "checkpoints" / f"step_{step:08d}",
            tiny_model(tokenizer.vocab_size, preset="tiny", seed=step, d_model=256, d_ff=1024),
            tokenizer_file=tokenizer.model_file,
            metadata={"step": step},
        )
    commands = {"average": ["average", str(run), "-n", "2"]}
    if importlib.util.find_spec("ctranslate2") is not None:
        commands["export"] = ["export", str(run / "checkpoints" / "step_00000002")]
        commands["export"] += ["--to", "ctranslate2"]
    if importlib.util.find_spec("transformers") is not None:
        assert main(["export", str(model_dir), "--to", "hf", "-o", str(inputs / "hf")]) == 0
        commands["import"] = ["import", str(inputs / "hf")]
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        features = datasets.Features({"translation": datasets.Translation(["de", "en"])})
        pairs = [{"de": f"Satz {i} " * 5, "en": f"sentence {i} " * 5} for i in range(200_000)]
        splits = {"train": pairs, "validation": pairs[:9], "test": pairs[:9]}
        hub = inputs / "hub"
        datasets.DatasetDict(
            {
                split: datasets.Dataset.from_dict({"translation": records}, features=features)
                for split, records in splits.items()
            }
        ).save_to_disk(str(hub))
        commands["prepare"] = ["prepare", "wmt14-en-de", "--force", "--data-dir", str(hub)]
    return commands


def parts_under(directory: Path) -> list[str]:
    """The parts (``.NAME.tmp-PID``, ``.NAME.old-PID``) in ``directory`` and below it."""
    found = []
    for root, directories, files in os.walk(directory):
        found += [f"{root}/{name}" for name in directories + files if PART.fullmatch(name)]
    return found


def signal_at(
    process: subprocess.Popen[bytes], signal_number: int, moment: str, where: Path
) -> set[int]:
    """Sends ``signal_number`` to ``process`` while it loads (0.5 s in) or, with ``moment``
    "writing", as soon as a part appears in ``where`` (frozen with SIGSTOP the moment it is
    seen, so that the signal finds it writing); returns the processes it had forked then."""
    if moment == "loading":
        time.sleep(0.5)
        descendants = children(process.pid)
        process.send_signal(signal_number)
        return descendants
    deadline = time.monotonic() + 120
    while not parts_under(where):
        assert process.poll() is None, "it ended before a part was seen: give it more to write"
        assert time.monotonic() < deadline, "no part appeared"
        time.sleep(0.001)
    process.send_signal(signal.SIGSTOP)
    descendants = children(process.pid)
    process.send_signal(signal_number)
    process.send_signal(signal.SIGCONT)
    return descendants


@pytest.mark.parametrize("moment", ["loading", "writing"])
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize(
    "command", ["average", "export", pytest.param("import", marks=pytest.mark.slow), "prepare"]
)
def test_a_writer_stopped_at_any_moment_leaves_nothing_running_or_behind(
    command: str,
    signal_number: int,
    moment: str,
    writers: dict[str, list[str]],
    tmp_path: Path,
) -> None:
    """``average``, ``export``, ``import`` and ``prepare`` killed (SIGKILL), terminated (SIGTERM)
    or interrupted (Ctrl-C) while loading or while writing: no process of theirs is left, and
    the next run to the same output succeeds and leaves no part beside it, in it or in the
    system's temporary directory."""
    if command not in writers:
        pytest.skip(f"the optional dependency of {command} is not installed")
    output = tmp_path / "out" / "result"
    output.parent.mkdir()
    argv = [*writers[command], *([str(output)] if command == "prepare" else ["-o", str(output)])]
    process = aiayn(*argv)
    descendants: set[int] = set()
    try:
        descendants = signal_at(process, signal_number, moment, output.parent)
        process.wait(timeout=60)
        wait_for(lambda: not any(map(running, descendants)), 5, f"{descendants} to end")
    finally:
        if process.poll() is None:
            kill(process)
        for pid in filter(running, descendants):
            os.kill(pid, signal.SIGKILL)
    again = aiayn(*argv)
    assert again.wait(timeout=120) == 0, again.stderr.read() if again.stderr else ""
    assert parts_under(output.parent) == []
    system = Path(tempfile.gettempdir())
    assert [p.name for p in system.glob(f".*-{process.pid}")] == []


# -- serve ------------------------------------------------------------------------------------


def health(port: int) -> dict | None:
    """``GET /health``'s answer, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return json.loads(answer.read())
    except (OSError, ValueError):  # not listening yet, or a 503 while it starts
        return None


@pytest.mark.parametrize("moment", ["loading", "serving"])
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_serve_stopped_at_any_moment_leaves_nothing_running_or_behind(
    signal_number: int, moment: str, model_dir: Path
) -> None:
    """``aiayn serve`` killed (SIGKILL), terminated (SIGTERM) or interrupted (Ctrl-C) while it
    loads or while a costly request is being translated (a minute of work on this model): it
    ends within seconds, leaving no process and no part in the system's temporary directory,
    and a SIGTERM or Ctrl-C answers the waiting client 503 first."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = aiayn("serve", "-m", str(model_dir), "--port", str(port))
    client = None
    descendants: set[int] = set()
    try:
        if moment == "loading":
            time.sleep(0.5)
        else:
            wait_for(lambda: health(port) or process.poll() is not None, 120, "the server")
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            body = json.dumps({"texts": [" ".join(CORPUS)] * 30, "beam_size": 8}).encode()
            client = socket.create_connection(("127.0.0.1", port), timeout=60)
            client.sendall(
                b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(lambda: (health(port) or {}).get("queued", 0) > 0, 30, "the request")
        descendants = children(process.pid)
        started = time.monotonic()
        process.send_signal(signal_number)
        process.wait(timeout=120)
        assert time.monotonic() - started < 10, "it took long to end"
        wait_for(lambda: not any(map(running, descendants)), 5, f"{descendants} to end")
        if client is not None and signal_number != signal.SIGKILL:
            assert client.recv(100).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    finally:
        if client is not None:
            client.close()
        if process.poll() is None:
            kill(process)
        for pid in filter(running, descendants):
            os.kill(pid, signal.SIGKILL)
    system = Path(tempfile.gettempdir())
    assert [p.name for p in system.glob(f".*-{process.pid}")] == []


# -- train ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["loading", "writing"])
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_train_stopped_while_it_sets_up_leaves_nothing_running_or_behind(
    signal_number: int, moment: str, tmp_path: Path
) -> None:
    """``aiayn train`` killed, terminated or interrupted while it loads or while it writes its
    tokenizer and binarised data: no process of its is left, and the same command run again
    trains and leaves no part in the run directory or the system's temporary directory.
    (Stopped while it trains: ``test_sigkill_then_resume_is_exact`` and
    ``test_sigterm_saves_exits_143_and_resumes_exactly`` in test_train_e2e.py.)"""
    for side in ("en", "de"):
        (tmp_path / f"train.{side}").write_text("\n".join(CORPUS * 3000) + "\n")
    run = tmp_path / "run"
    argv = ["train", "--src", str(tmp_path / "train.en"), "--tgt", str(tmp_path / "train.de")]
    argv += ["--out-dir", str(run), "--preset", "tiny", "--vocab-size", "400"]
    argv += ["--max-steps", "2", "--no-progress"]
    run.mkdir()  # where parts appear
    process = aiayn(*argv)
    descendants: set[int] = set()
    try:
        descendants = signal_at(process, signal_number, moment, run)
        process.wait(timeout=60)
        wait_for(lambda: not any(map(running, descendants)), 5, f"{descendants} to end")
    finally:
        if process.poll() is None:
            kill(process)
        for pid in filter(running, descendants):
            os.kill(pid, signal.SIGKILL)
    again = aiayn(*argv)
    assert again.wait(timeout=300) == 0, again.stderr.read() if again.stderr else ""
    assert parts_under(run) == []
    system = Path(tempfile.gettempdir())
    assert [p.name for p in system.glob(f".*-{process.pid}")] == []
