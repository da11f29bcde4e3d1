"""Output of the benchmark: the markdown report, the JSON document and the fill-per-strategy plot.

The sections measure and return their figures (``benchmarks/packing.py`` and the others); everything here only
formats what they measured: a ``render_*`` function per section, the report's header and footer, the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import Stats, markdown_table, pct
from benchmarks.packing import packing_target_line

if TYPE_CHECKING:
    from benchmarks.packing import PackingResult
    from benchmarks.pipeline import PipelineResult
    from benchmarks.resume import ResumeResult
    from benchmarks.scale import ScaleResult
    from benchmarks.tiles import TilesResult
    from benchmarks.train import TrainResult


# ------------------------------------------------------------------------------------------------------
# the report


def render_report(doc: dict[str, Any], sections: list[str]) -> str:
    """The whole markdown report: title, machine, each section's text, total wall time."""
    md = [f"# nanovlm benchmark{' (quick)' if doc['quick'] else ''}", "", render_machine(doc["machine"]), ""]
    if doc.get("cpus"):
        store, loader = (",".join(map(str, doc["cpus"][k])) for k in ("store", "loader"))
        md += [f"Pinned (remote, stream, ranges): the S3 store on CPUs {store}, the loader on {loader}.", ""]
    for text in sections:
        md += [text, ""]
    md.append(f"Total wall time: {doc['wall_s']:.0f} s; load average at the end {doc['load_avg_1m_end']}.")
    return "\n".join(md)


def render_machine(m: dict[str, Any]) -> str:
    gpu = m.get("gpu")
    gpu_s = f"{gpu['count']}x {gpu['name']} ({gpu['memory_gb']} GB, CUDA {gpu['cuda']})" if gpu else "none"
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB RAM, GPU: {gpu_s}; Python {m['python']}, "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m.get('transformers', '?')}, "
        f"webdataset {m.get('webdataset', '?')}; load average at start {m['load_avg_1m']}; commit {m['git_commit']}."
    )


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ------------------------------------------------------------------------------------------------------
# packing


def render_packing(result: PackingResult) -> str:
    plan = result.plan
    md = ["## Packing quality", ""]
    md.append(
        "Fill = real tokens / slots. *fill at peak*: real tokens / (steps x largest step), what a fixed memory "
        "budget sees. Gaps are in percentage points of fill (positive = below the bound / FFD). Cost: "
        "planning time per sample, median [min-max] of "
        f"{plan.reps} runs after a warm-up."
    )
    md.append("")
    for c in result.cells:
        md += [cell_table(c), ""]
    md += [f"Ours, one factor changed (lookahead), L = {plan.sweep_budget}:", "", sweep_table(result.sweep), ""]
    md += ["Targets:", ""] + [f"- {packing_target_line(c)}" for c in result.checks] + [""]
    return "\n".join(md)


def _cost(row: dict[str, Any]) -> str:
    if row.get("us_per_sample"):
        return Stats(**row["us_per_sample"]).fmt(2)
    if row.get("collate_us_per_sample"):
        return "collate " + Stats(**row["collate_us_per_sample"]).fmt(1)
    return "-"


def cell_table(cell: dict[str, Any]) -> str:
    """Markdown table of one cell (distribution x budget)."""
    headers = [
        "strategy",
        "fill",
        "fill at peak",
        "slots/step (cv)",
        "samples/step",
        "images/step (max)",
        "dropped tok",
        "gap to bound",
        "gap to FFD",
        "cost us/sample",
    ]
    out = [
        [
            r["strategy"],
            pct(r["fill"], 2),
            pct(r["fill_at_peak"], 1),
            f"{r['slots_per_step_mean']:.0f} ({r['slots_per_step_cv']:.2f})",
            f"{r['samples_per_step']:.1f}",
            f"{r['images_per_step_mean']:.1f} ({r['images_per_step_max']})",
            pct(r["dropped_tokens_frac"], 1),
            f"{r['gap_to_bound_pp']:+.2f} pp",
            f"{r['gap_to_ffd_pp']:+.2f} pp",
            _cost(r),
        ]
        for r in cell["rows"]
    ]
    d = cell["distribution"]
    title = (
        f"**{d['name']}**, L = {cell['budget_tokens']}, <= {cell['max_images']} images/pack: {d['samples']} samples, "
        f"mean {d['mean']:.0f} / p99 {d['p99']:.0f} / max {d['max']} tokens; bound fill "
        f"{pct(cell['bound_fill'], 2)} ({cell['lower_bound_packs']} packs"
        + (", the image cap binds" if cell.get("bound_binding") == "images" else "")
        + f"), FFD {pct(cell['ffd_fill'], 2)} "
        f"({cell['ffd_packs']} packs)"
    )
    return title + "\n\n" + markdown_table(headers, out)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["distribution", "L", "lookahead", "fill", "gap to FFD", "longest wait (packs)"],
        [
            [
                r["distribution"],
                r["budget_tokens"],
                r["lookahead"],
                pct(r["fill"], 2),
                f"{r['gap_to_ffd_pp']:+.2f} pp",
                r["max_wait_packs"],
            ]
            for r in rows
        ],
    )


# ------------------------------------------------------------------------------------------------------
# data pipeline


def render_pipeline(result: PipelineResult) -> str:
    md = ["## Data pipeline", ""]
    md.append(
        f"Data: {', '.join(result.data)}; image size {result.image_size}, "
        f"{result.image_tokens} tokens/image, L = {result.max_tokens}. Median [min-max] of {result.reps} "
        "runs after warm-up."
    )
    md += ["", "Per-sample cost by stage (one process):", ""]
    stages, raw_stage = result.stages, result.raw_stage
    rows = [[k, Stats(**v).fmt(0)] for k, v in stages["us_per_sample"].items()]
    rows.append(["**total (ours)**", Stats(**stages["total_us_per_sample"]).fmt(0)])
    rows.append(["webdataset read + decode('pil')", Stats(**raw_stage["us_per_sample"]).fmt(0)])
    md.append(markdown_table(["stage", "us/sample"], rows))
    md += ["", "Throughput by worker count (samples/s; the ratio is the >= 90% target):", ""]
    md.append(workers_table(result.by_workers, result.plan.step_s))
    md += ["", f"Target (>= 90% of raw webdataset at every worker count): {_met(result.target_met)}."]
    return "\n".join(md)


def _workers_row(b: dict[str, Any]) -> list[Any]:
    d, r = b["datamodule"], b["raw_webdataset"]
    q = d["queue_wait"]
    return [
        b["workers"],
        Stats(**d["samples_per_s"]).fmt(0),
        Stats(**d["real_tokens_per_s"]).fmt(0),
        Stats(**r["samples_per_s"]).fmt(0) if "samples_per_s" in r else r.get("skipped", "-"),
        f"{100 * b['ratio_to_raw']:.0f}%" if b["ratio_to_raw"] is not None else "-",
        f"{q['median_ms']:.1f} / {q['p99_ms']:.1f} ({100 * q['frac_of_time_waiting']:.0f}%)",
        f"{d['main_peak_rss_mb']['median']:.0f}",
        f"{d['worker_peak_rss_mb']['median']:.0f} ({d['worker_private_mb']['median']:.0f} private)"
        if d["worker_peak_rss_mb"]
        else "-",
    ]


def workers_table(by_workers: list[dict[str, Any]], step_s: float) -> str:
    return markdown_table(
        [
            "workers",
            "DataModule samples/s",
            "real tokens/s",
            "raw webdataset samples/s",
            "ratio",
            f"queue wait ms median / p99 (share), {step_s * 1e3:.0f} ms step",
            "main peak RSS MB",
            "worker peak RSS MB",
        ],
        [_workers_row(b) for b in by_workers],
    )


# ------------------------------------------------------------------------------------------------------
# training throughput


def render_train(result: TrainResult) -> str:
    md = ["## Training throughput", "", _train_setting(result), ""]
    md.append(modes_table(result.modes))
    if result.ratio_check is not None:
        md += ["", _ratio_text(result.ratio_check)]
    if result.loss_position_head is not None:
        md += ["", _head_text(result.loss_position_head)]
    if result.backends:
        md += ["", "Attention backends (packed):", "", backends_table(result.backends)]
    profiled = {**result.modes, **{f"packed/{b['backend']}": b for b in result.backends}}
    profiled = {name: r for name, r in profiled.items() if r.get("profile")}
    if profiled:
        steps = next(iter(profiled.values()))["profile"]["steps"]
        md += ["", _profile_text(result.device.type == "cuda", steps), "", profile_table(profiled)]
    return "\n".join(md)


def _train_setting(result: TrainResult) -> str:
    layout, cuda = result.layout, result.device.type == "cuda"
    text = (
        f"Model: {result.parameters / 1e6:.1f}M parameters ({result.model_label}, "
        f"attention backend {result.attn_backend}{', blocks compiled' if result.compiled else ''}), "
        f"device {result.device}, L = {layout['max_tokens']}, {layout['samples']} samples; "
        f"padded modes use B = {layout['batch_size']}, constrained cutoff {layout['cutoff']}. Tokens/s: median "
        f"[min-max] of {result.reps} passes (modes interleaved) after {result.warmup} warm-up steps; step times "
        "pooled over all passes; peak memory: above the resting level (activations, gradients, temporaries)."
    )
    if result.compile_step:
        text += _static_text(result)
    launches = result.modes.get("packed", {}).get("launches_per_step")
    if launches:
        text += f" Kernel launches of one packed step (forward + backward): {launches}" + (
            " (CUDA kernels and copies)." if cuda else " (aten ops dispatched, the CPU proxy)."
        )
    return text


def _static_text(result: TrainResult) -> str:
    """What the static rows ran (``--compile-step``): the layout, and the compiled step's graphs."""
    from benchmarks.train import STATIC_COMPILED

    st, cuda = result.layout["static"], result.device.type == "cuda"
    how = result.compile_backend + (", CUDA graphs" if cuda and result.compile_backend == "inductor" else "")
    text = (
        f" Static rows: the packed plan as static packs ({st['segments']} segments, {st['image_slots']} image "
        f"slots for {st['images_per_pack_mean']:.1f} images per pack on average), eager and with the whole step "
        f"compiled ({how}); compilation is in the warm-up; their MFU counts the real samples' work, as the packed "
        "row's does." + (" The no-CUDA-graphs row compiles the same step without them." if "CUDA graphs" in how else "")
    )
    counters = result.modes.get(STATIC_COMPILED, {}).get("compile_counters")
    if counters:
        text += f" Compiled step: {counters['unique_graphs']} graph(s), {counters['graph_breaks']} graph breaks"
        text += (
            f", {counters['cudagraph_skips']} CUDA-graph skips (0: every step replays a CUDA graph)." if cuda else "."
        )
    return text


def modes_table(modes: dict[str, dict[str, Any]]) -> str:
    rows = []
    for mode, r in modes.items():
        if "real_tokens_per_s" not in r:
            rows.append([mode, f"{100 * r['fill']:.1f}%", r["steps_per_pass"], r["error"], "-", "-", "-", "-"])
            continue
        rows.append([mode, f"{100 * r['fill']:.1f}%", r["steps_per_pass"], *_timing_cells(r)])
    headers = ["layout", "fill", "steps", "real tokens/s", "step ms median", "step ms p99", "peak memory MB", "MFU"]
    return markdown_table(headers, rows)


def _timing_cells(r: dict[str, Any]) -> list[str]:
    """real tokens/s, step ms median and p99, peak memory MB, MFU of one timed layout or backend."""
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    times = [f"{r['step_ms_median']:.1f}", f"{r['step_ms_p99']:.1f}", f"{r['peak_memory_mb']:.0f}"]
    return [Stats(**r["real_tokens_per_s"]).fmt(0), *times, mfu]


def _profile_text(cuda: bool, steps: int) -> str:
    text = (
        f"Host vs device time per whole step (forward, backward, optimizer), from a profile of {steps} steps after "
        "the timed passes: host = self time of the ops and runtime calls on the CPU (profiler overhead included)"
    )
    if cuda:
        text += (
            ", device = summed GPU kernel and copy time; issue = host time until the step's last launch returned, "
            "median of the timed steps (no profiler). Host above device: the GPU waits for the host. Launches: "
            "kernels run by forward + backward (a CUDA graph replays its kernels with one launch)"
        )
    return text + ". First loss: of the first warm-up step (rows of the same packs and seed must agree)."


def profile_table(rows: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, r in rows.items():
        prof = r["profile"]
        device = f"{prof['device_ms']:.1f}" if prof.get("device_ms") is not None else "-"
        issue = f"{r['host_issue_ms_median']:.1f}" if "host_issue_ms_median" in r else "-"
        step = f"{r['step_ms_median']:.1f}" if "step_ms_median" in r else "-"
        first = f"{r['first_losses'][0]:.4f}" if r.get("first_losses") else "-"
        first_s = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "-"
        out.append(
            [name, step, f"{prof['host_ms']:.1f}", device, issue, r.get("launches_per_step") or "-", first_s, first]
        )
    head = [
        "row",
        "step ms median",
        "host ms",
        "device ms",
        "issue ms",
        "launches (fwd+bwd)",
        "first step s",
        "first loss",
    ]
    return markdown_table(head, out)


def _ratio_text(check: dict[str, Any]) -> str:
    if check["actual_ratio"] is None:
        return "No ratio: pad-to-longest or packed did not finish (see the table)."
    text = (
        f"Packed / pad-to-longest real tokens/s: {check['actual_ratio']:.2f}x; ideal (ratio of fills) "
        f"{check['ideal_ratio']:.2f}x; {100 * check['fraction_of_ideal']:.0f}% of ideal (target >= 90%: "
        f"{_met(check['target_met'])}; pass by pass "
        f"{Stats(**check['paired_fraction_of_ideal']).fmt(0, 100)}%). Counting FLOPs instead of slots (images cost "
        f"the same in every layout), the ideal is {check['ideal_ratio_by_flops']:.2f}x, of which "
        f"{100 * check['fraction_of_flops_ideal']:.0f}% is reached."
    )
    if "decoder_only" in check:
        d = check["decoder_only"]
        text += (
            f" With the images encoded once beforehand (*decoder only*: the layout is then the only difference), "
            f"packed / pad-to-longest is {d['actual_ratio']:.2f}x, {100 * d['fraction_of_ideal']:.0f}% of the "
            f"ratio of fills (pass by pass {Stats(**d['paired_fraction_of_ideal']).fmt(0, 100)}%)."
        )
    return text


def _head_text(head: dict[str, Any]) -> str:
    return (
        f"LM head on the loss positions only (what training does) vs on every position: "
        f"{head['speedup']:.2f}x real tokens/s (pass by pass {Stats(**head['paired_speedup']).fmt(2)}x), "
        f"peak memory {head['peak_memory_mb']:.0f} vs {head['peak_memory_mb_head_everywhere']:.0f} MB."
    )


def backends_table(backends: list[dict[str, Any]]) -> str:
    rows = []
    for b in backends:
        if "unavailable" in b or "real_tokens_per_s" not in b:
            why = b.get("unavailable") or b.get("error") or "failed"
            rows.append([b["backend"], why[:90], "-", "-", "-", "-", "-"])
        else:
            rows.append([b["backend"], *_timing_cells(b), b["launches_per_step"] or "-"])
    head = ["backend", "real tokens/s", "step ms median", "p99", "peak MB", "MFU", "launches/step"]
    return markdown_table(head, rows)


# ------------------------------------------------------------------------------------------------------
# resume cost


def render_resume(result: ResumeResult) -> str:
    md = ["## Resume cost", ""]
    md.append(
        f"Time from {'DataModule construction (in-process, --quick)' if result.in_process else 'process start'} to "
        f"the first batch; epoch of {result.batches_per_epoch} batches, {result.workers} worker(s), data "
        f"{', '.join(result.data)}. Median [min-max] of {result.reps} runs, positions interleaved; each checks that "
        "its first batch is the batch at the restored position. "
        "*data s* = setup + restore + first batch (the part that could depend on the position)."
    )
    md += ["", resume_table(result.results)]
    md += [
        "",
        f"Late vs fresh (data s): {100 * result.growth:+.0f}% (target: no growth with position, within 25% or 0.1 s "
        f"of timer noise: {_met(result.target_met)}).",
    ]
    return "\n".join(md)


def render_tiles(result: TilesResult) -> str:
    lay = result.layout
    md = ["## Packing with image splitting", ""]
    md.append(
        f"Images split into <= {lay['max_tiles']} tiles of {lay['image_size']} px plus a global view, "
        f"{lay['tokens_per_tile']} tokens a tile (nanovlm/data/tiling.py); lengths and tile counts from image sizes "
        "alone. The image cap below counts tiles. Columns as in the packing section."
    )
    md.append("")
    for c in result.cells:
        notes = c["distribution"]
        md += [
            cell_table(c),
            "",
            f"(image sizes: {notes.get('image_sizes')}; {notes.get('tiles_mean', 0):.1f} tiles a sample)",
            "",
        ]
    return "\n".join(md)


def render_scale(result: ScaleResult) -> str:
    md = ["## Scale", ""]
    md.append(
        "Per process, before its first read, for 64 ranks x 8 workers and 8,192-token packs (synthetic index, "
        "1,000 shards, one image per sample). *first*: the index as the page cache holds it (read from disk when "
        "cold) and the length columns derived and saved into the node's cache; *again*: a second process, columns "
        "in the page cache, length columns mapped from the node's cache. *split s*: the epoch order, its cut into slots and the "
        "pack count (vectorised, in every process); *slot s*: a worker packing its own slot; *resumed*: the same "
        "for a worker halfway through the epoch; *elastic*: a half-consumed epoch resumed on 48 x 8 (the old slots' "
        "frontiers say what each left), then the worker's new slot. PSS from /proc/self/smaps_rollup after planning: *own* = "
        "anonymous pages, *mapped* = the index's and the length columns' file pages (shared by every process of a node); *worker* = "
        "a process forked from it that reads the length columns."
    )
    rows = []
    for r in result.rows:
        pss, worker = r["pss_mb"], r["worker_pss_mb"]
        elastic = f"{r['elastic_split_s']:.1f} + {r['elastic_slot_s']:.2f}" if "elastic_split_s" in r else "not run"
        rows.append(
            [f"{r['n']:,}", f"{r['open_s'] * 1e3:.0f} / {r['again']['open_s'] * 1e3:.0f}",
             f"{r['table_s']:.2f} / {r['again']['table_s']:.2f}", f"{r['split_s']:.2f}", f"{r['slot_s']:.2f}",
             f"{r['resume_split_s']:.2f} + {r['resume_slot_s']:.2f}", elastic,
             f"{pss.get('Pss_Anon', 0):.0f}", f"{pss.get('Pss_File', 0):.0f}", f"{worker.get('Pss_Anon', 0):.0f}",
             f"{r['peak_rss_mb']:.0f}", f"{r['index_bytes'] / 2**30:.2f}"]
        )  # fmt: skip
    headers = ["samples", "open ms (first / again)", "table s (first / again)", "split s", "slot s", "resumed s",
               "elastic s", "own PSS MB", "mapped PSS MB", "worker own PSS MB", "peak RSS MB", "index GiB"]  # fmt: skip
    md += ["", markdown_table(headers, rows)]
    md += ["", "Time to one worker's first batch through the DataModule (64 x 8; 48 x 8 after the elastic resume), on an "
           "index of the same size whose shards link to the demo data's real shards: setup (index, table) + the "
           "rank's split + the worker's slot packed and its first pack read, decoded, tokenized and collated. "
           "Imports excluded, page cache warm (a first process read the columns); *own PSS*: the process, torch and "
           "Lightning loaded.", ""]  # fmt: skip
    fb_rows = []
    for r in result.rows:
        for name, f in r.get("first_batch", {}).items():
            fb_rows.append([f"{r['n']:,}", name, f"{f['setup_s']:.2f}", f"{f['split_s']:.2f}", f"{f['first_pack_s']:.2f}",
                            f"{f['total_s']:.2f}", f"{f['pss_mb'].get('Pss_Anon', 0):.0f}"])  # fmt: skip
    fb_headers = ["samples", "resume", "setup s", "split s", "slot + first pack s", "first batch s", "own PSS MB"]
    md += [markdown_table(fb_headers, fb_rows)]
    if result.carry:
        n = f"{result.rows[0]['n']:,}" if result.rows else ""
        md += [
            "",
            f"Samples all 512 slots carry into the next epoch, epoch after epoch ({n} samples), and the fill of the packs:",
        ]
        c_rows = [
            [f"max_tokens={m}", *(f"{e['carried']:,} ({e['fill']:.2%} fill)" for e in per)]
            for m, per in result.carry.items()
        ]
        md += ["", markdown_table(["budget", *(f"after epoch {e['epoch']}" for e in next(iter(result.carry.values())))], c_rows)]  # fmt: skip
    p = result.prepare
    if p:
        md += ["", f"prepare_data index-only on {p['shards']} ({p['n_shards']} shards), per-shard work in one process: "
               f"{p['decode_samples_per_s']:.0f} samples/s per core decoding every image (`--image-check decode`), "
               f"{p['header_samples_per_s']:.0f} reading image headers only (`--image-check header`)."]  # fmt: skip
    return "\n".join(md)


def resume_table(results: dict[str, dict[str, Any]]) -> str:
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
    headers = [
        "start",
        "position (batches)",
        "total s",
        "data s",
        "imports s",
        "setup s",
        "load_state ms",
        "first batch s",
    ]
    return markdown_table(headers, rows)


# ------------------------------------------------------------------------------------------------------
# files


def _short(name: str) -> str:
    """Strategy label without its parameters, for plot legends."""
    return name.split(" (batch")[0]


def _is_flattening(row: dict[str, Any]) -> bool:
    return row["strategy"].startswith("DataCollatorWithFlattening")


def plot_fill(cells: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Grouped bars: fill of every strategy in every (distribution, budget) cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not cells:
        raise ValueError("no packing cells to plot")
    strategies: list[str] = []
    for c in cells:
        for r in c["rows"]:
            if _short(r["strategy"]) not in strategies:
                strategies.append(_short(r["strategy"]))
    labels = [
        f"{c['distribution']['name'].split('(')[0]}\nL={c['budget_tokens']}\nimages<={c['max_images']}" for c in cells
    ]
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(cells)), 5.0))
    cmap = plt.get_cmap("tab10")
    for k, s in enumerate(strategies):
        xs, ys = [], []
        for j, c in enumerate(cells):
            for r in c["rows"]:
                if _short(r["strategy"]) == s:
                    xs.append(j + (k - (len(strategies) - 1) / 2) * width)
                    # Padding-free flattening has no budget: plot its fill at the provisioned (peak) step size.
                    ys.append(100.0 * (r["fill_at_peak"] if _is_flattening(r) else r["fill"]))
        label = s + (" (at peak step)" if s.startswith("DataCollatorWithFlattening") else "")
        ax.bar(xs, ys, width, label=label, color=cmap(k % 10))
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("fill: real tokens / slots (%)")
    ax.set_ylim(0, 105)
    ax.axhline(99, color="grey", lw=0.6, ls="--")
    ax.set_title("Packing fill per strategy (higher is better; dashed line: 99%)")
    ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, -0.42))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def write_json(doc: dict[str, Any], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str))
    os.replace(tmp, out)
    return out


def _remote_source(result: dict) -> str:
    """The data and the readers of the remote and stream sections, as their reports open."""
    return (
        f"{result['samples']} samples in {result['shards']} shards ({result['dataset_bytes'] / 1e6:.1f} MB) from "
        f"{result['data']}, read by the DataModule with {result['plan']['workers']} workers"
    )


def render_remote(result: dict) -> str:
    plan = result["plan"]
    md = ["## Remote data: S3 on loopback with added latency", ""]
    md.append(
        f"{_remote_source(result)}: from local disk, and from moto's S3 server adding the latency to "
        f"every request with {plan['bandwidth_mb_s']:.0f} MB/s shared. Cold: cache emptied before the epoch; warm: the epoch after. One epoch per pass, timed from the "
        "loader's start to its last batch (*after 1st batch*: the rate after the first batch, and its ratio to the "
        "local one alike; *fetched by 1st "
        "batch*: the share of a cold epoch's bytes the store had sent by then), "
        f"in {plan['reps']} rounds (every loader cold, then warm, each round between two passes of "
        "every loader from local disk); *of local*: each pass against its loader's local rate at that moment, "
        "interpolated between the two (median [min-max]); *store CPU s*: CPU time of the S3 server's "
        "process during the pass (its own process; on the workers' cores unless the report says it is pinned); "
        "*wait s*: "
        "what the workers spent opening shards after each one's first batch, summed (fetching one, or waiting on "
        "its prefetch); *bytes/epoch* counts what the store sent (index included)."
    )
    md.append("")
    rows = []
    for r in result["rows"]:
        sps = r["samples_per_s"]
        sent = r["bytes_per_epoch"]
        rows.append(
            [
                r["name"],
                "" if r["prefetch"] is None else ("on" if r["prefetch"] else "off"),
                Stats(**sps).fmt(0),
                f"{Stats(**r['of_local']).fmt(1, 100)}%",
                f"{r['steady_samples_per_s']['median']:.0f} ({r['steady_of_local']['median'] * 100:.1f}%)",
                f"{r['first_batch_s']['median']:.2f}",
                "" if sent is None else f"{r['by_first_batch']['median'] * 100:.0f}%",
                f"{r['store_cpu_s']['median']:.2f}",
                "" if r["latency_ms"] is None else f"{r['wait_s']['median']:.2f}",
                "" if sent is None else f"{sent / result['dataset_bytes']:.3f}",
            ]
        )
    md.append(
        markdown_table(
            [
                "source",
                "prefetch",
                "samples/s",
                "of local",
                "after 1st batch",
                "first batch s",
                "fetched by 1st batch",
                "store CPU s",
                "wait s",
                "bytes/epoch / dataset",
            ],
            rows,
        )
    )
    if "transfer" in result:
        md += ["", render_transfer(result)]
    if "peers" in result:
        md += ["", render_peers(result)]
    return "\n".join(md)


def render_ranges(result: dict) -> str:
    plan = result["plan"]
    md = ["## Remote data: whole shards or byte ranges", ""]
    md.append(
        f"Samples of one shard ({result['samples_per_shard']} samples) of {result['data']} from moto's S3 server "
        f"adding the latency to every request with {plan['bandwidth_mb_s']:.0f} MB/s shared: all of them, or a few "
        "at random places, by one GET of the whole shard (the shard cache's transfer) or by one ranged GET per "
        f"sample ({plan['connections']} in flight). {plan['reps']} shards per row, median [min-max]; *client* and "
        "*store CPU*: the reading process's and the store process's CPU time per sample read; *bytes / samples'*: "
        "the body bytes the store sent over the bytes of the samples read."
    )
    md.append("")
    rows = [
        [
            f"+{r['latency_ms']} ms",
            r["read"],
            r["how"],
            str(r["requests"]),
            Stats(**r["wall_s"]).fmt(3),
            Stats(**r["samples_per_s"]).fmt(0),
            Stats(**r["client_cpu_ms_per_sample"]).fmt(3),
            Stats(**r["store_cpu_ms_per_sample"]).fmt(3),
            f"{r['bytes_over_samples']['median']:.2f}",
        ]
        for r in result["rows"]
    ]
    headers = ["latency", "samples read", "how", "requests", "wall s", "samples/s", "client CPU ms/sample"]
    md.append(markdown_table(headers + ["store CPU ms/sample", "bytes / samples'"], rows))
    return "\n".join(md)


def render_stream(result: dict) -> str:
    plan = result["plan"]
    md = ["## Remote data through a small cache, as a training run streams it", ""]
    md.append(
        f"{_remote_source(result)} from moto's S3 server adding the latency to every request with {plan['bandwidth_mb_s']:.0f} MB/s shared, through a cache "
        f"of {plan['shards_per_worker']} shards per worker ({result['cache_bytes']['small'] / 1e6:.1f} MB), so every "
        "epoch fetches the dataset again, or one that holds all of it, so every epoch after the first reads staged "
        f"copies. {plan['epochs']} epochs per pass from one loader (its workers carry on across "
        "epoch ends, as in training), timed from the end of the first epoch to the end of the last; "
        f"{plan['reps']} rounds, each remote pass between two local ones. *of local*: against the mean of those "
        "two; *wait s*: what the workers spent opening shards in the timed epochs, summed; *bytes/epoch*: what "
        "the store sent per timed epoch; *store CPU s*: the CPU time of the store's process (moto's server; on the "
        "loader's cores unless the report says it is pinned) per timed epoch. *control*: the small cache with every "
        "shard staged by a copy from local disk instead of a fetch (the index still from S3): the cache's own work, "
        "without the transfer and the store. "
        "*loader* and *machine CPU ms/sample*: CPU time per sample read in the timed epochs, of this process and "
        "its DataLoader workers, and of everything the machine ran (the store's process and the kernel included). "
        "Median [min-max]."
    )
    md.append("")
    rows = []
    for r in result["rows"]:
        remote = r["latency_ms"] is not None
        rows.append(
            [
                r["name"],
                Stats(**r["samples_per_s"]).fmt(0),
                f"{Stats(**r['of_local']).fmt(1, 100)}%" if remote else "",
                Stats(**r["wait_s"]).fmt(2) if remote else "",
                Stats(**r["bytes_per_epoch"]).fmt(3) if remote else "",
                Stats(**r["store_cpu_s"]).fmt(2) if remote else "",
                *(Stats(**r[k]).fmt(3) if k in r else "n/a" for k in ("loader_cpu_ms", "machine_cpu_ms")),
            ]
        )
    head = ["source", "samples/s", "of local", "wait s", "bytes/epoch / dataset", "store CPU s"]
    head += ["loader CPU ms/sample", "machine CPU ms/sample"]
    md.append(markdown_table(head, rows))
    return "\n".join(md)


def render_transfer(result: dict) -> str:
    """The CPU a reader's process spends receiving: s3fs's own transfer against the presigned GET."""
    t = result["transfer"]
    md = ["### The transfer", ""]
    md.append(
        "CPU time of a fresh process forked after s3fs was imported (as a DataLoader worker is forked from a "
        f"trainer that has read its index over S3) fetching {t['shards']} shards one after another "
        f"({result['dataset_bytes'] / result['shards'] / 1e6:.1f} MB each), then one {t['big_bytes'] / 1e6:.0f} MB "
        f"object, straight from the S3 server; {result['plan']['reps']} processes each, median [min-max]. *first "
        "fetch*: includes the process's own client set-up."
    )
    md.append("")
    rows = [
        [how, Stats(**r["first_ms"]).fmt(0), Stats(**r["shard_ms"]).fmt(1), Stats(**r["mb_ms"]).fmt(2)]
        for how, r in t["rows"].items()
    ]
    md.append(markdown_table(["transfer", "first fetch ms", "ms per further shard", "ms per MB (large object)"], rows))
    return "\n".join(md)


def render_peers(result: dict) -> str:
    """Ours (prefetch on) beside megatron-energon and LitData, row by row, in samples/s."""
    peers = result["peers"]
    names = list(peers["prepared"])
    md = ["### Beside the peers", ""]
    if peers["missing"]:
        md += [f"Not installed here, so not measured: {', '.join(peers['missing'])}.", ""]
    if not names:
        return "\n".join(md)
    md.append(
        "The same shards and per-sample work (members parsed, images decoded and resized, text tokenized, in the "
        "workers: `SampleProcessor.process`), each peer after its own preparation step, batches of 32 samples "
        f"collated in the workers; {result['plan']['reps']} rounds, as for ours (medians; *of local*: against "
        "that loader's local rate, interpolated alike). megatron-energon reads S3 through multi-storage-client (its "
        "cache on for cold and warm), LitData through its own chunk cache. *bytes/epoch*: what the store sent in "
        "the cold epoch, against that loader's own dataset size; *store CPU*: the store process's CPU seconds in "
        "the cold epoch (what this loader's requests cost it). *ours / peer*: our pass over "
        "the peer's pass of the same row and round, seconds apart (median [min-max] over the rounds)."
    )
    md.append("")
    ours = {r["name"]: r for r in result["rows"] if r["prefetch"] in (True, None)}
    theirs = {r["name"]: r for r in peers["rows"]}
    prep = {n: f"{peers['prepared'][n]['seconds']:.1f} s, {peers['prepared'][n]['bytes'] / 1e6:.0f} MB" for n in names}
    rows = [["preparation", "(prepare_data: the index)", *(c for n in names for c in (prep[n], ""))]]

    def cell(r: dict, size: float) -> str:
        sent = r["bytes_per_epoch"]
        text = f"{r['samples_per_s']['median']:.0f} ({r['of_local']['median'] * 100:.0f}%"
        return text + ("" if sent is None else f", {sent / size:.2f}x, {r['store_cpu_s']['median']:.2f} s") + ")"

    def paired(mine: dict, peer: dict) -> str:
        return Stats.of([a / b for a, b in zip(mine["runs"], peer["runs"], strict=True)]).fmt(2)

    for name in ours:
        cells = [name, cell(ours[name], result["dataset_bytes"])]
        for n in names:
            r = theirs.get(f"{n}: {name}")
            cells += ["", ""] if r is None else [cell(r, peers["prepared"][n]["bytes"]), paired(ours[name], r)]
        rows.append(cells)
    what = "samples/s (of local, bytes/epoch, store CPU)"
    heads = [h for n in names for h in (f"{n}, {what}", f"ours / {n}")]
    md.append(markdown_table(["source", f"ours, {what}", *heads], rows))
    md += ["", _first_batches(ours, theirs, names)]
    return "\n".join(md)


def _first_batches(ours: dict, theirs: dict, names: list[str]) -> str:
    """The cold rows' first batches: when each loader's first batch came, the share of the epoch's bytes fetched
    by then, and the rate after it (what a rate that leaves the first batch out would show)."""
    md = [
        "Cold epochs up to their first batch, medians: seconds to the first batch / share of the epoch's bytes "
        "fetched by then / samples/s after it.",
        "",
    ]

    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        share = r["by_first_batch"]["median"] * 100
        return f"{r['first_batch_s']['median']:.2f} s / {share:.0f}% / {r['steady_samples_per_s']['median']:.0f}"

    cold = [name for name, r in ours.items() if r["cold"]]
    rows = [[name, cell(ours[name]), *(cell(theirs.get(f"{n}: {name}")) for n in names)] for name in cold]
    return "\n".join([*md, markdown_table(["source", "ours", *names], rows)])


def render_decode(result: dict) -> str:
    md = ["## JPEG decode: in a worker vs on the device (data.image_decode)", ""]
    md.append(
        f"{result['images']} JPEGs ({result['source']}) to {result['image_size']} px. *worker*: Pillow with draft "
        f"scaling and bicubic resize, one image at a time on one core; *device*: {result['decoder']} on "
        f"{result['device']}, packs of {result['pack_images']} images, at most {result['decode_chunk']} per call, "
        "antialiased bicubic resize on the device. *host CPU*: the process's CPU time per image."
    )
    md.append("")
    rows = [[r["path"], f"{r['images_per_s']:.0f}", f"{r['host_cpu_ms_per_image']:.2f}"] for r in result["rows"]]
    md.append(markdown_table(["path", "images/s", "host CPU ms/image"], rows))
    d = result["pixel_diff_vs_worker_no_draft"]
    md.append("")
    md.append(
        f"Pixels of the device path against the worker path without draft scaling: mean |diff| {d['mean']:.2f}, "
        f"max {d['max']:.0f} (of 255); batches that fell back to Pillow: {result['fallbacks']}."
    )
    return "\n".join(md)
