"""Resume cost: time from process start to the first batch, fresh vs resuming early, midway and late in an epoch.

Each measurement is a new Python process (so imports, index loading and worker start-up are counted, as
they are when a job restarts). The child builds the DataModule, restores a data state whose position is
``consumed`` batches into epoch 0 (a state as a checkpoint holds it: the DataModule's own ``state_dict()``
with the position set), and takes the first batch. It also checks that this batch is the one at that
position, so the measurement cannot pass by restarting the epoch. The target: time to first batch does not
grow with the position (resume seeks in the deterministic plan; it never replays).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nanovlm.bench.common import Stats, markdown_table
from nanovlm.bench.pipeline_bench import _data_config
from nanovlm.bench.workloads import demo_dirs


def measure(spec: dict[str, Any], t_spawn: float) -> dict[str, Any]:
    """Build the DataModule, restore ``spec['state']``, take the first batch; timings relative to ``t_spawn``."""
    t_main = time.time()
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    t_import = time.time()
    cfg = load_config(spec["config_files"], spec["overrides"])
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    t_setup = time.time()
    if spec["state"] is not None:
        dm.load_state_dict(spec["state"])
    t_state = time.time()
    it = iter(dm.train_dataloader())
    batch = next(it)
    t_first = time.time()
    del it
    meta = batch["meta"]
    return {
        "python_start_s": t_main - t_spawn,
        "imports_s": t_import - t_main,
        "setup_s": t_setup - t_import,
        "load_state_s": t_state - t_setup,
        "first_batch_s": t_first - t_state,
        "data_s": t_first - t_import,  # everything that could depend on the position
        "total_s": t_first - t_spawn,
        "epoch": int(meta["epoch"]),
        "index": int(meta["index"]),
    }


def _child(spec_path: str, t_spawn: float) -> None:
    """Runs in the measured process; prints one JSON line of timings."""
    print(json.dumps(measure(json.loads(Path(spec_path).read_text()), t_spawn)), flush=True)
    os._exit(0)  # do not wait for worker/producer teardown: the measurement is over


def run(args: argparse.Namespace, log=print) -> tuple[dict[str, Any], str]:
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    cfg = _data_config(args, 1 if args.quick else 2)
    if not args.data:
        demo_dirs(cfg)
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    per_epoch = dm.current_plan().batches_per_rank()
    base = dm.state_dict()
    positions = {"fresh": None, "early": 1, "mid": per_epoch // 2, "late": max(1, per_epoch * 9 // 10)}
    reps = args.reps
    in_process = args.quick  # --quick: no new interpreter per measurement (imports not counted)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"data.train=[{','.join(cfg.data.train)}]",
        f"data.tokenizer={cfg.data.tokenizer}",
        f"data.num_workers={cfg.data.num_workers}",
        f"data.max_tokens={cfg.data.max_tokens}",
        "data.val=[]",
        "data.make_demo_if_missing=false",
    ]
    results = {}
    specs = {}
    for name, consumed in positions.items():
        state = None
        if consumed is not None:
            state = json.loads(json.dumps(base))
            state["ranks"][0]["consumed"] = consumed
        specs[name] = workdir / f"resume_{name}.json"
        specs[name].write_text(
            json.dumps({"config_files": args.config or ["tiny_cpu.yaml"], "overrides": overrides, "state": state})
        )
    runs: dict[str, list[dict]] = {name: [] for name in positions}
    for i in range(reps):  # positions interleaved, so a burst of load hits all of them alike
        log(f"[resume] round {i + 1}/{reps}: " + ", ".join(f"{n} ({c or 0}/{per_epoch})" for n, c in positions.items()))
        for name, spec in specs.items():
            t_spawn = time.time()
            if in_process:
                runs[name].append(measure(json.loads(spec.read_text()), t_spawn))
                continue
            out = subprocess.run(
                [sys.executable, "-m", "nanovlm.bench.resume_bench", "--child", str(spec), repr(t_spawn)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(f"resume child failed ({name}): {out.stderr[-2000:]}")
            runs[name].append(json.loads(lines[-1]))
    for name, consumed in positions.items():
        for r in runs[name]:
            if r["index"] != (consumed or 0) or r["epoch"] != 0:
                raise RuntimeError(f"resume at {consumed} yielded batch {r['index']} of epoch {r['epoch']}")
        results[name] = {
            "position": consumed or 0,
            **{
                k: Stats.of([r[k] for r in runs[name]]).to_dict()
                for k in ("total_s", "data_s", "imports_s", "setup_s", "load_state_s", "first_batch_s")
            },
        }
    # The check uses the data part (setup + restore + first batch): imports do not depend on the position.
    fresh = results["fresh"]["data_s"]["median"]
    late = results["late"]["data_s"]["median"]
    growth = (late - fresh) / fresh
    ok = late <= fresh * 1.25 or late - fresh <= 0.1  # "does not grow": within 25% or 0.1 s of timer noise
    md = ["## Resume cost", ""]
    md.append(
        f"Time from {'DataModule construction (in-process, --quick)' if in_process else 'process start'} to the first "
        f"batch; epoch of {per_epoch} batches, {cfg.data.num_workers} worker(s), data {', '.join(cfg.data.train)}. "
        f"Median [min-max] of {reps} runs, positions interleaved; each checks that its first batch is the batch at the restored position. "
        "*data s* = setup + restore + first batch (the part that could depend on the position)."
    )
    md.append("")
    rows = [
        [
            name,
            r["position"],
            Stats(**r["total_s"]).fmt(2),
            Stats(**r["data_s"]).fmt(2),
            f"{r['imports_s']['median']:.2f}",
            f"{r['setup_s']['median']:.2f}",
            f"{r['load_state_s']['median'] * 1e3:.1f}",
            f"{r['first_batch_s']['median']:.2f}",
        ]
        for name, r in results.items()
    ]
    md.append(
        markdown_table(
            [
                "start",
                "position (batches)",
                "total s",
                "data s",
                "imports s",
                "setup s",
                "load_state ms",
                "first batch s",
            ],
            rows,
        )
    )
    md += [
        "",
        f"Late vs fresh (data s): {100 * growth:+.0f}% (target: no growth with position, within 25% or 0.1 s of "
        f"timer noise: {'met' if ok else 'MISSED'}).",
    ]
    return {
        "batches_per_epoch": per_epoch,
        "workers": cfg.data.num_workers,
        "in_process": in_process,
        "results": results,
        "growth_late_vs_fresh": growth,
        "target_met": ok,
    }, "\n".join(md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="internal: one resume measurement (run by the benchmark)")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "T_SPAWN"), required=True)
    a = ap.parse_args()
    _child(a.child[0], float(a.child[1]))
