"""Keep DataLoader workers alive through a preemption SIGTERM until the trainer has saved.

SLURM preemption and ``scancel`` send SIGTERM to every process of a job step, DataLoader workers included.
A worker dies of it at once; torch's SIGCHLD check then raises in the training process, in the middle of the
preemption checkpoint it is writing. So workers hand the signal to the trainer instead: they block SIGTERM
and a small thread waits for it with ``sigtimedwait``, which also tells who sent it.

- sent by the worker's parent (torch's DataLoader ending a worker that did not stop in time, or
  multiprocessing's exit handler): die of it at once, as an unshielded worker would;
- sent by anyone else (the scheduler, ``kill -TERM -<pgid>``): ignore it. The training process got the same
  signal, saves at the next step boundary and shuts the workers down the normal way. Should it die instead,
  torch's worker loop notices the lost parent and exits; ``grace_s`` bounds the wait in any case.
"""

from __future__ import annotations

import os
import signal
import threading
import time

GRACE_S = 600.0  # a shielded worker exits this long after a foreign SIGTERM, whatever the trainer does


def _die_of_sigterm() -> None:
    """Terminate this process by SIGTERM with the default action (exit status -15, as without shielding).

    Runs in the waiting thread: unblocking SIGTERM there makes it the one thread the kernel delivers to."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # delivery is asynchronous; never fall through into the caller
    os._exit(128 + signal.SIGTERM)


def _wait_for_sigterm(parent: int, grace_s: float) -> None:
    deadline = None
    while True:
        timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        info = signal.sigtimedwait({signal.SIGTERM}, timeout)
        if info is not None:
            if info.si_pid == parent:  # torch or multiprocessing ending its worker
                _die_of_sigterm()
            if deadline is None:
                deadline = time.monotonic() + grace_s
        if os.getppid() != parent or (deadline is not None and time.monotonic() >= deadline):
            _die_of_sigterm()


def shield_from_preemption(grace_s: float = GRACE_S) -> None:
    """Call first thing in a DataLoader worker (its ``worker_init_fn``); see the module docstring.

    The mask is inherited by threads started later (the pack producer), so only the waiting thread ever
    receives SIGTERM. No-op where the platform lacks ``sigtimedwait`` (not Linux/Unix).
    """
    if not hasattr(signal, "sigtimedwait"):
        return
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # inherited Python handlers (Lightning's) would only log it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_wait_for_sigterm, args=(parent, grace_s), name="sigterm-shield", daemon=True).start()
