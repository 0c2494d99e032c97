"""The demo's parts, without training: the split, the corpus files and when a run resumes.

The demo trained for real, and the accuracy the README claims, are in integration/test_demo.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn import checkpoint, demo, trainer
from aiayn.demo import EXAMPLES, split_numbers, write_demo_corpus


def test_split_keeps_the_shown_examples_out_of_training() -> None:
    splits = split_numbers(1000, n_valid=50, n_test=100, seed=1)
    shown = [n for n in EXAMPLES if n < 1000]
    assert splits.test[: len(shown)] == shown
    assert not set(shown) & set(splits.train + splits.valid)
    parts = [splits.train, splits.valid, splits.test]
    assert [len(p) for p in parts] == [850, 50, 100]
    assert sorted(splits.train + splits.valid + splits.test) == list(range(1000))
    assert split_numbers(1000, n_valid=50, n_test=100, seed=1) == splits


def test_demo_corpus_is_line_aligned_english_and_german(tmp_path: Path) -> None:
    splits = demo.DemoSplits(train=[21, 3], valid=[97], test=[4321])
    files = write_demo_corpus(tmp_path / "corpus", splits)
    assert set(files) == {"train", "valid", "test"}
    en, de = files["train"]
    assert en.read_text(encoding="utf-8").splitlines() == ["twenty-one", "three"]
    assert de.read_text(encoding="utf-8").splitlines() == ["einundzwanzig", "drei"]


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
        (step / checkpoint.CHECKSUMS_FILE).write_text("{}")
    calls = []

    def fake_train(config: object, *, resume: bool) -> None:
        calls.append(resume)
        raise _Stop

    monkeypatch.setattr(trainer, "train", fake_train)
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path, limit=1000, progress=False)
    assert calls == [complete]
