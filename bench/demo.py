"""`make demo` as a user meets it: `aiayn demo`, the whole command, timed from launch to exit.

    python bench/demo.py                # one round, on the CPU (what the README quotes)
    python bench/demo.py --rounds 3     # the median of three

Each round runs `python -m aiayn demo -o WORK/roundN --device cpu` in a fresh folder: it writes
the number corpus, trains the `demo` preset, scores its 500 held-out numbers and translates the
samples. The row keeps each round's wall time, what the demo's report says (held-out exact
match, the numbers 0–100 it gets right) and the process's peak memory. The first round's whole
output is kept as WORK/round1.log, the transcript the README shows. The record goes to
bench/results/demo.jsonl.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import runner

EXACT_MATCH = re.compile(r"exact match ([\d.]+)%")
SMALL_RIGHT = re.compile(r"Numbers 0–\d+ \(in training[^)]*\): (\d+)/(\d+) right")


def report_figures(output: str) -> dict[str, Any]:
    """The demo's report as figures: held-out exact match (a percentage) and the numbers 0–100
    right ("101/101"); ValueError where the report lacks them (the demo failed or changed)."""
    exact, small = EXACT_MATCH.search(output), SMALL_RIGHT.search(output)
    if exact is None or small is None:
        raise ValueError(f"no demo report in the output: ...{output[-500:]}")
    return {"exact_match": float(exact.group(1)),
            "small_right": f"{small.group(1)}/{small.group(2)}"}  # fmt: skip


def demo_round(command: list[str], out_dir: Path, log: Path, env: dict[str, str]) -> float:
    """Seconds from launch to exit of `command` writing into `out_dir`; its output into `log`.
    A failure raises with the end of that output."""
    start = time.perf_counter()
    done = subprocess.run([*command, "-o", str(out_dir)], env=env, capture_output=True,
                          text=True, preexec_fn=runner.ends_with_benchmark)  # fmt: skip
    seconds = time.perf_counter() - start
    log.write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        raise RuntimeError(f"aiayn demo failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def measure(command: list[str], rounds: int, work: Path) -> dict[str, Any]:
    """`rounds` runs of the demo; the row: wall time, its report's figures (every round's must
    agree: the demo is seeded), the peak memory of the largest round."""
    env = runner.with_src_on_path(os.environ)
    seconds, reports = [], []
    for r in range(rounds):
        log = work / f"round{r + 1}.log"
        seconds.append(demo_round(command, work / f"round{r + 1}", log, env))
        reports.append(report_figures(log.read_text(encoding="utf-8")))
        print(f"round {r + 1}: aiayn demo: {seconds[-1]:.1f} s, {reports[-1]}", flush=True)
    if any(report != reports[0] for report in reports):
        raise RuntimeError(f"the rounds' reports differ: {reports}")
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    return {
        "command": "aiayn demo",
        "wall_s": runner.figures(seconds, 1),
        "exact_match": f"{reports[0]['exact_match']:.1f}%",
        "small_right": reports[0]["small_right"],
        "peak_rss": f"{peak_mib:.0f} MiB",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of the demo (default 1)")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary "
                        "folder, removed at the end)")  # fmt: skip
    runner.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    command = [*runner.AIAYN, "demo", "--device", "cpu"]
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        row = measure(command, args.rounds, work)
        if args.work is not None:
            print(f"the first round's output: {work / 'round1.log'}")
    rec = runner.record(
        "demo",
        table="`aiayn demo` on the CPU",
        setup="the demo's model",
        columns=[
            ("command", "command"),
            ("wall_s", "wall time, s (rounds)"),
            ("exact_match", "held-out exact match"),
            ("small_right", "numbers 0–100 right"),
            ("peak_rss", "peak RSS"),
        ],
        rows=[row],
        summary=f"`aiayn demo` builds its corpus, trains, evaluates and translates in "
        f"{row['wall_s']['median']:.0f} s (held-out exact match {row['exact_match']})",
        machine_name=args.machine,
        load=load,
        notes=[
            "`.venv` already set up: a fresh clone's `make demo` adds the one-time install "
            "first; the `demo` preset (d_model 128, 3+3 layers), 1,200 updates, 500 held-out "
            "numbers."
        ],
    )
    runner.write(rec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
