"""Training throughput: the same samples and the same model, laid out three ways.

The samples are read and processed once (the data pipeline is measured on its own in ``benchmarks/pipeline.py``),
then batched by

- ``packed``: ``pack_online`` + ``collate_packed`` -> [1, L] rows with cu_seqlens (varlen attention);
- ``pad_to_longest``: ``B`` consecutive samples padded to the longest -> [B, longest] with attention_mask;
- ``constrained``: ``B`` samples, those above a cutoff dropped, padded to the cutoff -> [B, cutoff].

``B = round(L / mean sample length)``, so a padded step holds as many real tokens on average as a pack.
Each mode trains a freshly seeded copy of the model (forward + backward + AdamW step), warm-up steps
excluded, over the same batch list ``reps`` times. Reported: real (non-padding) tokens/s, step time
median and p99, peak memory, and the ratio check: packed tokens/s over pad-to-longest tokens/s should
reach at least 90% of the ideal ratio fill(packed) / fill(pad-to-longest).

Every mode trains as training does, with the LM head on the loss positions only; one more packed mode runs it
on every position, to show what that saves.

Every layout runs the same images through the vision encoder, so that cost does not shrink with the fill.
The *decoder only* runs of packed and pad-to-longest isolate the layout: their images are encoded once
before timing (``inputs_embeds``), and each step trains the decoder alone on those embeddings.

On ``--device cuda`` the model is the ``--preset`` (default model_222m.yaml) in bf16, and the packed mode is
repeated for every available attention backend, with MFU.

``--compile-step`` adds the packed layout as static packs (``data.static_shapes``: one set of tensor shapes for every
step), trained eager and with ``trainer.compile=step`` (``strategies.compile_step``: forward + backward as one graph;
on CUDA replayed as a CUDA graph). Compilation happens in the untimed warm-up. Every packed row also gets the host
vs device time of a whole step from a short profile: an eager GPU step of a small model is bound by the host issuing
kernels, which is what the compiled step is meant to remove. ``--train-modes`` picks the other rows, so that a
short GPU run (``scripts/gpu_check.sh``) times only what it compares.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import Stats, percentile, proc_mb, reset_peak_rss
from benchmarks.workloads import data_config, demo_dirs, sample_refs
from nanovlm.config import Config, image_token_count, load_config
from nanovlm.constants import IMAGE_TOKEN


def load_samples(cfg: Config, tokenizer, n: int) -> list:
    """The first ``n`` processable samples of the dataset (over-length ones dropped, as training does)."""
    from nanovlm.data.format import SampleError
    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.reader import ShardReader

    proc = SampleProcessor.from_config(tokenizer, cfg.model, cfg.data)
    reader = ShardReader()
    out = []
    for path, off, nb, k in sample_refs(list(cfg.data.train)):
        try:
            out.append(proc.process(reader.read(path, off, nb, k), cfg.data.max_tokens, "drop"))
        except SampleError:
            continue
        if len(out) >= n:
            reader.close()
            return out
    reader.close()
    return out


def make_batches(
    samples: list, cfg: Config, pad_id: int, image_token_id: int | None = None
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Batches of every mode over the same samples, and the layout parameters used. With ``image_token_id``, also
    the packed plan as static packs (``STATIC``, see ``static_packs``)."""
    from nanovlm.data import packing
    from nanovlm.data.collate import collate_packed, collate_padded

    L, size = cfg.data.max_tokens, cfg.model.vision.image_size
    lengths = [int(s.input_ids.numel()) for s in samples]
    n_img = [int(s.pixel_values.shape[0]) for s in samples]
    B = max(1, round(L / statistics.mean(lengths)))
    cutoff = cfg.data.pad_cutoff or min(L, int(math.ceil(sorted(lengths)[int(0.95 * (len(lengths) - 1))] / 64) * 64))
    packed = packing.pack_online(lengths, n_img, L, cfg.data.max_images, cfg.data.lookahead, cfg.data.max_carry)
    ptl = packing.pad_to_longest(lengths, n_img, B, L)
    con = packing.constrained(lengths, n_img, B, cutoff)
    out = {
        "packed": [collate_packed([samples[i] for i in p], L, pad_id, size) for p in packed.packs if p],
        "pad_to_longest": [collate_padded([samples[i] for i in p], pad_id, size) for p in ptl.packs if p],
        "constrained": [
            _pad_to(collate_padded([samples[i] for i in p], pad_id, size), cutoff, pad_id) for p in con.packs if p
        ],
    }
    layout = {"batch_size": B, "cutoff": cutoff, "samples": len(samples), "max_tokens": L}
    if image_token_id is not None:
        out[STATIC], layout["static"] = static_packs(samples, packed.packs, cfg, pad_id, image_token_id)
    return out, layout


STATIC = "packed/static"  # the batches of the static rows: the packed plan laid out with one set of shapes


def static_packs(
    samples: list, packs: list[list[int]], cfg: Config, pad_id: int, image_token_id: int
) -> tuple[list[dict], dict[str, Any]]:
    """The packs of ``packs`` as static packs, and their layout (segments, image slots, mean images per pack).

    Segments come from the samples' lengths as training computes them (``StaticLayout.for_lengths``). The image
    slots are the most images any pack of this plan holds, the value ``data.max_images`` is meant to be set to for
    static packs (docs/performance.md); the plan stays as it is, since no pack exceeds it. The section's own image
    cap is raised so that the token budget binds (``train_config``): as many slots would make every step encode
    mostly blank images, a cost of the setting, not of static shapes.
    """
    from nanovlm.data.collate import StaticLayout, collate_packed

    L, size = cfg.data.max_tokens, cfg.model.vision.image_size
    packs = [p for p in packs if p]
    images = [sum(int(samples[i].pixel_values.shape[0]) for i in p) for p in packs]
    lengths = np.array([int(s.input_ids.numel()) for s in samples])
    static = StaticLayout.for_lengths(
        lengths, L, max(1, max(images, default=0)), image_token_id, image_token_count(cfg.model)
    )
    batches = [collate_packed([samples[i] for i in p], L, pad_id, size, static=static) for p in packs]
    info = {
        "segments": static.segments,
        "image_slots": static.image_slots,
        "images_per_pack_mean": statistics.mean(images) if images else 0.0,
    }
    return batches, info


def _pad_to(batch: dict, width: int, pad_id: int) -> dict:
    """Right-pad a [B, l] padded batch to [B, width] (constrained padding pads every row to the cutoff)."""
    extra = width - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    batch["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=pad_id)
    batch["labels"] = F.pad(batch["labels"], (0, extra), value=-100)
    batch["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
    batch["position_ids"] = F.pad(batch["position_ids"], (0, extra), value=0)
    batch["meta"]["slots"] = int(batch["input_ids"].numel())
    return batch


def _to(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _fill(batches: list[dict]) -> float:
    return sum(b["meta"]["real_tokens"] for b in batches) / max(1, sum(b["meta"]["slots"] for b in batches))


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


FIRST_LOSSES = 3  # warm-up losses recorded per runner


class ModeRunner:
    """One layout (or attention backend, or static packs eager or compiled): its own freshly seeded model and
    optimizer, and its batches.

    Runners are timed interleaved (pass 1 of every mode, then pass 2, ...), so a burst of load from
    elsewhere on the machine hits every mode alike instead of one mode's whole measurement.
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        tokenizer,
        batches: list[dict],
        device: torch.device,
        seed: int,
        compile_blocks: bool = False,
        decoder_only: bool = False,
        head_everywhere: bool = False,
        whole_step: bool = False,
        compile_backend: str = "inductor",
        cuda_graphs: bool = True,
    ):
        from nanovlm.model import build_model
        from nanovlm.train.strategies import apply_compile, compile_step

        self.name, self.batches, self.device, self.whole_step = name, batches, device, whole_step
        # as training does: the LM head on the loss positions only (unless comparing with the head everywhere)
        self.return_logits = head_everywhere
        torch.manual_seed(seed)
        self.model = build_model(cfg.model, tokenizer).to(device)
        if compile_blocks:  # as trainer.compile does; compilation happens in the (untimed) warm-up
            apply_compile(self.model)
        if whole_step:  # trainer.compile=step, for static packs: the first warm-up step compiles
            compile_step(self.model, device, backend=compile_backend, cuda_graphs=cuda_graphs)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.dev_batches = [_to(b, device) for b in batches]
        if decoder_only:  # images encoded once, up front: each step trains the decoder on fixed embeddings
            for b in self.dev_batches:
                with torch.no_grad(), self._autocast():
                    b["inputs_embeds"] = self.model.embed(b["input_ids"], b.get("pixel_values"))
        self.tokens = sum(b["meta"]["real_tokens"] for b in batches)
        self.rates: list[float] = []
        self.step_ms: list[float] = []
        self.issue_ms: list[float] = []  # host time until a step's last launch returns (before the sync)
        self.peak_extra_mb = 0.0
        self.first_step_s: float | None = None  # the first warm-up step: compilation, CUDA-graph warm-up, autotuning
        self.first_losses: list[float] = []  # of the first warm-up steps: runners of the same packs must agree
        self.launches: int | None = None
        self.profile: dict[str, Any] | None = None
        self.aux_errors: list[str] = []  # launch count or profile that failed (the timings stand)
        self.compiles: dict[str, int] = {}  # torch.compile's counters over this runner's steps (compile_counters)
        self.error: str | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _fwd_bwd(self, b: dict) -> torch.Tensor:
        if self.whole_step:  # as training_step does: a new step, so CUDA graphs may reuse the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast():
            loss = self.model(b, return_logits=self.return_logits)["loss"]
        loss.backward()
        return loss.detach()

    def step(self, b: dict) -> torch.Tensor:
        """One training step; its loss (with CUDA graphs, valid until the next step replays the graph)."""
        loss = self._fwd_bwd(b)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def warmup(self, n_steps: int) -> None:
        """Warm-up steps (not timed); the peak memory above the resting level is measured here, and the first
        step's time (compilation) and first losses are recorded. A compiled step gets at least 3: compile, CUDA
        graph warm-up, recording."""
        if self.error:
            return
        n_steps = max(n_steps, 3) if self.whole_step else n_steps
        before = compile_counters()
        try:
            self._sync()
            if self.device.type == "cuda":
                base = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            else:  # give freed heap back to the OS first, or this mode would reuse the previous mode's peak
                _malloc_trim()
                reset_peak_rss()
                base = proc_mb("self", "VmRSS") * 2**20
            for i in range(n_steps):
                t0 = time.perf_counter()
                loss = self.step(self.dev_batches[i % len(self.dev_batches)])
                if i < FIRST_LOSSES:
                    self.first_losses.append(float(loss))  # a host sync: fine, nothing here is timed
                if i == 0:
                    self.first_step_s = time.perf_counter() - t0
            self._sync()
            peak = (
                torch.cuda.max_memory_allocated(self.device)
                if self.device.type == "cuda"
                else proc_mb("self", "VmHWM") * 2**20
            )
            self.peak_extra_mb = max(0.0, (peak - base) / 2**20)
        except torch.OutOfMemoryError as e:
            self._fail(e)
        except Exception as e:  # compiling the whole step (a graph break under fullgraph, a compiler error) fails
            if not self.whole_step:  # in its own row, not the section: the other rows are still measured
                raise
            self._fail(e, f"compile failed ({type(e).__name__})")
        finally:
            self._count_compiles(before)

    def _count_compiles(self, before: dict[str, int]) -> None:
        """Add torch.compile's counters since ``before`` to this runner's: runners run one at a time, so the
        difference over its own warm-up and passes is its own compilations (a recompilation would show here)."""
        for k, v in compile_counters().items():
            self.compiles[k] = self.compiles.get(k, 0) + v - before[k]

    def measure_launches(self) -> None:
        """Kernels launched by forward + backward of the first batch (see ``count_launches``)."""
        if self.error:
            return
        b = self.dev_batches[0]

        def fwd_bwd() -> None:
            self._fwd_bwd(b)
            self._sync()

        try:
            self.launches = count_launches(fwd_bwd, self.device)
        except Exception as e:  # e.g. the profiler around a CUDA-graph replay: the timings stand without it
            self.aux_errors.append(f"launch count: {type(e).__name__}: {str(e)[:160]}")
        self.opt.zero_grad(set_to_none=True)

    def profile_steps(self, n_steps: int) -> None:
        """Host vs device time of whole steps (forward, backward, optimizer; see ``step_profile``), after the
        timed passes, so that compilation and CUDA-graph recording are behind it."""
        if self.error:
            return

        def steps() -> None:
            for i in range(n_steps):
                self.step(self.dev_batches[i % len(self.dev_batches)])
            self._sync()

        try:
            self.profile = step_profile(steps, n_steps, self.device)
        except torch.OutOfMemoryError as e:
            self._fail(e)
        except Exception as e:  # as in measure_launches: an auxiliary figure, reported missing with the reason
            self.aux_errors.append(f"profile: {type(e).__name__}: {str(e)[:160]}")

    def timed_pass(self) -> None:
        if self.error:
            return
        before = compile_counters()
        try:
            t_pass = time.perf_counter()
            for b in self.dev_batches:
                t0 = time.perf_counter()
                self.step(b)
                t_issued = time.perf_counter()
                self._sync()
                self.step_ms.append((time.perf_counter() - t0) * 1e3)
                self.issue_ms.append((t_issued - t0) * 1e3)
            self.rates.append(self.tokens / (time.perf_counter() - t_pass))
        except torch.OutOfMemoryError as e:
            self._fail(e)
        finally:
            self._count_compiles(before)

    def _fail(self, e: BaseException, what: str = "out of memory") -> None:
        self.error = f"{what}: " + (str(e).strip().splitlines() or [""])[0][:120]
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self) -> None:
        del self.model, self.opt, self.dev_batches
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps_per_pass": len(self.batches),
            "real_tokens_per_pass": self.tokens,
            "fill": _fill(self.batches),
            "error": self.error,
            "launches_per_step": self.launches,
            "first_step_s": self.first_step_s,
            "first_losses": self.first_losses,
        }
        if self.profile is not None:
            out["profile"] = self.profile
        if self.aux_errors:
            out["aux_errors"] = self.aux_errors
        if self.whole_step or any(self.compiles.values()):
            out["compile_counters"] = self.compiles
        if self.rates:
            out.update(
                real_tokens_per_s=Stats.of(self.rates).to_dict(),
                step_ms_median=percentile(self.step_ms, 50),
                step_ms_p99=percentile(self.step_ms, 99),
                peak_memory_mb=self.peak_extra_mb,
                peak_memory_kind="cuda peak allocated above resting (activations, grads, temporaries)"
                if self.device.type == "cuda"
                else "process peak RSS above resting",
            )
            if self.device.type == "cuda":  # on CPU the host computes the step: this would equal the step time
                out["host_issue_ms_median"] = percentile(self.issue_ms, 50)
        return out


# aten ops that only make views or read metadata: no kernel of their own (a copying ``to``/``contiguous`` counts)
_NO_KERNEL = frozenset(
    "aten::" + n
    for n in (  # noqa: SIM905 (a word list)
        "view view_as _unsafe_view reshape _reshape_alias t transpose permute as_strided unsqueeze squeeze expand "
        "expand_as slice select narrow split split_with_sizes chunk unbind unflatten flatten alias detach "
        "lift_fresh resolve_conj resolve_neg result_type empty empty_strided empty_like to _to_copy contiguous "
        "clone item _local_scalar_dense is_nonzero size stride numel dim"
    ).split()
)


def count_launches(fn, device: torch.device) -> int:
    """Kernels one call of ``fn`` launches: on CUDA the device kernels and copies the profiler records; on CPU a
    proxy, the aten ops dispatched at top level (not from inside another aten op) that compute or copy.

    An eager GPU step of a small model is bound by the host issuing kernels, so this count is what fusions cut.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == DeviceType.CUDA)

    def copies(e) -> bool:
        return any(c.name in ("aten::copy_", "aten::_to_copy", "aten::fill_") or copies(c) for c in e.cpu_children)

    def top_level(e) -> bool:
        return e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")

    return sum(
        1 for e in events if e.name.startswith("aten::") and top_level(e) and (e.name not in _NO_KERNEL or copies(e))
    )


def compile_counters() -> dict[str, int]:
    """torch.compile's process-wide counters: graphs compiled, graph breaks, and CUDA-graph skips (a compiled step
    that inductor could not put in a CUDA graph runs, silently, without one: this says so). ``ModeRunner`` keeps
    the difference over its own steps."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


def step_profile(steps, n_steps: int, device: torch.device) -> dict[str, Any]:
    """Per step of ``steps`` (which runs ``n_steps`` steps and syncs), from one ``torch.profiler`` pass:

    - ``host_ms``: the self time of every op and runtime call recorded on the host (all threads): what issuing the
      step costs the CPU (on CPU it also computes it), inflated a little by the profiler's own bookkeeping;
    - ``device_ms`` (CUDA): the summed durations of the GPU kernels, copies and memsets;
    - ``device_events`` (CUDA): how many of those ran (kernels inside a CUDA graph included).

    A step whose host time exceeds its device time is host-bound: the GPU waits for launches (docs/performance.md:
    an eager 222M step on an H200 had 136 ms of host time behind 93 ms of kernels).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        steps()
    events = prof.events()
    host_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
    on_device = [e for e in events if e.device_type == DeviceType.CUDA] if cuda else []
    out: dict[str, Any] = {"steps": n_steps, "host_ms": host_us / 1e3 / n_steps, "device_ms": None}
    if cuda:
        out["device_ms"] = sum(e.time_range.elapsed_us() for e in on_device) / 1e3 / n_steps
        out["device_events"] = len(on_device) / n_steps
    return out


def run_interleaved(runners: list[ModeRunner], reps: int, warmup: int, log=print) -> None:
    for r in runners:
        log(f"[train] warm-up {r.name}: {warmup} steps")
        r.warmup(warmup)
    for i in range(reps):
        log(f"[train] pass {i + 1}/{reps}: " + ", ".join(f"{r.name} ({len(r.batches)} steps)" for r in runners))
        for r in runners:
            r.timed_pass()


def _layout_ratio(a: ModeRunner, b: ModeRunner, ideal: float) -> dict[str, Any] | None:
    """``a``'s real tokens/s over ``b``'s (medians), as a fraction of ``ideal`` too; None when either failed.

    Also pass by pass: pass i of ``a`` over pass i of ``b``, which ran right after it, so a burst of load on
    the machine moves both and largely cancels (median and spread of the passes)."""
    if not a.rates or not b.rates:
        return None
    actual = statistics.median(a.rates) / statistics.median(b.rates)
    return {
        "actual_ratio": actual,
        "fraction_of_ideal": actual / ideal,
        "paired_fraction_of_ideal": Stats.of([x / y / ideal for x, y in zip(a.rates, b.rates)]).to_dict(),
    }


HEAD_EVERYWHERE = "packed, LM head on every position"


def _head_saving(ours: ModeRunner, everywhere: ModeRunner) -> dict[str, Any] | None:
    """Packed training with the LM head on the loss positions only vs on every position (median tokens/s)."""
    if not ours.rates or not everywhere.rates:
        return None
    return {
        "speedup": statistics.median(ours.rates) / statistics.median(everywhere.rates),
        "paired_speedup": Stats.of([a / b for a, b in zip(ours.rates, everywhere.rates)]).to_dict(),
        "peak_memory_mb": ours.peak_extra_mb,
        "peak_memory_mb_head_everywhere": everywhere.peak_extra_mb,
    }


def pass_flops(cfg: Config, vocab: int, batches: list[dict]) -> float:
    """Training FLOPs of one pass as the model computes it: every slot (padding included) through the decoder
    blocks, the loss positions through the LM head, every image through the vision encoder. Used for an ideal
    ratio that accounts for the costs that do not depend on the layout (images, LM head)."""
    from nanovlm.model import flops_per_image, flops_per_token

    total = 0.0
    per_image = flops_per_image(cfg.model)
    for b in batches:
        if "cu_seqlens" in b:  # packed: a token attends within its own segment
            cu = b["cu_seqlens"].tolist()
            segs = [e - a for a, e in zip(cu[:-1], cu[1:])]
            seq = sum(x * x for x in segs) / max(1, sum(segs))
        else:  # padded rows: every position of the row is computed
            seq = float(b["input_ids"].shape[1])
        slots = b["input_ids"].numel()
        head = b["meta"]["loss_tokens"] / slots  # the LM head runs on the loss positions only
        total += flops_per_token(cfg.model, vocab, seq, head_fraction=head) * slots + per_image * b["meta"]["n_images"]
    return total


def _mfu(cfg: Config, vocab: int, batches: list[dict], tokens_per_s: float, device: torch.device) -> float | None:
    """MFU of a pass at ``tokens_per_s`` real tokens/s, by the training telemetry's formula (``batch_flops``)."""
    from nanovlm.model import batch_flops
    from nanovlm.train.callbacks import batch_stats, peak_tflops

    peak = peak_tflops(cfg.trainer.peak_tflops, device)
    if not peak:
        return None
    stats = [batch_stats(b) for b in batches]
    tokens, seq_sq, images, head = (
        sum(st[k] for st in stats) for k in ("real_tokens", "seq_sq", "images", "loss_tokens")
    )
    flops = batch_flops(cfg.model, vocab, tokens, seq_sq, images, head)
    return flops / max(1, tokens) * tokens_per_s / (peak * 1e12)


# ------------------------------------------------------------------------------------------------------
# the section

LAYOUTS = ("packed", "pad_to_longest", "constrained")
DECODER_ONLY = ("packed", "pad_to_longest")  # the layouts also timed with the images encoded beforehand
# --train-modes: the layouts, the LM head on every position (HEAD_EVERYWHERE), the decoder-only runs (DECODER_ONLY)
TRAIN_MODES = (*LAYOUTS, "head_everywhere", "decoder_only")
PROFILE_STEPS = 2  # whole steps per packed runner in the host vs device profile


@dataclass
class TrainResult:
    """What the train section measured, and the setting its report states."""

    device: torch.device
    parameters: int
    layout: dict[str, Any]  # B, cutoff, samples, max_tokens (and the static layout with --compile-step)
    modes: dict[str, dict[str, Any]]  # per layout: fill, tokens/s, step times, peak memory (MFU for packed)
    backends: list[dict[str, Any]]  # per attention backend (packed), or why it is unavailable
    ratio_check: dict[str, Any] | None  # None when --train-modes leaves packed or pad_to_longest out
    loss_position_head: dict[str, Any] | None
    model_label: str  # the preset, or the last config file
    attn_backend: str
    compiled: bool  # --compile: compiled blocks
    compile_step: bool  # --compile-step: the static rows, eager and compiled
    compile_backend: str  # --compile-backend of the compiled step
    reps: int
    warmup: int

    def to_json(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "parameters": self.parameters,
            "layout": self.layout,
            "modes": self.modes,
            "backends": self.backends,
            "ratio_check": self.ratio_check,
            "loss_position_head": self.loss_position_head,
            "compile_step": self.compile_step,
            "compile_backend": self.compile_backend if self.compile_step else None,
        }


def train_device(args: argparse.Namespace) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    return device


def train_config(args: argparse.Namespace, device: torch.device) -> tuple[Config, str]:
    """The config the section trains with, and the model preset on top of it ("" for none)."""
    preset = args.preset or ("model_222m.yaml" if device.type == "cuda" else "")
    cfg = data_config(args, 0, with_budget=not preset)  # with a preset, --budget applies to the preset's model
    if not args.data:
        demo_dirs(cfg)
    if preset:  # a larger model on the same data (the default on cuda)
        files = [*(args.config or ["tiny_cpu.yaml"]), preset]
        ov = [f"data.train=[{','.join(cfg.data.train)}]", f"data.tokenizer={cfg.data.tokenizer}", "data.val=[]"]
        L = args.budget or (8192 if device.type == "cuda" else cfg.data.max_tokens)
        ov += [f"data.max_tokens={L}", "data.make_demo_if_missing=false"]
        if device.type == "cuda":
            ov.append("model.attn_backend=auto")
        cfg = load_config(files, [*ov, *args.set])
    # One factor at a time: the layout. The image cap is raised so that the token budget is what binds
    # (the packing section measures the image cap on its own).
    itc = image_token_count(cfg.model)
    cfg.data.max_images = max(cfg.data.max_images, cfg.data.max_tokens // max(1, itc // 2))
    return cfg, preset


def parse_train_modes(text: str) -> tuple[str, ...]:
    """``--train-modes``: the rows besides the backends and static ones, as a tuple of ``TRAIN_MODES`` ("all": every
    one, "none": none of them). A ValueError names what is wrong."""
    text = text.strip()
    if text in ("", "all"):
        return TRAIN_MODES
    if text == "none":
        return ()
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))  # in order, once each
    bad = [m for m in modes if m not in TRAIN_MODES]
    if bad:
        raise ValueError(f"unknown --train-modes {bad}; choose from {list(TRAIN_MODES)}, 'all' or 'none'")
    return modes


def layout_runners(
    cfg: Config, tokenizer, batches: dict[str, list[dict]], device: torch.device, args: argparse.Namespace
) -> list[ModeRunner]:
    """The layouts, the LM head on every position, and the decoder-only runs that ``--train-modes`` names, in
    report order."""
    modes = parse_train_modes(args.train_modes)
    runners = [
        ModeRunner(m, cfg, tokenizer, batches[m], device, args.seed, args.compile) for m in LAYOUTS if m in modes
    ]
    # The LM head on every position, as a model without loss-position logits computes it (training runs it on
    # the loss positions only): what that saves, in time and memory
    if "head_everywhere" in modes:
        runners.append(
            ModeRunner(
                HEAD_EVERYWHERE,
                cfg,
                tokenizer,
                batches["packed"],
                device,
                args.seed,
                args.compile,
                head_everywhere=True,
            )
        )
    # One factor at a time, again: the images encoded once beforehand, so that the layout is the only difference
    if "decoder_only" in modes:
        runners += [
            ModeRunner(f"{m} (decoder only)", cfg, tokenizer, batches[m], device, args.seed, args.compile, True)
            for m in DECODER_ONLY
        ]
    return runners


STATIC_EAGER, STATIC_COMPILED = "packed/static eager", "packed/static compiled step"
STATIC_NO_GRAPHS = "packed/static compiled step, no CUDA graphs"


def static_runners(
    cfg: Config, tokenizer, static: list[dict], device: torch.device, args: argparse.Namespace
) -> list[ModeRunner]:
    """``--compile-step``: the packed plan as static packs, eager and with ``compile_step`` (trainer.compile=step;
    CUDA graphs on GPU), from the same seed, so that their first losses must agree. ``--compile`` (blocks) does not
    apply: trainer.compile is one or the other. ``--compile-backend``: inductor (what training uses), or e.g.
    aot_eager, which captures the same one graph with its backward but generates no code (a quick check). On CUDA
    with inductor a third row compiles the same step without CUDA graphs: what the compiled kernels give alone."""
    compiled = dict(whole_step=True, compile_backend=args.compile_backend)
    runners = [
        ModeRunner(STATIC_EAGER, cfg, tokenizer, static, device, args.seed),
        ModeRunner(STATIC_COMPILED, cfg, tokenizer, static, device, args.seed, **compiled),
    ]
    if device.type == "cuda" and args.compile_backend == "inductor":
        runners.append(
            ModeRunner(STATIC_NO_GRAPHS, cfg, tokenizer, static, device, args.seed, **compiled, cuda_graphs=False)
        )
    return runners


def backend_runners(
    cfg: Config, tokenizer, packed: list[dict], device: torch.device, args: argparse.Namespace
) -> tuple[list[ModeRunner], list[dict[str, Any]]]:
    """A packed runner per available attention backend (on cuda, or with --backends), and a row per backend
    (an unavailable one says why); ``--backends none``: none. ``cfg.model.attn_backend`` is left as it was."""
    runners: list[ModeRunner] = []
    backends: list[dict[str, Any]] = []
    if (device.type != "cuda" and not args.backends) or args.backends == "none":
        return runners, backends
    from nanovlm.model import resolve_backend

    configured = cfg.model.attn_backend
    for name in [b for b in (args.backends or "sdpa,torch_varlen,flash_attn").split(",") if b]:
        try:
            resolve_backend(name, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        except Exception as e:  # an unavailable backend is reported, not fatal
            backends.append({"backend": name, "unavailable": str(e).splitlines()[0]})
            continue
        cfg.model.attn_backend = name
        runners.append(ModeRunner(f"packed/{name}", cfg, tokenizer, packed, device, args.seed, args.compile))
        backends.append({"backend": name})
    cfg.model.attn_backend = configured
    return runners, backends


def ratio_check(
    by_name: dict[str, ModeRunner], cfg: Config, vocab: int, batches: dict[str, list[dict]]
) -> dict[str, Any] | None:
    """The >= 90% target: packed over pad-to-longest real tokens/s against the ratio of their fills (and of their
    FLOPs), plus the same ratio for the decoder-only runs; None when ``--train-modes`` left either layout out."""
    if "packed" not in by_name or "pad_to_longest" not in by_name:
        return None
    ideal = _fill(batches["packed"]) / _fill(batches["pad_to_longest"])
    ratio = _layout_ratio(by_name["packed"], by_name["pad_to_longest"], ideal)
    if ratio is not None:
        check = {"ideal_ratio": ideal, **ratio, "target_met": ratio["fraction_of_ideal"] >= 0.9}
        # The fill ratio assumes cost proportional to slots; images cost the same in every layout.
        fl = pass_flops(cfg, vocab, batches["pad_to_longest"]) / pass_flops(cfg, vocab, batches["packed"])
        check["ideal_ratio_by_flops"] = fl
        check["fraction_of_flops_ideal"] = ratio["actual_ratio"] / fl
    else:  # one of them failed (e.g. pad-to-longest out of memory): no ratio to check
        check = {"ideal_ratio": ideal, "actual_ratio": None, "fraction_of_ideal": None, "target_met": None}
    only = [by_name.get(f"{m} (decoder only)") for m in DECODER_ONLY]
    decoder_only = _layout_ratio(only[0], only[1], ideal) if all(only) else None
    if decoder_only is not None:
        check["decoder_only"] = decoder_only
    return check


def _time_runners(
    layouts: list[ModeRunner], extra: list[ModeRunner], backends: list[dict[str, Any]], reps: int, warmup: int, log
) -> tuple[dict[str, dict[str, Any]], dict[str, ModeRunner]]:
    """Time every runner interleaved, count the packed runners' kernel launches and profile their host vs device
    time, free the models; return the results of ``layouts`` by name (``backends`` rows are filled in place) and
    every runner by name."""
    runners = [*layouts, *extra]
    run_interleaved(runners, reps, warmup, log)
    for r in runners:
        if r.name == "packed" or r.name.startswith("packed/"):
            r.measure_launches()
            r.profile_steps(PROFILE_STEPS)
    results = {r.name: r.result() for r in layouts}
    by_name = {r.name: r for r in runners}
    for b in backends:
        if "unavailable" not in b:
            b.update(by_name[f"packed/{b['backend']}"].result())
    for r in runners:
        r.release()
    return results, by_name


def measure(args: argparse.Namespace, log=print) -> TrainResult:
    from nanovlm.data.tokenizer import load_tokenizer
    from nanovlm.model import build_model, num_parameters, resolve_vocab_size

    device = train_device(args)
    cfg, preset = train_config(args, device)
    tokenizer = load_tokenizer(args.tokenizer or cfg.data.tokenizer, cfg.model.vision.image_splitting)
    quick = args.quick
    n = args.train_samples or ((80 if quick else 600) if device.type == "cpu" else (1000 if quick else 4000))
    log(f"[train] loading {n} samples for L={cfg.data.max_tokens} on {device}")
    samples = load_samples(cfg, tokenizer, n)
    if not samples:
        raise ValueError(f"no usable sample in {cfg.data.train} for max_tokens={cfg.data.max_tokens}")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) if args.compile_step else None
    batches, layout = make_batches(samples, cfg, int(tokenizer.pad_token_id or 0), image_id)
    # cuda: a whole pass of warm-up, so every padded shape has been seen (kernels, allocator) before timing
    warmup = max(len(v) for v in batches.values()) if device.type == "cuda" else (2 if quick else 3)
    backend = cfg.model.attn_backend
    vocab = resolve_vocab_size(cfg.model, tokenizer)
    layouts = layout_runners(cfg, tokenizer, batches, device, args)
    if args.compile_step:
        layouts += static_runners(cfg, tokenizer, batches[STATIC], device, args)
    extra, backends = backend_runners(cfg, tokenizer, batches["packed"], device, args)
    results, by_name = _time_runners(layouts, extra, backends, args.reps, warmup, log)
    # MFU counts the work of the real samples (the packed plan's), also for static packs: their blank image slots
    # and their LM head on every position are a cost of the fixed shapes, not useful work
    mfu_rows = [results.get(m) for m in ("packed", STATIC_EAGER, STATIC_COMPILED, STATIC_NO_GRAPHS)] + backends
    for res in mfu_rows:
        if res and "real_tokens_per_s" in res:
            res["mfu"] = _mfu(cfg, vocab, batches["packed"], res["real_tokens_per_s"]["median"], device)
    head = HEAD_EVERYWHERE in by_name and "packed" in by_name
    return TrainResult(
        device=device,
        parameters=num_parameters(build_model(cfg.model, tokenizer))["total"],  # on the CPU: counting only
        layout=layout,
        modes=results,
        backends=backends,
        ratio_check=ratio_check(by_name, cfg, vocab, batches),
        loss_position_head=_head_saving(by_name["packed"], by_name[HEAD_EVERYWHERE]) if head else None,
        model_label=preset or (args.config or ["tiny_cpu.yaml"])[-1],
        attn_backend=backend,
        compiled=args.compile,
        compile_step=args.compile_step,
        compile_backend=args.compile_backend,
        reps=args.reps,
        warmup=warmup,
    )
