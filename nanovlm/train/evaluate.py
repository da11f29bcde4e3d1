"""End-of-run evaluation: answer accuracy on held-out samples, with and without their images, next to chance.

Uses validation samples whose json carries a short expected ``"answer"`` (the demo data does; so can yours).
For each one the model greedily generates the last assistant turn from the conversation before it; the
answer counts as correct when the generated text equals the expected one (case and surrounding punctuation
ignored). Chance is the mean chance level of the evaluated samples' tasks when the data says its task (the
demo data), else the accuracy of always answering the most common expected answer (per task when samples
carry a ``"task"``).

Every sample with images is answered a second time with each image replaced by a blank one (uniform at the
normalisation mean, so the encoder sees zeros): the *vision lift*, accuracy with images minus accuracy with
blank images, is what the model takes from the pixels rather than from the question's text prior. A model can
score well above chance without looking (answer priors, text-only samples); the lift cannot be had that way.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from nanovlm.config import Config, DataConfig
from nanovlm.constants import IMAGE_TOKEN

log = logging.getLogger(__name__)


def normalize_answer(text: str) -> str:
    return re.sub(r"^[\W_]+|[\W_]+$", "", text.strip().lower())


def iter_answered_records(
    directories: list[str],
    limit: int,
    skips: Counter | None = None,
    cache_dir: str | None = None,
    cache_max_bytes: int = DataConfig.cache_max_bytes,
):
    """Up to ``limit`` records with an ``answer``, taken from ``directories`` in turn (one from each, round robin,
    in index order within each), so every validation set is evaluated, not only the first. Remote directories are
    read through a shard cache in ``cache_dir``, as training reads them.

    A record that cannot be read is logged and counted in ``skips`` (by reason), as the validation loader does.
    """
    from nanovlm.data.index import load_index
    from nanovlm.data.reader import ShardReader
    from nanovlm.data.shard_cache import shard_cache

    indexes = [load_index(d, cache_dir=cache_dir) for d in directories]
    reader = ShardReader(cache=shard_cache(indexes, cache_dir, cache_max_bytes))
    streams = [_answered(idx, reader, skips) for idx in indexes]
    found = 0
    try:
        while streams and found < limit:
            for stream in list(streams):
                record = next(stream, None)
                if record is None:
                    streams.remove(stream)
                    continue
                yield record
                found += 1
                if found >= limit:
                    return
    finally:
        reader.close()


def _answered(idx, reader, skips: Counter | None):
    """The records of one dataset directory that end in an assistant turn and have an ``answer``, in order."""
    from nanovlm.data.format import SampleError

    for path, off, nb, key in idx.sample_refs():
        try:
            record = reader.read(path, off, nb, key)
        except SampleError as e:
            _skip(skips, e, f"{key} ({path})")
            continue
        if "answer" in record.extra and record.messages[-1]["role"] == "assistant":
            yield record


ANSWER_MARGIN = 8  # tokens generated beyond the expected answer's length (room for its end token and some slack)


def _skip(skips: Counter | None, err: Exception, where: str) -> None:
    log.warning("[eval] skipped sample %s: %s", where, err)
    if skips is not None:
        skips[getattr(err, "reason", type(err).__name__)] += 1


def _question(messages: list[dict]) -> str:
    """The last user turn before the answer ('' when the conversation has none)."""
    user = [m["content"] for m in messages[:-1] if m["role"] == "user"]
    return user[-1].replace(IMAGE_TOKEN, "").strip() if user else ""


def blank_like(pixels: torch.Tensor, image_mean: list[float]) -> torch.Tensor:
    """uint8 images of the same shape as ``pixels``, each a flat image at the normalisation mean: after
    ``NanoVLM.normalize`` they are (close to) zero, an image that carries no information."""
    mean = torch.tensor([round(255 * m) for m in image_mean], dtype=torch.uint8, device=pixels.device)
    return mean.view(1, 3, 1, 1).expand_as(pixels).contiguous()


def _generate_text(model, tokenizer, prompt: torch.Tensor, pixels, budget: int, eos: int) -> str:
    new = model.generate(prompt, pixels, max_new_tokens=budget, eos_token_id=eos)[0].tolist()
    return tokenizer.decode([t for t in new if t != eos], skip_special_tokens=True).strip()


@torch.no_grad()
def evaluate_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: Config,
    directories: list[str],
    limit: int,
    max_new_tokens: int | None = None,
    blank_images: bool = True,
) -> dict[str, Any]:
    """Greedy-decode the final answer of up to ``limit`` held-out samples, with their images and (when
    ``blank_images``) with blank ones. Returns accuracy, accuracy_blank, chance, per-task figures and rows.

    ``max_new_tokens`` None: per sample, the expected answer's token count + ANSWER_MARGIN (an exact match needs
    no more; a fixed small budget could never match a long answer such as a caption). Always capped so prompt +
    answer fit the model's context; a prompt that leaves no room is skipped as ``overlength``. A sample without
    images is answered once: its blank-image answer is the same generation.

    Samples that cannot be read or processed (e.g. an unreadable image) are skipped, logged and counted in
    ``skipped`` (by reason), as the validation loader skips them.
    """
    from nanovlm.data.format import SampleError
    from nanovlm.data.processing import SampleProcessor

    processor = SampleProcessor.from_config(tokenizer, cfg.model, cfg.data)
    eos = processor.end_id  # the token that closes a turn in the run's chat format
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    skipped: Counter = Counter()
    try:
        records = iter_answered_records(directories, limit, skipped, cfg.data.cache_dir, cfg.data.cache_max_bytes)
        for record in records:
            try:
                ids, pixels = processor.prompt(record.messages[:-1], record.images, record.key)
                prompt = torch.tensor([ids], device=device)
                pixels = pixels.to(device) if record.images else None
            except SampleError as e:
                _skip(skipped, e, record.key)
                continue
            expected = str(record.extra["answer"])
            budget = max_new_tokens
            if budget is None:
                budget = len(tokenizer.encode(expected, add_special_tokens=False)) + ANSWER_MARGIN
            budget = min(budget, cfg.model.language.max_position_embeddings + 1 - prompt.shape[1])  # generate's bound
            if budget <= 0:
                _skip(
                    skipped, SampleError("overlength", record.key, "the prompt fills the model's context"), record.key
                )
                continue
            text = _generate_text(model, tokenizer, prompt, pixels, budget, eos)
            row = {
                "key": record.key,
                "task": record.extra.get("task"),
                "images": len(record.images),
                "question": _question(record.messages),
                "expected": expected,
                "generated": text,
                "correct": normalize_answer(text) == normalize_answer(expected),
            }
            if blank_images:
                blank = text
                if pixels is not None:
                    blanks = blank_like(pixels, cfg.model.vision.image_mean)
                    blank = _generate_text(model, tokenizer, prompt, blanks, budget, eos)
                row["generated_blank"] = blank
                row["correct_blank"] = normalize_answer(blank) == normalize_answer(expected)
            rows.append(row)
    finally:
        model.train(was_training)
    return summarize(rows, dict(skipped))


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict], skipped: dict[str, int] | None = None) -> dict[str, Any]:
    """Accuracy with and without images, overall and per task, next to chance (the result of evaluate_answers)."""
    has_blank = bool(rows) and all("correct_blank" in r for r in rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["task"] or "all", []).append(r)
    by_task = {
        task: {
            "n": len(g),
            "accuracy": _mean(r["correct"] for r in g),
            "accuracy_blank": _mean(r["correct_blank"] for r in g) if has_blank else None,
            "chance": chance_level(g),
            "with_images": sum(r["images"] > 0 for r in g),
        }
        for task, g in sorted(groups.items())
    }
    accuracy = _mean(r["correct"] for r in rows)
    accuracy_blank = _mean(r["correct_blank"] for r in rows) if has_blank else None
    return {
        "n": len(rows),
        "accuracy": accuracy or 0.0,
        "accuracy_blank": accuracy_blank,
        "vision_lift": None if accuracy_blank is None else accuracy - accuracy_blank,
        "chance": chance_level(rows),
        "by_task": by_task,
        "rows": rows,
        "skipped": dict(skipped or {}),
    }


_DEMO_KEY = re.compile(r"demo-(train|val)-\d{6}")  # the keys make_demo_data writes


def chance_level(rows: list[dict]) -> float | None:
    """The demo's per-task chance on demo samples; elsewhere, always answering the most common expected answer
    of each task (of all samples when they name no task)."""
    if not rows:
        return None
    if all(r["task"] is not None and _DEMO_KEY.fullmatch(str(r["key"])) for r in rows):  # not a user task "count"
        from nanovlm.data.demo import CHANCE

        if all(r["task"] in CHANCE for r in rows):
            return sum(CHANCE[r["task"]] for r in rows) / len(rows)
    by_task: dict[Any, Counter] = {}
    for r in rows:
        by_task.setdefault(r["task"], Counter())[normalize_answer(r["expected"])] += 1
    return sum(c.most_common(1)[0][1] for c in by_task.values()) / len(rows)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_report(result: dict[str, Any], examples: int = 6) -> str:
    rows, skipped = result["rows"], result.get("skipped") or {}
    skip_note = (
        f"; skipped {sum(skipped.values())} unusable samples ("
        + ", ".join(f"{r}={n}" for r, n in sorted(skipped.items()))
        + ")"
        if skipped
        else ""
    )
    if not rows:
        return "[eval] no held-out samples with an 'answer' field: skipped" + skip_note
    chance, blank = result["chance"], result.get("accuracy_blank")
    lines = [
        f"[eval] held-out answer accuracy: {result['accuracy']:.1%} on {result['n']} samples"
        + (f" (chance {chance:.1%})" if chance is not None else "")
        + (
            f"; with blank images {blank:.1%}: the images add {100 * result['vision_lift']:+.1f} points"
            if blank is not None
            else ""
        )
        + skip_note
    ]
    by_task = result["by_task"]
    if len(by_task) > 1 or blank is not None:
        width = max(len(t) for t in by_task)
        lines.append(f"[eval] {'task':{width}}  {'n':>4}  {'images':>7}  {'blank':>7}  {'chance':>7}")
        for task, t in by_task.items():
            lines.append(
                f"[eval] {task:{width}}  {t['n']:>4}  {_pct(t['accuracy']):>7}  {_pct(t['accuracy_blank']):>7}  "
                f"{_pct(t['chance']):>7}" + ("" if t["with_images"] else "  (no images)")
            )
    for r in rows[:examples]:
        mark = "ok " if r["correct"] else "bad"
        lines.append(f"  [{mark}] {r['question'][:60]!r:64} expected {r['expected']!r:10} got {r['generated']!r}")
    return "\n".join(lines)


EVAL_FILE = "eval.json"  # in trainer.run_dir, next to config.yaml and csv/


def write_eval(result: dict[str, Any], run_dir: str | Path, step: int) -> Path:
    """The evaluation as JSON (figures and every row), written atomically into the run directory."""
    path = Path(run_dir) / EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"step": step, **result}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def evaluate_at_end(cfg: Config, module: Any, datamodule: Any, trainer: Any) -> dict[str, Any] | None:
    """Run ``evaluate_answers`` on rank 0 after training (single process or DDP; FSDP shards the weights,
    so there it is skipped with a message). Prints the report, writes it to ``<run_dir>/eval.json`` and
    returns the result on rank 0."""
    if not cfg.data.val or cfg.trainer.eval_samples <= 0:
        return None
    if cfg.trainer.strategy == "fsdp":
        if trainer.is_global_zero:
            print(
                "[eval] skipped under FSDP (sharded weights). To evaluate, run the same command in one process "
                "(python scripts/train.py ... trainer.strategy=auto trainer.devices=1): it resumes the final "
                "checkpoint, has nothing left to train, and evaluates"
            )
        return None
    result = None
    if trainer.is_global_zero:
        result = evaluate_answers(module.model, datamodule.tokenizer, cfg, cfg.data.val, cfg.trainer.eval_samples)
        path = write_eval(result, cfg.trainer.run_dir, trainer.global_step)
        print(format_report(result) + f"\n[eval] written to {path}", flush=True)
    trainer.strategy.barrier("eval_at_end")
    return result
