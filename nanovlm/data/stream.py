"""The stream of one rank's packed batches: what each DataLoader worker runs.

A ``PackStream`` is picklable (no open files, no threads), so it travels to the DataLoader's worker processes.
Each worker serves one slot of the plan (``slot = rank * slots_per_rank + worker``): it packs only that slot's
chunk of each epoch (``shards.pack_slot``), walks its packs from the saved position on, epoch after epoch,
carrying what its last pack left into its own next chunk, and a background ``PackProducer`` reads, processes
and collates them into a bounded queue. torch's DataLoader reads workers round-robin starting at worker 0, so after ``c``
consumed batches worker ``w`` serves slot ``(w + c) % W``; the interleaved stream then equals the uninterrupted
one, batch for batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from nanovlm.data.collate import StaticLayout, collate_packed, collate_padded
from nanovlm.data.format import SampleError
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.producer import PackProducer, PlannedPack, Skip
from nanovlm.data.reader import ShardReader
from nanovlm.data.shard_cache import Prefetcher, ShardCache
from nanovlm.data.shards import (
    Carry,
    EpochSplit,
    Frontier,
    PackSpec,
    SampleTable,
    SlotPlan,
    Topology,
    pack_all,
    pack_slot,
    plan_split,
)
from nanovlm.data.state import Position

log = logging.getLogger(__name__)
LOOKAHEAD = 32  # packs whose shards a worker's prefetch considers, this epoch's and then the next one's


class SampleRef(NamedTuple):
    """A planned sample: where it is and how long it should be (located a pack at a time: ``locate_many``)."""

    path: str
    offset: int
    nbytes: int
    key: str
    gid: int
    length: int  # its tokens, as the index says


class DataMismatchError(RuntimeError):
    """A processed sample disagrees with its index entry (index made with another tokenizer or model)."""


@dataclass
class StreamSpec:
    table: SampleTable
    spec: PackSpec
    topology: Topology
    rank: int
    seed: int
    weights: tuple[float, ...]
    shuffle_buffer: int
    shuffle: bool
    finite: bool  # validation: one pass of epoch 0, every sample once (short slots get empty packs), no carry
    processor: SampleProcessor
    pad_id: int
    image_size: int
    queue_size: int
    read_ahead: int
    static: StaticLayout | None = None  # data.static_shapes: every pack laid out with these fixed shapes
    cache: ShardCache | None = None  # remote shards: staged here (shard_cache.py)
    prefetch_shards: int = 2  # remote shards fetched ahead of the one being read; 0 = off

    def split(self, pos: Position) -> EpochSplit:
        return plan_split(
            self.table,
            self.spec,
            self.topology,
            self.seed,
            pos.epoch,
            pos.carry,
            pos.history,
            self.weights,
            self.shuffle_buffer,
            self.shuffle,
            self.finite,
        )

    def slot_plan(self, split: EpochSplit, slot: int) -> tuple[EpochSplit, SlotPlan]:
        """The slot's packs: its own chunk packed (validation: every slot, to top all up to the longest), and the
        split cut down to that chunk, so a worker holds O(N / slots) of the epoch while it serves it."""
        if self.finite:
            return split, pack_all(self.table, self.spec, split, finite=True).slots[slot]
        return split.restrict(slot, slot + 1), pack_slot(self.table, self.spec, split, slot)


class PackStream(IterableDataset):
    """The rank's batches, read by one producer per DataLoader worker, in the plan's order.

    ``first_split``: the split of the start position when the caller already has it (it holds only this rank's
    chunks, so it pickles small); workers compute it otherwise, and every later epoch's split themselves."""

    def __init__(self, s: StreamSpec, start: Position, first_split: EpochSplit | None = None) -> None:
        self.s, self.start, self._first_split = s, start, first_split

    def _shards_ahead(self, plan: SlotPlan, k: int, then: SlotPlan | None = None, packs: int = LOOKAHEAD) -> list[str]:
        """The distinct shards of the slot's next ``packs`` packs, by their samples' positions in the epoch: the
        order the producer reads them in (position order, over a window of a few packs), where pack order is not
        (a pack's samples come from anywhere in the packer's look-ahead). ``then``: the slot's plan of the next
        epoch, whose first packs fill the window past this epoch's last."""
        shards = self._shards_of(plan, plan.packs[k : k + packs])
        if then is not None and k + packs > len(plan.packs):
            shards += self._shards_of(then, then.packs[: k + packs - len(plan.packs)])
        return shards

    def _shards_of(self, plan: SlotPlan, packs: list[np.ndarray]) -> list[str]:
        positions = np.sort(np.concatenate(packs)) if packs else np.zeros(0, np.int64)
        shards = self.s.table.shard_of(plan.gids[positions])
        _, first = np.unique(shards, return_index=True)
        return [self.s.table.shard_paths[i] for i in shards[np.sort(first)].tolist()]

    def _packs(self, local: int, first_pack: int, prefetch: Prefetcher | None = None) -> Iterator[PlannedPack]:
        s, spr = self.s, self.s.topology.slots_per_rank
        slot = s.rank * spr + local
        pos = dataclasses.replace(self.start)
        split, plan = s.slot_plan(self._first_split if self._first_split is not None else s.split(pos), slot)
        following = None  # the next epoch's (position, split, plan), made early so prefetch sees past the epoch end
        k = first_pack
        while True:
            n_packs = len(plan.packs)
            frontier = Frontier(plan.packable())
            for done in plan.packs[: min(k, n_packs)]:  # resumed mid-epoch: the packs consumed before
                frontier.advance(done)
            while k < n_packs:
                if following is None and not s.finite and k + LOOKAHEAD > n_packs:  # the same work as at the end
                    following = self._next_epoch(pos, split, plan, slot)
                if prefetch is not None and (k == 0 or k == first_pack or k % 4 == 0):  # at a start, then every 4
                    prefetch.upcoming(self._shards_ahead(plan, k, following[2] if following else None))
                positions = plan.packs[k]
                gids = plan.gids[positions]
                extra: dict[str, Any] = {"epoch": pos.epoch, "index": k * spr + local, "worker_slot": slot}
                extra["slot_frontier"] = frontier.advance(positions)  # what an elastic resume needs of this slot
                if k == 0:  # the skips the planner made in this slot's chunk, reported once per epoch
                    # plain dicts: torch's pin_memory copies a mapping and then update()s it, which
                    # would add a Counter's counts twice
                    extra["planned_skips"] = {
                        r: dict(Counter(s.table.dataset_of(plan.gids[p]).tolist())) for r, p in plan.skipped.items()
                    }
                if k == n_packs - 1 and not s.finite:  # the slot's last pack: what it carries into its next chunk
                    extra["slot_carry"] = plan.carry_out.tolist()
                    if local == spr - 1:  # the rank's last batch of the epoch: the training process never re-plans
                        extra["epoch_end"] = True
                        extra["carry_bound"] = split.bound_next.tolist()
                where = zip(s.table.locate_many(gids), gids.tolist(), plan.lengths[positions].tolist())
                refs = [SampleRef(*w, gid, n) for w, gid, n in where]
                yield PlannedPack(pos.epoch, k * spr + local, refs, positions.tolist(), extra)
                k += 1
            if s.finite:
                return
            k -= n_packs
            pos, split, plan = following or self._next_epoch(pos, split, plan, slot)
            following = None

    def _next_epoch(
        self, pos: Position, split: EpochSplit, plan: SlotPlan, slot: int
    ) -> tuple[Position, EpochSplit, SlotPlan]:
        """The slot's start of the epoch after ``pos``: it packs what this epoch's last pack carried out first."""
        pos = Position(pos.epoch + 1, 0, Carry({slot: plan.carry_out}, split.bound_next), ())
        return (pos, *self.s.slot_plan(self.s.split(pos), slot))

    def __iter__(self) -> Iterator[dict]:
        s = self.s
        info = get_worker_info()
        worker = info.id if info is not None else 0
        spr = s.topology.slots_per_rank
        if info is not None and info.num_workers != spr:
            raise RuntimeError(f"stream planned for {spr} workers runs on {info.num_workers}")
        c = self.start.consumed
        local = (worker + c) % spr  # rotation: the DataLoader reads worker 0 first
        reader = ShardReader(cache=s.cache)
        prefetch = None
        if s.cache is not None and s.prefetch_shards:
            prefetch = Prefetcher(s.cache, ahead=s.prefetch_shards, held=reader.holds)
        t, limit = s.table, s.spec.limit
        # with "drop" the plan already left out over-length samples: process without a limit, so a sample whose
        # real length disagrees with the index fails the length check below instead of passing as a skip
        limit_arg = limit if s.spec.overlength == "truncate" else None

        def load(ref: SampleRef):
            record = reader.read(ref.path, ref.offset, ref.nbytes, ref.key)
            sample = s.processor.process(record, limit_arg, s.spec.overlength)
            n, want = int(sample.input_ids.numel()), ref.length
            if n != want and not (sample.truncated and n <= want):
                where = t.dataset_names[t.dataset_of(ref.gid)]
                raise DataMismatchError(
                    f"sample {ref.key!r} of {where} has {n} tokens after processing but its index says {want}: the "
                    "index was made with another tokenizer or image token count, or an image's size changed since. "
                    "Re-run scripts/prepare_data.py with this run's tokenizer and model config."
                )
            return sample

        def assemble(pack: PlannedPack, samples: list, skips: list[Skip]) -> dict:
            for sk in skips:
                log.warning("skipped sample %s (%s): %s", sk.key, sk.reason, sk.detail)
            meta = dict(pack.extra)
            meta["skips"] = [(sk.ref.key, sk.reason, int(t.dataset_of(sk.ref.gid))) for sk in skips]
            if s.cache is not None:  # this worker's remote reading so far (retries, fetches, bytes)
                meta["remote"] = s.cache.counters.snapshot()
            if s.spec.mode == "packed":
                return collate_packed(samples, s.spec.max_tokens, s.pad_id, s.image_size, meta, s.static)
            return collate_padded(samples, s.pad_id, s.image_size, meta)

        producer = PackProducer(
            self._packs(local, (worker + c) // spr, prefetch),
            load,
            assemble,
            lambda ref: f"{ref.key} ({ref.path})",
            queue_size=s.queue_size,
            read_ahead=s.read_ahead,
            skip_exceptions=(SampleError,),
            name=f"pack-producer-r{s.rank}w{worker}",
        )
        try:
            for batch in producer:
                batch["meta"]["queue_depth"] = producer.qsize()
                yield batch
        finally:
            producer.close()
            reader.close()
            if prefetch is not None:
                prefetch.close()
