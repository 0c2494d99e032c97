"""bench/bench_cpu_time.py groups perf samples by what ran: the groups BENCHMARKS.md quotes."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_cpu_time(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_cpu_time

    return bench_cpu_time


@pytest.mark.parametrize(
    ("library", "symbol", "group"),
    [
        ("libtorch_cpu.so", "mkl_blas_def_sgemm_kernel_0_zen", "matrix products (MKL, oneDNN)"),
        ("libtorch_cpu.so", "mkl_blas_def_xsgemv", "matrix products (MKL, oneDNN)"),
        ("[JIT] tid 10293", "0x00007f3d40a1016c", "matrix products (MKL, oneDNN)"),
        ("libtorch_cpu.so", "Sleef_finz_expf8_u10avx2", "softmax, log-softmax, exp"),
        (
            "libctranslate2-a7a60d30.so.4.8.5",
            "ctranslate2::cpu::softmax<(ctranslate2::cpu::CpuIsa)2>",
            "softmax, log-softmax, exp",
        ),
        (
            "libtorch_cpu.so",
            "at::native::AVX2::topk_impl_loop<float, float>",
            "other compute kernels (element-wise, reductions, top-k, norms)",
        ),
        (
            "libctranslate2-a7a60d30.so.4.8.5",
            "ctranslate2::ops::TopK::compute<(ctranslate2::Device)0, float, int>",
            "other compute kernels (element-wise, reductions, top-k, norms)",
        ),
        ("libc.so.6", "__memmove_avx_unaligned_erms", "memory copies (libc)"),
        ("libc.so.6", "_int_malloc", "memory allocation"),
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "Python interpreter"),
        ("libtorch_python.so", "torch::FunctionSignature::parse", "PyTorch's Python bindings"),
        (
            "libtorch_cpu.so",
            "c10::impl::OperatorEntry::lookup",
            "PyTorch's dispatch and tensor bookkeeping",
        ),
        ("libc10.so", "c10::TensorImpl::~TensorImpl", "PyTorch's dispatch and tensor bookkeeping"),
        (
            "libctranslate2-a7a60d30.so.4.8.5",
            "ctranslate2::BeamSearch::search",
            "CTranslate2's own code (other)",
        ),
        ("[kernel.kallsyms]", "exc_page_fault", "operating system (page faults, scheduling)"),
        ("ld-linux-x86-64.so.2", "do_lookup_x", "everything else"),
    ],
)
def test_samples_are_grouped_by_what_ran(
    bench_cpu_time, library: str, symbol: str, group: str
) -> None:
    assert bench_cpu_time.group_of(library, symbol) == group
