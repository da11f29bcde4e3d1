"""Tokenizers: the small offline byte-level BPE of the default run, hub tokenizers, and their fingerprint.

The model needs five special tokens: ``<image>`` (placeholder, expanded to the image's tokens during
processing), ``<|im_start|>`` / ``<|im_end|>`` (ChatML turns), ``<|pad|>`` and ``<|endoftext|>``.
``load_tokenizer`` adds whichever a hub tokenizer lacks, so any causal-LM tokenizer works. With image splitting
it also adds the grid markers (``tiling.SPLIT_TOKENS``, as SmolVLM's tokenizer has them).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nanovlm.constants import IMAGE_TOKEN
from nanovlm.data.tiling import SPLIT_TOKENS

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
EOT_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOT_TOKEN, IM_START, IM_END, PAD_TOKEN, IMAGE_TOKEN)

# ChatML, as SmolLM2 / Qwen use it. The training-side encoding (processing.SampleProcessor) builds the same
# token sequence piecewise so that it can place loss labels exactly.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _ensure_special_tokens(tok: PreTrainedTokenizerBase, image_splitting: bool) -> PreTrainedTokenizerBase:
    """Add missing special tokens, set pad/eos, and a ChatML chat template when the tokenizer has none."""
    vocab = tok.get_vocab()
    wanted = SPECIAL_TOKENS + (SPLIT_TOKENS if image_splitting else ())
    has_pad = tok.pad_token is not None and tok.pad_token_id is not None
    # a tokenizer that pads already needs no <|pad|>: one token more would not fit a checkpoint's embedding
    missing = [t for t in wanted if t not in vocab and not (t == PAD_TOKEN and has_pad)]
    if missing:
        # appended: replacing the list would drop the tokenizer's other extra special tokens (and change its
        # fingerprint)
        tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    if tok.pad_token is None or tok.pad_token_id is None:
        tok.pad_token = PAD_TOKEN
    if tok.eos_token is None:
        tok.eos_token = IM_END
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(name_or_path: str | os.PathLike, image_splitting: bool = False) -> PreTrainedTokenizerBase:
    """A local tokenizer directory or a hub id (hub ids need network) with the special tokens the model needs
    (and the grid markers, for ``model.vision.image_splitting``)."""
    path = Path(name_or_path)
    looks_like_hub_id = len(path.parts) == 2 and not str(name_or_path).startswith((".", "/"))
    if not path.exists() and not looks_like_hub_id:
        raise FileNotFoundError(
            f"tokenizer directory not found: {name_or_path} (set data.tokenizer to a directory written by "
            "save_pretrained - the demo's is made by scripts/make_demo_data.py - or to a hub id such as "
            "HuggingFaceTB/SmolLM2-135M-Instruct)"
        )
    tok = AutoTokenizer.from_pretrained(str(name_or_path))
    return _ensure_special_tokens(tok, image_splitting)


def build_tokenizer(
    out_dir: str | os.PathLike, texts: Iterable[str], vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE on ``texts`` and save it (``save_pretrained``) to ``out_dir``.

    Deterministic for the same texts. Byte-level means any text encodes (no unknown token), so the demo
    tokenizer also works, less efficiently, on text it was not trained on.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(texts), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IMAGE_TOKEN, EOT_TOKEN],
    )
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tok.save_pretrained(str(tmp))
    if out.exists():
        for f in out.iterdir():
            f.unlink()
        out.rmdir()
    os.replace(tmp, out)  # a crash mid-save leaves no half-written tokenizer at out_dir
    return load_tokenizer(out)


# Text that exercises what the vocabulary alone does not decide: normalizer, pre-tokenizer (prefix spaces,
# whitespace runs, digits, punctuation), merges, unicode and the special-token strings read as plain content.
_PROBE = (
    "Hello world!  Two  spaces,\ttab\nnew line; don't STOP 12345 3.14159 (a) [b] {c} -- x_y/z\n"
    " leading space café naïve Ünïcödé 東京タワー 😀 https://example.org/a?b=c&d=1 <image> <|im_end|>"
)


def plain_text_tokenizer(tok: PreTrainedTokenizerBase):
    """A private ``tokenizers.Tokenizer`` copy of ``tok`` that reads content as plain text: special-token strings
    in it are not matched, and a padding or truncation setting stored in tokenizer.json (which transformers' own
    calls ignore, but this copy would apply to every piece of text) is switched off."""
    from tokenizers import Tokenizer

    text = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    text.no_padding()
    text.no_truncation()
    text.encode_special_tokens = True
    return text


def _hash(payload: dict) -> str:
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase, chat_format: str = "chatml") -> str:
    """Short hash of vocabulary, special tokens, chat template and how a probe text tokenizes.

    Stored in a dataset index: token lengths in an index are only valid for the tokenizer that counted them.
    The probe catches tokenizers with the same vocabulary that count differently (another pre-tokenizer,
    normalizer or merge list). (The value's layout, a hash of the vocabulary hash and the probe ids behind
    ``2-``, is what every index written so far stores.) The grid markers are left out: they are special tokens
    appended to the vocabulary, which changes no count of content text, so one prepared dataset serves runs
    with and without image splitting. A chat format other than ChatML (``chat.py``) frames turns with other
    tokens, so it is named in the value.
    """
    markers = set(SPLIT_TOKENS)
    vocab = _hash(
        {
            "vocab": sorted(kv for kv in tok.get_vocab().items() if kv[0] not in markers),
            "special": sorted(
                (t, tok.convert_tokens_to_ids(t)) for t in (set(tok.all_special_tokens) | set(SPECIAL_TOKENS)) - markers
            ),
            "chat_template": getattr(tok, "chat_template", None) or "",
        }
    )
    probe = plain_text_tokenizer(tok).encode(_PROBE, add_special_tokens=False).ids  # as SampleProcessor counts
    counted = "2-" + _hash({"legacy": vocab, "probe": probe})
    return counted if chat_format == "chatml" else f"{counted}+{chat_format}"  # another framing, other counts
