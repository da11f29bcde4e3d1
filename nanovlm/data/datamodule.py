"""PackedMultimodalDataModule: sharded WebDataset directories -> packed batches, exactly resumable.

How it works (details in shards.py / producer.py):

* ``setup`` loads every directory's index (per sample: byte range, token length, image count), checks that
  the index was counted with the run's tokenizer, and builds the deterministic plan of the current epoch:
  order from (seed, epoch), split over world_size x workers slots balanced by tokens, packed per slot, every
  slot cut to the same number of packs K (the cut samples open the next epoch). Every rank computes the same
  plan, so ranks agree on steps without talking, and each rank yields exactly K x workers batches per epoch.
* The train loader is an infinite stream over data epochs (training ends at ``trainer.max_steps``). Each
  DataLoader worker runs a background producer that reads its packs by seeking into the shards, processes
  and collates them into a bounded queue.
* The state is the position in the plan (epoch, batches consumed, samples carried in). It advances only in
  ``on_batch_consumed`` (called after a batch was trained), never on prefetch, so a checkpoint holds what was
  trained. Resuming recomputes the epoch plan (O(N) metadata) and seeks: no replay. torch's DataLoader reads
  workers round-robin starting at worker 0, so after ``c`` consumed batches worker ``w`` serves slot
  ``(w + c) % W``; the interleaved stream then equals the uninterrupted one, batch for batch.
* A different world size or worker count continues the epoch: what the old topology already consumed is
  removed from the epoch order and the remainder is re-planned over the new slots (no loss, no repeat).
  A different seed, dataset or packing config is refused: the saved position would not mean anything.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from nanovlm.config import DataConfig, ModelConfig, image_token_count
from nanovlm.data.collate import collate_packed, collate_padded
from nanovlm.data.format import SampleError
from nanovlm.data.index import load_index
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.producer import PackProducer, PlannedPack, Skip
from nanovlm.data.reader import ShardReader
from nanovlm.data.shards import EpochPlan, PackSpec, SampleTable, Segment, Topology, build_epoch_plan
from nanovlm.data.tokenizer import accepted_fingerprints, load_tokenizer
from nanovlm.data.worker_signals import shield_from_preemption

log = logging.getLogger(__name__)
STATE_VERSION = 1


# data-state fingerprint key: which samples truncation skips because their prompt alone fills the limit
PROMPT_ONLY_KEY = "truncate_skips_prompt_only_samples"


class DataStateError(RuntimeError):
    """A saved data state cannot be restored exactly (the message says what changed and what to do)."""


class DataMismatchError(RuntimeError):
    """A processed sample disagrees with its index entry (index made with another tokenizer or model)."""


class SkipRateError(RuntimeError):
    """More samples of a dataset were skipped in one epoch than ``data.max_skip_rate`` allows."""


# ----------------------------------------------------------------------------------------------------------
# what a DataLoader worker needs (picklable; no open files, no threads)


@dataclass
class _Position:
    epoch: int = 0
    consumed: int = 0  # batches of this epoch the rank has consumed (under the current topology)
    carry_in: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # gids opening this epoch
    history: tuple[Segment, ...] = ()  # parts of this epoch consumed under earlier topologies


@dataclass
class _StreamSpec:
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

    def plan(self, pos: _Position) -> EpochPlan:
        return build_epoch_plan(
            self.table,
            self.spec,
            self.topology,
            self.seed,
            pos.epoch,
            pos.carry_in,
            pos.history,
            self.weights,
            self.shuffle_buffer,
            self.shuffle,
            self.finite,
        )


class _PackStream(IterableDataset):
    """The rank's batches, read by one producer per DataLoader worker, in the plan's order."""

    def __init__(self, s: _StreamSpec, start: _Position, first_plan: EpochPlan | None = None) -> None:
        self.s, self.start, self._first_plan = s, start, first_plan

    def _packs(self, local: int, first_pack: int) -> Iterator[PlannedPack]:
        s, spr = self.s, self.s.topology.slots_per_rank
        slot = s.rank * spr + local
        pos = dataclasses.replace(self.start)
        plan = self._first_plan if self._first_plan is not None else s.plan(pos)
        k = first_pack
        while True:
            while k < plan.packs_per_slot:
                positions = plan.pack(slot, k)
                gids = plan.order[positions]
                extra: dict[str, Any] = {"epoch": pos.epoch, "index": k * spr + local, "slot": slot}
                if k == 0:  # the skips the planner made in this slot's chunk, reported once per epoch
                    # plain dicts: torch's default_convert/pin_memory copy a mapping and then update() it, which
                    # would add a Counter's counts twice
                    extra["planned_skips"] = {
                        r: dict(Counter(s.table.dataset[plan.order[p]].tolist()))
                        for r, p in plan.slot_skips(slot).items()
                    }
                if k == plan.packs_per_slot - 1 and local == spr - 1:  # the rank's last batch of the epoch
                    extra["epoch_end"] = True  # carry it, so the training process never re-plans to find the end
                    extra["carry_out"] = plan.carry_out.tolist()
                yield PlannedPack(
                    pos.epoch,
                    k * spr + local,
                    refs=[int(g) for g in gids],
                    order=[int(p) for p in positions],
                    planned_lengths=[int(n) for n in plan.lengths[positions]],
                    extra=extra,
                )
                k += 1
            if s.finite:
                return
            k -= plan.packs_per_slot
            pos = _Position(pos.epoch + 1, 0, plan.carry_out, ())
            plan = s.plan(pos)

    def __iter__(self) -> Iterator[dict]:
        s = self.s
        info = get_worker_info()
        worker = info.id if info is not None else 0
        spr = s.topology.slots_per_rank
        if info is not None and info.num_workers != spr:
            raise RuntimeError(f"stream planned for {spr} workers runs on {info.num_workers}")
        c = self.start.consumed
        local = (worker + c) % spr  # rotation: the DataLoader reads worker 0 first
        reader = ShardReader()
        t, limit = s.table, s.spec.limit
        # with "drop" the plan already left out over-length samples: process without a limit, so a sample whose
        # real length disagrees with the index fails the length check below instead of passing as a skip
        limit_arg = limit if s.spec.overlength == "truncate" else None
        planned: dict[int, int] = {}

        def load(gid: int):
            key = t.keys[gid]
            record = reader.read(t.shard_paths[t.shard[gid]], int(t.offset[gid]), int(t.nbytes[gid]), key)
            sample = s.processor.process(record, limit_arg, s.spec.overlength)
            n, want = int(sample.input_ids.numel()), planned[gid]
            if n != want and not (sample.truncated and n <= want):
                raise DataMismatchError(
                    f"sample {key!r} of {t.dataset_names[t.dataset[gid]]} has {n} tokens after processing but its "
                    f"index says {want}: the index was made with another tokenizer or image token count. Re-run "
                    "scripts/prepare_data.py with this run's tokenizer and model config."
                )
            return sample

        def assemble(pack: PlannedPack, samples: list, skips: list[Skip]) -> dict:
            for sk in skips:
                log.warning("skipped sample %s (%s): %s", sk.key, sk.reason, sk.detail)
            meta = dict(pack.extra)
            meta["skips"] = [(t.keys[sk.ref], sk.reason, int(t.dataset[sk.ref])) for sk in skips]
            if s.spec.mode == "packed":
                return collate_packed(samples, s.spec.max_tokens, s.pad_id, s.image_size, meta)
            return collate_padded(samples, s.pad_id, s.image_size, meta)

        def key_of(gid: int) -> str:
            return f"{t.keys[gid]} ({t.shard_paths[t.shard[gid]]})"

        def packs() -> Iterator[PlannedPack]:
            for p in self._packs(local, (worker + c) // spr):
                planned.update(zip(p.refs, p.planned_lengths))
                yield p

        producer = PackProducer(
            packs(),
            load,
            assemble,
            key_of,
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


def _init_worker(worker_id: int) -> None:
    """Workers outlive a preemption SIGTERM sent to the whole job so the trainer can save (worker_signals)."""
    shield_from_preemption()


# DataLoader iterators whose worker processes are running. One left unfinished at interpreter exit would have
# its workers terminated by multiprocessing's exit handler, and torch's dead-worker check would then print
# "DataLoader worker ... is killed by signal: Terminated" from inside that handler; shutting them down first, as
# torch does when an iterator is closed, ends them quietly. (Registered after multiprocessing's handler, so it
# runs before it.)
_open_worker_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shut_down_open_workers() -> None:
    for it in list(_open_worker_iterators):
        with contextlib.suppress(Exception):
            it._shutdown_workers()


class _TimedDataLoader(DataLoader):
    """A DataLoader that adds the time the caller waited for each batch to a telemetry sink."""

    wait_sink: list[float] | None = None

    def __iter__(self):  # type: ignore[override]
        it = super().__iter__()
        if hasattr(it, "_shutdown_workers"):  # the multi-process iterator
            _open_worker_iterators.add(it)
        sink = self.wait_sink
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            except (ConnectionError, EOFError) as e:  # torch's own dead-worker check can come second
                raise RuntimeError(
                    f"a DataLoader worker died while handing over a batch ({type(e).__name__}: {e}); it was probably "
                    "killed (out of memory?): lower data.num_workers or data.queue_size, or give the job more memory"
                ) from e
            if sink is not None:
                sink[0] += time.perf_counter() - t0
            yield batch


# ----------------------------------------------------------------------------------------------------------
# the DataModule


class PackedMultimodalDataModule(L.LightningDataModule):
    """Packed, sharded, exactly resumable multimodal data (see the module docstring and docs/internals.md).

    ``rank`` / ``world_size`` default to torch.distributed's (or 0 / 1); pass them to simulate ranks in tests.
    """

    def __init__(
        self,
        data_cfg: DataConfig,
        model_cfg: ModelConfig,
        tokenizer=None,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.model_cfg = data_cfg, model_cfg
        self._tokenizer = tokenizer
        self._rank_arg, self._world_arg, self._pin_arg = rank, world_size, pin_memory
        self.image_token_count = image_token_count(model_cfg)
        self.image_size = model_cfg.vision.image_size
        self.spec = PackSpec.from_config(data_cfg)
        self.rank, self.world_size = 0, 1
        self.table: SampleTable | None = None
        self.val_table: SampleTable | None = None
        self._pos = _Position()
        self._plan_cache: tuple[tuple, EpochPlan] | None = None
        self._pending_state: dict | None = None
        self._epoch_skips: Counter = Counter()  # (reason, dataset) -> count, this rank, this epoch
        self._total_skips: Counter = Counter()  # reason -> count, this rank, since the start of the run
        self._last_epoch_skips: dict[str, int] = {}
        self._planned_per_ds: np.ndarray | None = None
        self._wait = [0.0]
        self._tel = Counter()
        self._tel_skips: Counter = Counter()
        self._queue_depth = 0.0

    # ---- setup ---------------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer)
        return self._tokenizer

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.cfg.num_workers)

    def _load_table(self, dirs: list[str]) -> SampleTable:
        accepted = accepted_fingerprints(self.tokenizer)
        fingerprint = accepted[0]
        datasets = []
        for d in dirs:
            idx = load_index(d)
            if idx.tokenizer not in accepted:
                raise DataMismatchError(
                    f"{d}: the index was made with tokenizer {idx.tokenizer}, but this run uses {fingerprint} "
                    f"({self.cfg.tokenizer}); its token lengths would be wrong. Re-run scripts/prepare_data.py "
                    "with this run's tokenizer (--tokenizer)."
                )
            shards = [
                {
                    "path": str(idx.shard_path(sh).resolve()),
                    "keys": sh.keys,
                    "offsets": sh.offsets,
                    "nbytes": sh.nbytes,
                    "text_tokens": sh.text_tokens,
                    "n_images": sh.n_images,
                    "prompt_tokens": sh.prompt_tokens or None,
                    "prompt_images": sh.prompt_images or None,
                }
                for sh in idx.shards
            ]
            datasets.append((str(d), shards))
        return SampleTable.from_shard_columns(datasets, self.image_token_count)

    def setup(self, stage: str | None = None) -> None:
        if self._world_arg is not None:
            self.rank, self.world_size = int(self._rank_arg or 0), int(self._world_arg)
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        elif self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.table is None:
            if not self.cfg.train:
                raise ValueError("data.train lists no dataset directory")
            self.table = self._load_table(list(self.cfg.train))
            self.val_table = self._load_table(list(self.cfg.val)) if self.cfg.val else None
            if self.val_table is not None and self.cfg.val_samples > 0:  # one global subset: any topology sees it
                self.val_table = self.val_table.head(self.cfg.val_samples)
            self.processor = SampleProcessor(
                self.tokenizer,
                self.image_size,
                self.image_token_count,
                self.cfg.image_resize,
                self.cfg.max_image_pixels,
            )
            pad = self.tokenizer.pad_token_id
            self.pad_id = int(pad if pad is not None else 0)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        self._start_epoch_accounting()

    def _stream_spec(self, val: bool = False) -> _StreamSpec:
        table = self.val_table if val else self.table
        assert table is not None, "call setup() first"
        return _StreamSpec(
            table=table,
            spec=self.spec,
            topology=self.topology,
            rank=self.rank,
            seed=self.cfg.seed,
            weights=() if val else tuple(self.cfg.train_weights),
            shuffle_buffer=self.cfg.shuffle_buffer,
            shuffle=not val,
            finite=val,
            processor=self.processor,
            pad_id=self.pad_id,
            image_size=self.image_size,
            queue_size=self.cfg.queue_size,
            read_ahead=self.cfg.lookahead,
        )

    def current_plan(self) -> EpochPlan:
        """The plan of the epoch the stream is in (cached; O(N) metadata work to build)."""
        pos = self._pos
        key = (pos.epoch, tuple(pos.carry_in.tolist()), pos.history, self.topology)
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, self._stream_spec().plan(pos))
        return self._plan_cache[1]

    def _start_epoch_accounting(self) -> None:
        self._planned_per_ds = None  # computed on first use: a resume builds only the restored epoch's plan

    def _planned_samples(self) -> np.ndarray:
        """Samples per directory planned for this rank in the current epoch (the skip-rate denominators)."""
        if self._planned_per_ds is None:
            plan = self.current_plan()
            pos = plan.rank_positions(self.rank)
            n_dirs = len(self.table.dataset_names)
            self._planned_per_ds = np.bincount(self.table.dataset[plan.order[pos]], minlength=n_dirs)
        return self._planned_per_ds

    # ---- loaders ---------------------------------------------------------------------------------------------

    def _loader(self, stream: _PackStream, persistent: bool = False) -> DataLoader:
        nw = self.cfg.num_workers
        pin = self._pin_arg
        if pin is None:
            on_gpu = self.trainer is not None and getattr(self.trainer.strategy.root_device, "type", "cpu") == "cuda"
            pin = bool(self.cfg.pin_memory and on_gpu)
        dl = _TimedDataLoader(
            stream,
            batch_size=None,
            num_workers=nw,
            pin_memory=pin,
            prefetch_factor=1 if nw else None,  # the producer's queue already buffers ahead
            # validation reuses its workers: torch joins exhausted workers only after their 5 s poll timeout
            persistent_workers=persistent and nw > 0,
            worker_init_fn=_init_worker,
        )
        dl.wait_sink = self._wait
        return dl

    def train_dataloader(self) -> DataLoader:
        """Infinite stream of this rank's batches from the saved position on."""
        if self.table is None:
            self.setup("fit")
        return self._loader(_PackStream(self._stream_spec(), dataclasses.replace(self._pos), self.current_plan()))

    def val_dataloader(self) -> DataLoader | list:
        """Finite, deterministic packed validation batches (epoch 0 order, no shuffling); [] without data.val."""
        if self.table is None:
            self.setup("fit")
        if self.val_table is None:
            return []
        return self._loader(_PackStream(self._stream_spec(val=True), _Position()), persistent=True)

    # ---- position ----------------------------------------------------------------------------------------------

    def on_batch_consumed(self, batch: dict) -> None:
        """Advance the saved position past ``batch`` (call once per trained batch, e.g. on_train_batch_end)."""
        meta = batch["meta"]
        epoch, index = int(meta["epoch"]), int(meta["index"])
        if (epoch, index) != (self._pos.epoch, self._pos.consumed):
            raise RuntimeError(
                f"on_batch_consumed got batch {index} of epoch {epoch}, expected batch {self._pos.consumed} of epoch "
                f"{self._pos.epoch}: call it once per training batch, in order, with batches of train_dataloader()"
            )
        for reason, per_ds in meta.get("planned_skips", {}).items():
            for ds, n in per_ds.items():
                self._count_skip(reason, int(ds), n)
        for _key, reason, ds in meta.get("skips", []):
            self._count_skip(reason, ds, 1)
        self._tel.update(
            packs=1,
            samples=meta["n_samples"],
            real_tokens=meta["real_tokens"],
            slots=meta["slots"],
            images=meta["n_images"],
            loss_tokens=meta.get("loss_tokens", 0),
        )
        self._queue_depth = float(meta.get("queue_depth", 0))
        self._check_skip_rate()
        self._pos.consumed = index + 1
        if meta.get("epoch_end"):  # epoch done: its cut packs open the next one
            self._last_epoch_skips = self._epoch_skips_by_reason()
            if self._last_epoch_skips:
                log.warning(
                    "data epoch %d (rank %d): skipped %d samples: %s",
                    epoch,
                    self.rank,
                    sum(self._last_epoch_skips.values()),
                    ", ".join(f"{r}={n}" for r, n in sorted(self._last_epoch_skips.items())),
                )
            self._pos = _Position(epoch + 1, 0, np.asarray(meta["carry_out"], np.int64), ())
            self._epoch_skips = Counter()
            self._start_epoch_accounting()

    def _count_skip(self, reason: str, ds: int, n: int) -> None:
        self._epoch_skips[(reason, ds)] += n
        self._total_skips[reason] += n
        self._tel_skips[reason] += n

    def _epoch_skips_by_reason(self) -> dict[str, int]:
        out: Counter = Counter()
        for (reason, _ds), n in self._epoch_skips.items():
            out[reason] += n
        return dict(out)

    def _check_skip_rate(self) -> None:
        per_ds: Counter = Counter()
        for (_reason, ds), n in self._epoch_skips.items():
            per_ds[ds] += n
        for ds, n in per_ds.items():
            planned = int(self._planned_samples()[ds])
            if planned and n > self.cfg.max_skip_rate * planned:
                reasons = Counter({r: c for (r, d), c in self._epoch_skips.items() if d == ds}).most_common(3)
                raise SkipRateError(
                    f"{self.table.dataset_names[ds]}: {n} of this rank's {planned} samples of epoch {self._pos.epoch} "
                    f"were skipped (> data.max_skip_rate={self.cfg.max_skip_rate}); top reasons: "
                    + ", ".join(f"{r} x{c}" for r, c in reasons)
                    + ". Fix or re-prepare the data (scripts/prepare_data.py validates every sample), or raise "
                    "data.max_skip_rate."
                )

    # ---- state -------------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        out = {
            "seed": self.cfg.seed,
            "datasets": list(self.table.fingerprints),
            "weights": [float(w) for w in self.cfg.train_weights] or [1.0] * len(self.table.fingerprints),
            "packing": dataclasses.asdict(self.spec),
            "shuffle_buffer": self.cfg.shuffle_buffer,
            "image_token_count": self.image_token_count,
        }
        # The dataset hashes leave out the index's prompt columns: they change a plan only under truncation, and
        # only through the samples whose prompt alone fills the limit (skipped instead of truncated). Those are
        # named here by a hash of their rows, and only when there are any, so a state saved without the key
        # still loads wherever the plan is the same.
        if self.spec.overlength == "truncate":
            t, limit = self.table, self.spec.limit
            prompt_only = np.flatnonzero((t.length > limit) & (t.prompt >= limit))
            if prompt_only.size:
                out[PROMPT_ONLY_KEY] = hashlib.sha1(prompt_only.astype(np.int64).tobytes()).hexdigest()[:16]
        return out

    def _local_state(self) -> dict:
        return {
            "rank": self.rank,
            "epoch": self._pos.epoch,
            "consumed": self._pos.consumed,
            "epoch_skips": [[r, d, n] for (r, d), n in sorted(self._epoch_skips.items())],
            "total_skips": dict(self._total_skips),
        }

    def state_dict(self) -> dict:
        """The position of every rank (all-gathered under torch.distributed; every rank must call it)."""
        if self.table is None:
            return {}
        ranks = [self._local_state()]
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, ranks[0])
            ranks = gathered
        return self.merge_rank_states(
            [
                {
                    "version": STATE_VERSION,
                    "world_size": self.world_size,
                    "num_workers": self.cfg.num_workers,
                    "carry_in": self._pos.carry_in.tolist(),
                    "history": [dataclasses.astuple(h) for h in self._pos.history],
                    "config": self._fingerprint(),
                    "dataset_names": list(self.table.dataset_names),  # for messages only (the hashes decide)
                    "ranks": ranks,
                }
            ]
        )

    @staticmethod
    def merge_rank_states(states: list[dict]) -> dict:
        """Combine per-rank states (e.g. of ranks simulated in one process) into one; checks they agree."""
        out = dict(states[0])
        ranks = {r["rank"]: r for s in states for r in s["ranks"]}
        out["ranks"] = [ranks[k] for k in sorted(ranks)]
        for s in states[1:]:
            for k in ("world_size", "num_workers", "carry_in", "history", "config"):
                if s[k] != out[k]:
                    raise DataStateError(f"ranks disagree on the data state field {k!r}")
        positions = {(r["epoch"], r["consumed"]) for r in out["ranks"]}
        if len(positions) > 1:
            raise DataStateError(f"ranks are at different data positions {sorted(positions)}; they must step together")
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (exactly; or re-planned for a new world size / worker count)."""
        if not state:
            return
        if self.table is None:  # Lightning may restore before setup(): apply it there
            self._pending_state = state
            return
        if state.get("version") != STATE_VERSION:
            raise DataStateError(f"data state version {state.get('version')} is not {STATE_VERSION}")
        saved, now = state["config"], self._fingerprint()
        keys = [*now, *([PROMPT_ONLY_KEY] if PROMPT_ONLY_KEY in saved and PROMPT_ONLY_KEY not in now else [])]
        changed = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
        if "datasets" in saved and saved["datasets"] != now["datasets"]:  # name the directories, not only hashes
            was = state.get("dataset_names", "?")
            changed.append(f"data.train: {was} -> {list(self.table.dataset_names)} (content hashes above)")
        if changed:
            raise DataStateError(
                "cannot resume the data stream exactly: the data order depends on settings that changed since "
                "the checkpoint (" + "; ".join(changed) + "). Restore the old values to resume exactly, or start "
                "a new data stream from the checkpoint's weights: a new trainer.run_dir with "
                "checkpoint.init_from=<the checkpoint>."
            )
        ranks = state["ranks"]
        if len(ranks) != state["world_size"]:
            raise DataStateError(
                f"the data state holds {len(ranks)} of {state['world_size']} ranks: it was saved without gathering "
                "(call state_dict() on every rank under torch.distributed)"
            )
        epoch, consumed = ranks[0]["epoch"], ranks[0]["consumed"]
        history = tuple(Segment(*h) for h in state["history"])
        carry = np.asarray(state["carry_in"], np.int64)
        if carry.size and int(carry.max()) >= len(self.table):
            raise DataStateError("the data state carries samples that are not in the datasets")
        same = state["world_size"] == self.world_size and state["num_workers"] == self.cfg.num_workers
        if not same and consumed:  # elastic: remove what the old topology consumed, re-plan the rest
            history = (*history, Segment(state["world_size"], state["num_workers"], consumed))
            consumed = 0
            log.info(
                "data: resuming epoch %d with world_size=%d, workers=%d (saved with %d, %d): re-planning the rest",
                epoch,
                self.world_size,
                self.cfg.num_workers,
                state["world_size"],
                state["num_workers"],
            )
        self._pos = _Position(epoch, consumed, carry, history)
        if history and self.current_plan().packs_per_slot == 0:
            # too little of the epoch is left to give every new slot a batch: end it, the rest opens the next
            log.info(
                "data: the rest of epoch %d is too small for the new topology; it opens epoch %d", epoch, epoch + 1
            )
            self._pos = _Position(epoch + 1, 0, self.current_plan().carry_out, ())
        self._epoch_skips = Counter()
        self._total_skips = Counter()
        mine = [r for r in ranks if r["rank"] == self.rank] if same else ([] if self.rank else ranks)
        for r in mine:
            for reason, d, n in r["epoch_skips"]:
                self._epoch_skips[(reason, d)] += n
            self._total_skips.update(r["total_skips"])
        self._start_epoch_accounting()

    # ---- reporting ---------------------------------------------------------------------------------------------

    def telemetry(self) -> dict:
        """Counters since the last call (for the training loop's logger)."""
        t, wait = self._tel, self._wait[0]
        out = {
            "packs": t["packs"],
            "samples": t["samples"],
            "real_tokens": t["real_tokens"],
            "slots": t["slots"],
            "loss_tokens": t["loss_tokens"],
            "images": t["images"],
            "fill": t["real_tokens"] / t["slots"] if t["slots"] else 0.0,
            "data_wait_s": wait,
            "queue_depth": self._queue_depth,
            "skips_by_reason": dict(self._tel_skips),
            "epoch": self._pos.epoch,
            "epoch_position": self._pos.consumed,
            "last_epoch_skips": dict(self._last_epoch_skips),
        }
        self._tel, self._tel_skips, self._wait[0] = Counter(), Counter(), 0.0
        return out

    def pack_bytes(self) -> int:
        """Bytes of one finished pack (token tensors + the largest image tensor it may hold)."""
        tokens = self.spec.max_tokens if self.spec.mode == "packed" else self.spec.batch_size * self.spec.max_tokens
        images = self.spec.max_images if self.spec.mode == "packed" else self.spec.batch_size * self.spec.max_images
        return tokens * 8 * 3 + images * 3 * self.image_size**2

    def summary(self) -> dict:
        """Sizes, per-epoch plan and memory bound (for the start-of-run log)."""
        plan = self.current_plan()
        tab = self.table
        lengths = np.minimum(plan.lengths, self.spec.max_tokens)
        kept = np.ones(len(plan.order), bool)  # planned skips hold no tokens of the epoch
        for positions in plan.skipped.values():
            kept[positions] = False
        n_packs = plan.packs_per_slot * plan.topology.num_slots
        workers = max(1, self.cfg.num_workers)
        queue_mb = self.cfg.queue_size * workers * self.pack_bytes() / 2**20
        read_ahead_mb = self.cfg.lookahead * workers * 3 * self.image_size**2 * 2 / 2**20
        return {
            "datasets": [
                {
                    "dir": name,
                    "samples": int((tab.dataset == d).sum()),
                    "shards": int((tab.shard_dataset == d).sum()),
                    "weight": (self.cfg.train_weights or [1.0] * len(tab.dataset_names))[d],
                }
                for d, name in enumerate(tab.dataset_names)
            ],
            "val_samples": len(self.val_table) if self.val_table is not None else 0,
            "epoch": self._pos.epoch,
            "samples_per_epoch": int(len(plan.order)),
            "tokens_per_epoch": int(lengths[kept].sum()),
            "planned_skips": {r: int(p.size) for r, p in plan.skipped.items()},
            "packs_per_epoch": int(n_packs),
            "batches_per_rank_per_epoch": plan.batches_per_rank(),
            "carried_to_next_epoch": int(plan.carry_out.size),
            "planned_fill": float(lengths[plan.pack_items].sum() / max(1, n_packs * self.spec.max_tokens))
            if self.spec.mode == "packed"
            else None,
            "queue_memory_mb": round(queue_mb, 1),
            "read_ahead_memory_mb": round(read_ahead_mb, 1),
            "world_size": self.world_size,
            "num_workers": self.cfg.num_workers,
        }


class DataPositionCallback(L.Callback):
    """Advances the DataModule's position after every trained batch.

    Lightning runs callbacks' ``on_train_batch_end`` before the LightningModule's and moves ModelCheckpoint
    last, so with this callback a checkpoint saved at a step holds the position after that step's batch.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dm = trainer.datamodule
        if dm is not None and hasattr(dm, "on_batch_consumed"):  # ours, or one that keeps its position the same way
            dm.on_batch_consumed(batch)
