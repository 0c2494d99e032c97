"""Tests for aiayn.decode.backends: `Translator` drives any backend through the protocol alone
(sources as ids + EOS, longest first, one length limit per batch; results in input order;
refusals before any work), no subclass of `Translator` overrides its private methods, and a
missing peer runtime names the pip line to run."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch

import aiayn
from aiayn.config import preset
from aiayn.decode.backends import Backend, ExportedModel, export_kind
from aiayn.decode.options import DecodingOptions, max_output_length
from aiayn.decode.search import Hypothesis
from aiayn.decode.translator import Translator
from aiayn.errors import CheckpointError
from aiayn.extras import MissingExtra
from aiayn.text.tokenizer import EOS_ID, Tokenizer
from model_dirs import tiny_model_dir, train_tokenizer

CORPUS = ["the cat sat on the mat", "a dog barked at the moon all night", "hello world"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), CORPUS)


class EchoBackend(Backend):
    """Answers each source with its own ids (EOS cut), and records what it was asked; it
    states no capability, so it has `Backend`'s defaults: no attention maps, no scoring, one
    batch at a time."""

    def __init__(self, tokenizer: Tokenizer, **config: object) -> None:
        values = {"max_positions": 64, **config}
        model_config = preset("tiny", src_vocab_size=tokenizer.vocab_size, **values)
        self.models = [ExportedModel(model_config, torch.device("cpu"))]
        self.device = torch.device("cpu")
        self.checked: list[tuple[DecodingOptions, bool]] = []
        self.seeds: list[int] = []
        self.batches: list[tuple[list[list[int]], DecodingOptions]] = []

    def check(self, options: DecodingOptions, *, return_attention: bool) -> None:
        self.checked.append((options, return_attention))
        if return_attention:
            raise ValueError("no attention maps here")

    def seed(self, seed: int) -> None:
        self.seeds.append(seed)

    def search(self, sources, options, generator):
        self.batches.append((sources, options))
        return [[Hypothesis(tokens=ids[:-1], score=-1.0, log_prob=-1.0)] for ids in sources]


def test_a_translator_drives_any_backend_through_the_protocol(tokenizer: Tokenizer) -> None:
    backend = EchoBackend(tokenizer)
    translator = Translator.from_backend(backend, tokenizer, max_tokens=12, model_dirs=["x"])
    sentences = ["hello world", "", "the cat sat on the mat", "a dog"]
    results = translator.translate(sentences, beam_size=2, max_len_b=7)
    assert [r.text for r in results] == [s.strip() for s in sentences]  # input order
    assert all(r.src_tokens[-1] == "</s>" for r in results if r.src_tokens)
    assert backend.checked == [(DecodingOptions(beam_size=2, max_len_b=7), False)]
    widths = [len(sources[0]) for sources, _ in backend.batches]
    assert widths == sorted(widths, reverse=True)  # longest first
    for sources, options in backend.batches:
        assert all(ids[-1] == EOS_ID for ids in sources)
        assert len(sources) * len(sources[0]) * 2 <= 12 or len(sources) == 1  # the budget
        assert (options.max_len_a, options.max_len_b) == (1.0, 7)
    assert translator.model_dirs == [Path("x")] and translator.model is backend.models[0]


def test_refusals_come_before_any_work_and_seeds_only_with_sampling(
    tokenizer: Tokenizer,
) -> None:
    backend = EchoBackend(tokenizer)
    translator = Translator.from_backend(backend, tokenizer)
    assert not translator.returns_attention
    with pytest.raises(ValueError, match="no attention maps"):
        translator.translate(["hello world"], return_attention=True)
    assert backend.batches == []
    translator.translate(["hello world"], beam_size=1, seed=3)
    translator.translate(["hello world"], sampling=True, n_best=2, seed=5)
    assert backend.seeds == [5]


def test_learned_positions_cap_the_limit_each_backend_is_given(tokenizer: Tokenizer) -> None:
    """The translator applies the cap of learned positions for every backend: the options a
    batch comes with never allow more than max_positions − 1 output tokens."""
    backend = EchoBackend(tokenizer, positional_encoding="learned", max_positions=12)
    translator = Translator.from_backend(backend, tokenizer)
    translator.translate(["the cat sat on the mat", "hello"], beam_size=1)
    for sources, options in backend.batches:
        for ids in sources:
            assert max_output_length(len(ids), options.max_len_a, options.max_len_b) <= 11


def test_max_output_length_is_int_of_a_s_plus_b_at_least_0() -> None:
    assert max_output_length(10, 1.0, 50) == 60  # the paper's input length + 50
    assert max_output_length(3, 0.5, 3) == 4  # int(4.5)
    assert max_output_length(3, 0.0, -5) == 0


def test_no_subclass_of_translator_overrides_a_private_method() -> None:
    """A backend composes; it does not reach into `Translator`'s private steps."""
    package = Path(aiayn.__file__).parent
    private = {
        node.name
        for node in ast.walk(ast.parse((package / "decode" / "translator.py").read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_")
    } - {"__init__", "__repr__"}
    overrides = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            bases = [ast.unparse(b) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and any(b.endswith("Translator") for b in bases):
                overrides += [
                    f"{path.name}: {node.name}.{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name in private
                ]
    assert overrides == []


@pytest.mark.parametrize(
    ("runtime", "module", "name"),
    [
        ("onnxruntime", "aiayn.decode.backends.onnx", "OnnxModel"),
        ("ctranslate2", "aiayn.decode.backends.ctranslate2", "CTranslate2Backend"),
    ],
)
def test_a_missing_runtime_gives_the_install_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, runtime: str, module: str, name: str
) -> None:
    monkeypatch.setitem(sys.modules, runtime, None)  # as if not installed
    backend = getattr(importlib.import_module(module), name)
    with pytest.raises(MissingExtra, match=r"pip install -e '\.\[export\]'") as error:
        backend(tmp_path)
    assert runtime in str(error.value) and "\n" not in str(error.value)


class SideBySideBackend(EchoBackend):
    """Decodes `concurrency` batches at once: `submit` starts one, the function it returns
    waits for it."""

    concurrency = 2

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.events: list[str] = []

    def submit(self, sources, options):
        self.events.append("submit")
        hypotheses = self.search(sources, options, None)

        def wait():
            self.events.append("wait")
            return hypotheses

        return wait


def test_a_translator_asks_a_backend_what_it_can_do(tokenizer: Tokenizer) -> None:
    """Capabilities, not types: batches submitted all at once where the backend decodes
    several side by side (unless sampling), scoring refused where it does not score."""
    backend = SideBySideBackend(tokenizer)
    translator = Translator.from_backend(backend, tokenizer, max_tokens=12)
    sentences = ["hello world", "the cat sat on the mat", "a dog"]
    results = translator.translate(sentences, beam_size=2, max_len_b=7)
    assert [r.text for r in results] == sentences
    n = len(backend.batches)
    assert n > 1 and backend.events == ["submit"] * n + ["wait"] * n
    backend.events.clear()
    translator.translate(sentences, sampling=True, max_len_b=7)
    assert backend.events == []  # sampling: one batch at a time, through search
    assert not backend.supports_scoring
    with pytest.raises(ValueError, match="scoring needs the PyTorch model"):
        translator.score(["hello world"], ["hello world"])


def test_the_translator_never_asks_a_backend_what_it_is() -> None:
    package = Path(aiayn.__file__).parent
    source = (package / "decode" / "translator.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "getattr"):
            assert "backend" not in ast.unparse(node.args[0]), ast.unparse(node)


def test_a_directory_is_loaded_as_what_its_files_say_it_is(tmp_path: Path) -> None:
    """One loader for every kind: what a directory holds decides the backend, and an option the
    kind does not take is refused before anything runs."""
    model_dir = tiny_model_dir(tmp_path / "aiayn")
    onnx, ct2 = tmp_path / "onnx", tmp_path / "ct2"
    for directory, marker in ((onnx, "decoder_step.onnx"), (ct2, "model.bin")):
        directory.mkdir()
        (directory / marker).write_bytes(b"")
    assert [export_kind(d) for d in (model_dir, onnx, ct2)] == [None, "onnx", "ctranslate2"]
    translator = Translator(model_dir)
    assert translator.backend.supports_scoring and translator.backend.concurrency == 1
    with pytest.raises(ValueError, match="compute_type is CTranslate2's"):
        Translator(model_dir, compute_type="int8")
    with pytest.raises(CheckpointError, match="is a CTranslate2 export: an ensemble takes aiayn"):
        Translator([model_dir, ct2])
    with pytest.raises(ValueError, match="an ONNX export runs in float32 on the CPU"):
        Translator(onnx, bf16=True)
