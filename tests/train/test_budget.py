"""Tests for aiayn.train.budget and `time_budget` in training: the pace, the stop rule and the end
it foresees (on a simulated clock, exactly), the run's clock across a resume, and real runs that
end inside their budget by themselves: one process through `aiayn train`, and two under torchrun
(gloo), which stop at the same update.

The real runs are behaviour tests with small budgets (20-25 s); they assert that the run ended
before its budget ran out and saved its model, not how fast it trained.
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiayn.model_dir import load_model_dir
from aiayn.optim import learning_rate, scheduled_rate
from aiayn.train import budget, trainer
from aiayn.train import checkpoint as ckpt
from aiayn.train.budget import MARGIN_S, Pace, RunClock, TimeBudget
from aiayn.train.runlog import read_metrics
from train.test_trainer import TINY_MODEL, make_config, write_copy_corpus


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_runs_clock_adds_what_earlier_processes_spent() -> None:
    clock = FakeClock()
    run = RunClock(started=clock.now - 5, spent_before=100.0, clock=clock)
    assert run.elapsed() == 105.0
    clock.now += 10
    assert run.elapsed() == 115.0


def test_the_pace_leaves_out_a_processs_first_update_and_guesses_what_it_has_not_measured() -> None:
    pace = Pace(valid_tokens=1000, validations=2, save_bytes=200_000_000)
    assert pace.update_s == 0.0 and pace.validation_s == 0.0
    pace.count_update(5.0, tokens=100)  # the first: warm-up
    assert pace.update_s == 5.0  # all there is
    for _ in range(3):
        pace.count_update(1.0, tokens=100)
    assert pace.update_s == 1.0  # the first left out
    # A validation, not yet measured: 1000 tokens at 1/100 s each, half an update's cost per
    # token, for both the raw and the averaged weights.
    assert pace.validation_s == pytest.approx(2 * 1000 * 0.01 * 0.5)
    assert Pace(
        valid_tokens=1000, bleu=True, tokens_per_update=100, first_update=1.0
    ).validation_s == (pytest.approx(1000 * 0.01 * 0.5 * 21))
    assert pace.save_s == pytest.approx(0.25 + 2.0)  # 200 MB at 100 MB/s
    pace.last_validation, pace.last_save = 3.0, 0.5
    assert (pace.validation_s, pace.save_s) == (3.0, 0.5)
    assert Pace().validation_s == 0.0  # no validation set


def test_updates_left_pays_for_what_is_due_the_final_validation_and_save_and_a_margin() -> None:
    clock = FakeClock()
    pace = Pace(valid_tokens=10, first_update=1.0, update_mean=1.0, last_validation=4.0,
                last_save=2.0)  # fmt: skip
    plan = TimeBudget(100.0, RunClock(clock.now, clock=clock), pace)
    margin = 0.01 * 100 + 2 * 1.0 + MARGIN_S
    assert plan.margin_s() == margin
    assert plan.final_s() == 6.0
    assert plan.updates_left() == math.floor(100 - 6 - margin)
    assert plan.updates_left(due_s=6.0) == math.floor(100 - 12 - margin)
    clock.now += 100 - 6 - margin - 0.5  # less than an update's time left
    assert plan.updates_left() == 0
    # Periodic validations and saves are spread over the updates to come.
    periodic = TimeBudget(
        100.0, RunClock(clock.now, clock=clock), pace, valid_every=4, save_every=2
    )
    assert periodic.per_update_s() == 1.0 + 4.0 / 4 + 2.0 / 2
    assert periodic.updates_left() == math.floor((100 - 6 - margin) / 3.0)


@pytest.mark.parametrize("seconds", [30.0, 1800.0, 8 * 3600.0])
@pytest.mark.parametrize("schedule", ["linear", "cosine", "inverse_sqrt_cooldown"])
def test_on_a_noisy_clock_the_run_stops_in_time_with_its_schedule_at_zero(
    seconds: float, schedule: str
) -> None:
    """The trainer's rule, simulated: after every update the end is foreseen again from the
    measured pace, the next update's rate follows it; updates take 0.5-1.5x their mean time.
    The run stops inside its budget, its final validation and save included, and the rate of
    its last update is ~0 (what re-estimation allows: a fraction of an update's worth)."""
    rng = random.Random(int(seconds))
    clock = FakeClock()
    run_clock = RunClock(clock.now - 3.0, clock=clock)  # 3 s of start-up
    pace = Pace(valid_tokens=5000, save_bytes=10_000_000)
    plan = TimeBudget(seconds, run_clock, pace, valid_every=200)
    mean_update = seconds / 3000  # about 3000 updates fit
    warmup, step, end, rates = 100, 0, 10**9, []
    while True:
        rates.append(scheduled_rate(schedule, step + 1, d_model=64, warmup_steps=warmup, end=end))
        took = mean_update * rng.uniform(0.5, 1.5)
        clock.now += took
        step += 1
        pace.count_update(took, tokens=1000)
        due = 0.0
        if step % 200 == 0:
            due = pace.validation_s
        left = plan.updates_left(due_s=due)
        end = step + left
        if left == 0:
            break
        if step % 200 == 0:  # the periodic validation, which costs what it was guessed to
            clock.now += pace.validation_s
            pace.last_validation = pace.validation_s
    clock.now += plan.final_s()  # the final validation and save
    assert run_clock.elapsed() < seconds
    assert run_clock.elapsed() > seconds - plan.margin_s() - 3 * plan.per_update_s()  # no waste
    peak = learning_rate(warmup, d_model=64, warmup_steps=warmup)
    assert 2000 < step < 3200
    assert rates[-1] <= 0.01 * peak  # the last update: at the bottom of the decay
    assert max(rates) <= peak * (1 + 1e-12)


PROCESS_START = "from aiayn.train.budget import process_start; print(process_start())"
"""A fresh interpreter's `process_start` on `time.monotonic()`'s clock, which every process of
the machine shares."""
TICKS = 3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.0
"""What the OS's records of a process's start (in clock ticks) and of the uptime (in 1/100 s)
can be off by, read at two moments."""


def test_process_start_is_the_oss_record_of_this_process() -> None:
    """A fresh interpreter started between the moment it was launched and the moment it ended
    (Python's start-up included, before any of its code ran)."""
    if budget.process_start() is None:
        pytest.skip("no /proc here: aiayn train counts from when the command began")
    launched = time.monotonic()
    child = subprocess.run([sys.executable, "-c", PROCESS_START], capture_output=True, text=True,
                           check=True)  # fmt: skip
    ended = time.monotonic()
    assert launched - TICKS <= float(child.stdout) <= ended
    assert budget.process_start() <= launched


def test_a_torchrun_worker_counts_from_its_launchers_start() -> None:
    """The worker's parent (here: this test's process, started long before) is the launcher."""
    if budget.process_start() is None:
        pytest.skip("no /proc here")
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
    child = subprocess.run([sys.executable, "-c", PROCESS_START], capture_output=True, text=True,
                           check=True, env=env)  # fmt: skip
    ours = budget._start_of("self")
    assert ours is not None
    assert float(child.stdout) == pytest.approx(ours, abs=TICKS)


# -- in training ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("corpus"), 48)


def test_the_budget_is_the_runs_across_a_resume(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """A process that began 100 s ago (its start-up, say) trains 3 updates: the checkpoint
    records the run's 100+ s. A resume with a budget of 60 s finds it spent and trains no more;
    one with an hour goes on, and its checkpoints count on from there."""
    config = make_config(corpus, tmp_path / "run", max_steps=3, time_budget="1h")
    began = time.monotonic()
    result = trainer.train(config, started=began - 100)
    took = time.monotonic() - began
    assert (result.step, result.out_of_time) == (3, False)
    first = ckpt.load_training_state(ckpt.latest_checkpoint(tmp_path / "run")).progress.elapsed_s
    assert 100 < first <= 100 + took

    spent = trainer.train(make_config(corpus, tmp_path / "run", max_steps=6, time_budget="60s"),
                          resume=True)  # fmt: skip
    assert (spent.step, spent.out_of_time) == (3, True)
    more = trainer.train(make_config(corpus, tmp_path / "run", max_steps=6, time_budget="1h"),
                         resume=True)  # fmt: skip
    assert (more.step, more.out_of_time) == (6, False)
    state = ckpt.load_training_state(ckpt.latest_checkpoint(tmp_path / "run"))
    assert state.progress.elapsed_s > first
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["elapsed_s"] > 100 for r in records)


TINY_FLAGS = [
    "--vocab-size", "300", "--preset", "tiny", "--max-len", "16", "--max-tokens", "64",
    "--warmup-steps", "20", "--max-steps", "1000000", "--log-every", "25",
    "--valid-every", "100", "--save-every", "0", "--threads", "1", "--no-progress",
]  # fmt: skip
for key, value in TINY_MODEL.items():
    TINY_FLAGS += ["--model", f"{key}={value}"]


def _run(args: list[str], log: Path, timeout: float) -> tuple[float, str]:
    """Run `args` to its end (exit 0), in its own session; return its wall time and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            pytest.fail(f"still running after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
    took = time.monotonic() - began
    output = log.read_text()
    assert code == 0, output[-3000:]
    return took, output


def _check_ended_in_time(run: Path, took: float, seconds: float, output: str) -> int:
    """The run stopped itself, inside its budget, with the final validation and save done
    and its learning rate at ~0; returns its last step."""
    assert took < seconds, f"the run took {took:.1f} s of its {seconds:.0f} s\n{output[-3000:]}"
    records = read_metrics(run)
    last = records[-1]["step"]
    assert last > 50, "the budget left too little time to train: a loaded machine?"
    assert [r["type"] for r in records if r["step"] == last][-1] == "valid"  # the final one
    assert load_model_dir(run / "model").metadata["step"] == last
    [train] = [r for r in records if r["type"] == "train" and r["step"] == last]
    peak = learning_rate(20, d_model=TINY_MODEL["d_model"], warmup_steps=20)
    assert train["lr"] <= 0.05 * peak  # linear, the schedule "auto" picks with a budget
    assert re.search(rf"time budget: [\d.]+ s of {int(seconds)}s spent; step {last} is the last",
                     output)  # fmt: skip
    return last


def test_aiayn_train_ends_inside_its_time_budget_by_itself(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """`aiayn train --time-budget 20s` (counted from its process's start), a tiny model: the
    command exits on its own before 20 s have passed since it was launched."""
    run = tmp_path / "run"
    data = ["--src", str(corpus[0]), "--tgt", str(corpus[1]), "--valid-src", str(corpus[0]),
            "--valid-tgt", str(corpus[1])]  # fmt: skip
    args = [sys.executable, "-m", "aiayn", "train", *data, *TINY_FLAGS, "--out-dir", str(run)]
    took, output = _run([*args, "--time-budget", "20s"], tmp_path / "log", timeout=120)
    _check_ended_in_time(run, took, 20, output)


def test_data_parallel_ranks_stop_at_the_same_update_inside_the_budget(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two processes (gloo, torchrun): rank 0's clock decides, every rank stops after the same
    update (each says which), and the run ends inside its budget."""
    run = tmp_path / "run"
    data = ["--src", str(corpus[0]), "--tgt", str(corpus[1]), "--valid-src", str(corpus[0]),
            "--valid-tgt", str(corpus[1])]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", f"--log-dir={tmp_path / 'torchrun'}",  # not in /tmp
                "-m", "aiayn"]  # fmt: skip
    args = [*launcher, "train", *data, *TINY_FLAGS, "--out-dir", str(run), "--time-budget", "25s"]
    took, output = _run(args, tmp_path / "log", timeout=180)
    last = _check_ended_in_time(run, took, 25, output)
    assert re.findall(r"rank 1: step (\d+) is the last", output) == [str(last)]
