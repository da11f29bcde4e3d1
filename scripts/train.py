#!/usr/bin/env python
"""Train a nanoVLM: python scripts/train.py [--config FILE ...] [key=value ...]  (see --help)."""

import sys

from nanovlm.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
