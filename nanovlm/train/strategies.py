"""Distributed strategies, precision, activation checkpointing and compilation, chosen from ``trainer.*``.

- ``auto`` / ``single``: one process (Lightning picks the device).
- ``ddp``: ``DDPStrategy`` (gloo on CPU, NCCL on GPU). Every rank holds the full model.
- ``fsdp``: FSDP2 through Lightning's ``ModelParallelStrategy``. The LightningModule calls ``shard_model`` in
  ``configure_model``, which applies ``fully_shard`` to every transformer block and then to the root module
  over a 1-D data-parallel mesh of all ranks. Checkpoints are by default one *full* (gathered) state dict
  written by rank 0: simple, portable, and exact on resume; fine for models up to a few billion parameters.
  ``checkpoint.format=sharded`` has every rank write its own shards instead (``ShardedCheckpointStrategy``,
  see ``sharded.py``).

Works the same under ``python scripts/train.py`` (Lightning launches the local processes), ``torchrun`` and
SLURM ``srun`` (Lightning reads the rank from the environment).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from nanovlm.config import CheckpointConfig, TrainerConfig
from nanovlm.train import sharded
from nanovlm.train.checkpoint import CheckpointWriteError, fsync_dir

DIST_TIMEOUT = timedelta(minutes=30)
log = logging.getLogger(__name__)


def resolve_accelerator(cfg: TrainerConfig) -> str:
    """'auto' -> 'gpu' when CUDA is available, else 'cpu'."""
    if cfg.accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.accelerator


def resolve_precision(cfg: TrainerConfig) -> str:
    """'auto' -> bf16-mixed on GPU, 32-true on CPU (bitwise-reproducible, and CPU bf16 autocast is slow)."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-mixed" if resolve_accelerator(cfg) == "gpu" else "32-true"


def build_strategy(cfg: TrainerConfig, checkpoint: CheckpointConfig | None = None) -> Any:
    """A Lightning strategy object (or the string 'auto') for ``trainer.strategy`` and ``checkpoint.format``."""
    checkpoint = checkpoint or CheckpointConfig()
    if cfg.strategy in ("auto", "single"):
        return "auto"
    if cfg.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        # find_unused_parameters=False: every part gets a gradient (frozen parts have requires_grad=False).
        return DDPStrategy(find_unused_parameters=False, timeout=DIST_TIMEOUT)
    if cfg.strategy == "fsdp" and checkpoint.format == "sharded":
        return ShardedCheckpointStrategy(async_save=checkpoint.async_save, timeout=DIST_TIMEOUT)
    if cfg.strategy == "fsdp":
        return ModelParallelStrategy(save_distributed_checkpoint=False, timeout=DIST_TIMEOUT)
    raise ValueError(f"unknown trainer.strategy {cfg.strategy!r}; choose auto, single, ddp or fsdp")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks that FSDP2, activation checkpointing and compile act on."""
    return [*model.vision.blocks, *model.language.layers]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward. Wraps ``forward`` in place, so parameter names (and
    therefore checkpoints) are the same with and without it."""
    from torch.utils.checkpoint import checkpoint

    for block in transformer_blocks(model):
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile`` keeps parameter names)."""
    for block in transformer_blocks(model):
        block.compile()


def compile_step(model: nn.Module, device: torch.device, backend: str = "inductor", cuda_graphs: bool = True) -> None:
    """``trainer.compile=step``: ``torch.compile(fullgraph=True)`` of the model's static forward (``NanoVLM.
    static_forward``: embeddings, vision, decoder, head and loss), whose backward AOTAutograd compiles with it.
    Static packs give it one shape, so it compiles once; ``fullgraph`` makes a graph break an error instead of a
    silent slowdown. On CUDA, CUDA graphs (``mode="reduce-overhead"``) replay the whole step's kernels with one
    launch, which is what a small model's host-bound step needs (``cuda_graphs=False``: the compiled kernels alone,
    for the benchmark to tell the two apart). The parameters and their names are untouched."""
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" and cuda_graphs else None
    model.static_forward = torch.compile(model.static_forward, fullgraph=True, backend=backend, mode=mode)


def shard_model(model: nn.Module, precision: str, device: torch.device) -> None:
    """FSDP2: ``fully_shard`` each transformer block, then the root (embeddings, projector, head).

    Uses a 1-D mesh over all ranks (pure data parallel). Under bf16 precision the sharded parameters are
    gathered in bf16 and gradients reduced in fp32.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if precision.startswith("bf16"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if hasattr(model, "vision_every_forward"):  # a pack without images must gather the vision blocks too
        model.vision_every_forward = True


def launcher_topology(devices: Any, num_nodes: int) -> tuple[Any, int]:
    """(devices, num_nodes) for the Trainer: under torchrun, what torchrun started.

    Lightning refuses a ``devices x num_nodes`` that differs from torchrun's world size, and ``base.yaml`` says
    ``devices: 1``, so ``torchrun --nproc_per_node 8 scripts/train.py`` would fail unless the user also typed
    ``trainer.devices=8``. The launcher knows; a differing config value is overridden with a note.
    """
    env = os.environ
    local, world = env.get("LOCAL_WORLD_SIZE", ""), env.get("WORLD_SIZE", "")
    if not (env.get("TORCHELASTIC_RUN_ID") and local.isdigit() and world.isdigit()):
        return devices, num_nodes
    per_node, nodes = int(local), max(1, int(world) // max(1, int(local)))
    differs = devices not in ("auto", per_node) or num_nodes != nodes
    if differs and env.get("RANK", "0") == "0":
        print(
            f"[launch] torchrun started {nodes} node(s) x {per_node} processes: using trainer.devices={per_node} "
            f"trainer.num_nodes={nodes} (the config said {devices} and {num_nodes})",
            flush=True,
        )
    return per_node, nodes


class ShardedCheckpointStrategy(ModelParallelStrategy):
    """FSDP2 (Lightning's ``ModelParallelStrategy``) whose checkpoints are sharded directories, written
    atomically and read through ``sharded``'s safe reader (onto any world size). A full checkpoint file still
    loads (Lightning's loader, ``weights_only``), so a run can switch to sharded checkpoints mid-way.

    Every save goes to ``<name>.tmp`` and is renamed by rank 0 once every rank's shards are written: a directory
    with the checkpoint's name is always complete. With ``async_save`` (``checkpoint.async_save``) a save copies
    the shards to host memory and returns; a background thread writes them (over a gloo group of its own, so its
    collectives never interleave with training's) while training goes on. One save is in flight at a time: the
    next save, a load, a stop and the end of training first wait for it and publish it (``finish_checkpoint``).
    """

    def __init__(self, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.async_save = async_save
        self._pending: tuple[Any, Path, Path] | None = None  # (DCP's future, temp dir, final path) in flight
        self._save_group: Any = None  # gloo group of the background writes (made on the first async save)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.finish_checkpoint()
        path = Path(self.broadcast(str(checkpoint_path)))
        if not sharded.is_sharded(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        sharded.load_model_and_optimizers(path, self.model, self.optimizers, strict=strict)
        return sharded.read_meta(path)  # step, loops, DataModule and RNG states

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("ShardedCheckpointStrategy takes no storage_options")
        try:  # the save in flight first; its failure must not keep this one (maybe a stop's) from being tried
            self.finish_checkpoint()
        except CheckpointWriteError as e:
            log.error("%s; writing the next checkpoint anyway", e)
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.global_rank == 0 and tmp.exists():  # left by a killed save
            sharded.remove(tmp)
        self.barrier("sharded-save-start")
        try:
            future = self._write(checkpoint, tmp)
        except (OSError, RuntimeError) as e:
            raise _write_error(path, e) from e
        if future is not None:
            self._pending = (future, tmp, path)
            return
        self.barrier("sharded-save-written")  # every rank's shards, DCP's .metadata and meta.pt are in tmp
        error = _publish(tmp, path) if self.global_rank == 0 else None
        error = self.broadcast(error)  # rank 0's outcome: every rank raises it, none waits on the others
        if error is not None:
            raise _write_error(path, error)

    def _write(self, checkpoint: dict[str, Any], tmp: Path) -> Any:
        """Write this rank's shards (and, on rank 0, ``META_FILE``) into ``tmp``. With ``async_save``: stage the
        shards in host memory, start writing them and return DCP's future of the write; else None, written."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        tmp.mkdir(parents=True, exist_ok=True)
        state, future = sharded.tensor_state(checkpoint), None
        if self.async_save:
            if self._save_group is None:
                self._save_group = dist.new_group(backend="gloo", timeout=DIST_TIMEOUT)
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._save_group)
        else:
            dcp.save(state, checkpoint_id=tmp)
        if self.global_rank == 0:
            torch.save(checkpoint, tmp / sharded.META_FILE)  # step, loops, DataModule and RNG states
        return future

    def finish_checkpoint(self, agree: bool = True) -> None:
        """Wait for the save in flight, if any, and publish it. Every rank waits for its own writes; rank 0
        renames, as soon as its future resolves: DCP resolves it only after the coordinator has gathered every
        rank's writes and written ``.metadata``. ``agree``: every rank calls this at the same point (a save, a
        load, a stop), so rank 0's outcome is broadcast and all raise alike; teardown, where another rank may have
        failed already, does not."""
        if self._pending is None:
            return
        future, tmp, path = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as e:
            raise _write_error(path, e) from e
        error = _publish(tmp, path) if self.global_rank == 0 else None
        if agree:
            error = self.broadcast(error)
        if error is not None:
            raise _write_error(path, error)
        if self.global_rank == 0:
            print(f"[checkpoint] wrote {path} in the background", flush=True)

    def teardown(self) -> None:
        try:
            self.finish_checkpoint(agree=False)
        finally:
            super().teardown()


def _write_error(path: Path, cause: object) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"could not write sharded checkpoint {path}: {cause}. Earlier checkpoints in {path.parent} are kept."
    )


def _publish(tmp: Path, path: Path) -> str | None:
    """A complete temp checkpoint directory -> ``path``, durably (rank 0); what went wrong, or None."""
    try:
        with open(tmp / sharded.META_FILE, "rb") as f:  # DCP syncs its own files; torch.save does not
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if path.exists():  # the same step saved again (a rerun at the final step)
            sharded.remove(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
