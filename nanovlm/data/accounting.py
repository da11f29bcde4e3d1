"""What one rank's trained batches held: skip counts (with the ``data.max_skip_rate`` check) and telemetry.

Counted from each batch's ``meta`` when the batch is trained (``count``), never when it is prefetched, so the
counts in a checkpoint match the position saved with them.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from nanovlm.data.state import RankState

log = logging.getLogger(__name__)


class SkipRateError(RuntimeError):
    """More samples of a dataset were skipped in one epoch than ``data.max_skip_rate`` allows."""


class DataCounters:
    """Skips per (reason, dataset) this epoch and since the start; telemetry counters since the last read."""

    def __init__(self) -> None:
        self.epoch_skips: Counter = Counter()  # (reason, dataset) -> count, this epoch
        self.total_skips: Counter = Counter()  # reason -> count, since the start of the run
        self.last_epoch_skips: dict[str, int] = {}
        self.wait = [0.0]  # seconds the loop waited for data (the loader adds to it)
        self._tel: Counter = Counter()
        self._tel_skips: Counter = Counter()
        self._queue_depth = 0.0
        self._remote: dict[int, dict[str, int]] = {}  # worker slot -> its shard_cache.ShardCache counters

    def count(self, meta: dict) -> None:
        """Count one trained batch: the skips the planner made (reported with a slot's first pack), the samples
        skipped while reading it, and its tokens, images and samples."""
        for reason, per_ds in meta.get("planned_skips", {}).items():
            for ds, n in per_ds.items():
                self._skip(reason, int(ds), n)
        for _key, reason, ds in meta.get("skips", []):
            self._skip(reason, ds, 1)
        self._tel.update(
            packs=1,
            samples=meta["n_samples"],
            real_tokens=meta["real_tokens"],
            slots=meta["slots"],
            images=meta["n_images"],
            loss_tokens=meta.get("loss_tokens", 0),
        )
        self._queue_depth = float(meta.get("queue_depth", 0))
        if "remote" in meta:  # cumulative per worker: keep each worker's latest
            self._remote[meta.get("worker_slot", 0)] = dict(meta["remote"])

    def _skip(self, reason: str, ds: int, n: int) -> None:
        self.epoch_skips[(reason, ds)] += n
        self.total_skips[reason] += n
        self._tel_skips[reason] += n

    def end_epoch(self, epoch: int, rank: int) -> None:
        out: Counter = Counter()
        for (reason, _ds), n in self.epoch_skips.items():
            out[reason] += n
        self.last_epoch_skips = dict(out)
        if out:
            detail = ", ".join(f"{r}={n}" for r, n in sorted(out.items()))
            log.warning("data epoch %d (rank %d): skipped %d samples: %s", epoch, rank, sum(out.values()), detail)
        self.epoch_skips = Counter()

    def check_skip_rate(self, planned: np.ndarray, names: list[str], epoch: int, max_rate: float) -> None:
        """Raise SkipRateError when a directory lost more than ``max_rate`` of its ``planned`` samples this epoch."""
        per_ds: Counter = Counter()
        for (_reason, ds), n in self.epoch_skips.items():
            per_ds[ds] += n
        for ds, n in per_ds.items():
            if planned[ds] and n > max_rate * int(planned[ds]):
                reasons = Counter({r: c for (r, d), c in self.epoch_skips.items() if d == ds}).most_common(3)
                raise SkipRateError(
                    f"{names[ds]}: {n} of this rank's {int(planned[ds])} samples of epoch {epoch} were skipped "
                    f"(> data.max_skip_rate={max_rate}); top reasons: "
                    + ", ".join(f"{r} x{c}" for r, c in reasons)
                    + ". Fix or re-prepare the data (scripts/prepare_data.py validates every sample), or raise "
                    "data.max_skip_rate."
                )

    def rank_state(self, rank: int, epoch: int, consumed: int) -> RankState:
        skips = [[r, d, n] for (r, d), n in sorted(self.epoch_skips.items())]
        return RankState(rank, epoch, consumed, skips, dict(self.total_skips))

    def restore(self, ranks: list[RankState]) -> None:
        self.epoch_skips, self.total_skips = Counter(), Counter()
        for r in ranks:
            for reason, d, n in r.epoch_skips:
                self.epoch_skips[(reason, d)] += n
            self.total_skips.update(r.total_skips)

    def telemetry(self) -> dict:
        """Counters since the last call (for the training loop's logger)."""
        t = self._tel
        out = {
            "packs": t["packs"],
            "samples": t["samples"],
            "real_tokens": t["real_tokens"],
            "slots": t["slots"],
            "loss_tokens": t["loss_tokens"],
            "images": t["images"],
            "fill": t["real_tokens"] / t["slots"] if t["slots"] else 0.0,
            "data_wait_s": self.wait[0],
            "queue_depth": self._queue_depth,
            "skips_by_reason": dict(self._tel_skips),
            "last_epoch_skips": dict(self.last_epoch_skips),
        }
        if self._remote:  # since the start of the run, summed over this rank's workers
            out["remote"] = dict(sum((Counter(c) for c in self._remote.values()), Counter()))
        self._tel, self._tel_skips, self.wait[0] = Counter(), Counter(), 0.0
        return out
