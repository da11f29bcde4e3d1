"""``scripts/benchmark.py``: packing quality, data pipeline, training throughput and resume cost, side by side.

    python scripts/benchmark.py --quick --json runs/bench/quick.json            # < 2 min on 2 CPU cores
    python scripts/benchmark.py --json runs/bench/full.json --plot docs/fill.png  # the numbers in docs/performance.md
    python scripts/benchmark.py --sections packing --index data/my_set/train     # packing on your own data
    python scripts/benchmark.py --sections train --device cuda --preset model_222m.yaml
    python scripts/benchmark.py --sections train --device cuda --compile-step --train-modes packed  # compiled step
    python scripts/benchmark.py --sections scale --workdir /big/disk   # 1M / 10M / 100M-sample indexes (~6 GB)
    python scripts/benchmark.py --sections remote   # S3 on loopback behind 0 / 20 / 100 ms of latency vs local disk
    python scripts/benchmark.py --sections stream   # the same S3 through a cache of 2 shards per worker, 3 epochs
    python scripts/benchmark.py --sections ranges   # the same S3: a shard's samples by one whole GET or ranged GETs
    python scripts/benchmark.py --sections decode --device cuda   # JPEG decode: Pillow in a worker vs nvJPEG

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

from benchmarks.common import machine_description, pinned
from benchmarks.scale import parse_size

SECTIONS = ("packing", "pipeline", "train", "resume", "scale", "tiles", "remote", "stream", "ranges", "decode")
# scale writes GBs of synthetic index, tiles is a packing variant, remote, stream and ranges start an S3 server:
# asked for by name
DEFAULT_SECTIONS = SECTIONS[:4]
S3_SECTIONS = ("remote", "stream", "ranges")  # the ones --store-cpus and --loader-cpus pin


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (_run_args, _input_args, _train_args, _section_args, _store_args):
        add(p)
    p.add_argument("--workdir", default="runs/bench", help="scratch directory (demo data copies, checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run_args(p: argparse.ArgumentParser) -> None:
    """Which sections, their sizes and repetitions, and where the figures go."""
    p.add_argument("--quick", action="store_true", help="small sizes: the whole suite in under 2 minutes on 2 cores")
    p.add_argument(
        "--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
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


def _input_args(p: argparse.ArgumentParser) -> None:
    """The config and the data the sections read."""
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


def _train_args(p: argparse.ArgumentParser) -> None:
    """The train section's device, model and rows."""
    p.add_argument("--device", default="cpu", help="cpu | cuda (training section)")
    p.add_argument("--preset", default="", help="model preset for --device cuda, e.g. model_222m.yaml")
    p.add_argument(
        "--backends",
        default="",
        help="attention backends to compare (packed) in the train section, e.g. sdpa,torch_varlen,flash_attn (the "
        "default on cuda; none on cpu); 'none' for no backend rows",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block (trainer.compile=blocks) in the train section",
    )
    p.add_argument(
        "--compile-step",
        action="store_true",
        help="train section: add the packed plan as static packs (data.static_shapes), eager and with the whole step "
        "compiled (trainer.compile=step; CUDA graphs on cuda); compilation is in the untimed warm-up",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of --compile-step: inductor (as training; CUDA graphs on cuda) or e.g. aot_eager "
        "(the same graph capture, no code generation: a quick check of the plumbing)",
    )
    p.add_argument(
        "--train-modes",
        default="all",
        help="train section: the rows to time besides --backends and --compile-step, comma-separated from "
        "packed,pad_to_longest,constrained,head_everywhere,decoder_only (default all; 'none' for none)",
    )


def _section_args(p: argparse.ArgumentParser) -> None:
    """The scale, tiles and decode sections' sizes and inputs."""
    p.add_argument(
        "--scale-sizes", default="", help="scale section: index sizes, e.g. 1M,10M,100M (default; 100k with --quick)"
    )
    p.add_argument(
        "--scale-plan-max",
        type=parse_size,
        default="10M",
        help="scale section: largest index to plan the epoch for (above it the plan does not fit this machine)",
    )
    p.add_argument(
        "--tiles-samples",
        type=int,
        default=0,
        help="tiles section: samples per distribution (20000; 2000 with --quick)",
    )
    p.add_argument(
        "--decode-jpegs", default="", help="decode section: a directory or tar of JPEGs (default: synthetic)"
    )
    p.add_argument("--real-shards", default="", help="scale section: shards to time prepare_data on (default: demo)")


def _store_args(p: argparse.ArgumentParser) -> None:
    """Where the remote, stream and ranges sections run their S3 store and their loader."""
    p.add_argument(
        "--store-cpus",
        default="",
        metavar="CPUS",
        help="remote, stream and ranges sections: run the S3 store's process on these CPUs (e.g. 2-3), the loader on "
        "the others unless --loader-cpus says, as a store on another machine takes none of the loader's CPUs",
    )
    p.add_argument(
        "--loader-cpus",
        default="",
        metavar="CPUS",
        help="remote, stream and ranges sections: run the thread that measures them, and the DataLoader workers and "
        "threads it starts, on these CPUs (e.g. 0-1), the store on the others unless --store-cpus says (default: "
        "both on all)",
    )


def _check_cpus(args: argparse.Namespace) -> str | None:
    """--store-cpus and --loader-cpus as CPU sets, each the other's complement where only one is given (None and
    None: nothing pinned); what is wrong with them, or None."""
    from benchmarks.common import parse_cpus

    given = {"store": args.store_cpus, "loader": args.loader_cpus}
    if not any(given.values()):
        args.store_cpus = args.loader_cpus = None
        return None
    if not hasattr(os, "sched_getaffinity"):
        return "--store-cpus / --loader-cpus: this system cannot pin a process to CPUs"
    usable = frozenset(os.sched_getaffinity(0))
    cpus: dict[str, frozenset[int]] = {}
    for who, text in given.items():
        if text:
            try:
                cpus[who] = parse_cpus(text)
            except ValueError as e:
                return f"--{who}-cpus: {e}"
            if not cpus[who] <= usable:
                return f"--{who}-cpus {text}: CPUs {sorted(cpus[who] - usable)} are not among {sorted(usable)}"
    for who, other in (("store", "loader"), ("loader", "store")):
        if who not in cpus:
            cpus[who] = usable - cpus[other]
            if not cpus[who]:
                return f"--{other}-cpus {given[other]} leaves no CPU for the {who}"
    if cpus["store"] & cpus["loader"]:
        return f"--store-cpus and --loader-cpus share CPUs {sorted(cpus['store'] & cpus['loader'])}"
    try:  # a container may refuse it: say so now, not after the sections before the first S3 one
        for who in cpus:
            with pinned(cpus[who]):
                pass
    except OSError as e:
        return f"--{who}-cpus: this process may not pin itself to CPUs {sorted(cpus[who])} ({e.strerror})"
    args.store_cpus, args.loader_cpus = cpus["store"], cpus["loader"]
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """Fill in defaults that depend on --quick; what is wrong with the arguments, or None."""
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        return f"unknown section(s) {bad}; choose from {list(SECTIONS)}"
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    if args.reps < 1:
        return "--reps must be >= 1"
    if args.train_samples < 0:
        return "--train-samples must be >= 1 (0: the default)"
    problem = _check_cpus(args)
    if problem:
        return problem
    from benchmarks.train import parse_train_modes

    try:
        parse_train_modes(args.train_modes)
    except ValueError as e:
        return str(e)
    from benchmarks.workloads import bench_config
    from nanovlm.config import ConfigError

    try:  # a bad --config file or --set override stops here, not after the sections before it have run
        bench_config(args)
    except ConfigError as e:
        return f"error: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    doc: dict[str, Any] = {
        "command": " ".join(["python scripts/benchmark.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "machine": machine_description(),
        "sections": {},
    }
    if args.store_cpus:
        doc["cpus"] = {"store": sorted(args.store_cpus), "loader": sorted(args.loader_cpus)}
    texts = []
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        t0 = time.perf_counter()
        try:
            with pinned(args.loader_cpus if name in S3_SECTIONS else None):  # workers inherit it
                part, text = run_section(name, args)
        except (FileNotFoundError, ValueError) as e:  # bad input: say what is wrong, no traceback
            print(f"benchmark section '{name}' failed: {e}", file=sys.stderr)
            return 2
        part["wall_s"] = time.perf_counter() - t0
        doc["sections"][name] = part
        texts.append(text)
        print(f"[{name}] done in {part['wall_s']:.1f} s", file=sys.stderr, flush=True)
    doc["wall_s"] = time.perf_counter() - t_start
    doc["load_avg_1m_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    write_outputs(doc, texts, args)
    return 0


def write_outputs(doc: dict[str, Any], texts: list[str], args: argparse.Namespace) -> None:
    """Print the markdown report; write it, the JSON and the plot where asked."""
    from benchmarks.report import plot_fill, render_report, write_json

    report = render_report(doc, texts)
    print(report)
    if args.json:
        write_json(doc, args.json)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report + "\n")
    if args.plot and "packing" in doc["sections"]:
        plot_fill(doc["sections"]["packing"]["cells"], args.plot)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_section(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Measure one section; return its JSON part and its markdown."""
    from benchmarks import report

    if name == "packing":
        from benchmarks import packing
        from benchmarks.workloads import index_length_sets

        plan = packing.PackingPlan.quick() if args.quick else packing.PackingPlan()
        plan.reps, plan.seed = args.reps, args.seed
        if args.synthetic_samples:
            plan.synthetic_samples = args.synthetic_samples
        plan.index_sets, plan.index_budget = index_length_sets(args)
        result = packing.measure(plan, log=_log)
        return result.to_json(), report.render_packing(result)
    if name == "pipeline":
        from benchmarks import pipeline

        result = pipeline.measure(args, log=_log)
        return result.to_json(), report.render_pipeline(result)
    if name == "train":
        from benchmarks import train

        result = train.measure(args, log=_log)
        return result.to_json(), report.render_train(result)
    if name == "resume":
        from benchmarks import resume

        result = resume.measure(args, log=_log)
        return result.to_json(), report.render_resume(result)
    if name == "tiles":
        from benchmarks import tiles

        result = tiles.measure(args, log=_log)
        return result.to_json(), report.render_tiles(result)
    if name == "remote":
        from benchmarks import remote

        result = remote.measure(args, log=_log)
        return result, report.render_remote(result)
    if name == "stream":
        from benchmarks import stream

        result = stream.measure(args, log=_log)
        return result, report.render_stream(result)
    if name == "ranges":
        from benchmarks import ranges

        result = ranges.measure(args, log=_log)
        return result, report.render_ranges(result)
    if name == "scale":
        from benchmarks import scale

        result = scale.measure(args, log=_log)
        return result.to_json(), report.render_scale(result)
    if name == "decode":
        from benchmarks import decode

        result = decode.measure(args, log=_log)
        return result, report.render_decode(result)
    raise AssertionError(name)


if __name__ == "__main__":
    raise SystemExit(main())
