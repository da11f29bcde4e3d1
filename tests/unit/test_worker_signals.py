"""DataLoader workers outlive a foreign SIGTERM (preemption) but still die when their parent ends them."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import TESTS
from helpers.processes import shielded_sleeper

pytestmark = pytest.mark.skipif(not hasattr(signal, "sigtimedwait"), reason="needs sigtimedwait (Linux)")


def _start(grace_s: float = 60.0) -> mp.Process:
    p = mp.get_context("fork").Process(target=shielded_sleeper, args=(grace_s,), daemon=True)
    p.start()
    time.sleep(0.5)  # let the shield install its mask and thread
    return p


def _foreign_sigterm(pid: int) -> None:
    """SIGTERM sent by a process other than the worker's parent (as scancel / slurmstepd send it)."""
    subprocess.run(["kill", "-TERM", str(pid)], check=True)


def test_a_foreign_sigterm_is_ignored_and_the_parent_can_still_end_the_worker():
    p = _start()
    try:
        _foreign_sigterm(p.pid)
        p.join(timeout=2.0)
        assert p.is_alive(), "the worker died of a preemption SIGTERM meant for the trainer"
        t0 = time.monotonic()
        p.terminate()  # what torch's DataLoader and multiprocessing's exit handler do
        p.join(timeout=10.0)
        assert not p.is_alive() and p.exitcode == -signal.SIGTERM
        assert time.monotonic() - t0 < 5.0
    finally:
        if p.is_alive():
            p.kill()


def test_the_parent_terminating_a_worker_kills_it_at_once():
    p = _start()
    try:
        p.terminate()
        p.join(timeout=5.0)
        assert not p.is_alive() and p.exitcode == -signal.SIGTERM
    finally:
        if p.is_alive():
            p.kill()


def test_a_shielded_worker_exits_after_the_grace_period():
    p = _start(grace_s=1.0)
    try:
        _foreign_sigterm(p.pid)
        p.join(timeout=10.0)
        assert not p.is_alive() and p.exitcode == -signal.SIGTERM
    finally:
        if p.is_alive():
            p.kill()


def test_a_shielded_worker_exits_when_its_parent_dies(tmp_path):
    """The trainer is SIGKILLed after the preemption signal: its orphaned worker must not linger."""
    pid_file = tmp_path / "worker.pid"
    here = str(TESTS)
    script = (
        "import multiprocessing as mp, sys, time\n"
        f"sys.path.insert(0, {here!r})\n"
        "from helpers.processes import shielded_sleeper\n"
        "p = mp.get_context('fork').Process(target=shielded_sleeper, args=(60.0,))\n"
        f"p.start(); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        time.sleep(0.5)
        _foreign_sigterm(worker)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(worker):
            assert time.monotonic() < deadline, "the orphaned worker is still running"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped later by init) has stopped running
        return f.read().split()[2] != "Z"
