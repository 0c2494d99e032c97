"""The run log: one JSON object per line in RUN_DIR/metrics.jsonl, what a run measured as it went.

Named for what it holds (a log), not ``metrics``: the metrics themselves (BLEU, chrF) are in
:mod:`aiayn.evaluation`.

Records have `type` "train" (step, epoch, loss, nll, ppl, lr, tokens_per_s, tokens_seen) or
"valid" (step, valid_loss, valid_nll, valid_ppl, and valid_bleu/valid_chrf when enabled).
Readers stop at the last complete line, so a log that a running job is writing can be read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics log up to its last complete line (a run may still be writing)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"metrics log not found: {path}")
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # partly written last line
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, forget records written after the checkpoint (they will be written again)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLog:
    """Appends records to a run's metrics log; disabled on all but the main process of a job."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        """Appends one record as a line and closes the file: a crash loses at most that line."""
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
