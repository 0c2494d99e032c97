"""``aiayn translate``, ``evaluate``, ``score`` and ``attention``: a trained model on text."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.cli.common import (
    SAMPLING_FIELDS,
    add_model_dir_flag,
    add_model_flags,
    add_progress_flag,
    add_search_options,
    backend_of,
    load_translator,
    progress_bar,
    search_options,
)
from aiayn.cli.flags import add_dataclass_flags, integer
from aiayn.decode.options import DecodingOptions
from aiayn.errors import UserValueError

if TYPE_CHECKING:
    from aiayn.decode.translator import Translator

logger = logging.getLogger("aiayn")

OUTPUT_HELP = (
    "output file (default: stdout); written under a temporary name beside it and renamed at "
    "the end, so a failed run leaves an existing file as it was (a pipe, a device or a "
    "directory where no file can be made is written directly)"
)


def add(sub: argparse._SubParsersAction) -> None:
    _add_translate(sub)
    _add_evaluate(sub)
    _add_score(sub)
    _add_attention(sub)


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
    p.add_argument("-o", "--output", help=OUTPUT_HELP)
    add_progress_flag(p)
    p.add_argument(
        "--n-best", type=integer, metavar="N", help="write the N best hypotheses in n-best format"
    )
    p.add_argument(
        "--alignment",
        action="store_true",
        help="append a tab and source-target word alignments 'i-j ...' (see below; not with "
        "an ensemble)",
    )
    p.add_argument(
        "--alignment-layer",
        type=integer,
        metavar="L",
        help="decoder layer whose attention gives the alignments; 0-based, negative counts "
        "from the end (default -1, the last)",
    )
    add_search_options(p, ensemble=True, backend=True, workers=True)
    g = p.add_argument_group("sampling (instead of beam search)")
    add_dataclass_flags(g, DecodingOptions, only=SAMPLING_FIELDS)
    g.add_argument(
        "--seed",
        type=integer,
        help="seed for reproducible samples: the same input, model and --max-tokens (which "
        "decide the batches) give the same samples",
    )
    p.set_defaults(run=_run_translate)


def _run_translate(args: argparse.Namespace) -> int:
    from aiayn.decode.alignment import format_translation
    from aiayn.text.corpus import count_lines
    from aiayn.text.lines import check_input_file, output_lines, read_lines

    from_file = args.input not in (None, "-")
    if from_file:
        check_input_file(args.input)
    if from_file and args.output and Path(args.output).resolve() == Path(args.input).resolve():
        raise UserValueError(f"refusing to write the translation over its input {args.input}")
    if not from_file and sys.stdin is None:
        raise UserValueError("standard input is closed: give the sentences with -i FILE")
    if args.alignment and args.n_best is not None:
        raise UserValueError("--alignment cannot be combined with --n-best")
    if args.alignment_layer is not None and not args.alignment:
        raise UserValueError("--alignment-layer chooses the layer of --alignment: add it")
    if not args.sampling:
        unused = [
            f"--{name.replace('_', '-')}"
            for name in ("temperature", "top_k", "top_p")
            if getattr(args, name) is not None
        ]
        if unused:
            raise UserValueError(
                f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for sampling, "
                "which --sampling asks for; beam search does not use "
                f"{'it' if len(unused) == 1 else 'them'}"
            )
        if args.seed is not None:  # harmless, and a wrapper script may always pass one
            logger.warning("--seed is for sampling (--sampling): beam search does not use it")
    if args.alignment and backend_of(args) == "ctranslate2":
        raise UserValueError(
            "--alignment needs the attention maps, which the CTranslate2 backend does not "
            "return: translate with the aiayn model directory (--backend pytorch)"
        )
    options = {
        "options": search_options(args),  # with --n-best and the sampling flags
        "return_attention": args.alignment,
        "seed": args.seed,
    }
    translator = load_translator(args)
    translator.translate([], **options)  # checks the options before reading any input
    alignment_layer = None
    if args.alignment:
        from aiayn.decode.alignment import check_index

        n_layers = translator.model.config.n_decoder_layers
        layer = -1 if args.alignment_layer is None else args.alignment_layer  # the last
        alignment_layer = check_index(layer, n_layers, "layer", "decoder layers")

    if args.input is None and sys.stdin.isatty():
        return _translate_interactively(translator, options, args.n_best, alignment_layer)
    lines = read_lines(args.input) if from_file else read_lines(sys.stdin.buffer, name="<stdin>")
    # No bar when the translations themselves go to the terminal: they would tear it.
    show_progress = not args.no_progress and bool(args.output or not sys.stdout.isatty())
    counted = from_file and show_progress and Path(args.input).is_file()  # not a pipe: read once
    total = count_lines(Path(args.input)) if counted else None
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(progress_bar(show_progress, total))
        results = translator.translate_iterable(lines, progress=progress, **options)
        out = stack.enter_context(output_lines(args.output))
        for number, result in enumerate(results):
            out.write(format_translation(number, result, args.n_best, alignment_layer))
        out.flush()
    return 0


def _translate_interactively(
    translator: Translator, options: dict[str, Any], n_best: int | None, alignment_layer: int | None
) -> int:
    """A '> ' prompt on stderr, each translation on stdout, until end of input (Ctrl-D)."""
    from aiayn.decode.alignment import format_translation
    from aiayn.text.corpus import DataError, decode_line

    print("Type a sentence and press Enter; Ctrl-D to quit.", file=sys.stderr)
    number = lineno = 0
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()
        lineno += 1
        if not raw:
            print(file=sys.stderr)
            return 0
        try:  # what a file's lines are checked for; the session goes on after a bad one
            line = decode_line(raw, Path("<stdin>"), lineno)
        except DataError as error:
            print(f"error: {error}", file=sys.stderr)
            continue
        [result] = translator.translate([line], **options)
        sys.stdout.write(format_translation(number, result, n_best, alignment_layer))
        sys.stdout.flush()
        number += 1


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
    add_progress_flag(p)
    add_search_options(p, ensemble=True, backend=True, workers=True)
    p.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    import json

    from aiayn.decode.evaluation import check_tokenize, evaluate_files, tokenized_bleu
    from aiayn.text.corpus import count_lines
    from aiayn.text.lines import check_input_file, read_lines

    out_path = Path(args.output) if args.output else Path.cwd() / f"{Path(args.src).name}.hyp"
    for path in (args.src, *args.ref):
        check_input_file(path, "--src" if path == args.src else "--ref", reread=True)
    check_tokenize(args.tokenize)  # before loading a model and translating the set
    translator = load_translator(args)
    with progress_bar(not args.no_progress, count_lines(Path(args.src))) as progress:
        scores = evaluate_files(
            translator,
            args.src,
            args.ref,
            out_path=out_path,
            tokenize=args.tokenize,
            options=search_options(args),
            progress=progress,
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
        if len(translator.model_dirs) > 1:
            report["ensemble"] = [str(d) for d in translator.model_dirs]
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


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="the model's log-probability and perplexity of given translations",
        description="Score line-aligned (source, target) pairs with the model's "
        "log-probability of the target given the source, teacher-forced, without search "
        "(fairseq's --score-reference): to filter a corpus or check translations. Writes one "
        "line per pair, 'log_prob<TAB>tokens<TAB>perplexity', tokens counting the target's "
        "subword pieces + EOS and perplexity = exp(-log_prob / tokens); with --json one JSON "
        "object per line. The corpus totals go to stderr. With several -m, each token's "
        "probability is the mean of the models'.",
    )
    p.add_argument("--src", required=True, help="source sentences, one per line")
    p.add_argument("--tgt", required=True, help="their translations, line-aligned with --src")
    p.add_argument("-o", "--output", help=OUTPUT_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="write JSON lines {log_prob, tokens, perplexity, truncated}",
    )
    add_progress_flag(p)
    add_model_dir_flag(p, ensemble=True)
    add_model_flags(p)
    p.set_defaults(run=_run_score)


def _run_score(args: argparse.Namespace) -> int:
    import json
    import math

    from aiayn.decode.scoring import score_pairs
    from aiayn.text.corpus import count_lines
    from aiayn.text.lines import check_input_file, output_lines, read_lines

    src, tgt = Path(args.src), Path(args.tgt)
    for path, flag in ((src, "--src"), (tgt, "--tgt")):
        check_input_file(path, flag, reread=True)
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise UserValueError(f"{src} has {n_src} lines but {tgt} has {n_tgt} lines")
    if args.output and Path(args.output).resolve() in (src.resolve(), tgt.resolve()):
        raise UserValueError(f"refusing to write the scores over the input {args.output}")
    translator = load_translator(args)
    pairs = zip(read_lines(src), read_lines(tgt), strict=True)
    show_progress = not args.no_progress and bool(args.output or not sys.stdout.isatty())
    log_prob, n_tokens = 0.0, 0
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(progress_bar(show_progress, n_src))
        out = stack.enter_context(output_lines(args.output))
        scores = score_pairs(
            translator.models,
            translator.tokenizer,
            pairs,
            max_tokens=translator.max_tokens,
            progress=progress,
        )
        for pair in scores:
            log_prob, n_tokens = log_prob + pair.log_prob, n_tokens + pair.n_tokens
            if args.json:
                fields = {"log_prob": pair.log_prob, "tokens": pair.n_tokens}
                fields |= {"perplexity": pair.perplexity, "truncated": pair.truncated}
                out.write(json.dumps(fields) + "\n")
            else:
                out.write(f"{pair.log_prob:.4f}\t{pair.n_tokens}\t{pair.perplexity:.4f}\n")
        out.flush()
    perplexity = math.exp(min(-log_prob / n_tokens, 700.0)) if n_tokens else math.nan
    print(
        f"scored {n_src} pairs: {n_tokens} target tokens (EOS included), log-probability "
        f"{log_prob:.2f}, perplexity {perplexity:.2f}",
        file=sys.stderr,
    )
    return 0


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
        type=integer,
        help="0-based layer, negative from the end (default: the last for alignment, every "
        "layer for grids)",
    )
    p.add_argument(
        "--head", type=integer, help="one head (default: mean over heads / every head in grids)"
    )
    p.add_argument(
        "--auto-scale",
        action="store_true",
        help="colours from 0 to the largest weight shown (default: a fixed 0 to 1, the same in "
        "every picture)",
    )
    p.add_argument("--dpi", type=integer, default=150, help="image resolution (default 150)")
    add_search_options(p)
    p.set_defaults(run=_run_attention)


def _run_attention(args: argparse.Namespace) -> int:
    from aiayn.text.lines import one_line
    from aiayn.viz.plots import check_image_path, plot_attention, save_figure

    output = check_image_path(args.output)  # before the slow part
    translator = load_translator(args)
    sentence = " ".join(args.sentence)
    [result] = translator.translate([sentence], search_options(args), return_attention=True)
    figure = plot_attention(
        result, args.kind, layer=args.layer, head=args.head, auto_scale=args.auto_scale
    )
    save_figure(figure, output, dpi=args.dpi)
    print(one_line(result.text))
    logger.info("wrote %s", output)
    return 0
