#!/usr/bin/env python
"""JSONL + images -> indexed WebDataset shards: python scripts/prepare_data.py --input F.jsonl --output DIR  (see --help)."""

import sys

from nanovlm.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
