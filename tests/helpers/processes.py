"""Tests that need more than one process: forked gloo ranks, and a stand-in for a shielded DataLoader worker
(importable by a subprocess, which puts ``tests/`` on ``sys.path``)."""

from __future__ import annotations

import time

from nanovlm.data.worker_signals import shield_from_preemption


def run_forked_ranks(target, world_size: int, out_dir, *args, timeout: float = 120) -> None:
    """Run ``target(rank, port, *args)`` in ``world_size`` forked processes (a gloo group on a free port) and
    assert that every rank exited 0. A rank that fails writes its traceback to ``out_dir/error<rank>.txt``."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("fork")
    for _ in range(3):  # the free port may be taken between picking and binding (another test process): again
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        errors = [f.read_text() for f in sorted(out_dir.glob("error*.txt"))]
        if not any("address already in use" in e.lower() for e in errors):
            break
        for f in out_dir.glob("error*.txt"):
            f.unlink()
    assert not errors and all(p.exitcode == 0 for p in procs), errors


def shielded_sleeper(grace_s: float) -> None:
    """A worker that shields itself from a foreign SIGTERM, then sleeps."""
    shield_from_preemption(grace_s)
    time.sleep(120)
