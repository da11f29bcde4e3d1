"""The nanoVLM model: SigLIP-style ViT -> pixel-shuffle projector -> Llama-style decoder, varlen attention.

Plain PyTorch (no Lightning, no torch.distributed). Entry points:

- ``build_model(model_cfg, tokenizer)``: resolves the vocabulary and the ``<image>`` id, loads pretrained
  weights when configured.
- ``num_parameters(model)``, ``flops_per_token(model_cfg, vocab_size, seq_len)`` and ``batch_flops`` for
  summaries and MFU.
- ``nanovlm.model.attention.attention(q, k, v, cu_seqlens, max_seqlen, causal, backend)``: varlen attention
  (the submodule keeps its name: the function is deliberately not re-exported here).
"""

from __future__ import annotations

import logging

from nanovlm.config import ModelConfig, image_token_count
from nanovlm.constants import IMAGE_TOKEN
from nanovlm.model.attention import BackendUnavailableError, resolve_backend
from nanovlm.model.pretrained import (
    CheckpointMismatchError,
    check_tokenizer,
    load_language_weights,
    load_vision_weights,
    load_vlm_weights,
)
from nanovlm.model.vlm import NanoVLM

__all__ = [
    "BackendUnavailableError",
    "CheckpointMismatchError",
    "NanoVLM",
    "batch_flops",
    "build_model",
    "flops_per_image",
    "flops_per_token",
    "num_parameters",
    "resolve_backend",
    "resolve_vocab_size",
]

log = logging.getLogger(__name__)


def resolve_vocab_size(model_cfg: ModelConfig, tokenizer) -> int:
    """model.language.vocab_size, or len(tokenizer) rounded up to a multiple of 64 (fast matmuls) when 0."""
    n = len(tokenizer)
    size = model_cfg.language.vocab_size
    if size == 0:
        return -(-n // 64) * 64
    if size < n:
        raise ValueError(f"model.language.vocab_size={size} is smaller than the tokenizer's {n} tokens; set it to 0")
    return size


def build_model(model_cfg: ModelConfig, tokenizer) -> NanoVLM:
    """A NanoVLM sized for ``tokenizer``, with pretrained vision/language weights when the config names them."""
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    unk = getattr(tokenizer, "unk_token_id", None)
    if image_token_id is None or (image_token_id == unk and tokenizer.unk_token != IMAGE_TOKEN):
        raise ValueError(
            f"the tokenizer has no {IMAGE_TOKEN} token; load it with nanovlm.data.tokenizer.load_tokenizer, which adds it"
        )
    model = NanoVLM(model_cfg, resolve_vocab_size(model_cfg, tokenizer), image_token_id)
    if model_cfg.vlm_checkpoint and (model_cfg.vision_checkpoint or model_cfg.language_checkpoint):
        raise ValueError("model.vlm_checkpoint loads every weight: leave model.vision_checkpoint and "
                         "model.language_checkpoint null with it")  # fmt: skip
    problems = []  # every checkpoint is checked before failing: one run shows every fix to make
    for checkpoint, load, part in (
        (model_cfg.vision_checkpoint, load_vision_weights, model.vision),
        (model_cfg.language_checkpoint, load_language_weights, model.language),
        (model_cfg.vlm_checkpoint, load_vlm_weights, model),
    ):
        if checkpoint:
            try:
                load(part, checkpoint)
            except CheckpointMismatchError as e:
                problems.append(str(e))
    if model_cfg.language_checkpoint or model_cfg.vlm_checkpoint:
        try:
            check_tokenizer(tokenizer, model_cfg.language_checkpoint or model_cfg.vlm_checkpoint)
        except CheckpointMismatchError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointMismatchError("\n".join(problems))
    return model


def num_parameters(model: NanoVLM) -> dict[str, int]:
    """Parameter counts by part: vision, projector, language, total, trainable (tied weights counted once)."""
    seen: set[int] = set()
    counts: dict[str, int] = {}
    for part in ("vision", "projector", "language"):
        n = 0
        for p in getattr(model, part).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts[part] = n
    counts["total"] = sum(counts.values())
    counts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)  # parameters() dedups
    return counts


def _language_matmul_params(model_cfg: ModelConfig) -> int:
    """Matmul parameters of the decoder blocks (attention q, k, v, o and the MLP), without the LM head."""
    lm = model_cfg.language
    head_dim = lm.hidden_size // lm.num_heads
    attn = lm.hidden_size * head_dim * (2 * lm.num_heads + 2 * lm.num_kv_heads)  # q, o + k, v
    mlp = 3 * lm.hidden_size * lm.intermediate_size
    return lm.num_layers * (attn + mlp)


def flops_per_image(model_cfg: ModelConfig) -> float:
    """Training FLOPs (forward + backward) of the vision encoder and projector for one image.

    Per patch: 6 * (matmul parameters of the blocks + patch embedding) + 12 * layers * hidden * patches
    (non-causal attention scores and weighted sum, x3 for backward); plus 6 * projector parameters per
    decoder image token.
    """
    v = model_cfg.vision
    patches = (v.image_size // v.patch_size) ** 2
    block = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size
    matmul = v.num_layers * block + 3 * v.patch_size**2 * v.hidden_size
    vision = patches * (6 * matmul + 12 * v.num_layers * v.hidden_size * patches)
    proj = v.hidden_size * model_cfg.projector.pixel_shuffle_factor**2 * model_cfg.language.hidden_size
    return float(vision + 6 * proj * image_token_count(model_cfg))


def flops_per_token(
    model_cfg: ModelConfig,
    vocab_size: int,
    seq_len: float,
    images_per_token: float = 0.0,
    head_fraction: float = 1.0,
) -> float:
    """Training FLOPs per decoder token (the PaLM / nanoGPT MFU convention, forward + backward = 3x forward).

        6 * (N + head_fraction * hidden * vocab) + 6 * layers * (num_heads * head_dim) * seq_len
            + images_per_token * flops_per_image(cfg)

    N counts the decoder blocks' matmul parameters (attention, MLP; not the embedding lookup). The LM head
    runs on ``head_fraction`` of the tokens: 1 when every position gets logits, loss tokens / tokens when
    training computes them only where a loss is taken (``NanoVLM.forward(return_logits=False)``). The attention
    term is causal: a token attends to seq_len / 2 keys on average, 2 matmuls x 2 FLOPs each, x3 for training.
    For packed data seq_len is the length a token attends within its own sample: pass
    sum(L_i^2) / sum(L_i) over the samples, not the pack size. ``images_per_token`` (images / tokens in the
    batch) adds the vision encoder and projector. Frozen parts are counted as trained (the usual convention).
    """
    lm = model_cfg.language
    head_dim = lm.hidden_size // lm.num_heads
    matmul = _language_matmul_params(model_cfg) + head_fraction * lm.hidden_size * vocab_size
    language = 6 * matmul + 6 * lm.num_layers * lm.num_heads * head_dim * seq_len
    return float(language + images_per_token * flops_per_image(model_cfg))


def batch_flops(
    model_cfg: ModelConfig, vocab_size: int, tokens: float, seq_sq: float, images: float, head_tokens: float
) -> float:
    """Training FLOPs of a batch (or of many): ``tokens`` real tokens in samples whose squared lengths sum to
    ``seq_sq``, ``images`` images, the LM head on ``head_tokens`` positions. One formula for the training
    telemetry and the benchmark, so both report the same MFU for the same work."""
    if tokens <= 0:
        return float(images * flops_per_image(model_cfg))
    per_token = flops_per_token(model_cfg, vocab_size, seq_sq / tokens, images / tokens, head_tokens / tokens)
    return per_token * tokens
