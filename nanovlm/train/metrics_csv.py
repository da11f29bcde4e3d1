"""``<run_dir>/csv/metrics.csv``: one row per logged step, continued (not restarted) when a run resumes.

A plain Lightning ``Logger``: Lightning's CSVLogger deletes an existing metrics file when it starts, which would
lose a resumed run's history. Here the rows up to the resumed step are kept and later ones (logged by a killed run
after its last checkpoint, and trained again now) are dropped, so a resumed run's file reads like one run, as
steps.jsonl does. Columns are the sorted union of every key logged, plus ``step``.
"""

from __future__ import annotations

import csv
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


class MetricsCSV(Logger):
    """Rows go to disk as they are logged (a rewrite only when a new column appears); none is kept in memory."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        super().__init__()
        self.path = Path(run_dir) / "csv" / "metrics.csv"
        self.resume_step = resume_step
        self._header: list[str] | None = None  # known after the first write (rank 0 only)

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """The resolved config is written to ``<run_dir>/config.yaml`` instead."""

    def _read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with self.path.open(newline="") as f:
            return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]

    def _write(self, rows: list[dict], mode: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open(mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._header)
            if mode == "w" and self._header:
                writer.writeheader()
            writer.writerows(rows)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._header is None:  # first write: keep what the resumed-from steps logged, drop the rest
            old = self._read() if self.resume_step > 0 else []
            kept = [r for r in old if r.get("step") and float(r["step"]) <= self.resume_step]
            self._header = sorted({k for r in kept for k in r})
            self._write(kept, "w")
        row = {k: _scalar(v) for k, v in metrics.items()} | {"step": step}
        if set(row) <= set(self._header):
            self._write([row], "a")
        else:  # a new column: rewrite the file under the extended header
            rows = self._read() + [row]
            self._header = sorted(set(self._header) | set(row))
            self._write(rows, "w")
