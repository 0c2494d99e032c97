"""The benchmark entry points of bench/ run end to end on a tiny model and write their record
(bench/runner.py), so that what `make bench-translate` and `make bench-serve` run on an idle
machine has not rotted; their arguments are refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from model_dirs import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent


def bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_translate_times_aiayn_and_both_ctranslate2_thread_layouts(tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    model = tiny_model_dir(tmp_path, eos_scale=4.0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.en").write_text("the cat sat on the mat\nhello world\n", encoding="utf-8")
    (data / "valid.es").write_text("el gato\nhola mundo\n", encoding="utf-8")
    record = tmp_path / "translate.jsonl"
    done = bench(
        "translate.py", "-m", str(model), "--data", str(data), "--rounds", "1", "--busy-ok",
        "--skip", "int8", "--skip=-m MODEL", "--record", str(record), "--setup", "tiny",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [line] = record.read_text(encoding="utf-8").splitlines()
    rec = json.loads(line)
    assert (rec["task"], rec["setup"], rec["table"]) == (
        "translate", "tiny", "2 sentences, beam 4, 2 threads"
    )  # fmt: skip
    assert [r["system"] for r in rec["rows"]] == [
        "aiayn translate",
        "CTranslate2 fp32 (Python API)",
        "CTranslate2 fp32 (Python API, inter_threads 2)",
        "aiayn translate --backend ctranslate2",
    ]
    ours = rec["rows"][0]
    assert ours["wall_s"]["median"] > 0 and ours["rows_per_sentence"] > 0
    assert ours["length_ratio"] > 0
    assert rec["machine"]["cores"] >= 1 and rec["versions"]["ctranslate2"]


@pytest.mark.slow
def test_translate_s_decoding_tools_print_their_tables(tmp_path: Path) -> None:
    """`--profile` and `--step-calls N`: aiayn's search on one thread, no timing, no record;
    `--profile` beside CTranslate2's decoding of the same lines where it is installed."""
    model = tiny_model_dir(tmp_path, eos_scale=4.0)
    src = tmp_path / "valid.en"
    src.write_text("the cat sat on the mat\nhello world\n", encoding="utf-8")
    for flags, row in (
        ("--profile", "| decoder steps |"),
        ("--step-calls=2", "| **every call** |"),
    ):
        done = bench("translate.py", "-m", str(model), "--src", str(src), flags)
        assert done.returncode == 0, done.stdout + done.stderr
        assert row in done.stdout and "record" not in done.stdout
        if flags == "--profile" and importlib.util.find_spec("ctranslate2") is not None:
            # three significant digits: a tiny model's few milliseconds are not printed as 0.00
            number = r"([\d.e+-]+)"
            peer = re.search(rf"one thread: {number} s; aiayn's search {number} s", done.stdout)
            assert peer and float(peer[1]) > 0 and float(peer[2]) > 0, done.stdout


@pytest.mark.slow
def test_serve_measures_batching_on_and_off_under_load(tmp_path: Path) -> None:
    for module in ("httpx", "num2words", "fastapi", "uvicorn"):
        pytest.importorskip(module)
    record = tmp_path / "serve.jsonl"
    done = bench(
        "serve.py", "--requests", "4", "--concurrency", "1", "2", "--max-seconds", "30",
        "--busy-ok", "--record", str(record),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rec = json.loads(record.read_text(encoding="utf-8"))
    cells = [(r["batching"], r["clients"], r["errors"]) for r in rec["rows"]]
    assert cells == [("on", 1, 0), ("on", 2, 0), ("off", 1, 0), ("off", 2, 0)]
    assert "requests/s with 2 clients" in rec["summary"]


def test_translate_scores_the_outputs_length_against_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = bench_module(monkeypatch, "translate")
    (tmp_path / "hyp").write_text("el gato negro come pescado\nhola\n", encoding="utf-8")
    (tmp_path / "ref").write_text("el gato negro come pescado hoy\nhola mundo\n", encoding="utf-8")
    bleu, chrf, length = module.scores(tmp_path / "hyp", tmp_path / "ref")
    assert length == pytest.approx(6 / 8) and 0 < bleu < 100 and 0 < chrf < 100


def test_translate_s_summary_names_the_peer_at_its_faster_layout_and_the_best_bleu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    translate = bench_module(monkeypatch, "translate")
    timed = {
        "aiayn translate": ([10.0, 12.0, 11.0], 23.1),
        "aiayn translate --int8": ([8.0], 23.0),
        "aiayn translate --stopping exact": ([20.0], 23.4),
        "CTranslate2 fp32 (Python API)": ([9.0], 22.9),
        "CTranslate2 fp32 (Python API, inter_threads 2)": ([5.5], 22.9),
        "CTranslate2 int8 (Python API)": ([4.0], 22.8),
    }
    found = [translate.Command(name, [], seconds=seconds) for name, (seconds, _) in timed.items()]
    rows = [{"system": name, "bleu": bleu} for name, (_, bleu) in timed.items()]
    assert translate.against_ct2(rows, found) == [
        "`aiayn translate` 11.0 s against CTranslate2 fp32's 5.5 s at its faster layout (0.50×)",
        "`aiayn translate --int8` 8.0 s against CTranslate2 int8's 4.0 s at its faster layout "
        "(0.50×)",
        "BLEU 23.1",
        "the highest, 23.4, `aiayn translate --stopping exact`",
    ]
    assert translate.against_ct2(rows[:1], found) == ["BLEU 23.1"]


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("translate.py", ["-m", "MODEL"], "give --data DIR (an `aiayn prepare` folder)"),
        ("translate.py", ["-m", "M", "--data", "D", "--variant", "=-x"], "give NAME=FLAGS"),
        ("train.py", [], "give --data DIR (an `aiayn prepare` folder), or --src and --tgt"),
        ("train.py", ["--data", "D", "--max-updates", "3"], "a smoke run"),
        ("study.py", ["run", "D", "S", "S99-nothing"], "unknown run(s) ['S99-nothing']"),
        ("demo.py", ["--rounds", "0"], "--rounds must be at least 1, not 0"),
    ],
)
def test_arguments_are_refused_in_one_line(script: str, args: list[str], message: str) -> None:
    done = bench(script, *args, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr.splitlines()[-1]


def test_a_busy_machine_is_refused_in_one_line_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import runner

    monkeypatch.setattr(runner, "load_average", lambda: 64.0)
    with pytest.raises(SystemExit) as refused:
        runner.check_idle(wait_s=0)
    assert str(refused.value).startswith("the machine is busy (1-minute load average 64.0 on ")
    assert "--busy-ok" in str(refused.value)
    assert runner.check_idle(force=True) == 64.0
    monkeypatch.setattr(runner, "load_average", lambda: 0.0)
    assert runner.check_idle(wait_s=0) == 0.0


# A benchmark that times a command which sleeps (its pid first on stdout), in one of the two ways
# the harness runs commands: `subprocess.run` (study, translate) or train.py's `run_window`.
TIMED_SLEEPER = """
import subprocess, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import runner
runner.stop_children_on_sigterm()
sleeper = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
if {window!r}:
    import train
    train.run_window(sleeper, {{}}, 60, Path({log!r}))
else:
    subprocess.run(sleeper, preexec_fn=runner.ends_with_benchmark)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("window", [False, True], ids=["subprocess.run", "train.run_window"])
def test_a_benchmark_stopped_leaves_no_command_running(
    tmp_path: Path, window: bool, stop: signal.Signals
) -> None:
    """Stopped by a signal its handler sees (SIGTERM) or by SIGKILL, which none sees."""
    log = tmp_path / "window.log"
    script = TIMED_SLEEPER.format(bench=str(ROOT / "bench"), window=window, log=str(log))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    bench_process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        if window:  # run_window logs the command's output
            deadline = time.monotonic() + 60
            while not (log.exists() and log.read_text().strip()):
                assert time.monotonic() < deadline and bench_process.poll() is None
                time.sleep(0.1)
            sleeper = int(log.read_text().split("]")[1])
        else:
            assert bench_process.stdout is not None
            sleeper = int(bench_process.stdout.readline())
        bench_process.send_signal(stop)
        expected = -stop if stop == signal.SIGKILL else 128 + stop
        assert bench_process.wait(timeout=30) == expected
        deadline = time.monotonic() + 10
        while Path(f"/proc/{sleeper}").exists() and "Z" not in _state(sleeper):
            assert time.monotonic() < deadline, "the timed command outlived its benchmark"
            time.sleep(0.1)
    finally:
        bench_process.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"  # gone between the two reads


# `aiayn` as bench/study.py runs it, without training: `train` logs one update and one
# validation; `evaluate` prints scores that say which split they were made on.
FAKE_AIAYN = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
if args[0] == "train":
    out = Path(value("--out-dir"))
    out.mkdir(parents=True)
    records = [{"type": "train", "step": 10, "elapsed_s": 6.0, "tokens_per_s": 100.0},
               {"type": "valid", "step": 10, "valid_ppl": 9.5}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
    budget = value("--time-budget") if "--time-budget" in args else "30m"  # the recipe's
    (out / "train_config.yaml").write_text(f"time_budget: {budget}\\n")
else:
    split = Path(value("--src")).stem
    print(json.dumps({"bleu": {"valid": 20.0, "test": 10.0}[split], "chrf": 40.0}))
"""


def test_study_scores_each_run_on_the_test_split_where_the_data_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import runner
    import study

    (tmp_path / "aiayn.py").write_text(FAKE_AIAYN, encoding="utf-8")
    monkeypatch.setattr(runner, "AIAYN", [sys.executable, str(tmp_path / "aiayn.py")])
    data = tmp_path / "data"
    data.mkdir()

    def run(study_dir: str) -> dict:
        record = tmp_path / f"{study_dir}.jsonl"
        study.main(["run", str(data), str(tmp_path / study_dir), "S1-base", "--busy-ok",
                    "--record", str(record)])  # fmt: skip
        return json.loads(record.read_text(encoding="utf-8"))

    without = run("without")
    assert without["rows"][0]["bleu"] == 20.0 and "test_bleu" not in without["rows"][0]
    assert without["columns"] == [list(c) for c in study.STUDY_COLUMNS]
    assert not (tmp_path / "without" / "S1-base" / "test.bleu.json").exists()
    (data / "test.en").write_text("a test sentence\n", encoding="utf-8")
    with_test = run("with")
    assert (with_test["rows"][0]["bleu"], with_test["rows"][0]["test_bleu"]) == (20.0, 10.0)
    assert with_test["columns"] == [*without["columns"], ["test_bleu", "test BLEU"]]


def test_study_runs_the_recipe_at_its_budget_and_at_twice_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import runner
    import study

    (tmp_path / "aiayn.py").write_text(FAKE_AIAYN, encoding="utf-8")
    monkeypatch.setattr(runner, "AIAYN", [sys.executable, str(tmp_path / "aiayn.py")])
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.en").write_text("one\ntwo\n", encoding="utf-8")
    record = tmp_path / "recipe.jsonl"
    study.main(["run", str(data), str(tmp_path / "runs"), "recipe", "recipe-2x", "--busy-ok",
                "--record", str(record)])  # fmt: skip
    plain, doubled = (json.loads(line) for line in record.read_text().splitlines())
    assert plain["task"] == doubled["task"] == "recipe"
    assert plain["table"] == doubled["table"] and plain["setup"] != doubled["setup"]
    assert plain["setup"] == "`aiayn prepare bible-en-es`'s corpus (validation set: 2 pairs)"
    assert plain["rows"][0]["budget"].startswith("30m, ended at ")
    assert [(r["rows"][0]["run"], r["rows"][0]["flags"]) for r in (plain, doubled)] == [
        ("recipe", ""), ("recipe-2x", "--time-budget 60m")
    ]  # fmt: skip
    assert doubled["rows"][0]["budget"].startswith("60m, ended at ")
    assert doubled["setup"] == (
        "`aiayn prepare bible-en-es`'s corpus at twice the recipe's budget "
        "(`--time-budget 60m`; validation set: 2 pairs)"
    )
    assert plain["summary"] == "BLEU 20.0, chrF 40.0 after a 30m budget (10 updates)"
    assert doubled["command"].endswith("run DATA RUNS recipe-2x")


def test_study_plot_draws_the_runs_and_names_the_dev_books(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import study

    data = tmp_path / "data"
    data.mkdir()
    valid = {"origin": "books Ruth, Jonah, Mark", "files": {"en": "valid.en", "es": "valid.es"}}
    manifest = {"splits": {"valid": valid, "test": {"origin": "books Job", "files": {}}}}
    (data / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    for name, dropout, ppl in (("A", 0.1, 9.0), ("B", 0.0, 8.0)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        config = f"valid_tgt: {data / 'valid.es'}\nmodel:\n  dropout: {dropout}\n"
        (run / "train_config.yaml").write_text(config, encoding="utf-8")
        train = [{"type": "train", "step": s, "elapsed_s": 6.0 * s, "tokens_per_s": 100.0}
                 for s in (10, 20)]  # fmt: skip
        records = [*train, {"type": "valid", "step": 20, "valid_ppl": ppl}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert study.dev_set({"valid_tgt": str(data / "test.es")}) == "dev: test.es"
    assert study.dev_set({"valid_tsv": str(tmp_path / "dev.tsv")}) == "dev: dev.tsv"
    assert study.dev_set({}) == "dev"
    titles = []
    draw = study.draw
    monkeypatch.setattr(study, "draw", lambda *a: titles.append(a[-1]) or draw(*a))
    out = tmp_path / "figures"
    study.main(["plot", str(tmp_path / "runs"), "--runs", "A:base", "B:no dropout",
                "--out-dir", str(out), "--prefix", "p"])  # fmt: skip
    assert (out / "p-ppl-updates.png").stat().st_size > 0 and (out / "p-ppl-time.png").is_file()
    assert titles[0] == "Perplexity against updates (dev: books Ruth, Jonah, Mark)"
    table = (out / "p-table.md").read_text(encoding="utf-8")
    assert "no dropout" in table and "model.dropout" in table and "8.0" in table


def bench_train(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/train.py, loaded by path: `train` is also the name of the tests' package."""
    return bench_module(monkeypatch, "train")


def bench_module(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """bench/NAME.py, loaded by path as `bench_NAME`, with bench/ on the path for its imports."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    path = ROOT / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("precision", "native", "name", "bf16"),
    [
        (None, True, "aiayn train (bf16: native on this CPU)", True),
        (None, False, "aiayn train (float32)", False),
        ("fp32", True, "aiayn train --precision fp32 (float32)", False),
        ("bf16", False, "aiayn train --precision bf16 (bf16: emulated on this CPU)", True),
    ],
)
def test_train_names_aiayn_by_what_it_computes_in_on_this_cpu(
    monkeypatch: pytest.MonkeyPatch, precision: str | None, native: bool, name: str, bf16: bool
) -> None:
    train = bench_train(monkeypatch)
    monkeypatch.setattr("aiayn.train.update.native_bf16_cpu", lambda: native)
    trainer = train.aiayn_trainer(precision, "auto", native)
    assert (trainer.name, trainer.bf16, trainer.precision) == (name, bf16, precision)


def test_train_variants_add_flags_and_environment_to_aiayn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = bench_train(monkeypatch)
    monkeypatch.setattr("aiayn.train.update.native_bf16_cpu", lambda: True)
    onednn = train.variant_trainer("onednn=--precision fp32 --onednn", "auto", True)
    assert (onednn.name, onednn.bf16) == ("aiayn train --precision fp32 --onednn (float32)", False)
    assert (onednn.flags, onednn.env, onednn.precision) == (
        ["--precision", "fp32", "--onednn"],
        {},
        None,
    )
    passive = train.variant_trainer("passive=OMP_WAIT_POLICY=PASSIVE", "auto", True)
    assert passive.name == "OMP_WAIT_POLICY=PASSIVE aiayn train (bf16: native on this CPU)"
    assert (passive.flags, passive.env) == ([], {"OMP_WAIT_POLICY": "PASSIVE"})
    for bad in ("=--onednn", "nothing=", "noequals"):
        with pytest.raises(ValueError, match="give NAME=FLAGS"):
            train.runner.variant_words(bad)


def test_translate_variants_add_flags_and_environment_to_aiayn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    translate = bench_module(monkeypatch, "translate")
    args = translate.parse_args(
        ["-m", "M", "--src", "s", "--ref", "r", "--no-ct2", "--variant", "int8=--int8",
         "--variant", "cold=TORCH_DEVICE_BACKEND_AUTOLOAD=0 --int8"]
    )  # fmt: skip
    found = translate.systems(args, tmp_path, {})
    assert [(c.name, c.env) for c in found] == [
        ("aiayn translate", {}),
        ("aiayn translate --int8", {}),
        ("TORCH_DEVICE_BACKEND_AUTOLOAD=0 aiayn translate --int8",
         {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
    ]  # fmt: skip
    assert found[2].argv == found[1].argv
    # A command runs with its own variables on top of the run's environment.
    write = "import os, sys; open(sys.argv[1], 'w').write(os.environ['A'] + os.environ['B'])"
    command = translate.Command("env", [sys.executable, "-c", write, "{out}"], {"B": "2"})
    translate.runner.timed(command, tmp_path / "out", {**os.environ, "A": "1", "B": "0"})
    assert (tmp_path / "out").read_text() == "12"


def test_train_reads_whether_aiayn_trained_in_bf16_from_its_model_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = bench_train(monkeypatch)
    line = (
        "12:00:00 INFO aiayn.train.setup: model: 5,735,424 parameters, 30266 train pairs, "
        "1 device(s) × 1 batch(es) of ≤ 2048 tokens per update, on cpu"
    )
    for suffix, bf16 in (("", None), (" in bf16", " in bf16")):
        found = train.MODEL_LINE.search(line + suffix)
        assert found is not None
        assert (found.group(1), found.group(2), found.group(4)) == ("5,735,424", "30266", bf16)


def test_train_summary_compares_aiayn_as_users_run_it_with_fairseq(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = bench_train(monkeypatch)

    def trainer(name: str, system: str, rates: list[float], bf16: bool = False):
        intervals = [train.Interval(10, 10 * rate, rate) for rate in [1.0, *rates]]
        run = train.Run(len(intervals) * 10, intervals, 700.0, None, None, None)
        return train.Trainer(name, system, bf16=bf16, runs=[run])

    ours = trainer("aiayn train (bf16: native on this CPU)", "aiayn", [300, 310, 290], True)
    theirs = trainer(train.FAIRSEQ, "fairseq", [200, 190, 210])
    other = trainer("aiayn train --precision fp32 (float32)", "aiayn", [220, 200, 210])
    found = train.rows([ours, theirs, other])
    assert [row["vs_fairseq"] for row in found] == ["1.50×", "1.00×", "1.05×"]
    assert train.summary_line(found[0], found[1], ours) == (
        "`aiayn train` 300 target tokens/s in bf16 against `fairseq-train`'s 200 in float32 (1.50×)"
    )
    unmeasured = {"trainer": train.FAIRSEQ, "tokens_per_s": "not measured: no --fairseq-bin"}
    assert train.summary_line(found[0], unmeasured, ours) == (
        "`aiayn train` 300 target tokens/s in bf16"
    )


def test_train_data_note_lists_the_pairs_each_trainer_loaded_only_where_they_differ(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from aiayn.config import TrainConfig

    train = bench_train(monkeypatch)
    args = SimpleNamespace(src="d/train.en", tgt="d/train.es", config="r.yaml", threads=2,
                           fairseq_workers=1, rounds=2, seconds=120.0, log_every=10)  # fmt: skip
    prepared = train.Prepared(SimpleNamespace(vocab_size=8000), tmp_path, pairs=300)
    config = TrainConfig(src="d/train.en", tgt="d/train.es")

    def data_note(*loaded: int | None) -> str:
        trainers = [train.Trainer(f"t{i}", "aiayn", runs=[train.Run(10, [], None, None, 1, n)])
                    for i, n in enumerate(loaded)]  # fmt: skip
        return train.notes(args, config, prepared, trainers)[0]

    assert "; each trainer loaded all of them. Joint BPE" in data_note(300, 300)
    assert "the pairs each trainer loaded: t0 300, t1 299. Joint" in data_note(300, 299)
    assert "all of them" not in data_note(None, None)  # no trainer's log said


def test_demo_times_the_whole_command_and_reads_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/demo.py reads the figures from the report `aiayn demo` prints (made here by the
    demo's own `format_report`), keeps each round's output, and refuses rounds that disagree
    or a run without a report."""
    from aiayn.demo import DemoResult, format_report

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import demo

    def report(wrong: int) -> str:
        result = DemoResult(
            model_dir=tmp_path / "model", exact_match=0.984, chrf=99.1, chrf_signature="sig",
            small_wrong=[("five", "fünftausend")] * wrong, small_total=101, small_weight=8,
            minutes=2.9, examples=[],
        )  # fmt: skip
        return format_report(result, command="aiayn")

    assert demo.report_figures(report(1)) == {"exact_match": 98.4, "small_right": "100/101"}
    with pytest.raises(ValueError, match="no demo report"):
        demo.report_figures("Traceback (most recent call last): ...")
    failing = tmp_path / "failing_demo.py"
    failing.write_text("import sys; print('no corpus'); sys.exit(3)\n", encoding="utf-8")
    (tmp_path / "failed").mkdir()
    with pytest.raises(RuntimeError, match=r"aiayn demo exited with 3; its output: .*round1\.log"):
        demo.measure([sys.executable, str(failing)], 1, tmp_path / "failed")
    assert "no corpus" in (tmp_path / "failed" / "round1.log").read_text(encoding="utf-8")
    # A stand-in for `python -m aiayn demo`: prints a report, given `-o DIR` as the demo is.
    script = tmp_path / "fake_demo.py"
    script.write_text(f"print({report(0)!r})\n", encoding="utf-8")
    row = demo.measure([sys.executable, str(script)], 2, tmp_path)
    # wait4 counts from the fork, so under pytest (PyTorch loaded) it is at least this process's
    assert float(row["peak_rss"].removesuffix(" MiB")) > 1
    assert row["exact_match"] == "98.4%" and row["small_right"] == "101/101"
    assert len(row["wall_s"]["rounds"]) == 2 and row["peak_rss"].endswith(" MiB")
    assert "exact match 98.4%" in (tmp_path / "round1.log").read_text(encoding="utf-8")
    script.write_text(
        "import pathlib, sys\n"
        "first = pathlib.Path(sys.argv[2]).name == 'round1'\n"
        f"print({report(0)!r} if first else {report(3)!r})\n",
        encoding="utf-8",
    )
    with pytest.raises(RuntimeError, match="the rounds' reports differ"):
        demo.measure([sys.executable, str(script)], 2, tmp_path)


def test_demo_refuses_a_work_dir_that_holds_a_round(tmp_path: Path) -> None:
    """`aiayn demo` resumes a run it finds in its folder: timing that would be a false time."""
    (tmp_path / "round1").mkdir()
    done = bench("demo.py", "--work-dir", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert f"--work-dir {tmp_path} already holds round1" in done.stderr.splitlines()[-1]
