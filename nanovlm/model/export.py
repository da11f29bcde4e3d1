"""Hand a NanoVLM back to the transformers ecosystem as an Idefics3 (SmolVLM) checkpoint.

``export_idefics3(model, tokenizer, out_dir)`` writes ``config.json`` (``Idefics3Config``: a SigLIP-style vision
tower, the pixel-shuffle scale, a Llama text config), ``model.safetensors`` and the tokenizer, so that
``Idefics3ForConditionalGeneration.from_pretrained(out_dir)`` rebuilds the model with the same logits. The
weights are renamed with the loader's own name maps (``pretrained.vision_names`` / ``language_names``), the
fused projections split back into q/k/v and gate/up. The checkpoint holds the weights and the tokenizer (with the
grid markers when the run split images).

``idefics3_processor`` adds the processor (``preprocessor_config.json``, ``processor_config.json``, the chat
template) when transformers' ``Idefics3Processor`` lays images out exactly as training did: with image splitting
(every image framed by markers) under Idefics3's grid rule (``model.vision.longest_edge``), or with one squashed
view per image (``max_tiles=1``). Its chat template is the one the run trained with (``data.chat_format``). Other layouts (no markers,
our own grid rule, letterboxing) have no transformers equivalent: the export then says so and writes no
processor rather than one that would feed the model other sequences than it learned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nanovlm.model.pretrained import CONNECTOR_WEIGHT, language_names, vision_names

VISION_PREFIX, TEXT_PREFIX = "model.vision_model.", "model.text_model."


def idefics3_config(model, tokenizer, chat_format: str = "chatml"):
    """The ``Idefics3Config`` that describes ``model`` (its eos: the token that ends a turn in its chat format)."""
    from transformers import Idefics3Config, LlamaConfig

    from nanovlm.data.chat import end_token

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
        eos_token_id=tokenizer.convert_tokens_to_ids(end_token(chat_format)),
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


LANCZOS, BICUBIC = 1, 3  # PIL resampling filters, as transformers' image processors record them


def idefics3_processor(model_cfg, tokenizer, image_resize: str = "squash", chat_format: str = "chatml"):
    """(an ``Idefics3Processor`` that prepares inputs as training did, or None, and why not when None)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from nanovlm.config import image_token_count
    from nanovlm.data.chat import TEMPLATES

    v = model_cfg.vision
    common = dict(
        image_mean=list(v.image_mean), image_std=list(v.image_std), max_image_size={"longest_edge": v.image_size}
    )
    if not v.image_splitting:
        return None, (
            "the run showed images without markers (model.vision.image_splitting=false); transformers' Idefics3 "
            "processor always frames them (train with image_splitting=true and max_tiles=1 for one view per image)"
        )
    if v.longest_edge:  # Idefics3's own rule: the processor tiles exactly as training did
        images = Idefics3ImageProcessorPil(
            do_image_splitting=True, size={"longest_edge": v.longest_edge}, resample=LANCZOS, **common
        )
    elif v.max_tiles == 1 and image_resize == "squash":  # one view per image, squashed to a tile (BICUBIC)
        images = Idefics3ImageProcessorPil(do_image_splitting=False, do_resize=False, resample=BICUBIC, **common)
    else:
        return None, (
            f"the run tiled images by this project's grid rule (max_tiles={v.max_tiles}, image_resize="
            f"{image_resize}), which transformers' processor does not have (use model.vision.longest_edge for "
            "Idefics3's rule)"
        )
    return Idefics3Processor(
        images, tokenizer, image_seq_len=image_token_count(model_cfg), chat_template=TEMPLATES[chat_format]
    ), ""


def export_idefics3(
    model, tokenizer, out_dir: str | os.PathLike, image_resize: str = "squash", chat_format: str = "chatml"
) -> tuple[Path, str]:
    """Write ``model``, ``tokenizer`` and (where one exists, see the module docstring) its processor as a
    transformers Idefics3 checkpoint directory; returns it and why no processor was written ("" when one was)."""
    import copy

    from safetensors.torch import save_file

    from nanovlm.data.chat import TEMPLATES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = idefics3_config(model, tokenizer, chat_format)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.save_pretrained(out)
    state = idefics3_state_dict(model)
    if model.cfg.language.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = copy.deepcopy(tokenizer)  # the processor adds its tokens to it: leave the caller's alone
    tokenizer.chat_template = TEMPLATES[chat_format]  # the format the run trained on, not the one it came with
    processor, why_not = idefics3_processor(model.cfg, tokenizer, image_resize, chat_format)
    (processor or tokenizer).save_pretrained(out)
    return out, why_not
