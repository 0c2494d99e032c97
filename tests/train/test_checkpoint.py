"""Tests for aiayn.train.checkpoint: checkpoints (a model directory and the training state),
verification and averaging; model directories themselves are in tests/test_model_dir.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.model import Transformer
from aiayn.model_dir import (
    CHECKSUMS_FILE,
    MODEL_FILES,
    CheckpointError,
    __version__,
    load_model_dir,
    save_model_dir,
    sha256_of,
)
from aiayn.train import checkpoint as ckpt
from model_dirs import tiny_model
from test_model_dir import randomised


def _save_steps(
    run_dir: Path, models: list[Transformer], tokenizer_file: Path, keep_last: int = 10
) -> list[Path]:
    return [
        ckpt.save_checkpoint(
            run_dir,
            model,
            step=100 * (i + 1),
            training_state=ckpt.TrainingState({}, ckpt.Progress(step=100 * (i + 1)), [], 1, 1),
            tokenizer_file=tokenizer_file,
            metadata={"src_lang": "en"},
            keep_last=keep_last,
        )
        for i, model in enumerate(models)
    ]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_holds_a_model_dir_and_the_training_state(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    model = tiny_model()
    state = ckpt.TrainingState(
        optimizer=torch.optim.Adam(model.parameters()).state_dict(),
        progress=ckpt.Progress(step=3, interval={"loss": 1.5}),
        rng=[ckpt.capture_rng()],
        world_size=1,
        accumulate=2,
    )
    path = ckpt.save_checkpoint(
        tmp_path,
        model,
        step=3,
        training_state=state,
        tokenizer_file=tokenizer_file,
        metadata={"src_lang": "en"},
        keep_last=2,
    )
    assert path == tmp_path / "checkpoints" / "step_00000003"
    assert load_model_dir(path).metadata == {
        "aiayn_version": __version__,
        "src_lang": "en",
        "step": 3,
    }
    loaded = ckpt.load_training_state(path)
    assert loaded.progress == state.progress
    assert (loaded.world_size, loaded.accumulate) == (1, 2)
    assert torch.equal(loaded.rng[0]["torch"], state.rng[0]["torch"])
    # Plain dicts on disk, in the form of earlier releases (tests/test_compat.py resumes one).
    raw = torch.load(path / ckpt.TRAINING_STATE_FILE, weights_only=True)
    assert raw["progress"] == {
        "step": 3,
        "epoch": 1,
        "position": 0,
        "best_valid_nll": float("inf"),
        "tokens_seen": 0,
        "interval": {"loss": 1.5},
        "best_valid_bleu": -float("inf"),
        "best_step": 0,
        "validations_since_best": 0,
        "elapsed_s": 0.0,
        "schedule_end": 0,
        "weights": "raw",
        "weights_chosen_at": 0,
    }
    # No "ema" key without an average of the weights, as before there was one.
    assert sorted(raw) == ["accumulate", "optimizer", "progress", "rng", "world_size"]


def test_keep_last_prunes_old_checkpoints(tokenizer_file: Path, tmp_path: Path) -> None:
    paths = _save_steps(tmp_path, [tiny_model() for _ in range(5)], tokenizer_file, keep_last=2)
    assert ckpt.list_checkpoints(tmp_path) == paths[-2:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000400",
        "step_00000500",
    ]


def test_list_checkpoints_ignores_incomplete_ones(tokenizer_file: Path, tmp_path: Path) -> None:
    (path,) = _save_steps(tmp_path, [tiny_model()], tokenizer_file)
    (tmp_path / "checkpoints" / "step_00000200").mkdir()  # e.g. a copy that was cut short
    (tmp_path / "checkpoints" / ".step_00000300.tmp-123").mkdir()  # a save in progress
    assert ckpt.list_checkpoints(tmp_path) == [path]
    assert ckpt.list_checkpoints(tmp_path / "elsewhere") == []


class _Exploit:
    """Unpickling this object would run `os.system` — a malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_training_state_never_unpickles_code(tokenizer_file: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (path,) = _save_steps(tmp_path, [tiny_model()], tokenizer_file)
    torch.save({"progress": _Exploit(marker)}, path / ckpt.TRAINING_STATE_FILE)
    # Re-record the checksum, as an attacker who ships a whole checkpoint would.
    checksums = json.loads((path / CHECKSUMS_FILE).read_text())
    checksums[ckpt.TRAINING_STATE_FILE] = sha256_of(path / ckpt.TRAINING_STATE_FILE)
    (path / CHECKSUMS_FILE).write_text(json.dumps(checksums))
    with pytest.raises(CheckpointError, match=r"cannot read .*training_state\.pt"):
        ckpt.load_training_state(path)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_training_state_is_detected(
    damage: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    (path,) = _save_steps(tmp_path, [tiny_model()], tokenizer_file)
    state = path / ckpt.TRAINING_STATE_FILE
    data = bytearray(state.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"training_state\.pt is corrupt or truncated"):
        ckpt.load_training_state(path)


def test_architecture_check(tokenizer_file: Path, tmp_path: Path) -> None:
    (path,) = _save_steps(tmp_path, [tiny_model()], tokenizer_file)
    ckpt.check_same_architecture(path, tiny_model().config)
    ckpt.check_same_architecture(path, tiny_model(dropout=0.3).config)  # not architecture
    with pytest.raises(
        CheckpointError, match=r"different architecture \(d_ff: checkpoint 64, config 128\)"
    ):
        ckpt.check_same_architecture(path, tiny_model(d_ff=128).config)


# -- averaging (§6.1) -----------------------------------------------------------------------


def test_average_is_the_elementwise_mean(tokenizer_file: Path, tmp_path: Path) -> None:
    models = [randomised(tiny_model(), seed) for seed in (10, 11, 12)]
    paths = _save_steps(tmp_path, models, tokenizer_file)
    averaged = ckpt.average_checkpoints(paths)
    states = [_state(m) for m in models]
    for name, tensor in averaged.state_dict().items():
        expected = (states[0][name] + states[1][name] + states[2][name]) / 3
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
    assert averaged.output_projection.weight is averaged.tgt_embed.embedding.weight
    # Order does not matter (sums are taken in float64).
    reordered = ckpt.average_checkpoints(paths[::-1])
    for name, tensor in reordered.state_dict().items():
        assert torch.equal(tensor, averaged.state_dict()[name]), name


def test_average_of_one_checkpoint_is_itself(tokenizer_file: Path, tmp_path: Path) -> None:
    model = randomised(tiny_model(), 13)
    paths = _save_steps(tmp_path, [model], tokenizer_file)
    averaged = ckpt.average_checkpoints(paths)
    for name, tensor in averaged.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_average_refuses_mixed_architectures_and_nothing(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    paths = _save_steps(tmp_path, [tiny_model(), tiny_model(d_ff=128)], tokenizer_file)
    with pytest.raises(CheckpointError, match="configs differ"):
        ckpt.average_checkpoints(paths)
    with pytest.raises(CheckpointError, match="no checkpoints"):
        ckpt.average_checkpoints([])


def test_average_command(
    tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    models = [randomised(tiny_model(), seed) for seed in (20, 21, 22)]
    paths = _save_steps(tmp_path / "run", models, tokenizer_file)
    out = tmp_path / "averaged"
    assert main(["average", str(tmp_path / "run"), "--last", "2", "-o", str(out)]) == 0
    assert "averaged 2 checkpoints (step_00000200 … step_00000300)" in capsys.readouterr().out
    loaded = load_model_dir(out)
    assert loaded.metadata["averaged"] == ["step_00000200", "step_00000300"]
    assert loaded.metadata["step"] == 300
    expected = ckpt.average_checkpoints(paths[1:])
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, expected.state_dict()[name]), name


def test_average_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["average", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 2
    assert "no checkpoints in" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _average_fails(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run `aiayn average`; expect exit status 2 and a one-line message (no traceback)."""
    assert main(["average", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (message,) = err.strip().splitlines()
    assert message.startswith("aiayn average: error: "), err
    return message


def _tree(directory: Path) -> dict[str, bytes]:
    files = (p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def test_average_never_deletes_a_directory_it_did_not_write(
    tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _save_steps(tmp_path / "run", [randomised(tiny_model(), 30)], tokenizer_file)
    (tmp_path / "run" / "train_config.yaml").write_text("max_steps: 100\n")
    save_model_dir(tmp_path / "run" / "model", tiny_model(), tokenizer_file=tokenizer_file)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    run_before, notes_before = _tree(tmp_path / "run"), _tree(notes)

    err = _average_fails([str(tmp_path / "run"), "-o", str(notes)], capsys)
    assert f"{notes} already holds files that are not an aiayn model directory's (todo.txt)" in err
    err = _average_fails([str(tmp_path / "run"), "-o", str(tmp_path / "run")], capsys)
    assert f"{tmp_path / 'run'} is a training run directory;" in err
    err = _average_fails([str(tmp_path / "run"), "-o", str(tmp_path / "run" / "model")], capsys)
    assert f"{tmp_path / 'run' / 'model'} belongs to the training run {tmp_path / 'run'}" in err
    (tmp_path / "file").write_text("mine")
    err = _average_fails([str(tmp_path / "run"), "-o", str(tmp_path / "file")], capsys)
    assert f"{tmp_path / 'file'} exists and is not a directory" in err
    assert _tree(tmp_path / "run") == run_before
    assert _tree(notes) == notes_before
    assert (tmp_path / "file").read_text() == "mine"


def test_average_replaces_a_model_directory_it_wrote(tokenizer_file: Path, tmp_path: Path) -> None:
    _save_steps(tmp_path / "run", [randomised(tiny_model(), 31)], tokenizer_file)
    out = tmp_path / "averaged"
    for _ in range(2):
        assert main(["average", str(tmp_path / "run"), "-o", str(out)]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["average", str(tmp_path / "run"), "-o", str(empty)]) == 0
    assert load_model_dir(empty).metadata["averaged"] == ["step_00000100"]


def test_average_run_again_writes_the_same_bytes(tokenizer_file: Path, tmp_path: Path) -> None:
    """Same checkpoints, same output, byte for byte (checksums.json included): safetensors
    writes its header's metadata in a random order of its own (safetensors#584)."""
    models = [randomised(tiny_model(), seed) for seed in (40, 41)]
    _save_steps(tmp_path / "run", models, tokenizer_file)
    trees = []
    for out in ("out", "out", "other", "another"):  # again into the same, and elsewhere
        assert main(["average", str(tmp_path / "run"), "-o", str(tmp_path / out)]) == 0
        trees.append(_tree(tmp_path / out))
    assert sorted(trees[0]) == sorted([*MODEL_FILES, CHECKSUMS_FILE])
    assert all(tree == trees[0] for tree in trees[1:])


def test_a_checkpoint_saved_twice_has_the_same_bytes(tokenizer_file: Path, tmp_path: Path) -> None:
    model = randomised(tiny_model(share_embeddings="all"), 42)
    trees = [_tree(_save_steps(tmp_path / run, [model], tokenizer_file)[0]) for run in "abc"]
    assert all(tree == trees[0] for tree in trees[1:])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_weights_get_the_same_mode_as_the_other_files(
    umask: int, tokenizer_file: Path, tmp_path: Path
) -> None:
    _save_steps(tmp_path / "run", [tiny_model()], tokenizer_file)
    previous = os.umask(umask)
    try:
        assert main(["average", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
