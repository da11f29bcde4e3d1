"""The DataLoader around a PackStream: data-wait timing, a clear error for a dead worker, a quiet exit.

One batch is one pack (``batch_size=None``); the producer's queue already buffers ahead, so torch prefetches
one batch per worker. Workers outlive a preemption SIGTERM sent to the whole job, so the trainer can save
(``worker_signals``).
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import Generator

from torch.utils.data import DataLoader

from nanovlm.data.stream import PackStream
from nanovlm.data.worker_signals import shield_from_preemption

# torch's multi-process DataLoader iterators whose workers may still run. One left open at interpreter exit (an
# abandoned loop, a persistent validation loader outside Lightning, an iterator kept alive by an exception's
# traceback) would have its workers terminated by multiprocessing's exit handler, and torch's dead-worker check
# would then print "DataLoader worker ... is killed by signal: Terminated" from inside that handler. Shutting them
# down first, as torch does when an iterator is closed, ends them quietly. torch has no public call for it: this
# is the one place the project uses a private torch method (Lightning's own teardown calls the same one).
# Registered after multiprocessing's handler, so it runs before it.
_open_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shut_down_open_workers() -> None:
    for it in list(_open_iterators):
        with contextlib.suppress(Exception):
            it._shutdown_workers()


def _init_worker(worker_id: int) -> None:
    shield_from_preemption()


def _as_is(batch: dict) -> dict:
    """The collate function: a pack is collated already (``collate.py``), and holds no numpy array for torch's
    default (``default_convert``) to convert, so the walk over every list of its meta is skipped."""
    return batch


class TimedDataLoader(DataLoader):
    """A DataLoader that adds the time the caller waited for each batch to ``wait_sink[0]``."""

    wait_sink: list[float] | None = None

    def __iter__(self) -> Generator[dict, None, None]:  # type: ignore[override]
        it = super().__iter__()
        if self.num_workers > 0:
            _open_iterators.add(it)
        sink = self.wait_sink
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            except (ConnectionError, EOFError) as e:  # torch's own dead-worker check can come second
                raise RuntimeError(
                    f"a DataLoader worker died while handing over a batch ({type(e).__name__}: {e}); it was "
                    "probably killed (out of memory?): lower data.num_workers or data.queue_size, or give the "
                    "job more memory"
                ) from e
            if sink is not None:
                sink[0] += time.perf_counter() - t0
            yield batch


def make_loader(stream: PackStream, num_workers: int, pin_memory: bool, wait_sink: list[float], persistent: bool):
    """The DataLoader for ``stream`` (``persistent``: validation reuses its workers; torch joins exhausted workers
    only after their 5 s poll timeout)."""
    dl = TimedDataLoader(
        stream,
        batch_size=None,
        collate_fn=_as_is,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=1 if num_workers else None,
        persistent_workers=persistent and num_workers > 0,
        worker_init_fn=_init_worker,
    )
    dl.wait_sink = wait_sink
    return dl
