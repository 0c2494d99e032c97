"""Tests for aiayn.evaluation: scores are sacreBLEU's, counts are checked, files are named.

``evaluate_files`` is tested with a fake translator whose outputs are known, so that the scores
can be compared with sacreBLEU on the same strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sacrebleu

from aiayn.data import DataError
from aiayn.evaluation import EvaluationError, evaluate_files, score

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
        self.options: dict[str, Any] = {}

    def translate_iterable(self, sentences: Iterable[str], **options: Any) -> Iterator[Result]:
        self.options = options
        for sentence in sentences:
            yield Result(self.table.get(sentence.strip(), ""))


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
    assert translator.options == {"beam_size": 2}


def test_evaluate_files_checks_line_counts_before_translating(
    files: tuple[Path, Path, FakeTranslator], tmp_path: Path
) -> None:
    src, _, translator = files
    short = write(tmp_path / "short.en", REFERENCES)
    with pytest.raises(EvaluationError, match=r"test\.de has 4 lines but .*short\.en has 3 lines"):
        evaluate_files(translator, src, [short], out_path=tmp_path / "hyp")
    assert translator.options == {} and not (tmp_path / "hyp").exists()


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
