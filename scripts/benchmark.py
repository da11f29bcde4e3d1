"""Benchmark suite: packing quality, data pipeline, training throughput, resume cost (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ lives in the checkout, not installed
from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
