"""bench/fairseq_peer.py without fairseq: the pilot's reading, the updates that fit the budget,
the recipe's settings and schedule as fairseq flags, fairseq-generate's hypotheses (a stand-in's)
decoded and scored as `aiayn evaluate` scores, and bench/study.py's refusals of the run
`fairseq`."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aiayn.config import TrainConfig, load_yaml_config
from aiayn.decode.evaluation import score
from model_dirs import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/fairseq_peer.py, loaded by path with bench/train.py as its `train` (under pytest
    `train` is also the tests' package)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    module = None
    for name in ("train", "fairseq_peer"):
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # dataclasses look themselves up
        spec.loader.exec_module(module)
    return module


def inner(updates: int) -> str:
    record = {"epoch": 1, "num_updates": str(updates), "wps": "2000"}
    return f"2026-01-01 00:00:00 | INFO | train_inner | {json.dumps(record)}"


PILOT_LOG = [
    (1.0, "2026-01-01 00:00:00 | INFO | fairseq_cli.train | task: TranslationTask"),
    (12.0, inner(10)),  # the first interval: start-up at 12 - 10 / 2 = 7 s
    (17.0, inner(20)),
    (22.0, inner(30)),
    (23.0, "2026-01-01 00:00:00 | INFO | fairseq_cli.train | Stopping training due to "
           "cumulative_training_time: 0.0056 > stop_time_hours: 0.0055 hour(s)"),
    (27.0, "2026-01-01 00:00:00 | INFO | valid | "
           + json.dumps({"epoch": 1, "valid_ppl": "812.5", "valid_num_updates": "32"})),
]  # fmt: skip


def test_the_pilot_gives_the_pace_and_the_time_around_the_updates(peer: ModuleType) -> None:
    pilot = peer.read_pilot(PILOT_LOG, wall_s=30.0)
    # 2 updates/s from update 10 (12 s) to the last, 32 (the stop line, 23 s)
    assert (pilot.rate, pilot.startup_s, pilot.updates) == (2.0, 7.0, 32)
    assert (pilot.valid_s, pilot.end_s) == (4.0, 3.0)  # to the valid line; the save and exit
    # One logged interval is enough: the stop line is the second point.
    assert peer.read_pilot([PILOT_LOG[1], *PILOT_LOG[4:]], wall_s=30.0).rate == 2.0
    with pytest.raises(SystemExit, match="no stop or no validation"):
        peer.read_pilot(PILOT_LOG[:4], wall_s=30.0)
    stopped_at_10 = PILOT_LOG[5][1].replace('"32"', '"10"')
    with pytest.raises(SystemExit, match="made 10 update"):
        peer.read_pilot([PILOT_LOG[1], PILOT_LOG[4], (27.0, stopped_at_10)], wall_s=30.0)


def test_the_run_makes_the_most_updates_whose_run_fits_the_budget(peer: ModuleType) -> None:
    pilot = peer.Pilot(rate=2.0, startup_s=10.0, valid_s=5.0, end_s=3.0, updates=100)
    # 10 + N / 2 + 5 × ceil(N / 500) + 3 ≤ 1800: N = 3500 (7 validations); 3501 needs 8.
    n = peer.updates_in_budget(1800.0, pilot, valid_every=500)
    assert n == 3500
    assert peer.run_seconds(n, pilot, 500) <= 1800.0 < peer.run_seconds(n + 1, pilot, 500)
    assert peer.run_seconds(1000, pilot, 500) == 10 + 500 + 2 * 5 + 3  # 500, 1000 (the last)
    assert peer.run_seconds(1000, pilot, 0) == 10 + 500 + 5 + 3  # only the final validation
    assert peer.updates_in_budget(15.0, pilot, valid_every=500) == 0


def test_the_recipe_s_schedule_replaces_eq3_in_fairseq_s_flags(peer: ModuleType) -> None:
    flags = ["--lr", "0.003125", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "400",
             "--warmup-init-lr", "0", "--max-tokens", "2048"]  # fmt: skip
    assert peer.linear_decay(flags, 3500) == [
        "--lr", "0.003125", "--warmup-updates", "400", "--max-tokens", "2048",
        "--lr-scheduler", "polynomial_decay", "--power", "1", "--end-learning-rate", "0",
        "--total-num-update", "3500",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no --lr-scheduler"):
        peer.linear_decay(["--lr", "1"], 10)


def values(command: list[str]) -> dict[str, str]:
    """Each flag of `command` with the word after it (a switch's is the next flag)."""
    return {flag: after for flag, after in itertools.pairwise(command) if flag.startswith("--")}


def test_the_flags_are_the_recipe_s(peer: ModuleType) -> None:
    c = recipe_config()
    base = peer.base_command(Path("bin"), Path("data"), c, 8000)
    for flag in (
        "--encoder-normalize-before",
        "--decoder-normalize-before",
        "--share-all-embeddings",
        "--no-epoch-checkpoints",
    ):
        assert flag in base
    value = values(base)
    assert value["--encoder-layers"] == value["--decoder-layers"] == "2"
    assert (value["--encoder-embed-dim"], value["--encoder-ffn-embed-dim"]) == ("256", "1024")
    run = peer.run_command(base, c, 8000, 3500, 1720.0, Path("out"))
    value = values(run)
    assert (value["--max-update"], value["--total-num-update"]) == ("3500", "3500")
    assert (value["--lr-scheduler"], value["--power"], value["--end-learning-rate"]) == (
        "polynomial_decay",
        "1",
        "0",
    )
    assert float(value["--stop-time-hours"]) * 3600 == pytest.approx(1720.0)
    assert (value["--warmup-updates"], value["--max-tokens"], value["--seed"]) == (
        "400",
        "2048",
        "1",
    )
    assert value["--validate-interval-updates"] == "500"
    assert float(value["--lr"]) == pytest.approx(256**-0.5 * 400**-0.5)


def test_hypotheses_come_back_in_the_order_of_the_sentences(peer: ModuleType) -> None:
    output = "\n".join([
        "S-1\t▁hello", "H-1\t-0.25\t▁hola ▁mundo", "D-1\t-0.25\t▁hola ▁mundo",
        "2026-01-01 | INFO | fairseq_cli.generate | NOTE: hypothesis and token scores",
        "H-0\t-0.5\t", "H-7\t-0.1\t▁out ▁of ▁range",
    ])  # fmt: skip
    assert peer.hypotheses(output, 3) == ["", "▁hola ▁mundo", None]


def test_study_refuses_the_fairseq_run_without_fairseq_or_with_a_short_recorded_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import study

    def refusal(*flags: str) -> str:
        with pytest.raises(SystemExit) as refused:
            study.main(["run", str(tmp_path), str(tmp_path / "runs"), "fairseq", *flags])
        assert refused.value.code == 2
        return capsys.readouterr().err.splitlines()[-1]

    assert refusal().endswith("the run fairseq: no --fairseq-bin given")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("fairseq-preprocess", "fairseq-train", "fairseq-generate"):
        (tools / tool).write_text("#!/bin/sh\n", encoding="utf-8")
        (tools / tool).chmod(0o755)
    fairseq = ["--fairseq-bin", str(tools)]
    assert "is not recorded: --no-record" in refusal(*fairseq, "--budget", "3m")
    assert "--pilot (90s) must be shorter" in refusal(*fairseq, "--budget", "60s", "--pilot", "90s")
    assert "--budget ('soon') must be a duration" in refusal(*fairseq, "--budget", "soon")


def recipe_config() -> TrainConfig:
    recipe = load_yaml_config(ROOT / "recipes" / "bible-en-es-cpu.yaml")
    return TrainConfig.from_dict({**recipe, "src": "a", "tgt": "b"}, source="recipe")


# fairseq-generate as the run calls it, without a model: the pieces of DATA_DIR/SPLIT.pieces
# as the hypotheses, in reverse order, with the lines fairseq writes around them.
FAKE_GENERATE = """#!{python}
import sys
args = sys.argv[1:]
split = args[args.index("--gen-subset") + 1]
lines = open(f"{{args[0]}}/{{split}}.pieces", encoding="utf-8").read().splitlines()
print("2026-01-01 00:00:00 | INFO | fairseq_cli.generate | loading model(s)", file=sys.stderr)
for i in reversed(range(len(lines))):
    print(f"S-{{i}}\\tsource\\nH-{{i}}\\t-0.5\\t{{lines[i]}}\\nD-{{i}}\\t-0.5\\t{{lines[i]}}")
"""


def test_fairseq_s_hypotheses_are_decoded_and_scored_as_aiayn_evaluate_does(
    peer: ModuleType, tmp_path: Path
) -> None:
    tokenizer = train_tokenizer(tmp_path / "tokenizer")
    references = ["the cat sat on the mat", "", "hello world, this is a small test"]
    data, tools, binarised, out = (tmp_path / name for name in ("data", "bin", "fs", "out"))
    for folder in (data, tools, binarised, out):
        folder.mkdir()
    (data / "valid.en").write_text("a cat\n  \nhello\n", encoding="utf-8")  # one blank line
    (data / "valid.es").write_text("".join(r + "\n" for r in references), encoding="utf-8")
    pieces = [" ".join(tokenizer.pieces(tokenizer.encode(r))) for r in references]
    pieces[1] = "▁dog madeupword0000"  # a blank source's hypothesis is blank, whatever this is
    (binarised / "valid.pieces").write_text("\n".join(pieces) + "\n", encoding="utf-8")
    generate = tools / "fairseq-generate"
    generate.write_text(FAKE_GENERATE.format(python=sys.executable), encoding="utf-8")
    generate.chmod(0o755)
    args = argparse.Namespace(data=data, fairseq_bin=tools, threads=1)
    prepared = peer.bench_train.Prepared(tokenizer, tmp_path, 0, fairseq_data=binarised)
    scores = peer.generate(args, recipe_config(), prepared, out, "valid")
    assert (out / "valid.hyp").read_text(encoding="utf-8").splitlines() == references
    expected = score(references, [references]).to_dict()
    assert {k: scores[k] for k in expected} == expected
    assert json.loads((out / "valid.bleu.json").read_text(encoding="utf-8")) == scores
    ids = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    assert peer.detokenized("madeupword0000", tokenizer, ids) == tokenizer.decode([1])  # <unk>


def test_fairseq_s_commands_get_a_temporary_directory_removed_after(
    peer: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What fairseq's stopped data-loading workers leave in TMPDIR goes with it, and TMPDIR is
    as it was after, set or not, the run failing or not."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with peer.temporary_directory_of_its_own():
        own = Path(peer.bench_train.child_env(1)["TMPDIR"])
        assert own.is_dir() and own != tmp_path
        (own / "pymp-left" / "listener").parent.mkdir()
    assert not own.exists() and peer.os.environ["TMPDIR"] == str(tmp_path)
    monkeypatch.delenv("TMPDIR")
    with pytest.raises(SystemExit), peer.temporary_directory_of_its_own():
        own = Path(peer.os.environ["TMPDIR"])
        raise SystemExit("fairseq-train failed")
    assert not own.exists() and "TMPDIR" not in peer.os.environ
