"""Tests for `aiayn serve`'s flags: one per `ServerSettings` field (generated, with the field's
documentation and default), under the names the flags had before they were generated. The
server itself is tested in tests/serve/.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from aiayn.cli import build_parser, dataclass_values, main
from aiayn.cli.serve import _BY_HAND, _GROUPS
from aiayn.serve.settings import ServerSettings


def serve_parser() -> argparse.ArgumentParser:
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]


def test_every_setting_has_a_flag() -> None:
    flagged = {name for names in _GROUPS.values() for name in names}
    fields = {f.name for f in dataclasses.fields(ServerSettings)}
    assert fields - _BY_HAND == flagged


def test_flags_show_the_settings_docs_and_defaults() -> None:
    parser = serve_parser()
    helps = {a.dest: parser._get_formatter()._expand_help(a) for a in parser._actions}
    assert helps["max_chars"] == (
        "Longest text, in characters (Unicode code points). (default: 5000)"
    )
    assert helps["timeout_head_s"].endswith("(default: 10.0)")
    assert "aiayn.serve.batcher" in helps["batch_wait_ms"]  # docstring markup removed


def test_no_flags_give_the_default_settings() -> None:
    args = serve_parser().parse_args(["-m", "model"])
    assert dataclass_values(ServerSettings, args, skip=_BY_HAND) == {}


def test_flags_keep_their_names_and_set_the_fields() -> None:
    argv = ["-m", "model", "--max-chars", "10", "--timeout-head", "3", "--timeout-keep-alive"]
    argv += ["2.5", "--no-batching", "--require-api-key", "--docs", "--batch-wait-ms", "0"]
    argv += ["--max-beam-size", "8", "--cors-origin", "https://a.example"]
    args = serve_parser().parse_args(argv)
    values = dataclass_values(ServerSettings, args, skip=_BY_HAND)
    assert values == {
        "max_chars": 10,
        "timeout_head_s": 3.0,
        "timeout_keep_alive_s": 2.5,
        "batching": False,
        "require_api_key": True,
        "docs": True,
        "batch_wait_ms": 0.0,
        "max_beam_size": 8,
    }
    assert args.cors_origins == ["https://a.example"]


@pytest.mark.parametrize("kind", ["directory", "latin-1"])
def test_an_unusable_keys_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Old `aiayn serve`: a traceback for a directory; for a file that is not UTF-8, a codec
    error that did not say which file. Refused before the model is loaded."""
    keys = tmp_path
    if kind == "latin-1":
        keys = tmp_path / "keys"
        keys.write_bytes(b"caf\xe9\n")
    assert main(["serve", "-m", str(tmp_path / "no-model"), "--api-keys", str(keys)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"aiayn serve: error: {keys}: ") and error.count("\n") == 1, error
    assert "Traceback" not in error
