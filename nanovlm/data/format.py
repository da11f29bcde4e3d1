"""The sample schema: what one conversation with images is, how the supported inputs map to it, and what is bad.

Everything that reads user data (``prepare_data``, the index-only scan, the training DataModule) goes through
the functions here, so a sample is accepted or rejected for the same reason everywhere. A bad sample raises
:class:`SampleError` with a short fixed ``reason`` code; callers count skips per reason.

Supported inputs:

* native JSONL: ``{"images": ["a.jpg"], "messages": [{"role": "user", "content": "<image>\\nWhat?"}, ...]}``
* LLaVA JSONL: ``{"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>\\nWhat?"},
  {"from": "gpt", "value": "..."}]}`` (``image`` may also be a list)
* caption JSONL: ``{"image": "a.jpg", "caption": "..."}``
* WebDataset members of one key: ``0.jpg``, ``1.png``, ... + ``json`` (native or LLaVA conversation), or
  ``jpg`` + ``txt`` (a caption sample, e.g. made by img2dataset).

Nothing is ever unpickled: members with unknown suffixes (``pyd``, ``pickle``, ``pth``, ...) are ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from nanovlm.constants import IMAGE_TOKEN

ROLES = ("system", "user", "assistant")
# The user turn of a caption sample: the image, then a fixed instruction (so captioning is a task of its own).
CAPTION_PROMPT = IMAGE_TOKEN + "\nDescribe the image."
# Image member suffixes we decode (by content: the suffix only marks a member as an image).
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm")
# Members that could execute code when loaded by other tools; never read, documented so nobody adds them.
UNSAFE_SUFFIXES = ("pyd", "pickle", "pkl", "pth", "pt", "npy", "npz")
_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")


class SampleError(Exception):
    """One bad sample. ``reason`` is a short fixed code used to count skips (see docs/internals.md)."""

    def __init__(self, reason: str, key: str = "", detail: str = ""):
        self.reason = reason
        self.key = key
        self.detail = detail
        super().__init__(f"{reason}" + (f" [{key}]" if key else "") + (f": {detail}" if detail else ""))


@dataclass
class Record:
    """One sample before tokenization: ChatML-style messages with ``<image>`` placeholders and the raw image bytes.

    ``extra`` holds fields stored beside ``messages`` in the sample json (e.g. ``{"answer": "red"}``).
    """

    key: str
    messages: list[dict]
    images: list[bytes] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def check_key(key: str) -> str:
    """WebDataset splits member names at the first dot, so a key must not contain one (nor odd characters)."""
    if not key or not _KEY_RE.match(key):
        raise SampleError("bad_key", key, "keys may only hold letters, digits, '_', '-' and '/'")
    return key


def validate_messages(messages: Any, n_images: int, key: str = "") -> list[dict]:
    """Check a conversation and return it as a clean list of ``{"role", "content"}`` dicts.

    Raises SampleError: ``missing_messages`` (not a list of dicts), ``bad_role``, ``empty_conversation``
    (no turn with text), ``no_assistant_turn`` (nothing to learn from), ``image_count_mismatch``
    (``<image>`` placeholders != images).
    """
    if not isinstance(messages, list):
        raise SampleError("missing_messages", key, "'messages' must be a list of {role, content}")
    clean = []
    has_text = has_answer = False
    n_placeholders = 0
    for m in messages:  # one pass: this runs for every sample read in training
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise SampleError("missing_messages", key, f"bad message {str(m)[:80]!r}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise SampleError("bad_role", key, f"role {role!r} is not one of {ROLES}")
        if content.strip():
            has_text = True
            has_answer = has_answer or role == "assistant"
        n_placeholders += content.count(IMAGE_TOKEN)
        clean.append({"role": role, "content": content})
    if not has_text:
        raise SampleError("empty_conversation", key)
    if not has_answer:
        empty = any(m["role"] == "assistant" for m in clean)
        raise SampleError(
            "no_assistant_turn",
            key,
            "every assistant turn is empty" if empty else "the conversation has no assistant turn",
        )
    if n_placeholders != n_images:
        raise SampleError("image_count_mismatch", key, f"{n_placeholders} <image> placeholders, {n_images} images")
    return clean


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _image_refs(obj: dict, key: str) -> list[str]:
    """The image references of a sample: its ``image`` or ``images`` field (a string or a list), never both."""
    one, many = obj.get("image"), obj.get("images")
    if one is not None and many is not None:
        raise SampleError("bad_image_ref", key, "both 'image' and 'images' are set: use one")
    refs = _as_list(one if one is not None else many)
    if not all(isinstance(r, str) and r for r in refs):
        raise SampleError("bad_image_ref", key, f"image references must be non-empty strings, got {refs!r}"[:200])
    return refs


def _llava_messages(conversations: Any, n_images: int, key: str) -> list[dict]:
    if not isinstance(conversations, list):
        raise SampleError("missing_messages", key, "'conversations' must be a list")
    messages = []
    for turn in conversations:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise SampleError("missing_messages", key, f"bad turn {str(turn)[:80]!r}")
        role = _LLAVA_ROLES.get(str(turn.get("from")).lower())  # "Human" / "GPT" in some exports
        if role is None:
            raise SampleError("bad_role", key, f"'from' {turn.get('from')!r} is not human/gpt/system")
        messages.append({"role": role, "content": turn["value"]})
    # LLaVA convention: an image with no placeholder belongs before the first user turn's text.
    if n_images and not any(IMAGE_TOKEN in m["content"] for m in messages):
        for m in messages:
            if m["role"] == "user":
                m["content"] = "\n".join([IMAGE_TOKEN] * n_images) + "\n" + m["content"]
                break
    return messages


def parse_json_sample(obj: Any, key: str = "") -> tuple[list[dict], list[str], dict]:
    """A decoded JSON object in any supported format -> (messages, image references, extra fields).

    Image references are whatever the input holds (paths for JSONL); the caller resolves them.
    Raises SampleError with ``unknown_format`` when the object matches no format.
    """
    if not isinstance(obj, dict):
        raise SampleError("unknown_format", key, "a sample must be a JSON object")
    if "messages" in obj:  # native ("image" as in the other formats: left in extra, it silently lost the image)
        refs = _image_refs(obj, key)
        messages = validate_messages(obj["messages"], len(refs), key)
        extra = {k: v for k, v in obj.items() if k not in ("messages", "image", "images")}
    elif "conversations" in obj:  # LLaVA
        refs = _image_refs(obj, key)
        messages = validate_messages(_llava_messages(obj["conversations"], len(refs), key), len(refs), key)
        extra = {k: v for k, v in obj.items() if k not in ("conversations", "image", "images")}
    elif "caption" in obj:  # caption
        refs = _image_refs(obj, key)
        if len(refs) != 1:
            raise SampleError("image_count_mismatch", key, f"a caption sample needs one image, got {len(refs)}")
        if not isinstance(obj["caption"], str):
            raise SampleError("missing_messages", key, "'caption' must be a string")
        messages = validate_messages(caption_messages(obj["caption"]), 1, key)
        extra = {k: v for k, v in obj.items() if k not in ("caption", "image", "images")}
    else:
        raise SampleError("unknown_format", key, "expected 'messages' (native), 'conversations' (LLaVA) or 'caption'")
    return messages, refs, extra


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _json_object(text: str, key: str, what: str = "") -> Any:
    """``json.loads`` whose failures are SampleErrors: ``bad_json``, or ``bad_utf8`` for a lone surrogate escape
    (``"\\ud83d"`` without its pair, a broken emoji in scraped text), which no UTF-8 writer or tokenizer takes."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise SampleError("bad_json", key, f"{what}{e}") from None
    except RecursionError:
        raise SampleError("bad_json", key, f"{what}nested too deeply to parse") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise SampleError("bad_utf8", key, f"{what}lone surrogate escape in the text ({e.reason})") from None
    return obj


def parse_jsonl_line(line: str | bytes, key: str = "") -> tuple[list[dict], list[str], dict]:
    """One JSONL line -> (messages, image references, extra). ``bad_json`` / ``bad_utf8`` for broken lines."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SampleError("bad_utf8", key, str(e)) from None
    obj = _json_object(line.removeprefix("\ufeff"), key)  # a byte-order mark (files saved by some editors)
    return parse_json_sample(obj, key)


def caption_messages(caption: str) -> list[dict]:
    """A caption as a one-turn conversation: the fixed caption prompt, then the caption as the answer."""
    return [{"role": "user", "content": CAPTION_PROMPT}, {"role": "assistant", "content": caption.strip()}]


def _image_members(members: dict[str, bytes | memoryview]) -> list[bytes | memoryview]:
    """Image members in order: ``0.jpg``, ``1.png``, ... by number, or a single ``jpg``/``png``/... member."""
    numbered: list[tuple[int, bytes]] = []
    plain: list[tuple[str, bytes]] = []
    for suffix, data in members.items():
        head, _, ext = suffix.rpartition(".")
        ext = ext.lower()
        if ext not in IMAGE_SUFFIXES:
            continue
        if head == "":
            plain.append((suffix, data))
        elif head.isdigit():
            numbered.append((int(head), data))
    if numbered:
        return [d for _, d in sorted(numbered)]
    return [d for _, d in sorted(plain)[:1]]


def _utf8(members: dict[str, bytes | memoryview], name: str, key: str) -> str:
    try:
        return str(members[name], "utf-8")  # bytes, or a view into a shard read whole (reindex)
    except UnicodeDecodeError as e:
        raise SampleError("bad_utf8", key, f"{name} member: {e}") from None


def members_to_record(members: dict[str, bytes | memoryview], key: str) -> Record:
    """The members of one WebDataset key (suffix -> bytes) -> Record.

    ``json`` with ``messages`` (or LLaVA ``conversations``) wins; otherwise a ``txt`` member (or a json
    ``caption``) makes a caption sample with the first image. Unknown suffixes are ignored, never decoded.
    """
    images = _image_members(members)
    extra: dict = {}
    obj = None
    if "json" in members:
        obj = _json_object(_utf8(members, "json", key), key, "json member: ")
        if not isinstance(obj, dict):
            raise SampleError("bad_json", key, "json member is not an object")
    if obj is not None and ("messages" in obj or "conversations" in obj):
        conv = obj["messages"] if "messages" in obj else _llava_messages(obj["conversations"], len(images), key)
        messages = validate_messages(conv, len(images), key)
        extra = {k: v for k, v in obj.items() if k not in ("messages", "conversations", "images", "image")}
        return Record(key, messages, images, extra)
    caption = None
    if "txt" in members:
        caption = _utf8(members, "txt", key)
    elif obj is not None and isinstance(obj.get("caption"), str):
        caption = obj["caption"]
    if caption is None:
        raise SampleError("missing_messages", key, f"no json conversation or txt caption (members: {sorted(members)})")
    if not images:
        raise SampleError("missing_image", key, "caption sample without an image member")
    if obj is not None:
        extra = {k: v for k, v in obj.items() if k != "caption"}
    return Record(key, validate_messages(caption_messages(caption), 1, key), images[:1], extra)


def record_to_json(record: Record) -> bytes:
    """The ``json`` member written for a record: messages plus extra fields, deterministic bytes."""
    obj = dict(record.extra)
    obj["messages"] = record.messages
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")
