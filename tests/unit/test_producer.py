"""Background producer: order, read order, bounded queue, skips, error surfacing, clean shutdown."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from nanovlm.data.format import SampleError
from nanovlm.data.producer import PackProducer, PlannedPack, ProducerError


def packs_of(groups, epoch=0):
    """PlannedPacks whose refs are ints; a ref's read-order key is the ref itself."""
    return [PlannedPack(epoch, i, list(g), list(g)) for i, g in enumerate(groups)]


def assemble(pack, samples, skips):
    return (pack.index, samples, [(s.ref, s.reason) for s in skips])


def producer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pack-producer")]


def test_yields_planned_packs_in_order_and_reads_in_epoch_order():
    groups = [[3, 0], [1, 5, 2], [4], [7, 6]]
    reads = []

    def load(ref):
        reads.append(ref)
        return ref * 10

    out = list(PackProducer(packs_of(groups), load, assemble, str, queue_size=2, read_ahead=4))
    assert out == [(0, [30, 0], []), (1, [10, 50, 20], []), (2, [40], []), (3, [70, 60], [])]
    # reads follow the read-order key within the look-ahead window (sequential in the shard), not pack order
    assert reads == [0, 1, 2, 3, 4, 5, 6, 7]
    assert sorted(reads) == list(range(8))


def test_bad_samples_are_skipped_and_leave_a_hole():
    def load(ref):
        if ref in (2, 4):
            raise SampleError("corrupt_member", f"k{ref}", "bad bytes")
        return ref

    out = list(PackProducer(packs_of([[0, 1], [2], [3, 4, 5]]), load, assemble, str, skip_exceptions=(SampleError,)))
    assert out == [(0, [0, 1], []), (1, [], [(2, "corrupt_member")]), (2, [3, 5], [(4, "corrupt_member")])]


def test_failure_surfaces_with_key_and_traceback():
    def load_that_breaks(ref):
        if ref == 3:
            raise KeyError("no such field")
        return ref

    got = []
    with pytest.raises(ProducerError) as err:
        for batch in PackProducer(packs_of([[0, 1], [2], [3], [4]]), load_that_breaks, assemble, lambda r: f"key{r}"):
            got.append(batch[0])
    assert got == [0, 1]
    msg = str(err.value)
    assert "'key3'" in msg and "no such field" in msg and "load_that_breaks" in msg  # key + original traceback
    time.sleep(0.05)
    assert not producer_threads()


def test_queue_is_bounded_and_early_stop_joins_the_thread():
    loaded = []

    def infinite():
        for i in itertools.count():
            yield PlannedPack(0, i, [i], [i])

    def load(ref):
        loaded.append(ref)
        return ref

    producer = PackProducer(infinite(), load, assemble, str, queue_size=3, read_ahead=1)
    it = iter(producer)
    assert next(it)[0] == 0
    time.sleep(0.3)
    assert len(loaded) <= 1 + 3 + 2  # consumed + queue + one being put + one read ahead
    for batch in it:  # break out of the loop early
        if batch[0] == 2:
            break
    it.close()
    assert not producer_threads()


def test_exception_in_consumer_stops_the_producer():
    def infinite():
        for i in itertools.count():
            yield PlannedPack(0, i, [i], [i])

    def consume():
        for batch in PackProducer(infinite(), lambda r: r, assemble, str, queue_size=2):
            if batch[0] == 5:
                raise RuntimeError("training step failed")

    with pytest.raises(RuntimeError, match="training step failed"):
        consume()
    assert not producer_threads()
