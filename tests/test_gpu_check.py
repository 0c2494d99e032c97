"""bench/gpu_check.py (`make gpu-check`) where there is no GPU, as in CI: one line and exit 0,
after a CPU smoke run of every stage's code, so that the script a lent GPU will run has not
rotted; arguments and missing modules are refused in one line before anything runs; what a GPU
run measures becomes the records BENCHMARKS.md is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    """`make gpu-check`'s command: the script under this tree's src/."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, gpu_check measures")
def test_without_cuda_it_says_so_in_one_line_and_exits_0_after_a_cpu_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "report"
    result = gpu_check("--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"gpu_check: no CUDA device here (torch {torch.__version__})")
    assert "nothing measured; the CPU smoke of every stage passed" in line

    report = json.loads((out / "gpu-check.json").read_text(encoding="utf-8"))
    assert report["smoke"] is True
    stages = report["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {
        "tests": "skipped",
        "peak": "ok",
        "train": "ok",
        "torchrun": "ok",
        "job": "skipped",
    }
    rows = stages["train"]["rows"]
    graphs = "aiayn --static-shapes --compile"  # on the CPU, fixed shapes without graphs
    assert [(r["model"], r["precision"]) for r in rows] == [
        ("aiayn", "bf16"),
        (graphs, "bf16"),
        ("nn.Transformer", "bf16"),
        ("aiayn", "fp32"),
        ("nn.Transformer", "fp32"),
    ]
    assert all(r["tokens_per_s"] > 0 and r["target_tokens_per_update"] > 0 for r in rows)
    # The same sentences, batched their way: the fixed shapes' updates hold about as many.
    assert rows[1]["target_tokens_per_update"] == pytest.approx(
        rows[0]["target_tokens_per_update"], rel=0.5
    )
    assert stages["train"]["paper_run"]["hours_on_this_gpu"] > 0
    # The DDP worker wrapped the model (over gloo here) and matched the plain run.
    assert stages["torchrun"]["ddp"] is True
    assert stages["torchrun"]["max_loss_difference"] <= 1e-3
    assert (out / "torchrun-ddp.log").is_file()
    assert not (out / "records.jsonl").exists()  # a smoke run measures nothing
    # What a GPU run would record of these stages: the training table, the checks in its notes.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_check import records

    [trained] = records(report)
    assert [(r["model"], r["precision"]) for r in trained["rows"]][:3] == [
        ("aiayn", "bf16"), (graphs, "bf16"), ("nn.Transformer", "bf16")
    ]  # fmt: skip
    assert trained["notes"][0].startswith("Matrix products 64³, TFLOP/s: bf16 ")
    assert trained["notes"][1] == "`pytest tests/cuda`: skipped, not run in the CPU smoke."
    assert trained["notes"][2].startswith("torchrun and DDP over NCCL: ok, max |Δloss| ")
    assert trained["notes"][3].startswith("Each update ") and "≤ 128 tokens" in trained["notes"][3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: --out"),
        (["--out", "x", "--budget", "0"], "--budget (0.0) must be >= 1"),
        (["--out", "x", "--warmup", "-1"], "--warmup (-1) must be >= 0"),
        (["--out", "x", "--device", "cpu"], "--device ('cpu') must be cuda or cuda:N"),
        (["--out", "x", "--stages", "everything"], "invalid choice: 'everything'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.chdir(tmp_path)
    import gpu_check

    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(args)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_missing_module_is_named_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    monkeypatch.setitem(gpu_check.REQUIRED, "no_such_module_here", "pip: no-such-module")
    assert gpu_check.main(["--out", str(tmp_path / "report")]) == 2
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("gpu_check: missing Python module(s): no_such_module_here (pip: ")
    assert "--no-index" in line
    assert not (tmp_path / "report").exists()


def printed(report: dict, out: Path, capsys: pytest.CaptureFixture) -> str:
    """What a GPU run prints after its stages (a line per stage, then each record's table as
    BENCHMARKS.md shows it, its notes under it), its records written to OUT/records.jsonl."""
    import argparse

    import gpu_check

    capsys.readouterr()
    gpu_check.finish(argparse.Namespace(out=out, record=False), report)
    written = (out / "records.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["task"] for line in written] == ["gpu"] * len(written)
    return capsys.readouterr().out.strip()


def test_the_job_stage_reports_whole_commands_in_a_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """The job stage (`aiayn demo`, then `aiayn translate` per precision) runs on a GPU only;
    its record and what is printed of it are checked here."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    job = {
        "status": "ok",
        "demo_s": 61.2,
        "demo_exact_match": 1.0,
        "sentences": 500,
        "translate": [
            {"precision": "fp32", "seconds": [5.0, 4.0], "median_s": 4.5, "exact_match": 1.0},
            {"precision": "bf16", "seconds": [5.5], "median_s": 5.5, "exact_match": 0.998},
        ],
    }
    text = printed({"stages": {"job": job}}, tmp_path, capsys)
    assert "job: ok\n" in text
    assert "- `aiayn demo` 61 s, held-out exact match 100.0%." in text
    assert "| fp32 | 4.5 (5.0, 4.0) | 100.0% |" in text
    assert "| bf16 | 5.5 | 99.8% |" in text
    failed = {"status": "failed", "demo_s": 61.2, "error": "aiayn translate: exit 1 (x.log)"}
    assert (
        printed({"stages": {"job": failed}}, tmp_path, capsys)
        == "job: failed, aiayn translate: exit 1 (x.log)"
    )
    skipped = {"status": "skipped", "summary": "not run: aiayn demo needs num2words"}
    text = printed({"stages": {"job": skipped}}, tmp_path, capsys)
    assert text == "job: skipped, not run: aiayn demo needs num2words"


def test_the_job_stage_reports_ctranslate2_s_device_and_fallback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """With ctranslate2 on the GPU machine, the job stage runs `--backend ctranslate2
    --device cuda` once (decoding, or one line naming why not) and `--device auto` in the
    rounds, saying where it ran (the CLI's fallback warning read from its output)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check
    from aiayn.cli.common import CT2_GPU_FALLBACK  # the warning the CLI logs

    reason = "Library libcublas.so.12 is not found or cannot be loaded"
    warning = "12:00:00 WARNING aiayn: " + CT2_GPU_FALLBACK % reason
    match = gpu_check.ct2_fallback().search(warning)
    assert match is not None and match.group(1) == reason

    refused = f"aiayn translate: error: --device cuda: CTranslate2 cannot decode there ({reason})\n"
    probe = gpu_check._ct2_device_probe("cuda", 2, refused, 2.0)
    assert probe["status"] == "ok" and probe["exit"] == 2
    assert probe["summary"].startswith("exit 2, one line: aiayn translate: error: --device cuda")
    traceback = "Traceback (most recent call last):\n  ...\nRuntimeError: CTranslate2 boom\n"
    assert gpu_check._ct2_device_probe("cuda", 1, traceback, 2.0)["status"] == "failed"
    assert gpu_check._ct2_device_probe("cuda", None, "", 120.0)["status"] == "failed"
    decoded = gpu_check._ct2_device_probe("cuda", 0, "", 3.0)
    assert decoded["status"] == "ok" and decoded["summary"].startswith("decoded on cuda")

    job = {
        "status": "ok",
        "demo_s": 61.2,
        "sentences": 500,
        "ctranslate2_device": {"device": "cuda:1", **probe},
        "translate": [
            {"precision": "fp32", "seconds": [5.0], "median_s": 5.0, "exact_match": 1.0},
            {
                "precision": gpu_check.CT2_ROW,
                "seconds": [3.0, 2.0],
                "median_s": 2.5,
                "exact_match": 1.0,
                "ran_on": "the CPU (Library libcublas.so.12 is not found)",
            },
        ],
    }
    text = printed({"stages": {"job": job}}, tmp_path, capsys)
    assert (
        "| CTranslate2 (--backend ctranslate2 --device auto), on the CPU (Library "
        "libcublas.so.12 is not found) | 2.5 (3.0, 2.0) | 100.0% |"
    ) in text
    assert "- `aiayn translate --backend ctranslate2 --device cuda:1`: ok, exit 2" in text
    # A run that fails after others were measured keeps their rows, and says what failed.
    failed = {**job, "status": "failed", "error": "aiayn translate --bf16: exit 1 (translate.log)"}
    text = printed({"stages": {"job": failed}}, tmp_path, capsys)
    assert "| fp32 | 5.0 | 100.0% |" in text
    assert "- The user's job: failed, aiayn translate --bf16: exit 1 (translate.log)." in text


def test_the_job_stage_reads_exact_match_from_the_demo_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check
    from aiayn.demo import DemoResult, format_report

    report = format_report(
        DemoResult(
            model_dir=tmp_path, exact_match=0.998, chrf=99.9, chrf_signature="chrF2",
            small_wrong=[], small_total=101, small_weight=8, minutes=1.0, examples=[],
        )
    )  # fmt: skip
    match = gpu_check.DEMO_EXACT_MATCH.search(report)
    assert match is not None and float(match.group(1)) == 99.8


def test_the_training_and_job_tables_become_records_for_the_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU run's records (OUT/records.jsonl) carry the tables BENCHMARKS.md shows, in the
    columns bench/page.py renders."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check
    import runner

    train = {
        "status": "ok", "preset": "base", "vocab": 37000, "max_tokens": 12500,
        "batches_per_update": 2, "paper_run": {"hours_on_this_gpu": 5.4},
        "rows": [
            {"model": "aiayn", "precision": "bf16", "target_tokens_per_update": 17659,
             "median_update_s": 0.1351, "tokens_per_s": 129087.4,
             "tokens_per_s_range": [91242.1, 157368.0], "tflops": 56.6, "peak_memory_gib": 4.31,
             "mfu": 0.075, "busy": 0.412},
            {"model": "nn.Transformer", "precision": "bf16", "error": "not measured: out of time"},
        ],
    }  # fmt: skip
    job = {
        "status": "ok", "demo_s": 41.2, "sentences": 500,
        "translate": [{"precision": "fp32", "seconds": [5.72, 4.71], "median_s": 5.2,
                       "exact_match": 1.0}],
    }  # fmt: skip
    report = {"smoke": False, "machine": {}, "seconds": 1.0, "stages": {"train": train, "job": job}}
    trained, translated = gpu_check.records(report)
    assert trained["task"] == translated["task"] == "gpu"
    assert trained["table"] == "training `base`, updates of ~17,659 target tokens"
    assert trained["rows"] == [
        {"model": "aiayn", "precision": "bf16", "tokens_per_update": 17659, "update_s": 0.135,
         "tokens_per_s": 129087, "range": "91242–157368", "peak_gib": 4.3, "tflops": 56.6,
         "mfu": "8%", "busy": "41%"},
        {"model": "nn.Transformer", "precision": "bf16",
         "tokens_per_update": "not measured: out of time"},
    ]  # fmt: skip
    assert "129,087 target tokens/s" in trained["summary"] and "5.4 h" in trained["summary"]
    assert translated["rows"] == [
        {
            "decoding": "fp32",
            "wall_s": {"median": 5.2, "rounds": [5.7, 4.7]},
            "exact_match": "100.0%",
        }
    ]
    assert translated["command"] == "make gpu-check OUT=DIR"
    assert "| fp32 | 5.2 (5.7, 4.7) | 100.0% |" in runner.markdown_table(
        translated["columns"], translated["rows"]
    )


def test_how_busy_the_gpu_is_counts_overlapping_kernels_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    assert gpu_check.covered([]) == 0.0
    assert gpu_check.covered([(0.0, 2.0), (5.0, 6.0)]) == 3.0
    assert gpu_check.covered([(5.0, 6.0), (0.0, 4.0), (1.0, 2.0), (3.0, 5.5)]) == 6.0
    # On a CPU there is no GPU to be busy: the column stays empty.
    assert gpu_check.device_busy(torch.device("cpu"), lambda g, s: 0, [[0]], 10) is None
