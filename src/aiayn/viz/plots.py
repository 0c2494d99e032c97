"""Pictures of the model: attention maps, positional encodings (§3.5), the learning-rate
schedule (Eq. 3) and training curves.

Every function returns a :class:`matplotlib.figure.Figure` built without pyplot, so there is no
global state and no GUI backend: nothing opens a window, and figures are freed with their last
reference. :func:`save_figure` writes one as PNG or SVG, chosen by the file suffix, at exactly
``figsize × dpi`` pixels (no tight bounding box; the layout engine keeps labels inside)::

    [result] = translator.translate(["the cat sat on the mat"], return_attention=True)
    save_figure(plot_attention(result), "alignment.png")
    save_figure(plot_attention(result, "cross"), "cross.svg")   # every layer × head

Attention pictures label their axes with the real subword pieces ("▁" marks a word start, as
SentencePiece writes it). Figures grow with the number of tokens, about 0.28 inch per token
for the alignment view, so labels of sentences up to ~40 pieces do not overlap.

Axes of the attention maps (see :class:`aiayn.decode.translator.SentenceAttention`):

* ``encoder``: source queries (rows) × source keys (columns), EOS included.
* ``decoder``: rows are labelled with the output token predicted at that position (EOS
  included), columns with the decoder input (``<s>``, then the output shifted right); the
  map is zero above the diagonal (§3.2.3).
* ``cross`` and ``alignment``: output tokens (rows) × source pieces (columns).

matplotlib is the optional extra ``aiayn[viz]``: nothing else in aiayn imports this module (the
CLI imports it inside the commands that draw), and without matplotlib importing it raises a
one-line :class:`aiayn.extras.MissingExtra` saying how to install it, before any slow work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aiayn.decode.alignment import alignment_matrix, attention_maps, check_index
from aiayn.errors import UserFileNotFoundError, UserValueError
from aiayn.extras import require

require("viz", "matplotlib", needed_by="aiayn's pictures (aiayn plot, aiayn attention)")

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

if TYPE_CHECKING:
    from aiayn.decode.results import TranslationResult

__all__ = [
    "ATTENTION_KINDS",
    "DPI",
    "IMAGE_FORMATS",
    "check_image_path",
    "plot_alignment",
    "plot_attention",
    "plot_attention_grid",
    "plot_curves",
    "plot_positional_encoding",
    "plot_schedule",
    "save_figure",
]

IMAGE_FORMATS = (".png", ".svg")
DPI = 150
ATTENTION_KINDS = ("alignment", "encoder", "decoder", "cross")
BOS_PIECE = "<s>"
CMAP = "viridis"

_GRID_TITLES = {
    "encoder": "Encoder self-attention",
    "decoder": "Masked decoder self-attention",
    "cross": "Encoder-decoder attention",
}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def check_image_path(path: str | Path) -> Path:
    """``path`` if its suffix names a format we write (.png, .svg), else a ValueError listing
    them. Called before any slow work, so a typo fails at once."""
    path = Path(path)
    if path.suffix.lower() not in IMAGE_FORMATS:
        shown = repr(path.suffix) if path.suffix else "no suffix"
        raise UserValueError(
            f"cannot write {path}: unsupported image format ({shown}); "
            f"use one of {', '.join(IMAGE_FORMATS)}"
        )
    return path


def save_figure(figure: Figure, path: str | Path, *, dpi: int = DPI) -> Path:
    """Writes ``figure`` to ``path`` (PNG or SVG, from the suffix) and returns the path.

    The image is ``figure.get_size_inches() × dpi`` pixels: no tight bounding box, which would
    change the size from one sentence to the next.
    """
    path = check_image_path(path)
    if isinstance(dpi, bool) or not isinstance(dpi, int) or dpi < 1:
        raise UserValueError(f"dpi ({dpi!r}) must be a positive integer")
    if not path.parent.is_dir():
        raise UserFileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    figure.savefig(path, dpi=dpi, format=path.suffix.lower()[1:])
    return path


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def plot_attention(
    result: TranslationResult,
    kind: str = "alignment",
    *,
    layer: int | None = None,
    head: int | None = None,
    auto_scale: bool = False,
) -> Figure:
    """The picture ``aiayn attention`` draws: :func:`plot_alignment` for "alignment", else
    :func:`plot_attention_grid` for "encoder", "decoder" or "cross".

    Colours run from 0 to 1 by default, as attention weights do (and as on the web page of
    ``aiayn serve``), so that two pictures compare at a glance: a pale one is diffuse attention.
    ``auto_scale`` stretches them to the largest weight shown instead, which brings out the
    structure of diffuse maps at the cost of comparability.

    Args:
        result: From ``Translator.translate(..., return_attention=True)``.
        kind: One of :data:`ATTENTION_KINDS`.
        layer: 0-based, negative from the end. Alignment: default the last; grids: default
            every layer.
        head: Alignment: one head instead of the mean over heads; grids: only this head.
        auto_scale: Colour scale from 0 to the largest weight shown instead of 0 to 1.

    Raises:
        ValueError: Unknown kind, layer or head (the message lists the valid ones), or no
            attention maps in ``result``.
    """
    if kind not in ATTENTION_KINDS:
        raise UserValueError(
            f"unknown attention kind {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}"
        )
    if kind == "alignment":
        layer = -1 if layer is None else layer
        return plot_alignment(result, layer=layer, head=head, auto_scale=auto_scale)
    return plot_attention_grid(result, kind, layer=layer, head=head, auto_scale=auto_scale)


def _color_scale(weights: np.ndarray, auto_scale: bool) -> tuple[float, str]:
    """(vmax, colour bar label): 1, or the largest weight shown (see :func:`plot_attention`)."""
    if not auto_scale:
        return 1.0, "attention weight"
    return (float(weights.max()) if weights.size else 1.0), "attention weight (0 to the largest)"


def plot_alignment(
    result: TranslationResult,
    *,
    layer: int = -1,
    head: int | None = None,
    auto_scale: bool = False,
) -> Figure:
    """Encoder-decoder attention of one decoder layer averaged over heads (or one ``head``):
    output pieces (rows) × source pieces (columns), the soft alignment of the translation;
    colours from 0 to 1, or to the largest weight with ``auto_scale``."""
    matrix = alignment_matrix(result, layer, head).numpy()  # (T, S)
    vmax, label = _color_scale(matrix, auto_scale)
    n_layers, n_heads = attention_maps(result).cross.shape[:2]
    layer = layer % n_layers
    n_tgt, n_src = matrix.shape
    figure = Figure(
        figsize=(max(5.0, 2.4 + 0.28 * n_src), max(3.5, 2.1 + 0.28 * n_tgt)),
        layout="constrained",
    )
    ax = figure.add_subplot()
    image = ax.imshow(
        matrix, cmap=CMAP, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest"
    )
    font = 8 if max(n_src, n_tgt) <= 30 else 7
    _token_ticks(ax, result.src_tokens, result.tgt_tokens, font)
    ax.set_xlabel("source (subword pieces)")
    ax.set_ylabel("output (subword pieces)")
    heads = f"mean of {n_heads} heads" if head is None else f"head {head % n_heads}"
    ax.set_title(
        f"Encoder-decoder attention\ndecoder layer {layer} (of 0–{n_layers - 1}), {heads}",
        fontsize=10,
    )
    figure.colorbar(image, ax=ax, label=label, shrink=0.8)
    return figure


def plot_attention_grid(
    result: TranslationResult,
    kind: str,
    *,
    layer: int | None = None,
    head: int | None = None,
    auto_scale: bool = False,
) -> Figure:
    """Every layer (rows) × head (columns) of one kind of attention, on one colour scale.

    Args:
        result: From ``Translator.translate(..., return_attention=True)``.
        kind: "encoder", "decoder" or "cross".
        layer: Only this layer (0-based, negative from the end); default all.
        head: Only this head; default all.
        auto_scale: Colours from 0 to the largest weight in the grid instead of 0 to 1.
    """
    if kind not in _GRID_TITLES:
        raise UserValueError(
            f"unknown attention kind {kind!r}; choose one of {', '.join(_GRID_TITLES)}"
        )
    maps = getattr(attention_maps(result), kind).numpy()  # (L, H, Q, K)
    n_layers, n_heads, n_q, n_k = maps.shape
    stack = "encoder" if kind == "encoder" else "decoder"
    layers = range(n_layers)
    if layer is not None:
        layers = [check_index(layer, n_layers, "layer", f"{stack} layers")]
    heads = range(n_heads)
    if head is not None:
        heads = [check_index(head, n_heads, "head", "heads per layer")]
    queries, keys, q_name, k_name = _grid_axes(result, kind)
    shown = maps[np.ix_(list(layers), list(heads))]  # (layers, heads, Q, K)

    panel_w, panel_h = max(1.6, 0.5 + 0.085 * n_k), max(1.6, 0.5 + 0.085 * n_q)
    figure = Figure(
        figsize=(1.6 + panel_w * len(heads), 1.0 + panel_h * len(layers)), layout="constrained"
    )
    axes = figure.subplots(len(layers), len(heads), squeeze=False)
    font = 6 if max(n_q, n_k) <= 20 else 4.5
    vmax, label = _color_scale(shown, auto_scale)
    image = None
    for r, layer_index in enumerate(layers):
        for c, head_index in enumerate(heads):
            ax = axes[r, c]
            image = ax.imshow(
                shown[r, c], cmap=CMAP, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest"
            )
            _token_ticks(
                ax,
                keys if r == len(layers) - 1 else None,
                queries if c == 0 else None,
                font,
                n_x=n_k,
                n_y=n_q,
            )
            ax.set_title(f"layer {layer_index} · head {head_index}", fontsize=7)
    figure.colorbar(image, ax=axes, label=label, shrink=0.6)
    figure.supxlabel(k_name, fontsize=9)
    figure.supylabel(q_name, fontsize=9)
    figure.suptitle(f"{_GRID_TITLES[kind]}: layer × head")
    return figure


def _grid_axes(result: TranslationResult, kind: str) -> tuple[list[str], list[str], str, str]:
    """(query labels, key labels, query axis name, key axis name) of one kind of map."""
    if kind == "encoder":
        return result.src_tokens, result.src_tokens, "source (queries)", "source (keys)"
    if kind == "decoder":
        inputs = [BOS_PIECE, *result.tokens]
        return result.tgt_tokens, inputs, "output predicted (queries)", "decoder input (keys)"
    return result.tgt_tokens, result.src_tokens, "output (queries)", "source (keys)"


def _token_ticks(
    ax: Axes,
    x_labels: Sequence[str] | None,
    y_labels: Sequence[str] | None,
    font: float,
    *,
    n_x: int | None = None,
    n_y: int | None = None,
) -> None:
    """One tick per token; labels as written (math text off, so "$" stays a dollar), x labels
    vertical so that neighbours never overlap. A None label list hides that axis' labels."""
    n_x = len(x_labels) if x_labels is not None else n_x
    n_y = len(y_labels) if y_labels is not None else n_y
    ax.set_xticks(range(n_x))
    ax.set_yticks(range(n_y))
    if x_labels is not None:
        ax.set_xticklabels(x_labels, rotation=90, fontsize=font, parse_math=False)
    else:
        ax.tick_params(labelbottom=False)
    if y_labels is not None:
        ax.set_yticklabels(y_labels, fontsize=font, parse_math=False)
    else:
        ax.tick_params(labelleft=False)
    ax.tick_params(length=2)


# --------------------------------------------------------------------------------------------
# Positional encoding (§3.5) and learning-rate schedule (Eq. 3)
# --------------------------------------------------------------------------------------------


def plot_positional_encoding(
    d_model: int = 512, length: int = 100, *, dims: Sequence[int] | None = None
) -> Figure:
    """§3.5's sinusoids as a position × dimension heatmap, and a few dimensions as curves.

    Args:
        d_model: Model width D.
        length: Number of positions.
        dims: Dimensions to draw as curves; an empty list draws only the heatmap. By default
            0 and 1 (a sine and a cosine of wavelength 2π) and two even dimensions an eighth
            and a quarter of the way in, whose wavelengths are 10^0.5 and 10 times longer.
    """
    from aiayn.model import sinusoidal_positional_encoding

    for name, value in (("d_model", d_model), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserValueError(f"{name} ({value!r}) must be a positive integer")
    if dims is None:
        dims = sorted({d for d in (0, 1, d_model // 16 * 2, d_model // 8 * 2) if d < d_model})
    for d in dims:
        if not 0 <= d < d_model:
            raise UserValueError(
                f"dimension {d} is out of range for d_model {d_model} (valid: 0..{d_model - 1})"
            )
    pe = sinusoidal_positional_encoding(length, d_model).numpy()  # (length, D)

    figure = Figure(figsize=(10, 8 if dims else 5), layout="constrained")
    if dims:
        heat_ax, curve_ax = figure.subplots(2, 1, height_ratios=[3, 2])
    else:
        heat_ax, curve_ax = figure.add_subplot(), None
    image = heat_ax.imshow(
        pe, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest"
    )
    heat_ax.set_xlabel("dimension i")
    heat_ax.set_ylabel("position pos")
    heat_ax.set_title(
        f"Sinusoidal positional encoding (§3.5), d_model = {d_model}\n"
        "PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  "
        "PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))",
        fontsize=10,
    )
    figure.colorbar(image, ax=heat_ax, label="PE(pos, i)")
    if curve_ax is not None:
        positions = np.arange(length)
        for d in dims:
            wavelength = 2 * math.pi * 10000 ** ((d - d % 2) / d_model)
            kind = "sin" if d % 2 == 0 else "cos"
            curve_ax.plot(
                positions, pe[:, d], label=f"dim {d} ({kind}, wavelength {wavelength:.3g})"
            )
        curve_ax.set_xlabel("position pos")
        curve_ax.set_ylabel("PE(pos, i)")
        curve_ax.set_xlim(0, max(length - 1, 1))
        curve_ax.legend(  # above the curves, in place of a title: never over them
            fontsize=8, ncol=min(len(dims), 2), loc="lower center", bbox_to_anchor=(0.5, 1.0)
        )
        curve_ax.grid(alpha=0.3)
    return figure


def plot_schedule(
    settings: Sequence[tuple[int, int] | tuple[int, int, float]] = ((512, 4000),),
    *,
    steps: int = 100_000,
    scale: float = 1.0,
    schedule: str = "inverse_sqrt",
) -> Figure:
    """Eq. 3's learning rate (or another `schedule`'s) over ``steps`` updates, one curve per
    (d_model, warmup_steps) or (d_model, warmup_steps, lr_scale), with each peak (at step =
    warmup_steps) marked. Uses ``aiayn.optim.scheduled_rate``, the function training uses.

    Args:
        settings: One tuple per curve; a curve without its own scale takes ``scale``.
        steps: Updates on the x axis; a decaying schedule's run ends at the last of them.
        scale: Factor on Eq. 3 (``TrainConfig.lr_scale``) for curves that give none.
        schedule: One of ``aiayn.optim.SCHEDULES`` (``TrainConfig.schedule``).
    """
    from aiayn.optim import SCHEDULES, scheduled_rate

    if schedule not in SCHEDULES:
        raise UserValueError(f"schedule ({schedule!r}) must be one of {', '.join(SCHEDULES)}")

    def learning_rate(step: int, *, d_model: int, warmup_steps: int, scale: float) -> float:
        return scheduled_rate(
            schedule, step, d_model=d_model, warmup_steps=warmup_steps, scale=scale, end=steps
        )

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserValueError(f"steps ({steps!r}) must be a positive integer")
    if not settings:
        raise UserValueError("give at least one (d_model, warmup_steps) pair")
    curves = [(d, w, scale) if len(rest) == 0 else (d, w, *rest) for d, w, *rest in settings]
    for d_model, warmup, curve_scale in curves:
        if d_model < 1 or warmup < 1:
            raise UserValueError(f"d_model ({d_model}) and warmup ({warmup}) must be >= 1")
        if not curve_scale > 0:
            raise UserValueError(f"the learning-rate scale ({curve_scale}) must be > 0")
    # ~2000 points, plus every warmup step so that each peak is drawn exactly.
    points = np.linspace(1, steps, num=min(steps, 2000)).round().astype(int)
    points = np.unique(np.concatenate([points, [w for _, w, _ in curves if w <= steps]]))
    scales = {s for _, _, s in curves}
    common = scales.pop() if len(scales) == 1 else None  # in the title, else in each label

    figure = Figure(figsize=(8, 5), layout="constrained")
    ax = figure.add_subplot()
    for d_model, warmup, curve_scale in curves:
        rates = [learning_rate(int(s), d_model=d_model, warmup_steps=warmup, scale=curve_scale)
                 for s in points]  # fmt: skip
        label = f"d_model = {d_model}, warmup = {warmup}"
        (line,) = ax.plot(points, rates, label=label if common else f"{label}, × {curve_scale:g}")
        if warmup <= steps:
            peak = learning_rate(warmup, d_model=d_model, warmup_steps=warmup, scale=curve_scale)
            ax.plot([warmup], [peak], "o", color=line.get_color(), markersize=4)
            ax.annotate(
                f"{peak:.2e}",
                (warmup, peak),
                xytext=(4, 4),
                textcoords="offset points",
                fontsize=8,
                color=line.get_color(),
            )
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    title = _SCHEDULE_TITLES[schedule].format(steps=steps)
    ax.set_title(title if common in (None, 1.0) else f"{title} × {common:g}", fontsize=10)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_xlim(0, steps)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


_SCHEDULE_TITLES = {
    "inverse_sqrt": (
        "Learning-rate schedule (Eq. 3): d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)"
    ),
    "linear": "Learning-rate schedule: Eq. 3's warm-up, then linear to 0 at step {steps}",
    "cosine": "Learning-rate schedule: Eq. 3's warm-up, then cosine to 0 at step {steps}",
    "inverse_sqrt_cooldown": (
        "Learning-rate schedule: Eq. 3, cooled down linearly to 0 at step {steps} (last 20%)"
    ),
}


# --------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------


def plot_curves(run: str | Path) -> Figure:
    """Training and validation loss, perplexity, BLEU (if logged) and learning rate over steps.

    Reads ``metrics.jsonl`` (``run`` is a run directory or the file) up to its last complete
    line, so a run that is still writing can be plotted.

    Raises:
        FileNotFoundError: No metrics log.
        ValueError: The log has no complete record yet.
    """
    from aiayn.train.runlog import (
        METRICS_FILE,
        TrainRecord,
        ValidRecord,
        parse_record,
        read_metrics,
    )

    path = Path(run)
    records = [parse_record(r) for r in read_metrics(path)]
    if path.is_dir():
        path = path / METRICS_FILE
    train = [r for r in records if isinstance(r, TrainRecord)]
    valid = [r for r in records if isinstance(r, ValidRecord)]
    if not train and not valid:
        raise UserValueError(f"{path} has no complete training or validation record yet")

    panels: list[tuple[str, str, list[tuple[str, Sequence[Any], str, str]]]] = [
        (
            "Loss",
            "nats per target token",
            [
                ("train loss (label-smoothed)", train, "loss", "-"),
                ("train NLL", train, "nll", "-"),
                ("valid loss (label-smoothed)", valid, "valid_loss", "o-"),
                ("valid NLL", valid, "valid_nll", "o-"),
            ],
        ),
        (
            "Perplexity",
            "perplexity (log scale)",
            [("train", train, "ppl", "-"), ("valid", valid, "valid_ppl", "o-")],
        ),
    ]
    if any(r.valid_bleu is not None for r in valid):
        panels.append(("Validation BLEU", "BLEU", [("valid", valid, "valid_bleu", "o-")]))
    if any(r.lr is not None for r in train):
        panels.append(("Learning rate", "learning rate", [("train", train, "lr", "-")]))

    n_cols = 2 if len(panels) == 4 else len(panels)
    n_rows = math.ceil(len(panels) / n_cols)
    figure = Figure(figsize=(4.8 * n_cols, 3.8 * n_rows), layout="constrained")
    axes = figure.subplots(n_rows, n_cols, squeeze=False).ravel()
    for ax, (title, ylabel, series) in zip(axes, panels, strict=True):
        for label, rows, key, style in series:
            steps, values = _series(rows, key)
            if steps:
                ax.plot(steps, values, style, label=label, markersize=3)
        if title == "Perplexity":
            ax.set_yscale("log")
        if title == "Learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    last = max(r.step or 0 for r in (*train, *valid))
    figure.suptitle(f"Training curves: {path} (up to step {last})")
    return figure


def _series(rows: Sequence[Any], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of the field ``key`` of the records (`aiayn.train.runlog`) that have
    one."""
    steps, values = [], []
    for r in rows:
        value = getattr(r, key)
        if isinstance(value, (int, float)) and math.isfinite(value) and r.step is not None:
            steps.append(r.step)
            values.append(float(value))
    return steps, values
