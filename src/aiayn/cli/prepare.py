"""``aiayn prepare``: download and clean a parallel corpus into files that ``aiayn train``
reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.flags import integer


def add(sub: argparse._SubParsersAction) -> None:
    from aiayn.text.prepare import DEFAULT_MAX_CHARS
    from aiayn.text.prepare.bible import DEFAULT_SWORD_DIR

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
        "--sword-dir",
        default=str(DEFAULT_SWORD_DIR),
        help=f"where the SWORD modules are installed (default {DEFAULT_SWORD_DIR})",
    )
    bible.add_argument(
        "--test-books",
        default="",
        metavar="BOOK,...",
        help="hold these books out of training as a test split, test.{en,es,ref}: OSIS or "
        "English names, e.g. Job,Prov (default: no test split)",
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
            type=integer,
            default=DEFAULT_MAX_CHARS,
            help=f"drop training pairs with a longer side; 0 = no limit ({DEFAULT_MAX_CHARS})",
        )
        q.add_argument("--force", action="store_true", help="overwrite a prepared corpus")
        q.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from aiayn.text.prepare import describe_manifest

    options = dict(max_chars=args.max_chars, force=args.force)
    if args.what == "bible-en-es":
        from aiayn.text.prepare.bible import prepare_bible

        manifest = prepare_bible(
            args.out_dir,
            sword_dir=Path(args.sword_dir),
            test_books=args.test_books.split(","),
            **options,
        )
    else:
        from aiayn.text.prepare.hf import RECIPES, HubSource, Recipe, prepare_hub

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
