"""The `aiayn` command: info, train, average, translate, evaluate, demo.

Each subcommand is a small function that turns flags into explicit arguments for the library;
errors that a user can fix (bad config, bad data, missing files) are printed as one clear line
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from aiayn import __version__

logger = logging.getLogger("aiayn")


def _is_user_error(error: BaseException) -> bool:
    """Errors a user can fix (bad config, data, files): one line, exit status 2."""
    ours = type(error).__module__.startswith("aiayn.")
    return ours or isinstance(error, (ValueError, FileNotFoundError, UnicodeDecodeError))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


# -- info -----------------------------------------------------------------------------------


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print a model's architecture and parameter counts")
    p.add_argument("-m", "--model-dir", help="a trained model directory (instead of a preset)")
    p.add_argument("--preset", default="base", help="preset name (base, big, small, tiny)")
    p.add_argument("--vocab-size", type=int, default=37000, help="joint vocabulary size")
    p.add_argument("--tgt-vocab-size", type=int, help="target vocabulary size if not joint")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --set n_heads=16 (repeatable)",
    )
    p.set_defaults(run=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    import torch

    from aiayn.config import preset
    from aiayn.model import Transformer
    from aiayn.summary import describe

    if args.model_dir:
        from aiayn.checkpoint import read_model_config, resolve_model_dir

        config = read_model_config(resolve_model_dir(args.model_dir))
    else:
        overrides = _parse_assignments(args.set, "--set")
        if args.tgt_vocab_size is not None:
            overrides.setdefault("share_embeddings", "decoder")
        config = preset(
            args.preset,
            src_vocab_size=args.vocab_size,
            tgt_vocab_size=args.tgt_vocab_size,
            **overrides,
        )
    with torch.device("meta"):  # shapes only: no memory, no time
        model = Transformer(config)
    print(describe(model, config))
    return 0


# -- train ----------------------------------------------------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    from aiayn.config import TrainConfig

    p = sub.add_parser(
        "train",
        help="train a model from parallel text",
        description="Train from line-aligned files (--src/--tgt) or a TSV. Settings come from "
        "--config (YAML) and flags; flags win. Launch with torchrun for several GPUs/nodes.",
    )
    p.add_argument("-c", "--config", help="YAML file with training settings")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        help_text = f"(default: {_default_text(f)})"
        if f.name == "model":
            p.add_argument(
                "--model",
                action="append",
                metavar="FIELD=VALUE",
                help="override a model field, e.g. --model d_model=256 (repeatable)",
            )
        elif kind == "bool":
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            convert = int if kind.startswith("int") else float if kind == "float" else str
            p.add_argument(flag, type=convert, default=None, help=help_text)
    p.set_defaults(run=_run_train)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    return "{}"


def train_config_from_args(args: argparse.Namespace) -> Any:
    """YAML file values, then flag values on top; validated as a `TrainConfig`."""
    from aiayn.config import TrainConfig, load_yaml_config

    values: dict[str, Any] = load_yaml_config(args.config) if args.config else {}
    source = args.config or "flags"
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":
            if args.model:
                merged = dict(values.get("model") or {})
                merged.update(_parse_assignments(args.model, "--model"))
                values["model"] = merged
            continue
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
    return TrainConfig.from_dict(values, source=source)


def _run_train(args: argparse.Namespace) -> int:
    from aiayn.trainer import train

    config = train_config_from_args(args)
    result = train(config, resume=args.resume)
    if result.interrupted:
        print(
            f"interrupted at step {result.step}; continue with: aiayn train --resume "
            f"--out-dir {result.run_dir} ...",
            file=sys.stderr,
        )
        return 130
    print(f"model directory: {result.model_dir}")
    return 0


# -- average --------------------------------------------------------------------------------


def _add_average(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints of a run (§6.1)")
    p.add_argument("run_dir", help="run directory (its checkpoints/ are used)")
    p.add_argument("-n", "--last", type=int, default=5, help="number of checkpoints (default 5)")
    p.add_argument("-o", "--output", required=True, help="output model directory")
    p.set_defaults(run=_run_average)


def _run_average(args: argparse.Namespace) -> int:
    import json

    from aiayn import checkpoint as ckpt

    paths = ckpt.list_checkpoints(args.run_dir)
    if not paths:
        raise ckpt.CheckpointError(f"no checkpoints in {Path(args.run_dir) / 'checkpoints'}")
    if args.last < 1:
        raise ValueError(f"--last ({args.last}) must be >= 1")
    chosen = paths[-args.last :]
    if len(chosen) < args.last:
        logger.warning("only %d checkpoint(s) available; averaging those", len(chosen))
    model = ckpt.average_checkpoints(chosen)
    metadata = json.loads((chosen[-1] / ckpt.METADATA_FILE).read_text())
    metadata["averaged"] = [p.name for p in chosen]
    ckpt.save_model_dir(
        args.output, model, tokenizer_file=chosen[-1] / ckpt.TOKENIZER_FILE, metadata=metadata
    )
    print(
        f"averaged {len(chosen)} checkpoints ({chosen[0].name} … {chosen[-1].name}) "
        f"into {args.output}"
    )
    return 0


# -- helpers --------------------------------------------------------------------------------


def _parse_assignments(items: Sequence[str], flag: str) -> dict[str, Any]:
    """['d_model=256', 'norm_first=true'] → {'d_model': 256, 'norm_first': True}."""
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects FIELD=VALUE, got {item!r}")
        values[key.strip()] = yaml.safe_load(raw)
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(sub)
    _add_train(sub)
    _add_average(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.verbose or not _is_user_error(error):
            raise
        print(f"aiayn {args.command}: error: {error}", file=sys.stderr)
        return 2
