"""Tests for aiayn.extras: without an optional extra, what needs it fails with one line that
says what to install (the module, the pip command), and the CLI prints that line, not a
traceback. Missing modules are simulated with ``sys.modules[name] = None``, which makes their
import fail as if they were not installed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from aiayn.cli import main
from aiayn.extras import MissingExtra, require


def hide(monkeypatch: pytest.MonkeyPatch, missing: str, *reimported: str) -> None:
    """Makes ``missing`` (and its submodules) unimportable, and forgets the ``reimported``
    modules (and their submodules) so that the next import runs them again."""
    for name in list(sys.modules):
        if name == missing or name.startswith(missing + "."):
            monkeypatch.setitem(sys.modules, name, None)
        if any(name == m or name.startswith(m + ".") for m in reimported):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)


def test_require_imports_the_first_alternative_that_exists() -> None:
    [json_module] = require("serve", "no_such_module_x|json", needed_by="a test")
    assert json_module.__name__ == "json"
    with pytest.raises(MissingExtra, match=r"a test needs no_such_module_y"):
        require("viz", "no_such_module_y|no_such_module_z", needed_by="a test")


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn"])
def test_serve_without_its_extra_says_what_to_install(monkeypatch, missing: str) -> None:
    hide(monkeypatch, missing, "aiayn.serve")
    with pytest.raises(MissingExtra) as error:
        importlib.import_module("aiayn.serve.app")
    with pytest.raises(MissingExtra):
        from aiayn.serve import serve  # noqa: F401
    message = str(error.value)
    assert f"aiayn.serve needs {missing}, which is not installed" in message
    assert "pip install -e '.[serve]'" in message and "\n" not in message


def test_aiayn_serve_without_the_extra_is_a_one_line_error(monkeypatch, capsys, tmp_path) -> None:
    hide(monkeypatch, "fastapi", "aiayn.serve")
    assert main(["serve", "-m", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn serve: error: aiayn.serve needs fastapi")
    assert "pip install -e '.[serve]'" in err and "Traceback" not in err


def test_plots_without_matplotlib_is_a_one_line_error(monkeypatch, capsys, tmp_path) -> None:
    hide(monkeypatch, "matplotlib", "aiayn.viz.plots")
    with pytest.raises(MissingExtra, match=r"needs matplotlib.*pip install -e '\.\[viz\]'"):
        importlib.import_module("aiayn.viz.plots")
    output = str(tmp_path / "schedule.png")
    assert main(["plot", "schedule", "-o", output]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "'.[viz]'" in err and "Traceback" not in err


def test_serve_settings_need_neither_the_extra_nor_torch() -> None:
    """The CLI builds `aiayn serve`'s flags from `ServerSettings` while parsing any command."""
    code = (
        "import sys; sys.modules['fastapi'] = None; import aiayn.serve.settings; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
