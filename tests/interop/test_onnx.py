"""Tests for aiayn.interop.onnx: the encoder and decoder-step graphs run by onnxruntime under
aiayn's own search give the PyTorch model's tokens (greedy, beam, n-best), and `Translator`
loads an export directory like a model directory.

One export per module: exporting takes ~10-20 s on a loaded 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.decode.translator import Translator
from interop_models import INTEROP_MODEL, SENTENCES
from model_dirs import tiny_model_dir

onnx = pytest.importorskip("onnx", reason="optional: pip install -e '.[export]'")
pytest.importorskip("onnxruntime", reason="optional: pip install -e '.[export]'")
pytest.importorskip("onnxscript", reason="optional: pip install -e '.[export]'")

from aiayn.interop.onnx import OPSET, export_onnx  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("onnx"), **INTEROP_MODEL)


@pytest.fixture(scope="module")
def export(model_dir: Path) -> Path:
    return export_onnx(model_dir, model_dir.parent / "onnx")


def test_export_holds_two_graphs_of_the_stated_opset(export: Path):
    assert json.loads((export / "aiayn.json").read_text())["opset"] == OPSET
    for name in ("encoder.onnx", "decoder_step.onnx"):
        graph = onnx.load(str(export / name))
        onnx.checker.check_model(graph)
        assert {o.domain: o.version for o in graph.opset_import}[""] == OPSET
    assert (export / "tokenizer.model").is_file()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"beam_size": 1}, id="greedy"),
        pytest.param({"beam_size": 4}, id="beam4"),
        pytest.param({"beam_size": 4, "n_best": 3, "max_len_b": 8}, id="beam4-nbest"),
    ],
)
def test_translator_on_the_export_gives_the_pytorch_tokens(model_dir, export, options):
    ours = Translator(model_dir).translate(SENTENCES, **options)
    theirs = Translator(export).translate(SENTENCES, **options)
    assert [[h.token_ids for h in r.hypotheses] for r in theirs] == [
        [h.token_ids for h in r.hypotheses] for r in ours
    ]
    assert [r.text for r in theirs] == [r.text for r in ours]
    for t, o in zip(theirs, ours, strict=True):
        assert t.log_prob == pytest.approx(o.log_prob, abs=1e-3)


def test_export_cannot_give_attention_maps_or_run_int8(export: Path):
    translator = Translator(export)
    assert not translator.returns_attention
    with pytest.raises(ValueError, match="attention maps"):
        translator.translate(["hello"], return_attention=True)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        Translator(export, int8=True)


def test_threads_are_onnxruntimes_and_pytorchs_are_left_alone(model_dir, export):
    """`threads` are the sessions' own; PyTorch's belong to the process, which the translator
    leaves as it found it (tests/conftest.py gives the suite's threads back). The tokens stay
    the same."""
    import torch

    torch.set_num_threads(2)
    translator = Translator(export, threads=2)
    for session in (translator.model.encoder, translator.model.decoder):
        assert session.get_session_options().intra_op_num_threads == 2
    ours = Translator(model_dir).translate(SENTENCES, beam_size=4)
    theirs = translator.translate(SENTENCES, beam_size=4)
    assert [r.text for r in theirs] == [r.text for r in ours]
    assert torch.get_num_threads() == 2


def test_aiayn_translate_gives_onnxruntime_the_threads_and_pytorch_one(export):
    """The command owns its process: with --threads N, onnxruntime runs the graphs on N threads
    and PyTorch, left with the search's small operators, on one (its spinning OpenMP threads
    took onnxruntime's cores and slowed it down)."""
    import torch

    from aiayn.cli import build_parser
    from aiayn.cli.common import load_translator

    torch.set_num_threads(2)
    args = build_parser().parse_args(["translate", "-m", str(export), "--threads", "2"])
    translator = load_translator(args)
    assert torch.get_num_threads() == 1
    assert translator.model.encoder.get_session_options().intra_op_num_threads == 2


def test_the_interop_namespace_still_offers_onnx_model() -> None:
    from aiayn import interop
    from aiayn.decode.backends.onnx import OnnxModel

    assert interop.OnnxModel is OnnxModel
