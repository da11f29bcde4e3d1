"""``scripts/benchmark.py``: packing quality, data pipeline, training throughput and resume cost, side by side.

    python scripts/benchmark.py --quick --json runs/bench/quick.json            # < 2 min on 2 CPU cores
    python scripts/benchmark.py --json runs/bench/full.json --plot docs/fill.png  # the numbers in docs/performance.md
    python scripts/benchmark.py --sections packing --index data/my_set/train     # packing on your own data
    python scripts/benchmark.py --sections train --device cuda --preset model_222m.yaml

Every figure goes to ``--json``; a markdown report is printed (and written to ``--markdown``).
Warm-up is excluded, inputs and seeds are fixed, each timing is repeated ``--reps`` times (median and
min/max reported) and one factor changes at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from nanovlm.bench.common import machine_description

SECTIONS = ("packing", "pipeline", "train", "resume")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: the whole suite in under 2 minutes on 2 cores")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    p.add_argument("--markdown", metavar="PATH", help="also write the markdown report here")
    p.add_argument("--plot", metavar="PATH", help="write the fill-per-strategy plot (PNG) here")
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per measurement (default 5; 3 with --quick)"
    )
    p.add_argument(
        "--synthetic-samples",
        type=int,
        default=0,
        help="samples per synthetic distribution (default 20000; 3000 with --quick)",
    )
    p.add_argument(
        "--train-samples",
        type=int,
        default=0,
        help="samples the train section lays out (default 600 on cpu, 4000 on cuda; 80 / 1000 with --quick)",
    )
    p.add_argument("--config", action="append", default=[], help="config file(s) for the data/model sections")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override after the files, as train.py takes them (e.g. model.language.vocab_size=49152)",
    )
    p.add_argument("--index", action="append", default=[], metavar="DIR", help="dataset dir(s) whose lengths to pack")
    p.add_argument(
        "--data", action="append", default=[], metavar="DIR", help="dataset dir(s) for pipeline/train/resume"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for --data (default: the config's)")
    p.add_argument("--budget", type=int, default=0, help="token budget for --index / --data (default: the config's)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (training section)")
    p.add_argument("--preset", default="", help="model preset for --device cuda, e.g. model_222m.yaml")
    p.add_argument(
        "--backends", default="", help="attention backends to compare on cuda, e.g. sdpa,torch_varlen,flash_attn"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block (trainer.compile) in the train section",
    )
    p.add_argument("--workdir", default="runs/bench", help="scratch directory (demo data copies, checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"unknown section(s) {bad}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    if args.reps < 1:
        print("--reps must be >= 1", file=sys.stderr)
        return 2
    if args.train_samples < 0:
        print("--train-samples must be >= 1 (0: the default)", file=sys.stderr)
        return 2
    from nanovlm.bench.workloads import bench_config
    from nanovlm.config import ConfigError

    try:  # a bad --config file or --set override stops here, not after the sections before it have run
        bench_config(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    doc: dict[str, Any] = {
        "command": " ".join(["python scripts/benchmark.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "machine": machine_description(),
        "sections": {},
    }
    md = [f"# nanovlm benchmark{' (quick)' if args.quick else ''}", "", _machine_md(doc["machine"]), ""]
    for name in sections:
        t0 = time.perf_counter()
        try:
            part, text = _run_section(name, args)
        except (FileNotFoundError, ValueError) as e:  # bad input: say what is wrong, no traceback
            print(f"benchmark section '{name}' failed: {e}", file=sys.stderr)
            return 2
        part["wall_s"] = time.perf_counter() - t0
        doc["sections"][name] = part
        md += [text, ""]
        print(f"[{name}] done in {part['wall_s']:.1f} s", file=sys.stderr, flush=True)
    doc["wall_s"] = time.perf_counter() - t_start
    doc["load_avg_1m_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    md.append(f"Total wall time: {doc['wall_s']:.0f} s; load average at the end {doc['load_avg_1m_end']}.")
    report = "\n".join(md)
    print(report)
    if args.json:
        from nanovlm.bench.report import write_json

        write_json(doc, args.json)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report + "\n")
    if args.plot and "packing" in doc["sections"]:
        from nanovlm.bench.report import plot_fill

        plot_fill(doc["sections"]["packing"]["cells"], args.plot)
    return 0


def _machine_md(m: dict[str, Any]) -> str:
    gpu = m.get("gpu")
    gpu_s = f"{gpu['count']}x {gpu['name']} ({gpu['memory_gb']} GB, CUDA {gpu['cuda']})" if gpu else "none"
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB RAM, GPU: {gpu_s}; Python {m['python']}, "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m.get('transformers', '?')}, "
        f"webdataset {m.get('webdataset', '?')}; load average at start {m['load_avg_1m']}; commit {m['git_commit']}."
    )


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_section(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if name == "packing":
        from nanovlm.bench import packing_section

        plan = packing_section.PackingPlan.quick() if args.quick else packing_section.PackingPlan()
        plan.reps, plan.seed = args.reps, args.seed
        if args.synthetic_samples:
            plan.synthetic_samples = args.synthetic_samples
        from nanovlm.bench.workloads import index_length_sets

        plan.index_sets, plan.index_budget = index_length_sets(args)
        return packing_section.run(plan, log=_log)
    if name == "pipeline":
        from nanovlm.bench import pipeline_bench

        return pipeline_bench.run(args, log=_log)
    if name == "train":
        from nanovlm.bench import train_bench

        return train_bench.run(args, log=_log)
    if name == "resume":
        from nanovlm.bench import resume_bench

        return resume_bench.run(args, log=_log)
    raise AssertionError(name)


if __name__ == "__main__":
    raise SystemExit(main())
