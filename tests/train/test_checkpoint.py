"""Tests for aiayn.train.checkpoint: model directories, checkpoints, verification and averaging."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn import model_dir
from aiayn.cli import main
from aiayn.config import MAX_POSITIONS
from aiayn.model import Transformer
from aiayn.model_dir import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    MODEL_FILES,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    __version__,
    load_model_dir,
    load_weights,
    read_model_config,
    save_model_dir,
    sha256_of,
)
from aiayn.train import checkpoint as ckpt


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    # The checkpoint code copies the tokenizer as opaque bytes; no real model is needed here.
    path = tmp_path / "spm.model"
    path.write_bytes(b"not a real sentencepiece model")
    return path


def _randomised(model: Transformer, seed: int) -> Transformer:
    """`model` with every parameter drawn afresh (so checkpoints differ in every weight)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


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


# -- model directories ----------------------------------------------------------------------


def test_model_dir_round_trip(make_model: Callable, tokenizer_file: Path, tmp_path: Path) -> None:
    model = _randomised(make_model(), seed=1)
    directory = save_model_dir(
        tmp_path / "model", model, tokenizer_file=tokenizer_file, metadata={"step": 7}
    )
    assert sorted(p.name for p in directory.iterdir()) == sorted([*MODEL_FILES, CHECKSUMS_FILE])
    loaded = load_model_dir(directory)
    assert loaded.config == model.config
    assert loaded.metadata["step"] == 7
    assert "aiayn_version" in loaded.metadata
    assert loaded.tokenizer_file.read_bytes() == tokenizer_file.read_bytes()
    assert not loaded.model.training  # ready for inference
    expected = model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    src = torch.randint(4, 23, (2, 5))
    tgt = torch.randint(4, 23, (2, 4))
    assert torch.equal(loaded.model(src, tgt), model.eval()(src, tgt))


def test_tied_weights_are_stored_once_and_still_tied_after_load(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    model = _randomised(make_model(share_embeddings="all"), seed=2)
    directory = save_model_dir(tmp_path / "m", model, tokenizer_file=tokenizer_file)
    stored = load_file(directory / WEIGHTS_FILE)
    shared = [
        "src_embed.embedding.weight",
        "tgt_embed.embedding.weight",
        "output_projection.weight",
    ]
    assert sum(name in stored for name in shared) == 1  # §3.4: one matrix, saved once
    loaded = load_model_dir(directory).model
    assert loaded.output_projection.weight is loaded.tgt_embed.embedding.weight
    assert loaded.src_embed.embedding.weight is loaded.tgt_embed.embedding.weight
    assert torch.equal(loaded.output_projection.weight, model.output_projection.weight)


def test_untied_weights_round_trip(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    model = _randomised(make_model(share_embeddings="none"), seed=3)
    directory = save_model_dir(tmp_path / "m", model, tokenizer_file=tokenizer_file)
    loaded = load_model_dir(directory).model
    assert loaded.output_projection.weight is not loaded.tgt_embed.embedding.weight
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_saving_replaces_a_directory_atomically(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    first, second = _randomised(make_model(), 4), _randomised(make_model(), 5)
    save_model_dir(tmp_path / "model", first, tokenizer_file=tokenizer_file)
    save_model_dir(tmp_path / "model", second, tokenizer_file=tokenizer_file)
    assert [p.name for p in tmp_path.iterdir() if p.name != "spm.model"] == ["model"]  # no tmp
    loaded = load_model_dir(tmp_path / "model").model
    assert torch.equal(
        loaded.decoder.layers[0].feed_forward.linear1.weight,
        second.decoder.layers[0].feed_forward.linear1.weight,
    )


def test_run_dir_resolves_to_its_model(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    save_model_dir(tmp_path / "run" / "model", make_model(), tokenizer_file=tokenizer_file)
    assert load_model_dir(tmp_path / "run").directory == tmp_path / "run" / "model"
    with pytest.raises(CheckpointError, match=r"model directory not found: .*nowhere"):
        load_model_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("name", [*MODEL_FILES, CHECKSUMS_FILE])
def test_missing_file_is_named(
    name: str, make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    (directory / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing {name}"):
        load_model_dir(directory)


def _flip_a_weight_bit(directory: Path) -> None:
    """Flip one bit of one weight: still a valid safetensors file, its checksum wrong."""
    weights = directory / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))


def test_checksum_mismatch_is_detected(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    _flip_a_weight_bit(directory)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_model_dir(directory)


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE])
def test_truncated_file_is_detected(
    name: str, make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    path = directory / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{name} is corrupt or truncated"):
        load_model_dir(directory)


def test_a_changed_config_is_refused_before_a_model_is_built_from_it(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["max_positions"] = 10**12  # still valid JSON, a table no machine holds
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    built = []
    monkeypatch.setattr("aiayn.model.Transformer", lambda *a, **k: built.append(a))
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt or truncated"):
        load_model_dir(directory)
    assert built == []


def test_ctrl_c_while_loading_stops_the_hashing_and_stays_a_keyboard_interrupt(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    _flip_a_weight_bit(directory)
    real_sha256_of = model_dir.sha256_of
    stopped: list[bool] = []

    def endless_for_the_weights(path: Path, stop: threading.Event | None = None) -> str:
        """Weights whose hashing ends only when stopped (or after a minute: the test fails)."""
        if path.name != WEIGHTS_FILE:
            return real_sha256_of(path, stop)
        stopped.append(stop is not None and stop.wait(timeout=60))
        return real_sha256_of(path, stop)

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(model_dir, "sha256_of", endless_for_the_weights)
    monkeypatch.setattr(model_dir, "load_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):  # not the weights' checksum error
        load_model_dir(directory)
    assert stopped == [True]  # the hashing was stopped, not waited for
    hashing = [t for t in threading.enumerate() if t.name.startswith("aiayn-verify")]
    assert hashing == []  # and its thread has ended: nothing of the load outlives it


def test_a_load_error_gives_way_to_the_weights_checksum_error(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    _flip_a_weight_bit(directory)

    def unreadable(*args: object) -> None:
        raise CheckpointError("cannot load weights")

    monkeypatch.setattr("aiayn.model_dir.load_weights", unreadable)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_model_dir(directory)
    monkeypatch.undo()
    _flip_a_weight_bit(directory)  # back: the weights match their checksum again
    monkeypatch.setattr("aiayn.model_dir.load_weights", unreadable)
    with pytest.raises(CheckpointError, match="cannot load weights"):
        load_model_dir(directory)  # the weights match: the load error is the one raised


def test_weights_of_another_architecture_are_refused(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    other = make_model(n_decoder_layers=3)
    with pytest.raises(CheckpointError, match=r"does not match the model|cannot load"):
        load_weights(other, directory / WEIGHTS_FILE)


def test_invalid_config_is_named(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["d_modle"] = 8
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: invalid model config.*d_modle"):
        read_model_config(directory)


def _edit_config(directory: Path, **changes: object) -> Path:
    """Change fields of `directory`'s config.json and rewrite checksums.json to match (as a
    hand, or a tool that knows the format, would): only the config disagrees with the weights."""
    config_file = directory / CONFIG_FILE
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    checksums = json.loads((directory / CHECKSUMS_FILE).read_text())
    checksums[CONFIG_FILE] = hashlib.sha256(config_file.read_bytes()).hexdigest()
    (directory / CHECKSUMS_FILE).write_text(json.dumps(checksums))
    return config_file


@pytest.mark.parametrize(
    ("changes", "shown"),
    [
        ({"d_model": 2**40}, "d_model (1099511627776) does not match"),
        ({"d_ff": 2**40}, "d_ff (1099511627776) does not match"),
        ({"n_heads": 2**20}, "n_heads × d_k (8388608) does not match"),
        ({"n_encoder_layers": 2**40}, "n_encoder_layers (1099511627776) does not match"),
        ({"n_decoder_layers": 1}, "n_decoder_layers (1) does not match"),
        ({"src_vocab_size": 2**40, "tgt_vocab_size": 2**40}, "src_vocab_size (1099511627776)"),
        ({"positional_encoding": "learned", "max_positions": 2**16}, "max_positions (65536)"),
    ],
    ids=["d_model", "d_ff", "n_heads", "encoder", "decoder", "vocab", "positions"],
)
def test_sizes_that_the_weights_do_not_have_are_refused_before_the_model_is_built(
    changes: dict[str, object],
    shown: str,
    make_model: Callable,
    tokenizer_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    learned = changes.get("positional_encoding") == "learned"
    model = make_model(positional_encoding="learned") if learned else make_model()
    directory = save_model_dir(tmp_path / "m", model, tokenizer_file=tokenizer_file)
    config_file = _edit_config(directory, **changes)
    with pytest.raises(CheckpointError) as raised:
        load_model_dir(directory)
    message = str(raised.value)
    assert message.startswith(f"{config_file}: {shown}"), message
    assert f"the weights in {directory / WEIGHTS_FILE}" in message
    for argv in (["info", "-m", str(directory)], ["translate", "-m", str(directory)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"aiayn {argv[0]}: error: {message}\n"


def test_an_absurd_max_positions_of_a_sinusoidal_model_is_refused_before_its_table_is_built(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No weight holds a sinusoidal model's max_positions, so no weight contradicts an absurd
    one: 10^12 in config.json (checksums rewritten) went on to ask the allocator for the table
    (a `RuntimeError` of a bug, or the memory of the machine)."""
    directory = save_model_dir(tmp_path / "m", make_model(), tokenizer_file=tokenizer_file)
    config_file = _edit_config(directory, max_positions=10**12)
    message = (
        f"{config_file}: invalid model config: max_positions (1000000000000) must be at "
        f"most {MAX_POSITIONS}"
    )
    for argv in (["info", "-m", str(directory)], ["translate", "-m", str(directory)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"aiayn {argv[0]}: error: {message}\n"
    _edit_config(directory, max_positions=MAX_POSITIONS)  # the bound itself is a model
    assert read_model_config(directory).max_positions == MAX_POSITIONS


# -- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_holds_a_model_dir_and_the_training_state(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    model = make_model()
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


def test_keep_last_prunes_old_checkpoints(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    paths = _save_steps(tmp_path, [make_model() for _ in range(5)], tokenizer_file, keep_last=2)
    assert ckpt.list_checkpoints(tmp_path) == paths[-2:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000400",
        "step_00000500",
    ]


def test_list_checkpoints_ignores_incomplete_ones(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    (path,) = _save_steps(tmp_path, [make_model()], tokenizer_file)
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


def test_training_state_never_unpickles_code(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    (path,) = _save_steps(tmp_path, [make_model()], tokenizer_file)
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
    damage: str, make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    (path,) = _save_steps(tmp_path, [make_model()], tokenizer_file)
    state = path / ckpt.TRAINING_STATE_FILE
    data = bytearray(state.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"training_state\.pt is corrupt or truncated"):
        ckpt.load_training_state(path)


def test_architecture_check(make_model: Callable, tokenizer_file: Path, tmp_path: Path) -> None:
    (path,) = _save_steps(tmp_path, [make_model()], tokenizer_file)
    ckpt.check_same_architecture(path, make_model().config)
    ckpt.check_same_architecture(path, make_model(dropout=0.3).config)  # not architecture
    with pytest.raises(
        CheckpointError, match=r"different architecture \(d_ff: checkpoint 64, config 128\)"
    ):
        ckpt.check_same_architecture(path, make_model(d_ff=128).config)


# -- averaging (§6.1) -----------------------------------------------------------------------


def test_average_is_the_elementwise_mean(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    models = [_randomised(make_model(), seed) for seed in (10, 11, 12)]
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


def test_average_of_one_checkpoint_is_itself(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    model = _randomised(make_model(), 13)
    paths = _save_steps(tmp_path, [model], tokenizer_file)
    averaged = ckpt.average_checkpoints(paths)
    for name, tensor in averaged.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_average_refuses_mixed_architectures_and_nothing(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    paths = _save_steps(tmp_path, [make_model(), make_model(d_ff=128)], tokenizer_file)
    with pytest.raises(CheckpointError, match="configs differ"):
        ckpt.average_checkpoints(paths)
    with pytest.raises(CheckpointError, match="no checkpoints"):
        ckpt.average_checkpoints([])


def test_average_command(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    models = [_randomised(make_model(), seed) for seed in (20, 21, 22)]
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
    make_model: Callable, tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _save_steps(tmp_path / "run", [_randomised(make_model(), 30)], tokenizer_file)
    (tmp_path / "run" / "train_config.yaml").write_text("max_steps: 100\n")
    save_model_dir(tmp_path / "run" / "model", make_model(), tokenizer_file=tokenizer_file)
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


def test_average_replaces_a_model_directory_it_wrote(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    _save_steps(tmp_path / "run", [_randomised(make_model(), 31)], tokenizer_file)
    out = tmp_path / "averaged"
    for _ in range(2):
        assert main(["average", str(tmp_path / "run"), "-o", str(out)]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["average", str(tmp_path / "run"), "-o", str(empty)]) == 0
    assert load_model_dir(empty).metadata["averaged"] == ["step_00000100"]


def test_average_run_again_writes_the_same_bytes(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    """Same checkpoints, same output, byte for byte (checksums.json included): safetensors
    writes its header's metadata in a random order of its own (safetensors#584)."""
    models = [_randomised(make_model(), seed) for seed in (40, 41)]
    _save_steps(tmp_path / "run", models, tokenizer_file)
    trees = []
    for out in ("out", "out", "other", "another"):  # again into the same, and elsewhere
        assert main(["average", str(tmp_path / "run"), "-o", str(tmp_path / out)]) == 0
        trees.append(_tree(tmp_path / out))
    assert sorted(trees[0]) == sorted([*MODEL_FILES, CHECKSUMS_FILE])
    assert all(tree == trees[0] for tree in trees[1:])


def test_a_checkpoint_saved_twice_has_the_same_bytes(
    make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    model = _randomised(make_model(share_embeddings="all"), 42)
    trees = [_tree(_save_steps(tmp_path / run, [model], tokenizer_file)[0]) for run in "abc"]
    assert all(tree == trees[0] for tree in trees[1:])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_weights_get_the_same_mode_as_the_other_files(
    umask: int, make_model: Callable, tokenizer_file: Path, tmp_path: Path
) -> None:
    _save_steps(tmp_path / "run", [make_model()], tokenizer_file)
    previous = os.umask(umask)
    try:
        assert main(["average", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_a_write_limit_torch_hides_is_reported_as_such(tmp_path: Path) -> None:
    """torch's zip writer reports a failed write as "unexpected pos": the OSError under it is
    what the save reports, whatever the free space says, as a quota (EDQUOT) is not seen in
    the free space. A real file size limit (RLIMIT_FSIZE: EFBIG) plays it: the weights fit,
    the training state does not."""
    import subprocess
    import sys

    code = """if True:
        import resource, sys, torch
        from pathlib import Path
        from aiayn.model_dir import DiskFullError, save_model_dir
        from model_dirs import tiny_model, train_tokenizer
        directory = Path(sys.argv[1])
        tokenizer = train_tokenizer(directory / "tok")
        limit = 3_000_000  # over the tokenizer and the weights, under the 4 MiB state
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            save_model_dir(
                directory / "ckpt", tiny_model(tokenizer), tokenizer_file=tokenizer.model_file,
                extra_files={"training_state.pt": {"m": torch.zeros(1 << 20)}},
            )
        except DiskFullError as error:
            print(error)
    """
    tests = str(Path(__file__).parents[1])
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": tests},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"File too large writing {tmp_path / '.ckpt.tmp-'}"), run.stdout
    assert "partial checkpoint removed" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
