"""Process faults: a run that dies, is preempted, loses a worker or a disk, or gets uneven data.

Runs that must be killed or signalled are real ``scripts/train.py`` subprocesses (tiny model, a few steps, fp32
on CPU, with a timeout so a hang fails the test instead of blocking CI); runs that fail by themselves go through
the same CLI entry point in-process (``nanovlm.cli.train.main``: what it raises, the process exits 1 with).
Guarantees:

* SIGKILL *during* a checkpoint write leaves the previous checkpoint loadable, the half-written temp file is
  ignored, and resuming from the previous checkpoint retrains the lost steps exactly (same sample keys, same
  losses, bitwise);
* SIGTERM (SLURM preemption) saves a checkpoint at the next step boundary and exits 0;
* a producer failure (not a bad sample: a stale index) stops the run with an error naming the sample key and
  its shard and carrying the producer's traceback; the checkpoints written before stay valid;
* a DataLoader worker killed by the OOM killer gives a clear error within seconds, not a hang;
* disk full while saving: the run fails naming the checkpoint path, the previous checkpoint kept and loadable
  (the checkpoint IO alone: unit/test_checkpoint.py);
* one rank with far less usable data (most of its samples are broken): no hang, the same step count on both
  ranks (DDP, 2 gloo processes);
* resuming (``checkpoint.resume=auto``) over a planted checkpoint that holds code refuses it without running it.

The kill lands mid-write deterministically: the checkpoint's temp file is pre-created as a FIFO, so the saving
process blocks inside ``torch.save`` once the pipe is full, exactly where a slow disk would leave it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.faults import malicious_checkpoint, not_an_image, read_index, rewrite_shard
from helpers.training import MICRO_MODEL

from nanovlm.train.checkpoint import checkpoint_name, list_checkpoints

TIMEOUT = 240  # per training subprocess; a hang fails the test


# ----------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """A small procedural demo dataset (tokenizer, train, val) for a model with 4 tokens per image."""
    from nanovlm.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("reliability_demo")
    make_demo_data(root, train_samples=96, val_samples=8, samples_per_shard=24, image_token_count=4)
    return root


def overrides(data: Path, run_dir: Path, train: Path | None = None) -> list[str]:
    """A ~80K-parameter model, 128-token packs, no validation or evaluation: seconds per run."""
    return [
        *MICRO_MODEL,
        f"data.train=[{train or data / 'train'}]",
        "data.val=[]",
        f"data.tokenizer={data}/tokenizer",
        "data.make_demo_if_missing=false",
        "data.max_tokens=128",
        "data.num_workers=0",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        "trainer.logger=none",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_end=false",
        "optim.warmup_steps=2",
        f"trainer.run_dir={run_dir}",
    ]


def train_cmd(data: Path, run_dir: Path, *extra: str, train: Path | None = None) -> list[str]:
    return [sys.executable, "scripts/train.py", *overrides(data, run_dir, train), *extra]


def env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(
    cmd: list[str], timeout: float = TIMEOUT, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run to completion; on timeout kill the whole process group (DDP ranks, workers) and fail."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env() | (extra_env or {}),
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (a hang):\n{(out + err)[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start(cmd: list[str]) -> subprocess.Popen:
    """A training process in its own process group (so a kill reaches its DataLoader workers too)."""
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), start_new_session=True
    )


def steps(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / ("steps.jsonl" if rank == 0 else f"steps.rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (rc={proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def n_logged(run_dir: Path) -> int:
    """Complete lines in steps.jsonl (safe to call while the run appends to it)."""
    path = run_dir / "steps.jsonl"
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def load_ckpt(path: Path) -> dict:
    """What resume loads: the checkpoint through torch.load(weights_only=True)."""
    return torch.load(path, map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------------------------------------
# SIGKILL in the middle of a checkpoint write


@pytest.mark.slow
def test_sigkill_mid_checkpoint_write_keeps_previous_and_resume_is_exact(demo, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    extra = ["trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=3"]
    tmp4 = ckpts / (checkpoint_name(4) + ".tmp")
    os.mkfifo(tmp4)  # the save of step 4 will block on it, mid-write
    proc = start(train_cmd(demo, run_dir, *extra))
    received = bytearray()
    try:
        wait_for(lambda: (ckpts / checkpoint_name(2)).is_file(), proc, "the step-2 checkpoint")
        fd = os.open(tmp4, os.O_RDONLY | os.O_NONBLOCK)
        try:
            deadline = time.time() + TIMEOUT
            while len(received) < 4096:  # the writer is inside torch.save: some bytes arrived, more are pending
                assert time.time() < deadline and proc.poll() is None, "the step-4 save never started"
                try:
                    chunk = os.read(fd, 4096)
                except BlockingIOError:  # the writer has it open, nothing new yet
                    chunk = b""
                received += chunk
                if not chunk:
                    time.sleep(0.02)
            time.sleep(0.3)  # let it fill the pipe and block in write()
            assert proc.poll() is None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            os.close(fd)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # what a real disk holds after the kill: a partial temp file
    os.unlink(tmp4)
    tmp4.write_bytes(bytes(received))

    assert [s for s, _ in list_checkpoints(ckpts)] == [2]  # the torn write is not a checkpoint
    assert load_ckpt(ckpts / checkpoint_name(2))["global_step"] == 2
    with pytest.raises((RuntimeError, OSError)):  # and it really is torn (which error depends on where it tore)
        load_ckpt(tmp4)
    before = steps(run_dir)  # steps 1..4 were trained before the kill
    assert [r["step"] for r in before] == [1, 2, 3, 4]

    out = run(train_cmd(demo, run_dir, *extra))  # the same command resumes (checkpoint.resume=auto)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"[resume] from {ckpts / checkpoint_name(2)}" in out.stdout + out.stderr
    after = steps(run_dir)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    assert after[:4] == before  # steps 3 and 4 retrained exactly: same samples, bitwise the same losses
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4, 6]
    assert not list(ckpts.glob("*.tmp"))


# ----------------------------------------------------------------------------------------------------------
# SIGTERM (preemption)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["main", "group"])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(demo, tmp_path, target):
    """``main``: ``kill <pid>`` of a run without workers. ``group``: SIGTERM to every process of the run, its
    DataLoader worker included, as SLURM preemption / ``scancel`` deliver it to a job step."""
    run_dir = tmp_path / "run"
    workers = "data.num_workers=1" if target == "group" else "data.num_workers=0"
    proc = start(train_cmd(demo, run_dir, "trainer.max_steps=200", "checkpoint.every_n_steps=0", workers))
    try:
        wait_for(lambda: n_logged(run_dir) >= 2, proc, "two trained steps")
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    saved = list_checkpoints(run_dir / "checkpoints")
    assert len(saved) == 1, out[-3000:]
    step, path = saved[0]
    trained = steps(run_dir)
    assert 2 <= step < 200
    assert trained[-1]["step"] == step  # every trained step is in the checkpoint; none trained after it
    assert load_ckpt(path)["global_step"] == step
    assert "signal received: saved" in out and "Run the same command again to resume" in out
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


# ----------------------------------------------------------------------------------------------------------
# the producer fails mid-epoch


def _key_in_pack(data: Path, k: int) -> str:
    """The key of the last-read sample of pack ``k`` of the tiny run's epoch 0 (same config, same plan; one
    slot, as ``data.num_workers=0``).

    The producer reads samples in epoch order a window (``data.lookahead`` samples) ahead of the packs it
    assembles, so a failure on this sample stops the run a few packs before pack ``k``."""
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    cfg = load_config(["tiny_cpu.yaml"], overrides(data, data / "unused"))
    dm = PackedMultimodalDataModule(cfg.data, cfg.model)
    dm.setup("fit")
    plan = dm.current_plan()
    positions = plan.pack(0, k)
    return dm.table.keys[int(plan.order[positions.max()])]


def _copy_dataset(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_producer_failure_stops_the_run_naming_the_sample_and_keeps_checkpoints(demo, tmp_path):
    train = _copy_dataset(demo / "train", tmp_path / "train")
    key = _key_in_pack(demo, 8)  # read about 6 steps into training
    index = read_index(train)
    shard = next(i for i, s in enumerate(index["shards"]) if key in s["keys"])

    def longer_answer(k: str, suffix: str, data: bytes) -> bytes:
        """Same conversation, longer answer: the sample no longer has the token count its index entry says
        (the index and so the epoch plan are unchanged: a stale index, not a bad sample)."""
        if k != key or suffix != "json":
            return data
        obj = json.loads(data)
        obj["messages"][-1]["content"] += " and more words"
        return json.dumps(obj).encode()

    rewrite_shard(train, shard, longer_answer)
    shard_name = index["shards"][shard]["name"]

    from nanovlm.cli.train import main
    from nanovlm.data.producer import ProducerError

    run_dir = tmp_path / "run"
    argv = [*overrides(demo, run_dir, train), "trainer.max_steps=10", "checkpoint.every_n_steps=2"]
    with pytest.raises(ProducerError) as exc:  # uncaught by the CLI: the process exits 1 with this traceback
        main(argv)
    text = str(exc.value)
    assert key in text and shard_name in text
    assert "producer traceback" in text and "DataMismatchError" in text  # the cause travels with the error
    trained = steps(run_dir)
    n = len(trained)
    assert [r["step"] for r in trained] == list(range(1, n + 1)) and 2 <= n < 10  # it stopped mid-run
    assert key not in {k for r in trained for k in r["keys"]}
    last_step, last = list_checkpoints(run_dir / "checkpoints")[-1]
    assert last_step == 2 * (n // 2)  # the newest periodic checkpoint before the failure ...
    assert load_ckpt(last)["global_step"] == last_step  # ... is complete and loads
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_training_counts_and_logs_bad_samples(demo, tmp_path, caplog):
    """A run over shards with broken samples trains on, logs each skip with its key and reason, and reports the
    count in its metrics (``train/skipped_samples``)."""
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule
    from nanovlm.train.run import train as run_training

    train = _copy_dataset(demo / "train", tmp_path / "train")
    cfg = load_config(["tiny_cpu.yaml"], [*overrides(demo, tmp_path / "run", train), "trainer.max_steps=4"])
    dm = PackedMultimodalDataModule(cfg.data, cfg.model)
    dm.setup("fit")
    first = []
    for batch in dm.train_dataloader():  # the samples of the 4 packs the run will train
        first.append(batch["sample_keys"])
        dm.on_batch_consumed(batch)
        if len(first) == 4:
            break
    planned = sum(dm.telemetry()["skips_by_reason"].values())  # e.g. over-length samples, skipped by plan
    index = read_index(train)
    n_images = {k: n for s in index["shards"] for k, n in zip(s["keys"], s["n_images"])}
    broken = {keys[-1] for keys in first[1:] if n_images[keys[-1]] > 0}  # one sample with an image in packs 2..4
    assert len(broken) >= 2
    for s in range(len(index["shards"])):
        rewrite_shard(train, s, lambda k, sfx, d: not_an_image() if k in broken and sfx.endswith(("jpg", "png")) else d)
    with caplog.at_level("WARNING"):
        result = run_training(cfg)
    assert result.global_step == 4
    assert sum(row["train/skipped_samples"] for row in result.telemetry) == planned + len(broken)
    for key in broken:
        assert re.search(rf"skipped sample {key} \(\S+\) \(unreadable_image\)", caplog.text), key
    trained = {k for r in steps(tmp_path / "run") for k in r["keys"]}
    assert not trained & broken and trained == {k for keys in first for k in keys} - broken


# ----------------------------------------------------------------------------------------------------------
# a DataLoader worker is killed


KILL_WORKER_SCRIPT = """
import multiprocessing, os, signal, sys, time
from nanovlm.config import load_config
from nanovlm.data.datamodule import PackedMultimodalDataModule

cfg = load_config(["tiny_cpu.yaml"], sys.argv[1:])
dm = PackedMultimodalDataModule(cfg.data, cfg.model)
dm.setup("fit")
it = iter(dm.train_dataloader())
next(it)
time.sleep(4.0)  # the worker runs ahead: it prepares and queues the next batch
(worker,) = multiprocessing.active_children()
if os.environ.get("NO_SIGCHLD_CHECK"):  # only the batch handover can notice the death (the usual first sign)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
errors = []
t0 = time.time()
try:
    try:
        os.kill(worker.pid, signal.SIGKILL)  # the OOM killer's way
        for _ in range(100_000):  # the stream must fail, not hang
            next(it)
    except BaseException as e:
        errors.append(e)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
except BaseException as e:  # torch's SIGCHLD handler may raise (once) while the first error is handled
    errors.append(e)
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
elapsed = time.time() - t0
print("FIRST ERROR " + (f"{type(errors[0]).__name__}: {errors[0]}" if errors else "none") + f" AFTER {elapsed:.1f}s")
"""


@pytest.mark.parametrize("check", ["handover_only", "torch_and_handover"])
def test_killed_dataloader_worker_is_a_clear_error_not_a_hang(demo, check):
    """Receiving a batch the dead worker had queued needs the worker (shared-memory handover); torch's own
    dead-worker check, a SIGCHLD handler, often comes second. ``handover_only`` switches that check off, so the
    handover failure alone must already say that a DataLoader worker died; ``torch_and_handover`` is the real
    race. (A subprocess: torch's handler must not fire inside pytest.)"""
    cmd = [sys.executable, "-c", KILL_WORKER_SCRIPT, *overrides(demo, demo / "unused"), "data.num_workers=1"]
    out = run(cmd, timeout=120, extra_env={"NO_SIGCHLD_CHECK": "1"} if check == "handover_only" else {})
    text = out.stdout + out.stderr
    match = re.search(r"FIRST ERROR (.*) AFTER ([0-9.]+)s", out.stdout, re.S)
    assert match, text[-3000:]
    error, seconds = match.group(1), float(match.group(2))
    assert "DataLoader worker" in error and re.search(r"killed|died|exited unexpectedly", error), error
    assert seconds < 60


# ----------------------------------------------------------------------------------------------------------
# a corrupt checkpoint on disk (copied half-way, bit rot)


ABANDONED_ITERATORS = """
import sys
from nanovlm.config import load_config
from nanovlm.data.datamodule import PackedMultimodalDataModule

cfg = load_config(["tiny_cpu.yaml"], sys.argv[1:])
dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=0, world_size=1, pin_memory=False)
dm.setup("fit")
iterators = [iter(dm.train_dataloader()) for _ in range(4)]
for it in iterators:
    next(it)
print("exiting with", len(iterators), "producers running", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_exit_with_unfinished_dataloader_iterators_is_clean(demo, workers):
    """A script that stops reading a DataLoader and exits must exit 0 without an error on the way out.

    0 workers: the producer threads live in the process; Python ends daemon threads wherever they are at exit,
    and one ended inside a file read or a torch op used to abort the process (exit 134, "terminate called without
    an active exception" or "could not acquire lock ... at interpreter shutdown"), in about two runs of three.
    1 worker: multiprocessing's exit handler terminated the workers and torch reported "DataLoader worker ... is
    killed by signal: Terminated" from inside it."""
    cmd = [sys.executable, "-c", ABANDONED_ITERATORS, *overrides(demo, demo / "unused_run")]
    cmd.append(f"data.num_workers={workers}")
    for _ in range(2 if workers == 0 else 1):
        res = run(cmd, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "exiting with 4 producers running" in res.stdout
        for bad in ("Fatal Python error", "terminate called", "Traceback", "Exception ignored"):
            assert bad not in res.stderr, res.stderr[-2000:]


def test_corrupt_latest_checkpoint_is_an_error_naming_it_not_a_fresh_start(demo, tmp_path, capsys):
    """checkpoint.resume=auto must not silently train from scratch over a checkpoint it cannot read."""
    from nanovlm.cli.train import main

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / checkpoint_name(4)
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"PK\x03\x04" + bytes(200))  # a zip header and nothing else
    with pytest.raises(RuntimeError, match="corrupt"):
        main([*overrides(demo, run_dir), "trainer.max_steps=6"])
    assert f"[resume] from {ckpt}" in capsys.readouterr().out
    assert not (run_dir / "steps.jsonl").exists() or n_logged(run_dir) == 0  # nothing was trained


# ----------------------------------------------------------------------------------------------------------
# disk full while saving


def test_disk_full_during_training_fails_the_run_and_keeps_the_previous_checkpoint(demo, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    tmp4 = ckpts / (checkpoint_name(4) + ".tmp")
    tmp4.symlink_to("/dev/full")
    from nanovlm.cli.train import main
    from nanovlm.train.checkpoint import CheckpointWriteError

    with pytest.raises(CheckpointWriteError) as exc:  # uncaught by the CLI: the process exits 1
        main([*overrides(demo, run_dir), "trainer.max_steps=6", "checkpoint.every_n_steps=2"])
    assert f"could not write checkpoint {ckpts / checkpoint_name(4)}" in str(exc.value)
    assert "No space left on device" in str(exc.value)
    assert [r["step"] for r in steps(run_dir)] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]
    assert load_ckpt(ckpts / checkpoint_name(2))["global_step"] == 2


# ----------------------------------------------------------------------------------------------------------
# uneven data over ranks (DDP, 2 gloo processes)


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_with_far_less_usable_data_steps_with_the_others(demo, tmp_path):
    """Most of rank 1's samples are unreadable: rank 1 trains on almost nothing, yet both ranks take exactly
    max_steps optimizer steps (nobody waits forever in an all-reduce) and the run exits 0."""
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    train = _copy_dataset(demo / "train", tmp_path / "train")
    cfg = load_config(["tiny_cpu.yaml"], overrides(demo, tmp_path / "unused", train))
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=1, world_size=2)
    dm.setup("fit")
    rank1 = set()
    for batch in dm.train_dataloader():
        if batch["meta"]["epoch"] > 0:
            break
        rank1.update(batch["sample_keys"])
        dm.on_batch_consumed(batch)
    broken = set(sorted(rank1)[: int(len(rank1) * 0.8)])
    index = read_index(train)
    for s in range(len(index["shards"])):
        rewrite_shard(
            train, s, lambda k, suffix, d: not_an_image() if k in broken and suffix.endswith(("jpg", "png")) else d
        )
    max_steps = 6
    run_dir = tmp_path / "run"
    cmd = train_cmd(
        demo,
        run_dir,
        f"trainer.max_steps={max_steps}",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "checkpoint.every_n_steps=0",
        "data.max_skip_rate=1.0",
        train=train,
    )
    out = run(cmd, timeout=TIMEOUT)  # a rank waiting forever in a collective fails here
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r0, r1 = steps(run_dir, 0), steps(run_dir, 1)
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == list(range(1, max_steps + 1))
    trained1 = {k for r in r1 for k in r["keys"]}
    assert not trained1 & broken  # the broken samples were skipped, not trained
    assert len(trained1) < len({k for r in r0 for k in r["keys"]})  # rank 1 really had less data
    assert load_ckpt(run_dir / "checkpoints" / checkpoint_name(max_steps))["global_step"] == max_steps


# ----------------------------------------------------------------------------------------------------------
# a planted checkpoint that holds code


def test_resume_from_a_malicious_checkpoint_refuses_without_running_it(tmp_path, tiny_tokenizer):
    """The real resume path (``checkpoint.resume=auto`` through the train CLI and Lightning) loads with
    weights_only=True: a planted checkpoint holding code is refused and the code never runs."""
    from nanovlm.cli.train import main
    from nanovlm.data.demo import make_demo_data

    data = tmp_path / "demo"
    make_demo_data(data, train_samples=24, val_samples=4, samples_per_shard=24, image_token_count=4)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "pwned"
    malicious_checkpoint(run_dir / "checkpoints" / "step-00000009.ckpt", marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        main([*overrides(data, run_dir), "trainer.max_steps=12"])
    assert not marker.exists()
