#!/usr/bin/env python
"""Draw packed batches: python scripts/inspect_batch.py DATASET_DIR --out FILE.png [key=value ...]  (see --help)."""

import sys

from nanovlm.cli.inspect_batch import main

if __name__ == "__main__":
    sys.exit(main())
