"""Files written by an earlier release still work: a model directory translates exactly as it
did, and a checkpoint resumes. The fixture is a run directory written by commit e3eaae9
(tests/fixtures/release-e3eaae9/README.md says how); its expected outputs were written then.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.model_dir import load_model_dir
from aiayn.train.runlog import read_metrics

RELEASE = Path(__file__).parent / "fixtures" / "release-e3eaae9"
# The flags the fixture's run was made with (its README), as a resume repeats them.
TRAIN_FLAGS = [
    "train", "--src", "train.en", "--tgt", "train.de", "--valid-src", "train.en",
    "--valid-tgt", "train.de", "--src-lang", "en", "--tgt-lang", "de", "--vocab-size", "300",
    "--preset", "tiny", "--model", "d_model=32", "--model", "d_ff=64", "--model", "n_heads=2",
    "--model", "n_encoder_layers=1", "--model", "n_decoder_layers=1", "--warmup-steps", "2",
    "--max-tokens", "400", "--save-every", "3", "--valid-every", "3", "--log-every", "3",
    "--keep-last", "1", "--out-dir", "run", "--threads", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture
def release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A writable copy of the old run, as the working directory (its paths are relative)."""
    copy = tmp_path / "release"
    shutil.copytree(RELEASE, copy)
    monkeypatch.chdir(copy)
    return copy


def test_an_old_model_directory_loads_and_translates_as_it_did(release: Path) -> None:
    loaded = load_model_dir(release / "run" / "model")
    assert loaded.metadata["step"] == 6
    for name, flags in [
        ("expected-nbest2.txt", ["--n-best", "2"]),
        ("expected-sampled-seed3.de", ["--sampling", "--seed", "3"]),
    ]:
        out = release / f"got-{name}"
        args = ["translate", "-m", "run/model", "-i", "inputs.en", "-o", str(out), *flags]
        # The search of then: it allowed the empty output and ranked by GNMT's penalty, α 0.6.
        args += ["--min-len", "0", "--length-penalty-kind", "gnmt", "--length-penalty", "0.6"]
        assert main([*args, "--threads", "1"]) == 0
        assert out.read_text(encoding="utf-8") == (release / name).read_text(encoding="utf-8")


def test_an_old_checkpoint_resumes(release: Path) -> None:
    assert main([*TRAIN_FLAGS, "--max-steps", "9", "--resume"]) == 0
    records = read_metrics(release / "run")
    assert [(r["type"], r["step"]) for r in records] == [
        ("train", 3),
        ("valid", 3),
        ("train", 6),
        ("valid", 6),
        ("train", 9),
        ("valid", 9),
    ]
    assert load_model_dir(release / "run").metadata["step"] == 9
