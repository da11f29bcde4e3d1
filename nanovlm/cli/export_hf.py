"""``scripts/export_hf.py``: a run's checkpoint -> a transformers Idefics3 (SmolVLM) checkpoint directory.

    python scripts/export_hf.py runs/default out/my-vlm            # the run's newest checkpoint
    python scripts/export_hf.py runs/default out/my-vlm --checkpoint runs/default/checkpoints/step-400.ckpt

The model is rebuilt from the run's ``config.yaml`` and tokenizer, its weights come from the checkpoint, and
``Idefics3ForConditionalGeneration.from_pretrained(OUT)`` then gives the same logits, and where transformers'
processor can lay images out as training did, ``AutoProcessor.from_pretrained(OUT)`` prepares the same inputs
(``model/export.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/export_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory (holds config.yaml)")
    p.add_argument("out", help="directory to write the transformers checkpoint to")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: the run's newest)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from nanovlm.config import ConfigError, load_config
    from nanovlm.data.tokenizer import load_tokenizer
    from nanovlm.model import build_model
    from nanovlm.model.export import export_idefics3
    from nanovlm.train.checkpoint import (
        CheckpointModelMismatchError,
        checkpoint_dir,
        is_checkpoint,
        latest_checkpoint,
        load_weights,
    )
    from nanovlm.train.module import VLMModule

    config = Path(args.run_dir) / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"error: no config.yaml in {args.run_dir}: give the run directory a training run wrote")
    try:
        cfg = load_config([str(config)])
    except ConfigError as e:
        raise SystemExit(f"error: {config}: {e}") from None
    ckpt = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(checkpoint_dir(cfg))
    if ckpt is None:
        raise SystemExit(f"error: no checkpoint in {checkpoint_dir(cfg)}; give one with --checkpoint")
    if not is_checkpoint(ckpt):
        raise SystemExit(f"error: --checkpoint {ckpt}: no such checkpoint (file or sharded directory)")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vision.image_splitting)
    # the checkpoint holds every weight: no pretrained checkpoint is read (nor downloaded) again
    model_cfg = dataclasses.replace(cfg.model, vision_checkpoint=None, language_checkpoint=None, vlm_checkpoint=None)
    module = VLMModule(dataclasses.replace(cfg, model=model_cfg), tokenizer, model=build_model(model_cfg, tokenizer))
    try:
        load_weights(ckpt, module)
    except (FileNotFoundError, ValueError, CheckpointModelMismatchError) as e:
        raise SystemExit(f"error: {e}") from None
    out, why_not = export_idefics3(module.model, tokenizer, args.out, cfg.data.image_resize, cfg.data.chat_format)
    print(f"exported {ckpt} -> {out} (transformers Idefics3ForConditionalGeneration)")
    if why_not:
        print(f"no processor config written: {why_not}")
    else:
        print("with its processor: AutoProcessor.from_pretrained loads it and prepares inputs as training did")
    return 0
