"""Shared helpers for the benchmark suite: robust statistics, memory readings, machine description, tables.

Every figure the suite reports comes from ``Stats`` (median and spread over repetitions with warm-up
excluded), so a reader can see how noisy a number is, not just its value.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class Stats:
    """Median and spread of repeated measurements (warm-up already excluded)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of needs at least one value")
        v = sorted(float(x) for x in values)
        q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
        return cls(median=statistics.median(v), min=v[0], max=v[-1], q1=q[0], q3=q[2], n=len(v))

    def fmt(self, digits: int = 1, scale: float = 1.0) -> str:
        """'12.3 [11.9-12.8]': median and min-max, for tables."""
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.median * scale)} [{f.format(self.min * scale)}-{f.format(self.max * scale)}]"

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100) without numpy, for step-time p99."""
    v = sorted(values)
    if not v:
        raise ValueError("percentile of an empty sequence")
    k = (len(v) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------------------
# memory (Linux /proc; 0.0 elsewhere)


def proc_mb(pid: int | str, field: str, fname: str = "status") -> float:
    """A kB field of ``/proc/<pid>/<fname>`` (``VmRSS``, ``VmHWM``, ``Private_Dirty``, ...) in MB."""
    try:
        with open(f"/proc/{pid}/{fname}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM so the next peak is the measurement's own (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_pids() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return sorted(set(pids))


def worker_memory() -> list[dict[str, float]]:
    """Peak RSS and current private memory of each live child process (DataLoader workers)."""
    out = []
    for pid in child_pids():
        private = proc_mb(pid, "Private_Clean", "smaps_rollup") + proc_mb(pid, "Private_Dirty", "smaps_rollup")
        out.append({"pid": pid, "peak_rss_mb": proc_mb(pid, "VmHWM"), "private_mb": private})
    return out


# ------------------------------------------------------------------------------------------------------
# the machine


def parse_cpus(text: str) -> frozenset[int]:
    """CPU numbers written as taskset writes them ("0-1,4"); ValueError if malformed."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", part, re.ASCII)
        if m is None or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(f"{part!r} in {text!r} is not a CPU or a range of CPUs such as 0-1")
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return frozenset(cpus)


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` (None: as it is) until the block ends; the threads and processes it starts
    meanwhile inherit them and keep them."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class CpuReading:
    """CPU seconds so far: the whole machine's (everything it ran), and each of the loader's processes'."""

    machine: float
    ours: dict[int, float]  # pid -> its CPU seconds (this process, and each live child but the store)

    def loader_since(self, then: CpuReading) -> float:
        """The loader's CPU seconds since ``then``, over the processes alive at both readings (the DataLoader
        workers of one loader carry on between them; a worker that ended meanwhile would take its seconds along)."""
        return sum(self.ours[pid] - then.ours[pid] for pid in self.ours.keys() & then.ours.keys())


def cpu_reading(not_ours: Sequence[int] = ()) -> CpuReading | None:
    """The machine's and the loader's CPU seconds so far; None where /proc cannot say (not Linux)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    ours = {os.getpid(): time.process_time()}
    for pid in set(child_pids()) - set(not_ours):
        with contextlib.suppress(OSError):  # it exited meanwhile
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return CpuReading((user + nice + system + irq + softirq) / tick, ours)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],  # "-dirty": what ran is not that commit
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, torch, GPU (if any), load at start."""
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        mem_gb = 0.0
    desc: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "git_commit": _git_commit(),
        "gpu": None,
    }
    try:
        import transformers
        import webdataset

        desc["transformers"] = transformers.__version__
        desc["webdataset"] = getattr(webdataset, "__version__", "unknown")
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        desc["gpu"] = {
            "name": p.name,
            "count": torch.cuda.device_count(),
            "memory_gb": round(p.total_memory / 1e9, 1),
            "cuda": torch.version.cuda,
        }
    return desc


# ------------------------------------------------------------------------------------------------------
# tables


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers are expected pre-formatted as strings."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float, digits: int = 1) -> str:
    return f"{100.0 * x:.{digits}f}%"


def epoch_times(t_start: float, t_first: float, t_end: float, first: int, samples: int) -> dict[str, Any]:
    """The rates of one epoch of ``samples`` (``first`` of them in its first batch), every loader alike.

    *samples_per_s* spans the whole epoch, from the iterator's start: a loader may fetch far ahead before its first
    batch (LitData's pre-download grows to every chunk of a small dataset), and a rate after the first batch would
    leave that transfer out. *steady_samples_per_s* is the rate after the first batch."""
    return {
        "samples": samples,
        "seconds": t_end - t_start,
        "first_batch_s": t_first - t_start,
        "samples_per_s": samples / (t_end - t_start),
        "steady_samples_per_s": (samples - first) / (t_end - t_first),
    }
