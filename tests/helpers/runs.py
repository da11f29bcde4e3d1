"""``scripts/train.py`` as a subprocess on CPU (fp32, the micro model) over the ``small_demo`` fixture's data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from helpers import REPO
from helpers.training import MICRO_MODEL
from nanovlm.train.checkpoint import checkpoint_name, read_weights

TIMEOUT = 300


def tiny_overrides(data: Path) -> list[str]:
    """A ~80K-parameter model (4 tokens per image) on a 160-sample demo dataset, 256-token packs."""
    return [
        *MICRO_MODEL,
        f"data.train=[{data}/train]",
        f"data.val=[{data}/val]",
        f"data.tokenizer={data}/tokenizer",
        "data.make_demo_if_missing=false",
        "data.max_tokens=256",
        "data.num_workers=1",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=2",
        "trainer.eval_at_end=false",
        "trainer.val_batches=2",
        "optim.warmup_steps=2",
    ]


def train_cmd(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "scripts/train.py", *tiny_overrides(data), f"trainer.run_dir={run_dir}", *extra]


def run_train(data: Path, run_dir: Path, *extra: str) -> str:
    proc = subprocess.run(train_cmd(data, run_dir, *extra), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def steps(run_dir: Path, rank: int = 0) -> list[tuple]:
    name = "steps.jsonl" if rank == 0 else f"steps.rank{rank}.jsonl"
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
    return [(r["micro"], r["step"], tuple(r["keys"]), r["loss"]) for r in rows]


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of the run's checkpoint at ``step``, a file or a sharded directory."""
    return read_weights(run_dir / "checkpoints" / checkpoint_name(step))
