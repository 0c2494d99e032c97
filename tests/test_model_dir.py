"""Tests for aiayn.model_dir: a model directory (config, weights, tokenizer, checksums) saved
whole or not at all, loaded with every file verified, and refused in one line naming the file
and field where it is missing, damaged or asks for a model its weights are not."""

from __future__ import annotations

import hashlib
import json
import os
import threading
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
    load_model_dir,
    load_weights,
    read_model_config,
    save_model_dir,
)
from model_dirs import tiny_model


def randomised(model: Transformer, seed: int) -> Transformer:
    """`model` with every parameter drawn afresh (so checkpoints differ in every weight)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


def test_model_dir_round_trip(tokenizer_file: Path, tmp_path: Path) -> None:
    model = randomised(tiny_model(), seed=1)
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
    tokenizer_file: Path, tmp_path: Path
) -> None:
    model = randomised(tiny_model(share_embeddings="all"), seed=2)
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


def test_untied_weights_round_trip(tokenizer_file: Path, tmp_path: Path) -> None:
    model = randomised(tiny_model(share_embeddings="none"), seed=3)
    directory = save_model_dir(tmp_path / "m", model, tokenizer_file=tokenizer_file)
    loaded = load_model_dir(directory).model
    assert loaded.output_projection.weight is not loaded.tgt_embed.embedding.weight
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_saving_replaces_a_directory_atomically(tokenizer_file: Path, tmp_path: Path) -> None:
    first, second = randomised(tiny_model(), 4), randomised(tiny_model(), 5)
    save_model_dir(tmp_path / "model", first, tokenizer_file=tokenizer_file)
    save_model_dir(tmp_path / "model", second, tokenizer_file=tokenizer_file)
    assert [p.name for p in tmp_path.iterdir() if p.name != "spm.model"] == ["model"]  # no tmp
    loaded = load_model_dir(tmp_path / "model").model
    assert torch.equal(
        loaded.decoder.layers[0].feed_forward.linear1.weight,
        second.decoder.layers[0].feed_forward.linear1.weight,
    )


def test_run_dir_resolves_to_its_model(tokenizer_file: Path, tmp_path: Path) -> None:
    save_model_dir(tmp_path / "run" / "model", tiny_model(), tokenizer_file=tokenizer_file)
    assert load_model_dir(tmp_path / "run").directory == tmp_path / "run" / "model"
    with pytest.raises(CheckpointError, match=r"model directory not found: .*nowhere"):
        load_model_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("name", [*MODEL_FILES, CHECKSUMS_FILE])
def test_missing_file_is_named(name: str, tokenizer_file: Path, tmp_path: Path) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
    (directory / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing {name}"):
        load_model_dir(directory)


def _flip_a_weight_bit(directory: Path) -> None:
    """Flip one bit of one weight: still a valid safetensors file, its checksum wrong."""
    weights = directory / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))


def test_checksum_mismatch_is_detected(tokenizer_file: Path, tmp_path: Path) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
    _flip_a_weight_bit(directory)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_model_dir(directory)


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE])
def test_truncated_file_is_detected(name: str, tokenizer_file: Path, tmp_path: Path) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
    path = directory / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{name} is corrupt or truncated"):
        load_model_dir(directory)


def test_a_changed_config_is_refused_before_a_model_is_built_from_it(
    tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["max_positions"] = 10**12  # still valid JSON, a table no machine holds
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    built = []
    monkeypatch.setattr("aiayn.model.Transformer", lambda *a, **k: built.append(a))
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt or truncated"):
        load_model_dir(directory)
    assert built == []


def test_ctrl_c_while_loading_stops_the_hashing_and_stays_a_keyboard_interrupt(
    tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
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
    tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
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


def test_weights_of_another_architecture_are_refused(tokenizer_file: Path, tmp_path: Path) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
    other = tiny_model(n_decoder_layers=3)
    with pytest.raises(CheckpointError, match=r"does not match the model|cannot load"):
        load_weights(other, directory / WEIGHTS_FILE)


def test_invalid_config_is_named(tokenizer_file: Path, tmp_path: Path) -> None:
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
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
    tokenizer_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    learned = changes.get("positional_encoding") == "learned"
    model = tiny_model(positional_encoding="learned") if learned else tiny_model()
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
    tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No weight holds a sinusoidal model's max_positions, so no weight contradicts an absurd
    one: 10^12 in config.json (checksums rewritten) went on to ask the allocator for the table
    (a `RuntimeError` of a bug, or the memory of the machine)."""
    directory = save_model_dir(tmp_path / "m", tiny_model(), tokenizer_file=tokenizer_file)
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
                directory / "ckpt", tiny_model(tokenizer.vocab_size, preset="tiny", seed=0),
                tokenizer_file=tokenizer.model_file,
                extra_files={"training_state.pt": {"m": torch.zeros(1 << 20)}},
            )
        except DiskFullError as error:
            print(error)
    """
    tests = str(Path(__file__).parent)
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
