"""``python scripts/train.py [--config FILE ...] [key=value ...]``: train (or resume) a VLM.

Config precedence: schema defaults (nanovlm/config.py) <- each --config file in order <- key=value overrides.
Without --config the default run configs/tiny_cpu.yaml is used (a few minutes on 2 CPU cores, offline).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nanovlm.config import ConfigError, load_config, to_yaml

DEFAULT_CONFIG = "tiny_cpu.yaml"

EPILOG = """\
examples:
  python scripts/train.py                                   # default tiny run on the demo data (CPU)
  python scripts/train.py trainer.max_steps=50 optim.lr=1e-3
  python scripts/train.py --config base.yaml --config model_460m.yaml data.train=[data/mine/train]
  torchrun --nproc_per_node 8 scripts/train.py --config base.yaml --config ddp.yaml   # devices from torchrun

A bare config name (ddp.yaml) is looked up in configs/. Every key, its type, default and meaning is in
nanovlm/config.py; the most used keys are listed in docs/training.md, section "Configuration".
A run writes <trainer.run_dir>/config.yaml (resolved config), csv/metrics.csv, steps.jsonl and
checkpoints/; rerunning the same command resumes from the latest checkpoint (checkpoint.resume=auto).
"""


def parse_args(
    argv: Sequence[str] | None = None, default_configs: Sequence[str] = (DEFAULT_CONFIG,)
) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/train.py",
        description="Train a nanoVLM with Lightning (1 CPU/GPU, DDP or FSDP2; torchrun and SLURM aware).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="FILE",
        help=f"YAML config, may be repeated (later files win); default: {' + '.join(default_configs)}, which any "
        "--config replaces (list it too to build on it)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.max_steps=10")
    return p.parse_intermixed_args(argv)  # --config may come before, between or after the overrides


def main(argv: Sequence[str] | None = None, default_configs: Sequence[str] = (DEFAULT_CONFIG,)) -> int:
    """Parse, load and validate the config (exit 2 on a config error, before any heavy import), then train.

    ``default_configs`` are used when no --config is given (projects made from template/ pass their own)."""
    args = parse_args(argv, default_configs)
    files = args.config if args.config else list(default_configs)
    try:
        cfg = load_config(files, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    from nanovlm.data.datamodule import DataMismatchError, DataStateError, SkipRateError
    from nanovlm.data.shards import PlanError
    from nanovlm.model import BackendUnavailableError, CheckpointMismatchError
    from nanovlm.train.checkpoint import CheckpointModelMismatchError, RunDirConflictError
    from nanovlm.train.run import train  # heavy imports only after the config is known to be valid

    user_errors = (
        CheckpointModelMismatchError,  # a checkpoint to resume that does not fit the model
        CheckpointMismatchError,  # a pretrained checkpoint that does not fit
        BackendUnavailableError,
        RunDirConflictError,
        PlanError,
        DataStateError,
        DataMismatchError,
        SkipRateError,
        FileNotFoundError,  # a data, tokenizer or checkpoint path
    )
    try:
        result = train(cfg, config_files=list(files))
    except user_errors as e:  # their messages name the problem and the fix: no traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from nanovlm.dist import global_rank_from_env

    if result.preempted and global_rank_from_env() == 0:  # every rank gets here: one message
        cause = "by a signal" if result.stopped_by_signal else "as trainer.stop_at_step asks"
        print(
            f"stopped {cause} at step {result.global_step}; checkpoint {result.last_checkpoint}. "
            "Run the same command again to resume."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
