"""``aiayn shortlist``: a model's lexical shortlist from parallel text
(:mod:`aiayn.decode.shortlist`), which ``translate --shortlist`` decodes with and ``export --to
ctranslate2`` writes as a vocabulary map."""

from __future__ import annotations

import argparse

from aiayn.cli.flags import integer

# aiayn.decode.shortlist.DEFAULT_PER_SOURCE and DEFAULT_FREQUENT, restated so that building the
# parser imports nothing more (a test checks that they agree).
PER_SOURCE = 50
FREQUENT = 100


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shortlist",
        help="add a lexical shortlist to a model directory (for translate --shortlist)",
        description="Count which target pieces co-occur with each source piece in parallel text "
        "(the model's training data, tokenised with its tokenizer) and add the shortlist to the "
        "model directory as shortlist.safetensors: per source piece its --per-source best "
        "target pieces by the Dice coefficient, and the --frequent most frequent target pieces "
        "for every sentence. aiayn train counts one as a run starts and saves it with model/ and "
        "best/.",
    )
    p.add_argument("-m", "--model-dir", required=True, help="model directory (or run directory)")
    p.add_argument("--src", required=True, help="source side of the parallel text, one per line")
    p.add_argument("--tgt", required=True, help="target side, line-aligned with --src")
    p.add_argument(
        "--per-source",
        type=integer,
        default=PER_SOURCE,
        help=f"target pieces kept per source piece (default: {PER_SOURCE})",
    )
    p.add_argument(
        "--frequent",
        type=integer,
        default=FREQUENT,
        help=f"most frequent target pieces allowed for every sentence (default: {FREQUENT})",
    )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aiayn.decode.shortlist import build_shortlist_from_text, write_shortlist
    from aiayn.model_dir import read_model_config, resolve_model_dir, tokenizer_file_of, verify
    from aiayn.text.corpus import read_parallel
    from aiayn.text.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(args.model_dir)
    verify(model_dir)
    config = read_model_config(model_dir)
    tokenizer = load_tokenizer(tokenizer_file_of(model_dir))
    shortlist = build_shortlist_from_text(
        read_parallel(Path(args.src), Path(args.tgt)),
        tokenizer,
        src_vocab_size=config.src_vocab_size,
        tgt_vocab_size=config.tgt_vocab_size,
        per_source=args.per_source,
        frequent=args.frequent,
    )
    write_shortlist(model_dir, shortlist)
    print(
        f"wrote the shortlist of {model_dir}: {len(shortlist.targets)} target pieces for "
        f"{int((shortlist.offsets[1:] > shortlist.offsets[:-1]).sum())} source pieces, "
        f"{len(shortlist.always)} for every sentence"
    )
    return 0
