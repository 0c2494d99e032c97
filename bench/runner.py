"""The harness every benchmark runs on: the machine, whole commands in rounds, one record a run.

A benchmark here times what a user runs, whole commands each in a process of its own, in
interleaved rounds (a slow minute of a shared machine then hurts every system alike), on a
machine that is otherwise idle (`check_idle` reads the load average first). Each run appends
one record, a line of JSON, to `bench/results/TASK.jsonl` (`record`): what was measured and the
command that reproduces it; the machine (CPU model, its AVX2 / AVX-512 / AMX flags, the cores
used, the GPU) and versions; the commit and the git hash of each source folder the task
exercises (`SOURCES`), by which bench/page.py marks a row measured on older code (`same_code`);
and the figures, each round's value beside the median.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RECIPE = "recipes/bible-en-es-cpu.yaml"
"""The CPU recipe, which bench/train.py and bench/study.py train."""
IDLE_LOAD = 0.5
"""The 1-minute load average per core above which a machine counts as busy."""

TEXT = tuple(f"src/aiayn/text/{name}.py" for name in ("batching", "corpus", "lines", "tokenizer"))
"""What training reads its text with (not `aiayn prepare`, which makes the text)."""
TRAINING = (
    "src/aiayn/train", "src/aiayn/model.py", "src/aiayn/attention.py", "src/aiayn/loss.py",
    "src/aiayn/optim.py", "src/aiayn/acceleration.py", *TEXT, "src/aiayn/cli/train.py",
)  # fmt: skip
"""What `aiayn train` runs: the trainer, the model and its kernels, the loss, the optimizer."""
SOURCES = {
    "demo": ("src/aiayn/demo.py", *TRAINING, "src/aiayn/decode"),
    "translate": (
        "src/aiayn/decode", "src/aiayn/model.py", "src/aiayn/attention.py",
        "src/aiayn/cache.py", "src/aiayn/acceleration.py", *(f"src/aiayn/cli/{name}.py"
        for name in ("__init__", "common", "flags", "parser", "translate")),
    ),
    "train": (RECIPE, *TRAINING),
    "recipe": (RECIPE, *TRAINING, "src/aiayn/decode"),
    "serve": ("src/aiayn/serve", "src/aiayn/decode", "src/aiayn/model.py"),
    "gpu": ("src/aiayn",),
    "study": (RECIPE, *TRAINING, "src/aiayn/decode"),
}  # fmt: skip
"""Per task, the folders (and files) whose change can move its figures: what trains (the
recipe's settings among them) and, where BLEU is scored, the search."""
AIAYN = [sys.executable, "-m", "aiayn"]
"""The `aiayn` command, as this Python runs it."""


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------


def cpu() -> dict[str, Any]:
    """The CPU's model name, its vector flags that decide the kernels, and the cores used."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        text = ""
    if found := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        name = found.group(1).strip()
    if found := re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE):
        flags = set(found.group(1).split())
    named = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX"}
    try:
        cores = len(os.sched_getaffinity(0))  # what taskset leaves this process
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {"cpu": name, "flags": [v for k, v in named.items() if k in flags], "cores": cores}


def nvidia_smi(query: str) -> list[str]:
    """`query` of each NVIDIA GPU by nvidia-smi (`name`, `driver_version`, ...); [] without."""
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines if done.returncode == 0 else []


def gpu() -> str | None:
    """The NVIDIA GPUs, or None (also where CUDA_VISIBLE_DEVICES hides them)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None
    return ", ".join(nvidia_smi("name")) or None


def version(distribution: str) -> str | None:
    """The installed version of `distribution`, without importing it; None if missing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(name: str | None = None) -> dict[str, Any]:
    """The machine as a record names it: `name` (say "AMD EPYC with AVX2, 2 cores"; by default
    the CPU's model name, its widest flag and the cores), CPU, flags, cores and GPU."""
    m = {**cpu(), "gpu": gpu()}
    widest = m["flags"][-1] if m["flags"] else "no AVX2"
    m["name"] = name or (f"{m['gpu']} beside " if m["gpu"] else "") + (
        f"{m['cpu']} ({widest}), {m['cores']} cores"
    )
    return m


def versions(*peers: str) -> dict[str, str | None]:
    """Python's, torch's and each peer distribution's version (None: not installed)."""
    return {"python": platform.python_version(), "torch": version("torch")} | {
        peer: version(peer) for peer in peers
    }


def git(*args: str, stdin: str | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git, or a hung one
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_bytes(*args: str) -> bytes | None:
    """`git` with its output as bytes, unstripped (a file's contents)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_hashes(paths: Sequence[str], commit: str = "HEAD") -> dict[str, str] | None:
    """The git object hash of each path at `commit` (a folder's tree, a file's blob; a path
    missing there is left out), in one call; None where git cannot say (no git, or a copy of
    the tree without its repository)."""
    out = git("cat-file", "--batch-check", stdin="".join(f"{commit}:{p}\n" for p in paths))
    if out is None:
        return None
    found = [line.split()[0] for line in out.splitlines()]
    return {p: h for p, h in zip(paths, found, strict=True) if not h.endswith(":" + p)}


COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def missing_commits(commits: Sequence[str]) -> list[str]:
    """Those of `commits` this clone does not hold (a shallow clone lacks older ones)."""
    return [c for c in commits if not COMMIT.fullmatch(c) or git("cat-file", "-e", c) is None]


def same_code(commit: str, head: str, paths: tuple[str, ...]) -> bool | None:
    """Whether `paths` hold the same code at `commit` as at `head`: each file that differs is a
    Python file whose syntax tree, bare string statements (docstrings) left out, is the same
    (comments and layout are not in it), or a YAML file of the same values (`code`). A file
    added, deleted or renamed differs. None where git cannot say (a commit this clone lacks)."""
    if not (COMMIT.fullmatch(commit) and COMMIT.fullmatch(head)):
        return None
    key = (commit, head, paths)
    if key not in _SAME:
        out = git_bytes("diff", "-z", "--name-only", "--no-renames", commit, head, "--", *paths)
        if out is None:
            return None
        same = True
        for name in filter(None, out.decode("utf-8", "surrogateescape").split("\0")):
            before = git_bytes("cat-file", "blob", f"{commit}:{name}")
            after = git_bytes("cat-file", "blob", f"{head}:{name}")
            if before is None or after is None or code(name, before) != code(name, after):
                same = False  # added, deleted or changed
                break
        _SAME[key] = same
    return _SAME[key]


_SAME: dict[tuple[str, str, tuple[str, ...]], bool] = {}
"""`same_code`'s answers (commit hashes fix the contents: an answer holds for the process)."""


def code(name: str, blob: bytes) -> object:
    """What of a file can change a figure: a Python file's syntax tree without its bare string
    statements (docstrings), a YAML file's values; else (or unparsable) its bytes."""
    import yaml  # a dependency of aiayn's

    try:
        if name.endswith((".yaml", ".yml")):
            return repr(yaml.safe_load(blob))
        if name.endswith(".py"):
            tree = ast.parse(blob)
            for node in ast.walk(tree):
                for field in ("body", "orelse", "finalbody"):
                    statements = getattr(node, field, None)
                    if isinstance(statements, list):
                        setattr(node, field, [s for s in statements if not (
                            isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                            and isinstance(s.value.value, str)
                        )])  # fmt: skip
            return ast.dump(tree)
    except (SyntaxError, ValueError, TypeError, yaml.YAMLError):
        pass
    return blob


def provenance(task: str) -> dict[str, Any]:
    """The commit measured and the hashes of `src` and the task's folders; `uncommitted` where
    the working tree differs from the commit in them (the record then says so)."""
    paths = ("src", *SOURCES[task])
    return {
        "commit": git("rev-parse", "HEAD"),
        "sources": source_hashes(paths),
        "uncommitted": bool(git("status", "--porcelain", "--", *paths)),
    }


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def stop_children_on_sigterm() -> None:
    """Have SIGTERM end this benchmark as Ctrl-C does, by an exception, so that the command it
    is timing stops with it (`subprocess.run` kills its child on any exception; the harness's
    own `Popen`s stop theirs in a `finally`): a benchmark stopped with `kill` leaves no trainer,
    translator or server running. Process-wide, so for the entry points' `main`."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def ends_with_benchmark() -> None:
    """`preexec_fn` for a command the harness runs: on Linux the command gets SIGTERM when the
    benchmark dies, even of SIGKILL (which no handler sees), so that no trainer, translator or
    server outlives it (`stop_children_on_sigterm` covers the signals a handler sees)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_idle(force: bool = False, wait_s: float = 180.0) -> float | None:
    """The 1-minute load average, once it is at most `IDLE_LOAD` per core: waits up to `wait_s`
    for it to fall (a benchmark just before leaves it high for a minute or two), then exits
    with one line, unless `force` (the record then keeps the load it ran under)."""
    cores, deadline = cpu()["cores"], time.monotonic() + wait_s
    while (load := load_average()) is not None and load > IDLE_LOAD * cores and not force:
        if time.monotonic() > deadline:
            sys.exit(
                f"the machine is busy (1-minute load average {load:.1f} on {cores} cores): "
                "wait until it is idle, or pass --busy-ok to measure anyway"
            )
        time.sleep(10)
    return load


def shell_line(env: dict[str, str], argv: list[str]) -> str:
    """`argv` as a shell runs it with `env` set: "VAR=VALUE ... command args"."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


def variant_words(spec: str) -> tuple[list[str], dict[str, str]]:
    """A `--variant NAME=FLAGS`'s flags and environment (ValueError: not one): words of the
    form VAR=VALUE before the flags set its environment, as in a shell."""
    name, _, text = spec.partition("=")
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not name or not (words or env):
        raise ValueError(f"--variant {spec!r}: give NAME=FLAGS, e.g. onednn='--onednn'")
    return words, env


@dataclass
class Command:
    """One system's whole command; `{out}` in it is replaced by the round's output file."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set on top of the run's environment
    seconds: list[float] = field(default_factory=list)
    output: Path | None = None  # the first round's

    def argv_for(self, out: Path, swap: Mapping[str, str] | None = None) -> list[str]:
        swap = {"{out}": str(out), **(swap or {})}
        return [swap.get(part, part) for part in self.argv]


def timed(command: Command, out: Path, env: Mapping[str, str], **swap: str) -> float:
    """Seconds from launch to exit of `command` writing `out`; a failure raises with the end
    of its standard error."""
    start = time.perf_counter()
    argv, environment = command.argv_for(out, swap), {**env, **command.env}
    done = subprocess.run(argv, env=environment, capture_output=True, text=True,
                          preexec_fn=ends_with_benchmark)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{command.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def rounds(
    commands: list[Command],
    n: int,
    work: Path,
    env: Mapping[str, str],
    alternate: bool = False,
    after: Callable[[int, Command], None] | None = None,
) -> None:
    """`n` interleaved rounds of every command (in reverse order every other round where
    `alternate`), each round's seconds appended to its `seconds`; `after(round, command)`
    runs, untimed, after each."""
    for r in range(n):
        for i, command in enumerate(commands[::-1] if alternate and r % 2 else commands):
            out = work / f"round{r}-{i}.out"
            command.seconds.append(timed(command, out, env))
            command.output = command.output or out
            print(f"round {r + 1}: {command.name}: {command.seconds[-1]:.2f} s", flush=True)
            if after:
                after(r, command)


def figures(values: Sequence[float], digits: int = 2) -> dict[str, Any]:
    """The median and every round's value."""
    return {
        "median": round(statistics.median(values), digits),
        "rounds": [round(v, digits) for v in values],
    }


def with_src_on_path(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with this checkout's src/ first on PYTHONPATH (what was there stays after it,
    made absolute for a command run elsewhere: packages installed with `pip --target`, say)."""
    kept = [Path(p) for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [ROOT / "src", *kept]
    return {**environ, "PYTHONPATH": os.pathsep.join(str(p.resolve()) for p in paths)}


def proc_kib(pid: int, field: str) -> int | None:
    """A memory figure of a live process from /proc/PID/status, in KiB: `VmRSS` (resident
    now), `VmHWM` (its peak); None once the process is gone, or off Linux."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) if found else None


def run_to(
    command: Sequence[str], out: IO[str], *, env: Mapping[str, str]
) -> tuple[int, float, float]:
    """Run `command`, its standard output and error into `out` in the order it writes them;
    (exit status, seconds from launch to exit, its peak resident memory in KiB). The peak is
    this child's (`wait4`), not the largest of every child this process has waited for, as
    `getrusage(RUSAGE_CHILDREN)` says; it counts from the fork, so it is at least what this
    process held then: a harness that holds little, as the bench scripts do, measures the
    command. Ctrl-C or SIGTERM here stops it too."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                               preexec_fn=ends_with_benchmark)  # fmt: skip
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait again
    return process.returncode, time.perf_counter() - start, usage.ru_maxrss


def run_logged(
    command: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str],
    timeout: float | None = None,
    append: bool = False,
    cwd: Path | None = None,
) -> tuple[int | None, str]:
    """Run `command`, its output into `log` (with `append`, after what the log holds, under the
    command's line); (exit status, or None on a timeout; the output)."""
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, timeout=timeout,
                              preexec_fn=ends_with_benchmark)  # fmt: skip
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = None, (expired.stdout or b"") + (expired.stderr or b"")
        output += f"\n(timed out after {timeout:.0f} s)\n".encode()
    text = output.decode(errors="replace")
    with log.open("a" if append else "w", encoding="utf-8") as file:
        file.write(f"$ {' '.join(command)}\n{text}\n" if append else text)
    return code, text


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every entry point shares."""
    parser.add_argument("--machine", help="the machine's name in the record (default: its CPU)")
    parser.add_argument("--setup", help="what this run's rows stand for, e.g. the model's name")
    parser.add_argument("--busy-ok", action="store_true", help="measure on a busy machine too")
    parser.add_argument(
        "--record", type=Path, help="append the record here (default bench/results/TASK.jsonl)"
    )
    parser.add_argument("--no-record", action="store_true", help="print the table only")


def record(
    task: str,
    *,
    table: str,
    setup: str,
    columns: list[tuple[str, str]],
    rows: list[dict[str, Any]],
    summary: str,
    peers: Sequence[str] = (),
    machine_name: str | None = None,
    load: float | None = None,
    notes: Sequence[str] = (),
    command: str | None = None,
) -> dict[str, Any]:
    """One run's record: what, how, where, on which source, and the figures; `command` is
    the one that reproduces it (by default this process's own)."""
    return {
        "task": task,
        "table": table,
        "setup": setup,
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": command or shlex.join(["python", *reproducing(sys.argv)]),
        "machine": machine(machine_name),
        "load_average": load,
        "versions": versions(*peers),
        **provenance(task),
        "columns": [list(c) for c in columns],
        "rows": rows,
        "summary": summary,
        "notes": list(notes),
    }


_LABELS = ("--machine", "--setup", "--record", "--work-dir")
"""Options that name or place a record or its runs, not what it measures: its command leaves
them out."""


def reproducing(argv: Sequence[str]) -> list[str]:
    """`argv` without the options that only label the record or say where it goes, so that a
    record's command is the measurement and runs of it on other machines read alike."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LABELS:
            skip = True
        elif arg != "--no-record" and not arg.startswith(tuple(f"{o}=" for o in _LABELS)):
            out.append(arg)
    return out


def write(rec: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the record's table, and append the record to its file unless --no-record."""
    print(markdown_table(rec["columns"], rec["rows"]))
    if args.no_record:
        return
    path = args.record or RESULTS / f"{rec['task']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"record appended to {path}")


def cell(value: Any) -> str:
    """A figure as a table shows it: a median with its rounds, a number, or text."""
    if isinstance(value, dict) and "median" in value:
        values = [value["median"], *value["rounds"]]
        digits = max((len(repr(v).partition(".")[2]) for v in values if isinstance(v, float)),
                     default=0)  # fmt: skip
        median, *rounds_ = (f"{v:.{digits}f}" for v in values)
        return f"{median} ({', '.join(rounds_)})" if len(rounds_) > 1 else median
    return "" if value is None else str(value)


def markdown_table(columns: Sequence[Sequence[str]], rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)
