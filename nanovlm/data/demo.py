"""The procedural demo dataset: coloured shapes with questions a tiny model can learn in minutes on a CPU.

Every answer is determined by the image(s), so held-out accuracy measures whether the model *looks*.
Each sample is drawn from its own RNG seeded by ``(seed, split, index)``, so the data is deterministic and
independent of generation order. A sample's short expected answer is stored as ``"answer"`` in its json (it
equals the last assistant turn exactly), with ``"task"``; captions and long descriptions have no ``answer``.

Tasks (``TASKS``: the training mix weight and the answers each allows; chance = uniform guessing among them):

=============  ===========================================================  ========
task           question -> answer                                           chance
=============  ===========================================================  ========
colour         What colour is the shape? -> red|green|blue|yellow|purple|orange  1/6
shape          What shape is this? -> square|circle|triangle|cross          1/4
count          How many shapes are there? -> one|two|three|four             1/4
position       Is the shape on the left or the right? -> left|right         1/2
compare_size   (2 images) Which image has the larger shape? -> first|second 1/2
same_colour    (2 images) Do both shapes have the same colour? -> yes|no    1/2
background     What colour is the background? -> black|gray|white           1/3
multi_turn     colour question, then shape question (answer: the shape)     1/4
text_only      (no image) How many corners does a <shape> have? -> number   1/4
caption        Describe the image. -> one sentence                          -
long           Describe the image in detail. -> 1..40 sentences (long tail) -
=============  ===========================================================  ========

The val split is balanced: every task equally often and, within a task, every answer equally often. Guessing
(or answering without looking, as with blank images) gives exactly the task's chance there, a third overall
(``CHANCE_ACCURACY``); whatever a model scores above that per visual task it took from the pixels.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from nanovlm.data.format import CAPTION_PROMPT, Record

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
}
BACKGROUNDS = {"black": (20, 20, 20), "gray": (128, 128, 128), "white": (235, 235, 235)}
SHAPES = ("square", "circle", "triangle", "cross")
SIZES = {"small": 0.4, "large": 0.7}  # a single shape's side as a fraction of the image's shorter side
CORNERS = {"square": "four", "circle": "zero", "triangle": "three", "cross": "twelve"}
NUMBERS = ("zero", "one", "two", "three", "four")
SPLIT_IDS = {"train": 0, "val": 1}
TRAIN_SAMPLES, VAL_SAMPLES = 3000, 396  # the default build; 396 = 11 tasks x 36, a multiple of every answer count

# task -> (weight in the training mix, the short answers it allows; None: no short answer). The weights favour
# what is slow to learn from pixels (shape, comparing the colours of two images) over what is quick (colour,
# background, position); shape is still the last visual skill the default run learns.
TASKS: dict[str, tuple[float, tuple[str, ...] | None]] = {
    "colour": (0.07, tuple(COLOURS)),
    "shape": (0.30, SHAPES),
    "count": (0.10, NUMBERS[1:]),
    "position": (0.05, ("left", "right")),
    "compare_size": (0.08, ("first", "second")),
    "same_colour": (0.15, ("yes", "no")),
    "background": (0.03, tuple(BACKGROUNDS)),
    "multi_turn": (0.12, SHAPES),
    "text_only": (0.02, tuple(dict.fromkeys(CORNERS.values()))),
    "caption": (0.06, None),
    "long": (0.02, None),
}
# The "detail" mixes (``make_demo_data(mix=...)``): one small mark on a large image of some size and aspect.
# Squashed to one image_size square the mark shrinks to a few pixels; tiles show it at its own size, so these mixes
# measure what image splitting buys (docs/images.md). "detail_shape" asks only the mark's shape.
DETAIL_TASKS: dict[str, tuple[float, tuple[str, ...] | None]] = {
    "detail_shape": (0.75, SHAPES),
    "detail_colour": (0.25, tuple(COLOURS)),
}
MIXES = {"default": TASKS, "detail": DETAIL_TASKS, "detail_shape": {"detail_shape": (1.0, SHAPES)}}
DETAIL_MARK = 10  # side of the mark in pixels
DETAIL_LONG_SIDE = (64, 96)  # the image's longer side, pixels
DETAIL_ASPECTS = (1, 2, 3, 4)  # longer side / shorter side, either orientation

CHANCE = {  # uniform guessing per task
    t: 1 / len(answers) for mix in MIXES.values() for t, (_, answers) in mix.items() if answers
}
# The val split is balanced (every task equally often, each answer of a task equally often), so chance there is
# the plain mean of the per-task chances, and a model that answers without looking scores exactly chance.
CHANCE_ACCURACY = sum(CHANCE[t] for t, (_, a) in TASKS.items() if a) / sum(1 for _, a in TASKS.values() if a)


# ----------------------------------------------------------------------------------------------------------
# scenes


def _scene(rng: np.random.Generator, count: int | None = None, size: str | None = None) -> dict:
    """Random scene parameters: one shape kind and colour, 1-4 copies, a background, size and position."""
    colour = str(rng.choice(list(COLOURS)))
    return {
        "shape": str(rng.choice(SHAPES)),
        "colour": colour,
        "background": str(rng.choice(list(BACKGROUNDS))),
        "count": int(count if count is not None else (rng.integers(1, 5) if rng.random() < 0.4 else 1)),
        "size": size or str(rng.choice(["small", "large"])),
        "side": str(rng.choice(["left", "right"])),
        "w": int(rng.integers(40, 65)),
        "h": int(rng.integers(40, 65)),
    }


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    else:  # cross
        t = (x1 - x0) / 3
        draw.rectangle((x0 + t, y0, x1 - t, y1), fill=fill)
        draw.rectangle((x0, y0 + t, x1, y1 - t), fill=fill)


def render(scene: dict, rng: np.random.Generator) -> bytes:
    """Draw a scene; PNG (or, one time in four, JPEG) bytes."""
    w, h = scene["w"], scene["h"]
    base = np.array(BACKGROUNDS[scene["background"]], dtype=np.int16)
    noise = rng.integers(-12, 13, size=(h, w, 1), dtype=np.int16)
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    fill = COLOURS[scene["colour"]]
    if scene["count"] == 1:
        s = SIZES[scene["size"]] * min(w, h)
        # a fixed place on its side: jittering it made the shape task need several times more steps to learn
        cx, cy = w * (0.27 if scene["side"] == "left" else 0.73), h * 0.5
        cx = min(max(cx, s / 2 + 1), w - s / 2 - 1)
        _draw_shape(draw, scene["shape"], (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2), fill)
    else:  # copies in distinct cells of a 2x2 grid
        cells = rng.permutation(4)[: scene["count"]]
        s = 0.36 * min(w, h)
        for c in cells:
            cx = w * (0.25 + 0.5 * (c % 2)) + rng.uniform(-0.04, 0.04) * w
            cy = h * (0.25 + 0.5 * (c // 2)) + rng.uniform(-0.04, 0.04) * h
            _draw_shape(draw, scene["shape"], (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2), fill)
    buf = io.BytesIO()
    if rng.random() < 0.25:
        img.save(buf, format="JPEG", quality=92)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def render_detail(scene: dict, rng: np.random.Generator) -> bytes:
    """A noisy background of the scene's size with one DETAIL_MARK-pixel mark somewhere on it; PNG bytes."""
    w, h = scene["w"], scene["h"]
    base = np.array(BACKGROUNDS[scene["background"]], dtype=np.int16)
    noise = rng.integers(-12, 13, size=(h, w, 1), dtype=np.int16)
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    x, y = scene["x"], scene["y"]
    _draw_shape(ImageDraw.Draw(img), scene["shape"], (x, y, x + DETAIL_MARK, y + DETAIL_MARK), COLOURS[scene["colour"]])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _detail_scene(rng: np.random.Generator) -> dict:
    long = int(rng.integers(DETAIL_LONG_SIDE[0], DETAIL_LONG_SIDE[1] + 1))
    short = max(DETAIL_MARK + 4, long // int(rng.choice(DETAIL_ASPECTS)))
    w, h = (long, short) if rng.random() < 0.5 else (short, long)
    return {
        "shape": str(rng.choice(SHAPES)),
        "colour": str(rng.choice(list(COLOURS))),
        "background": str(rng.choice(list(BACKGROUNDS))),
        "w": w,
        "h": h,
        "x": int(rng.integers(1, w - DETAIL_MARK - 1)),
        "y": int(rng.integers(1, h - DETAIL_MARK - 1)),
    }


def _plural(scene: dict) -> str:
    n = scene["count"]
    noun = scene["shape"] + ("es" if scene["shape"] == "cross" and n > 1 else "s" if n > 1 else "")
    return f"{NUMBERS[n]} {scene['colour']} {noun}" if n > 1 else f"a {scene['size']} {scene['colour']} {noun}"


def caption(scene: dict) -> str:
    where = f" on the {scene['side']}" if scene["count"] == 1 else ""
    return f"{_plural(scene)}{where} on a {scene['background']} background."


_FACTS = (
    lambda s: f"The image shows {_plural(s)}.",
    lambda s: f"The background is {s['background']}.",
    lambda s: f"The colour of the shape is {s['colour']}.",
    lambda s: f"Each shape is a {s['shape']}.",
    lambda s: f"A {s['shape']} has {CORNERS[s['shape']]} corners.",
    lambda s: (
        f"There {'is' if s['count'] == 1 else 'are'} {NUMBERS[s['count']]} shape{'s' if s['count'] > 1 else ''} in total."
    ),
    lambda s: f"The shape is on the {s['side']} side." if s["count"] == 1 else "The shapes are spread over the image.",
    lambda s: f"The shape is {s['size']}." if s["count"] == 1 else "The shapes are small.",
    lambda s: f"The {s['colour']} colour stands out against the {s['background']} background.",
)


def long_description(scene: dict, rng: np.random.Generator) -> str:
    """1..40 sentences, long-tailed (geometric): facts about the scene, cycled and repeated."""
    n = min(40, int(rng.geometric(0.15)))
    order = list(rng.permutation(len(_FACTS)))
    return " ".join(_FACTS[order[i % len(order)]](scene) for i in range(n))


# ----------------------------------------------------------------------------------------------------------
# samples


def _qa(image_prompt: str, question: str, answer: str) -> list[dict]:
    return _turn(f"{image_prompt}\n{question}", answer)


def _turn(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


# The questions about one image: task -> (question, answer of a scene).
QUESTIONS = {
    "colour": ("What colour is the shape?", lambda s: s["colour"]),
    "shape": ("What shape is this?", lambda s: s["shape"]),
    "count": ("How many shapes are there?", lambda s: NUMBERS[s["count"]]),
    "position": ("Is the shape on the left or the right?", lambda s: s["side"]),
    "background": ("What colour is the background?", lambda s: s["background"]),
}


def make_sample(task: str, rng: np.random.Generator) -> tuple[list[dict], list[bytes], dict]:
    """(messages, images, extra) of one sample of ``task``."""
    if task == "compare_size":
        a, b = _scene(rng, count=1, size="small"), _scene(rng, count=1, size="large")
        first_larger = bool(rng.random() < 0.5)
        scenes = [b, a] if first_larger else [a, b]
        answer = "first" if first_larger else "second"
        msgs = _qa("<image><image>", "Which image has the larger shape?", answer)
        return msgs, [render(s, rng) for s in scenes], {"answer": answer, "task": task}
    if task == "same_colour":
        a, b = _scene(rng, count=1), _scene(rng, count=1)
        same = bool(rng.random() < 0.5)  # exactly even odds: a blind model gains nothing from the prior
        b["colour"] = a["colour"] if same else str(rng.choice([c for c in COLOURS if c != a["colour"]]))
        answer = "yes" if same else "no"
        msgs = _qa("<image><image>", "Do both shapes have the same colour?", answer)
        return msgs, [render(a, rng), render(b, rng)], {"answer": answer, "task": task}
    if task in ("detail_shape", "detail_colour"):
        scene = _detail_scene(rng)
        what = task.removeprefix("detail_")
        answer = scene[what]
        msgs = _qa("<image>", f"What {what} is the small mark?", answer)
        return msgs, [render_detail(scene, rng)], {"answer": answer, "task": task}
    if task == "text_only":
        shape = str(rng.choice(SHAPES))
        answer = CORNERS[shape]
        return _turn(f"How many corners does a {shape} have?", answer), [], {"answer": answer, "task": task}
    # count questions see 1..4 shapes equally often (elsewhere most scenes hold one shape)
    scene = _scene(rng, count=1 if task == "position" else int(rng.integers(1, 5)) if task == "count" else None)
    image = [render(scene, rng)]
    if task in QUESTIONS:
        question, answer = QUESTIONS[task]
        msgs = _qa("<image>", question, answer(scene))
    elif task == "multi_turn":
        msgs = _qa("<image>", QUESTIONS["colour"][0], scene["colour"]) + _turn("And what shape is it?", scene["shape"])
    elif task == "caption":
        msgs = [{"role": "user", "content": CAPTION_PROMPT}, {"role": "assistant", "content": caption(scene)}]
        return msgs, image, {"task": task}
    elif task == "long":
        msgs = _qa("<image>", "Describe the image in detail.", long_description(scene, rng))
        return msgs, image, {"task": task}
    else:
        raise ValueError(f"unknown demo task {task!r}")
    return msgs, image, {"answer": msgs[-1]["content"], "task": task}


def generate_records(n: int, split: str = "train", seed: int = 0, mix: str = "default") -> Iterator[Record]:
    """``n`` demo Records with keys ``demo-<split>-000000``...; sample i depends only on (seed, split, i).

    train draws tasks by their mix weight; val cycles through the tasks and, within a task, through its answers
    (drawing scenes until one has the answer due), so each task's held-out score is measured on equal footing.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown demo mix {mix!r}; choose one of {sorted(MIXES)}")
    tasks = list(MIXES[mix])
    weights = np.array([MIXES[mix][t][0] for t in tasks])
    weights = weights / weights.sum()
    for i in range(n):
        rng = np.random.default_rng([seed, SPLIT_IDS[split], i])
        if split == "train":
            task = tasks[int(rng.choice(len(tasks), p=weights))]
            messages, images, extra = make_sample(task, rng)
        else:
            task = tasks[i % len(tasks)]
            messages, images, extra = _sample_with_answer(task, MIXES[mix][task][1], i // len(tasks), rng)
        yield Record(f"demo-{split}-{i:06d}", messages, images, extra)


def _sample_with_answer(
    task: str, answers: tuple[str, ...] | None, k: int, rng: np.random.Generator
) -> tuple[list[dict], list[bytes], dict]:
    """A sample of ``task`` whose answer is the k-th of ``answers`` (cyclically); any sample for tasks without."""
    for _ in range(1000):  # the rarest answer has odds 1/6: never near this bound
        sample = make_sample(task, rng)
        if not answers or sample[2]["answer"] == answers[k % len(answers)]:
            return sample
    raise RuntimeError(f"demo task {task!r} never produced answer {answers[k % len(answers)]!r}")


def tokenizer_texts(records: list[Record]) -> list[str]:
    """Texts the demo tokenizer is trained on: every turn with its ChatML role line."""
    return [f"{m['role']}\n{m['content']}" for r in records for m in r.messages]


def make_demo_data(
    root: str | os.PathLike = "data/demo",
    train_samples: int = TRAIN_SAMPLES,
    val_samples: int = VAL_SAMPLES,
    seed: int = 0,
    image_token_count: int = 16,
    samples_per_shard: int = 500,
    mix: str = "default",
) -> dict:
    """Write ``root/tokenizer``, ``root/train`` and ``root/val`` (held out: a different RNG stream) of ``mix``
    (``MIXES``: the default tasks, or "detail").

    Returns a summary dict (sample counts and paths). Deterministic: the same arguments give the same bytes.
    """
    from nanovlm.data.prepare import write_dataset
    from nanovlm.data.tokenizer import build_tokenizer

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    train = list(generate_records(train_samples, "train", seed, mix))
    val = list(generate_records(val_samples, "val", seed, mix))
    tok = build_tokenizer(root / "tokenizer", tokenizer_texts(train), vocab_size=512)
    tr = write_dataset(train, root / "train", tok, image_token_count, samples_per_shard, created_by="make_demo_data")
    va = write_dataset(val, root / "val", tok, image_token_count, samples_per_shard, created_by="make_demo_data")
    return {
        "root": str(root),
        "train_samples": tr.num_samples,
        "val_samples": va.num_samples,
        "vocab_size": len(tok),
        "chance_accuracy": float(np.mean([CHANCE[t] for t, (_, a) in MIXES[mix].items() if a])),
    }


def _complete(root: Path) -> bool:
    return all(
        (root / p).exists() for p in ("tokenizer/tokenizer.json", "train/index/meta.json", "val/index/meta.json")
    )


def ensure_demo_data(root: str | os.PathLike = "data/demo", **kwargs) -> Path:
    """Build the demo dataset into ``root`` unless it is already there; return ``root``.

    Safe when several processes (DDP ranks) call it at once: each builds into its own temporary directory and
    the first to finish renames it into place; the others discard theirs.
    """
    root = Path(root)
    if _complete(root):
        return root
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    make_demo_data(tmp, **kwargs)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        if root.exists() and not any(root.iterdir()):
            root.rmdir()
        os.rename(tmp, root)
    except OSError:  # another process won, or a partial root exists: fill in only the missing parts
        for part in ("tokenizer", "train", "val"):
            if not (root / part).exists():
                os.replace(tmp / part, root / part)
        shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(root):
        raise RuntimeError(f"demo data at {root} is incomplete; delete it and run scripts/make_demo_data.py")
    return root
