"""The run log (metrics.jsonl): written a line at a time, read while a run is still writing it,
cut back to a checkpoint on resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest

from aiayn.train.runlog import (
    METRICS_FILE,
    MetricsLog,
    TrainingDisplay,
    TrainRecord,
    ValidRecord,
    parse_record,
    read_metrics,
    scalars,
    truncate_metrics,
)


def test_read_metrics_stops_at_a_partly_written_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"st')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]
    with pytest.raises(FileNotFoundError, match="metrics log not found"):
        read_metrics(tmp_path / "nowhere")


def test_the_log_appends_one_line_per_record_on_the_main_process_only(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    log = MetricsLog(path, enabled=True)
    records = [{"type": "train", "step": 1, "loss": 2.5}, {"type": "valid", "step": 1}]
    for record in records:
        log.write(record)
    assert read_metrics(tmp_path) == records
    assert path.read_text(encoding="utf-8").count("\n") == 2
    MetricsLog(tmp_path / "other.jsonl", enabled=False).write(records[0])
    assert not (tmp_path / "other.jsonl").exists()


def test_truncate_keeps_the_records_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    log = MetricsLog(path, enabled=True)
    for step in (1, 2, 3, 4):
        log.write({"type": "train", "step": step})
    truncate_metrics(path, step=2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert not list(tmp_path.glob("*.tmp"))
    truncate_metrics(tmp_path / "none.jsonl", step=2)  # no log yet: nothing to do
    assert not (tmp_path / "none.jsonl").exists()


def test_records_are_written_as_the_flat_json_of_earlier_releases(tmp_path: Path) -> None:
    train = TrainRecord(
        step=2, epoch=1, loss=2.5, nll=2.0, ppl=7.39, lr=1e-3, tokens_per_s=900.0, tokens_seen=80
    )
    valid = ValidRecord(step=2, valid_loss=2.6, valid_nll=2.1, valid_ppl=8.17, valid_tokens=40)
    log = MetricsLog(tmp_path / METRICS_FILE, enabled=True)
    log.write(train)
    log.write(valid)
    written = read_metrics(tmp_path)
    assert written == [
        {"type": "train", "step": 2, "epoch": 1, "loss": 2.5, "nll": 2.0, "ppl": 7.39,
         "lr": 1e-3, "tokens_per_s": 900.0, "tokens_seen": 80},
        {"type": "valid", "step": 2, "valid_loss": 2.6, "valid_nll": 2.1, "valid_ppl": 8.17,
         "valid_tokens": 40},
    ]  # fmt: skip
    assert [parse_record(r) for r in written] == [train, valid]
    assert valid.metrics() == {k: v for k, v in written[1].items() if k.startswith("valid")}


def test_parse_record_reads_old_and_unknown_records() -> None:
    old = parse_record({"type": "train", "step": 3, "loss": 1.0, "extra": True})  # no lr, ...
    assert isinstance(old, TrainRecord) and old.step == 3 and old.lr is None
    assert parse_record({"type": "note", "step": 1}) is None
    assert parse_record({"step": 1}) is None


def test_tensorboard_tags_are_the_records_numbers() -> None:
    train = TrainRecord(step=5, epoch=1, loss=2.5, nll=2.0, ppl=7.4, lr=1e-3, tokens_per_s=900.0,
                        tokens_seen=4000)  # fmt: skip
    assert scalars(train) == {
        "train/epoch": 1.0,
        "train/loss": 2.5,
        "train/nll": 2.0,
        "train/ppl": 7.4,
        "train/lr": 1e-3,
        "train/tokens_per_s": 900.0,
        "train/tokens_seen": 4000.0,
    }
    valid = ValidRecord(step=5, valid_loss=2.6, valid_nll=2.1, valid_ppl=8.2, valid_tokens=300)
    assert scalars(valid) == {
        "valid/loss": 2.6,
        "valid/nll": 2.1,
        "valid/ppl": 8.2,
        "valid/tokens": 300.0,
    }  # no BLEU measured: no BLEU tag
    with_bleu = dataclasses.replace(valid, valid_bleu=20.0, bleu_signature="nrefs:1|...")
    assert scalars(with_bleu)["valid/bleu"] == 20.0
    assert "valid/bleu_signature" not in scalars(with_bleu)


def test_training_display_logs_a_line_per_record_without_a_terminal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No bar off a terminal, even when asked for: the record becomes a log line (only where
    `log`, i.e. rank 0), and the throughput restarts after it."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    display = TrainingDisplay(logging.getLogger("aiayn.train.trainer"))
    display.open(bar=True, total=10, initial=0)
    assert display.bar is None
    display.count(500)
    assert display.tokens_per_s() > 0
    record = TrainRecord(step=3, epoch=1, loss=2.5, nll=2.0, ppl=7.39, lr=1e-3,
                         tokens_per_s=1234.0, tokens_seen=500)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="aiayn.train.trainer"):
        display.show(record, log=False)
        assert caplog.records == []
        display.show(record, log=True)
    assert caplog.records[0].name == "aiayn.train.trainer"
    assert caplog.records[0].getMessage() == "step 3: loss 2.5000 ppl 7.39 lr 0.001 1234 tok/s"
    assert display.tokens_per_s() == 0.0
    display.advance()
    display.close()
