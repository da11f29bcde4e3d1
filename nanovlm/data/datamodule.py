"""PackedMultimodalDataModule: sharded WebDataset directories -> packed batches, exactly resumable.

The Lightning face of the data pipeline; each job lives in its own module:

* ``shards``: the deterministic epoch plan (order from (seed, epoch), split over world_size x workers slots
  balanced by packable tokens; every slot yields the same number of packs K, a bound every process computes from
  sums, and carries what is left into its own next chunk). Ranks agree on steps without talking, and each
  DataLoader worker packs only its own slot.
* ``stream`` / ``loader``: the rank's batches, read by one background producer per DataLoader worker.
* ``state``: the position saved in checkpoints (epoch, batches consumed, the slots' carries) and its
  restoring, exactly or re-planned for another world size or worker count.
* ``accounting``: skip counts (``data.max_skip_rate``) and telemetry.

The position advances only in ``on_batch_consumed`` (called after a batch was trained, by
``train.callbacks.DataPositionCallback``), never on prefetch, so a checkpoint holds what was trained.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from nanovlm.config import DataConfig, ModelConfig, image_token_count
from nanovlm.constants import DEFERRED_JPEGS
from nanovlm.data.accounting import DataCounters, SkipRateError
from nanovlm.data.collate import StaticLayout
from nanovlm.data.device_decode import DeviceDecoder, check_decoder
from nanovlm.data.index import load_index
from nanovlm.data.loader import make_loader
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.remote import default_cache_dir
from nanovlm.data.shard_cache import prefetch_depth, shard_cache
from nanovlm.data.shards import Carry, EpochPlan, EpochSplit, PackSpec, SampleTable, Topology, pack_all, pack_slot
from nanovlm.data.state import DataState, DataStateError, Position, check_fingerprint, fingerprint, restore
from nanovlm.data.stream import DataMismatchError, PackStream, StreamSpec
from nanovlm.data.tiling import ImageLayout
from nanovlm.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from nanovlm.dist import all_gather_object, initialized, rank_world

__all__ = ["DataMismatchError", "DataStateError", "PackedMultimodalDataModule", "SkipRateError"]


def load_table(
    dirs: list[str],
    tokenizer,
    tokenizer_name: str,
    layout: ImageLayout,
    chat_format: str = "chatml",
    cache_dir: str | None = None,
) -> SampleTable:
    """The sample table of dataset directories (local or URLs, whose indexes are fetched into ``cache_dir``, where
    a large table's length columns are kept too), refusing an index counted with another tokenizer or chat
    format."""
    fingerprint_now = tokenizer_fingerprint(tokenizer, chat_format)
    datasets = []
    for d in dirs:
        idx = load_index(d, cache_dir=cache_dir)
        if idx.tokenizer != fingerprint_now:
            raise DataMismatchError(
                f"{d}: the index was made with tokenizer {idx.tokenizer}, but this run uses {fingerprint_now} "
                f"({tokenizer_name}, data.chat_format={chat_format}); its token lengths would be wrong. Re-run "
                "scripts/prepare_data.py with this run's tokenizer and config (--tokenizer, --config)."
            )
        datasets.append((str(d), idx))
    return SampleTable.from_indexes(datasets, layout, cache_dir or default_cache_dir())


class PackedMultimodalDataModule(L.LightningDataModule):
    """Packed, sharded, exactly resumable multimodal data (see the module docstring and docs/internals.md).

    ``rank`` / ``world_size`` default to torch.distributed's (or the trainer's, or 0 / 1); pass them to simulate
    ranks in tests.
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
        self.shard_cache = None  # shard_cache.ShardCache when a dataset is a URL
        self.prefetch_shards = data_cfg.prefetch_shards  # remote shards each worker fetches ahead (set by setup)
        self.static: StaticLayout | None = None  # data.static_shapes: the packs' fixed shapes
        self.position = Position()
        self.counters = DataCounters()
        self.device_decoder = DeviceDecoder()  # data.image_decode=device: decodes packs' JPEGs after the move
        self._split_cache: tuple[tuple, EpochSplit] | None = None
        self._carry_out: dict[int, np.ndarray] = {}  # slot -> what its last pack of this epoch carries on
        self._frontier: dict[int, list[int]] = {}  # slot -> how far its consumed packs reached (shards.Frontier)
        self._pending_state: dict | None = None
        self._planned_per_ds: np.ndarray | None = None

    # ---- setup ---------------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer, self.model_cfg.vision.image_splitting)
        return self._tokenizer

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.cfg.num_workers)

    def _resolve_rank(self) -> None:
        if self._world_arg is not None:
            self.rank, self.world_size = int(self._rank_arg or 0), int(self._world_arg)
        elif initialized():
            self.rank, self.world_size = rank_world()
        elif self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")

    def setup(self, stage: str | None = None) -> None:
        self._resolve_rank()
        if self.table is None:
            if not self.cfg.train:
                raise ValueError("data.train lists no dataset directory")
            self.processor = SampleProcessor.from_config(self.tokenizer, self.model_cfg, self.cfg)
            args = (self.tokenizer, self.cfg.tokenizer, self.processor.layout, self.cfg.chat_format, self.cfg.cache_dir)
            self.table = load_table(list(self.cfg.train), *args)
            self.val_table = load_table(list(self.cfg.val), *args) if self.cfg.val else None
            indexes = [*self.table.indexes, *(self.val_table.indexes if self.val_table is not None else [])]
            self.shard_cache = shard_cache(indexes, self.cfg.cache_dir, self.cfg.cache_max_bytes)
            self.prefetch_shards = self._prefetch_depth()
            if self.val_table is not None and self.cfg.val_samples > 0:  # one global subset: any topology sees it
                self.val_table = self.val_table.head(self.cfg.val_samples)
            pad = self.tokenizer.pad_token_id
            self.pad_id = int(pad if pad is not None else 0)
            self.static = self._static_layout() if self.cfg.static_shapes else None
            if self.cfg.image_decode == "device" and self.trainer is not None:
                check_decoder(self.trainer.strategy.root_device)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        self._planned_per_ds = None

    def _static_layout(self) -> StaticLayout:
        """One layout for training and validation packs: segments from the shortest sample of either."""
        tables = [t for t in (self.table, self.val_table) if t is not None]
        lengths = np.concatenate([t.length for t in tables])
        p = self.processor
        return StaticLayout.for_lengths(
            lengths, self.spec.max_tokens, self.spec.max_images, p.image_token_id, p.image_token_count
        )

    def _stream_spec(self, val: bool = False) -> StreamSpec:
        table = self.val_table if val else self.table
        assert table is not None, "call setup() first"
        return StreamSpec(
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
            static=self.static,
            cache=self.shard_cache,
            prefetch_shards=self.prefetch_shards,
        )

    def _prefetch_depth(self) -> int:
        """``data.prefetch_shards``, or fewer where the node's shard cache cannot hold them for all of its
        workers (shard_cache.prefetch_depth): every rank of the node runs ``num_workers`` workers on the one cache."""
        if self.shard_cache is None or not self.cfg.prefetch_shards:
            return self.cfg.prefetch_shards
        local = os.environ.get("LOCAL_WORLD_SIZE", "")  # torchrun's; else the Trainer's devices per node
        if local.isdigit():
            ranks = int(local)
        else:
            ranks = self.trainer.num_devices if self.trainer is not None else 1
        workers = max(1, ranks) * max(1, self.cfg.num_workers)
        return prefetch_depth(self.shard_cache, self.cfg.prefetch_shards, workers)

    def current_split(self) -> EpochSplit:
        """The split of the epoch the stream is in, cut down to this rank's chunks (cached: vectorised O(N) work
        to build, O(N / world_size) to keep)."""
        pos = self.position
        if self._split_cache is None or self._split_cache[0] != self._split_key(pos):
            self._full_split(pos)
        return self._split_cache[1]

    def _split_key(self, pos: Position) -> tuple:
        return (pos.epoch, pos.carry.key(), pos.history, self.topology, self.rank)

    def _full_split(self, pos: Position) -> EpochSplit:
        """Every slot's chunks of ``pos``'s epoch; caches this rank's part for ``current_split``."""
        split = self._stream_spec().split(pos)
        own = self._own_slots()
        self._split_cache = (self._split_key(pos), split.restrict(own.start, own.stop))
        return split

    def current_plan(self) -> EpochPlan:
        """Every slot's packs of the current epoch (O(N) packing; needs every slot's carry, so after a restore or
        in one process): for tools and tests. Training packs only this rank's slots."""
        return pack_all(self.table, self.spec, self._full_split(self.position))

    def _own_slots(self) -> range:
        spr = self.topology.slots_per_rank
        return range(self.rank * spr, (self.rank + 1) * spr)

    def _planned_samples(self) -> np.ndarray:
        """Samples per directory in this rank's chunks of the current epoch (the skip-rate denominators;
        computed on first use, so a resume builds only the restored epoch's split)."""
        if self._planned_per_ds is None:
            split = self.current_split()
            gids = np.concatenate([split.chunk(s) for s in self._own_slots()])
            self._planned_per_ds = np.bincount(self.table.dataset_of(gids), minlength=len(self.table.dataset_names))
        return self._planned_per_ds

    # ---- loaders ---------------------------------------------------------------------------------------------

    def _loader(self, stream: PackStream, persistent: bool = False) -> DataLoader:
        pin = self._pin_arg
        if pin is None:
            on_gpu = self.trainer is not None and getattr(self.trainer.strategy.root_device, "type", "cpu") == "cuda"
            pin = bool(self.cfg.pin_memory and on_gpu)
        return make_loader(stream, self.cfg.num_workers, pin, self.counters.wait, persistent)

    def train_dataloader(self) -> DataLoader:
        """Infinite stream of this rank's batches from the saved position on."""
        if self.table is None:
            self.setup("fit")
        return self._loader(PackStream(self._stream_spec(), dataclasses.replace(self.position), self.current_split()))

    def val_dataloader(self) -> DataLoader | list:
        """Finite, deterministic packed validation batches (epoch 0 order, no shuffling); [] without data.val."""
        if self.table is None:
            self.setup("fit")
        if self.val_table is None:
            return []
        return self._loader(PackStream(self._stream_spec(val=True), Position()), persistent=True)

    # ---- device ------------------------------------------------------------------------------------------------

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's move to the device, then (``data.image_decode=device``) the pack's deferred JPEGs decoded
        into its ``pixel_values`` there. Their bytes stay on the host: nvJPEG parses them from host memory."""
        deferred = batch.pop(DEFERRED_JPEGS, None) if isinstance(batch, dict) else None
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        if deferred:
            self.device_decoder(batch["pixel_values"], deferred)
        return batch

    # ---- position ----------------------------------------------------------------------------------------------

    def on_batch_consumed(self, batch: dict) -> None:
        """Advance the saved position past ``batch`` (call once per trained batch, e.g. on_train_batch_end)."""
        meta = batch["meta"]
        epoch, index = int(meta["epoch"]), int(meta["index"])
        if (epoch, index) != (self.position.epoch, self.position.consumed):
            raise RuntimeError(
                f"on_batch_consumed got batch {index} of epoch {epoch}, expected batch {self.position.consumed} of "
                f"epoch {self.position.epoch}: call it once per training batch, in order, with batches of "
                "train_dataloader()"
            )
        self.counters.count(meta)
        if self.counters.epoch_skips:  # the denominators need this epoch's plan: build it only when skips happened
            names, rate = self.table.dataset_names, self.cfg.max_skip_rate
            self.counters.check_skip_rate(self._planned_samples(), names, epoch, rate)
        self.position.consumed = index + 1
        self._frontier[int(meta["worker_slot"])] = list(meta["slot_frontier"])
        if "slot_carry" in meta:  # a slot's last pack: what it left opens its next chunk
            self._carry_out[int(meta["worker_slot"])] = np.asarray(meta["slot_carry"], np.int64)
        if meta.get("epoch_end"):
            self.counters.end_epoch(epoch, self.rank)
            carry = Carry(self._carry_out, np.asarray(meta["carry_bound"], np.int64).reshape(-1, 3))
            self.position, self._carry_out, self._frontier = Position(epoch + 1, 0, carry, ()), {}, {}
            self._planned_per_ds = None

    # ---- state -------------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        return fingerprint(self.cfg, self.spec, self.table, self.processor.layout)

    def state_dict(self) -> dict:
        """The position of every rank (all-gathered under torch.distributed; every rank must call it)."""
        if self.table is None:
            return {}
        pos = self.position
        mine = self.counters.rank_state(self.rank, pos.epoch, pos.consumed)
        if pos.carry.slots and not pos.history:  # after an elastic resume every rank holds all (history_carry)
            mine.carry_in = [pos.carry.slots[s].tolist() for s in self._own_slots()]
        mine.frontier = [self._frontier.get(s, []) for s in self._own_slots()]
        first = self._own_slots().start  # slots that finished the epoch before this rank did: what they carry on
        mine.carry_out = [[s - first, g.tolist()] for s, g in sorted(self._carry_out.items())]
        ranks = all_gather_object(mine) if self.world_size > 1 else [mine]
        state = DataState(
            world_size=self.world_size,
            num_workers=self.cfg.num_workers,
            carry_prefix=pos.carry.prefix.tolist(),
            carry_bound=pos.carry.bound.tolist(),
            history=[[h.world_size, h.num_workers, h.consumed, [list(f) for f in h.frontiers]] for h in pos.history],
            history_carry=[pos.carry.slots[s].tolist() for s in sorted(pos.carry.slots)] if pos.history else [],
            config=self._fingerprint(),
            dataset_names=list(self.table.dataset_names),
            ranks=ranks,
        )
        return DataState.merge([state]).to_dict()

    @staticmethod
    def merge_rank_states(states: list[dict]) -> dict:
        """Combine per-rank states (e.g. of ranks simulated in one process) into one; checks they agree."""
        return DataState.merge([DataState.from_dict(s) for s in states]).to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (exactly; or re-planned for a new world size / worker count)."""
        if not state:
            return
        if self.table is None:  # Lightning may restore before setup(): apply it there
            self._pending_state = state
            return
        saved = DataState.from_dict(state)
        check_fingerprint(saved, self._fingerprint(), list(self.table.dataset_names))

        def split(pos: Position) -> EpochSplit:
            self.position = pos
            return self._full_split(pos)

        self.position, skip_ranks = restore(saved, self.topology, self.rank, len(self.table), split)
        same = (saved.world_size, saved.num_workers) == (self.world_size, self.cfg.num_workers)
        first = self._own_slots().start  # the same topology continues its slots; a new one starts its own
        self._frontier = {first + j: f for r in skip_ranks for j, f in enumerate(r.frontier) if f} if same else {}
        self._carry_out = (
            {first + j: np.asarray(g, np.int64) for r in skip_ranks for j, g in r.carry_out} if same else {}
        )
        self.counters.restore(skip_ranks)
        self._planned_per_ds = None

    # ---- reporting ---------------------------------------------------------------------------------------------

    def telemetry(self) -> dict:
        """Counters since the last call (for the training loop's logger)."""
        out = self.counters.telemetry() | {"epoch": self.position.epoch, "epoch_position": self.position.consumed}
        if self.cfg.image_decode == "device":
            out |= self.device_decoder.counts()
        return out

    def pack_bytes(self) -> int:
        """Bytes of one finished pack (token tensors + the largest image tensor it may hold)."""
        tokens = self.spec.max_tokens if self.spec.mode == "packed" else self.spec.batch_size * self.spec.max_tokens
        images = self.spec.max_images if self.spec.mode == "packed" else self.spec.batch_size * self.spec.max_images
        return tokens * 8 * 3 + images * 3 * self.image_size**2

    def summary(self) -> dict:
        """Sizes, per-epoch plan and memory bound (for the start-of-run log). The fill is this rank's first slot's
        (packing one slot; the epoch's sizes come from the split without packing)."""
        split = self.current_split()
        first = pack_slot(self.table, self.spec, split, self._own_slots().start)
        tab = self.table
        n_packs = split.packs_per_slot * split.topology.num_slots
        workers = max(1, self.cfg.num_workers)
        queue_mb = self.cfg.queue_size * workers * self.pack_bytes() / 2**20
        layout = self.processor.layout  # views per read-ahead sample: ~2 images, each 1 view or up to max_tiles + 1
        views = min(self.spec.max_images, 2 * (layout.max_tiles + 1 if layout.splitting else 1))
        read_ahead_mb = self.cfg.lookahead * workers * 3 * self.image_size**2 * views / 2**20
        first_tokens = sum(int(first.lengths[p].sum()) for p in first.packs)
        return {
            "datasets": [
                {
                    "dir": name,
                    "samples": int(tab.dataset_start[d + 1] - tab.dataset_start[d]),
                    "shards": int((tab.shard_dataset == d).sum()),
                    "weight": (self.cfg.train_weights or [1.0] * len(tab.dataset_names))[d],
                }
                for d, name in enumerate(tab.dataset_names)
            ],
            "val_samples": len(self.val_table) if self.val_table is not None else 0,
            "epoch": self.position.epoch,
            "samples_per_epoch": split.n_fresh,
            "tokens_per_epoch": int(split.units[:, 0].sum() - split.carry.bound[:, 0].sum()),
            "planned_skips": dict(split.skip_counts),
            "packs_per_epoch": int(n_packs),
            "batches_per_rank_per_epoch": split.batches_per_rank(),
            "slot_carry_out": int(first.carry_out.size),
            "planned_fill": first_tokens / max(1, len(first.packs) * self.spec.max_tokens)
            if self.spec.mode == "packed"
            else None,
            "queue_memory_mb": round(queue_mb, 1),
            "read_ahead_memory_mb": round(read_ahead_mb, 1),
            "world_size": self.world_size,
            "num_workers": self.cfg.num_workers,
        }
