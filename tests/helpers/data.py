"""A small ``PackedMultimodalDataModule`` on synthetic shards (``make_dataset``): config, setup, consumption."""

from __future__ import annotations

from nanovlm.config import load_config
from nanovlm.data.datamodule import PackedMultimodalDataModule
from nanovlm.data.index import load_index

IMAGE_TOKENS = 16  # 32 px images, 4 px patches, pixel shuffle 2: the sample sizes these tests are built around


def make_cfg(train, val=(), **data):
    cfg = load_config(["tiny_cpu.yaml"], ["model.projector.pixel_shuffle_factor=2"])
    cfg.data.train = [str(d) for d in train]
    cfg.data.val = [str(d) for d in val]
    cfg.data.max_tokens = 256
    cfg.data.max_images = 8
    cfg.data.lookahead = 16
    cfg.data.max_carry = 4
    cfg.data.shuffle_buffer = 8
    cfg.data.queue_size = 2
    cfg.data.num_workers = 0
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def make_dm(cfg, tokenizer, rank=0, world_size=1):
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer, rank=rank, world_size=world_size)
    dm.setup("fit")
    return dm


def take(dm, n, consume=True):
    """The next n batches of a fresh train loader (advancing the position like a training loop)."""
    out = []
    it = iter(dm.train_dataloader())
    try:
        for batch in it:
            if consume:
                dm.on_batch_consumed(batch)
            out.append(batch)
            if len(out) == n:
                break
    finally:
        del it  # shut the loader down now, even when an exception keeps this frame alive in a traceback
    return out


def all_keys(*dirs):
    return sorted(k for d in dirs for k in load_index(d).key_list())


def carried_keys(*dms) -> list[str]:
    """Keys of the samples the ranks ``dms`` carry into their current epoch (each knows its own slots')."""
    gids = {int(g) for dm in dms for g in dm.position.carry.all_gids()}
    return [dms[0].table.keys[g] for g in sorted(gids)]
