"""Tests for `aiayn export`, `aiayn import` and `--backend ctranslate2`, through `main`: an
export translates to the same lines as the PyTorch model, an HF export imported back translates
identically, `-o` never destroys files aiayn did not write, and what a backend cannot do is a
one-line error. Each test skips when its optional runtime is missing."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.errors import UserError
from interop_models import INTEROP_MODEL, SENTENCES
from model_dirs import tiny_model_dir

FAST = ["--threads", "1", "--no-progress"]
TEXTS = [s for s in SENTENCES if s][:3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("cli-interop"), **INTEROP_MODEL)


@pytest.fixture(scope="module")
def source(model_dir: Path) -> Path:
    path = model_dir.parent / "source.txt"
    path.write_text("".join(f"{s}\n" for s in SENTENCES), encoding="utf-8")
    return path


def translate(model: Path | str, source: Path, *flags: str) -> list[str]:
    out = source.parent / "out.txt"
    argv = ["translate", "-m", str(model), "-i", str(source), "-o", str(out), *FAST, *flags]
    assert main(argv) == 0
    return out.read_text(encoding="utf-8").splitlines()


def export(model_dir: Path, to: str, out: Path, *flags: str) -> Path:
    assert main(["export", str(model_dir), "--to", to, "-o", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def ct2_dir(model_dir: Path) -> Path:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    return export(model_dir, "ctranslate2", model_dir.parent / "ct2")


# -- CTranslate2 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--beam-size", "1"], id="greedy"),
        pytest.param(["--beam-size", "4", "--stopping", "finished"], id="beam4"),
    ],
)
def test_a_ctranslate2_export_translates_as_pytorch(ct2_dir, model_dir, source, flags) -> None:
    theirs, ours = translate(ct2_dir, source, *flags), translate(model_dir, source, *flags)
    if flags == ["--beam-size", "1"]:  # greedy search: identical even at the length limit
        assert theirs == ours
    else:
        assert ended(model_dir, theirs) == ended(model_dir, ours)


def test_min_len_is_ctranslate2s_min_decoding_length(model_dir, source, tmp_path) -> None:
    """--min-len holds EOS back on CTranslate2 as in aiayn's search, on a model whose most
    probable token is always EOS: empty outputs with --min-len 0, else outputs of that many
    pieces, the same from both."""
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.model_dir import load_model_dir, save_model_dir, tokenizer_file_of
    from aiayn.text.tokenizer import EOS_ID

    loaded = load_model_dir(model_dir)
    model, d = loaded.model, loaded.config.d_model
    with torch.no_grad():  # the decoder's output ≈ 10·u, and EOS's output row 5·u
        u = torch.randn(d, generator=torch.Generator().manual_seed(0))
        u /= u.norm()
        norm = model.decoder.layers[-1].feed_forward_sublayer.norm
        norm.weight.fill_(0.1)
        norm.bias.copy_(10 * u)
        model.output_projection.weight[EOS_ID] = 5 * u
    eos_first = save_model_dir(
        tmp_path / "eos-first", model, tokenizer_file=tokenizer_file_of(model_dir)
    )
    ct2 = export(eos_first, "ctranslate2", tmp_path / "ct2")
    for min_len in ("0", "3"):
        flags = ["--beam-size", "1", "--min-len", min_len]
        ours = translate(eos_first, source, *flags)
        assert translate(ct2, source, *flags) == ours
        outputs = [line for line, text in zip(ours, SENTENCES, strict=True) if text]
        assert all(outputs) if min_len == "3" else not any(outputs), outputs


def test_backend_ctranslate2_converts_a_model_directory(ct2_dir, model_dir, source) -> None:
    # Beam search on CTranslate2 ends a sentence at beam-size finished hypotheses.
    pytorch = ended(model_dir, translate(model_dir, source, "--stopping", "finished"))
    assert ended(model_dir, translate(model_dir, source, "--backend", "ctranslate2")) == pytorch
    assert ended(model_dir, translate(ct2_dir, source, "--compute-type", "float32")) == pytorch


def ended(model_dir: Path, lines: list[str]) -> list[str]:
    """The translations of `SENTENCES` whose beam-4 output (aiayn's) ends before its length
    limit: at the limit, beam search on CTranslate2 may pick another output (the backend cuts
    its hypothesis there afterwards, where aiayn's search forces EOS)."""
    from aiayn.decode.translator import Translator

    results = Translator(model_dir).translate(SENTENCES, beam_size=4, stopping="finished")
    limits = [len(r.src_tokens) + 50 for r in results]  # source with </s>, + 50
    pairs = zip(lines, results, limits, strict=True)
    kept = [line for line, r, limit in pairs if len(r.token_ids) < limit]
    assert len(kept) >= 4
    return kept


def test_backend_ctranslate2_takes_the_decoding_threads_by_default(ct2_dir, monkeypatch) -> None:
    """Without --threads, CTranslate2 gets `runtime.decoding_threads()` (the idle cores, 1 to
    4), as PyTorch does, one translator per thread (inter_threads) unless --workers says
    otherwise; --threads N gives it N."""
    import ctranslate2

    from aiayn import runtime
    from aiayn.cli import build_parser
    from aiayn.cli.common import load_translator

    asked = []

    def translator(*args, **kwargs):
        asked.append((kwargs["inter_threads"], kwargs["intra_threads"]))
        return real(*args, **kwargs)

    real = ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "Translator", translator)
    monkeypatch.setattr(runtime, "decoding_threads", lambda: 3)
    for flags in ([], ["--threads", "2"], ["--workers", "1"], ["--threads", "4", "--workers", "2"]):
        load_translator(build_parser().parse_args(["translate", "-m", str(ct2_dir), *flags]))
    assert asked == [(3, 1), (2, 1), (1, 3), (2, 2)]
    load_translator(build_parser().parse_args(["serve", "-m", str(ct2_dir)]))
    assert asked[-1] == (1, 3)  # a server decodes one call at a time: one translator


def test_backend_ctranslate2_device_auto_falls_back_to_the_cpu(ct2_dir, monkeypatch) -> None:
    """--device auto on a machine where CTranslate2 counts a GPU it cannot compute on (its
    wheel built for another CUDA: the model loads, the first matrix product fails) decodes on
    the CPU, with a warning; --device cuda there is one line naming the device; cuda:N reaches
    CTranslate2 as its device_index; an error that is not the device's is not hidden."""
    import ctranslate2

    from aiayn.cli import build_parser
    from aiayn.cli.common import load_translator

    opened = []
    failure = "Library libcublas.so.12 is not found or cannot be loaded"

    class GpuWithoutCublas:  # what CTranslate2 4.8 does there: loads, then fails to compute
        def translate_batch(self, *args, **kwargs):
            raise RuntimeError(failure)

    def translator(*args, **kwargs):
        opened.append((kwargs["device"], kwargs["device_index"]))
        return GpuWithoutCublas() if kwargs["device"] == "cuda" else real(*args, **kwargs)

    real = ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "Translator", translator)
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)

    def load(*flags: str):
        return load_translator(build_parser().parse_args(["translate", "-m", str(ct2_dir), *flags]))

    assert load("--device", "auto").device == "cpu"
    assert opened == [("cuda", 0), ("cpu", 0)]
    opened.clear()
    for device, index in (("cuda", 0), ("cuda:1", 1)):
        with pytest.raises(UserError, match=rf"--device {device}: .*libcublas\.so\.12"):
            load("--device", device)
        assert opened.pop() == ("cuda", index)
    with pytest.raises(UserError, match="runs on cpu, cuda, cuda:N or auto"):
        load("--device", "gpu")
    failure = "Unable to open file 'model.bin'"  # not the GPU's fault: no CPU retry
    with pytest.raises(RuntimeError, match=r"model\.bin"):
        load("--device", "auto")
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 0)
    with pytest.raises(UserError, match="--device cuda: CTranslate2 sees no CUDA GPU"):
        load("--device", "cuda")


def test_backend_ctranslate2_converts_on_one_pytorch_thread(model_dir, monkeypatch) -> None:
    """Converting a model directory must not start PyTorch's OpenMP threads: once they exist,
    the process's libgomp has more threads than cores and CTranslate2 decodes far slower."""
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    import torch

    from aiayn.cli import build_parser
    from aiayn.cli.common import load_translator
    from aiayn.interop import ctranslate2

    threads_while_converting = []

    def export(*args, **kwargs):
        threads_while_converting.append(torch.get_num_threads())
        return real_export(*args, **kwargs)

    real_export = ctranslate2.export_ctranslate2
    monkeypatch.setattr(ctranslate2, "export_ctranslate2", export)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = ["translate", "-m", str(model_dir), "--backend", "ctranslate2", "--threads", "2"]
        load_translator(build_parser().parse_args(argv))
    finally:
        torch.set_num_threads(before)
    assert threads_while_converting == [1]


def test_backend_ctranslate2_converts_a_model_directory_once(
    model_dir, source, tmp_path, monkeypatch
) -> None:
    """The export is kept in the cache and used again; a changed model is converted again."""
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    import os
    import shutil

    from aiayn.interop import ctranslate2

    converted = []

    def export(model, out, *args, **kwargs):
        converted.append(Path(model))
        return real_export(model, out, *args, **kwargs)

    real_export = ctranslate2.export_ctranslate2
    monkeypatch.setattr(ctranslate2, "export_ctranslate2", export)
    first = translate(model_dir, source, "--backend", "ctranslate2")
    assert converted == [model_dir] and len(list(ctranslate2.cache_dir().iterdir())) == 1
    assert translate(model_dir, source, "--backend", "ctranslate2") == first
    assert converted == [model_dir]  # from the cache
    copy = shutil.copytree(model_dir, tmp_path / "copy")
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert translate(copy, source, "--backend", "ctranslate2") == first
    assert converted == [model_dir, copy]  # the same bytes, touched: converted again
    assert len(list(ctranslate2.cache_dir().iterdir())) == 2


def test_the_ctranslate2_cache_keeps_the_most_recently_used(model_dir, tmp_path) -> None:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    import os
    import shutil

    from aiayn.interop import ctranslate2

    root = ctranslate2.cache_dir()
    (root / "my-models").mkdir(parents=True)  # AIAYN_CT2_CACHE set to a directory in use
    copies = []
    for i in range(ctranslate2.CACHE_ENTRIES + 1):
        copy = shutil.copytree(model_dir, tmp_path / f"m{i}")
        os.utime(copy / "config.json", ns=(0, 10**9 * (i + 1)))  # another key for each copy
        copies.append(copy)
    first = ctranslate2.cached_export(copies[0])
    for copy in copies[1:]:
        assert ctranslate2.find_cached_export(copy) is None
        ctranslate2.cached_export(copy)
        assert ctranslate2.find_cached_export(copies[0]) == first  # used again each time
    kept = {p.name for p in root.iterdir()}
    assert len(kept) == ctranslate2.CACHE_ENTRIES + 1 and {first.name, "my-models"} <= kept
    assert ctranslate2.find_cached_export(copies[1]) is None  # the least recently used went


def test_a_broken_cache_entry_is_converted_again(model_dir, source) -> None:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.interop import ctranslate2

    entry = ctranslate2.cached_export(model_dir)
    (entry / "model.bin").unlink()  # as a removal killed half-way leaves it
    assert ctranslate2.find_cached_export(model_dir) is None
    assert ctranslate2.cached_export(model_dir) == entry and (entry / "model.bin").is_file()
    assert translate(model_dir, source, "--backend", "ctranslate2")


def test_a_damaged_cache_entry_is_converted_again(model_dir, source, caplog) -> None:
    """A cached export whose weights were cut short: CTranslate2 cannot load it, so the entry is
    dropped and the model converted again (it used to be CTranslate2's RuntimeError, never
    converted again while the model directory stayed the same)."""
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.interop import ctranslate2

    entry = ctranslate2.cached_export(model_dir)
    expected = translate(model_dir, source, "--backend", "ctranslate2")
    with (entry / "model.bin").open("r+b") as weights:
        weights.truncate(1000)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert translate(model_dir, source, "--backend", "ctranslate2") == expected
    assert "CTranslate2 cannot load this export" in caplog.text
    assert f"converting {model_dir} again" in caplog.text
    assert (entry / "model.bin").stat().st_size > 1000


NO_TORCH = """
import sys
from aiayn.cli import main
rc = main(sys.argv[1:])
print("torch" in sys.modules, file=sys.stderr)
sys.exit(rc)
"""


def test_backend_ctranslate2_translates_without_importing_torch(
    ct2_dir, model_dir, source, tmp_path
) -> None:
    """An export, or a model directory once cached, decodes with no torch in the process: what
    makes one line start in the time CTranslate2's own API takes (BENCHMARKS.md)."""
    import os
    import subprocess

    imports = "import sys, ctranslate2; print('torch' in sys.modules)"
    alone = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True)
    if alone.stdout.strip() != "False":
        pytest.skip("this CTranslate2 imports torch itself (before OpenNMT/CTranslate2#2080)")

    def run(command: str, *argv: str) -> str:
        io = ["-i", str(source), "-o", str(tmp_path / "out.txt")] if command == "translate" else []
        done = subprocess.run(
            [sys.executable, "-c", NO_TORCH, command, *argv, *io, *FAST],
            capture_output=True,
            text=True,
            env=os.environ | {"AIAYN_CT2_CACHE": str(tmp_path / "cache")},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr.splitlines()[-1]  # whether torch was imported

    assert run("translate", "-m", str(ct2_dir)) == "False"
    assert run("translate", "-m", str(model_dir), "--backend", "ctranslate2") == "True"  # converts
    assert run("translate", "-m", str(model_dir), "--backend", "ctranslate2") == "False"
    text = ["--src", str(source), "--ref", str(source), "-o", str(tmp_path / "hyp.txt")]
    assert run("evaluate", "-m", str(ct2_dir), *text) == "False"


def test_ctranslate2_refuses_alignments_gnmt_and_other_stopping_rules(
    ct2_dir, model_dir, source, capsys
) -> None:
    argv = ["translate", "-m", str(ct2_dir), "-i", str(source), *FAST]
    assert main([*argv, "--alignment"]) == 2
    err = capsys.readouterr().err
    assert "--alignment" in err and "CTranslate2" in err and "Traceback" not in err
    assert main([*argv, "--length-penalty-kind", "gnmt"]) == 2
    assert "length_penalty_kind='power'" in capsys.readouterr().err
    for rule in ("exact", "heuristic"):  # CTranslate2 stops by its own rule, "finished"
        assert main([*argv, "--stopping", rule]) == 2
        err = capsys.readouterr().err
        assert f"--stopping {rule} is aiayn's search's" in err and len(err.splitlines()) == 1
    assert translate(ct2_dir, source, "--stopping", "finished") == translate(ct2_dir, source)
    assert main([*argv, "--backend", "pytorch"]) == 2
    assert "is a CTranslate2 export" in capsys.readouterr().err
    assert main([*argv, "--int8"]) == 2
    assert "--compute-type int8" in capsys.readouterr().err
    assert main([*argv, "--no-onednn"]) == 2
    assert "--no-onednn is PyTorch's" in capsys.readouterr().err
    plain = ["translate", "-m", str(model_dir), "-i", str(source), *FAST]
    assert main([*plain, "--compute-type", "int8"]) == 2
    assert "--backend ctranslate2" in capsys.readouterr().err


def test_commands_that_need_pytorch_refuse_an_export(ct2_dir, source, capsys) -> None:
    argv = ["score", "-m", str(ct2_dir), "--src", str(source), "--tgt", str(source)]
    assert main(argv) == 2
    assert "needs the aiayn model directory" in capsys.readouterr().err


def test_quantization_is_stored(ct2_dir, model_dir, source) -> None:
    out = export(model_dir, "ctranslate2", model_dir.parent / "ct2-int8", "--quantization", "int8")
    assert '"quantization": "int8"' in (out / "aiayn.json").read_text()
    assert len(translate(out, source, "--beam-size", "1")) == len(SENTENCES)


# -- ONNX, Hugging Face -----------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--beam-size", "1"], ["--beam-size", "4"]], ids=["1", "4"])
def test_an_onnx_export_translates_as_pytorch(model_dir, source, flags) -> None:
    pytest.importorskip("onnxruntime", reason="optional: pip install -e '.[export]'")
    pytest.importorskip("onnxscript", reason="optional: pip install -e '.[export]'")
    out = model_dir.parent / "onnx"
    if not out.exists():
        export(model_dir, "onnx", out)
    assert translate(out, source, *flags) == translate(model_dir, source, *flags)


def test_an_hf_export_imported_back_translates_identically(model_dir, source, tmp_path) -> None:
    pytest.importorskip("transformers", reason="optional: pip install -e '.[export]'")
    hf = export(model_dir, "hf", tmp_path / "hf")
    assert main(["import", str(hf), "-o", str(tmp_path / "back")]) == 0
    for flags in (["--beam-size", "1"], []):
        back = translate(tmp_path / "back", source, *flags)
        assert back == translate(model_dir, source, *flags)


# -- -o and flag checks -----------------------------------------------------------------------


def test_output_with_a_foreign_file_is_refused_and_the_file_kept(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for argv in (
        ["export", str(model_dir), "--to", "ctranslate2", "-o", str(out)],
        ["export", str(model_dir), "--to", "onnx", "-o", str(out)],
        ["import", str(model_dir), "-o", str(out)],
    ):
        assert main(argv) == 2
        assert "notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def test_an_earlier_export_of_the_same_kind_is_replaced(ct2_dir, model_dir, tmp_path, capsys):
    out = export(model_dir, "ctranslate2", tmp_path / "again")
    export(model_dir, "ctranslate2", out, "--quantization", "int16")
    assert '"quantization": "int16"' in (out / "aiayn.json").read_text()
    assert main(["export", str(model_dir), "--to", "onnx", "-o", str(out)]) == 2
    assert "holds a CTranslate2 export, not an ONNX export" in capsys.readouterr().err
    assert (out / "model.bin").is_file()


def test_format_specific_flags_are_refused_for_other_formats(model_dir, tmp_path, capsys):
    out = str(tmp_path / "x")
    assert main(["export", str(model_dir), "--to", "hf", "-o", out, "--quantization", "int8"]) == 2
    assert "--quantization is for --to ctranslate2" in capsys.readouterr().err
    assert main(["export", str(model_dir), "--to", "ctranslate2", "-o", out, "--opset", "17"]) == 2
    assert "--opset is for --to onnx" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_missing_runtime_is_the_install_line(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed
    assert main(["export", str(model_dir), "--to", "ctranslate2", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[export]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_the_cli_lists_ctranslate2s_quantizations() -> None:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    from aiayn.cli.interop import QUANTIZATIONS
    from aiayn.interop import ctranslate2

    assert QUANTIZATIONS == ctranslate2.QUANTIZATIONS


def test_serve_on_ctranslate2_translates_and_refuses_attention(ct2_dir, model_dir) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from aiayn.cli import build_parser
    from aiayn.cli.common import load_translator, search_options
    from aiayn.serve import Decoding, ServerSettings, create_app

    args = build_parser().parse_args(["serve", "-m", str(model_dir), "--backend", "ctranslate2"])
    translator = load_translator(args)
    decoding = Decoding(**dataclasses.asdict(search_options(args)))
    assert decoding.length_penalty_kind == "power"
    expected = translator.translate(TEXTS, options=search_options(args))
    with TestClient(create_app(translator, ServerSettings(decoding=decoding))) as client:
        answer = client.post("/translate", json={"texts": TEXTS})
        assert answer.status_code == 200, answer.text
        assert [t["text"] for t in answer.json()["translations"]] == [r.text for r in expected]
        refused = client.post("/translate", json={"text": "hello", "return_attention": True})
        assert refused.status_code == 422
        assert "no attention maps" in refused.json()["error"]
        assert client.get("/").status_code == 200


def test_an_hf_directory_with_a_corrupt_json_file_is_one_line_naming_it(tmp_path, capsys):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "marian",', encoding="utf-8")  # cut short
    assert main(["import", str(hf), "-o", str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn import: error: {hf / 'config.json'}: not valid JSON: "), err
    assert err.count("\n") == 1
    assert not (tmp_path / "imported").exists()


def test_an_onnx_export_with_a_corrupt_aiayn_json_is_one_line_naming_it(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    export_dir = tmp_path / "onnx"
    export_dir.mkdir()
    (export_dir / "decoder_step.onnx").write_bytes(b"")  # what marks an ONNX export
    (export_dir / "aiayn.json").write_text('{"config": ', encoding="utf-8")  # cut short
    source = tmp_path / "in.txt"
    source.write_text("hello\n", encoding="utf-8")
    assert main(["translate", "-m", str(export_dir), "-i", str(source), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn translate: error: {export_dir / 'aiayn.json'} is corrupt: "), err
    assert err.count("\n") == 1


def test_a_damaged_export_or_a_compute_type_ctranslate2_refuses_is_one_line(
    ct2_dir, model_dir, source, tmp_path, capsys
):
    """Old CLI: CTranslate2's ValueError and RuntimeError, and onnxruntime's errors, came out
    as tracebacks of a bug in aiayn."""
    argv = ["translate", "-i", str(source), "-o", str(tmp_path / "out.txt"), *FAST]
    assert main([*argv, "-m", str(ct2_dir), "--compute-type", "bogus"]) == 2
    assert "error: compute_type ('bogus') on cpu: " in capsys.readouterr().err
    damaged = tmp_path / "ct2"
    shutil.copytree(ct2_dir, damaged)
    with (damaged / "model.bin").open("r+b") as weights:
        weights.truncate(1000)
    assert main([*argv, "-m", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert f"error: {damaged}: CTranslate2 cannot load this export (" in err, err
    assert err.count("\n") == 1
    pytest.importorskip("onnxruntime")
    onnx_dir = tmp_path / "onnx"  # an ONNX export's aiayn.json, and graphs that are not
    onnx_dir.mkdir()
    aiayn = json.loads((ct2_dir / "aiayn.json").read_text(encoding="utf-8"))
    (onnx_dir / "aiayn.json").write_text(json.dumps({**aiayn, "positions": 64}), encoding="utf-8")
    for name in ("encoder.onnx", "decoder_step.onnx"):
        (onnx_dir / name).write_bytes(b"not a graph")
    assert main([*argv, "-m", str(onnx_dir)]) == 2
    err = capsys.readouterr().err
    assert f"error: {onnx_dir / 'encoder.onnx'}: onnxruntime cannot load it (" in err, err
    assert "a damaged export (write it again" in err


def test_outputs_longer_than_a_ctranslate2_exports_positions_are_refused(ct2_dir, source, capsys):
    """Old CLI: CTranslate2's RuntimeError ("No position encodings are defined for positions
    >= ...") as a bug's traceback, where the ONNX export refused in one line."""
    argv = ["translate", "-m", str(ct2_dir), "-i", str(source), *FAST, "--max-len-b", "100000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the export's positional table has" in err and "lower max_len_a/max_len_b" in err


def test_an_opset_the_exporter_does_not_write_is_refused(model_dir, tmp_path, capsys, monkeypatch):
    """Old CLI: --opset 99 wrote opset-18 graphs and an aiayn.json saying 99, exit 0. (PyTorch's
    exporter, which takes seconds, is played by one that writes what it wrote: an opset-18
    graph whatever it is asked.)"""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")

    def exporter(module, args, path, **kwargs):
        graph = onnx.helper.make_graph([], "g", [], [])
        opset = onnx.helper.make_opsetid("", 18)
        onnx.save(onnx.helper.make_model(graph, opset_imports=[opset]), path)

    monkeypatch.setattr(torch.onnx, "export", exporter)
    out = tmp_path / "onnx"
    assert main(["export", str(model_dir), "--to", "onnx", "--opset", "99", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "opset (99): PyTorch's exporter wrote the graphs in opset 18" in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
