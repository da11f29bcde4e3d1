#!/usr/bin/env python
"""A trained run -> a transformers Idefics3 checkpoint: python scripts/export_hf.py RUN_DIR OUT  (see --help)."""

import sys

from nanovlm.cli.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
