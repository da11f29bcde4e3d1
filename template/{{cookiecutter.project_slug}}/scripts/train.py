#!/usr/bin/env python
"""Train this project: nanovlm's tiny_cpu.yaml <- configs/experiment.yaml <- key=value overrides.

    python scripts/train.py [--config FILE ...] [key=value ...]      (see --help)

With --config, only the given files are used (add configs/experiment.yaml yourself).
"""

import sys
from pathlib import Path

from nanovlm.cli.train import main

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    sys.exit(main(default_configs=["tiny_cpu.yaml", str(ROOT / "configs" / "experiment.yaml")]))
