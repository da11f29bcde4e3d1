"""``scripts/train.py`` as users run it: argument errors, --print-config, --help, and a two-step fit."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import REPO
from helpers.runs import TIMEOUT, final_weights, run_train, steps, train_cmd

from nanovlm.config import load_config, to_yaml
from nanovlm.train.checkpoint import checkpoint_name


def train_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT
    )


def test_bad_key_exits_2_with_suggestion_and_no_traceback():
    proc = train_script("trainer.max_stepz=1")
    assert proc.returncode == 2
    assert "max_stepz" in proc.stderr and "did you mean 'trainer.max_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_value_and_missing_config_file_exit_2():
    proc = train_script("trainer.max_steps=many")
    assert proc.returncode == 2 and "trainer.max_steps" in proc.stderr and "Traceback" not in proc.stderr
    proc = train_script("--config", "no_such.yaml")
    assert proc.returncode == 2 and "no_such.yaml" in proc.stderr


def test_data_that_cannot_be_planned_exits_2_naming_the_fix(small_demo, tmp_path):
    cmd = train_cmd(small_demo, tmp_path / "run", "data.train_weights=[0.0]", "trainer.max_steps=1")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: PlanError: epoch 0 has no samples to train on" in proc.stderr and "data.train_weights" in proc.stderr


def test_print_config_is_the_resolved_config():
    proc = train_script("--print-config", "trainer.max_steps=7", "optim.lr=0.01")
    assert proc.returncode == 0, proc.stderr
    expected = to_yaml(load_config(["tiny_cpu.yaml"], ["trainer.max_steps=7", "optim.lr=0.01"]))
    assert proc.stdout == expected
    assert yaml.safe_load(proc.stdout)["trainer"]["max_steps"] == 7


def test_options_may_come_anywhere_among_the_overrides():
    """``train.py key=v --config ddp.yaml key2=v`` failed with "unrecognized arguments"."""
    from nanovlm.cli.train import parse_args

    args = parse_args(["trainer.max_steps=3", "--config", "ddp.yaml", "optim.lr=0.01", "--print-config"])
    assert args.config == ["ddp.yaml"] and args.print_config
    assert args.overrides == ["trainer.max_steps=3", "optim.lr=0.01"]


def test_help_points_to_config_docs():
    proc = train_script("--help")
    assert proc.returncode == 0
    assert "--config" in proc.stdout and "--print-config" in proc.stdout
    assert "Configuration" in proc.stdout and "nanovlm/config.py" in proc.stdout


@pytest.mark.slow
def test_two_step_fit_writes_run_dir_and_evaluates(small_demo, tmp_path):
    run_dir = tmp_path / "run"
    extra = ["trainer.max_steps=2", "trainer.eval_at_end=true", "trainer.eval_samples=3", "trainer.log_every_n_steps=1"]
    extra.append("optim.warmup_steps=3")
    out = run_train(small_demo, run_dir, *extra)
    assert "nanovlm training run" in out and "attention     : sdpa" in out  # the start summary
    assert "weights       : random init" in out
    assert "optim.warmup_steps=3 > trainer.max_steps: the learning rate never leaves warmup (it peaks at 67%" in out
    assert "[val] step 2: val/loss" in out
    assert "[eval] held-out answer accuracy:" in out and "on 3 samples (chance" in out
    # the resolved config, the metrics, the step trace and the final checkpoint
    saved = load_config([run_dir / "config.yaml"])
    assert saved.trainer.max_steps == 2 and saved.data.max_tokens == 256
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").read_text().splitlines()))
    train_rows = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in train_rows] == [1, 2]
    for key in ("train/lr", "train/tokens_per_s", "train/samples_per_s", "train/packing_fill", "train/data_wait_frac"):
        assert float(train_rows[-1][key]) > 0 or key == "train/data_wait_frac"
    assert any(r.get("val/loss") for r in rows)
    assert (run_dir / "checkpoints" / checkpoint_name(2)).is_file()
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 2
    # the same command again resumes from the final checkpoint and has nothing left to do
    out = run_train(small_demo, run_dir, *extra)
    assert f"[resume] from {run_dir / 'checkpoints' / checkpoint_name(2)}" in out
    assert "[eval]" in out  # the finished run is still evaluated
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 2


def test_fit_with_image_splitting_logs_tiles_evaluates_and_exports(small_demo, tmp_path):
    """The demo's 40-64 px images at 16-px tiles: 2x2 grids and more, so packs carry several tiles per image; the
    end-of-run evaluation generates from split prompts and the export carries the markers."""
    run_dir = tmp_path / "run"
    split = ["model.vision.image_splitting=true", "model.vision.max_tiles=4", "data.max_images=96"]
    extra = ["trainer.max_steps=2", "trainer.eval_at_end=true", "trainer.eval_samples=3", "trainer.log_every_n_steps=1"]
    out = run_train(small_demo, run_dir, *split, *extra)
    assert "[eval] held-out answer accuracy:" in out and "on 3 samples (chance" in out
    rows = [
        r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").read_text().splitlines()) if r.get("train/loss")
    ]
    per_pack = [float(r["train/tiles_per_pack"]) for r in rows]
    samples = [float(r["train/samples_per_s"]) for r in rows]
    assert len(per_pack) == 2 and all(t > 8 for t in per_pack) and samples[-1] > 0
    proc = subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(run_dir), str(tmp_path / "hf")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    vocab = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["added_tokens"]
    assert {"<global-img>", "<row_2_col_2>", "<fake_token_around_image>"} <= {t["content"] for t in vocab}


@pytest.mark.slow
def test_resume_continues_metrics_and_a_fresh_start_never_mixes_runs(small_demo, tmp_path):
    run_dir = tmp_path / "run"
    extra = ["trainer.log_every_n_steps=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=5"]
    run_train(small_demo, run_dir, "trainer.max_steps=2", *extra)
    out = run_train(small_demo, run_dir, "trainer.max_steps=3", *extra)  # resumes from step 2
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").read_text().splitlines()))
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == [1, 2, 3]  # Lightning's logger kept only 3
    # resuming at or past max_steps says there is nothing to train
    out = run_train(small_demo, run_dir, "trainer.max_steps=2", *extra)
    assert "checkpoint is at step 3, trainer.max_steps=2: nothing left to train" in out
    # starting over, or from an older checkpoint, next to later checkpoints: refused, nothing deleted
    for how in ("checkpoint.resume=none", f"checkpoint.resume={run_dir / 'checkpoints' / checkpoint_name(1)}"):
        proc = subprocess.run(
            train_cmd(small_demo, run_dir, "trainer.max_steps=3", how, *extra),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "RunDirConflictError" in proc.stderr and "from an earlier run" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [checkpoint_name(s) for s in (1, 2, 3)]


def _one_step_run_with_unfused_checkpoint(data, run_dir) -> bytes:
    """Train one step, then rewrite its checkpoint with separate q/k/v_proj and gate/up_proj tensors (the
    layout of other Llama implementations). Returns the original checkpoint bytes."""
    import torch

    run_train(data, run_dir, "trainer.max_steps=1", "trainer.eval_at_end=false")
    path = run_dir / "checkpoints" / checkpoint_name(1)
    good = path.read_bytes()
    ckpt = torch.load(path, weights_only=True)
    unfused = {}
    for name, t in ckpt["state_dict"].items():
        if ".qkv_proj." in name and ".language." in name:
            h = t.shape[0] // 8  # MICRO_MODEL: 4 query heads + 2 x 2 kv heads
            unfused |= dict(
                zip(
                    [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")],
                    t.split([4 * h, 2 * h, 2 * h]),
                )
            )
        elif ".gate_up_proj." in name:
            unfused |= dict(zip([name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")], t.chunk(2)))
        else:
            unfused[name] = t
    ckpt["state_dict"] = unfused
    torch.save(ckpt, path)
    return good


def _resume(data, run_dir, *extra: str) -> subprocess.CompletedProcess:
    cmd = train_cmd(data, run_dir, "trainer.max_steps=2", "trainer.eval_at_end=false", *extra)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)


def _assert_unfit_error(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the checkpoint does not fit this model" in proc.stderr
    assert "tensor(s) missing: model.language.layers.0.self_attn.qkv_proj.weight" in proc.stderr
    assert "the model.* config differs" in proc.stderr
    assert all(len(line) < 1200 for line in proc.stderr.splitlines() if "does not fit" in line)  # not every key


def test_resuming_a_checkpoint_that_does_not_fit_the_model_is_a_clear_error(small_demo, tmp_path):
    """A checkpoint of another layout (separate q/k/v and gate/up) or of another model config stops the run
    before training with one readable message naming a few tensors and the likely cause, not torch's list of
    every key; exit 2, no traceback."""
    run_dir = tmp_path / "run"
    good = _one_step_run_with_unfused_checkpoint(small_demo, run_dir)
    _assert_unfit_error(_resume(small_demo, run_dir))

    (run_dir / "checkpoints" / checkpoint_name(1)).write_bytes(good)
    proc = _resume(small_demo, run_dir, "model.language.intermediate_size=64")  # another model config
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "of another shape: model.language.layers.0.mlp.gate_up_proj.weight (192, 48) vs (128, 48)" in proc.stderr
    assert "the model.* config differs" in proc.stderr


@pytest.mark.slow
def test_init_from_starts_a_new_stage_from_the_weights_only(small_demo, tmp_path):
    """checkpoint.init_from: a fresh run (step 0, new optimizer, data from the start) with another run's weights;
    once the new run has checkpoints of its own it resumes those and the option no longer applies."""
    first, second = tmp_path / "stage1", tmp_path / "stage2"
    run_train(small_demo, first, "trainer.max_steps=2")
    source = first / "checkpoints" / checkpoint_name(2)
    # lr 0 (vision_lr 0: the same lr): the weights cannot move, so the new run's checkpoint holds exactly what it started from
    stage2 = [f"checkpoint.init_from={source}", "trainer.max_steps=1", "optim.lr=0", "optim.vision_lr=0"]
    stage2 += ["optim.weight_decay=0"]
    out = run_train(small_demo, second, *stage2)
    assert f"[init] model weights from {source} (new optimizer, step 0)" in out
    got, want = final_weights(second, 1), final_weights(first, 2)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert steps(second)[0][2] == steps(first)[0][2]  # a new data stream: the first pack of the epoch
    out = run_train(small_demo, second, *stage2)  # the same command again: its own checkpoint, not init_from
    assert "[resume] from" in out and "[init]" not in out
    proc = subprocess.run(
        train_cmd(small_demo, tmp_path / "stage3", "checkpoint.init_from=/no/such.ckpt", "trainer.max_steps=1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        "error: FileNotFoundError: checkpoint.init_from='/no/such.ckpt': no such checkpoint (file or sharded directory)"
        in proc.stderr
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_resume_of_a_checkpoint_that_does_not_fit_is_the_same_clear_error(small_demo, tmp_path):
    """FSDP2 (ModelParallelStrategy) loads the weights before the LightningModule's hook: checked there too."""
    run_dir = tmp_path / "run"
    _one_step_run_with_unfused_checkpoint(small_demo, run_dir)
    _assert_unfit_error(_resume(small_demo, run_dir, "trainer.devices=2", "trainer.strategy=fsdp"))


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_without_trainer_devices_uses_the_launchers_processes(small_demo, tmp_path):
    """``torchrun --nproc_per_node 2 scripts/train.py`` works although the config says ``devices: 1``."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(small_demo, run_dir, "trainer.max_steps=2", "trainer.strategy=ddp", "trainer.devices=1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*torchrun, *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[launch] torchrun started 1 node(s) x 2 processes: using trainer.devices=2" in out
    for name in ("steps.jsonl", "steps.rank1.jsonl"):
        assert len((run_dir / name).read_text().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_validation_with_an_image_less_pack_on_one_rank(tmp_path):
    """3 validation samples on 2 ranks, one per pack: one rank's second pack is empty (no images). Under FSDP2
    every rank must still gather the vision blocks, or the collectives pair up wrongly (gloo aborted)."""
    from nanovlm.data.demo import make_demo_data

    data = tmp_path / "data"
    make_demo_data(data, train_samples=80, val_samples=3, samples_per_shard=40, image_token_count=4)
    extra = ["trainer.max_steps=2", "trainer.devices=2", "trainer.strategy=fsdp", "trainer.val_batches=10"]
    extra += ["data.max_tokens=48", "data.overlength=truncate", "data.num_workers=0"]
    proc = subprocess.run(
        train_cmd(data, tmp_path / "run", *extra), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[val] step 2: val/loss" in out


@pytest.mark.slow
def test_the_compiled_static_step_trains_like_eager_and_resumes(small_demo, tmp_path):
    """``data.static_shapes=true trainer.compile=step`` through the CLI: the same packs, in the same order, with
    the eager run's losses (fp32, inductor on CPU), and a resume from its own checkpoint continues exactly."""
    extra = ["trainer.max_steps=4", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2", "data.num_workers=0"]
    run_train(small_demo, tmp_path / "eager", *extra)
    compiled = ["data.static_shapes=true", "trainer.compile=step"]
    run_train(small_demo, tmp_path / "step", *extra, *compiled, "trainer.max_steps=2")
    out = run_train(small_demo, tmp_path / "step", *extra, *compiled)  # resumes at step 2
    assert "[resume] from" in out
    want, got = steps(tmp_path / "eager"), steps(tmp_path / "step")
    assert [r[:3] for r in got] == [r[:3] for r in want] and len(got) == 4
    for (*_, a), (*_, b) in zip(want, got):
        assert abs(a - b) <= 1e-4 * abs(a), (a, b)


def test_device_jpeg_decode_trains_on_the_same_packs_as_worker_decode(small_demo, tmp_path):
    """data.image_decode=device through Lightning's transfer hook: the same packs and, up to the decoders'
    rounding of the demo's JPEGs (one image in four), the same losses as the worker path. The first step's loss
    (same weights) tells decoded images from the grey canvases: 3e-6 apart here, 6e-5 when the hook is skipped."""
    runs = {}
    for decode in ("worker", "device"):
        run_train(small_demo, tmp_path / decode, "trainer.max_steps=3", f"data.image_decode={decode}")
        runs[decode] = steps(tmp_path / decode)
    assert [r[:3] for r in runs["device"]] == [r[:3] for r in runs["worker"]]
    losses = [(d[3], w[3]) for d, w in zip(runs["device"], runs["worker"])]
    assert abs(losses[0][0] - losses[0][1]) <= 5e-6 * abs(losses[0][1]), losses
    assert all(abs(d - w) <= 1e-3 * abs(w) for d, w in losses), losses
    rows = list(csv.DictReader((tmp_path / "device" / "csv" / "metrics.csv").read_text().splitlines()))
    assert [r["train/device_decode_failures"] for r in rows if r.get("train/loss")][-1] == "0.0"
