"""The `aiayn` command: info, train, average, translate, evaluate, serve, demo, attention, plot,
prepare.

Each subcommand is a small function that turns flags into explicit arguments for the library;
errors that a user can fix (bad config, bad data, missing files) are printed as one clear line
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import inspect
import logging
import os
import re
import signal
import sys
import types
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from aiayn import __version__
from aiayn.decoding_options import DecodingOptions  # no torch: --help stays fast

logger = logging.getLogger("aiayn")

T = TypeVar("T")


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
    p.add_argument("--preset", default="base", help="preset name (base, big, small, tiny, demo)")
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
    from aiayn.describe import describe
    from aiayn.model import Transformer

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
    add_dataclass_flags(p, TrainConfig, skip={"model"})
    p.add_argument(
        "--model",
        action="append",
        metavar="FIELD=VALUE",
        help="override a model field, e.g. --model d_model=256 (repeatable)",
    )
    p.set_defaults(run=_run_train)


def train_config_from_args(args: argparse.Namespace) -> Any:
    """YAML file values, then flag values on top; validated as a `TrainConfig`."""
    from aiayn.config import TrainConfig, load_yaml_config

    values: dict[str, Any] = load_yaml_config(args.config) if args.config else {}
    source = args.config or "flags"
    if args.model:
        merged = dict(values.get("model") or {})
        merged.update(_parse_assignments(args.model, "--model"))
        values["model"] = merged
    values.update(dataclass_values(TrainConfig, args, skip={"model"}))
    return TrainConfig.from_dict(values, source=source)


def _run_train(args: argparse.Namespace) -> int:
    from aiayn.trainer import train

    config = train_config_from_args(args)
    result = train(config, resume=args.resume)
    # A run stopped by a signal exits as the shell reports one: 128 + its number (143 for
    # SIGTERM, 130 for SIGINT), which schedulers and wrappers read as "stopped, not failed".
    status = 128 + (result.stop_signal or signal.SIGINT) if result.interrupted else 0
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone reports
        return status
    if result.interrupted:
        print(
            f"interrupted at step {result.step}; continue with: aiayn train --resume "
            f"--out-dir {result.run_dir} ...",
            file=sys.stderr,
        )
        return status
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

    ckpt.check_replaceable(args.output)  # refused before averaging, not after
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


# -- translate ------------------------------------------------------------------------------


# Flags of `DecodingOptions` fields: the search ones are shared by translate, evaluate, serve
# and attention; the sampling ones are translate's (with its own --n-best).
_SEARCH_FIELDS = ("beam_size", "length_penalty", "length_penalty_kind", "max_len_a", "max_len_b")
_SAMPLING_FIELDS = ("sampling", "temperature", "top_k", "top_p")


def _add_search_options(p: argparse.ArgumentParser) -> None:
    """Model loading and beam search flags shared by `translate`, `evaluate`, `serve` and
    `attention`."""
    p.add_argument("-m", "--model-dir", required=True, help="model directory (or run directory)")
    g = p.add_argument_group("search (defaults are the paper's, §6.1)")
    add_dataclass_flags(g, DecodingOptions, only=_SEARCH_FIELDS)
    g = p.add_argument_group("model")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="batch budget: padded source tokens x beam size (default 4096)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (default: PyTorch's)")
    g.add_argument(
        "--int8",
        action="store_true",
        help="int8 dynamic quantization of the linear layers (CPU only; faster, see "
        "BENCHMARKS.md for the effect on BLEU)",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="run the model in bfloat16 (faster on GPUs and CPUs with native bf16; see "
        "BENCHMARKS.md for the effect on BLEU)",
    )


def _load_translator(args: argparse.Namespace) -> Any:
    import torch

    from aiayn.translator import Translator

    device, int8 = args.device, getattr(args, "int8", False)
    if device == "auto":
        device = "cpu" if int8 or not torch.cuda.is_available() else "cuda"
    return Translator(
        args.model_dir,
        device=device,
        max_tokens=args.max_tokens,
        threads=args.threads,
        int8=int8,
        bf16=getattr(args, "bf16", False),
    )


def _search_options(args: argparse.Namespace) -> DecodingOptions:
    """The `DecodingOptions` of the flags given (every field a command has no flag for keeps
    its default)."""
    return dataclass_from_args(DecodingOptions, args)


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text, one sentence per line",
        description="Translate a file or stdin, one sentence per line, into a file or stdout: "
        "one output line per input line, in input order, empty lines kept empty. With a "
        "terminal on stdin and no -i, translate interactively. Sentences longer than the model "
        "accepts (max_positions - 1 tokens) are truncated with a warning.",
        epilog="--n-best N writes N lines per input line, best first, in the Moses/fairseq "
        "n-best style 'i ||| text ||| score': i is the 0-based input line number and score "
        "the hypothesis' log-probability divided by the length penalty (the plain "
        "log-probability for greedy search and sampling). An empty input line gives one "
        "line 'i |||  ||| 0.0000'. --alignment appends to each output line a tab and hard "
        "word alignments in the Pharaoh format of fast_align and Moses: space-separated "
        "'i-j' pairs, i the 0-based source position and j the 0-based target position, "
        "counted in subword pieces (SentencePiece pieces, not words). Each output token is "
        "aligned to the source piece it attends to most (encoder-decoder attention of "
        "--alignment-layer, averaged over heads); the EOS of source and output are left out, "
        "so there is one pair per output piece. Tabs in the translation become spaces. An "
        "empty input line gives a line with only the tab.",
    )
    p.add_argument("-i", "--input", help="input file (default: stdin; '-' = stdin)")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument(
        "--n-best", type=int, metavar="N", help="write the N best hypotheses in n-best format"
    )
    p.add_argument(
        "--alignment",
        action="store_true",
        help="append a tab and source-target word alignments 'i-j ...' (see below)",
    )
    p.add_argument(
        "--alignment-layer",
        type=int,
        default=-1,
        metavar="L",
        help="decoder layer whose attention gives the alignments; 0-based, negative counts "
        "from the end (default -1, the last)",
    )
    _add_search_options(p)
    g = p.add_argument_group("sampling (instead of beam search)")
    add_dataclass_flags(g, DecodingOptions, only=_SAMPLING_FIELDS)
    g.add_argument("--seed", type=int, help="seed for reproducible samples")
    p.set_defaults(run=_run_translate)


def _run_translate(args: argparse.Namespace) -> int:
    from aiayn.data import count_lines
    from aiayn.translator import read_lines

    from_file = args.input not in (None, "-")
    if from_file and not Path(args.input).is_file():
        raise FileNotFoundError(f"input file {args.input} does not exist")
    if from_file and args.output and Path(args.output).resolve() == Path(args.input).resolve():
        raise ValueError(f"refusing to write the translation over its input {args.input}")
    if args.alignment and args.n_best is not None:
        raise ValueError("--alignment cannot be combined with --n-best")
    options = {
        "options": _search_options(args),  # with --n-best and the sampling flags
        "return_attention": args.alignment,
        "seed": args.seed,
    }
    translator = _load_translator(args)
    translator.translate([], **options)  # checks the options before reading any input
    alignment_layer = None
    if args.alignment:
        from aiayn.alignment import check_index

        n_layers = translator.model.config.n_decoder_layers
        alignment_layer = check_index(args.alignment_layer, n_layers, "layer", "decoder layers")

    if args.input is None and sys.stdin.isatty():
        return _translate_interactively(translator, options, args.n_best, alignment_layer)
    lines = read_lines(args.input) if from_file else read_lines(sys.stdin.buffer, name="<stdin>")
    results = translator.translate_iterable(lines, **options)
    if from_file and sys.stderr.isatty():
        from tqdm import tqdm

        results = tqdm(results, total=count_lines(Path(args.input)), unit="line", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        out = sys.stdout
        if args.output:
            out = stack.enter_context(open(args.output, "w", encoding="utf-8", newline="\n"))
        for number, result in enumerate(results):
            out.write(_format_translation(number, result, args.n_best, alignment_layer))
        out.flush()
    return 0


def _translate_interactively(
    translator: Any, options: dict[str, Any], n_best: int | None, alignment_layer: int | None
) -> int:
    """A '> ' prompt on stderr, each translation on stdout, until end of input (Ctrl-D)."""
    print("Type a sentence and press Enter; Ctrl-D to quit.", file=sys.stderr)
    number = 0
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            print(file=sys.stderr)
            return 0
        [result] = translator.translate([line], **options)
        sys.stdout.write(_format_translation(number, result, n_best, alignment_layer))
        sys.stdout.flush()
        number += 1


def _format_translation(
    number: int, result: Any, n_best: int | None, alignment_layer: int | None = None
) -> str:
    """One line of text, or with --n-best one 'i ||| text ||| score' line per hypothesis, or
    with --alignment 'text<TAB>i-j i-j ...'."""
    from aiayn.translator import one_line

    if alignment_layer is not None:
        from aiayn.alignment import format_alignment, hard_alignment

        pairs = hard_alignment(result, layer=alignment_layer)
        return f"{one_line(result.text).replace(chr(9), ' ')}\t{format_alignment(pairs)}\n"
    if n_best is None:
        return one_line(result.text) + "\n"
    return "".join(
        f"{number} ||| {one_line(h.text)} ||| {h.score:.4f}\n" for h in result.hypotheses
    )


# -- evaluate -------------------------------------------------------------------------------


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="translate a test set and score it with sacreBLEU (BLEU, chrF)",
        description="Translate --src, write the hypotheses, and print corpus BLEU and chrF "
        "against one or more references, with sacreBLEU signatures.",
    )
    p.add_argument("--src", required=True, help="source sentences, one per line")
    p.add_argument(
        "--ref",
        action="append",
        required=True,
        help="reference translations, line-aligned with --src (repeat for several)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="where to write the hypotheses (default: <name of --src>.hyp in the current "
        "directory)",
    )
    p.add_argument("--tokenize", help="sacreBLEU tokenizer for BLEU (default 13a; zh, intl...)")
    p.add_argument(
        "--tokenized-bleu",
        action="store_true",
        help="also print tokenized BLEU with compound splitting, as the paper reported on EN-DE "
        "(13a tokenization approximating Moses; not comparable with sacreBLEU)",
    )
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    _add_search_options(p)
    p.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    import json

    from aiayn.evaluation import evaluate_files, tokenized_bleu
    from aiayn.translator import read_lines

    out_path = Path(args.output) if args.output else Path.cwd() / f"{Path(args.src).name}.hyp"
    for path in (args.src, *args.ref):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
    translator = _load_translator(args)
    scores = evaluate_files(
        translator,
        args.src,
        args.ref,
        out_path=out_path,
        tokenize=args.tokenize,
        options=_search_options(args),
    )
    tokenized = None
    if args.tokenized_bleu:
        tokenized = tokenized_bleu(
            [line.strip() for line in read_lines(out_path)],
            [[line.strip() for line in read_lines(path)] for path in args.ref],
        )
    if args.json:
        report = {
            **scores.to_dict(),
            "hypotheses_file": str(out_path),
            "model_dir": str(translator.model_dir),
        }
        if tokenized is not None:
            report["tokenized_bleu"] = tokenized.bleu
            report["tokenized_bleu_label"] = tokenized.label
            report["tokenized_bleu_text"] = tokenized.bleu_text
        print(json.dumps(report, indent=2))
    else:
        print(scores)
        if tokenized is not None:
            print(tokenized)
    return 0


# -- serve ----------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP: JSON API, LibreTranslate API and a web page",
        description="Serve translations over HTTP: POST /translate (aiayn's JSON API, and "
        "LibreTranslate's), GET /languages, POST /detect, GET /info, GET /health, the OpenAPI "
        "schema at /openapi.json, and at / a web page that translates and draws the "
        "attention. Concurrent requests are batched into one model call. The search flags "
        "set the defaults that requests may override (beam size, n-best, length penalty).",
    )
    _add_search_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )
    g = p.add_argument_group("batching")
    g.add_argument(
        "--batch-wait-ms",
        type=float,
        help="how long a request may wait for others to join its model call; no wait while "
        "requests come one at a time (default 5)",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        help="budget of one model call over merged requests: source tokens x beam size "
        "(default 4096); --max-tokens then cuts the call into padded batches",
    )
    g.add_argument(
        "--no-batching", action="store_true", help="one model call per request (to compare)"
    )
    g = p.add_argument_group("limits (a request over one gets a 4xx error naming it)")
    g.add_argument("--max-chars", type=int, help="characters per text (default 5000)")
    g.add_argument("--max-texts", type=int, help="texts per request (default 64)")
    g.add_argument("--max-queue", type=int, help="requests waiting for the model (default 256)")
    g.add_argument("--max-beam-size", type=int, help="largest beam a request may ask (16)")
    g.add_argument("--max-body-bytes", type=int, help="request body size (default 4 MiB)")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from aiayn.serve import Decoding, ServerSettings, serve

    given = {
        name: getattr(args, name)
        for name in (
            "batch_wait_ms",
            "max_batch_tokens",
            "max_chars",
            "max_texts",
            "max_queue",
            "max_beam_size",
            "max_body_bytes",
        )
        if getattr(args, name) is not None
    }
    options = _search_options(args)
    decoding = Decoding(**{name: getattr(options, name) for name in _SEARCH_FIELDS})
    settings = ServerSettings(decoding=decoding, batching=not args.no_batching, **given)
    translator = _load_translator(args)
    translator.translate(["a"], beam_size=1, max_len_a=0, max_len_b=1)  # fail before listening
    serve(translator, settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0


# -- attention ------------------------------------------------------------------------------


def _add_attention(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attention",
        help="translate a sentence and draw its attention maps (PNG or SVG)",
        description="Translate one sentence and draw its attention with the subword pieces on "
        "the axes. --kind alignment (default): encoder-decoder attention of one layer averaged "
        "over heads, output (rows) x source (columns). encoder, decoder, cross: a grid of "
        "every layer x head of encoder self-attention, masked decoder self-attention or "
        "encoder-decoder attention. The format comes from the suffix of -o (.png, .svg).",
    )
    p.add_argument("sentence", nargs="+", help="the sentence (quoted, or as several words)")
    p.add_argument("-o", "--output", required=True, help="image file, .png or .svg")
    p.add_argument(
        "--kind",
        choices=["alignment", "encoder", "decoder", "cross"],
        default="alignment",
        help="which attention to draw (default: alignment)",
    )
    p.add_argument(
        "--layer",
        type=int,
        help="0-based layer, negative from the end (default: the last for alignment, every "
        "layer for grids)",
    )
    p.add_argument(
        "--head", type=int, help="one head (default: mean over heads / every head in grids)"
    )
    p.add_argument(
        "--auto-scale",
        action="store_true",
        help="colours from 0 to the largest weight shown (default: a fixed 0 to 1, the same in "
        "every picture)",
    )
    p.add_argument("--dpi", type=int, default=150, help="image resolution (default 150)")
    _add_search_options(p)
    p.set_defaults(run=_run_attention)


def _run_attention(args: argparse.Namespace) -> int:
    from aiayn.plots import check_image_path, plot_attention, save_figure
    from aiayn.translator import one_line

    output = check_image_path(args.output)  # before the slow part
    translator = _load_translator(args)
    sentence = " ".join(args.sentence)
    [result] = translator.translate([sentence], _search_options(args), return_attention=True)
    figure = plot_attention(
        result, args.kind, layer=args.layer, head=args.head, auto_scale=args.auto_scale
    )
    save_figure(figure, output, dpi=args.dpi)
    print(one_line(result.text))
    logger.info("wrote %s", output)
    return 0


# -- plot -----------------------------------------------------------------------------------


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw positional encodings, the learning-rate schedule or training curves",
        description="Draw a picture as PNG or SVG (from the suffix of -o).",
    )
    what = p.add_subparsers(dest="what", required=True, metavar="WHAT")

    pe = what.add_parser(
        "positional-encoding", help="the sinusoids of §3.5: position x dimension heatmap"
    )
    pe.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    pe.add_argument("--length", type=int, default=100, help="positions (default 100)")
    pe.add_argument(
        "--dims",
        type=int,
        nargs="*",
        metavar="I",
        help="dimensions to draw as curves (default 0, 1, d/8, d/4; none: heatmap only)",
    )
    pe.set_defaults(run=_run_plot_positional_encoding)

    sc = what.add_parser("schedule", help="the learning-rate schedule of Eq. 3")
    sc.add_argument(
        "--d-model",
        type=int,
        action="append",
        help="model width (default 512); repeat, with --warmup, to compare several",
    )
    sc.add_argument(
        "--warmup", type=int, action="append", help="warmup steps (default 4000); repeatable"
    )
    sc.add_argument("--steps", type=int, default=100_000, help="steps (default 100000)")
    sc.add_argument(
        "--lr-scale",
        "--scale",
        type=float,
        action="append",
        help="factor on Eq. 3, train's --lr-scale (default 1.0); repeatable, pairs like --warmup",
    )
    sc.set_defaults(run=_run_plot_schedule)

    cu = what.add_parser("curves", help="loss, perplexity, BLEU and learning rate of a run")
    cu.add_argument("run_dir", help="run directory (or its metrics.jsonl)")
    cu.set_defaults(run=_run_plot_curves)

    for q in (pe, sc, cu):
        q.add_argument("-o", "--output", required=True, help="image file, .png or .svg")
        q.add_argument("--dpi", type=int, default=150, help="image resolution (default 150)")


def _save_plot(args: argparse.Namespace, draw: Any) -> int:
    from aiayn.plots import check_image_path, save_figure

    output = check_image_path(args.output)
    save_figure(draw(), output, dpi=args.dpi)
    logger.info("wrote %s", output)
    return 0


def _run_plot_positional_encoding(args: argparse.Namespace) -> int:
    from aiayn.plots import plot_positional_encoding

    return _save_plot(
        args, lambda: plot_positional_encoding(args.d_model, args.length, dims=args.dims)
    )


def _run_plot_schedule(args: argparse.Namespace) -> int:
    from aiayn.plots import plot_schedule

    given = {
        "--d-model": args.d_model or [512],
        "--warmup": args.warmup or [4000],
        "--lr-scale": args.lr_scale or [1.0],
    }
    n_curves = max(len(values) for values in given.values())
    if any(len(values) not in (1, n_curves) for values in given.values()):
        counts = ", ".join(f"{flag} {len(v)} time{'s' * (len(v) > 1)}" for flag, v in given.items())
        raise ValueError(
            f"given {counts}: give each the same number of times (they pair up), or once"
        )
    columns = [values * (n_curves // len(values)) for values in given.values()]
    settings = list(zip(*columns, strict=True))
    return _save_plot(args, lambda: plot_schedule(settings, steps=args.steps))


def _run_plot_curves(args: argparse.Namespace) -> int:
    from aiayn.plots import plot_curves

    return _save_plot(args, lambda: plot_curves(args.run_dir))


# -- prepare --------------------------------------------------------------------------------


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    from aiayn.prepare import DEFAULT_MAX_CHARS
    from aiayn.prepare.bible import DEFAULT_SWORD_DIR

    p = sub.add_parser(
        "prepare",
        help="download and clean a parallel corpus into files that `aiayn train` reads",
        description="Write line-aligned {split}.{lang} files (UTF-8, NFC, one sentence per "
        "line) and manifest.json into OUT_DIR. See docs/reproducing.md.",
    )
    what = p.add_subparsers(dest="what", required=True, metavar="CORPUS")
    wmt = what.add_parser("wmt14-en-de", help="WMT14 EN→DE (wmt/wmt14 de-en, HF Hub)")
    iwslt = what.add_parser("iwslt14-de-en", help="IWSLT DE→EN (IWSLT/iwslt2017, HF Hub)")
    hf = what.add_parser("hf", help="any translation dataset of the HF Hub")
    hf.add_argument("dataset", help="dataset id, e.g. wmt/wmt16")
    hf.add_argument("config", help="configuration, e.g. ro-en")
    hf.add_argument("--src-lang", required=True, help="source key of 'translation'")
    hf.add_argument("--tgt-lang", required=True, help="target key of 'translation'")
    hf.add_argument("--revision", help="branch, tag or commit of the dataset")
    hf.add_argument(
        "--parquet-export",
        action="store_true",
        help="read the Hub's Parquet export (for datasets with only a loading script)",
    )
    bible = what.add_parser("bible-en-es", help="Bible EN→ES from Debian's SWORD modules")
    bible.add_argument(
        "--sword-dir", default=str(DEFAULT_SWORD_DIR), help=f"(default {DEFAULT_SWORD_DIR})"
    )
    for q in (wmt, iwslt, hf):
        q.add_argument(
            "--data-dir",
            "--from-disk",
            help="read a local copy: a save_to_disk folder, or Parquet/JSON files per split",
        )
        q.add_argument("--cache-dir", help="download cache of `datasets` (default: its own)")
    for q in (wmt, iwslt, hf, bible):
        q.add_argument("out_dir", metavar="OUT_DIR", help="output folder")
        q.add_argument(
            "--max-chars",
            type=int,
            default=DEFAULT_MAX_CHARS,
            help=f"drop training pairs with a longer side; 0 = no limit ({DEFAULT_MAX_CHARS})",
        )
        q.add_argument("--force", action="store_true", help="overwrite a prepared corpus")
        q.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from aiayn.prepare import describe_manifest

    options = dict(max_chars=args.max_chars, force=args.force)
    if args.what == "bible-en-es":
        from aiayn.prepare.bible import prepare_bible

        manifest = prepare_bible(args.out_dir, sword_dir=Path(args.sword_dir), **options)
    else:
        from aiayn.prepare.hf import RECIPES, HubSource, Recipe, prepare_hub

        recipe = RECIPES.get(args.what) or Recipe(
            HubSource(
                args.dataset,
                args.config,
                revision=args.revision,
                parquet_export=args.parquet_export,
            ),
            src_lang=args.src_lang,
            tgt_lang=args.tgt_lang,
        )
        manifest = prepare_hub(
            recipe.source,
            args.out_dir,
            src_lang=recipe.src_lang,
            tgt_lang=recipe.tgt_lang,
            data_dir=args.data_dir,
            cache_dir=args.cache_dir,
            **options,
        )
    print(describe_manifest(manifest, args.out_dir))
    return 0


# -- demo -----------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole job offline: numbers in English words → German, trained and evaluated",
    )
    p.add_argument("-o", "--out-dir", default="demo_run", help="output directory (demo_run)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer updates")
    p.add_argument("--seed", type=int, default=1, help="seed (default 1)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from aiayn.demo import DemoStopped, format_report, run_demo

    options = {} if args.max_steps is None else {"max_steps": args.max_steps}
    try:
        result = run_demo(args.out_dir, seed=args.seed, **options)
    except DemoStopped as stopped:
        print(stopped, file=sys.stderr)
        return 128 + (stopped.signum or signal.SIGINT)
    print(format_report(result))
    return 0


# -- helpers --------------------------------------------------------------------------------


def attribute_docs(cls: type) -> dict[str, str]:
    """Each attribute's description in the ``Attributes:`` section of ``cls``'s Google-style
    docstring, continuation lines joined. An entry may describe several attributes at once
    (``src, tgt: Line-aligned training files.``)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    entry_indent = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next section
            break
        entry_indent = entry_indent or indent
        entry = re.fullmatch(r"(\w+(?:, \w+)*):\s*(.*)", text)
        if indent == entry_indent and entry:
            names = entry.group(1).split(", ")
            for name in names:
                docs[name] = entry.group(2)
        else:
            for name in names:
                docs[name] = f"{docs[name]} {text}".strip()
    return docs


def _flag_type(name: str, hint: Any) -> dict[str, Any]:
    """argparse keywords for a field annotated ``hint``: int, float, str, bool (--x/--no-x),
    a Literal (choices), or one of these ``| None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return {"type": type(choices[0]), "choices": choices}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"no command-line flag for field {name} of type {hint}")


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Sequence[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Adds a ``--field-name`` flag for each field of the dataclass ``cls``: those in ``only``
    (in that order), or else all but ``skip``.

    The type comes from the annotation (see :func:`_flag_type`). The help is the field's
    description in the class's ``Attributes:`` docstring (:func:`attribute_docs`) followed by
    "(default: X)" read from the field, so it cannot go stale; a field without a description
    is an error. A flag not given parses as None, so that :func:`dataclass_values` returns
    exactly what the user set and the dataclass keeps the defaults.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    for name in only if only is not None else [n for n in fields if n not in skip]:
        if name not in docs:
            raise TypeError(f"{cls.__name__}.{name} has no description in the class docstring")
        help_text = f"{docs[name]} (default: {_default_text(fields[name])})"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            help=help_text.replace("%", "%%"),
            **_flag_type(name, hints[name]),
        )


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return str(f.default)
    return str(f.default_factory())  # type: ignore[misc]


def dataclass_values(
    cls: type, args: argparse.Namespace, *, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The fields of ``cls`` given as flags made by :func:`add_dataclass_flags`."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in skip:
            values[f.name] = value
    return values


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from the flags given; its own defaults for the rest."""
    return cls(**dataclass_values(cls, args))


def _parse_assignments(items: Sequence[str], flag: str) -> dict[str, Any]:
    """['d_model=256', 'norm_first=true'] → {'d_model': 256, 'norm_first': True}."""
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects FIELD=VALUE, got {item!r}")
        values[key.strip()] = yaml.safe_load(raw)
    return values


class ArgumentParser(argparse.ArgumentParser):
    """argparse that suggests the closest command or flag for a misspelt one (Python 3.12's
    ``suggest_on_error``, which 3.10 and 3.11 lack) and names the subcommand whose flag it was,
    with that subcommand's usage.

    Long flags must be spelt out (``allow_abbrev=False``): a prefix that works today (``--max-step``
    for ``--max-steps``) would break the day a flag sharing it is added, and a misspelling now
    gets its suggestion instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand that was given them, not by `aiayn`
            self._innermost(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            names = list(action.choices)
            close = difflib.get_close_matches(value, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(names)}"
            raise argparse.ArgumentError(None, f"unknown command {value!r}; {hint}")
        super()._check_value(action, value)

    def error(self, message: str) -> typing.NoReturn:
        super().error(message + self._suggestions())

    def _innermost(self, namespace: argparse.Namespace) -> ArgumentParser:
        """The (sub)command parser that parsed the end of the command line."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, ArgumentParser):
                    return chosen._innermost(namespace)
        return self

    def _suggestions(self) -> str:
        """ "; did you mean '--max-steps'?" for the long flags given that this parser lacks."""
        if any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return ""  # the flags belong to a subcommand, which suggests for itself
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        pairs = []
        for token in self._given:
            if token == "--":
                break
            flag = token.partition("=")[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                close = difflib.get_close_matches(flag, known, n=1)
                if close:
                    pairs.append((close[0], flag))
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][0]!r}?"
        if pairs:
            return "; did you mean " + ", ".join(f"{c!r} for {f!r}" for c, f in pairs) + "?"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(sub)
    _add_train(sub)
    _add_average(sub)
    _add_demo(sub)
    _add_translate(sub)
    _add_evaluate(sub)
    _add_serve(sub)
    _add_attention(sub)
    _add_plot(sub)
    _add_prepare(sub)
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
