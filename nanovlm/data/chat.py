"""Chat formats: how a conversation's turns are framed into text, the one fact training, the index, generation and
an exported processor share (``data.chat_format``).

``chatml`` (the default; SmolLM2, Qwen)::

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n

``smolvlm`` (SmolVLM / Idefics3 instruct checkpoints, their processor's template), one ``<|im_start|>`` for the
whole conversation, the role capitalised, ``": "`` before text and ``":"`` before an image::

    <|im_start|>User:<image>{text}<end_of_utterance>\\nAssistant: {content}<end_of_utterance>\\n

Each turn is (special tokens and text of its header, its content, end token, "\\n"); ``processing.SampleProcessor`` encodes
those pieces one by one so that it can put loss labels exactly on an assistant's content and its end token. The
pieces split where a byte-level tokenizer's pre-tokenizer splits anyway, so the ids equal a tokenization of the
rendered template (tests/unit/test_export.py checks it against transformers' processor).
"""

from __future__ import annotations

from nanovlm.constants import CHAT_FORMATS, IMAGE_TOKEN
from nanovlm.data.tokenizer import IM_END, IM_START

END_OF_UTTERANCE = "<end_of_utterance>"

# content given as a string (with <image> placeholders) or as transformers' list of parts
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
)
_STARTS_WITH_IMAGE = (
    "{% if message['content'] is string %}{% set first_image = message['content'].startswith('<image>') %}"
    "{% else %}{% set first_image = message['content'][0]['type'] == 'image' %}{% endif %}"
)
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        + _CONTENT
        + "{{ '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "smolvlm": (
        "{{ '<|im_start|>' }}{% for message in messages %}" + _STARTS_WITH_IMAGE + "{{ message['role'] | capitalize }}"
        "{% if first_image %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}" + _CONTENT + "{{ '<end_of_utterance>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    ),
}


def check_format(name: str) -> str:
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; choose one of {list(CHAT_FORMATS)}")
    return name


def end_token(name: str) -> str:
    """The special token closing every turn: the loss teaches it after an answer, and generation stops at it."""
    return IM_END if name == "chatml" else END_OF_UTTERANCE


def special_tokens(name: str) -> tuple[str, str]:
    """The special tokens a tokenizer must carry for this format."""
    return IM_START, end_token(name)


def conversation_start(name: str) -> tuple[str, ...]:
    """Special tokens before the first turn."""
    return () if name == "chatml" else (IM_START,)


def header(name: str, role: str) -> tuple[tuple[str, ...], str]:
    """(special tokens, text) that open a turn of ``role``."""
    return ((IM_START,), role + "\n") if name == "chatml" else ((), role.capitalize() + ":")


def content(name: str, text: str) -> str:
    """A message's content as the format writes it after its header."""
    return text if name == "chatml" or text.startswith(IMAGE_TOKEN) else " " + text
