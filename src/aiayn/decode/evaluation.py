"""Corpus BLEU and chrF with sacreBLEU, as the paper's results are reported (§6.1, Table 2).

The paper reports tokenized BLEU; we report sacreBLEU (Post, 2018) on detokenized text, whose
signature (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...``) makes a score
reproducible and comparable. chrF (Popović, 2015) is reported next to it. Training's
validation BLEU (:func:`bleu_of_pairs`), ``aiayn evaluate`` (:func:`evaluate_files`) and tests
all go through :func:`score`.

:func:`tokenized_bleu` approximates the number the paper reported on EN-DE (tensor2tensor's
``get_ende_bleu.sh``): tokenized text, hyphenated compounds split, then ``multi-bleu.perl``. It
is higher than sacreBLEU on the same output and is printed under its own label, never as
"BLEU".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics import bleu as sacrebleu_bleu
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from aiayn.decode.options import DecodingOptions
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.text.corpus import count_lines
from aiayn.text.lines import check_input_file, one_line, output_lines, read_lines

logger = logging.getLogger(__name__)

__all__ = [
    "EvalScores",
    "EvaluationError",
    "TokenizedBleu",
    "bleu_of_pairs",
    "check_tokenize",
    "evaluate_files",
    "score",
    "split_hyphenated_compounds",
    "tokenized_bleu",
]


class EvaluationError(UserValueError):
    """Hypotheses and references cannot be scored together (counts differ, nothing to score)."""


@dataclass(frozen=True)
class EvalScores:
    """Corpus-level scores and the sacreBLEU signatures that say how they were computed.

    Attributes:
        bleu: Corpus BLEU, 0–100.
        chrf: Corpus chrF2, 0–100.
        bleu_signature: e.g. ``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``.
        chrf_signature: e.g. ``nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0``.
        bleu_text: sacreBLEU's one-line report: n-gram precisions, brevity penalty, lengths.
        chrf_text: sacreBLEU's one-line chrF report.
        n_sentences: Number of hypotheses scored.
    """

    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_text: str
    chrf_text: str
    n_sentences: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.bleu_text}\n{self.chrf_text}"


def _check_streams(
    hypotheses: list[str], references: list[list[str]], names: Sequence[str] | None = None
) -> None:
    """Something to score, at least one reference, and every stream as long as the hypotheses.

    `names`: the hypotheses' name, then the references' (default "hypotheses", "reference k").
    """
    hyp_name, *ref_names = names or ["hypotheses"]
    ref_names += [f"reference {k + 1}" for k in range(len(ref_names), len(references))]
    if not references:
        raise EvaluationError("no references to score against")
    for stream, ref_name in zip(references, ref_names, strict=False):
        if len(stream) != len(hypotheses):
            raise EvaluationError(
                f"{hyp_name} has {len(hypotheses)} sentences but {ref_name} has {len(stream)}"
            )
    if not hypotheses:
        raise EvaluationError(f"nothing to score: {hyp_name} is empty")


def check_tokenize(tokenize: str | None) -> None:
    """Raises an EvaluationError if sacreBLEU cannot make the BLEU tokenizer ``tokenize`` (an
    unknown name, a missing extra such as ``ja-mecab``'s): before anything is translated."""
    if tokenize is None:
        return
    try:
        BLEU(tokenize=tokenize)
    except KeyError:
        known = ", ".join(getattr(sacrebleu_bleu, "_TOKENIZERS", ()))
        raise EvaluationError(
            f"tokenize ({tokenize!r}) is not one of sacreBLEU's tokenizers"
            + (f": {known}" if known else "")
        ) from None
    except Exception as error:  # sacreBLEU printed what to install, if that is it
        reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        reason = reason or type(error).__name__
        message = f"sacreBLEU cannot use the tokenizer {tokenize!r}: {reason}"
        raise EvaluationError(message) from None


def score(
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    tokenize: str | None = None,
    names: Sequence[str] | None = None,
) -> EvalScores:
    """Corpus BLEU and chrF of detokenized hypotheses against one or more references.

    Args:
        hypotheses: One output per sentence.
        references: Reference *streams*, as in ``sacrebleu.corpus_bleu``: ``references[k][i]``
            is the k-th reference of sentence i; every stream is as long as ``hypotheses``.
        tokenize: sacreBLEU's BLEU tokenizer ("13a" by default; "zh", "intl", "char", ...).
        names: Names of the hypotheses and of each reference stream for error messages (file
            names, when scoring files).

    Raises:
        EvaluationError: There is nothing to score, no reference, or a reference stream's
            length differs from the number of hypotheses (both counts are named).
    """
    hypotheses = list(hypotheses)
    references = [list(stream) for stream in references]
    _check_streams(hypotheses, references, names)

    bleu = BLEU(tokenize=tokenize)
    chrf = CHRF()
    bleu_score = bleu.corpus_score(hypotheses, references)
    chrf_score = chrf.corpus_score(hypotheses, references)
    bleu_signature = str(bleu.get_signature())
    chrf_signature = str(chrf.get_signature())
    return EvalScores(
        bleu=bleu_score.score,
        chrf=chrf_score.score,
        bleu_signature=bleu_signature,
        chrf_signature=chrf_signature,
        bleu_text=bleu_score.format(signature=bleu_signature),
        chrf_text=chrf_score.format(signature=chrf_signature),
        n_sentences=len(hypotheses),
    )


# t2t's get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'.
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")
TOKENIZED_BLEU_LABEL = (
    "tokenized BLEU (13a tokenization + compound splitting, as t2t's get_ende_bleu.sh but 13a "
    "instead of Moses)"
)
TOKENIZED_BLEU_LABEL_NO_SPLIT = "tokenized BLEU (13a tokenization, no compound splitting)"


@dataclass(frozen=True)
class TokenizedBleu:
    """Corpus BLEU on tokenized text, labelled with how the text was tokenized.

    Attributes:
        bleu: Corpus BLEU, 0–100.
        label: What was computed, e.g. :data:`TOKENIZED_BLEU_LABEL`; print it with the score.
        bleu_text: sacreBLEU's one-line report on the tokenized text (precisions, BP, lengths).
    """

    bleu: float
    label: str
    bleu_text: str

    def __str__(self) -> str:
        return f"{self.label} = {self.bleu:.2f}\n  {self.bleu_text}"


def split_hyphenated_compounds(tokenized: str) -> str:
    """Splits hyphenated compounds as t2t's ``get_ende_bleu.sh`` does.

    ``Nord-Süd-Achse`` becomes ``Nord ##AT##-##AT## Süd ##AT##-##AT## Achse``, so a hypothesis
    that gets part of a compound right earns n-gram matches for that part. Matches do not
    overlap, exactly as with Perl's ``s///g``: in ``a-b-c`` only the first hyphen is split.
    """
    return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", tokenized)


def tokenized_bleu(
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    split_compounds: bool = True,
) -> TokenizedBleu:
    """Tokenized BLEU with compound splitting, the metric behind the paper's EN-DE numbers.

    The paper's BLEU (Table 2) comes from tensor2tensor's ``get_ende_bleu.sh``: Moses-tokenize
    hypotheses and references, split hyphenated compounds (:func:`split_hyphenated_compounds`),
    then run ``multi-bleu.perl`` on the tokens. Here the word tokenizer is sacreBLEU's ``13a``
    (the mteval-v13a tokenizer), an approximation of Moses' ``tokenizer.perl`` that splits
    fewer things (e.g. apostrophes stay attached): sacremoses is not a dependency. BLEU is then
    sacreBLEU's with ``tokenize="none"`` and no smoothing (``multi-bleu.perl`` does not
    smooth), case-sensitive like ``multi-bleu.perl`` without ``-lc``.

    With ``split_compounds=False`` this equals sacreBLEU's 13a BLEU whenever every n-gram
    order has a match (they differ only in smoothing). Compound splitting turns one wrong
    compound token into several tokens, some of them right, so it usually raises the score.

    Args:
        hypotheses: One detokenized output per sentence.
        references: Reference streams, as in :func:`score`.
        split_compounds: Split ``x-y`` into ``x ##AT##-##AT## y`` after tokenizing.

    Raises:
        EvaluationError: Nothing to score, no reference, or counts differ.
    """
    hypotheses = list(hypotheses)
    references = [list(stream) for stream in references]
    _check_streams(hypotheses, references)

    tokenizer = Tokenizer13a()

    def tokenize(line: str) -> str:
        tokens = tokenizer(line.strip())
        return split_hyphenated_compounds(tokens) if split_compounds else tokens

    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    result = bleu.corpus_score(
        [tokenize(h) for h in hypotheses],
        [[tokenize(r) for r in stream] for stream in references],
    )
    signature = str(bleu.get_signature())
    return TokenizedBleu(
        bleu=result.score,
        label=TOKENIZED_BLEU_LABEL if split_compounds else TOKENIZED_BLEU_LABEL_NO_SPLIT,
        bleu_text=result.format(signature=signature),
    )


def evaluate_files(
    translator: Translator,
    src_path: str | Path,
    ref_paths: Sequence[str | Path],
    *,
    out_path: str | Path,
    tokenize: str | None = None,
    options: DecodingOptions | None = None,
    progress: Callable[[int], None] | None = None,
    **overrides: Any,
) -> EvalScores:
    """Translates ``src_path``, writes the hypotheses to ``out_path`` and scores them.

    Line counts are checked before anything is translated. Blank source lines give blank
    hypotheses (and still count as sentences). Hypotheses are written one per line, in source
    order, line breaks inside a hypothesis replaced by spaces.

    Args:
        translator: Anything with ``Translator.translate_iterable``.
        src_path: Source sentences, one per line, UTF-8.
        ref_paths: One or more reference files, line-aligned with the source.
        out_path: Where to write the hypotheses (replaced if it exists).
        tokenize: sacreBLEU's BLEU tokenizer, see :func:`score`.
        options, **overrides: How to decode, as for ``Translator.translate`` (None: the
            paper's beam search).
        progress: Called with the number of sentences finished after each batch (see
            ``Translator.translate``).

    Raises:
        EvaluationError: No reference file, line counts differ (files and counts named), the
            output would overwrite an input, the source is empty, or sacreBLEU has no
            tokenizer ``tokenize``.
        ValueError: A decoding option is out of range (checked before reading anything).
        DataError: A line is not valid UTF-8 (file and line named).
        FileNotFoundError: An input file does not exist.
        UserValueError: An input is a directory, or not a regular file (a pipe: read twice).
    """
    options = replace(options or DecodingOptions(), **overrides)
    check_tokenize(tokenize)
    src_path, out_path = Path(src_path), Path(out_path)
    ref_paths = [Path(p) for p in ref_paths]
    if not ref_paths:
        raise EvaluationError("give at least one reference file")
    for path in (src_path, *ref_paths):
        check_input_file(path, "source file" if path == src_path else "reference", reread=True)
        if out_path.exists() and out_path.resolve() == path.resolve():
            raise EvaluationError(f"refusing to overwrite the input {path} with hypotheses")
    n_src = count_lines(src_path)
    for path in ref_paths:
        n_ref = count_lines(path)
        if n_ref != n_src:
            raise EvaluationError(
                f"source and reference are not aligned: {src_path} has {n_src} lines but "
                f"{path} has {n_ref} lines"
            )
    if n_src == 0:
        raise EvaluationError(f"nothing to score: {src_path} is empty")
    references = [[line.strip() for line in read_lines(path)] for path in ref_paths]

    hypotheses = []
    results = translator.translate_iterable(read_lines(src_path), options, progress=progress)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with output_lines(out_path) as out:  # replaced once every hypothesis is written
        for result in results:
            text = one_line(result.text)
            hypotheses.append(text)
            out.write(text + "\n")
    logger.info("wrote %d hypotheses to %s", len(hypotheses), out_path)
    return score(
        hypotheses,
        references,
        tokenize=tokenize,
        names=[str(out_path), *(str(p) for p in ref_paths)],
    )


def bleu_of_pairs(
    translator: Translator,
    pairs: Sequence[tuple[str, str]],
    options: DecodingOptions | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """Training's validation BLEU: decode the sources of ``pairs`` (source, reference) and
    score them, through the same code as ``aiayn evaluate``.

    The sources go to the translator one of its batches at a time (``Translator.batches``:
    those it would make itself from the whole set, longest first), so that ``should_stop()`` is
    asked between batches: a stop request during training never waits for a whole dev set.

    Args:
        translator: Usually ``Translator.from_model`` over the model being trained.
        pairs: The validation set.
        options: How to decode; None = the paper's beam search (§6.1).
        should_stop: Asked before each batch.

    Returns:
        The metrics ``valid_bleu``, ``valid_chrf`` and ``bleu_signature``; None when
        ``should_stop()`` said stop.
    """
    options = options or DecodingOptions()
    sources = [src for src, _ in pairs]
    hypotheses = [""] * len(sources)  # blank sources stay blank, in no batch
    for batch in translator.batches(sources, options):
        if should_stop():
            return None
        results = translator.translate([sources[i] for i in batch], options)
        for i, result in zip(batch, results, strict=True):
            hypotheses[i] = result.text
    scores = score(hypotheses, [[tgt for _, tgt in pairs]])
    return {
        "valid_bleu": scores.bleu,
        "valid_chrf": scores.chrf,
        "bleu_signature": scores.bleu_signature,
    }
