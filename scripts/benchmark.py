"""Benchmark suite: packing quality, data pipeline, training throughput, resume cost (see --help)."""

from nanovlm.cli.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
