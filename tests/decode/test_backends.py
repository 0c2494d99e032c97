"""Tests for aiayn.interop._runtime: a missing optional runtime names the pip line to run."""

from __future__ import annotations

import pytest

from aiayn.interop._runtime import require


def test_missing_runtime_gives_the_install_line():
    with pytest.raises(ImportError, match=r"pip install -e '\.\[export\]'"):
        require("surely_not_an_installed_module", "exporting to nowhere")
