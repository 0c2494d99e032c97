"""Tests for aiayn.decode.evaluation: scores are sacreBLEU's, counts are checked, files are named.

``evaluate_files`` is tested with a fake translator whose outputs are known, so that the scores
can be compared with sacreBLEU on the same strings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sacrebleu

from aiayn.decode.evaluation import (
    TOKENIZED_BLEU_LABEL,
    EvaluationError,
    bleu_of_pairs,
    evaluate_files,
    score,
    split_hyphenated_compounds,
    tokenized_bleu,
)
from aiayn.decode.search import DecodingOptions
from aiayn.text.corpus import DataError

HYPOTHESES = [
    "The cat sat on the mat.",
    "There is a dog barking at the moon tonight.",
    "He read the book in one afternoon.",
]
REFERENCES = [
    "The cat sat on the mat.",
    "A dog is barking at the moon tonight.",
    "She read that book in a single afternoon.",
]
OTHER_REFERENCES = [
    "A cat was sitting on the mat.",
    "There is a dog barking at the moon this night.",
    "He read the whole book in one afternoon.",
]


def test_score_equals_sacrebleu() -> None:
    scores = score(HYPOTHESES, [REFERENCES])
    assert scores.bleu == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score)
    assert scores.chrf == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score)
    assert 0 < scores.bleu < 100 and 0 < scores.chrf < 100
    assert scores.n_sentences == 3


def test_score_reports_signatures() -> None:
    scores = score(HYPOTHESES, [REFERENCES])
    assert scores.bleu_signature.startswith("nrefs:1|case:mixed|")
    assert "tok:13a" in scores.bleu_signature and "version:" in scores.bleu_signature
    assert scores.chrf_signature.startswith("nrefs:1|") and "nc:6" in scores.chrf_signature
    assert scores.bleu_text.startswith(f"BLEU|{scores.bleu_signature} = {scores.bleu:.2f}")
    assert scores.chrf_text.startswith(f"chrF2|{scores.chrf_signature} = {scores.chrf:.2f}")
    assert str(scores) == f"{scores.bleu_text}\n{scores.chrf_text}"
    assert scores.to_dict()["bleu"] == scores.bleu


def test_score_with_several_references_and_a_tokenizer() -> None:
    refs = [REFERENCES, OTHER_REFERENCES]
    scores = score(HYPOTHESES, refs, tokenize="intl")
    expected = sacrebleu.corpus_bleu(HYPOTHESES, refs, tokenize="intl").score
    assert scores.bleu == pytest.approx(expected)
    assert "nrefs:2" in scores.bleu_signature and "tok:intl" in scores.bleu_signature
    assert scores.bleu > score(HYPOTHESES, [REFERENCES], tokenize="intl").bleu


def test_mismatched_counts_name_both_counts() -> None:
    with pytest.raises(EvaluationError, match="hypotheses has 3 sentences but reference 1 has 2"):
        score(HYPOTHESES, [REFERENCES[:2]])
    with pytest.raises(EvaluationError, match=r"hyp\.txt has 3 sentences but ref2\.txt has 4"):
        score(HYPOTHESES, [REFERENCES, [*REFERENCES, "x"]], names=["hyp.txt", "r.txt", "ref2.txt"])


def test_nothing_to_score_is_an_error() -> None:
    with pytest.raises(EvaluationError, match="nothing to score"):
        score([], [[]])
    with pytest.raises(EvaluationError, match="no references"):
        score(HYPOTHESES, [])


# -- files ------------------------------------------------------------------------------------


@dataclass
class Result:
    text: str


class FakeTranslator:
    """'Translates' by looking the source up in a table; records the options it was given."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table
        self.options: DecodingOptions | None = None

    def batches(self, sentences: list[str], options: DecodingOptions) -> list[list[int]]:
        """One sentence per batch (bleu_of_pairs translates a batch per call)."""
        return [[i] for i, sentence in enumerate(sentences) if sentence.strip()]

    def translate_iterable(
        self,
        sentences: Iterable[str],
        options: DecodingOptions,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[Result]:
        self.options = options
        for sentence in sentences:
            if progress is not None:
                progress(1)
            yield Result(self.table.get(sentence.strip(), ""))

    def translate(self, sentences: list[str], options: DecodingOptions | None) -> list[Result]:
        return list(self.translate_iterable(sentences, options or DecodingOptions()))


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, FakeTranslator]:
    sources = ["Die Katze.", "", "Der Hund.", "Das Buch."]
    outputs = [*HYPOTHESES[:1], "", *HYPOTHESES[1:]]
    src = write(tmp_path / "test.de", sources)
    ref = write(tmp_path / "test.en", [*REFERENCES[:1], "", *REFERENCES[1:]])
    translator = FakeTranslator(dict(zip(sources, outputs, strict=True)))
    return src, ref, translator


def test_evaluate_files_writes_hypotheses_and_scores_them(
    files: tuple[Path, Path, FakeTranslator], tmp_path: Path
) -> None:
    src, ref, translator = files
    out = tmp_path / "out" / "test.hyp"
    scores = evaluate_files(translator, src, [ref], out_path=out, beam_size=2)
    hypotheses = [*HYPOTHESES[:1], "", *HYPOTHESES[1:]]
    assert out.read_text(encoding="utf-8") == "".join(f"{h}\n" for h in hypotheses)
    assert scores == score(hypotheses, [[*REFERENCES[:1], "", *REFERENCES[1:]]])
    assert translator.options == DecodingOptions(beam_size=2)


def test_validation_bleu_scores_the_paper_decoding_against_the_targets() -> None:
    sources = ["Die Katze.", "Der Hund.", "Das Buch."]
    translator = FakeTranslator(dict(zip(sources, HYPOTHESES, strict=True)))
    metrics = bleu_of_pairs(translator, list(zip(sources, REFERENCES, strict=True)))
    expected = score(HYPOTHESES, [REFERENCES])
    assert metrics == {
        "valid_bleu": expected.bleu,
        "valid_chrf": expected.chrf,
        "bleu_signature": expected.bleu_signature,
    }
    assert translator.options == DecodingOptions()  # §6.1, from the one home of the defaults


def test_validation_bleu_stops_between_batches_when_asked() -> None:
    sources = ["Die Katze.", "Der Hund.", "Das Buch."]
    translator = FakeTranslator(dict(zip(sources, HYPOTHESES, strict=True)))
    asked = []

    def should_stop() -> bool:
        asked.append(translator.options)
        return len(asked) > 1  # after the first batch

    pairs = list(zip(sources, REFERENCES, strict=True))
    assert bleu_of_pairs(translator, pairs, should_stop=should_stop) is None
    assert asked == [None, DecodingOptions()]  # asked before each batch, stopped at the second


def test_evaluate_files_checks_line_counts_before_translating(
    files: tuple[Path, Path, FakeTranslator], tmp_path: Path
) -> None:
    src, _, translator = files
    short = write(tmp_path / "short.en", REFERENCES)
    with pytest.raises(EvaluationError, match=r"test\.de has 4 lines but .*short\.en has 3 lines"):
        evaluate_files(translator, src, [short], out_path=tmp_path / "hyp")
    assert translator.options is None and not (tmp_path / "hyp").exists()


def test_evaluate_files_names_the_line_of_invalid_utf8(
    files: tuple[Path, Path, FakeTranslator], tmp_path: Path
) -> None:
    src, _, translator = files
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"one\ntwo\nthr\xe9e\nfour\n")
    with pytest.raises(DataError, match=r"bad\.en:3: invalid UTF-8"):
        evaluate_files(translator, src, [bad], out_path=tmp_path / "hyp")


def test_evaluate_files_refuses_to_overwrite_an_input(
    files: tuple[Path, Path, FakeTranslator],
) -> None:
    src, ref, translator = files
    with pytest.raises(EvaluationError, match="refusing to overwrite"):
        evaluate_files(translator, src, [ref], out_path=ref)
    assert ref.read_text(encoding="utf-8").startswith(REFERENCES[0])


def test_evaluate_files_rejects_missing_and_empty_inputs(
    files: tuple[Path, Path, FakeTranslator], tmp_path: Path
) -> None:
    src, _, translator = files
    with pytest.raises(FileNotFoundError, match=r"nope\.en"):
        evaluate_files(translator, src, [tmp_path / "nope.en"], out_path=tmp_path / "hyp")
    empty_src, empty_ref = write(tmp_path / "e.de", []), write(tmp_path / "e.en", [])
    with pytest.raises(EvaluationError, match="nothing to score"):
        evaluate_files(translator, empty_src, [empty_ref], out_path=tmp_path / "hyp")


# -- tokenized BLEU (the paper's EN-DE metric) -------------------------------------------------

# One hypothesis that gets the compound half right. 13a keeps "Nord-Süd-Verbindung" as one
# token and splits off the final ".".
COMPOUND_HYP = "Die Nord-Süd-Verbindung ist sehr wichtig."
COMPOUND_REF = "Die Nord-Süd-Achse ist sehr wichtig."


def test_split_hyphenated_compounds_is_t2ts_rule() -> None:
    assert split_hyphenated_compounds("Nord-Süd-Achse") == (
        "Nord ##AT##-##AT## Süd ##AT##-##AT## Achse"
    )
    # Perl's s{(\S)-(\S)}{...}g does not overlap matches: after "a-b" the "-c" has no left char.
    assert split_hyphenated_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_hyphenated_compounds("5 - 3 , -x x-") == "5 - 3 , -x x-"


def test_tokenized_bleu_without_splitting_is_sacrebleu_13a() -> None:
    # Hand count on the 13a tokens
    #   hyp: Die | Nord-Süd-Verbindung | ist | sehr | wichtig | .     (6 tokens)
    #   ref: Die | Nord-Süd-Achse      | ist | sehr | wichtig | .     (6 tokens)
    # 1-grams 5/6 (all but the compound), 2-grams 3/5 (ist sehr, sehr wichtig, wichtig .),
    # 3-grams 2/4, 4-grams 1/3 (ist sehr wichtig .); BP = 1.
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25  # = 100 * (1/12)^(1/4) = 53.73
    result = tokenized_bleu([COMPOUND_HYP], [[COMPOUND_REF]], split_compounds=False)
    assert result.bleu == pytest.approx(expected)
    assert result.bleu == pytest.approx(score([COMPOUND_HYP], [[COMPOUND_REF]]).bleu)
    assert result.bleu == pytest.approx(53.73, abs=0.01)
    assert "no compound splitting" in result.label
    many = tokenized_bleu(HYPOTHESES, [REFERENCES], split_compounds=False)
    assert many.bleu == pytest.approx(score(HYPOTHESES, [REFERENCES]).bleu)


def test_compound_splitting_adds_matches_around_hyphens() -> None:
    # After splitting, with A = ##AT##-##AT##:
    #   hyp: Die Nord A Süd A Verbindung ist sehr wichtig .   (10 tokens)
    #   ref: Die Nord A Süd A Achse      ist sehr wichtig .   (10 tokens)
    # 1-grams 9/10 (all but Verbindung)
    # 2-grams 7/9: Die·Nord, Nord·A, A·Süd, Süd·A, ist·sehr, sehr·wichtig, wichtig·.
    #   (misses A·Verbindung, Verbindung·ist)
    # 3-grams 5/8: Die·Nord·A, Nord·A·Süd, A·Süd·A, ist·sehr·wichtig, sehr·wichtig·.
    # 4-grams 3/7: Die·Nord·A·Süd, Nord·A·Süd·A, ist·sehr·wichtig·.
    expected = 100 * (9 / 10 * 7 / 9 * 5 / 8 * 3 / 7) ** 0.25  # = 100 * (3/16)^(1/4) = 65.80
    result = tokenized_bleu([COMPOUND_HYP], [[COMPOUND_REF]])
    assert result.bleu == pytest.approx(expected)
    assert result.bleu == pytest.approx(65.80, abs=0.01)
    # The direction the paper's numbers lean: the right half of a compound now earns matches.
    assert result.bleu > score([COMPOUND_HYP], [[COMPOUND_REF]]).bleu
    assert result.label == TOKENIZED_BLEU_LABEL
    assert "13a" in result.label and "compound splitting" in result.label
    assert "tok:none" in result.bleu_text and "smooth:none" in result.bleu_text
    assert str(result).startswith(f"{TOKENIZED_BLEU_LABEL} = 65.80")


def test_tokenized_bleu_checks_counts() -> None:
    with pytest.raises(EvaluationError, match="hypotheses has 3 sentences but reference 1 has 2"):
        tokenized_bleu(HYPOTHESES, [REFERENCES[:2]])
    with pytest.raises(EvaluationError, match="nothing to score"):
        tokenized_bleu([], [[]])
    with pytest.raises(EvaluationError, match="no references"):
        tokenized_bleu(HYPOTHESES, [])


def test_cli_evaluate_prints_tokenized_bleu_next_to_sacrebleu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiayn import cli
    from aiayn.cli import translate as cli_translate

    src = write(tmp_path / "test.en", ["north-south"])
    ref = write(tmp_path / "test.de", [COMPOUND_REF])
    translator = FakeTranslator({"north-south": COMPOUND_HYP})
    translator.model_dir = tmp_path  # type: ignore[attr-defined]
    translator.model_dirs = [tmp_path]  # type: ignore[attr-defined]
    monkeypatch.setattr(cli_translate, "load_translator", lambda args: translator)
    args = ["evaluate", "-m", str(tmp_path), "--src", str(src), "--ref", str(ref)]
    args += ["-o", str(tmp_path / "test.hyp"), "--tokenized-bleu"]

    assert cli.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("BLEU|nrefs:1|") and " = 53.73 " in out[0]
    assert out[1].startswith("chrF2|")
    assert out[2] == f"{TOKENIZED_BLEU_LABEL} = 65.80"

    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bleu"] == pytest.approx(53.73, abs=0.01)
    assert report["tokenized_bleu"] == pytest.approx(65.80, abs=0.01)
    assert report["tokenized_bleu_label"] == TOKENIZED_BLEU_LABEL
