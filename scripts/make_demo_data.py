#!/usr/bin/env python
"""Build the offline demo dataset: python scripts/make_demo_data.py [--output data/demo]  (see --help)."""

import sys

from nanovlm.cli.make_demo_data import main

if __name__ == "__main__":
    sys.exit(main())
