"""Background producer: reads, processes and assembles planned packs into a bounded queue.

One producer runs per DataLoader worker (or in the main process when ``num_workers=0``). Its thread walks the
worker's pack plan; the consumer (the DataLoader worker's iterator, or the training loop) takes finished packs
from a ``queue.Queue(queue_size)``, so memory is bounded by ``queue_size`` packs plus the samples in flight.

Reads follow the epoch order (sequential within shards): the samples of the next few packs (about
``read_ahead`` samples) are read in position order and wait in a dict until their pack is complete.

Failure handling: an exception listed in ``skip_exceptions`` (a bad sample) is a counted skip that leaves a
hole in its pack; any other exception stops the producer and is re-raised in the consumer as
``ProducerError`` with the sample key and the original traceback text. Closing the iterator (``break``,
garbage collection, an exception in the consumer) sets a stop event and joins the thread; every blocking call
uses a timeout, so nothing hangs at exit.
"""

from __future__ import annotations

import atexit
import heapq
import queue
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

_POLL_S = 0.05  # how often blocked puts/gets re-check the stop event / thread liveness


class ProducerError(RuntimeError):
    """The producer thread failed; the message names the sample and carries the original traceback."""


@dataclass
class PlannedPack:
    """One pack of the plan: which samples to read, in pack order."""

    epoch: int
    index: int  # position of this pack in the rank's stream within the epoch
    refs: list[Any]  # opaque sample references (passed to ``load``), in pack order
    order: list[int]  # read-order key of each ref (its position in the epoch order)
    extra: dict[str, Any] = field(default_factory=dict)  # copied into the batch meta


@dataclass
class Skip:
    """A sample left out of its pack (a counted skip)."""

    ref: Any
    key: str
    reason: str
    detail: str = ""


@dataclass
class _Failure:
    key: str
    message: str


_END = object()

# Producers whose thread is running. Their threads are daemons (a forgotten iterator must not keep the process
# alive), but at interpreter exit Python ends daemon threads wherever they are: one inside a file read keeps the
# file's lock forever ("could not acquire lock ... at interpreter shutdown"), one inside a torch op aborts the
# process ("terminate called without an active exception"). So at exit, before that, every live producer is
# stopped and joined: a script that leaves a DataLoader iterator unfinished exits cleanly.
_live: weakref.WeakSet[PackProducer] = weakref.WeakSet()


@atexit.register
def _close_live_producers() -> None:
    for producer in list(_live):
        producer.close(timeout=5.0)


class PackProducer:
    """Iterate over finished batches produced by a background thread.

    Args:
        packs: the planned packs, in order (may be infinite; consumed lazily by the thread).
        load: ``ref -> sample``; raises one of ``skip_exceptions`` for a bad sample.
        assemble: ``(pack, samples, skips) -> batch`` (samples in pack order, skipped ones left out).
        key_of: ``ref -> str`` for error messages and skips.
        queue_size: finished batches buffered ahead of the consumer.
        read_ahead: samples of upcoming packs read ahead in epoch order (at least one pack is always open).
        skip_exceptions: exception types that mean "skip this sample" (with a ``reason`` attribute).
    """

    def __init__(
        self,
        packs: Iterable[PlannedPack],
        load: Callable[[Any], Any],
        assemble: Callable[[PlannedPack, list[Any], list[Skip]], Any],
        key_of: Callable[[Any], str],
        queue_size: int = 4,
        read_ahead: int = 64,
        skip_exceptions: tuple[type[BaseException], ...] = (),
        name: str = "pack-producer",
    ) -> None:
        self._packs = iter(packs)
        self._load, self._assemble, self._key_of = load, assemble, key_of
        self._read_ahead = max(1, read_ahead)
        self._skip_exceptions = skip_exceptions
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._current_ref: Any = None  # the sample being read (its key is looked up only if it fails)
        self._current_pack = ""  # else the pack being assembled

    # ---- producer side (background thread) -------------------------------------------------------------

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> Iterator[Any]:
        window: deque[tuple[PlannedPack, int]] = deque()  # open packs with their sequence number
        missing: dict[int, int] = {}  # pack seq -> samples not read yet
        done: dict[tuple[int, int], Any] = {}  # (pack seq, slot in pack) -> sample or Skip
        heap: list[tuple[int, int, int, int]] = []  # (epoch, order, pack seq, slot in pack)
        in_window = 0
        seq = 0
        exhausted = False
        while True:
            while not exhausted and (not window or in_window < self._read_ahead):
                pack = next(self._packs, None)
                if pack is None:
                    exhausted = True
                    break
                window.append((pack, seq))
                missing[seq] = len(pack.refs)
                in_window += len(pack.refs)
                for j, o in enumerate(pack.order):
                    heapq.heappush(heap, (pack.epoch, o, seq, j))
                seq += 1
            if not window:
                return
            if heap:
                _, _, s, j = heapq.heappop(heap)
                pack = next(p for p, q in window if q == s)
                done[(s, j)] = self._read_one(pack, j)
                missing[s] -= 1
            while window and missing[window[0][1]] == 0:
                pack, s = window.popleft()
                del missing[s]
                in_window -= len(pack.refs)
                got = [done.pop((s, j)) for j in range(len(pack.refs))]
                skips = [g for g in got if isinstance(g, Skip)]
                samples = [g for g in got if not isinstance(g, Skip)]
                self._current_ref, self._current_pack = None, f"pack {pack.index} of epoch {pack.epoch}"
                yield self._assemble(pack, samples, skips)
            if self._stop.is_set():
                return

    def _read_one(self, pack: PlannedPack, j: int) -> Any:
        ref = pack.refs[j]
        self._current_ref = ref
        try:
            return self._load(ref)
        except self._skip_exceptions as e:
            return Skip(ref, self._name(ref), str(getattr(e, "reason", type(e).__name__)), str(e))

    def _current_name(self) -> str:
        """What failed, for the error: a sample's key and shard are looked up only then (not per sample)."""
        return self._current_pack if self._current_ref is None else self._name(self._current_ref)

    def _name(self, ref: Any) -> str:
        try:
            return self._key_of(ref)
        except Exception:  # noqa: BLE001 - the failure being reported matters more than its name
            return repr(ref)

    def _run(self) -> None:
        try:
            for batch in self._produce():
                if not self._put(batch):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - everything is re-raised in the consumer
            tb = traceback.format_exc()
            self._put(_Failure(self._current_name(), f"{type(e).__name__}: {e}\n\nproducer traceback:\n{tb}"))

    # ---- consumer side -----------------------------------------------------------------------------------

    def qsize(self) -> int:
        """Finished batches waiting in the queue (telemetry)."""
        return self._queue.qsize()

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            raise RuntimeError("a PackProducer can be iterated only once")
        self._started = True
        _live.add(self)
        self._thread.start()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise ProducerError("data producer thread exited without a result") from None
                    continue
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise ProducerError(f"data producer failed on sample {item.key!r}: {item.message}")
                yield item
        finally:
            self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait for it (idempotent)."""
        _live.discard(self)
        self._stop.set()
        while True:  # unblock a put in progress and free memory
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        if getattr(self, "_started", False):
            self.close(timeout=1.0)
