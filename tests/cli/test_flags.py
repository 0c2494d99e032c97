"""Tests for the flags `aiayn` generates from dataclasses: help from the attribute docs, defaults
from the fields (never restated), values layered on the dataclass defaults.

The commands themselves are tested in tests/cli/test_translate.py (translate, evaluate),
tests/cli/test_interop.py (export, import, --backend), test_plots.py (plot, attention) and
tests/integration (train).
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiayn.cli import (
    add_dataclass_flags,
    attribute_docs,
    build_parser,
    dataclass_from_args,
    main,
    train_config_from_args,
)
from aiayn.config import ConfigError, TrainConfig
from aiayn.decode.search import DecodingOptions

SEARCH_COMMANDS = ["translate", "evaluate", "serve", "attention"]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[command]


def flag_help(command: str) -> dict[str, str]:
    """Each option's help text as `--help` prints it (``%%`` unescaped)."""
    parser = subparser(command)
    texts = {}
    for action in parser._actions:
        if action.option_strings:
            flag = next(o for o in action.option_strings if o.startswith("--"))
            texts[flag] = parser._get_formatter()._expand_help(action)
    return texts


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


# -- help -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", *SEARCH_COMMANDS])
def test_every_flag_is_described(command: str) -> None:
    for flag, text in flag_help(command).items():
        assert text, f"{command} {flag} has no help"
        assert not text.startswith("(default"), f"{command} {flag} has only its default: {text}"


def test_decoding_flags_show_the_dataclass_defaults() -> None:
    help_texts = flag_help("translate")
    for f in dataclasses.fields(DecodingOptions):
        flag = "--" + f.name.replace("_", "-")
        if flag == "--n-best":  # translate's own: given or not selects the n-best format
            continue
        assert help_texts[flag].endswith(f"(default: {f.default})"), flag
        assert attribute_docs(DecodingOptions)[f.name] in help_texts[flag]


def test_train_flags_show_the_attribute_docs_and_defaults() -> None:
    help_texts = flag_help("train")
    docs = attribute_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":
            continue
        text = help_texts["--" + f.name.replace("_", "-")]
        default = "" if f.default is None else f" (default: {f.default})"
        assert text == f"{docs[f.name]}{default}"
    assert "Number of optimizer updates" in help_texts["--max-steps"]
    assert help_texts["--src"] == help_texts["--tgt"]  # documented together as "src, tgt:"


def test_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ["train", *SEARCH_COMMANDS]:
        with pytest.raises(SystemExit):
            parse(command, "--help")
    assert "(default: power)" in capsys.readouterr().out  # --length-penalty-kind


# -- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", SEARCH_COMMANDS)
def test_no_flags_give_the_dataclass_defaults(command: str) -> None:
    required = {
        "translate": [],
        "evaluate": ["--src", "s", "--ref", "r"],
        "serve": [],
        "attention": ["word", "-o", "x.png"],
    }[command]
    args = parse(command, "-m", "model", *required)
    assert dataclass_from_args(DecodingOptions, args) == DecodingOptions()


def test_decoding_flags_set_the_options() -> None:
    args = parse(
        "translate",
        "-m",
        "model",
        "--beam-size",
        "5",
        "--length-penalty",
        "1",
        "--length-penalty-kind",
        "power",
        "--max-len-a",
        "1.5",
        "--max-len-b",
        "10",
        "--n-best",
        "3",
        "--sampling",
        "--temperature",
        "0.5",
        "--top-k",
        "7",
        "--top-p",
        "0.9",
    )
    assert dataclass_from_args(DecodingOptions, args) == DecodingOptions(
        beam_size=5,
        length_penalty=1.0,
        length_penalty_kind="power",
        max_len_a=1.5,
        max_len_b=10.0,
        n_best=3,
        sampling=True,
        temperature=0.5,
        top_k=7,
        top_p=0.9,
    )
    assert args.n_best == 3 and parse("translate", "-m", "model").n_best is None


def test_a_choice_outside_the_literal_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("translate", "-m", "model", "--length-penalty-kind", "wu")
    assert "invalid choice: 'wu'" in capsys.readouterr().err


BIG = "9" * 400


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--time-budget", f"{BIG}h"],
            "time_budget ('99999999999999999999...999999999h') must be at most 366d",
        ),
        (["--time-budget", "400d"], "time_budget ('400d') must be at most 366d"),
        (
            ["--max-steps", BIG],
            "argument --max-steps: 99999999999999999999...9999999999 is too large",
        ),
        (
            ["--warmup-steps", str(2**60)],
            "argument --warmup-steps: 1152921504606846976 is too large",
        ),
        (["--lr-scale", "inf"], "argument --lr-scale: inf is not a finite number"),
        (["--lr-scale", "1e400"], "argument --lr-scale: 1e400 is not a finite number"),
        (["--label-smoothing", "nan"], "argument --label-smoothing: nan is not a finite number"),
    ],
)
def test_an_infinite_or_absurd_number_is_refused_before_anything_is_written(
    tmp_path: Path, flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 400-digit number of hours is infinite as a float: refused when the flag is read, one
    line naming it, exit 2, and no run directory (not a traceback once the run has started)."""
    (tmp_path / "a.en").write_text("a b\n")
    (tmp_path / "a.de").write_text("c d\n")
    run = tmp_path / "run"
    argv = ["train", "--src", str(tmp_path / "a.en"), "--tgt", str(tmp_path / "a.de")]
    argv += ["--out-dir", str(run), "--max-steps", "1", "--no-progress", *flags]
    try:
        status = main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert err[-1].startswith("aiayn train: error: ") and said in err[-1], err
    assert not run.exists()


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        (f"max_steps: {BIG}", "max_steps (99999999999999999999...9999999999) is too large"),
        ("lr_scale: 1.0e+400", "lr_scale (inf) is not a finite number"),
        ("label_smoothing: .nan", "label_smoothing (nan) is not a finite number"),
        ("warmup_steps: 1.0e+300", "warmup_steps (1e+300) must be of type int"),
        ("adam_eps: 1.0e+300", "adam_eps (1e+300) is too large (at most 2^53)"),
        (f"model: {{d_model: {BIG}}}", "model: d_model (99999999999999999999...9999999999) is"),
    ],
)
def test_an_infinite_or_absurd_number_in_a_yaml_config_is_refused_before_anything_is_written(
    tmp_path: Path, lines: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same numbers in ``-c FILE`` as in flags: one line naming the file and the field
    (its value shortened), exit 2, no run directory."""
    (tmp_path / "a.en").write_text("a b\n")
    (tmp_path / "a.de").write_text("c d\n")
    config = tmp_path / "train.yaml"
    config.write_text(f"src: {tmp_path / 'a.en'}\ntgt: {tmp_path / 'a.de'}\n{lines}\n")
    run = tmp_path / "run"
    status = main(["train", "-c", str(config), "--out-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith(f"aiayn train: error: {config}: {said}"), err
    assert len(err[0]) < 200 and not run.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["translate", "-m", "m", "--n-best", BIG], "argument --n-best: 9999"),
        (["translate", "-m", "m", "--seed", BIG], "argument --seed: 9999"),
        (["translate", "-m", "m", "--max-tokens", BIG], "argument --max-tokens: 9999"),
        (["evaluate", "-m", "m", "--src", "s", "--threads", BIG], "argument --threads: 9999"),
        (["attention", "-m", "m", "--layer", BIG], "argument --layer: 9999"),
        (["plot", "schedule", "-o", "x.png", "--lr-scale", "inf"], "inf is not a finite"),
        (["plot", "positional-encoding", "-o", "x.png", "--length", BIG], "--length: 9999"),
        (["serve", "-m", "m", "--port", BIG], "argument --port: 9999"),
        (["serve", "-m", "m", "--port", "70000"], "--port: 70000 is not a port (0 to 65535)"),
        (["export", "m", "--to", "onnx", "-o", "x", "--opset", BIG], "--opset: 9999"),
    ],
)
def test_every_number_flag_refuses_an_absurd_number(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hand-written number flags (not made from a dataclass) refuse what the generated ones
    refuse: one line naming the flag, exit 2, before a model is looked for."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert said in err[-1] and ("too large" in err[-1] or "not a" in err[-1]), err


def test_train_flags_go_over_the_yaml_file(tmp_path: Path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("src: a.en\ntgt: a.de\nmax_steps: 10\nprogress: true\nmodel: {d_ff: 64}\n")
    args = parse(
        "train", "-c", str(config), "--max-steps", "20", "--no-progress", "--model", "n_heads=2"
    )
    resolved = train_config_from_args(args)
    assert (resolved.src, resolved.max_steps, resolved.progress) == ("a.en", 20, False)
    assert resolved.model == {"d_ff": 64, "n_heads": 2}
    assert resolved.warmup_steps == TrainConfig.warmup_steps  # neither file nor flag: default


def test_train_batches_default_to_the_papers_update_on_cuda_and_stay_on_a_cpu(
    tmp_path: Path,
) -> None:
    """Unsized by file and flags, a run on CUDA takes the paper's ~25,000 target tokens an
    update in batches of 12,500 (two on one GPU); on a CPU, `TrainConfig`'s 4096 and no
    accumulation. A size given anywhere is kept, and a given --accumulate is not overridden
    by the default --tokens-per-update. No GPU is needed: nothing asks for one here."""

    def batches(*flags: str) -> tuple[int, int, int]:
        c = train_config_from_args(parse("train", "--src", "a", "--tgt", "b", *flags))
        return c.max_tokens, c.tokens_per_update, c.accumulate

    cpu = (TrainConfig.max_tokens, TrainConfig.tokens_per_update, TrainConfig.accumulate)
    assert cpu == (4096, 0, 1)
    assert batches("--device", "cpu") == cpu
    assert batches("--device", "cuda") == (12_500, 25_000, 1)
    assert batches("--device", "cuda:1") == (12_500, 25_000, 1)
    assert batches("--device", "cuda", "--max-tokens", "4096") == (4096, 25_000, 1)
    assert batches("--device", "cuda", "--accumulate", "3") == (12_500, 0, 3)
    assert batches("--device", "cuda", "--tokens-per-update", "50000") == (12_500, 50_000, 1)
    recipe = tmp_path / "train.yaml"
    recipe.write_text("max_tokens: 2048\naccumulate: 1\n")
    assert batches("-c", str(recipe), "--device", "cuda") == (2048, 0, 1)
    assert batches("--device", "cuda") != batches("--device", "cpu")


def test_train_reads_a_time_budget_schedule_average_and_precision_from_flags_or_yaml(
    tmp_path: Path,
) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("src: a.en\ntgt: a.de\ntime_budget: 30m\nschedule: cosine\n")
    resolved = train_config_from_args(parse("train", "-c", str(config), "--ema-decay", "0.999"))
    assert (resolved.time_budget, resolved.budget_seconds, resolved.schedule) == (
        "30m",
        1800,
        "cosine",
    )
    assert resolved.ema_decay == 0.999
    flags = ["train", "--src", "a", "--tgt", "b", "--time-budget", "90s", "--precision", "fp32"]
    resolved = train_config_from_args(parse(*flags))
    assert (resolved.budget_seconds, resolved.precision, resolved.schedule) == (90, "fp32", "auto")
    # A recipe's budget dropped from the command line: Eq. 3 again.
    resolved = train_config_from_args(parse("train", "-c", str(config), "--time-budget", "none"))
    assert (resolved.time_budget, resolved.budget_seconds) == (None, None)
    with pytest.raises(SystemExit):
        parse("train", "--src", "a", "--tgt", "b", "--precision", "fp16")


@pytest.mark.parametrize(
    ("flags", "precision"),
    [(["--cpu-bf16"], "bf16"), (["--no-bf16"], "fp32"), (["--bf16"], "auto"),
     (["--no-cpu-bf16"], "auto"), (["--no-bf16", "--no-cpu-bf16"], "fp32")],
)  # fmt: skip
def test_the_precision_flags_of_earlier_releases_still_work(
    flags: list[str], precision: str
) -> None:
    resolved = train_config_from_args(parse("train", "--src", "a", "--tgt", "b", *flags))
    assert resolved.precision == precision


def test_old_precision_flags_with_precision_are_refused_and_flags_go_over_an_old_file(
    tmp_path: Path,
) -> None:
    args = parse("train", "--src", "a", "--tgt", "b", "--cpu-bf16", "--precision", "fp32")
    with pytest.raises(ConfigError, match=r"--cpu-bf16 and --precision both given"):
        train_config_from_args(args)
    config = tmp_path / "old.yaml"
    config.write_text("src: a.en\ntgt: a.de\ncpu_bf16: true\n")  # an earlier release's file
    assert train_config_from_args(parse("train", "-c", str(config))).precision == "bf16"
    args = parse("train", "-c", str(config), "--precision", "fp32")
    assert train_config_from_args(args).precision == "fp32"  # flags win, as for any key


# -- the generator ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """Something with options.

    Attributes:
        width, height: Size in pixels, a description
            that goes on.
        name: What to call it (50% of the time).

    Raises:
        Nothing: this section is not read.
    """

    width: int = 3
    height: int | None = None
    name: str = "x"
    undocumented: float = 1.0


def test_attribute_docs_read_grouped_names_and_continuation_lines() -> None:
    assert attribute_docs(Example) == {
        "width": "Size in pixels, a description that goes on.",
        "height": "Size in pixels, a description that goes on.",
        "name": "What to call it (50% of the time).",
    }


def test_an_undocumented_field_gets_no_flag() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match=r"Example\.undocumented has no description"):
        add_dataclass_flags(parser, Example)
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Example, skip={"undocumented"})
    assert dataclass_from_args(Example, parser.parse_args(["--height", "4"])) == Example(height=4)
    assert "(50%% of the time)" in parser._actions[-1].help  # escaped for argparse


def test_building_the_flags_imports_no_torch() -> None:
    # `aiayn --help` and the commands that do not decode stay fast (~0.2 s instead of ~2 s).
    code = "import sys, aiayn.cli; aiayn.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def every_command(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for every command and sub-command: ("plot", "schedule"), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_command(sub, (*path, name))
            return
    yield path, parser


def test_every_command_documents_every_flag() -> None:
    commands = dict(every_command(build_parser()))
    assert {"export", "import", "serve", ("plot", "schedule")} <= {
        c[0] if len(c) == 1 else c for c in commands
    }
    for command, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            text = formatter._expand_help(action) if action.help else ""
            where = f"aiayn {' '.join(command)} {name}"
            assert text.strip(), f"{where} has no help"
            assert not text.startswith("(default"), f"{where} has only its default: {text}"
            assert "(default: None)" not in text, f"{where}: {text}"
            assert "``" not in text and ":mod:" not in text, f"{where} shows markup: {text}"


HELP_OF_EVERY_COMMAND = """
import contextlib, io, sys
from aiayn.cli import main
for command in sys.argv[1:]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([*command.split(), "--help"])
print("torch" in sys.modules)
"""


def test_help_of_every_command_imports_no_torch() -> None:
    commands = [" ".join(command) for command, _ in every_command(build_parser())]
    run = [sys.executable, "-c", HELP_OF_EVERY_COMMAND, *commands]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# -- did you mean -----------------------------------------------------------------------------


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The lines `aiayn.cli.main` prints to stderr before exiting with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trian"], "aiayn: error: unknown command 'trian'; did you mean 'train'?"),
        (
            ["plot", "shedule"],
            "aiayn plot: error: unknown command 'shedule'; did you mean 'schedule'?",
        ),
        (["xyzzy"], "aiayn: error: unknown command 'xyzzy'; choose from info, train, average,"),
    ],
)
def test_a_misspelt_command_gets_the_closest_one(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = error_of(argv, capsys)
    assert lines[-1].startswith(message)
    assert lines[0].startswith(f"usage: aiayn {' '.join(argv[:-1])}".rstrip() + " [-h]")


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        # a prefix is no longer taken for the flag (allow_abbrev=False): it is corrected
        (["train", "--max-step", "5"], "; did you mean '--max-steps'?"),
        (["train", "--max-stpes=5"], "; did you mean '--max-steps'?"),
        (
            ["train", "--max-stpes", "5", "--sed", "3"],
            "; did you mean '--max-steps' for '--max-stpes', '--seed' for '--sed'?",
        ),
        (["plot", "schedule", "--warmpu", "4", "-o", "x.png"], "; did you mean '--warmup'?"),
    ],
)
def test_a_misspelt_flag_gets_the_closest_one_with_the_subcommands_usage(
    argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = error_of(argv, capsys)
    command = " ".join(a for a in argv if not a.startswith("-") and a.isalpha())
    assert lines[0].startswith(f"usage: aiayn {command} [-h]")
    assert lines[-1].startswith(f"aiayn {command}: error: unrecognized arguments: ")
    assert lines[-1].endswith(suggestion)


def test_a_misspelt_required_flag_is_suggested_too(capsys: pytest.CaptureFixture[str]) -> None:
    [*_, last] = error_of(["translate", "--modle-dir", "m"], capsys)
    assert last == (
        "aiayn translate: error: the following arguments are required: -m/--model-dir; "
        "did you mean '--model-dir'?"
    )


def test_an_extra_argument_with_no_close_flag_gets_no_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    [*_, last] = error_of(["info", "extra", "--zzzzzz"], capsys)
    assert last == "aiayn info: error: unrecognized arguments: extra --zzzzzz"
