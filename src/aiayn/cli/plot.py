"""``aiayn plot``: positional encodings, the learning-rate schedule, training curves."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiayn.cli.flags import integer, number
from aiayn.errors import UserValueError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("aiayn")


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw positional encodings, the learning-rate schedule or training curves",
        description="Draw a picture as PNG or SVG (from the suffix of -o).",
    )
    what = p.add_subparsers(dest="what", required=True, metavar="WHAT")

    pe = what.add_parser(
        "positional-encoding", help="the sinusoids of §3.5: position x dimension heatmap"
    )
    pe.add_argument("--d-model", type=integer, default=512, help="model width (default 512)")
    pe.add_argument("--length", type=integer, default=100, help="positions (default 100)")
    pe.add_argument(
        "--dims",
        type=integer,
        nargs="*",
        metavar="I",
        help="dimensions to draw as curves (default 0, 1, d/8, d/4; none: heatmap only)",
    )
    pe.set_defaults(run=_run_plot_positional_encoding)

    sc = what.add_parser(
        "schedule", help="the learning-rate schedule of Eq. 3 (or another of train's)"
    )
    sc.add_argument(
        "--d-model",
        type=integer,
        action="append",
        help="model width (default 512); repeat, with --warmup, to compare several",
    )
    sc.add_argument(
        "--warmup", type=integer, action="append", help="warmup steps (default 4000); repeatable"
    )
    sc.add_argument("--steps", type=integer, default=100_000, help="steps (default 100000)")
    sc.add_argument(
        "--lr-scale",
        "--scale",
        type=number,
        action="append",
        help="factor on Eq. 3, train's --lr-scale (default 1.0); repeatable, pairs like --warmup",
    )
    sc.add_argument(
        "--schedule",
        choices=("inverse_sqrt", "linear", "cosine", "inverse_sqrt_cooldown"),
        default="inverse_sqrt",
        help="train's --schedule (default inverse_sqrt, Eq. 3); a decaying one reaches 0 at "
        "--steps",
    )
    sc.set_defaults(run=_run_plot_schedule)

    cu = what.add_parser("curves", help="loss, perplexity, BLEU and learning rate of a run")
    cu.add_argument("run_dir", help="run directory (or its metrics.jsonl)")
    cu.set_defaults(run=_run_plot_curves)

    for q in (pe, sc, cu):
        q.add_argument("-o", "--output", required=True, help="image file, .png or .svg")
        q.add_argument("--dpi", type=integer, default=150, help="image resolution (default 150)")


def _save_plot(args: argparse.Namespace, draw: Callable[[], Figure]) -> int:
    from aiayn.viz.plots import check_image_path, save_figure

    output = check_image_path(args.output)
    save_figure(draw(), output, dpi=args.dpi)
    logger.info("wrote %s", output)
    return 0


def _run_plot_positional_encoding(args: argparse.Namespace) -> int:
    from aiayn.viz.plots import plot_positional_encoding

    return _save_plot(
        args, lambda: plot_positional_encoding(args.d_model, args.length, dims=args.dims)
    )


def _run_plot_schedule(args: argparse.Namespace) -> int:
    from aiayn.viz.plots import plot_schedule

    given = {
        "--d-model": args.d_model or [512],
        "--warmup": args.warmup or [4000],
        "--lr-scale": args.lr_scale or [1.0],
    }
    n_curves = max(len(values) for values in given.values())
    if any(len(values) not in (1, n_curves) for values in given.values()):
        counts = ", ".join(f"{flag} {len(v)} time{'s' * (len(v) > 1)}" for flag, v in given.items())
        raise UserValueError(
            f"given {counts}: give each the same number of times (they pair up), or once"
        )
    columns = [values * (n_curves // len(values)) for values in given.values()]
    settings = list(zip(*columns, strict=True))
    return _save_plot(
        args, lambda: plot_schedule(settings, steps=args.steps, schedule=args.schedule)
    )


def _run_plot_curves(args: argparse.Namespace) -> int:
    from aiayn.viz.plots import plot_curves

    return _save_plot(args, lambda: plot_curves(args.run_dir))
