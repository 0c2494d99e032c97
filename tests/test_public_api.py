"""The package's own namespace: `aiayn.Translator` and friends, imported only when used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aiayn
import aiayn.config
import aiayn.decode.options
import aiayn.decode.translator
import aiayn.model


def test_import_aiayn_does_not_import_torch() -> None:
    """Run in a fresh interpreter: this one imported torch long ago (conftest)."""
    code = "import sys, aiayn; print(aiayn.__version__, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == [aiayn.__version__, "False"]


def test_public_names_are_the_modules_own() -> None:
    assert aiayn.Translator is aiayn.decode.translator.Translator
    assert aiayn.Transformer is aiayn.model.Transformer
    assert aiayn.ModelConfig is aiayn.config.ModelConfig
    assert aiayn.DecodingOptions is aiayn.decode.options.DecodingOptions
    from aiayn import Translator

    assert Translator is aiayn.decode.translator.Translator


def test_dir_and_all_list_the_public_names() -> None:
    public = {
        "DecodingOptions",
        "ModelConfig",
        "Transformer",
        "Translator",
        "UserError",
        "__version__",
    }
    assert public <= set(dir(aiayn))
    assert set(aiayn.__all__) == public


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'aiayn' has no attribute 'Nope'"):
        aiayn.Nope  # noqa: B018
    assert not hasattr(aiayn, "translate")
