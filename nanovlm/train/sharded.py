"""Sharded checkpoints (``checkpoint.format=sharded``, FSDP2 only): a directory in which every rank writes its own
shards of the model and optimizer with ``torch.distributed.checkpoint`` (DCP), beside one ``meta.pt`` holding the
rest of Lightning's checkpoint dict (step, loops, DataModule and RNG states of every rank).

Why: a full checkpoint gathers every tensor on rank 0, which at a few billion parameters costs rank 0's memory
and one process's write bandwidth; sharded, each rank writes 1/world of it in parallel. DCP records the global
shape and the offsets of each shard, so a checkpoint written by W ranks loads onto any other number (it reshards
on load): elastic resume keeps working. The DataModule state in ``meta.pt`` is the same as in a full checkpoint.

Safe like a full one: DCP unpickles its ``.metadata`` file and the non-tensor items (the optimizer's
``param_groups``) with no restriction, so a planted checkpoint could run code on load. Every read here goes
through ``SafeReader`` (an allow-list of the metadata classes) and ``SafeLoadPlanner`` (``weights_only=True``).

Atomic like a full one: the ranks write ``step-N.ckpt.tmp/``; after a barrier rank 0 renames it to
``step-N.ckpt/``. A directory with the final name is therefore complete, and a killed save leaves only a
``.tmp`` that nothing reads. Single-process tools (``checkpoint.init_from``, export, the fit check) read the full
model weights from the directory without a process group (``read_sharded_weights``). The strategy that writes
them is ``strategies.ShardedCheckpointStrategy``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DCP's own planner uses

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint
WEIGHTS_PREFIX = "state_dict."  # DCP flattens {"state_dict": {name: tensor}} into "state_dict.<name>" keys


def is_sharded(path: str | os.PathLike) -> bool:
    """A complete sharded checkpoint: a directory with DCP's metadata and Lightning's ``meta.pt``."""
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file() and (p / ".metadata").is_file()


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part (step, loops, DataModule and RNG states); never executes code."""
    meta = Path(path) / META_FILE
    return torch.load(meta, map_location="cpu", weights_only=True)


_METADATA_GLOBALS = {  # what DCP's .metadata pickle refers to; anything else is refused
    "torch.distributed.checkpoint.metadata": None,  # None: every name (its dataclasses and enums)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get(module, set())
        if (module in _METADATA_GLOBALS and allowed is None) or name in (allowed or ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"sharded checkpoint metadata refers to {module}.{name}, which a checkpoint never needs: refused "
            "(it could run code); the checkpoint was not written by this project or was tampered with"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the ``.metadata`` unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader does
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, with non-tensor items loaded by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict[str, Any], path: str | os.PathLike, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` (filled in place) through the safe reader and planner. A refused item is raised
    as an ``UnpicklingError`` naming the checkpoint (DCP wraps errors of every rank in its own exception)."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except dcp.CheckpointException as e:
        refused = [f[0] for f in e.failures.values() if isinstance(f[0], pickle.UnpicklingError)]
        if refused:
            raise pickle.UnpicklingError(f"sharded checkpoint {path}: an item was refused ({refused[0]})") from e
        raise


def optimizer_key(i: int) -> str:
    return f"optimizer_{i}"  # Lightning's key for optimizer i in a distributed checkpoint: its saves load too


def tensor_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Pop a Lightning checkpoint's sharded tensors into the layout DCP writes (``state_dict``, ``optimizer_<i>``);
    what stays in ``checkpoint`` is ``META_FILE``'s."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({optimizer_key(i): s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def load_model_and_optimizers(path: Path, module: torch.nn.Module, optimizers: list, strict: bool = True) -> None:
    """Load a sharded checkpoint into an FSDP2 ``module`` and its ``optimizers`` (a collective: every rank calls
    it). The state dicts asked for carry this run's sharding, so DCP reshards a checkpoint of another world size."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"state_dict": get_model_state_dict(module)}
    safe_load(state, path)
    module.load_state_dict(state["state_dict"], strict=strict)
    for i, optimizer in enumerate(optimizers):
        key = optimizer_key(i)
        ostate = {key: get_optimizer_state_dict(module, optimizer)}
        safe_load(ostate, path)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=ostate[key], options=StateDictOptions(cpu_offload=True)
        )


def _weight_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Name -> DCP's metadata (global shape, dtype) of every model tensor; no tensor is read."""
    meta = SafeReader(str(path)).read_metadata().state_dict_metadata
    return {k[len(WEIGHTS_PREFIX) :]: m for k, m in meta.items() if k.startswith(WEIGHTS_PREFIX) and hasattr(m, "size")}


def weight_shapes(path: str | os.PathLike) -> dict[str, torch.Size]:
    """Name -> global shape of every model tensor."""
    return {name: m.size for name, m in _weight_metadata(path).items()}


def read_sharded_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict (name -> CPU tensor) of a sharded checkpoint, in one process.

    Tensors are allocated from DCP's metadata (global shape and dtype) and filled by ``dcp.load`` without a
    process group, whatever number of ranks wrote them."""
    weights = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in _weight_metadata(path).items()}
    safe_load({"state_dict": weights}, path, no_dist=True)
    return weights


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint of either format."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
