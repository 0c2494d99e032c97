"""``aiayn info``, ``train``, ``average`` and ``demo``: models before and during training."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.cli.flags import add_dataclass_flags, dataclass_values, integer, parse_assignments
from aiayn.errors import UserValueError

if TYPE_CHECKING:
    from aiayn.config import TrainConfig

logger = logging.getLogger("aiayn")


def add(sub: argparse._SubParsersAction) -> None:
    _add_info(sub)
    _add_train(sub)
    _add_average(sub)
    _add_demo(sub)


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print a model's architecture and parameter counts")
    p.add_argument("-m", "--model-dir", help="a trained model directory (instead of a preset)")
    p.add_argument(
        "--preset", help="preset name (base, big, small, tiny, demo; default base; not with -m)"
    )
    p.add_argument(
        "--vocab-size", type=integer, help="joint vocabulary size (default 37000; not with -m)"
    )
    p.add_argument("--tgt-vocab-size", type=integer, help="target vocabulary size if not joint")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --set n_heads=16 (repeatable)",
    )
    p.set_defaults(run=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    # No torch: the counts come from the config (`describe.parameter_shapes`).
    from aiayn.cli.describe import describe
    from aiayn.config import preset

    if args.model_dir:
        from aiayn.model_dir import read_model_config, resolve_model_dir

        given = [
            flag
            for flag, value in (
                ("--preset", args.preset),
                ("--vocab-size", args.vocab_size),
                ("--tgt-vocab-size", args.tgt_vocab_size),
                ("--set", args.set or None),
            )
            if value is not None
        ]
        if given:
            raise UserValueError(
                f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} a preset; with -m "
                "the model directory's own architecture is shown: leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        config = read_model_config(resolve_model_dir(args.model_dir))
    else:
        overrides = parse_assignments(args.set, "--set")
        if args.tgt_vocab_size is not None:
            overrides.setdefault("share_embeddings", "decoder")
        config = preset(
            args.preset or "base",
            src_vocab_size=37000 if args.vocab_size is None else args.vocab_size,
            tgt_vocab_size=args.tgt_vocab_size,
            **overrides,
        )
    print(describe(config))
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from aiayn.config import TrainConfig

    p = sub.add_parser(
        "train",
        help="train a model from parallel text",
        description="Train from line-aligned files (--src/--tgt) or a TSV. Settings come from "
        "--config (YAML) and flags; flags win. Launch with torchrun for several GPUs/nodes.",
    )
    p.add_argument("-c", "--config", help="YAML file with training settings")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint, with the run's settings (its "
        "train_config.yaml); flags may change only how it goes on: when it ends (--max-steps, "
        "--max-epochs, --time-budget, --patience), saving, logging, validation, the device, "
        "precision and threads, and --accumulate; anything else is refused, naming what may "
        "change (docs/settings.md lists it)",
    )
    add_dataclass_flags(p, TrainConfig, skip={"model"})
    # The flags of earlier releases, replaced by --precision (`config.upgrade_train_values`).
    for old in ("bf16", "cpu_bf16"):
        p.add_argument(
            "--" + old.replace("_", "-"),
            dest=f"legacy_{old}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=argparse.SUPPRESS,
        )
    p.add_argument(
        "--model",
        action="append",
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --model d_model=256 (repeatable)",
    )
    p.set_defaults(run=_run_train)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """YAML file values, then flag values on top; validated as a `TrainConfig`. What neither
    sets takes the device's defaults (`config.device_train_defaults`: on CUDA, the paper's
    update size), else `TrainConfig`'s.

    With `--resume`, the run's own `train_config.yaml` comes first: what the file and flags
    give goes on top of it, where the trainer accepts it as an override or refuses it.
    """
    from aiayn.config import (
        LEGACY_PRECISION_KEYS,
        ConfigError,
        TrainConfig,
        device_train_defaults,
        load_yaml_config,
        upgrade_train_values,
    )
    from aiayn.runtime import device_type
    from aiayn.train.rundir import read_config

    values: dict[str, Any] = load_yaml_config(args.config) if args.config else {}
    source = args.config or "flags"
    # Each source's keys of earlier releases are read as today's before the sources merge,
    # so that a flag given today goes over an old key in the file, and the other way round.
    values = upgrade_train_values(values, source=source)
    out_dir = args.out_dir or values.get("out_dir") or TrainConfig.out_dir
    if args.resume and (saved := read_config(Path(out_dir))) is not None:
        values = {**saved, **values}
    if args.model:
        merged = dict(values.get("model") or {})
        merged.update(parse_assignments(args.model, "--model"))
        values["model"] = merged
    flags = dataclass_values(TrainConfig, args, skip={"model"})
    legacy = {
        name: value
        for name in LEGACY_PRECISION_KEYS
        if (value := getattr(args, f"legacy_{name}", None)) is not None
    }
    if legacy and "precision" in flags:
        given = " and ".join(
            f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in legacy.items()
        )
        raise ConfigError(f"{given} and --precision both given: give --precision alone")
    flags.update(upgrade_train_values(legacy, source="flags"))
    values.update(flags)
    device = device_type(values.get("device", TrainConfig.device))
    values = {**device_train_defaults(device, given=values), **values}
    return TrainConfig.from_dict(values, source=source)


def _run_train(args: argparse.Namespace) -> int:
    import time

    from aiayn.train.budget import process_start

    # A time budget counts from the process's start, as the OS recorded it; where it keeps no
    # record, from here (before torch is imported).
    started = process_start()
    started = time.monotonic() if started is None else started

    # PyTorch's threads wait for each other at every operation. Spinning, a waiting thread
    # holds the core that other work (another process) needs, and every step stalls; passive,
    # it sleeps: on an idle 2-core AMD EPYC, 0.86-0.94x the speed of ACTIVE or of OpenMP's own
    # default, but 3x that default's with one core held by another process (BENCHMARKS.md,
    # "`aiayn train`'s settings side by side"). A machine doing nothing else may set ACTIVE.
    # OpenMP reads it once, as torch loads: so here, unless it is set.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from aiayn import runtime
    from aiayn.train.trainer import runtime_settings, train

    config = train_config_from_args(args)
    # The process's settings (threads, oneDNN's kernel cache for bf16 on a CPU, the compile
    # fallback) are the command's to set, before any PyTorch work; `train` sets none.
    runtime.configure(**runtime_settings(config))
    result = train(config, resume=args.resume, started=started)
    # A run stopped by a signal exits as the shell reports one: 128 + its number (143 for
    # SIGTERM, 130 for SIGINT), which schedulers and wrappers read as "stopped, not failed".
    status = 128 + (result.stop_signal or signal.SIGINT) if result.interrupted else 0
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone reports
        return status
    if result.interrupted:
        print(
            f"interrupted at step {result.step}; continue with: aiayn train --resume "
            f"--out-dir {result.run_dir}",
            file=sys.stderr,
        )
        return status
    print(f"model directory: {result.model_dir}")
    return 0


def _add_average(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints of a run (§6.1)")
    p.add_argument("run_dir", help="run directory (its checkpoints/ are used)")
    p.add_argument(
        "-n", "--last", type=integer, default=5, help="number of checkpoints (default 5)"
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output model directory: new, empty, or an earlier average's (replaced), e.g. "
        "RUN/averaged; not the run directory, nor its model/, best/ or checkpoints/",
    )
    p.set_defaults(run=_run_average)


def _run_average(args: argparse.Namespace) -> int:
    import json

    from aiayn.cli.output_dir import check_output_dir
    from aiayn.model_dir import METADATA_FILE, CheckpointError, save_model_dir, tokenizer_file_of
    from aiayn.train import checkpoint as ckpt

    output = check_output_dir(Path(args.output), "aiayn")  # refused before averaging, not after
    paths = ckpt.list_checkpoints(args.run_dir)
    if not paths:
        raise CheckpointError(f"no checkpoints in {Path(args.run_dir) / 'checkpoints'}")
    if args.last < 1:
        raise UserValueError(f"--last ({args.last}) must be >= 1")
    chosen = paths[-args.last :]
    if len(chosen) < args.last:
        logger.warning("only %d checkpoint(s) available; averaging those", len(chosen))
    model = ckpt.average_checkpoints(chosen)
    metadata = json.loads((chosen[-1] / METADATA_FILE).read_text())
    metadata["averaged"] = [p.name for p in chosen]
    save_model_dir(output, model, tokenizer_file=tokenizer_file_of(chosen[-1]), metadata=metadata)
    print(
        f"averaged {len(chosen)} checkpoints ({chosen[0].name} … {chosen[-1].name}) "
        f"into {args.output}"
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole job offline: numbers in English words → German, trained and evaluated",
    )
    p.add_argument("-o", "--out-dir", default="demo_run", help="output directory (demo_run)")
    p.add_argument("--max-steps", type=integer, default=None, help="optimizer updates")
    p.add_argument("--seed", type=integer, default=1, help="seed (default 1)")
    p.add_argument(
        "--device",
        default="auto",
        help="where it trains and translates: auto (a CUDA GPU where there is one, else the "
        "CPU), cpu, cuda or cuda:N",
    )
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from aiayn import runtime
    from aiayn.demo import DemoStopped, format_report, run_demo

    runtime.configure(reuse_freed_memory=True)  # the process's, as `aiayn train` sets it
    options = {} if args.max_steps is None else {"max_steps": args.max_steps}
    try:
        result = run_demo(args.out_dir, seed=args.seed, device=args.device, **options)
    except DemoStopped as stopped:
        print(stopped, file=sys.stderr)
        return 128 + (stopped.signum or signal.SIGINT)
    print(format_report(result))
    return 0
