"""Configuration schema and loader.

The nested dataclasses below *are* the schema: every key a YAML file or a CLI override may set is a field
here, with its type and default. ``load_config`` merges, in order of increasing precedence,

    schema defaults  ->  YAML file(s) (left to right)  ->  ``key=value`` overrides (OmegaConf dot-list)

in OmegaConf struct mode, so a misspelled key or a value of the wrong type fails immediately, with a
message that names the key (and the closest valid key), before any model or data is touched.

Sections follow Megatron's grouping: ``model``, ``data``, ``optim``, ``trainer``, ``checkpoint``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from nanovlm.constants import BACKENDS, CHAT_FORMATS, IMAGE_DECODES, LOSS_KERNELS, MAX_SHUFFLE_BUFFER

# ----------------------------------------------------------------------------------------------------------
# model


@dataclass
class VisionConfig:
    """SigLIP-style ViT encoder (conv patch embedding, learned positions, no CLS token)."""

    image_size: int = 224  # input resolution (square): of the whole image, or of each tile with splitting
    image_splitting: bool = False  # show each image as a grid of image_size tiles + a global view (data/tiling.py)
    max_tiles: int = 4  # with image_splitting: most grid tiles per image (the global view comes on top), <= 36
    longest_edge: int = 0  # with image_splitting: 0 = our grid rule; > 0 = Idefics3/SmolVLM's (longest edge -> this)
    patch_size: int = 16  # conv patch size; the encoder sees (image_size / patch_size)^2 patches
    hidden_size: int = 768  # width of the encoder
    num_layers: int = 12  # transformer blocks
    num_heads: int = 12  # attention heads (head dim = hidden_size / num_heads)
    intermediate_size: int = 3072  # MLP width (GELU-tanh)
    layer_norm_eps: float = 1e-6  # LayerNorm epsilon, as in SigLIP
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])  # per-channel mean, 0..1 scale
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])  # per-channel std, 0..1 scale


@dataclass
class ProjectorConfig:
    """Pixel shuffle (space-to-depth on the patch grid) followed by one linear map to the decoder width."""

    pixel_shuffle_factor: int = 2  # 2 turns a 14x14 patch grid into 7x7 image tokens; must divide the grid side


@dataclass
class LanguageConfig:
    """Llama / SmolLM2-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    vocab_size: int = 0  # 0 = take it from the tokenizer (rounded up to a multiple of 64)
    hidden_size: int = 576  # decoder width
    num_layers: int = 30  # decoder blocks
    num_heads: int = 9  # query heads
    num_kv_heads: int = 3  # key/value heads (GQA); must divide num_heads
    intermediate_size: int = 1536  # SwiGLU width
    rope_theta: float = 100000.0  # RoPE base
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    max_position_embeddings: int = 8192  # longest position a sample may reach (positions restart per sample)
    tie_embeddings: bool = True  # share input embedding and LM head weights


@dataclass
class ModelConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    language: LanguageConfig = field(default_factory=LanguageConfig)
    attn_backend: str = "auto"  # auto | flash_attn | torch_varlen | sdpa
    init_std: float = 0.02  # std of the normal init of linear and token weights (see NanoVLM.init_weights)
    loss_chunk_rows: int = 0  # LM head + cross-entropy this many loss rows at a time (no [N, vocab] logits); 0 = off
    loss_kernel: str = "auto"  # auto | torch | liger (Liger's fused head + loss on CUDA: pip install -e .[liger])
    vision_checkpoint: str | None = None  # transformers SigLIP checkpoint (hub id or dir) to load; None = random
    language_checkpoint: str | None = None  # transformers Llama/SmolLM2 checkpoint to load; None = random
    vlm_checkpoint: str | None = None  # transformers Idefics3/SmolVLM checkpoint: every weight (not with the two above)


# ----------------------------------------------------------------------------------------------------------
# data


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=lambda: ["data/demo/train"])  # dataset directories (shards + index)
    train_weights: list[float] = field(default_factory=list)  # per-directory repeat factor per epoch; [] = all 1.0
    val: list[str] = field(default_factory=lambda: ["data/demo/val"])  # validation directories; [] = no validation
    val_samples: int = (
        0  # validate on the first N samples of data.val (stored order; the same set on any topology); 0 = all
    )
    tokenizer: str = "data/demo/tokenizer"  # local tokenizer dir or hub id (hub ids need network)
    make_demo_if_missing: bool = True  # build the procedural demo dataset + tokenizer when the paths above are absent
    max_tokens: int = 4096  # token budget per pack (text + image tokens): the T of every [1, T] batch
    max_images: int = 16  # encoder inputs per pack: images, or tiles with model.vision.image_splitting
    overlength: str = "drop"  # what to do with a sample longer than max_tokens: drop | truncate (counted)
    packing: str = "packed"  # packed | pad_to_longest | constrained (the last two are baselines)
    batch_size: int = 8  # samples per batch for the padded baselines (packed mode always yields one pack)
    pad_cutoff: int = 0  # constrained padding: samples above this are truncated/dropped; 0 = max_tokens
    lookahead: int = 64  # packer lookahead buffer (samples): candidates for each pack's subset-sum fill
    max_carry: int = 8  # a sample left over this many packs is overdue: packs start with the oldest overdue one
    shuffle_buffer: int = 256  # bounded sample shuffle window within the epoch order
    num_workers: int = 2  # DataLoader workers per rank (0 = in the main process)
    queue_size: int = 4  # finished packs buffered by each producer (memory = queue_size x pack size)
    pin_memory: bool = True  # pin batches when training on a GPU
    static_shapes: bool = False  # every pack has the same tensor shapes (for trainer.compile=step; see collate.py)
    image_resize: str = "squash"  # squash | letterbox: how images reach vision.image_size
    image_decode: str = "worker"  # worker | device: JPEGs decoded on the training device (nvJPEG on CUDA), not tiles
    chat_format: str = "chatml"  # chatml | smolvlm (SmolVLM/Idefics3 instruct checkpoints): how turns are framed
    max_image_pixels: int = 64_000_000  # larger images are skipped (decompression-bomb guard)
    max_skip_rate: float = 0.1  # fail when more than this fraction of an epoch's samples is skipped
    cache_dir: str = (
        ""  # remote datasets (s3://, https://): local index copies and shards; "" = $NANOVLM_CACHE or ~/.cache/nanovlm
    )
    cache_max_bytes: int = 20_000_000_000  # staged remote shards kept at most (per node: its processes share them)
    prefetch_shards: int = 2  # remote shards each DataLoader worker fetches ahead of the one it reads; 0 = off
    seed: int = 1234  # data order seed (epoch order is derived from seed and epoch)


# ----------------------------------------------------------------------------------------------------------
# optim


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate of the language model (and the default for the other groups)
    vision_lr: float = 0.0  # peak lr for the vision encoder; 0 = use lr
    projector_lr: float = 0.0  # peak lr for the projector; 0 = use lr
    freeze_vision: bool = False  # no gradients for the vision encoder
    freeze_projector: bool = False  # no gradients for the projector
    freeze_language: bool = False  # no gradients for the language model
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not applied to norms, biases, embeddings)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    schedule: str = "cosine"  # cosine | linear | constant (all with linear warmup)
    warmup_steps: int = 100  # linear warmup from 0 to the peak lr
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak lr (cosine / linear)
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping


# ----------------------------------------------------------------------------------------------------------
# trainer


@dataclass
class TrainerConfig:
    run_dir: str = "runs/default"  # everything a run writes: resolved config, logs, checkpoints
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: Any = "auto"  # int (processes per node) or "auto"
    num_nodes: int = 1  # nodes in a multi-node run (torchrun --nnodes / SLURM)
    strategy: str = "auto"  # auto | ddp | fsdp (FSDP2 via fully_shard per block)
    precision: str = "auto"  # auto (bf16-mixed on GPU, 32-true on CPU) | bf16-mixed | 32-true | ...
    max_steps: int = 1000  # optimizer steps to train
    accumulate_grad_batches: int = 1  # packs per optimizer step
    val_every_n_steps: int = 0  # run validation every N optimizer steps; 0 = only at the end
    val_batches: int = (
        -1
    )  # per-rank cap on packs per validation run; -1 = no cap, 0 = no validation (see data.val_samples)
    log_every_n_steps: int = 10  # telemetry interval
    logger: str = "csv"  # csv | tensorboard | none
    progress_bar: bool = True  # show the progress bar with loss, tokens/s and fill
    activation_checkpointing: bool = False  # recompute block activations in backward (saves memory)
    compile: str = "none"  # none | blocks (torch.compile each block) | step (the whole forward + backward; needs data.static_shapes)
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = guess from the GPU name (CPU: MFU not reported)
    seed: int = 1234  # model init and dropout seed
    eval_at_end: bool = True  # after training: held-out accuracy and a few generated answers
    eval_samples: int = 256  # held-out samples for the end-of-run evaluation (fewer make it noisy: 64 give +-6 points)
    stop_at_step: int = 0  # save a checkpoint and stop after this step, as if preempted (time-sliced jobs); 0 = off


# ----------------------------------------------------------------------------------------------------------
# checkpoint


@dataclass
class CheckpointConfig:
    dir: str = ""  # where checkpoints go; "" = <run_dir>/checkpoints
    every_n_steps: int = 500  # periodic checkpoint interval in optimizer steps; 0 = only the final one
    keep_last: int = 3  # periodic checkpoints to keep (the newest ones)
    resume: str = "auto"  # auto (latest in dir, if any) | none | path to a checkpoint file
    # A new stage from a finished one: model weights from this checkpoint file when the run starts fresh (new
    # optimizer, step 0, new data stream); ignored once the run has checkpoints of its own to resume.
    init_from: str = ""
    # full: one file of gathered tensors, written by rank 0 (portable; fine up to a few billion parameters).
    # sharded: a directory where every rank writes its own shards (torch.distributed.checkpoint); trainer.strategy
    # =fsdp only; resumes on any world size.
    format: str = "full"
    # sharded only: a save copies the shards to host memory and returns; a background thread writes them while
    # training goes on (published once written; the next save, a stop and the end of training wait for it)
    async_save: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# ----------------------------------------------------------------------------------------------------------
# loading

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the shipped configs (configs/ in a checkout links here)


class ConfigError(ValueError):
    """A config file or override does not fit the schema. The message names the key and what is wrong."""


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted keys of the schema, e.g. ['model.vision.image_size', ...] (sections included)."""
    keys: list[str] = []
    for f in fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(_schema_keys(type(default), path + "."))
    return keys


def _suggest(key: str) -> str:
    """Closest valid key to a misspelled dotted ``key``: same section first, then anywhere."""
    valid = _schema_keys(Config)
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in valid if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
    for pool in (siblings, valid):
        names = [k.rsplit(".", 1)[-1] for k in pool] if pool is siblings else pool
        target = key.rsplit(".", 1)[-1] if pool is siblings else key
        match = difflib.get_close_matches(target, names, n=1, cutoff=0.5)
        if match:
            return f"{parent}.{match[0]}" if pool is siblings and parent else match[0]
    return ""


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        hint = _suggest(key)
        msg = f"unknown config key '{key}' in {source}"
        if hint:
            msg += f"; did you mean '{hint}'?"
        return ConfigError(msg)
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        expected = _type_name(key)
        if expected.startswith("list"):  # OmegaConf's own text ("AnyNode is not a ListConfig ...") says little
            msg = f"a list is expected; write it in brackets, e.g. {key}=[a,b] (or {key}=[] for none)"
        return ConfigError(f"bad value for config key '{key}' in {source}: {msg} (expected type: {expected})")
    return ConfigError(f"config error in {source}: {err}")


def _type_name(key: str) -> str:
    node: Any = Config
    item = key.endswith("]")  # an element of a list: 'data.train_weights[0]'
    for part in key.split("[")[0].split("."):
        match = [f for f in fields(node) if f.name == part] if is_dataclass(node) else []
        if not match:
            return "?"
        f = match[0]
        node = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        node = type(node) if is_dataclass(node) else f.type
    name = node if isinstance(node, str) else getattr(node, "__name__", str(node))
    if item and name.startswith("list[") and name.endswith("]"):
        return name[5:-1]
    return name


def _check_values(cfg: Config) -> None:
    """Semantic checks that types alone cannot express (choices, divisibility)."""
    choices = {
        "model.attn_backend": (cfg.model.attn_backend, set(BACKENDS)),
        "model.loss_kernel": (cfg.model.loss_kernel, set(LOSS_KERNELS)),
        "data.overlength": (cfg.data.overlength, {"drop", "truncate"}),
        "data.packing": (cfg.data.packing, {"packed", "pad_to_longest", "constrained"}),
        "data.image_resize": (cfg.data.image_resize, {"squash", "letterbox"}),
        "data.image_decode": (cfg.data.image_decode, set(IMAGE_DECODES)),
        "data.chat_format": (cfg.data.chat_format, set(CHAT_FORMATS)),
        "optim.schedule": (cfg.optim.schedule, {"cosine", "linear", "constant"}),
        "trainer.strategy": (cfg.trainer.strategy, {"auto", "ddp", "fsdp", "single"}),
        "trainer.logger": (cfg.trainer.logger, {"csv", "tensorboard", "none"}),
        "trainer.compile": (cfg.trainer.compile, {"none", "blocks", "step"}),
        "checkpoint.format": (cfg.checkpoint.format, {"full", "sharded"}),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"bad value for config key '{key}': {value!r}; choose one of {sorted(allowed)}")
    v, lm = cfg.model.vision, cfg.model.language
    if v.image_size % v.patch_size:
        raise ConfigError("model.vision.image_size must be a multiple of model.vision.patch_size")
    grid = v.image_size // v.patch_size
    if grid % cfg.model.projector.pixel_shuffle_factor:
        raise ConfigError(
            f"model.projector.pixel_shuffle_factor={cfg.model.projector.pixel_shuffle_factor} must divide the "
            f"patch grid side {grid} (image_size / patch_size)"
        )
    if v.hidden_size % v.num_heads or lm.hidden_size % lm.num_heads or lm.num_heads % lm.num_kv_heads:
        raise ConfigError("hidden sizes must divide by head counts, and language.num_heads by num_kv_heads")
    if cfg.data.max_tokens <= 0 or cfg.data.max_images <= 0:
        raise ConfigError("data.max_tokens and data.max_images must be positive")
    if v.image_splitting and not 1 <= v.max_tiles <= 36:
        raise ConfigError(
            f"bad value for config key 'model.vision.max_tiles': {v.max_tiles}; 1..36 (grids of at most 6 x 6 tiles)"
        )
    if v.image_splitting and v.longest_edge:
        from nanovlm.data.tiling import MAX_GRID_SIDE, MAX_IDEFICS3_EDGE, idefics3_side

        if (
            not v.image_size <= v.longest_edge <= MAX_IDEFICS3_EDGE
            or idefics3_side(v.image_size, v.longest_edge) > MAX_GRID_SIDE
        ):
            raise ConfigError(
                f"bad value for config key 'model.vision.longest_edge': {v.longest_edge}; 0 (our grid rule) or "
                f"image_size ({v.image_size}) .. {min(MAX_GRID_SIDE * v.image_size, MAX_IDEFICS3_EDGE)} (at most "
                f"{MAX_GRID_SIDE} tiles a side, {MAX_IDEFICS3_EDGE} px)"
            )
    if cfg.data.max_tokens > lm.max_position_embeddings:
        raise ConfigError(
            f"data.max_tokens={cfg.data.max_tokens} exceeds model.language.max_position_embeddings="
            f"{lm.max_position_embeddings}: a sample may be that long, and its positions would go beyond what the "
            "decoder is configured for (a pretrained one was trained up to its own value); lower data.max_tokens "
            "or raise model.language.max_position_embeddings"
        )
    _check_combinations(cfg)
    _check_ranges(cfg)


def _check_combinations(cfg: Config) -> None:
    """Keys whose values are fine alone but not together."""
    if cfg.trainer.compile == "step" and (
        not cfg.data.static_shapes or cfg.data.packing != "packed" or cfg.trainer.strategy == "fsdp"
    ):
        raise ConfigError(
            "trainer.compile=step compiles one graph for every step: it needs data.static_shapes=true and "
            f"data.packing=packed (got {cfg.data.static_shapes} and {cfg.data.packing!r}), and does not run with "
            f"trainer.strategy=fsdp (got {cfg.trainer.strategy!r}; use trainer.compile=blocks there)"
        )
    if cfg.checkpoint.format == "sharded" and cfg.trainer.strategy != "fsdp":
        raise ConfigError(
            f"checkpoint.format=sharded writes each rank's FSDP shards: it needs trainer.strategy=fsdp (got "
            f"{cfg.trainer.strategy!r}; other strategies hold the whole model on every rank and write one file)"
        )
    if cfg.checkpoint.async_save and cfg.checkpoint.format != "sharded":
        raise ConfigError(
            "checkpoint.async_save writes sharded checkpoints in the background: it needs "
            f"checkpoint.format=sharded (got {cfg.checkpoint.format!r})"
        )
    if cfg.data.image_decode == "device" and cfg.model.vision.image_splitting:
        raise ConfigError(
            "data.image_decode=device decodes each JPEG into one view on the device; with "
            "model.vision.image_splitting the tiles are cut in the DataLoader workers: use data.image_decode=worker"
        )
    if cfg.data.static_shapes and cfg.data.packing != "packed":
        raise ConfigError("data.static_shapes lays out packs: it needs data.packing=packed")
    if cfg.data.train_weights and len(cfg.data.train_weights) != len(cfg.data.train):
        raise ConfigError("data.train_weights must have one weight per data.train directory (or be empty)")
    if cfg.checkpoint.resume not in {"auto", "none"} and not cfg.checkpoint.resume:
        raise ConfigError("checkpoint.resume must be 'auto', 'none' or a checkpoint path")


def _check_ranges(cfg: Config) -> None:
    """Numbers outside their meaningful range fail here, naming the key, instead of deep inside a run (a
    ZeroDivisionError, a Lightning exception after the data setup) or silently (a negative learning rate)."""
    d, o, t, c = cfg.data, cfg.optim, cfg.trainer, cfg.checkpoint
    at_least = {
        -1: {"trainer.val_batches": t.val_batches},  # -1: no cap
        1: {
            "trainer.max_steps": t.max_steps,
            "trainer.accumulate_grad_batches": t.accumulate_grad_batches,
            "trainer.log_every_n_steps": t.log_every_n_steps,
            "trainer.num_nodes": t.num_nodes,
            "checkpoint.keep_last": c.keep_last,
            "data.lookahead": d.lookahead,
            "data.queue_size": d.queue_size,
            "data.batch_size": d.batch_size,
            "data.cache_max_bytes": d.cache_max_bytes,
        },
        0: {
            "trainer.val_every_n_steps": t.val_every_n_steps,
            "trainer.eval_samples": t.eval_samples,
            "trainer.stop_at_step": t.stop_at_step,
            "trainer.peak_tflops": t.peak_tflops,
            "checkpoint.every_n_steps": c.every_n_steps,
            "data.num_workers": d.num_workers,
            "data.shuffle_buffer": d.shuffle_buffer,  # 0: no shuffling
            "data.max_image_pixels": d.max_image_pixels,  # 0: no limit of our own
            "data.max_carry": d.max_carry,
            "model.loss_chunk_rows": cfg.model.loss_chunk_rows,  # 0: off
            "data.val_samples": d.val_samples,
            "data.pad_cutoff": d.pad_cutoff,
            "data.max_skip_rate": d.max_skip_rate,
            "data.prefetch_shards": d.prefetch_shards,
            "optim.lr": o.lr,
            "optim.vision_lr": o.vision_lr,
            "optim.projector_lr": o.projector_lr,
            "optim.weight_decay": o.weight_decay,
            "optim.warmup_steps": o.warmup_steps,
            "optim.grad_clip": o.grad_clip,
        },
    }
    for low, values in at_least.items():
        for key, value in values.items():
            if value < low:
                raise ConfigError(f"bad value for config key '{key}': {value}; it must be >= {low}")
    if d.shuffle_buffer > MAX_SHUFFLE_BUFFER:
        raise ConfigError(
            f"bad value for config key 'data.shuffle_buffer': {d.shuffle_buffer}; it must be <= {MAX_SHUFFLE_BUFFER}"
        )
    if any(w < 0 for w in d.train_weights):
        raise ConfigError(f"bad value for config key 'data.train_weights': {d.train_weights}; weights must be >= 0")
    from nanovlm.data.remote import redact

    for key, dirs in (("data.train", d.train), ("data.val", d.val)):
        for u in dirs:
            if redact(u) != u:  # a user:password@ or a query string (a presigned token): never kept or logged
                raise ConfigError(
                    f"bad value for config key '{key}': {redact(u)} with credentials or a query string (not shown); "
                    "give the plain URL: credentials come from the store's environment (AWS_ACCESS_KEY_ID, "
                    "AWS_PROFILE, HF_TOKEN, ...), never from the config"
                )
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"bad value for config key 'optim.betas': {o.betas}; two numbers in [0, 1), e.g. [0.9, 0.95]")
    if not o.eps > 0 or not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.eps must be > 0 and optim.min_lr_ratio within [0, 1]")
    if not (t.devices == "auto" or (isinstance(t.devices, int) and not isinstance(t.devices, bool) and t.devices >= 1)):
        raise ConfigError(f"bad value for config key 'trainer.devices': {t.devices!r}; a number >= 1 or 'auto'")


def image_token_count(cfg: ModelConfig) -> int:
    """Decoder tokens per image: (grid / shuffle factor)^2."""
    grid = cfg.vision.image_size // cfg.vision.patch_size
    return (grid // cfg.projector.pixel_shuffle_factor) ** 2


def resolve_path(path: str | os.PathLike) -> Path:
    """A config file given as a bare name ('ddp.yaml') is looked up in configs/ when not found as given."""
    p = Path(path)
    if not p.exists() and (CONFIG_DIR / p).exists():
        return CONFIG_DIR / p
    return p


def load_config(files: Sequence[str | os.PathLike] = (), overrides: Sequence[str] = ()) -> Config:
    """Schema defaults <- YAML files (in order) <- ``key=value`` overrides; strict keys and types.

    Raises ConfigError naming the offending key (with the closest valid key for a typo) or file.
    """
    merged: DictConfig = OmegaConf.structured(Config)
    OmegaConf.set_struct(merged, True)
    for f in files:
        path = resolve_path(f)
        if not path.is_file():
            raise ConfigError(f"config file not found: {f}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"cannot parse config file {path}: {e}") from e
        if loaded is None or not isinstance(loaded, DictConfig):
            if loaded is None or len(loaded) == 0:
                continue
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as e:
            raise _explain(e, str(path)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. trainer.max_steps=10)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _explain(e, f"override '{item}'") from None
        except TypeError:  # 'data.train[0]=x': OmegaConf cannot merge one element into a typed list
            key = item.split("=", 1)[0]
            raise ConfigError(
                f"override '{item}': set the whole list, e.g. {key.split('[')[0]}=[a,b] (elements of a list cannot "
                "be set one by one)"
            ) from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _expand_home(cfg)
    _check_values(cfg)
    return cfg


def _expand_home(cfg: Config) -> None:
    """'~/...' in a path key means the home directory, as in a shell (a quoted or YAML value is not expanded)."""

    def home(p: str | None) -> str | None:
        return None if p is None else os.path.expanduser(p)

    d, t, c, m = cfg.data, cfg.trainer, cfg.checkpoint, cfg.model
    d.train, d.val = [home(p) for p in d.train], [home(p) for p in d.val]
    d.tokenizer, t.run_dir, c.dir, c.init_from = home(d.tokenizer), home(t.run_dir), home(c.dir), home(c.init_from)
    d.cache_dir = home(d.cache_dir)
    m.vision_checkpoint, m.language_checkpoint = home(m.vision_checkpoint), home(m.language_checkpoint)
    m.vlm_checkpoint = home(m.vlm_checkpoint)
    if c.resume not in ("auto", "none"):
        c.resume = home(c.resume)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what a run directory stores as config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to <run_dir>/config.yaml and return its path."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)
    return path
