"""The `aiayn` command: info, train, average, demo, translate, evaluate, score, attention, serve,
plot, prepare, export, import.

Each subcommand is a small function that turns flags into explicit arguments for the library;
errors that a user can fix (bad config, bad data, missing files) are printed as one clear line
with exit status 2, never as a traceback. The commands live by family, each module with an
``add(subparsers)`` that registers its commands and their ``run`` functions:

- :mod:`aiayn.cli.train`: info, train, average, demo
- :mod:`aiayn.cli.translate`: translate, evaluate, score, attention
- :mod:`aiayn.cli.serve`: serve
- :mod:`aiayn.cli.plot`, :mod:`aiayn.cli.prepare`
- :mod:`aiayn.cli.interop`: export, import

:mod:`aiayn.cli.parser` is argparse with "did you mean" for a misspelt command or flag;
:mod:`aiayn.cli.flags` turns dataclass fields into flags; :mod:`aiayn.cli.common` holds what
several commands share (loading the model, the search flags, the progress bar), and
:mod:`aiayn.cli.output_dir` the one rule of what ``-o`` of average, export and import may
replace. Building the parser imports no torch, so ``aiayn --help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from aiayn import __version__
from aiayn.cli import interop, plot, prepare, serve, train, translate
from aiayn.cli.flags import (
    add_dataclass_flags,
    attribute_docs,
    dataclass_from_args,
    dataclass_values,
    parse_assignments,
)
from aiayn.cli.parser import ArgumentParser
from aiayn.cli.train import train_config_from_args

__all__ = [
    "add_dataclass_flags",
    "attribute_docs",
    "build_parser",
    "dataclass_from_args",
    "dataclass_values",
    "main",
    "parse_assignments",
    "train_config_from_args",
]

logger = logging.getLogger("aiayn")

# In the order `aiayn --help` lists them.
_COMMAND_FAMILIES = (train, translate, serve, plot, prepare, interop)


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


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in _COMMAND_FAMILIES:
        family.add(sub)
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
