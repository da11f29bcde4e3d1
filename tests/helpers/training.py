"""In-process training stand-ins: the ~80K-parameter model every multi-step training test uses, a tiny config
on CPU, and a deterministic stream of packed batches built with the real collator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanovlm.config import Config, image_token_count, load_config
from nanovlm.data.collate import collate_packed
from nanovlm.model.vlm import NanoVLM

# A ~80K-parameter model (16 px images, 4 tokens per image): the shape every multi-step training test uses.
MICRO_MODEL = [
    "model.vision.image_size=16",
    "model.vision.patch_size=4",
    "model.vision.hidden_size=32",
    "model.vision.num_layers=1",
    "model.vision.num_heads=2",
    "model.vision.intermediate_size=64",
    "model.language.hidden_size=48",
    "model.language.num_layers=2",
    "model.language.num_heads=4",
    "model.language.num_kv_heads=2",
    "model.language.intermediate_size=96",
]


VOCAB = 96

IMAGE_ID = 95

PAD_ID = 0


TINY = [
    *MICRO_MODEL,
    "model.attn_backend=sdpa",
    "data.max_tokens=64",
    "data.val=[]",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.progress_bar=false",
    "trainer.logger=none",
    "trainer.log_every_n_steps=2",
    "trainer.eval_at_end=false",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
]


def tiny_cfg(tmp_path: Path, *extra: str) -> Config:
    return load_config([], [*TINY, f"trainer.run_dir={tmp_path}", *extra])


@dataclass
class Sample:
    key: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor


def synthetic_batch(index: int, cfg: Config) -> dict:
    """Pack ``index`` of a deterministic stream: 2 samples, each one image + a random prompt + the same
    3-token answer (learnable in a few steps)."""
    g = torch.Generator().manual_seed(index)
    itc = image_token_count(cfg.model)
    size = cfg.model.vision.image_size
    samples = []
    for j in range(2):
        prompt = torch.randint(1, 40, (6,), generator=g)
        answer = torch.tensor([50, 51, 52])
        ids = torch.cat([torch.full((itc,), IMAGE_ID), prompt, answer])
        labels = torch.full_like(ids, -100)
        labels[-3:] = answer
        pixels = torch.randint(0, 256, (1, 3, size, size), generator=g, dtype=torch.uint8)
        samples.append(Sample(f"s{index:05d}_{j}", ids, labels, pixels))
    return collate_packed(samples, cfg.data.max_tokens, PAD_ID, size, meta={"index": index})


def tiny_model(cfg: Config) -> NanoVLM:
    torch.manual_seed(0)
    return NanoVLM(cfg.model, VOCAB, IMAGE_ID)
