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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Stats
from benchmarks.workloads import data_config, demo_dirs

ROOT = Path(__file__).resolve().parent.parent  # the checkout: ``benchmarks`` is imported from here, not installed


def time_to_first_batch(spec: dict[str, Any], t_spawn: float) -> dict[str, Any]:
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
    print(json.dumps(time_to_first_batch(json.loads(Path(spec_path).read_text()), t_spawn)), flush=True)
    os._exit(0)  # do not wait for worker/producer teardown: the measurement is over


TIMINGS = ("total_s", "data_s", "imports_s", "setup_s", "load_state_s", "first_batch_s")


def positions(per_epoch: int) -> dict[str, int | None]:
    """Batches consumed before each resume point (None: a fresh start)."""
    return {"fresh": None, "early": 1, "mid": per_epoch // 2, "late": max(1, per_epoch * 9 // 10)}


def write_specs(
    args: argparse.Namespace, cfg, base: dict[str, Any], where: dict[str, int | None], workdir: Path
) -> dict[str, Path]:
    """One spec file per position: the config to build the DataModule from, and the data state to restore."""
    overrides = [
        f"data.train=[{','.join(cfg.data.train)}]",
        f"data.tokenizer={cfg.data.tokenizer}",
        f"data.num_workers={cfg.data.num_workers}",
        f"data.max_tokens={cfg.data.max_tokens}",
        "data.val=[]",
        "data.make_demo_if_missing=false",
    ]
    specs = {}
    for name, consumed in where.items():
        state = None
        if consumed is not None:
            state = json.loads(json.dumps(base))
            state["ranks"][0]["consumed"] = consumed
        specs[name] = workdir / f"resume_{name}.json"
        specs[name].write_text(
            json.dumps({"config_files": args.config or ["tiny_cpu.yaml"], "overrides": overrides, "state": state})
        )
    return specs


def measure_in_child(name: str, spec: Path, t_spawn: float) -> dict[str, Any]:
    """One measurement in a new Python process (``python -m benchmarks.resume --child``)."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume", "--child", str(spec), repr(t_spawn)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": pythonpath},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"resume child failed ({name}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def measure_rounds(
    specs: dict[str, Path], where: dict[str, int | None], per_epoch: int, reps: int, in_process: bool, log
) -> dict[str, list[dict[str, Any]]]:
    """``reps`` measurements per position, positions interleaved so a burst of load hits all of them alike."""
    runs: dict[str, list[dict]] = {name: [] for name in where}
    for i in range(reps):
        log(f"[resume] round {i + 1}/{reps}: " + ", ".join(f"{n} ({c or 0}/{per_epoch})" for n, c in where.items()))
        for name, spec in specs.items():
            t_spawn = time.time()
            if in_process:
                runs[name].append(time_to_first_batch(json.loads(spec.read_text()), t_spawn))
            else:
                runs[name].append(measure_in_child(name, spec, t_spawn))
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], where: dict[str, int | None]) -> dict[str, dict[str, Any]]:
    """Median and spread of every timing per position, after checking each first batch is the restored one."""
    results = {}
    for name, consumed in where.items():
        for r in runs[name]:
            if r["index"] != (consumed or 0) or r["epoch"] != 0:
                raise RuntimeError(f"resume at {consumed} yielded batch {r['index']} of epoch {r['epoch']}")
        results[name] = {
            "position": consumed or 0,
            **{k: Stats.of([r[k] for r in runs[name]]).to_dict() for k in TIMINGS},
        }
    return results


def growth_check(results: dict[str, dict[str, Any]]) -> tuple[float, bool]:
    """Late vs fresh growth of the data part (setup + restore + first batch: imports do not depend on the
    position), and whether it "does not grow": within 25% or 0.1 s of timer noise."""
    fresh = results["fresh"]["data_s"]["median"]
    late = results["late"]["data_s"]["median"]
    return (late - fresh) / fresh, late <= fresh * 1.25 or late - fresh <= 0.1


@dataclass
class ResumeResult:
    """What the resume section measured, and the setting its report states."""

    batches_per_epoch: int
    workers: int
    in_process: bool
    results: dict[str, dict[str, Any]]
    growth: float
    target_met: bool
    data: list[str]
    reps: int

    def to_json(self) -> dict[str, Any]:
        return {
            "batches_per_epoch": self.batches_per_epoch,
            "workers": self.workers,
            "in_process": self.in_process,
            "results": self.results,
            "growth_late_vs_fresh": self.growth,
            "target_met": self.target_met,
        }


def measure(args: argparse.Namespace, log=print) -> ResumeResult:
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    cfg = data_config(args, 1 if args.quick else 2)
    if not args.data:
        demo_dirs(cfg)
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    per_epoch = dm.current_split().batches_per_rank()
    where = positions(per_epoch)
    in_process = args.quick  # --quick: no new interpreter per measurement (imports not counted)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    specs = write_specs(args, cfg, dm.state_dict(), where, workdir)
    results = summarize(measure_rounds(specs, where, per_epoch, args.reps, in_process, log), where)
    growth, ok = growth_check(results)
    return ResumeResult(
        batches_per_epoch=per_epoch,
        workers=cfg.data.num_workers,
        in_process=in_process,
        results=results,
        growth=growth,
        target_met=ok,
        data=list(cfg.data.train),
        reps=args.reps,
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="internal: one resume measurement (run by the benchmark)")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "T_SPAWN"), required=True)
    a = ap.parse_args()
    _child(a.child[0], float(a.child[1]))
