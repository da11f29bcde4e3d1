"""Checkpoint IO and resume resolution: atomic writes (a failed or interrupted write keeps the previous
checkpoint), disk full, ``checkpoint.resume`` modes.

Security: checkpoints are loaded without executing pickled code. A control test first shows that the planted
checkpoint's payload really fires under full unpickling (it creates a marker file); then the loader is run on it. A
static guard keeps new code on the training path from adding an unsafe deserializer. (The real resume path through
the train CLI is in integration/test_faults_process.py.)
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from helpers import REPO
from helpers.faults import malicious_checkpoint
from helpers.training import Sample, tiny_cfg

from nanovlm.train.checkpoint import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    checkpoint_name,
    list_checkpoints,
    resolve_resume,
)


def test_atomic_io_roundtrip_and_write_error_keeps_previous(tmp_path):
    io = AtomicCheckpointIO()
    good = tmp_path / checkpoint_name(10)
    io.save_checkpoint({"w": torch.arange(4), "step": 10}, good)
    assert torch.equal(io.load_checkpoint(good)["w"], torch.arange(4))
    assert not list(tmp_path.glob("*.tmp"))
    # a write that fails (its temp path is a directory) names the path and leaves the good checkpoint alone
    bad = tmp_path / checkpoint_name(20)
    (tmp_path / (bad.name + ".tmp")).mkdir()
    with pytest.raises(CheckpointWriteError, match=r"step-00000020\.ckpt"):
        io.save_checkpoint({"w": torch.zeros(2)}, bad)
    assert not bad.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert io.load_checkpoint(good)["step"] == 10


def test_load_refuses_pickled_code(tmp_path):
    path = tmp_path / checkpoint_name(1)
    torch.save({"obj": Sample}, path)  # a class reference: needs unpickling of arbitrary globals
    with pytest.raises(Exception, match="(?i)weights_only"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_resolve_resume_modes(tmp_path):
    cfg = tiny_cfg(tmp_path)
    assert resolve_resume(cfg) is None  # auto, empty dir
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    for step in (5, 20, 10):
        (ck / checkpoint_name(step)).write_bytes(b"x")
    (ck / (checkpoint_name(30) + ".tmp")).write_bytes(b"partial")  # an interrupted save is never picked
    assert resolve_resume(cfg) == ck / checkpoint_name(20)
    cfg.checkpoint.resume = "none"
    assert resolve_resume(cfg) is None
    cfg.checkpoint.resume = str(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        resolve_resume(cfg)


# ----------------------------------------------------------------------------------------------------------
# disk full while saving


def test_disk_full_checkpoint_write_names_the_path_and_keeps_the_previous_one(tmp_path):
    """/dev/full answers every write with ENOSPC, the errno of a full disk."""
    from nanovlm.train.checkpoint import AtomicCheckpointIO, CheckpointWriteError

    io = AtomicCheckpointIO()
    state = {"state_dict": {"w": torch.randn(64, 64)}, "global_step": 2}
    io.save_checkpoint(state, tmp_path / checkpoint_name(2))
    before = (tmp_path / checkpoint_name(2)).read_bytes()
    target = tmp_path / checkpoint_name(4)
    (tmp_path / (target.name + ".tmp")).symlink_to("/dev/full")
    with pytest.raises(CheckpointWriteError) as exc:
        io.save_checkpoint(state | {"global_step": 4}, target)
    assert str(target) in str(exc.value)
    assert "No space left on device" in str(exc.value)
    assert not target.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert (tmp_path / checkpoint_name(2)).read_bytes() == before
    assert io.load_checkpoint(tmp_path / checkpoint_name(2))["global_step"] == 2


# ----------------------------------------------------------------------------------------------------------
# security: checkpoints are loaded without executing pickled code


def test_control_full_unpickling_of_the_checkpoint_creates_its_marker(tmp_path):
    marker = tmp_path / "pwned_by_ckpt"
    path = malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_checkpoint_io_refuses_code_in_a_checkpoint(tmp_path):
    from nanovlm.train.checkpoint import AtomicCheckpointIO

    marker = tmp_path / "pwned"
    path = malicious_checkpoint(tmp_path / "step-00000001.ckpt", marker)
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError):  # asking for full unpickling does not get it either
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()


def test_checkpoint_io_loads_a_plain_checkpoint(tmp_path):
    from nanovlm.train.checkpoint import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    state = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3, "loops": {"x": [1, 2]}}
    io.save_checkpoint(state, tmp_path / "step-00000003.ckpt")
    loaded = io.load_checkpoint(tmp_path / "step-00000003.ckpt")
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))


def test_training_code_has_no_unsafe_deserialization():
    """Static guard for future code on the training path (data, model, train, cli; the benchmark's webdataset
    baseline is out of scope): no pickle / marshal, no torch.load without weights_only=True, no webdataset
    decoder. The behaviour tests above prove today's paths; this keeps a new path from quietly adding one."""
    root = REPO / "nanovlm"
    offenders = []
    unsafe = re.compile(
        r"\bpickle\.loads?\(|\bmarshal\.loads?\(|\bdill\b|\bcloudpickle\b|autodecode|\.decode\(\s*[\"'](pil|rgb|torch\w*|l)[\"']"
    )
    for sub in ("data", "model", "train", "cli"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text()
            for n, line in enumerate(text.splitlines(), 1):
                if unsafe.search(line):
                    offenders.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
            for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
                if "weights_only=True" not in m.group(1) and not m.group(1).strip().startswith("weights_only"):
                    offenders.append(f"{path.relative_to(root.parent)}: torch.load({m.group(1)})")
    assert offenders == []


# ----------------------------------------------------------------------------------------------------------
# sharded checkpoints (checkpoint.format=sharded): what single-process code reads from the directory


def _write_sharded(path, weights: dict[str, torch.Tensor], step: int) -> None:
    """A sharded checkpoint as ShardedCheckpointStrategy leaves it (DCP files + Lightning's meta.pt), written
    by one process (the multi-process writes are in integration/test_resume.py)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": weights}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": step}, path / "meta.pt")


def test_sharded_checkpoints_are_listed_read_checked_and_pruned(tmp_path):
    from nanovlm.train.checkpoint import (
        CheckpointModelMismatchError,
        check_checkpoint_fits,
        check_resume_strategy,
        checkpoint_step,
        load_weights,
        read_weights,
    )
    from nanovlm.train.sharded import remove

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ck = tmp_path / "checkpoints"
    _write_sharded(ck / checkpoint_name(7), weights, 7)
    (ck / (checkpoint_name(9) + ".tmp")).mkdir()  # a save killed half way: never listed
    (ck / checkpoint_name(8)).mkdir()  # a directory without the metadata: not a checkpoint
    assert list_checkpoints(ck) == [(7, ck / checkpoint_name(7))]
    assert checkpoint_step(ck / checkpoint_name(7)) == 7
    got = read_weights(ck / checkpoint_name(7))
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    check_checkpoint_fits(ck / checkpoint_name(7), model.state_dict())  # names and shapes match: no error
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 5))
    with pytest.raises(CheckpointModelMismatchError, match=r"1\.weight \(3, 8\) vs \(5, 8\)"):
        check_checkpoint_fits(ck / checkpoint_name(7), other.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    load_weights(ck / checkpoint_name(7), fresh)  # checkpoint.init_from: the weights alone
    assert all(torch.equal(fresh.state_dict()[k], weights[k]) for k in weights)
    check_resume_strategy(ck / checkpoint_name(7), "fsdp")
    with pytest.raises(CheckpointModelMismatchError, match="trainer.strategy=fsdp"):
        check_resume_strategy(ck / checkpoint_name(7), "ddp")
    remove(ck / checkpoint_name(7))
    assert list_checkpoints(ck) == []


def test_sharded_format_needs_fsdp():
    from nanovlm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="checkpoint.format=sharded .* needs trainer.strategy=fsdp"):
        load_config([], ["checkpoint.format=sharded", "trainer.strategy=ddp"])
    assert load_config([], ["checkpoint.format=sharded", "trainer.strategy=fsdp"]).checkpoint.format == "sharded"
    with pytest.raises(ConfigError, match="checkpoint.async_save .* needs checkpoint.format=sharded"):
        load_config([], ["checkpoint.async_save=true", "trainer.strategy=fsdp"])


def test_a_sharded_checkpoint_with_code_in_it_is_refused(tmp_path):
    """DCP itself unpickles ``.metadata`` and non-tensor items without restriction: the control shows a planted
    object runs under DCP's own reader; ours refuses both places (metadata and a bytes item) and runs nothing."""
    import torch.distributed.checkpoint as dcp
    from helpers.faults import _CreatesFile

    from nanovlm.train.sharded import read_sharded_weights, safe_load

    marker = tmp_path / "pwned"
    path = tmp_path / checkpoint_name(1)
    weights = {"w": torch.arange(4.0)}
    dcp.save({"state_dict": weights, "x": _CreatesFile(marker)}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 1}, path / "meta.pt")
    dcp.load({"x": None}, checkpoint_id=str(path), no_dist=True)  # control: DCP's own load runs the payload
    assert marker.exists()
    marker.unlink()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        safe_load({"x": None}, path, no_dist=True)
    assert not marker.exists()
    assert torch.equal(read_sharded_weights(path)["w"], weights["w"])  # the tensors alone read fine
    (path / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        read_sharded_weights(path)
    assert not marker.exists()
