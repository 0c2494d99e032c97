"""What several commands share: loading the model (`-m`, device, threads, int8/bf16, the
CTranslate2 backend), the search flags, and the progress bar."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.cli.flags import add_dataclass_flags, dataclass_from_args, integer
from aiayn.decode.backends import export_kind  # no torch: --help stays fast
from aiayn.decode.options import DecodingOptions
from aiayn.errors import UserValueError
from aiayn.parts import system_scratch

if TYPE_CHECKING:
    from aiayn.decode.translator import Translator

logger = logging.getLogger("aiayn")

# Flags of `DecodingOptions` fields: the search ones are shared by translate, evaluate, serve
# and attention; the sampling ones are translate's (with its own --n-best).
SEARCH_FIELDS = (
    "beam_size",
    "length_penalty",
    "length_penalty_kind",
    "max_len_a",
    "max_len_b",
    "min_len",
    "stopping",
    "shortlist",
)
SAMPLING_FIELDS = ("sampling", "temperature", "top_k", "top_p")

BACKENDS = ("pytorch", "ctranslate2")


def add_search_options(
    p: argparse.ArgumentParser,
    *,
    ensemble: bool = False,
    backend: bool = False,
    workers: bool = False,
) -> None:
    """Model loading and beam search flags shared by `translate`, `evaluate`, `serve` and
    `attention`; with ``ensemble``, -m may be repeated; with ``backend``, the model may run on
    CTranslate2; with ``workers``, batches may be decoded in parallel processes."""
    add_model_dir_flag(p, ensemble=ensemble)
    g = p.add_argument_group("search (defaults are the paper's, §6.1)")
    add_dataclass_flags(g, DecodingOptions, only=SEARCH_FIELDS)
    add_model_flags(p, backend=backend, workers=workers)


def add_model_dir_flag(p: argparse.ArgumentParser, *, ensemble: bool) -> None:
    if ensemble:
        p.add_argument(
            "-m",
            "--model-dir",
            required=True,
            action="append",
            help="model directory (or run directory); repeat for the ensemble of "
            "several models trained with the same tokenizer: the mean of their probabilities "
            "at every step",
        )
    else:
        p.add_argument(
            "-m", "--model-dir", required=True, help="model directory (or run directory)"
        )


def _positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_model_flags(
    p: argparse.ArgumentParser, *, backend: bool = False, workers: bool = False
) -> None:
    """How `load_translator` loads and runs the model: batch budget, device, threads, int8,
    with ``backend`` the runtime (PyTorch or CTranslate2), with ``workers`` how many batches
    are decoded at once."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="batch budget: padded source tokens x beam size; for score, padded tokens "
        f"(default {CPU_MAX_TOKENS} on a CPU, {GPU_MAX_TOKENS} on a GPU)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto)")
    g.add_argument(
        "--threads",
        type=integer,
        help="CPU threads; 0 = PyTorch's default, one per core (default: the cores other work "
        "leaves idle, 1 to 4: the 1-minute load average, at most the tasks runnable now; on "
        "cores busy with other work, PyTorch's threads wait for each other and decoding gets "
        "many times slower)",
    )
    if workers:
        g.add_argument(
            "--workers",
            type=_positive_int,
            help="CPU: decode this many batches at once, sharing --threads among them, with "
            "the outputs of one: PyTorch (Linux) in processes forked from this one, "
            "CTranslate2 on as many translators of its own (inter_threads) (default: one per "
            "thread, so each runs one thread; PyTorch forks only when the input makes more "
            "than one batch; 1 on a GPU, for an ONNX export, and for sampling)",
        )
    g.add_argument(
        "--int8",
        action="store_true",
        help="int8 dynamic quantization of the linear layers (CPU only; faster, see "
        "BENCHMARKS.md for the effect on BLEU)",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="run the model in bfloat16 (GPUs, and CPUs with native bf16: AVX512-BF16, AMX; "
        "it pays for wide models, such as base, more than for narrow ones; slightly different "
        "outputs: see BENCHMARKS.md)",
    )
    onednn = g.add_mutually_exclusive_group()
    onednn.add_argument(
        "--onednn",
        dest="onednn",
        action="store_true",
        default=None,
        help="float32 on an x86-64 CPU: run every linear layer on oneDNN's pre-packed weights "
        "(same function; see BENCHMARKS.md; default: on x86-64 CPUs other than Intel's, the "
        "pre-softmax projection on oneDNN's and the other layers on MKL's, the fastest mix "
        "measured on an AMD EPYC)",
    )
    onednn.add_argument(
        "--no-onednn",
        dest="onednn",
        action="store_false",
        default=None,
        help="float32 on an x86-64 CPU: MKL's matrix products (PyTorch's own) on weights "
        "stored transposed for every linear layer, none on oneDNN's (default on Intel CPUs)",
    )
    if not backend:
        return
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        help="run the model with PyTorch or CTranslate2 (pip install -e '.[export]'). "
        "ctranslate2 takes a directory written by 'aiayn export --to ctranslate2', or converts "
        "an aiayn model directory the first time and keeps the export in a cache "
        "(~/.cache/aiayn/ctranslate2; AIAYN_CT2_CACHE=DIR to move it); it returns no attention "
        "maps, ranks beam hypotheses by log_prob / |Y|^alpha (--length-penalty-kind power, "
        "its default here) and stops beam search by its own rule (--stopping finished, the only "
        "one it takes). One CTranslate2 call per batch: an output longer than its sentence's "
        "length limit is cut to it afterwards, where pytorch's search ends it there, so at "
        "the limit beam search can pick another output. (default: ctranslate2 for a "
        "CTranslate2 export, else pytorch)",
    )
    g.add_argument(
        "--compute-type",
        help="CTranslate2's compute type: int8, int8_float32, int16, float16, bfloat16, "
        "float32, ... (default: as the export stores the weights)",
    )


def backend_of(args: argparse.Namespace) -> str:
    """The backend the flags ask for: --backend, or what -m holds."""
    dirs = args.model_dir if isinstance(args.model_dir, list) else [args.model_dir]
    backend = getattr(args, "backend", None)
    exported = [d for d in dirs if export_kind(d) == "ctranslate2"]
    if backend is None:
        if exported and not hasattr(args, "backend"):
            raise UserValueError(
                f"{exported[0]} is a CTranslate2 export; this command needs the aiayn model "
                "directory it was exported from"
            )
        backend = "ctranslate2" if exported else "pytorch"
    if backend == "pytorch" and exported:
        raise UserValueError(
            f"{exported[0]} is a CTranslate2 export: leave out --backend pytorch, or give the "
            "aiayn model directory"
        )
    if backend == "pytorch" and getattr(args, "compute_type", None):
        raise UserValueError("--compute-type is CTranslate2's: use it with --backend ctranslate2")
    return backend


CT2_GPU_FALLBACK = "CTranslate2 cannot use the GPU (%s): decoding on the CPU"
"""The warning of `--backend ctranslate2 --device auto` where CTranslate2 counts a GPU it cannot
compute on (bench/gpu_check.py reads it to say where a run decoded)."""
CPU_MAX_TOKENS = 4096
GPU_MAX_TOKENS = 16384
"""`--max-tokens` when not given: on a GPU a larger batch budget pays (fewer, fuller batches,
the same outputs). 16384, not more: a budget a smaller GPU holds with a `big` model too."""


def max_tokens(args: argparse.Namespace, on_cpu: bool) -> int:
    """The batch budget: ``--max-tokens``, else `CPU_MAX_TOKENS` or `GPU_MAX_TOKENS`."""
    if args.max_tokens is not None:
        return args.max_tokens
    return CPU_MAX_TOKENS if on_cpu else GPU_MAX_TOKENS


def threads_of(args: argparse.Namespace, on_cpu: bool) -> int:
    """``--threads``, or the cores other work leaves idle (`runtime.decoding_threads`); a number
    given by hand beyond those, on a CPU, is taken with a warning
    (`runtime.threads_beyond_free_cores`)."""
    from aiayn import runtime

    if args.threads is None:
        return runtime.decoding_threads()
    if on_cpu and (crowded := runtime.threads_beyond_free_cores(args.threads)):
        logger.warning(crowded)
    return args.threads


def load_translator(args: argparse.Namespace) -> Translator:
    """The translator the flags describe: PyTorch (one model or an ensemble, or an ONNX export)
    or CTranslate2.

    The process is the command's, so its settings are made here, not by the translator
    (`runtime.configure`): the allocator's (freed memory kept for reuse), and the threads:
    PyTorch's, or for an ONNX export onnxruntime's, PyTorch keeping one for the search's small
    operators (with both on every core, PyTorch's spin-waiting OpenMP threads take the cores
    from onnxruntime's and slow it down).
    """
    if backend_of(args) == "ctranslate2":
        return _load_ct2_translator(args)
    import torch

    from aiayn import runtime
    from aiayn.decode.translator import Translator

    int8 = getattr(args, "int8", False)
    device = runtime.checked_device(args.device, cpu_only=int8)  # a name it lacks: one line
    on_cpu = device.type == "cpu"
    dirs = args.model_dir if isinstance(args.model_dir, list) else [args.model_dir]
    onnx = len(dirs) == 1 and export_kind(dirs[0]) == "onnx"
    threads = threads_of(args, on_cpu)
    total = threads or torch.get_num_threads()  # 0: PyTorch's default
    workers = getattr(args, "workers", 1)  # 1 for the commands without --workers (serve)
    if workers is None:  # one worker per thread where workers can run
        from aiayn.decode.workers import fork_missing

        workers = total if on_cpu and not onnx and fork_missing() is None else 1
    worker_threads = max(1, total // max(workers, 1))
    if on_cpu and args.threads is None:
        if workers > 1:
            logger.info(
                "decoding in up to %d worker processes of %d CPU thread(s) each; --workers, "
                "--threads to change",
                workers,
                worker_threads,
            )
        else:
            logger.info("decoding with %d CPU thread(s); --threads to change", threads)
    # freed tensors' memory kept for the next step's (`runtime.keep_freed_memory`)
    runtime.configure(threads=min(threads, 1) if onnx else threads, reuse_freed_memory=True)
    return Translator(
        args.model_dir,
        device=device,
        max_tokens=max_tokens(args, on_cpu),
        threads=threads if onnx else 0,
        int8=int8,
        bf16=getattr(args, "bf16", False),
        onednn=getattr(args, "onednn", None),
        workers=workers,
        worker_threads=worker_threads,
    )


def _load_ct2_translator(args: argparse.Namespace) -> Translator:
    """A `Translator` over -m's CTranslate2 export, or an aiayn model directory's export from
    the cache (`aiayn.interop.ctranslate2.cached_export`: converted the first time only).

    Nothing here imports torch once the export exists, so the command starts in the time
    CTranslate2's own API does. Converting does import it; PyTorch then gets one thread first,
    so that it never starts its OpenMP threads: once they exist beside CTranslate2's, the
    process has more OpenMP threads than cores and CTranslate2 decodes slower for as long as it
    runs (docs/interop.md, "CTranslate2 beside PyTorch").
    """
    from aiayn import runtime
    from aiayn.extras import require

    require("export", "ctranslate2", needed_by="--backend ctranslate2")  # or one line naming it
    from aiayn.decode.backends.ctranslate2 import DEVICE_ERROR, cuda_available
    from aiayn.decode.translator import Translator
    from aiayn.errors import CorruptCheckpointError, first_line
    from aiayn.interop.ctranslate2 import (
        cached_export,
        drop_cached_export,
        export_ctranslate2,
        find_cached_export,
    )

    dirs = args.model_dir if isinstance(args.model_dir, list) else [args.model_dir]
    if len(dirs) > 1:
        raise UserValueError("--backend ctranslate2 runs one model: give -m once (no ensembles)")
    if args.int8 or args.bf16:
        flag = "--int8" if args.int8 else "--bf16"
        kind = "int8" if args.int8 else "bfloat16"
        raise UserValueError(f"{flag} is PyTorch's; with CTranslate2 use --compute-type {kind}")
    if getattr(args, "onednn", None) is not None:
        flag = "--onednn" if args.onednn else "--no-onednn"
        raise UserValueError(f"{flag} is PyTorch's: CTranslate2 picks its own CPU kernels")
    device = args.device
    auto = device == "auto"
    if auto:
        device = runtime.auto_device(cuda_available)  # CTranslate2's GPUs, not PyTorch's
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserValueError(
            f"--device {device}: the CTranslate2 backend runs on cpu, cuda, cuda:N or auto"
        )
    if not auto and device != "cpu" and not cuda_available():
        raise UserValueError(f"--device {device}: CTranslate2 sees no CUDA GPU on this machine")

    def options(device: str) -> dict:
        on_cpu = device == "cpu"
        threads = threads_of(args, on_cpu)
        workers = getattr(args, "workers", 1)  # 1 for the commands without --workers (serve)
        if workers is None:  # on a CPU one translator per thread, as PyTorch's workers
            workers = max(threads, 1) if on_cpu else 1
        if on_cpu and args.threads is None:
            if workers > 1:
                logger.info(
                    "decoding up to %d batches at once (CTranslate2's inter_threads), %d CPU "
                    "thread(s) each; --workers, --threads to change",
                    workers,
                    max(1, threads // workers),
                )
            else:
                logger.info("decoding with %d CPU thread(s); --threads to change", threads)
        return dict(
            device=device,
            compute_type=args.compute_type,
            max_tokens=max_tokens(args, on_cpu),
            threads=threads,
            workers=workers,
        )

    def load(export: Path) -> Translator:
        """The translator on `device`; with --device auto, on the CPU where CTranslate2 counts
        a GPU it cannot use (its wheel built for another CUDA than the machine's)."""
        try:
            return Translator(export, **options(device))
        except RuntimeError as error:  # what CTranslate2 raises for a GPU it cannot compute on
            reason = first_line(error)
            if device == "cpu" or not DEVICE_ERROR.search(reason):
                raise  # not the device's: a broken export is the same error on any device
            if not auto:
                raise UserValueError(
                    f"--device {device}: CTranslate2 cannot decode there ({reason})"
                ) from None
            logger.warning(CT2_GPU_FALLBACK, reason)
            return Translator(export, **options("cpu"))

    model_dir = Path(dirs[0])
    if export_kind(model_dir) == "ctranslate2":
        return load(model_dir)
    export = find_cached_export(model_dir)
    translator = None
    if export is not None:
        try:
            translator = load(export)
        except CorruptCheckpointError as error:  # damaged in the cache: converted again
            logger.warning("%s; converting %s again", error, model_dir)
            drop_cached_export(export)
    if translator is None:
        runtime.configure(threads=1)  # before the conversion's PyTorch work
        export = cached_export(model_dir)
        if export is not None:
            translator = load(export)
    if translator is None:  # nothing to key a cache by, or no cache to write: a temporary export
        with system_scratch("aiayn-ct2-export") as tmp:
            logger.info(
                "converting %s to CTranslate2 (to skip this, run once: aiayn export %s --to "
                "ctranslate2 -o DIR, and pass -m DIR)",
                model_dir,
                model_dir,
            )
            export_ctranslate2(model_dir, tmp / "model")
            translator = load(tmp / "model")
    translator.model_dirs = [model_dir]  # what the user named, not the export
    translator.model_dir = model_dir
    return translator


def search_options(args: argparse.Namespace) -> DecodingOptions:
    """The `DecodingOptions` of the flags given (every field a command has no flag for keeps
    its default). CTranslate2 stops a sentence's search by its own rule, --stopping finished:
    any other --stopping is refused (and its translator refuses --length-penalty-kind gnmt)."""
    options = dataclass_from_args(DecodingOptions, args)
    if backend_of(args) != "ctranslate2":
        return options
    stopping = getattr(args, "stopping", None)
    if stopping not in (None, "finished"):
        raise UserValueError(
            f"--stopping {stopping} is aiayn's search's: CTranslate2 ends a sentence's beam "
            "search at beam-size finished hypotheses (--stopping finished)"
        )
    return options


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (one is drawn on stderr, with an ETA, when it is a terminal)",
    )


@contextlib.contextmanager
def progress_bar(wanted: bool, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr counting lines, if ``wanted`` and stderr is a terminal: yields
    its ``update`` (or None). ``total`` None counts without an ETA. Log records are written
    above the bar instead of through it while it is open."""
    if not (wanted and sys.stderr.isatty()):
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with (
        logging_redirect_tqdm(),
        tqdm(total=total, unit="line", file=sys.stderr, dynamic_ncols=True) as bar,
    ):
        yield bar.update
