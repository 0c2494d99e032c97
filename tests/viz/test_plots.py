"""Tests for aiayn.viz.plots and the `aiayn attention` / `aiayn plot` commands.

Each picture is written at the size we set (figure size × dpi), is not blank, shows the data it
claims (the image arrays are the attention maps, §3.5's table, Eq. 3's curve), and SVG output
is XML. Bad input (kind, layer, head, image format, missing or partly written metrics log)
fails with a message that lists the valid choices, exit status 2 from the command line.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from aiayn.cli import build_parser, main
from aiayn.decode.translator import TranslationResult, Translator
from aiayn.model import sinusoidal_positional_encoding
from aiayn.optim import learning_rate, scheduled_rate
from aiayn.viz.plots import (
    ATTENTION_KINDS,
    check_image_path,
    plot_alignment,
    plot_attention,
    plot_attention_grid,
    plot_curves,
    plot_positional_encoding,
    plot_schedule,
    save_figure,
)
from model_dirs import tiny_model_dir

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon all night",
    "die katze sass auf der matte",
    "ein hund bellte die ganze nacht den mond an",
]
SENTENCE = "the cat sat on the mat"
FAST = {"beam_size": 2, "max_len_b": 4}
CLI_FAST = ["--beam-size", "2", "--max-len-b", "4", "--dpi", "40"]
DPI = 40  # small images: fast tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(
        tmp_path_factory.mktemp("plots"), CORPUS, d_model=32, d_ff=64, n_heads=2, max_positions=32
    )


@pytest.fixture(scope="module")
def result(model_dir: Path) -> TranslationResult:
    [result] = Translator(model_dir).translate([SENTENCE], return_attention=True, **FAST)
    return result


def write_metrics(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")
    return path


def train_record(step: int) -> dict:
    nll = 4.5 / step**0.3
    lr = learning_rate(step, d_model=512, warmup_steps=40)
    return {
        "type": "train",
        "step": step,
        "loss": nll + 0.5,
        "nll": nll,
        "ppl": math.exp(nll),
        "lr": lr,
        "tokens_per_s": 1000.0,
    }


def valid_record(step: int) -> dict:
    nll = 3.6 / step**0.3
    return {
        "type": "valid",
        "step": step,
        "valid_loss": nll + 0.4,
        "valid_nll": nll,
        "valid_ppl": math.exp(nll),
        "valid_bleu": step / 10,
    }


TRAIN = [train_record(step) for step in range(10, 210, 10)]
VALID = [valid_record(step) for step in (50, 100, 150, 200)]


def assert_image(path: Path, figure_size: tuple[float, float] | np.ndarray, dpi: int) -> None:
    """A PNG of figure size × dpi pixels that is not blank."""
    image = matplotlib.image.imread(path)  # (height, width, RGBA) floats in [0, 1]
    width, height = (round(x * dpi) for x in figure_size)
    assert abs(image.shape[1] - width) <= 1 and abs(image.shape[0] - height) <= 1
    rgb = image[..., :3]
    assert rgb.var() > 0.005
    assert (rgb.min(axis=-1) < 0.9).mean() > 0.05  # some ink, not a white page


def size_of(figure: Figure) -> tuple[float, float]:
    width, height = figure.get_size_inches()
    return float(width), float(height)


# -- attention pictures show the maps ------------------------------------------------------------


def test_alignment_picture_is_the_head_averaged_cross_attention(
    result: TranslationResult, tmp_path: Path
) -> None:
    figure = plot_attention(result)  # default: alignment, last layer
    [image] = figure.axes[0].images
    np.testing.assert_allclose(image.get_array(), result.attention.numpy())
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels == result.src_tokens
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == result.tgt_tokens
    assert figure.axes[0].get_title() and figure.axes[0].get_xlabel()
    assert len(figure.axes) == 2  # the map and its colour bar
    assert_image(save_figure(figure, tmp_path / "a.png", dpi=DPI), size_of(figure), DPI)

    one_head = plot_alignment(result, layer=0, head=1)
    [image] = one_head.axes[0].images
    np.testing.assert_allclose(image.get_array(), result.attention_maps.cross[0, 1].numpy())


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_grid_has_every_layer_and_head(
    result: TranslationResult, kind: str, tmp_path: Path
) -> None:
    maps = getattr(result.attention_maps, kind)
    n_layers, n_heads = maps.shape[:2]
    figure = plot_attention(result, kind)
    panels = [ax for ax in figure.axes if ax.images]
    colour_bars = [ax for ax in figure.axes if not ax.images]
    assert len(panels) == n_layers * n_heads and len(colour_bars) == 1
    for index, ax in enumerate(panels):
        layer, head = divmod(index, n_heads)
        np.testing.assert_allclose(ax.images[0].get_array(), maps[layer, head].numpy())
        assert ax.get_title() == f"layer {layer} · head {head}"
    assert_image(save_figure(figure, tmp_path / f"{kind}.png", dpi=DPI), size_of(figure), DPI)

    one = plot_attention_grid(result, kind, layer=-1, head=0)
    [panel] = [ax for ax in one.axes if ax.images]
    np.testing.assert_allclose(panel.images[0].get_array(), maps[-1, 0].numpy())


@pytest.mark.parametrize("kind", ["alignment", "encoder", "cross"])
def test_colours_run_from_0_to_1_unless_auto_scaled(result: TranslationResult, kind: str) -> None:
    """A fixed scale makes two pictures comparable (as on the web page); --auto-scale stretches
    it to the largest weight shown."""

    def scale_of(figure: Any) -> tuple[float, float, float]:
        images = [image for ax in figure.axes for image in ax.images]
        largest = max(float(np.max(image.get_array())) for image in images)
        return (*images[0].get_clim(), largest)

    assert scale_of(plot_attention(result, kind))[:2] == (0.0, 1.0)
    low, high, largest = scale_of(plot_attention(result, kind, auto_scale=True))
    assert low == 0.0 and high == pytest.approx(largest) and largest < 1.0


def test_decoder_grid_labels_inputs_and_predictions(result: TranslationResult) -> None:
    figure = plot_attention_grid(result, "decoder", layer=0, head=0)
    ax = next(ax for ax in figure.axes if ax.images)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["<s>", *result.tokens]
    assert [t.get_text() for t in ax.get_yticklabels()] == result.tgt_tokens


def test_long_sentence_figure_grows_with_the_tokens(model_dir: Path) -> None:
    translator = Translator(model_dir)
    long = " ".join(CORPUS)
    [short_result, long_result] = translator.translate(
        [SENTENCE, long], return_attention=True, **FAST
    )
    assert len(long_result.src_tokens) >= 30
    short_w, _ = size_of(plot_alignment(short_result))
    long_w, _ = size_of(plot_alignment(long_result))
    assert long_w >= 0.25 * len(long_result.src_tokens) > short_w


# -- other pictures show their formulas ---------------------------------------------------------


def test_positional_encoding_picture_is_the_table(tmp_path: Path) -> None:
    figure = plot_positional_encoding(64, 30, dims=[0, 1, 10])
    heat = next(ax for ax in figure.axes if ax.images)
    np.testing.assert_allclose(
        heat.images[0].get_array(), sinusoidal_positional_encoding(30, 64).numpy()
    )
    curves = next(ax for ax in figure.axes if ax.lines)
    np.testing.assert_allclose(
        curves.lines[2].get_ydata(), sinusoidal_positional_encoding(30, 64)[:, 10].numpy()
    )
    assert_image(save_figure(figure, tmp_path / "pe.png", dpi=DPI), size_of(figure), DPI)
    assert not [ax for ax in plot_positional_encoding(16, 8, dims=[]).axes if ax.lines]
    with pytest.raises(ValueError, match=r"dimension 64 is out of range.*0\.\.63"):
        plot_positional_encoding(64, 10, dims=[64])


def test_schedule_picture_is_eq_3_with_its_peak_at_warmup(tmp_path: Path) -> None:
    figure = plot_schedule([(512, 4000), (256, 1000)], steps=20_000)
    ax = figure.axes[0]
    curves = [line for line in ax.lines if len(line.get_xdata()) > 1]
    assert len(curves) == 2
    for line, (d_model, warmup) in zip(curves, [(512, 4000), (256, 1000)], strict=True):
        steps, rates = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert steps[np.argmax(rates)] == warmup
        expected = [learning_rate(int(s), d_model=d_model, warmup_steps=warmup) for s in steps]
        np.testing.assert_allclose(rates, expected)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "d_model = 512, warmup = 4000",
        "d_model = 256, warmup = 1000",
    ]
    assert_image(save_figure(figure, tmp_path / "lr.png", dpi=DPI), size_of(figure), DPI)


def test_schedule_curves_each_take_their_own_lr_scale() -> None:
    """The paper's base model at Eq. 3's rate beside the demo's at half of it (make docs)."""
    figure = plot_schedule([(512, 4000, 1.0), (128, 200, 0.5)], steps=5000)
    ax = figure.axes[0]
    curves = [line for line in ax.lines if len(line.get_xdata()) > 1]
    settings = [(512, 4000, 1.0), (128, 200, 0.5)]
    for line, (d_model, warmup, scale) in zip(curves, settings, strict=True):
        steps = np.asarray(line.get_xdata())
        expected = [learning_rate(int(s), d_model=d_model, warmup_steps=warmup, scale=scale)
                    for s in steps]  # fmt: skip
        np.testing.assert_allclose(line.get_ydata(), expected)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "d_model = 512, warmup = 4000, × 1",
        "d_model = 128, warmup = 200, × 0.5",
    ]
    assert "×" not in ax.get_title()
    # one scale for every curve goes in the title, as with the keyword `scale`
    for figure in (plot_schedule([(128, 200, 0.5)]), plot_schedule([(128, 200)], scale=0.5)):
        assert figure.axes[0].get_title().endswith("× 0.5")
    with pytest.raises(ValueError, match=r"scale \(0\.0\) must be > 0"):
        plot_schedule([(128, 200, 0.0)])


@pytest.mark.parametrize("schedule", ["linear", "cosine", "inverse_sqrt_cooldown"])
def test_a_decaying_schedule_is_drawn_as_training_sets_it_down_to_zero_at_the_last_step(
    schedule: str,
) -> None:
    figure = plot_schedule([(256, 400)], steps=3000, schedule=schedule)
    ax = figure.axes[0]
    [line] = [line for line in ax.lines if len(line.get_xdata()) > 1]
    steps, rates = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
    expected = [scheduled_rate(schedule, int(s), d_model=256, warmup_steps=400, end=3000)
                for s in steps]  # fmt: skip
    np.testing.assert_allclose(rates, expected)
    assert steps[-1] == 3000 and rates[-1] == 0.0
    assert steps[np.argmax(rates)] == 400  # Eq. 3's peak, marked as for Eq. 3
    assert "to 0 at step 3000" in ax.get_title()
    with pytest.raises(ValueError, match=r"schedule \('exp'\) must be one of"):
        plot_schedule(schedule="exp")


def test_curves_plot_train_and_valid_series(tmp_path: Path) -> None:
    write_metrics(tmp_path / "metrics.jsonl", TRAIN + VALID)
    figure = plot_curves(tmp_path)
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == ["Loss", "Perplexity", "Validation BLEU", "Learning rate"]
    loss = figure.axes[0]
    by_label = {line.get_label(): line for line in loss.lines}
    assert list(by_label["train loss (label-smoothed)"].get_xdata()) == [r["step"] for r in TRAIN]
    assert list(by_label["valid NLL"].get_ydata()) == [r["valid_nll"] for r in VALID]
    assert figure.axes[1].get_yscale() == "log"
    assert_image(save_figure(figure, tmp_path / "c.png", dpi=DPI), size_of(figure), DPI)

    no_bleu = [{k: v for k, v in r.items() if k != "valid_bleu"} for r in VALID]
    write_metrics(tmp_path / "metrics.jsonl", TRAIN + no_bleu)
    titles = [ax.get_title() for ax in plot_curves(tmp_path / "metrics.jsonl").axes]
    assert titles == ["Loss", "Perplexity", "Learning rate"]


def test_curves_of_a_run_still_writing_stop_at_the_last_complete_line(tmp_path: Path) -> None:
    partial = json.dumps(TRAIN[5])[:25]  # a record cut mid-write
    write_metrics(tmp_path / "metrics.jsonl", TRAIN[:5], tail=partial)
    figure = plot_curves(tmp_path)
    loss = figure.axes[0]
    [train] = [line for line in loss.lines if line.get_label() == "train loss (label-smoothed)"]
    assert list(train.get_xdata()) == [r["step"] for r in TRAIN[:5]]
    out = tmp_path / "curves.png"
    assert main(["plot", "curves", str(tmp_path), "-o", str(out), "--dpi", str(DPI)]) == 0
    assert_image(out, size_of(figure), DPI)


def test_curves_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "c.png")
    assert main(["plot", "curves", str(tmp_path / "nowhere"), "-o", out]) == 2
    assert "metrics log not found" in capsys.readouterr().err
    write_metrics(tmp_path / "metrics.jsonl", [], tail='{"type": "tra')
    assert main(["plot", "curves", str(tmp_path), "-o", out]) == 2
    assert "no complete training or validation record" in capsys.readouterr().err
    assert not Path(out).exists()


# -- files ---------------------------------------------------------------------------------------


def test_svg_is_xml_with_an_svg_root(tmp_path: Path, result: TranslationResult) -> None:
    for name, figure in [("a.svg", plot_attention(result)), ("lr.svg", plot_schedule())]:
        path = save_figure(figure, tmp_path / name)
        root = ET.parse(path).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_unsupported_formats_are_refused_listing_the_valid_ones(tmp_path: Path) -> None:
    for name in ("a.jpg", "a.pdf", "noext"):
        with pytest.raises(ValueError, match=r"use one of \.png, \.svg"):
            check_image_path(tmp_path / name)
    assert check_image_path("A.PNG") == Path("A.PNG")


# -- aiayn attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_attention_command_writes_the_picture(
    model_dir: Path,
    result: TranslationResult,
    kind: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / f"{kind}.png"
    argv = ["attention", "-m", str(model_dir), SENTENCE, "-o", str(out), "--kind", kind]
    assert main([*argv, *CLI_FAST]) == 0
    assert capsys.readouterr().out == result.text + "\n"
    assert_image(out, size_of(plot_attention(result, kind)), 40)


def test_attention_command_takes_words_and_writes_svg(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.svg"
    argv = ["attention", "-m", str(model_dir), *SENTENCE.split(), "-o", str(out), "--layer", "0"]
    assert main([*argv, *CLI_FAST, "--auto-scale"]) == 0
    assert ET.parse(out).getroot().tag.endswith("svg")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--layer", "2"],
            "layer 2 is out of range: the model has 2 decoder layers (valid: 0, 1, or -2, -1)",
        ),
        (["--kind", "encoder", "--layer", "-3"], "the model has 2 encoder layers"),
        (
            ["--head", "2"],
            "head 2 is out of range: the model has 2 heads per layer (valid: 0, 1, or -2, -1)",
        ),
        (["--kind", "cross", "--head", "5"], "head 5 is out of range"),
        (["-o", "x.jpg"], "unsupported image format ('.jpg'); use one of .png, .svg"),
    ],
)
def test_attention_command_bad_input_exits_2_listing_choices(
    model_dir: Path,
    tmp_path: Path,
    flags: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["attention", "-m", str(model_dir), SENTENCE, "-o", str(tmp_path / "a.png")]
    assert main([*argv, *CLI_FAST, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn attention: error:") and message in err
    assert not list(tmp_path.iterdir())


def test_unknown_attention_kind(
    model_dir: Path, result: TranslationResult, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", "-m", str(model_dir), SENTENCE, "-o", "a.png", "--kind", "self"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'self'" in err and all(k in err for k in ATTENTION_KINDS)
    with pytest.raises(ValueError, match="choose one of alignment, encoder, decoder, cross"):
        plot_attention(result, "self")
    with pytest.raises(ValueError, match="blank"):
        plot_attention(Translator(model_dir).translate([""], return_attention=True)[0])
    # The command line offers exactly the kinds the library draws.
    parser = build_parser()
    attention = parser._subparsers._group_actions[0].choices["attention"]
    [kind_action] = [a for a in attention._actions if a.dest == "kind"]
    assert tuple(kind_action.choices) == ATTENTION_KINDS


# -- aiayn plot -----------------------------------------------------------------------------------


def test_plot_positional_encoding_and_schedule_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pe = tmp_path / "pe.png"
    argv = ["plot", "positional-encoding", "--d-model", "64", "--length", "20", "-o", str(pe)]
    assert main([*argv, "--dpi", str(DPI)]) == 0
    assert_image(pe, size_of(plot_positional_encoding(64, 20)), DPI)

    lr = tmp_path / "lr.png"
    argv = ["plot", "schedule", "--d-model", "512", "--d-model", "256", "--warmup", "4000"]
    assert main([*argv, "--steps", "10000", "-o", str(lr), "--dpi", str(DPI)]) == 0
    assert_image(lr, size_of(plot_schedule()), DPI)
    argv = ["plot", "schedule", "--schedule", "linear", "--steps", "1000", "-o", str(lr)]
    assert main([*argv, "--dpi", str(DPI)]) == 0
    assert_image(lr, size_of(plot_schedule(schedule="linear")), DPI)
    parser = build_parser()
    argv = ["plot", "schedule", "--d-model", "512", "--warmup", "4000", "--lr-scale", "1"]
    args = parser.parse_args(
        [*argv, "--d-model", "128", "--warmup", "200", "--lr-scale", "0.5", "-o", "x.png"]
    )
    assert (args.d_model, args.warmup, args.lr_scale) == ([512, 128], [4000, 200], [1.0, 0.5])

    argv = ["plot", "schedule", "--d-model", "1", "--d-model", "2"]
    assert main([*argv, "--warmup", "1", "--warmup", "2", "--warmup", "3", "-o", str(lr)]) == 2
    assert (
        "given --d-model 2 times, --warmup 3 times, --lr-scale 1 time:" in capsys.readouterr().err
    )
    assert main(["plot", "positional-encoding", "-o", str(tmp_path / "pe.gif")]) == 2
    assert "use one of .png, .svg" in capsys.readouterr().err
