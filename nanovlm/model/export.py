"""Hand a NanoVLM back to the transformers ecosystem as an Idefics3 (SmolVLM) checkpoint.

``export_idefics3(model, tokenizer, out_dir)`` writes ``config.json`` (``Idefics3Config``: a SigLIP-style vision
tower, the pixel-shuffle scale, a Llama text config), ``model.safetensors`` and the tokenizer, so that
``Idefics3ForConditionalGeneration.from_pretrained(out_dir)`` rebuilds the model with the same logits. The
weights are renamed with the loader's own name maps (``pretrained.vision_names`` / ``language_names``), the
fused projections split back into q/k/v and gate/up. The checkpoint holds the weights and the tokenizer (with the
grid markers when the run split images); how images become tiles is this project's processing (``tiling.py``),
not yet written as a transformers processor config.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nanovlm.model.pretrained import CONNECTOR_WEIGHT, language_names, vision_names

VISION_PREFIX, TEXT_PREFIX = "model.vision_model.", "model.text_model."


def idefics3_config(model, tokenizer):
    """The ``Idefics3Config`` that describes ``model``."""
    from transformers import Idefics3Config, LlamaConfig

    cfg = model.cfg
    v, lang = cfg.vision, cfg.language
    text = LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=lang.hidden_size,
        num_hidden_layers=lang.num_layers,
        num_attention_heads=lang.num_heads,
        num_key_value_heads=lang.num_kv_heads,
        intermediate_size=lang.intermediate_size,
        rms_norm_eps=lang.rms_norm_eps,
        rope_theta=lang.rope_theta,
        max_position_embeddings=lang.max_position_embeddings,
        tie_word_embeddings=lang.tie_embeddings,
        hidden_act="silu",
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers,
        num_attention_heads=v.num_heads,
        image_size=v.image_size,
        patch_size=v.patch_size,
        layer_norm_eps=v.layer_norm_eps,
        hidden_act="gelu_pytorch_tanh",
    )
    return Idefics3Config(
        vision_config=vision,
        text_config=text.to_dict(),
        scale_factor=cfg.projector.pixel_shuffle_factor,
        image_token_id=model.image_token_id,
        tie_word_embeddings=lang.tie_embeddings,
    )


def idefics3_state_dict(model) -> dict[str, torch.Tensor]:
    """Our parameters under Idefics3's names, fused projections split (contiguous CPU tensors)."""
    lang = model.cfg.language
    head_dim = lang.hidden_size // lang.num_heads
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {CONNECTOR_WEIGHT: params["projector.proj.weight"]}
    for part, names in (
        ("vision", vision_names(model.vision, VISION_PREFIX)),
        ("language", language_names(model.language, TEXT_PREFIX)),
    ):
        for ours, theirs in names.items():
            t = params[f"{part}.{ours}"]
            if isinstance(theirs, str):
                out[theirs] = t
                continue
            if ".qkv_proj." in ours and part == "language":
                rows = [lang.num_heads * head_dim, lang.num_kv_heads * head_dim, lang.num_kv_heads * head_dim]
            else:  # vision q/k/v (equal thirds) and gate/up (halves)
                rows = [t.shape[0] // len(theirs)] * len(theirs)
            out.update(zip(theirs, t.split(rows)))
    return {k: t.detach().to("cpu").contiguous().clone() for k, t in out.items()}


def export_idefics3(model, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` and ``tokenizer`` as a transformers Idefics3 checkpoint directory; returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = idefics3_config(model, tokenizer)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.save_pretrained(out)
    state = idefics3_state_dict(model)
    if model.cfg.language.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    return out
