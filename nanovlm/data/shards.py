"""The deterministic epoch plan: order, split over ranks x workers, and the packs of every slot.

Everything here is a pure function of the dataset indexes' metadata (per sample: shard, byte range, token
length, image count), the seed and the epoch, so

* every rank computes the same global plan without communicating, and therefore agrees on the number of
  steps per epoch (no rank ever waits on a collective at an epoch end);
* resuming is a seek: the plan of the current epoch is recomputed in O(N) metadata work and the reader jumps
  to the first unconsumed pack, whatever the position in the epoch.

Terms: a *gid* is a row of the ``SampleTable`` (one sample of one training directory); the epoch *order* is a
sequence of gids (a gid may occur more than once when a directory's weight is above 1); a *position* indexes
that order, so it identifies one occurrence. A *slot* is one (rank, DataLoader worker) pair:
``slot = rank * slots_per_rank + worker``.

Epoch e's order = the samples carried in from epoch e-1 (cut at its end, see below) followed by the fresh
order: per directory, its shards shuffled (one shard permutation per pass; a fractional weight adds a seeded
random subset of one more pass), directories interleaved in proportion to their sizes, then a bounded window
shuffle over the whole list (no sample moves more than ``shuffle_buffer`` places, so reads stay sequential
within shards). The order is cut into one contiguous chunk per slot, balanced by tokens; each chunk is packed
by the online packer; every slot keeps the same number of packs K (the minimum), and the samples of the packs
cut from longer slots are carried to the front of the next epoch, so nothing is lost and every rank yields
exactly K x slots_per_rank batches per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from nanovlm.config import DataConfig
from nanovlm.data import packing
from nanovlm.data.index import DatasetIndex
from nanovlm.data.tiling import ImageLayout, as_layout


class PlanError(ValueError):
    """The data cannot be planned as configured (e.g. too few samples for the number of slots)."""


@dataclass
class SampleTable:
    """The samples of the training (or validation) directories, one row per gid, built from their indexes.

    Planning reads only the three length columns (derived for the run's model: each process holds them
    once, and DataLoader workers forked from it share the pages). Where a sample lives (shard, byte range,
    key) is looked up in the memory-mapped indexes one sample at a time, when it is read or named.
    """

    length: np.ndarray  # int32 [N] total tokens (text + image tokens) for the run's model
    n_images: np.ndarray  # int32 [N] encoder inputs (what data.max_images counts): images, or tiles with splitting
    prompt: np.ndarray  # int32 [N] tokens before the first loss token (image-expanded)
    shard_start: np.ndarray  # int64 [n_shards + 1]: shard i holds gids shard_start[i]:shard_start[i + 1]
    shard_paths: list[str]  # [n_shards] absolute shard paths, or URLs of remote shards
    shard_dataset: np.ndarray  # int32 [n_shards] directory index of each shard
    dataset_start: np.ndarray  # int64 [n_dirs + 1]: directory d holds gids dataset_start[d]:dataset_start[d + 1]
    dataset_names: list[str]  # [n_dirs] the directories as given
    fingerprints: list[str]  # [n_dirs] content hash of each directory's index
    indexes: list[DatasetIndex]  # [n_dirs] where keys and byte ranges are looked up
    vision_unit: str = "images"  # what n_images counts: "images", or "tiles" with image splitting

    def __len__(self) -> int:
        return len(self.length)

    def dataset_of(self, gids: np.ndarray) -> np.ndarray:
        """Directory index of each gid."""
        return np.searchsorted(self.dataset_start, gids, side="right") - 1

    def shard_of(self, gids: np.ndarray) -> np.ndarray:
        """Shard index of each gid."""
        return np.searchsorted(self.shard_start, gids, side="right") - 1

    def _local(self, gid: int) -> tuple[int, int]:
        d = int(np.searchsorted(self.dataset_start, gid, side="right")) - 1
        return d, int(gid - self.dataset_start[d])

    def key(self, gid: int) -> str:
        d, i = self._local(gid)
        return self.indexes[d].key(i)

    @property
    def keys(self) -> KeyView:
        """``keys[gid]`` decodes one key; the table never holds them all."""
        return KeyView(self)

    def locate(self, gid: int) -> tuple[str, int, int, str]:
        """(shard path, byte offset, byte size, key) of one sample."""
        d, i = self._local(gid)
        cols = self.indexes[d].columns
        return self.shard_paths[int(self.shard_of(gid))], int(cols["offset"][i]), int(cols["nbytes"][i]), self.key(gid)

    def head(self, n: int) -> SampleTable:
        """The first ``n`` samples (stored order); shards past them stay listed but hold no sample."""
        return replace(
            self,
            length=self.length[:n],
            n_images=self.n_images[:n],
            prompt=self.prompt[:n],
            shard_start=np.minimum(self.shard_start, n),
            dataset_start=np.minimum(self.dataset_start, n),
        )

    @classmethod
    def from_indexes(cls, datasets: Sequence[tuple[str, DatasetIndex]], layout: ImageLayout | int) -> SampleTable:
        """Build from ``[(directory name, its index), ...]``, in that order, for the run's image ``layout``
        (an int: that many tokens per image, no splitting)."""
        layout = as_layout(layout)

        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            if len(parts) == 1 and parts[0].dtype == dtype:
                return parts[0]  # one directory: the mapped column itself, shared by every process
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        idxs = [idx for _, idx in datasets]
        sizes = [idx.num_samples for idx in idxs]
        shard_counts = [s.num_samples for idx in idxs for s in idx.shards]
        return cls(
            length=cat([i.total_tokens(layout, np.int32) for i in idxs], np.int32),
            n_images=cat([i.vision_inputs(layout) for i in idxs], np.int32),
            prompt=cat([i.prompt_lengths(layout, np.int32) for i in idxs], np.int32),
            shard_start=np.concatenate([[0], np.cumsum(shard_counts, dtype=np.int64)]).astype(np.int64),
            shard_paths=[idx.shard_location(s) for idx in idxs for s in idx.shards],
            shard_dataset=np.asarray([d for d, idx in enumerate(idxs) for _ in idx.shards], np.int32),
            dataset_start=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64),
            dataset_names=[name for name, _ in datasets],
            fingerprints=[idx.content_hash[:16] for idx in idxs],
            indexes=idxs,
            vision_unit=layout.unit,
        )


class KeyView:
    """``table.keys[gid]`` -> key, decoded on demand from the directory's index."""

    def __init__(self, table: SampleTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, gid: int) -> str:
        if not 0 <= gid < len(self.table):
            raise IndexError(gid)
        return self.table.key(int(gid))


@dataclass(frozen=True)
class Topology:
    """Who consumes the plan: ``world_size`` ranks with ``num_workers`` DataLoader workers each."""

    world_size: int
    num_workers: int  # 0 = the main process reads (one slot per rank)

    @property
    def slots_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def num_slots(self) -> int:
        return self.world_size * self.slots_per_rank


@dataclass(frozen=True)
class PackSpec:
    """How a slot's samples become batches: the packing part of DataConfig (its defaults are DataConfig's)."""

    mode: str = DataConfig.packing  # packed | pad_to_longest | constrained
    max_tokens: int = DataConfig.max_tokens
    max_images: int = DataConfig.max_images
    lookahead: int = DataConfig.lookahead
    max_carry: int = DataConfig.max_carry
    overlength: str = DataConfig.overlength
    batch_size: int = DataConfig.batch_size  # padded baselines only
    pad_cutoff: int = DataConfig.pad_cutoff  # constrained only; 0 = max_tokens

    @classmethod
    def from_config(cls, d: DataConfig) -> PackSpec:
        fields = (d.packing, d.max_tokens, d.max_images, d.lookahead, d.max_carry, d.overlength, d.batch_size)
        return cls(*fields, pad_cutoff=d.pad_cutoff)

    @property
    def limit(self) -> int:
        """The most tokens one sample may have: max_tokens, or the constrained baseline's pad cutoff below it."""
        if self.mode == "constrained":
            return min(self.pad_cutoff or self.max_tokens, self.max_tokens)
        return self.max_tokens

    def run(self, lengths: np.ndarray, n_images: np.ndarray, prompts: np.ndarray | None = None) -> packing.PackResult:
        """Batch one slot's samples; ``prompts`` (tokens before each first loss token) lets
        truncation skip a sample whose cut would leave no answer."""
        if self.mode == "packed":
            return packing.pack_online(
                lengths,
                n_images,
                self.max_tokens,
                self.max_images,
                self.lookahead,
                self.max_carry,
                self.overlength,
                prompts,
            )
        if self.mode == "pad_to_longest":
            return packing.pad_to_longest(lengths, n_images, self.batch_size, self.max_tokens, self.overlength, prompts)
        if self.mode == "constrained":
            return packing.constrained(lengths, n_images, self.batch_size, self.limit, self.overlength, prompts)
        raise PlanError(f"unknown packing mode {self.mode!r}")


def _rng(seed: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng([seed, *parts])


def epoch_order(
    table: SampleTable,
    seed: int,
    epoch: int,
    weights: Sequence[float] = (),
    shuffle_buffer: int = 256,
    shuffle: bool = True,
) -> np.ndarray:
    """The fresh sample order of one epoch (gids), from (seed, epoch) and the metadata only.

    ``weights`` are per-directory repeat factors (default 1.0): 2.0 = every sample twice per epoch, 0.5 = a
    seeded random half, a different half each epoch. ``shuffle=False`` gives the stored order (validation).
    """
    n_dirs = len(table.dataset_names)
    weights = list(weights) or [1.0] * n_dirs
    if len(weights) != n_dirs or any(w < 0 for w in weights):
        raise PlanError(f"need one non-negative weight per directory ({n_dirs}), got {weights}")
    shard_bounds = table.shard_start
    per_dir: list[np.ndarray] = []
    for d in range(n_dirs):
        shards = np.flatnonzero(table.shard_dataset == d)
        full, frac = int(weights[d]), weights[d] - int(weights[d])
        passes: list[np.ndarray] = []
        for p in range(full + (1 if frac > 1e-9 else 0)):
            perm = _rng(seed, epoch, d, p).permutation(shards) if shuffle else shards
            gids = np.concatenate([np.arange(shard_bounds[s], shard_bounds[s + 1]) for s in perm] or [np.zeros(0)])
            if p == full:  # the fractional pass: a seeded subset, kept in shard order
                keep = _rng(seed, epoch, d, p, 1).choice(len(gids), round(frac * len(gids)), replace=False)
                gids = gids[np.sort(keep)]
            passes.append(gids.astype(np.int64))
        per_dir.append(np.concatenate(passes) if passes else np.zeros(0, np.int64))
    # interleave directories in proportion to their sizes (each spread evenly over the epoch)
    rel = np.concatenate([(np.arange(len(g)) + 0.5) / max(1, len(g)) for g in per_dir])
    src = np.concatenate([np.full(len(g), d) for d, g in enumerate(per_dir)])
    gids = np.concatenate(per_dir)
    order = gids[np.lexsort((src, rel))]
    if shuffle and shuffle_buffer > 1 and len(order) > 1:
        # bounded window shuffle: sort by position + U(0, buffer); no sample moves by more than `buffer`
        jitter = _rng(seed, epoch, 1 << 20).uniform(0.0, float(shuffle_buffer), len(order))
        order = order[np.argsort(np.arange(len(order)) + jitter, kind="stable")]
    return order


def balanced_chunks(tokens: np.ndarray, num_slots: int) -> np.ndarray:
    """Boundaries [num_slots + 1] of contiguous chunks with (nearly) equal token sums.

    With at least as many samples as slots every chunk gets one or more samples: a long sample next to short
    ones would otherwise pull two boundaries onto the same place and leave a slot with nothing to pack.
    """
    n = len(tokens)
    cum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    targets = cum[-1] * np.arange(1, num_slots) / num_slots
    inner = np.clip(np.searchsorted(cum, targets, side="left"), 0, n)
    if n >= num_slots > 1:
        i = np.arange(1, num_slots)
        inner = i + np.maximum.accumulate(inner - i)  # strictly increasing: boundary i >= boundary i-1 + 1
        inner = np.minimum(inner, n - num_slots + i)  # and room left for one sample per later slot
    return np.concatenate([[0], inner, [n]]).astype(np.int64)


@dataclass
class EpochPlan:
    """The packs of every slot for one epoch (or for the rest of one epoch after an elastic resume)."""

    epoch: int
    topology: Topology
    order: np.ndarray  # gids; positions below index this array
    packs_per_slot: int  # K: every slot yields exactly K packs
    pack_items: np.ndarray  # positions, pack after pack, slot after slot
    pack_start: np.ndarray  # [num_slots * K + 1]: pack (slot, k) = pack_items[start[slot*K+k]:start[...+1]]
    lengths: np.ndarray  # [len(order)] planned length of every position (clipped when truncated)
    carry_out: np.ndarray  # gids of the cut packs: the front of the next epoch's order
    skipped: dict[str, np.ndarray]  # reason -> positions never planned (over-length, too many images)
    truncated: int  # positions whose length was clipped to max_tokens
    slot_bounds: np.ndarray  # [num_slots + 1]: slot s was given positions slot_bounds[s]:slot_bounds[s+1]

    def pack(self, slot: int, k: int) -> np.ndarray:
        """Positions of pack ``k`` of ``slot``."""
        i = slot * self.packs_per_slot + k
        return self.pack_items[self.pack_start[i] : self.pack_start[i + 1]]

    def batches_per_rank(self) -> int:
        return self.packs_per_slot * self.topology.slots_per_rank

    def slot_skips(self, slot: int) -> dict[str, np.ndarray]:
        """Positions of the slot's chunk that the packer skipped, by reason."""
        lo, hi = self.slot_bounds[slot], self.slot_bounds[slot + 1]
        return {r: p[(p >= lo) & (p < hi)] for r, p in self.skipped.items() if ((p >= lo) & (p < hi)).any()}

    def rank_positions(self, rank: int) -> np.ndarray:
        """Positions planned for ``rank`` this epoch: its packs plus what its slots skipped."""
        spr, k = self.topology.slots_per_rank, self.packs_per_slot
        lo, hi = self.pack_start[rank * spr * k], self.pack_start[(rank + 1) * spr * k]
        skipped = [p for s in range(rank * spr, (rank + 1) * spr) for p in self.slot_skips(s).values()]
        return np.concatenate([self.pack_items[lo:hi], *skipped])

    def consumed_positions(self, consumed: int) -> np.ndarray:
        """Positions in the packs a rank stream has consumed after ``consumed`` batches, for every rank.

        Batch ``b`` of a rank comes from its local slot ``b % slots_per_rank``, pack ``b // slots_per_rank``.
        """
        spr = self.topology.slots_per_rank
        out = []
        for rank in range(self.topology.world_size):
            for local in range(spr):
                n_packs = max(0, -(-(consumed - local) // spr))  # ceil((consumed - local) / spr)
                slot = rank * spr + local
                for k in range(min(n_packs, self.packs_per_slot)):
                    out.append(self.pack(slot, k))
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def plan_order(
    table: SampleTable,
    spec: PackSpec,
    topology: Topology,
    order: np.ndarray,
    epoch: int = 0,
    *,
    finite: bool = False,
    remainder: bool = False,
) -> EpochPlan:
    """Split ``order`` over the topology's slots balanced by tokens, pack each slot, cut all to K packs.

    ``finite`` (validation: one pass, nothing carried): no slot is cut; slots with fewer packs are topped up
    with empty packs (all padding, no loss) to the longest slot's count, so every sample is evaluated exactly
    once whatever the topology, and ranks still step together.
    ``remainder`` (the rest of an epoch, re-planned for a new topology): when some slot would get no pack, the
    epoch ends here (K = 0) and all of the remaining order opens the next epoch, instead of an error.
    """
    n_slots = topology.num_slots
    if not len(order) and not (finite or remainder):
        raise PlanError(
            f"epoch {epoch} has no samples to train on: the data.train directories hold no samples, or "
            "data.train_weights round every directory down to zero samples"
        )
    lengths = table.length[order]
    n_images = table.n_images[order]
    prompts = table.prompt[order]
    bounds = balanced_chunks(np.minimum(lengths, spec.max_tokens), n_slots)
    per_slot: list[list[np.ndarray]] = []
    eff = lengths.copy()
    skipped: dict[str, list[np.ndarray]] = {}
    truncated = 0
    for s in range(n_slots):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        res = spec.run(lengths[lo:hi], n_images[lo:hi], prompts[lo:hi])
        eff[lo:hi] = res.lengths
        truncated += len(res.truncated)
        for reason, idx in res.skipped.items():
            reason = "too_many_tiles" if reason == "too_many_images" and table.vision_unit == "tiles" else reason
            skipped.setdefault(reason, []).append(np.asarray(idx, np.int64) + lo)
        per_slot.append([np.asarray(p, np.int64) + lo for p in res.packs])
    skips = {r: np.concatenate(v) for r, v in skipped.items()}
    if finite:
        k = max((len(p) for p in per_slot), default=0)
        per_slot = [slot + [np.zeros(0, np.int64)] * (k - len(slot)) for slot in per_slot]
    else:
        k = min(len(p) for p in per_slot) if per_slot else 0
    kept = [p for slot in per_slot for p in slot[:k]]
    cut = [p for slot in per_slot for p in slot[k:]]
    carry_pos = np.concatenate(cut) if cut else np.zeros(0, np.int64)
    if k == 0 and len(order) and not finite:
        if not remainder:
            raise PlanError(_no_pack_message(epoch, len(order), topology, skips))
        # too little left for the new slots: the epoch ends and all of the rest opens the next one, skips
        # included (the next epoch plans and reports them)
        carry_pos, skips = np.arange(len(order)), {}
    sizes = np.array([len(p) for p in kept], np.int64)
    return EpochPlan(
        epoch=epoch,
        topology=topology,
        order=order,
        packs_per_slot=k,
        pack_items=np.concatenate(kept) if kept else np.zeros(0, np.int64),
        pack_start=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        lengths=eff,
        carry_out=order[carry_pos],
        skipped=skips,
        truncated=truncated,
        slot_bounds=bounds,
    )


def _no_pack_message(epoch: int, n: int, topology: Topology, skips: dict[str, np.ndarray]) -> str:
    """Why some slot got no pack, with the fix that applies: the skips when they are the cause."""
    where = (
        f"every one of the {topology.num_slots} slots (world_size={topology.world_size} x "
        f"workers={topology.slots_per_rank})"
    )
    n_skipped = sum(len(p) for p in skips.values())
    if n_skipped * 2 >= n:
        reasons = ", ".join(f"{r}={len(p)}" for r, p in sorted(skips.items()))
        fixes = []
        if "overlength" in skips:
            fixes.append("raise data.max_tokens or set data.overlength=truncate")
        if "too_many_images" in skips or "too_many_tiles" in skips:
            fixes.append("raise data.max_images (or, for tiles, lower model.vision.max_tiles or longest_edge)")
        if "empty" in skips:
            fixes.append("re-prepare the data: its index has samples without tokens")
        return (
            f"epoch {epoch}: {n_skipped} of its {n} samples cannot be packed ({reasons}), so the rest cannot give "
            f"{where} a batch; " + "; ".join(fixes or ["check the data"])
        )
    return (
        f"epoch {epoch}: {n} samples cannot give {where} at least one batch; use fewer data.num_workers or ranks, "
        "a smaller data.max_tokens, or more data"
    )


@dataclass(frozen=True)
class ConsumedPart:
    """Part of an epoch consumed under an earlier topology (for elastic resume)."""

    world_size: int
    num_workers: int
    consumed: int  # batches each rank had consumed under that topology


def build_epoch_plan(
    table: SampleTable,
    spec: PackSpec,
    topology: Topology,
    seed: int,
    epoch: int,
    carry_in: np.ndarray | Sequence[int] = (),
    history: Sequence[ConsumedPart] = (),
    weights: Sequence[float] = (),
    shuffle_buffer: int = 256,
    shuffle: bool = True,
    finite: bool = False,
) -> EpochPlan:
    """The plan of ``epoch`` for ``topology`` (``finite``: one validation pass, see ``plan_order``).

    ``history`` lists the parts of this epoch consumed under earlier topologies: each is re-planned in turn
    and the samples of its consumed packs (and the samples it skipped) are removed, so the returned plan
    covers exactly what remains, split over the new topology. When too little remains to give every new slot
    a pack, the plan has no packs (K = 0) and carries all of the remainder into the next epoch.
    """
    fresh = epoch_order(table, seed, epoch, weights, shuffle_buffer, shuffle)
    order = np.concatenate([np.asarray(carry_in, np.int64), fresh])
    for part in history:
        old = plan_order(table, spec, Topology(part.world_size, part.num_workers), order, epoch)
        gone = [old.consumed_positions(part.consumed), *old.skipped.values()]
        keep = np.ones(len(order), bool)
        keep[np.concatenate(gone)] = False
        order = order[keep]
    return plan_order(table, spec, topology, order, epoch, finite=finite, remainder=bool(history))
