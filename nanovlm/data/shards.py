"""The deterministic epoch plan: order, split over ranks x workers, a common pack count, the packs of a slot.

Everything here is a pure function of the dataset indexes' metadata (per sample: shard, byte range, token
length, image count), the seed and the epoch, so

* every process computes the same split and pack count without communicating, so ranks agree on the number of
  steps per epoch (no rank ever waits on a collective at an epoch end);
* each DataLoader worker packs only its own slot's chunk: the per-process planning cost is O(N) vectorised
  numpy (the order and the split) plus O(N / slots) packing;
* resuming is a seek: the current epoch's split is recomputed and the worker jumps to the first unconsumed pack
  of its slot, whatever the position in the epoch.

Terms: a *gid* is a row of the ``SampleTable`` (one sample of one training directory); the epoch *order* is a
sequence of gids (a gid may occur more than once when a directory's weight is above 1); a *position* indexes
a slot's chunk, so it identifies one occurrence. A *slot* is one (rank, DataLoader worker) pair:
``slot = rank * slots_per_rank + worker``.

Epoch e's fresh order: per directory, its shards shuffled (one shard permutation per pass; a fractional weight
adds a seeded random subset of one more pass), directories interleaved in proportion to their sizes, then a
bounded window shuffle over the whole list (no sample moves more than ``shuffle_buffer`` places, so reads stay
sequential within shards). It is cut into one contiguous chunk per slot, balanced by packable tokens (samples for
the padded baselines); each slot's chunk opens with what the slot carried from epoch e-1. Every slot yields the
same number of packs K, a lower bound on every slot's pack count computed from token, image and sample sums
(``EpochSplit``); the samples of a slot's packs past K are carried to the front of its own next chunk, so nothing
is lost and every rank yields exactly K x slots_per_rank batches per epoch. The bound counts full packs, so a
slot's carry grows each epoch by what its K packs leave unfilled in the budget that binds: next to nothing where
packs fill it (the token budget at 99.9% fill), about 1.5% of an epoch per epoch where they fill 98% (measured by
the benchmark's scale section); carried samples are trained first in the slot's next chunk.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from nanovlm.config import DataConfig
from nanovlm.constants import MAX_SHUFFLE_BUFFER
from nanovlm.data import lengths, packing
from nanovlm.data.index import DatasetIndex, decode_keys
from nanovlm.data.tiling import ImageLayout, as_layout

try:  # numpy's switch for the huge-page hint it gives large allocations
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy 1.x
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:
        _set_madvise_hugepage = None


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """Planning touches each of its N-sized arrays once. With numpy's huge-page hint, a kernel that compacts
    memory to find huge pages on first touch (``defrag=madvise``, a common default) can stall for seconds on a
    fragmented node; without it a first touch is a plain page fault."""
    before = _set_madvise_hugepage(False) if _set_madvise_hugepage else None
    try:
        yield
    finally:
        if _set_madvise_hugepage:
            _set_madvise_hugepage(before)


class PlanError(ValueError):
    """The data cannot be planned as configured (e.g. too few samples for the number of slots)."""


@dataclass
class SampleTable:
    """The samples of the training (or validation) directories, one row per gid, built from their indexes.

    Planning reads only the three length columns, derived for the run's model (``lengths``: a large table's are
    mapped from the node's cache, one copy for all its processes). Where a sample lives (shard, byte range, key)
    is looked up in the memory-mapped indexes only when it is read (a pack at a time: ``locate_many``) or named.
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
        return self.locate_many(np.array([gid]))[0]

    def locate_many(self, gids: np.ndarray) -> list[tuple[str, int, int, str]]:
        """``locate`` of each gid [n] (a pack's): a few numpy calls per directory instead of several per sample."""
        gids = np.asarray(gids, dtype=np.int64)
        d, shard = self.dataset_of(gids), self.shard_of(gids)
        out: list = [None] * len(gids)
        for di in np.unique(d).tolist():
            at = np.flatnonzero(d == di)
            rows = gids[at] - self.dataset_start[di]
            columns = self.indexes[di].columns
            where = zip(
                at.tolist(),
                shard[at].tolist(),
                columns["offset"][rows].tolist(),
                columns["nbytes"][rows].tolist(),
                decode_keys(columns, rows),
            )
            for j, s, offset, nbytes, key in where:
                out[j] = (self.shard_paths[s], offset, nbytes, key)
        return out

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
    def from_indexes(
        cls,
        datasets: Sequence[tuple[str, DatasetIndex]],
        layout: ImageLayout | int,
        cache_dir: str | os.PathLike | None = None,
    ) -> SampleTable:
        """Build from ``[(directory name, its index), ...]``, in that order, for the run's image ``layout``
        (an int: that many tokens per image, no splitting). With ``cache_dir`` a large table's length columns
        are mapped from the node's cache (``lengths``), shared by its processes."""
        layout = as_layout(layout)
        idxs = [idx for _, idx in datasets]
        sizes = [idx.num_samples for idx in idxs]
        shard_counts = [s.num_samples for idx in idxs for s in idx.shards]
        with small_pages():
            columns = lengths.load_columns(idxs, layout, cache_dir)
        return cls(
            **columns,
            shard_start=np.concatenate([[0], np.cumsum(shard_counts, dtype=np.int64)]).astype(np.int64),
            shard_paths=[idx.shard_location(s) for idx in idxs for s in idx.shards],
            shard_dataset=np.asarray([d for d, idx in enumerate(idxs) for _ in idx.shards], np.int32),
            dataset_start=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64),
            dataset_names=[name for name, _ in datasets],
            fingerprints=[idx.content_hash[:16] for idx in idxs],
            indexes=idxs,
            vision_unit=layout.unit,
        )

    def __getstate__(self) -> dict:
        """Whole columns mapped from a file travel (to spawned DataLoader workers) as the file's path and are
        mapped again there: pickling them would copy them into every worker."""
        state = dict(self.__dict__)
        for name in lengths.COLUMNS:
            arr = state[name]
            whole = isinstance(arr, np.memmap) and arr.filename and arr.strides == (arr.itemsize,)
            if whole and len(np.load(arr.filename, mmap_mode="r")) == len(arr):  # forward, full length: the file
                state[name] = _Mapped(arr.filename, len(arr))
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            state[name] = value.open() if isinstance(value, _Mapped) else value
        self.__dict__.update(state)


@dataclass(frozen=True)
class _Mapped:
    """A pickled stand-in for a column mapped from an .npy file."""

    path: str
    rows: int

    def open(self) -> np.ndarray:
        arr = np.load(self.path, mmap_mode="r")
        if len(arr) != self.rows:
            raise RuntimeError(f"{self.path} changed while the run was using it: restart the run")
        return arr


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
    def image_limit(self) -> int:
        """The most encoder inputs one sample may have (the padded baselines have no image budget)."""
        return self.max_images if self.mode == "packed" else 1 << 30

    @property
    def capacity(self) -> np.ndarray:
        """The most (tokens, encoder inputs, samples) one pack holds; 0 = not limited."""
        if self.mode == "packed":
            return np.array([self.max_tokens, self.max_images, 0], np.int64)
        return np.array([0, 0, self.batch_size], np.int64)

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


PIECE = 1 << 20  # samples per step of the N-sized passes: temporaries under 32 MB, reused by malloc
READ_BLOCK = 64  # at most this many places an odd slot reads forward at a time, going backwards (_blocks_backwards)


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
            gids = _shard_runs(shard_bounds, perm)
            if p == full:  # the fractional pass: a seeded subset, kept in shard order
                keep = _rng(seed, epoch, d, p, 1).choice(len(gids), round(frac * len(gids)), replace=False)
                gids = gids[np.sort(keep)]
            passes.append(gids)
        per_dir.append(passes[0] if len(passes) == 1 else np.concatenate([np.zeros(0, np.int64), *passes]))
    if n_dirs == 1:
        order = per_dir[0]
    else:  # interleave directories in proportion to their sizes (each spread evenly over the epoch)
        rel = np.concatenate([(np.arange(len(g)) + 0.5) / max(1, len(g)) for g in per_dir])
        src = np.concatenate([np.full(len(g), d) for d, g in enumerate(per_dir)])
        order = np.concatenate(per_dir)[np.lexsort((src, rel))]
    if shuffle and shuffle_buffer > 1 and len(order) > 1:
        order = _window_shuffle(order, min(shuffle_buffer, len(order)), _rng(seed, epoch, 1 << 20))
    return order


def _shard_runs(shard_bounds: np.ndarray, shards: np.ndarray, piece: int = PIECE) -> np.ndarray:
    """The gids of ``shards``, shard after shard (int64), without a Python loop over the shards: written a group
    of shards (about ``piece`` samples) at a time, so the one N-sized array is the result."""
    counts = shard_bounds[shards + 1] - shard_bounds[shards]
    ends = np.cumsum(counts)
    out = np.empty(int(ends[-1]) if len(ends) else 0, np.int64)
    cuts = np.unique(np.concatenate([[0], np.searchsorted(ends, np.arange(piece, len(out), piece)), [len(shards)]]))
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo, hi = int(ends[a - 1]) if a else 0, int(ends[b - 1])
        out[lo:hi] = np.repeat(shard_bounds[shards[a:b]] - (ends[a:b] - counts[a:b]), counts[a:b])
        out[lo:hi] += np.arange(lo, hi)
    return out


def _window_shuffle(order: np.ndarray, b: int, rng: np.random.Generator, chunk: int = 1 << 18) -> np.ndarray:
    """Sort ``order`` in place by position + U(0, b): no sample moves by ``b`` places or more, and neighbours stay
    near each other. (Shuffling fixed windows whole is cheaper at 100M samples but trained the demo tasks worse:
    63-98% held-out accuracy over four seeds in tests/integration/test_train_and_evaluate.py's run, against
    88-100%.)

    Keys are sorted as int64 (the key in whole 2^-20 places over its rank by position), then the rare runs that
    rounding tied are put in float order (``_untie``): exactly a stable sort of the float keys.
    The sort runs ``chunk`` output places at a time: a key below ``hi`` belongs to a position below ``hi``, so
    each chunk sorts its own positions' keys below ``hi`` with those earlier chunks left waiting; that is the
    order one global sort gives, in cache. Only places below ``hi`` are written, after the chunk's values are
    read, so the order is sorted where it lies: no N-sized array is made.
    """
    if not 0 < b <= MAX_SHUFFLE_BUFFER:
        raise PlanError(f"a shuffle window of {b} samples: it must be within 1..{MAX_SHUFFLE_BUFFER}")
    if not 0 < chunk <= MAX_SHUFFLE_BUFFER:
        raise ValueError(f"chunk must be within 1..{MAX_SHUFFLE_BUFFER}, got {chunk}")
    n, done = len(order), 0
    wait_key, wait_val = np.zeros(0), order[:0].copy()  # keys >= lo drawn by earlier chunks, by position
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        key = np.concatenate([wait_key, rng.random(hi - lo) * b + np.arange(lo, hi)])
        val = np.concatenate([wait_val, order[lo:hi]])
        if hi < n:
            now = key < hi
            wait_key, wait_val, key, val = key[~now], val[~now], key[now], val[now]
        # int64 [m]: the key in 2^-20 places above lo (< chunk + b <= 2^21), over 21 bits of its rank by position
        packed = ((key - lo) * (1 << 20)).astype(np.int64) << 21
        packed |= np.arange(len(key))
        packed.sort()  # distinct values: any sort gives this order
        rank = packed & ((1 << 21) - 1)
        _untie(packed >> 21, rank, key)
        order[done : done + len(key)] = val[rank]
        done += len(key)
    return order


def _untie(q: np.ndarray, rank: np.ndarray, key: np.ndarray) -> None:
    """Reorder ``rank`` within runs of equal quantised keys ``q`` by the keys themselves (then by rank), so the
    result is exactly a stable sort of the float keys. Rounding is monotone, so only such runs can be out of
    order; at 100M samples there are a few dozen."""
    same = q[1:] == q[:-1]
    if not same.any():
        return
    edges = np.diff(np.concatenate([[False], same, [False]]).astype(np.int8))
    for a, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) + 1):
        r = rank[a:e]
        rank[a:e] = r[np.lexsort((r, key[r]))]


def balanced_chunks(tokens: np.ndarray, num_slots: int, offsets: np.ndarray | None = None) -> np.ndarray:
    """Boundaries [num_slots + 1] of contiguous chunks whose token sums, plus ``offsets`` (tokens each slot
    already holds, its carry), are (nearly) equal.

    With at least as many samples as slots every chunk gets one or more samples: a long sample next to short
    ones would otherwise pull two boundaries onto the same place and leave a slot with nothing to pack.
    """
    n = len(tokens)
    total = int(tokens.sum(dtype=np.int64))
    if offsets is None or not len(offsets):
        targets = total * np.arange(1, num_slots) / num_slots
    else:  # slot s should end where the fresh tokens of slots < s plus their offsets reach s+1 equal shares
        per_slot = (total + int(np.sum(offsets))) / num_slots
        targets = np.maximum.accumulate(per_slot * np.arange(1, num_slots) - np.cumsum(offsets)[:-1])
    inner = np.clip(_prefix_search(tokens, targets), 0, n)
    if n >= num_slots > 1:
        i = np.arange(1, num_slots)
        inner = i + np.maximum.accumulate(inner - i)  # strictly increasing: boundary i >= boundary i-1 + 1
        inner = np.minimum(inner, n - num_slots + i)  # and room left for one sample per later slot
    return np.concatenate([[0], inner, [n]]).astype(np.int64)


def _prefix_search(x: np.ndarray, targets: np.ndarray, piece: int = PIECE) -> np.ndarray:
    """``searchsorted(concat([0], cumsum(x)), targets, side="left")`` for non-negative ``x`` and ascending
    ``targets``, a piece at a time: no N-sized int64 prefix sum (at 100M samples its allocation alone takes
    seconds)."""
    out = np.full(len(targets), len(x) + 1, np.int64)
    buf = np.empty(min(piece, len(x)), np.int64)
    before, t = 0, 0  # sum of the pieces so far; first target not yet placed
    for lo in range(0, len(x), piece):
        if t == len(targets):
            break
        cum = buf[: len(x[lo : lo + piece])]
        cum[:] = x[lo : lo + piece]  # then summed in place: a casting cumsum is 10x slower
        np.cumsum(cum, out=cum)
        cum += before
        end = int(np.searchsorted(targets, cum[-1], side="right"))  # targets placed in this piece
        if end > t:
            out[t:end] = lo + np.searchsorted(cum, targets[t:end], side="left") + 1
        before, t = int(cum[-1]), end
    out[targets <= 0] = 0
    return out


def _no_units() -> np.ndarray:
    return np.zeros((0, 3), np.int64)


@dataclass
class Carry:
    """The samples an epoch opens with, kept back from the one before.

    Per slot (``slots``: slot -> gids, with ``bound``: [num_slots, 3], for every slot a lower bound on the
    (tokens, encoder inputs, samples) of its carry that every process computes alike), or one ``prefix`` of the
    whole order (after a change of topology, from a saved state that lists every slot's carry). A process only
    knows the carries of the slots it packed; the bound is what the common pack count is agreed on.
    """

    slots: dict[int, np.ndarray] = field(default_factory=dict)
    bound: np.ndarray = field(default_factory=_no_units)
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def all_gids(self) -> np.ndarray:
        """Every carried gid, the prefix first, then slot by slot (needs every slot's carry)."""
        return np.concatenate([self.prefix, *(self.slots[s] for s in sorted(self.slots))]).astype(np.int64)

    def key(self) -> tuple:
        return (
            self.prefix.tobytes(),
            self.bound.tobytes(),
            tuple((s, g.tobytes()) for s, g in sorted(self.slots.items())),
        )


@dataclass
class EpochSplit:
    """One epoch's (or the rest of one epoch's) order cut into slot chunks, and the pack count K every slot will
    yield: O(N) vectorised metadata work, the same in every process, without packing anything.

    Slot s packs ``chunk(s)`` = its carry, then ``fresh[bounds[s]:bounds[s + 1]]`` (backwards, a block at a time, in
    odd slots). K is a lower bound on the packs any slot's packer makes: a pack holds at most ``capacity`` (tokens,
    encoder inputs, samples), so a slot with units U makes at least max_d ceil(U_d / capacity_d) packs, and U >= the
    carry's bound plus the fresh chunk's exact units. Each slot keeps its first K packs and carries the samples of
    the rest into its own next chunk; the next bound is what K packs cannot have taken, max(0, U_bound - K x
    capacity).
    """

    epoch: int
    topology: Topology
    fresh: np.ndarray  # gids cut into the slots' fresh chunks (the epoch's fresh order, or the rest of it)
    bounds: np.ndarray  # [num_slots + 1]
    carry: Carry  # per-slot carries (a prefix is already part of ``fresh``)
    packs_per_slot: int  # K
    bound_next: np.ndarray  # [num_slots, 3]: the next epoch's carry bound
    skip_counts: dict[str, int]  # reason -> samples of ``fresh`` no pack can take
    units: np.ndarray  # [num_slots, 3]: the (lower bound on) units of every slot's chunk
    n_fresh: int  # samples in ``fresh`` before ``restrict``
    block: int  # places an odd slot reads forward at a time (``read_block``)

    def chunk(self, slot: int) -> np.ndarray:
        """Gids slot ``slot`` packs this epoch, in order (its carry must be known here): its carry, then its part
        of ``fresh``, which odd slots read backwards a block at a time (``_blocks_backwards``). Two
        neighbouring slots then reach the shard their parts share together, both at their end or both at their
        start, and a node's cache holding a few shards per worker fetches it once: read in one direction, one slot
        would read it first and the other last, after eviction (measured: 1.05-1.08 x the dataset's bytes per
        epoch with 2 shards per worker, 32 shards, 2 workers). Slot 0 reads forward, so the part of a carried
        prefix (after a change of topology) that opens its part is packed first."""
        fresh = self.fresh[self.bounds[slot] : self.bounds[slot + 1]]
        if slot % 2:
            fresh = _blocks_backwards(fresh, self.block)
        if not self.carry.slots:
            return fresh
        if slot not in self.carry.slots:
            raise RuntimeError(f"epoch {self.epoch}: the carry of slot {slot} is not known to this process")
        return np.concatenate([self.carry.slots[slot], fresh])

    def batches_per_rank(self) -> int:
        return self.packs_per_slot * self.topology.slots_per_rank

    def restrict(self, lo: int, hi: int) -> EpochSplit:
        """The split with only the chunks of slots ``lo:hi`` kept: what one rank's workers need (it pickles in
        O(N / world_size))."""
        a, b = self.bounds[lo], self.bounds[hi]
        carry = Carry({s: g for s, g in self.carry.slots.items() if lo <= s < hi}, self.carry.bound)
        return replace(self, fresh=self.fresh[a:b].copy(), bounds=np.clip(self.bounds - a, 0, b - a), carry=carry)


def read_block(shard_start: np.ndarray) -> int:
    """An eighth of the mean shard, at most ``READ_BLOCK``: well inside a shard, so the shard two slots share is
    near the first block an odd slot reads."""
    return int(np.clip(shard_start[-1] // (8 * max(1, len(shard_start) - 1)), 1, READ_BLOCK))


def _blocks_backwards(gids: np.ndarray, block: int) -> np.ndarray:
    """``gids`` cut into blocks of ``block`` places, the blocks in reverse order, each read forward; the short block
    (``len(gids) % block`` places) opens ``gids``, so it goes last. Reads still go forward ``block`` samples at a
    time, which the kernel's read-ahead follows, and a shard's samples stay together: places that lie within d of
    each other lie within d + 2 x block after. No shard is looked up (reversing the runs of one shard instead
    looks up every sample's, ~80 ns a sample: about 1 s for a 12.5M-sample part, paid by every ``chunk``)."""
    head = len(gids) % block
    rows = gids[head:].reshape(-1, block)  # [m, block]
    return np.concatenate([rows[::-1].ravel(), gids[:head]])


def split_epoch(
    table: SampleTable, spec: PackSpec, topology: Topology, order: np.ndarray, carry: Carry, epoch: int
) -> EpochSplit:
    """Cut ``order`` (after ``carry.prefix``) into slot chunks balanced in the unit that sets K, carries included,
    and agree on K from the bound (see ``EpochSplit``)."""
    s = topology.num_slots
    order = np.concatenate([carry.prefix, order]).astype(np.int64) if carry.prefix.size else order
    per_slot = bool(carry.slots) or len(carry.bound) > 0
    bound = carry.bound if per_slot else np.zeros((s, 3), np.int64)
    if per_slot and len(bound) != s:
        raise PlanError(f"epoch {epoch}: a carry of {len(bound)} slots cannot open an epoch of {s} slots")
    if stray := sorted(set(carry.slots) - set(range(s))):
        raise PlanError(f"epoch {epoch}: the carry names slots {stray}, but the epoch has slots 0..{s - 1}")
    tokens, code, counts = _packable_tokens(table, spec, order)  # int32 [n], int8 [n], int64 [1 + reasons]
    ok = code == 0
    # balanced in the unit that sets K: packable tokens (packs) or samples (padded batches), carries included
    unit, d = (tokens, 0) if spec.mode == "packed" else (ok, 2)
    bounds = balanced_chunks(unit, s, bound[:, d] if per_slot else None)
    images = [table.n_images[order[a:b]][ok[a:b]].sum(dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    fresh = [_chunk_sums(tokens, bounds), np.array(images, np.int64), _chunk_sums(ok, bounds)]
    total = bound + np.stack(fresh, 1)  # [s, 3]
    cap = spec.capacity
    need = np.where(cap > 0, -(-total // np.maximum(cap, 1)), 0).max(1)  # packs each slot makes at least
    k = int(need.min()) if s else 0
    nxt = np.where(cap > 0, np.maximum(0, total - k * cap), 0)
    skips = _named({r: int(c) for r, c in zip(packing.SKIP_REASONS, counts[1:]) if c}, table)
    carry = carry if per_slot else Carry()
    block = read_block(table.shard_start)
    return EpochSplit(epoch, topology, order, bounds, carry, k, nxt, skips, total, len(order), block)


def _packable_tokens(
    table: SampleTable, spec: PackSpec, gids: np.ndarray, piece: int = PIECE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each gid's planned tokens (int32 [n], 0 when no pack can take it), its skip code (int8 [n], 0 = packable)
    and how many have each code (int64 [1 + len(SKIP_REASONS)]), a piece at a time (``packing.effective_lengths``):
    the length columns' gathers stay piece-sized."""
    tokens, code = np.empty(len(gids), np.int32), np.empty(len(gids), np.int8)
    counts = np.zeros(len(packing.SKIP_REASONS) + 1, np.int64)
    args = (spec.limit, spec.image_limit, spec.overlength)
    for lo in range(0, len(gids), piece):
        g = gids[lo : lo + piece]
        eff, c = packing.effective_lengths(table.length[g], table.n_images[g], *args, table.prompt[g])
        tokens[lo : lo + len(g)] = np.where(c == 0, eff, 0)
        code[lo : lo + len(g)] = c
        counts += np.bincount(c, minlength=len(counts))
    return tokens, code, counts


def _named(skipped: dict, table: SampleTable) -> dict:
    """Skip reasons as the run names them: encoder inputs are tiles when images are split."""
    if table.vision_unit == "tiles" and "too_many_images" in skipped:
        skipped["too_many_tiles"] = skipped.pop("too_many_images")
    return skipped


def _chunk_sums(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Sums of ``x`` over the chunks ``bounds`` cuts it into (int64; empty chunks sum to 0), one slice at a time,
    so no N-sized int64 copy of ``x`` is made."""
    return np.array([x[a:b].sum(dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])], np.int64)


@dataclass
class SlotPlan:
    """The packs one slot yields in one epoch, and what it carries into the next."""

    slot: int
    gids: np.ndarray  # the slot's chunk; positions below index it
    packs: list[np.ndarray]  # exactly K packs of positions (validation: topped up with empty ones)
    lengths: np.ndarray  # [len(gids)] planned length of every position (clipped when truncated)
    skipped: dict[str, np.ndarray]  # reason -> positions no pack takes
    truncated: int  # positions whose length was clipped to the limit
    carry_out: np.ndarray  # gids of the packs past K: the front of this slot's next chunk

    def pack_gids(self, k: int) -> np.ndarray:
        return self.gids[self.packs[k]]

    def packable(self) -> np.ndarray:
        """Mask of the positions a pack can take (all but the skipped)."""
        mask = np.ones(len(self.gids), bool)
        for positions in self.skipped.values():
            mask[positions] = False
        return mask


@small_pages()
def pack_slot(table: SampleTable, spec: PackSpec, split: EpochSplit, slot: int, finite: bool = False) -> SlotPlan:
    """Pack one slot's chunk and keep its first K packs, carrying the samples of the rest (``finite``: keep
    every pack, carry nothing)."""
    gids = split.chunk(slot)
    res = spec.run(table.length[gids], table.n_images[gids], table.prompt[gids])
    packs = [np.asarray(p, np.int64) for p in res.packs]
    k = len(packs) if finite else split.packs_per_slot
    if len(packs) < k:  # cannot happen: K is a lower bound on every slot's pack count
        raise RuntimeError(f"slot {slot} of epoch {split.epoch} made {len(packs)} packs, below the bound K={k}")
    skipped = _named({r: np.asarray(i, np.int64) for r, i in res.skipped.items()}, table)
    carry_out = gids[np.concatenate(packs[k:])] if len(packs) > k else np.zeros(0, np.int64)
    return SlotPlan(slot, gids, packs[:k], np.asarray(res.lengths, np.int64), skipped, len(res.truncated), carry_out)


class Frontier:
    """How far a slot's packs have consumed its chunk, in O(lookahead) numbers: ``(top, *holes)``, with ``top`` the
    last position any consumed pack took and ``holes`` the packable positions below it that none took yet.

    The online packer takes items from a buffer of the next ``lookahead`` items, so every position it has not
    reached is unconsumed and at most a buffer's worth below ``top`` is: what remains of the chunk is the holes
    plus every packable position after ``top``, whatever the packer's internal state. A worker advances one
    per pack and sends it with the batch; a saved state holds the last of every slot, so an elastic resume
    finds what each old slot left without packing it again.
    """

    def __init__(self, packable: np.ndarray) -> None:
        self.packable, self.top, self.holes = packable, -1, set()

    def advance(self, pack: np.ndarray) -> list[int]:
        """Consume ``pack`` (positions); returns the frontier after it."""
        hi = int(pack.max()) if pack.size else self.top
        if hi > self.top:
            self.holes.update((np.flatnonzero(self.packable[self.top + 1 : hi + 1]) + self.top + 1).tolist())
            self.top = hi
        self.holes.difference_update(pack.tolist())
        return [self.top, *sorted(self.holes)]

    @staticmethod
    def remaining(packable: np.ndarray, frontier: Sequence[int]) -> np.ndarray:
        """Mask of the chunk's positions still to be packed after ``frontier`` (empty: nothing consumed)."""
        keep = packable.copy()
        if len(frontier):
            keep[: frontier[0] + 1] = False
            keep[np.asarray(frontier[1:], np.int64)] = True
        return keep


def packable(table: SampleTable, spec: PackSpec, gids: np.ndarray) -> np.ndarray:
    """Which of ``gids`` a pack can take (the over-length and image rules; ``packing.effective_lengths``)."""
    return _packable_tokens(table, spec, gids)[1] == 0


@dataclass(frozen=True)
class ConsumedPart:
    """Part of an epoch consumed under an earlier topology (for elastic resume)."""

    world_size: int
    num_workers: int
    consumed: int  # batches each rank had consumed under that topology
    frontiers: tuple[tuple[int, ...], ...] = ()  # per slot, its ``Frontier`` then (empty: consumed nothing)

    def remaining(self, table: SampleTable, spec: PackSpec, split: EpochSplit) -> np.ndarray:
        """Gids of ``split`` (this part's) that its slots had not consumed nor skipped, slot after slot."""
        out = []
        for slot in range(split.topology.num_slots):
            gids = split.chunk(slot)
            frontier = self.frontiers[slot] if slot < len(self.frontiers) else ()
            out.append(gids[Frontier.remaining(packable(table, spec, gids), frontier)])
        return np.concatenate(out) if out else np.zeros(0, np.int64)


@dataclass
class EpochPlan:
    """Every slot's packs of one epoch (or of the rest of one), for validation, elastic resume, tools and tests:
    training processes pack only their own slots (``pack_slot``)."""

    split: EpochSplit
    slots: list[SlotPlan]

    @property
    def topology(self) -> Topology:
        return self.split.topology

    @property
    def packs_per_slot(self) -> int:
        return len(self.slots[0].packs) if self.slots else 0

    @property
    def order(self) -> np.ndarray:
        """Every slot's chunk, slot after slot; the positions below index it."""
        return np.concatenate([p.gids for p in self.slots]) if self.slots else np.zeros(0, np.int64)

    @property
    def slot_bounds(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(p.gids) for p in self.slots])]).astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([p.lengths for p in self.slots]) if self.slots else np.zeros(0, np.int64)

    @property
    def carry_out(self) -> np.ndarray:
        return np.concatenate([p.carry_out for p in self.slots]) if self.slots else np.zeros(0, np.int64)

    def carry(self) -> Carry:
        """What opens the next epoch on the same topology."""
        return Carry({p.slot: p.carry_out for p in self.slots}, self.split.bound_next)

    @property
    def skipped(self) -> dict[str, np.ndarray]:
        out: dict[str, list[np.ndarray]] = {}
        for p, lo in zip(self.slots, self.slot_bounds):
            for r, i in p.skipped.items():
                out.setdefault(r, []).append(i + lo)
        return {r: np.concatenate(v) for r, v in out.items()}

    @property
    def truncated(self) -> int:
        return sum(p.truncated for p in self.slots)

    def pack(self, slot: int, k: int) -> np.ndarray:
        """Positions of pack ``k`` of ``slot``."""
        return self.slots[slot].packs[k] + self.slot_bounds[slot]

    def batches_per_rank(self) -> int:
        return self.packs_per_slot * self.topology.slots_per_rank

    def slot_skips(self, slot: int) -> dict[str, np.ndarray]:
        """Positions of the slot's chunk that the packer skipped, by reason."""
        return {r: i + self.slot_bounds[slot] for r, i in self.slots[slot].skipped.items()}

    def rank_positions(self, rank: int) -> np.ndarray:
        """Positions planned for ``rank`` this epoch: its packs plus what its slots skipped."""
        spr = self.topology.slots_per_rank
        slots = range(rank * spr, (rank + 1) * spr)
        parts = [self.pack(s, k) for s in slots for k in range(self.packs_per_slot)]
        parts += [p for s in slots for p in self.slot_skips(s).values()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def consumed_part(self, consumed: int) -> ConsumedPart:
        """This plan's part after ``consumed`` batches per rank, with every slot's frontier (as workers report it).

        Batch ``b`` of a rank comes from its local slot ``b % slots_per_rank``, pack ``b // slots_per_rank``.
        """
        spr, out = self.topology.slots_per_rank, []
        for p in self.slots:
            n_packs = min(self.packs_per_slot, max(0, -(-(consumed - p.slot % spr) // spr)))
            f, frontier = Frontier(p.packable()), []
            for k in range(n_packs):
                frontier = f.advance(p.packs[k])
            out.append(tuple(frontier))
        return ConsumedPart(self.topology.world_size, self.topology.num_workers, consumed, tuple(out))


def pack_all(table: SampleTable, spec: PackSpec, split: EpochSplit, finite: bool = False) -> EpochPlan:
    """Every slot of ``split`` packed (O(N)). ``finite`` (validation: one pass, nothing carried): no slot is cut;
    slots with fewer packs are topped up with empty packs (all padding, no loss) to the longest slot's count, so
    every sample is evaluated exactly once whatever the topology, and ranks still step together."""
    slots = range(split.topology.num_slots)
    if not finite:
        return EpochPlan(split, [pack_slot(table, spec, split, s) for s in slots])
    made = [pack_slot(table, spec, split, s, finite=True) for s in slots]
    k = max((len(m.packs) for m in made), default=0)
    for m in made:
        m.packs += [np.zeros(0, np.int64)] * (k - len(m.packs))
    return EpochPlan(split, made)


def _no_pack_message(split: EpochSplit) -> str:
    """Why some slot gets no pack, with the fix that applies: the skips when they are the cause."""
    topology, n, skips = split.topology, split.n_fresh, split.skip_counts
    where = (
        f"every one of the {topology.num_slots} slots (world_size={topology.world_size} x "
        f"workers={topology.slots_per_rank})"
    )
    n_skipped = sum(skips.values())
    if n_skipped * 2 >= n:
        reasons = ", ".join(f"{r}={c}" for r, c in sorted(skips.items()))
        fixes = []
        if "overlength" in skips:
            fixes.append("raise data.max_tokens or set data.overlength=truncate")
        if "too_many_images" in skips or "too_many_tiles" in skips:
            fixes.append("raise data.max_images (or, for tiles, lower model.vision.max_tiles or longest_edge)")
        if "empty" in skips:
            fixes.append("re-prepare the data: its index has samples without tokens")
        return (
            f"epoch {split.epoch}: {n_skipped} of its {n} samples cannot be packed ({reasons}), so the rest cannot "
            f"give {where} a batch; " + "; ".join(fixes or ["check the data"])
        )
    return (
        f"epoch {split.epoch}: {n} samples cannot give {where} at least one batch; use fewer data.num_workers or "
        "ranks, a smaller data.max_tokens, or more data"
    )


@small_pages()
def plan_split(
    table: SampleTable,
    spec: PackSpec,
    topology: Topology,
    seed: int,
    epoch: int,
    carry: Carry | None = None,
    history: Sequence[ConsumedPart] = (),
    weights: Sequence[float] = (),
    shuffle_buffer: int = 256,
    shuffle: bool = True,
    finite: bool = False,
) -> EpochSplit:
    """The split of ``epoch`` for ``topology``: vectorised, except after a change of topology mid-epoch.

    ``history`` lists the parts of this epoch consumed under earlier topologies (``carry`` opened the first):
    each is split in turn and what its slots' frontiers say they consumed or skipped is removed (vectorised, no
    packing), so the split covers exactly what remains, over the new topology. When that remainder cannot give
    every new slot a pack, K = 0 and the whole remainder opens the next epoch (``state.restore``). A fresh epoch
    with K = 0 is a ``PlanError`` naming the cause; so is a training epoch without samples.
    """
    carry = carry or Carry()
    order = epoch_order(table, seed, epoch, weights, shuffle_buffer, shuffle)
    if not (len(order) or carry.prefix.size or carry.slots or finite):
        raise PlanError(
            f"epoch {epoch} has no samples to train on: the data.train directories hold no samples, or "
            "data.train_weights round every directory down to zero samples"
        )
    for part in history:  # vectorised: each part's frontiers say what its slots left
        old = split_epoch(table, spec, Topology(part.world_size, part.num_workers), order, carry, epoch)
        order, carry = part.remaining(table, spec, old), Carry()
    split = split_epoch(table, spec, topology, order, carry, epoch)
    if split.packs_per_slot == 0 and len(split.fresh) and not (finite or history):
        raise PlanError(_no_pack_message(split))
    return split


def build_epoch_plan(
    table: SampleTable,
    spec: PackSpec,
    topology: Topology,
    seed: int,
    epoch: int,
    carry: Carry | None = None,
    history: Sequence[ConsumedPart] = (),
    weights: Sequence[float] = (),
    shuffle_buffer: int = 256,
    shuffle: bool = True,
    finite: bool = False,
) -> EpochPlan:
    """Every slot's packs of ``epoch`` (``plan_split``, then every slot packed): for validation, tools and tests."""
    split = plan_split(table, spec, topology, seed, epoch, carry, history, weights, shuffle_buffer, shuffle, finite)
    return pack_all(table, spec, split, finite)
