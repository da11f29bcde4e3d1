"""Rank and world size, in one place: from torch.distributed once it is up, from the launcher's environment before;
and the file lock the processes of one node coordinate with.

Every helper works without torch.distributed (one process: rank 0 of 1), so callers never check for it. torch is
imported on first use: the index and the shard cache take the file lock from here, and tools that only read an
index (prepare_data, analyze_data, the planner) should not pay torch's import.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _dist():
    import torch.distributed

    return torch.distributed


def initialized() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, else (0, 1)."""
    return (_dist().get_rank(), _dist().get_world_size()) if initialized() else (0, 1)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (a collective: all ranks must call it); ``[obj]`` in one process."""
    if not initialized() or _dist().get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _dist().get_world_size()
    _dist().all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank (a collective: all ranks must call it)."""
    import torch

    if not initialized() or _dist().get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    _dist().all_reduce(t, op=_dist().ReduceOp.MAX)
    return bool(t.item())


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks, in place (a collective); unchanged in one process."""
    if initialized():
        _dist().all_reduce(t)
    return t


def global_rank_from_env() -> int:
    """This process's global rank before torch.distributed is initialised (0 when not launched by a launcher)."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):  # LOCAL_RANK: processes Lightning started on one node
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
    """An exclusive lock shared by the processes of a node (fcntl on ``path``, created when missing): ranks
    starting together build the demo data once, and workers share one staged copy of a remote shard."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
