"""bench/bench_cpu_time.py groups perf samples by what ran: the groups BENCHMARKS.md quotes."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
OTHER_COMPUTE = "other compute kernels (element-wise, reductions, top-k, norms, concatenation)"
DISPATCH = "PyTorch's dispatch and tensor bookkeeping"


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
            OTHER_COMPUTE,
        ),
        (
            "libctranslate2-a7a60d30.so.4.8.5",
            "ctranslate2::ops::TopK::compute<(ctranslate2::Device)0, float, int>",
            OTHER_COMPUTE,
        ),
        (
            "libc.so.6",
            "__memmove_avx_unaligned_erms",
            "memory copies (libc's memcpy, memmove, memset)",
        ),
        ("libc.so.6", "_int_malloc", "memory allocation"),
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "Python interpreter"),
        ("libtorch_python.so", "torch::FunctionSignature::parse", "PyTorch's Python bindings"),
        (
            "libtorch_cpu.so",
            "c10::impl::OperatorEntry::lookup",
            DISPATCH,
        ),
        ("libc10.so", "c10::TensorImpl::~TensorImpl", DISPATCH),
        ("libtorch_cpu.so", "at::native::expand", DISPATCH),  # not exp
        (
            "libtorch_cpu.so",
            "at::native::(anonymous namespace)::baddbmm_cpu_kernel<float>",
            "matrix products (MKL, oneDNN)",
        ),
        ("libtorch_cpu.so", "at::native::(anonymous namespace)::cat_serial_kernel", OTHER_COMPUTE),
        ("libc.so.6", "__libc_free", "memory allocation"),
        ("libc.so.6", "cfree@GLIBC_2.2.5", "memory allocation"),
        (
            "libtorch_cpu.so",
            "at::native::(anonymous namespace)::LayerNormKernelImpl",
            OTHER_COMPUTE,
        ),
        ("libc.so.6", "_int_memalign", "memory allocation"),
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


def test_a_perf_report_is_read_as_seconds_by_symbol_and_group(bench_cpu_time) -> None:
    report = """\
# Samples: 3K of event 'cpu-clock:ppp'
#
    18.37%          1998  libtorch_cpu.so       [.] mkl_blas_def_sgemm_kernel_0_zen
     2.00%           999  [JIT] tid 10293       [.] 0x00007f3d40a1016c
     1.00%           999  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     0.50%           999  [kernel.kallsyms]     [k] exc_page_fault
"""
    by_symbol = bench_cpu_time.seconds_by_symbol(report)
    assert by_symbol == {
        ("libtorch_cpu.so", "mkl_blas_def_sgemm_kernel_0_zen"): 2.0,
        ("[JIT] tid 10293", "0x00007f3d40a1016c"): 1.0,
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault"): 1.0,
        ("[kernel.kallsyms]", "exc_page_fault"): 1.0,
    }
    assert bench_cpu_time.seconds_by_group(by_symbol) == {
        "matrix products (MKL, oneDNN)": 3.0,
        "Python interpreter": 1.0,
        "operating system (page faults, scheduling)": 1.0,
    }
