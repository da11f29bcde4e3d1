#!/usr/bin/env python
"""Print packed batches of a run's DataModule: python scripts/inspect_batch.py [--config FILE] [key=value ...]."""

import sys

from nanovlm.cli.inspect_batch import main

if __name__ == "__main__":
    sys.exit(main())
