"""Load pretrained SigLIP (vision), Llama / SmolLM2 (language) or whole Idefics3 / SmolVLM weights from
transformers checkpoints.

A checkpoint is a local directory written by ``save_pretrained`` or a hub id (downloaded with
huggingface_hub; needs network, so it is opt-in by config: ``model.vision_checkpoint`` /
``model.language_checkpoint``, or ``model.vlm_checkpoint`` for all of it). The checkpoint's config is compared with ours first (sizes, heads, eps,
RoPE base, activation), then every tensor is mapped by name and shape-checked; any mismatch fails with one
error listing all of them. Load before wrapping the model with FSDP.

Name maps (ours -> transformers):

    vision    patch_embedding.*           [vision_model.]embeddings.patch_embedding.*
              position_embedding.weight   [vision_model.]embeddings.position_embedding.weight
              blocks.{i}.*                [vision_model.]encoder.layers.{i}.*   (same sub-names)
              post_layernorm.*            [vision_model.]post_layernorm.*
    language  embed_tokens.weight         model.embed_tokens.weight  (first V_ckpt rows; new tokens keep their init)
              layers.{i}.*                model.layers.{i}.*          (same sub-names)
              norm.weight                 model.norm.weight
              lm_head.weight              lm_head.weight (untied heads only)
    VLM       vision.* / language.*       model.vision_model.* / model.text_model.* (as above), lm_head.weight
              projector.proj.weight       model.connector.modality_projection.proj.weight
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A pretrained checkpoint does not fit the configured model; the message lists every difference."""


# ----------------------------------------------------------------------------------------------------------
# reading checkpoints


def resolve_checkpoint(name_or_path: str) -> Path:
    """A local directory as is, else a hub id downloaded (config + safetensors only) with huggingface_hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"checkpoint {name_or_path!r} is not a directory written by save_pretrained")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise FileNotFoundError(
            f"cannot fetch checkpoint {name_or_path!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Give a local directory (save_pretrained output), check the hub id and the network, or set the "
            "checkpoint to null for random init."
        ) from e


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (sharded or not). Only safetensors / weights-only torch files."""
    files = sorted(directory.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(str(f)))
    else:
        for f in sorted(directory.glob("pytorch_model*.bin")):
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    if not state:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {directory}")
    return state


def _find_prefix(state: dict[str, torch.Tensor], anchor: str, skip: tuple[str, ...] = ()) -> str:
    """The prefix in front of ``anchor`` (e.g. 'vision_model.' before 'embeddings.patch_embedding.weight')."""
    for key in state:
        if key.endswith(anchor) and not key.startswith(skip):
            return key[: -len(anchor)]
    raise CheckpointMismatchError(f"checkpoint has no tensor named '*{anchor}'; is it the right kind of model?")


# transformers model_type values whose architecture our modules reproduce (Mistral without a sliding window is
# Llama's architecture; SmolLM2 checkpoints say "llama").
VISION_MODEL_TYPES = ("siglip", "siglip_vision_model", "idefics3_vision", "smolvlm_vision")
LANGUAGE_MODEL_TYPES = ("llama", "mistral")
VLM_MODEL_TYPES = ("idefics3", "smolvlm")  # SigLIP-style ViT + pixel-shuffle connector + Llama decoder: ours


def _check_model_type(kind: str, where: str, hf, allowed: tuple[str, ...]) -> None:
    model_type = getattr(hf, "model_type", None)
    if model_type is not None and model_type not in allowed:
        raise CheckpointMismatchError(
            f"{kind} checkpoint {where} is a {model_type!r} model; this loader reads {' / '.join(allowed)} "
            "checkpoints (other architectures differ in ways the weights alone do not show: biases, q/k norms, "
            "attention windows)"
        )


def _check_config(kind: str, where: str, pairs: dict[str, tuple[object, object]], hint: str) -> None:
    bad = [f"{key}: checkpoint {ckpt!r} vs config {ours!r}" for key, (ckpt, ours) in pairs.items() if ckpt != ours]
    if bad:
        raise CheckpointMismatchError(
            f"{kind} checkpoint {where} does not match the model config: " + "; ".join(bad) + f". {hint}"
        )


def _copy(
    module: nn.Module,
    mapping: dict[str, str | tuple[str, ...]],
    state: dict[str, torch.Tensor],
    kind: str,
    where: str,
    rows=(),
    unused_scope: str = "",
    ignore: tuple[str, ...] = (),
):
    """Copy state[ckpt_name] into module's parameter ours_name for every pair; a tuple of checkpoint names is
    stacked by rows (fused projections); names in ``rows`` may be shorter in the checkpoint's first dimension
    (vocabulary rows); all problems are reported at once.

    A checkpoint tensor under ``unused_scope`` that no parameter takes (and that contains none of ``ignore``) is
    a problem too: it means another architecture (biases, q/k norms) whose weights would silently be dropped."""
    params = dict(module.named_parameters(remove_duplicate=False))
    problems = []
    used = {n for theirs in mapping.values() for n in ((theirs,) if isinstance(theirs, str) else theirs)}
    unused = [k for k in state if k.startswith(unused_scope) and k not in used and not any(i in k for i in ignore)]
    if unused:
        problems.append(
            f"{len(unused)} checkpoint tensor(s) have no place in this model, e.g. {unused[:4]}: the checkpoint is "
            "another architecture (this loader reads SigLIP vision and Llama-architecture language models)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in mapping.items():
        names = (theirs,) if isinstance(theirs, str) else theirs
        missing = [n for n in names if n not in state]
        if missing:
            problems += [f"missing tensor '{n}' (for {ours})" for n in missing]
            continue
        parts = [state[n] for n in names]
        if len({t.shape[1:] for t in parts}) > 1:
            problems.append(f"{' + '.join(names)} cannot be stacked: shapes {[tuple(t.shape) for t in parts]}")
            continue
        p, t = params[ours], torch.cat(parts) if len(parts) > 1 else parts[0]
        fits = t.shape == p.shape or (ours in rows and t.shape[1:] == p.shape[1:] and t.shape[0] <= p.shape[0])
        if not fits:
            problems.append(f"'{' + '.join(names)}' has shape {tuple(t.shape)} but {ours} needs {tuple(p.shape)}")
            if ours in rows and t.shape[1:] == p.shape[1:]:
                problems[-1] += (
                    f" (the checkpoint's vocabulary has {t.shape[0]} tokens, the model {p.shape[0]}, sized from"
                    " data.tokenizer or model.language.vocab_size: is data.tokenizer the checkpoint's tokenizer?)"
                )
        tensors[ours] = t
    if problems:
        raise CheckpointMismatchError(f"{kind} checkpoint {where} does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for ours, t in tensors.items():
            params[ours][: t.shape[0]].copy_(t.to(params[ours].dtype))


def _n_tensors(mapping: dict[str, str | tuple[str, ...]]) -> int:
    return sum(1 if isinstance(v, str) else len(v) for v in mapping.values())


def _fused_names(name: str) -> str | tuple[str, ...]:
    """Our parameter name -> the checkpoint's name(s), with fused projections split into their parts."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return tuple(name.replace(fused, part) for part in parts)
    return name


# ----------------------------------------------------------------------------------------------------------
# name maps (the loaders and export.py read the same ones)


def vision_names(vision: nn.Module, prefix: str) -> dict[str, str | tuple[str, ...]]:
    """Our vision parameter -> the checkpoint name(s) under ``prefix`` (fused q/k/v: three names)."""
    mapping = {}
    for name, _ in vision.named_parameters():
        if name.startswith(("patch_embedding.", "position_embedding.")):
            theirs = f"{prefix}embeddings.{name}"
        elif name.startswith("blocks."):
            theirs = f"{prefix}encoder.layers.{name[len('blocks.') :]}"
        else:
            theirs = prefix + name
        mapping[name] = _fused_names(theirs)
    return mapping


def language_names(language: nn.Module, prefix: str) -> dict[str, str | tuple[str, ...]]:
    """Our decoder parameter -> the checkpoint name(s); a tied lm_head is not listed (it is embed_tokens)."""
    return {
        name: "lm_head.weight" if name == "lm_head.weight" else _fused_names(prefix + name)
        for name, _ in language.named_parameters()
    }


# ----------------------------------------------------------------------------------------------------------
# vision


def load_vision_weights(vision: nn.Module, name_or_path: str) -> None:
    """Load a transformers SigLIP checkpoint (SiglipVisionModel or the full SiglipModel) into ``vision``."""
    from transformers import AutoConfig

    directory = resolve_checkpoint(name_or_path)
    hf = AutoConfig.from_pretrained(directory)
    _load_vision(vision, getattr(hf, "vision_config", hf), read_state_dict(directory), name_or_path)


def _load_vision(vision: nn.Module, hf, state: dict[str, torch.Tensor], name_or_path: str) -> None:
    cfg = vision.cfg
    _check_model_type("vision", name_or_path, hf, VISION_MODEL_TYPES)
    _check_config(
        "vision",
        name_or_path,
        {
            "image_size": (hf.image_size, cfg.image_size),
            "patch_size": (hf.patch_size, cfg.patch_size),
            "hidden_size": (hf.hidden_size, cfg.hidden_size),
            "num_layers": (hf.num_hidden_layers, cfg.num_layers),
            "num_heads": (hf.num_attention_heads, cfg.num_heads),
            "intermediate_size": (hf.intermediate_size, cfg.intermediate_size),
            "layer_norm_eps": (hf.layer_norm_eps, cfg.layer_norm_eps),
            "activation": (hf.hidden_act, "gelu_pytorch_tanh"),
        },
        "Set model.vision.* to the checkpoint's values (configs/model_222m.yaml fits google/siglip-base-patch16-224).",
    )
    prefix = _find_prefix(state, "embeddings.patch_embedding.weight", skip=("text_model.",))
    mapping = vision_names(vision, prefix)
    # SigLIP's pooling head ("head.*") is not used: the projector reads every patch
    _copy(vision, mapping, state, "vision", name_or_path, unused_scope=prefix, ignore=(f"{prefix}head.",))
    log.info("loaded vision weights from %s (%d tensors)", name_or_path, _n_tensors(mapping))


# ----------------------------------------------------------------------------------------------------------
# language


def _check_language_config(hf, cfg, name_or_path: str, tied_ckpt: bool) -> None:
    """Every language config value the checkpoint fixes must equal ours (one error listing the differences)."""
    # transformers >= 5: rope_parameters (theta and scaling); 4.x: rope_theta + rope_scaling ("rope_type" or "type")
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    _check_config(
        "language",
        name_or_path,
        {
            "hidden_size": (hf.hidden_size, cfg.hidden_size),
            "num_layers": (hf.num_hidden_layers, cfg.num_layers),
            "num_heads": (hf.num_attention_heads, cfg.num_heads),
            "num_kv_heads": (hf.num_key_value_heads, cfg.num_kv_heads),
            "intermediate_size": (hf.intermediate_size, cfg.intermediate_size),
            "head_dim": (head_dim, cfg.hidden_size // cfg.num_heads),
            "rope_theta": (float(theta), float(cfg.rope_theta)),
            "rope_type": (rope.get("rope_type", "default"), "default"),
            "rms_norm_eps": (hf.rms_norm_eps, cfg.rms_norm_eps),
            "activation": (hf.hidden_act, "silu"),
            "attention_bias": (getattr(hf, "attention_bias", False), False),
            "mlp_bias": (getattr(hf, "mlp_bias", False), False),
            "sliding_window": (getattr(hf, "sliding_window", None), None),
            "tie_embeddings": (tied_ckpt, tied_ckpt or cfg.tie_embeddings),  # only a tied model on an untied ckpt
        },
        "Set model.language.* to the checkpoint's values (configs/model_222m.yaml fits HuggingFaceTB/SmolLM2-135M)"
        + (
            "; RoPE scaling and sliding-window attention are not supported: use a checkpoint without them."
            if rope.get("rope_type", "default") != "default" or getattr(hf, "sliding_window", None) is not None
            else "."
        ),
    )


def load_language_weights(language: nn.Module, name_or_path: str) -> None:
    """Load a transformers Llama / SmolLM2 checkpoint (LlamaForCausalLM) into ``language``.

    The checkpoint's vocabulary may be smaller than ours (tokens added for the VLM, rounding to 64): its rows
    are copied and the extra rows keep their random init.
    """
    from transformers import AutoConfig

    directory = resolve_checkpoint(name_or_path)
    hf = AutoConfig.from_pretrained(directory)
    tied_ckpt = bool(getattr(hf, "tie_word_embeddings", False))
    if not hasattr(hf, "num_key_value_heads") and hasattr(hf, "text_config"):  # a composite config
        hf = hf.text_config
    _load_language(language, hf, read_state_dict(directory), name_or_path, tied_ckpt)


def _load_language(language: nn.Module, hf, state: dict[str, torch.Tensor], name_or_path: str, tied_ckpt: bool):
    cfg = language.cfg
    _check_model_type("language", name_or_path, hf, LANGUAGE_MODEL_TYPES)
    _check_language_config(hf, cfg, name_or_path, tied_ckpt)
    ckpt_positions = getattr(hf, "max_position_embeddings", None)
    if ckpt_positions and cfg.max_position_embeddings > ckpt_positions:
        log.warning(
            "model.language.max_position_embeddings=%d exceeds %s's %d: samples longer than %d tokens put the "
            "decoder at positions it was not trained on",
            cfg.max_position_embeddings,
            name_or_path,
            ckpt_positions,
            ckpt_positions,
        )
    prefix = _find_prefix(state, "embed_tokens.weight")
    mapping = language_names(language, prefix)
    if "lm_head.weight" in mapping and tied_ckpt:
        mapping["lm_head.weight"] = prefix + "embed_tokens.weight"  # untied head initialised from tied weights
    _copy(
        language,
        mapping,
        state,
        "language",
        name_or_path,
        rows=("embed_tokens.weight", "lm_head.weight"),
        unused_scope=prefix,
        ignore=("rotary_emb.inv_freq", *(("lm_head.weight",) if tied_ckpt else ())),  # buffers; a tied copy
    )
    n_ckpt = state[prefix + "embed_tokens.weight"].shape[0]
    log.info(
        "loaded language weights from %s (%d tensors; vocabulary rows %d of %d from the checkpoint)",
        name_or_path,
        _n_tensors(mapping),
        n_ckpt,
        language.vocab_size,
    )


# ----------------------------------------------------------------------------------------------------------
# a whole VLM: Idefics3 / SmolVLM

CONNECTOR_WEIGHT = "model.connector.modality_projection.proj.weight"


def load_vlm_weights(model: nn.Module, name_or_path: str) -> None:
    """Load a transformers Idefics3 / SmolVLM checkpoint (Idefics3ForConditionalGeneration) into a NanoVLM:
    vision tower, connector, decoder and LM head. The architectures are the same (a SigLIP ViT, the same pixel
    shuffle, one bias-free linear map, a Llama decoder), so nothing is approximated; every config value the
    checkpoint fixes is checked and all differences are reported in one error."""
    from transformers import AutoConfig

    directory = resolve_checkpoint(name_or_path)
    hf = AutoConfig.from_pretrained(directory)
    _check_model_type("VLM", name_or_path, hf, VLM_MODEL_TYPES)
    state = read_state_dict(directory)
    problems = []
    for load in (
        lambda: _check_vlm_config(model, hf, name_or_path),
        lambda: _check_vlm_processor(model.cfg.vision, directory, name_or_path),
        lambda: _load_vision(model.vision, hf.vision_config, state, name_or_path),
        lambda: _load_language(model.language, hf.text_config, state, name_or_path, bool(hf.tie_word_embeddings)),
        lambda: _copy(
            model.projector,
            {"proj.weight": CONNECTOR_WEIGHT},
            state,
            "connector",
            name_or_path,
            unused_scope="model.connector.",
        ),  # fmt: skip
    ):
        try:
            load()
        except CheckpointMismatchError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointMismatchError("\n".join(problems))
    log.info("loaded the whole VLM from %s", name_or_path)


def _check_vlm_config(model: nn.Module, hf, name_or_path: str) -> None:
    _check_config(
        "VLM",
        name_or_path,
        {
            "pixel_shuffle_factor": (hf.scale_factor, model.cfg.projector.pixel_shuffle_factor),
            "image_token_id": (hf.image_token_id, model.image_token_id),
        },
        "Set model.projector.pixel_shuffle_factor to the checkpoint's scale_factor, and prepare the data with the "
        "checkpoint's tokenizer (data.tokenizer) so that <image> has its id.",
    )


def _check_vlm_processor(vision, directory: Path, name_or_path: str) -> None:
    """The images must reach the model as the checkpoint's processor prepared them in its training: the same tile
    size, normalisation and layout (Idefics3's grid rule with its longest edge, or one framed view per image)."""
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        log.info("%s has no preprocessor_config.json: cannot check the image preprocessing", name_or_path)
        return
    proc = json.loads(path.read_text())
    pairs = {
        "model.vision.image_size": (proc.get("max_image_size", {}).get("longest_edge"), vision.image_size),
        "model.vision.image_mean": (
            [float(x) for x in proc.get("image_mean", [])],
            [float(x) for x in vision.image_mean],
        ),
        "model.vision.image_std": ([float(x) for x in proc.get("image_std", [])], [float(x) for x in vision.image_std]),
        "model.vision.image_splitting": (True, vision.image_splitting),  # its processor frames every image
    }
    if proc.get("do_image_splitting", True):
        pairs["model.vision.longest_edge"] = (proc.get("size", {}).get("longest_edge"), vision.longest_edge)
    elif vision.longest_edge == 0:
        pairs["model.vision.max_tiles"] = (1, vision.max_tiles)  # one view per image
    else:
        pairs["model.vision.longest_edge"] = (0, vision.longest_edge)
    _check_config(
        "VLM",
        name_or_path,
        pairs,
        "Set these keys to what the checkpoint's processor (its preprocessor_config.json) does, so that images "
        "reach the model as they did in its training.",
    )


def checkpoint_chat_format(name_or_path: str) -> str | None:
    """The chat format (``data/chat.py``) a checkpoint was tuned with, read from the chat template it ships
    (processor or tokenizer): "smolvlm" when its turns end with <end_of_utterance>, "chatml" with <|im_end|>,
    None without a template."""
    from nanovlm.data.chat import END_OF_UTTERANCE
    from nanovlm.data.tokenizer import IM_END

    directory = resolve_checkpoint(name_or_path)
    templates = (
        [(directory / "chat_template.jinja").read_text()] if (directory / "chat_template.jinja").is_file() else []
    )
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            templates.append(str(json.loads((directory / name).read_text()).get("chat_template") or ""))
    for template in filter(None, templates):
        if END_OF_UTTERANCE in template:
            return "smolvlm"
        if IM_END in template:
            return "chatml"
    return None


def check_tokenizer(tokenizer, name_or_path: str) -> None:
    """The training tokenizer must give the checkpoint's tokens the checkpoint's ids, or the copied embedding rows
    belong to other tokens (training would start from scrambled embeddings, with no error anywhere). Checked
    against the tokenizer.json saved with the checkpoint, when there is one; tokens added after the checkpoint's
    vocabulary (<image>, padding) do not matter."""
    directory = resolve_checkpoint(name_or_path)
    path = directory / "tokenizer.json"
    if not path.is_file():
        log.info("%s has no tokenizer.json: cannot check that data.tokenizer is the checkpoint's", name_or_path)
        return
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    ours = tokenizer.get_vocab()
    wrong = sorted((i, t, ours.get(t)) for t, i in theirs.items() if ours.get(t) != i)
    if wrong:
        examples = ", ".join(f"{t!r} is {i} there, {o} here" for i, t, o in wrong[:3])
        raise CheckpointMismatchError(
            f"data.tokenizer is not the tokenizer of language checkpoint {name_or_path}: {len(wrong)} of its "
            f"{len(theirs)} tokens have another id ({examples}), so the copied embedding rows would belong to other "
            f"tokens. Prepare the data with the checkpoint's tokenizer (data.tokenizer={directory})."
        )
