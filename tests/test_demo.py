"""The demo's parts, without training: the split, the corpus files and when a run resumes.

The demo trained for real, and the accuracy the README claims, are in integration/test_demo.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn import demo
from aiayn.config import PRESETS
from aiayn.demo import EXAMPLES, SMALL, SMALL_EXAMPLES, split_numbers, write_demo_corpus
from aiayn.model_dir import CHECKSUMS_FILE
from aiayn.train import trainer


def test_split_keeps_the_shown_examples_out_of_training_and_0_to_100_in() -> None:
    splits = split_numbers(1000, n_valid=50, n_test=100, seed=1)
    shown = [n for n in EXAMPLES if n < 1000]
    assert splits.test[: len(shown)] == shown
    assert not set(shown) & set(splits.train + splits.valid)
    assert set(SMALL) <= set(splits.train) and set(SMALL_EXAMPLES) <= set(SMALL)
    parts = [splits.train, splits.valid, splits.test]
    assert [len(p) for p in parts] == [850, 50, 100]
    assert sorted(splits.train + splits.valid + splits.test) == list(range(1000))
    assert split_numbers(1000, n_valid=50, n_test=100, seed=1) == splits


def test_demo_corpus_is_line_aligned_english_and_german(tmp_path: Path) -> None:
    splits = demo.DemoSplits(train=[21, 3], valid=[97], test=[4321])
    files = write_demo_corpus(tmp_path / "corpus", splits, small_weight=1)
    assert set(files) == {"train", "valid", "test", "vocab"}
    en, de = files["train"]
    assert en.read_text(encoding="utf-8").splitlines() == ["twenty-one", "three"]
    assert de.read_text(encoding="utf-8").splitlines() == ["einundzwanzig", "drei"]


def test_demo_corpus_repeats_only_the_small_numbers_in_training(tmp_path: Path) -> None:
    splits = demo.DemoSplits(train=[21, 20, 101], valid=[5], test=[7])
    files = write_demo_corpus(tmp_path / "corpus", splits, small_weight=3)
    lines = {name: en.read_text(encoding="utf-8").splitlines() for name, (en, _) in files.items()}
    assert lines["train"] == ["twenty-one"] * 3 + ["twenty"] * 3 + ["one hundred and one"]
    assert lines["vocab"] == ["twenty-one", "twenty", "one hundred and one"]  # each number once
    assert (lines["valid"], lines["test"]) == (["five"], ["seven"])


class _Stop(Exception):
    pass


@pytest.mark.parametrize("complete", [True, False])
def test_demo_resumes_only_from_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, complete: bool
) -> None:
    """A step directory without its checksums (a save cut short) is not something to resume."""
    step = tmp_path / "run" / "checkpoints" / "step_00000300"
    step.mkdir(parents=True)
    if complete:
        (step / CHECKSUMS_FILE).write_text("{}")
    calls = []

    def fake_train(config: object, *, resume: bool) -> None:
        calls.append(resume)
        raise _Stop

    monkeypatch.setattr(trainer, "train", fake_train)
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path, limit=1000, progress=False)
    assert calls == [complete]


def _record_training(monkeypatch: pytest.MonkeyPatch) -> list:
    """The configs the demo would train with, each training stopped at once (`_Stop`)."""
    configs = []

    def fake_train(config: object, *, resume: bool) -> None:
        configs.append(config)
        raise _Stop

    monkeypatch.setattr(trainer, "train", fake_train)
    return configs


def test_make_docs_draws_the_schedule_the_demo_trains_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make docs` draws the demo's Eq. 3 curve from flags; they must be the demo's settings."""
    configs = _record_training(monkeypatch)
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path, limit=1000, progress=False)
    [config] = configs
    d_model = PRESETS[config.preset]["d_model"]
    flags = f"--d-model {d_model} --warmup {config.warmup_steps} --lr-scale {config.lr_scale:g}"
    makefile = (Path(__file__).parents[1] / "Makefile").read_text(encoding="utf-8")
    assert flags in " ".join(makefile.replace("\\\n", " ").split())
    assert config.preset == "demo" and not config.model  # the preset says what the model is


def test_demo_trains_where_device_says_and_refuses_a_missing_gpu_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`aiayn demo --device`: "auto" is made a device before training (the translator then
    decodes where the model trained); a CUDA device this machine lacks is one line, exit
    status 2, and nothing written."""
    import torch

    from aiayn.cli import main

    configs = _record_training(monkeypatch)
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path / "cpu", limit=1000, progress=False, device="cpu")
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path / "auto", limit=1000, progress=False)
    assert [c.device for c in configs] == ["cpu", "cuda" if torch.cuda.is_available() else "cpu"]
    if torch.cuda.is_available():
        return  # the refusal needs a machine without a GPU
    out = tmp_path / "gpu"
    assert main(["demo", "-o", str(out), "--device", "cuda"]) == 2
    assert "--device cuda: this machine has no CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_report_says_which_numbers_were_seen_in_training() -> None:
    result = demo.DemoResult(
        model_dir=Path("m"),
        exact_match=0.99,
        chrf=99.9,
        chrf_signature="nrefs:1",
        small_wrong=[("zero", "sechshundertelf")],
        small_total=101,
        small_weight=20,
        minutes=2.0,
        examples=[
            demo.DemoExample("five", "fünf", "fünf", held_out=False),
            demo.DemoExample("three hundred and forty-two", "x", "dreihundertzweiundvierzig", True),
        ],
    )
    report = demo.format_report(result).splitlines()
    assert "Held-out numbers (never seen in training): exact match 99.0%" in report
    assert "Numbers 0–100 (in training, weighted ×20): 100/101 right" in report
    assert "  wrong: zero → sechshundertelf" in report
    assert "  five  (in training)" in report and "    → fünf  ✓" in report
    assert "  three hundred and forty-two  (held out)" in report and "    → x  ✗" in report


def test_the_report_says_to_try_aiayn_as_it_was_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make demo` runs `.venv/bin/aiayn demo` without an activated environment, where a bare
    `aiayn translate` is "command not found": the command to try is the one that ran."""
    launcher = tmp_path / ".venv" / "bin" / "aiayn"
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr("sys.argv", [".venv/bin/aiayn", "demo"])
    result = demo.DemoResult(
        model_dir=Path("demo_run/run/model"),
        exact_match=1.0,
        chrf=100.0,
        chrf_signature="nrefs:1",
        small_wrong=[],
        small_total=101,
        small_weight=8,
        minutes=2.0,
        examples=[],
    )
    try_line = demo.format_report(result).splitlines()[-1]
    assert try_line == (
        "Try: .venv/bin/aiayn translate -m demo_run/run/model <<< 'two thousand and twenty-six'"
    )
    monkeypatch.setenv("PATH", f"{launcher.parent}:/usr/bin:/bin")  # an activated environment
    assert demo.format_report(result).splitlines()[-1].startswith("Try: aiayn translate -m ")
    monkeypatch.setattr("sys.argv", ["/somewhere/aiayn/__main__.py", "demo"])  # python -m aiayn
    assert demo.command_as_run().endswith(" -m aiayn")
