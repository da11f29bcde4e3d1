#!/usr/bin/env python
"""Length report from a dataset index: python scripts/analyze_data.py DIR --out REPORT_DIR  (see --help)."""

import sys

from nanovlm.cli.analyze_data import main

if __name__ == "__main__":
    sys.exit(main())
