"""`make demo` as a user meets it: `aiayn demo`, the whole command, timed from launch to exit.

    python bench/demo.py                # one round, on the CPU (what the README quotes)
    python bench/demo.py --rounds 3     # the median of three

Each round runs `python -m aiayn demo -o WORK/roundN --device cpu` in a fresh folder: it writes
the number corpus, trains the `demo` preset, scores its 500 held-out numbers and translates the
samples. The row keeps each round's wall time, what the demo's report says (held-out exact
match, the numbers 0–100 it gets right) and the process's peak memory. Each round's output, in
the order a terminal shows it, is kept as WORK/roundN.log (with `--work-dir`; the first round's
is the transcript the README shows). The record goes to bench/results/demo.jsonl.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
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
        raise ValueError("no demo report (held-out exact match, numbers 0–100 right) in it")
    return {"exact_match": float(exact.group(1)),
            "small_right": f"{small.group(1)}/{small.group(2)}"}  # fmt: skip


def demo_round(
    command: list[str], out_dir: Path, log: Path, env: dict[str, str]
) -> tuple[float, float]:
    """(seconds from launch to exit, peak resident MiB) of `command` writing into `out_dir`,
    its output into `log`. A failure raises a one-line RuntimeError naming the log."""
    with log.open("w", encoding="utf-8") as out:
        code, seconds, peak_kib = runner.run_to([*command, "-o", str(out_dir)], out, env=env)
    if code != 0:
        raise RuntimeError(f"aiayn demo exited with {code}; its output: {log}")
    return seconds, peak_kib / 1024


def measure(command: list[str], rounds: int, work: Path) -> dict[str, Any]:
    """`rounds` runs of the demo; the row: wall time, its report's figures (every round's must
    agree: the demo is seeded), the peak memory of the largest round."""
    env = runner.with_src_on_path(os.environ)
    seconds, peaks, reports = [], [], []
    for r in range(rounds):
        log = work / f"round{r + 1}.log"
        wall, peak = demo_round(command, work / f"round{r + 1}", log, env)
        seconds.append(wall)
        peaks.append(peak)
        try:
            reports.append(report_figures(log.read_text(encoding="utf-8")))
        except ValueError as error:
            raise ValueError(f"aiayn demo's output {log}: {error}") from None
        print(f"round {r + 1}: aiayn demo: {seconds[-1]:.1f} s, {reports[-1]}", flush=True)
    if any(report != reports[0] for report in reports):
        raise RuntimeError(f"the rounds' reports differ: {reports}")
    peak_mib = max(peaks)
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
    parser.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary "
                        "folder, removed at the end)")  # fmt: skip
    runner.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    for r in range(args.rounds):  # the demo resumes a run it finds there: a false time
        held = None if args.work_dir is None else args.work_dir / f"round{r + 1}"
        if held is not None and held.exists():
            parser.error(f"--work-dir {args.work_dir} already holds {held.name}: give an empty one")
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    command = [*runner.AIAYN, "demo", "--device", "cpu"]
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        try:
            row = measure(command, args.rounds, work)
        except (RuntimeError, ValueError) as error:
            hint = "" if args.work_dir else " (rerun with --work-dir DIR to keep it)"
            sys.exit(f"bench/demo.py: {str(error).splitlines()[0]}{hint}")
        if args.work_dir is not None:
            print(f"the first round's output: {work / 'round1.log'}")
    rec = runner.record(
        "demo",
        table="`aiayn demo` on the CPU",
        setup=args.setup or "the demo's model",
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
