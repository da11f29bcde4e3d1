"""The data position saved in every checkpoint: where each rank is in the deterministic epoch plan.

``DataState`` is what ``PackedMultimodalDataModule.state_dict()`` returns (as a plain dict, so checkpoints hold
no class of ours), one for the whole job: the ranks step together, so one epoch / consumed pair describes
them all; ``ranks`` keeps each rank's skip counts and the carries its slots opened the epoch with (only the
slot that packed a carry knows it, so the state gathers them). ``restore`` turns a saved state into the
position to continue from: the same position when the topology is the same, or (elastic) the rest of the epoch
re-planned over the new ranks and workers, with what the old topology consumed listed in ``history``.

The ``config`` fingerprint names everything the epoch order depends on; a state whose fingerprint differs
from the run's is refused with the list of what changed, since its position would mean other samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanovlm.config import DataConfig
from nanovlm.data.shards import Carry, ConsumedPart, EpochSplit, PackSpec, SampleTable, Topology
from nanovlm.data.tiling import ImageLayout

log = logging.getLogger(__name__)
# What a saved state's positions mean: the plan's order and how slots read their chunks. A state of another
# version would resume into other samples, so it is refused by name. 4: odd slots read their part backwards a
# block at a time (shards.read_block).
STATE_VERSION = 4


class DataStateError(RuntimeError):
    """A saved data state cannot be restored exactly (the message says what changed and what to do)."""


@dataclass
class Position:
    """Where a rank is in the epoch plan."""

    epoch: int = 0
    consumed: int = 0  # batches of this epoch the rank has consumed (under the current topology)
    carry: Carry = field(default_factory=Carry)  # what opened this epoch (the first part of it, see history)
    history: tuple[ConsumedPart, ...] = ()  # parts of this epoch consumed under earlier topologies


@dataclass
class RankState:
    """One rank's position, skip counts (``epoch_skips``: [reason, dataset, count] of this epoch), the carry each of
    its slots opened the epoch with (``carry_in[local slot]``: gids) and how far each consumed its chunk."""

    rank: int
    epoch: int
    consumed: int
    epoch_skips: list[list] = field(default_factory=list)
    total_skips: dict[str, int] = field(default_factory=dict)
    carry_in: list[list[int]] = field(default_factory=list)
    frontier: list[list[int]] = field(default_factory=list)  # per local slot: its shards.Frontier (elastic resume)
    carry_out: list[list] = field(default_factory=list)  # [local slot, gids]: carries of slots done with the epoch


@dataclass
class DataState:
    """The data position of a whole job, as saved in a checkpoint (``to_dict`` / ``from_dict``)."""

    world_size: int
    num_workers: int
    carry_prefix: list[int]  # gids opening the epoch ahead of every slot (after a change of topology)
    carry_bound: list[list[int]]  # [slots][3]: the common lower bound on each slot's carry (shards.Carry)
    history: list[list]  # [world_size, num_workers, consumed, frontiers] per earlier topology of the epoch
    history_carry: list[list[int]]  # with history: every slot's carry of the epoch's first topology
    config: dict[str, Any]  # the fingerprint (see ``fingerprint``)
    dataset_names: list[str]  # for messages only: the content hashes in ``config`` decide
    ranks: list[RankState]
    version: int = STATE_VERSION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DataState:
        if d.get("version") != STATE_VERSION:
            raise DataStateError(
                f"data state version {d.get('version')} is not {STATE_VERSION}: it was saved by another version "
                "of the data pipeline; start a new data stream from the checkpoint's weights with "
                "checkpoint.init_from=<the checkpoint>"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            out = cls(**{k: v for k, v in d.items() if k in fields})
            out.ranks = [RankState(**r) if isinstance(r, dict) else r for r in out.ranks]
        except TypeError as e:
            raise DataStateError(f"the data state is malformed ({e})") from None
        return out

    @staticmethod
    def merge(states: list[DataState]) -> DataState:
        """Combine per-rank states (each rank's own, or ranks simulated in one process) into one; they must agree."""
        out = dataclasses.replace(states[0])
        ranks = {r.rank: r for s in states for r in s.ranks}
        out.ranks = [ranks[k] for k in sorted(ranks)]
        for s in states[1:]:
            for k in ("world_size", "num_workers", "carry_prefix", "carry_bound", "history", "history_carry", "config"):
                if getattr(s, k) != getattr(out, k):
                    raise DataStateError(f"ranks disagree on the data state field {k!r}")
        positions = {(r.epoch, r.consumed) for r in out.ranks}
        if len(positions) > 1:
            raise DataStateError(f"ranks are at different data positions {sorted(positions)}; they must step together")
        return out


def fingerprint(cfg: DataConfig, spec: PackSpec, table: SampleTable, layout: ImageLayout) -> dict[str, Any]:
    """Everything the epoch order depends on. Under truncation that includes which samples are skipped because
    their prompt alone fills the limit (the index's prompt columns decide it: the dataset hashes cover them,
    but this names the effect for this run's limit), named by a hash of their rows."""
    out: dict[str, Any] = {
        "seed": cfg.seed,
        "datasets": list(table.fingerprints),
        "weights": [float(w) for w in cfg.train_weights] or [1.0] * len(table.fingerprints),
        "packing": dataclasses.asdict(spec),
        "shuffle_buffer": cfg.shuffle_buffer,
        "image_token_count": layout.tokens_per_tile,
    }
    if layout.splitting:  # lengths follow the grids (recorded only then: unsplit states keep their keys)
        out["image_splitting"] = {"image_size": layout.image_size, "max_tiles": layout.max_tiles}
        if layout.longest_edge:  # Idefics3's grid rule
            out["image_splitting"]["longest_edge"] = layout.longest_edge
    if spec.overlength == "truncate":
        prompt_only = np.flatnonzero((table.length > spec.limit) & (table.prompt >= spec.limit))
        out["prompt_only_skips"] = hashlib.sha1(prompt_only.astype(np.int64).tobytes()).hexdigest()[:16]
    return out


def check_fingerprint(state: DataState, now: dict[str, Any], dataset_names: list[str]) -> None:
    """Refuse a state saved under another seed, dataset, packing or model config, naming each change."""
    saved = state.config

    def shown(d: dict, k: str) -> str:
        return repr(d[k]) if k in d else "(not recorded)"

    changed = [f"{k}: {shown(saved, k)} -> {shown(now, k)}" for k in {**saved, **now} if saved.get(k) != now.get(k)]
    if saved.get("datasets") != now.get("datasets"):  # name the directories, not only the hashes
        changed.append(f"data.train: {state.dataset_names} -> {dataset_names} (content hashes above)")
    if changed:
        raise DataStateError(
            "cannot resume the data stream exactly: the data order depends on settings that changed since "
            "the checkpoint (" + "; ".join(changed) + "). Restore the old values to resume exactly, or start "
            "a new data stream from the checkpoint's weights: a new trainer.run_dir with "
            "checkpoint.init_from=<the checkpoint>."
        )


def restore(
    state: DataState, topology: Topology, rank: int, num_samples: int, split: Callable[[Position], EpochSplit]
) -> tuple[Position, list[RankState]]:
    """The position for ``rank`` to continue from under ``topology``, and the rank states whose skip counts it
    takes over.

    Same topology: the saved position. Another world size or worker count mid-epoch: what the old topology
    consumed joins ``history`` and the rest of the epoch is re-planned over the new slots; when too little is
    left to give every new slot a batch, the epoch ends there and the rest opens the next one. At an epoch's
    start, the old slots' carries become one prefix of the new order. The skip counts of an elastic resume all
    go to rank 0 (the per-rank split no longer exists).
    """
    if len(state.ranks) != state.world_size:
        raise DataStateError(
            f"the data state holds {len(state.ranks)} of {state.world_size} ranks: it was saved without gathering "
            "(call state_dict() on every rank under torch.distributed)"
        )
    epoch, consumed = state.ranks[0].epoch, state.ranks[0].consumed
    history = tuple(part(*h) for h in state.history)
    carry = saved_carry(state)
    if any(g.size and int(g.max()) >= num_samples for g in (carry.prefix, *carry.slots.values())):
        raise DataStateError("the data state carries samples that are not in the datasets")
    same = (state.world_size, state.num_workers) == (topology.world_size, topology.num_workers)
    if not same and consumed:
        spr = max(1, state.num_workers)
        frontiers = [[]] * (state.world_size * spr)
        for r in state.ranks:
            frontiers[r.rank * spr : r.rank * spr + len(r.frontier)] = r.frontier
        history = (*history, part(state.world_size, state.num_workers, consumed, frontiers))
        consumed = 0
        log.info(
            "data: resuming epoch %d with world_size=%d, workers=%d (saved with %d, %d): re-planning the rest",
            epoch,
            topology.world_size,
            topology.num_workers,
            state.world_size,
            state.num_workers,
        )
    elif not same and not history:  # a new topology opens the epoch: the old slots' carries lead its order
        carry = Carry(prefix=carry.all_gids())
    pos = Position(epoch, consumed, carry, history)
    rest = split(pos) if history else None
    if rest is not None and rest.packs_per_slot == 0:
        log.info("data: the rest of epoch %d is too small for the new topology; it opens epoch %d", epoch, epoch + 1)
        pos = Position(epoch + 1, 0, Carry(prefix=rest.fresh), ())
    return pos, [r for r in state.ranks if r.rank == rank] if same else (state.ranks if rank == 0 else [])


def part(world_size: int, num_workers: int, consumed: int, frontiers: list[list[int]] = ()) -> ConsumedPart:
    """A ``ConsumedPart`` from its saved form (lists)."""
    return ConsumedPart(world_size, num_workers, consumed, tuple(tuple(int(x) for x in f) for f in frontiers))


def saved_carry(state: DataState) -> Carry:
    """The carry the saved epoch opened with: every slot's, gathered from the rank that packed it (after an elastic
    resume, every rank holds all of the first topology's, ``history_carry``)."""
    spr = max(1, state.num_workers)
    slots = {r.rank * spr + j: np.asarray(g, np.int64) for r in state.ranks for j, g in enumerate(r.carry_in)}
    if state.history:
        slots = {s: np.asarray(g, np.int64) for s, g in enumerate(state.history_carry)}
    bound = np.asarray(state.carry_bound, np.int64).reshape(-1, 3)
    if len(bound) and len(slots) != len(bound):
        raise DataStateError(f"the data state lists the carries of {len(slots)} of its {len(bound)} slots")
    return Carry(slots if len(bound) else {}, bound, np.asarray(state.carry_prefix, np.int64))
