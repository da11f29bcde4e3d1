"""NanoVLM: vision encoder -> projector -> image embeddings spliced into the decoder's token stream.

Text carries ``image_token_count`` copies of the ``<image>`` token id per image; the projected embeddings of
image i replace the i-th run of placeholders, in order of appearance. A mismatch between placeholders and
images is an error that names the samples, never a silent misalignment.

``forward(batch)`` consumes the packed batch of docs/data.md (or a padded [B, T] batch with
``attention_mask``) and returns logits and the mean next-token loss over ``labels != -100``;
``forward(batch, return_logits=False)`` (training) computes logits only where that loss is taken.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanovlm.config import ModelConfig, image_token_count
from nanovlm.constants import DEFERRED_JPEGS, IGNORE_INDEX
from nanovlm.model.language import KVCache, LanguageModel, RMSNorm
from nanovlm.model.loss import linear_cross_entropy, resolve_loss_kernel
from nanovlm.model.projector import Projector
from nanovlm.model.vision import VisionEncoder


def loss_rows(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into [B * T] of the positions whose next label is a loss token (labels unshifted, [B, T]).

    Position (b, t) predicts labels[b, t + 1]; the last position of a row predicts nothing.
    """
    predicts = F.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)  # [B, T]
    return predicts.reshape(-1).nonzero().squeeze(1)  # [N] int64


class NanoVLM(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, image_token_id: int) -> None:
        super().__init__()
        if not 0 <= image_token_id < vocab_size:
            raise ValueError(f"image_token_id {image_token_id} is outside the vocabulary [0, {vocab_size})")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.image_token_count = image_token_count(cfg)
        self.vision = VisionEncoder(cfg.vision, cfg.attn_backend)
        self.projector = Projector(cfg)
        self.language = LanguageModel(cfg.language, vocab_size, cfg.attn_backend)
        # Run the vision path on every forward, also for a pack without images and without gradients (a blank
        # image scaled by zero). Set when the model is sharded (FSDP2): each vision block all-gathers its weights
        # on forward, so a rank that skipped them would pair its next all-gather with another rank's vision one.
        self.vision_every_forward = False
        self._pixel_stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # see normalize
        self.init_weights()

    # ------------------------------------------------------------------------------------------------------
    # init

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init: N(0, init_std) for linear and embedding weights, with the residual output projections
        scaled by 1/sqrt(2 * layers) (GPT-2) so the residual stream does not grow with depth; zero biases, unit
        norms; the vision encoder's patch and position embeddings as SigLIP (below). Public so that a model built
        on the meta device can be materialised and initialised."""
        std = self.cfg.init_std
        residual_out = {"out_proj", "fc2", "o_proj", "down_proj"}
        for part, depth in ((self.vision, self.cfg.vision.num_layers), (self.language, self.cfg.language.num_layers)):
            for name, module in part.named_modules():
                if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
                    scale = 1 / math.sqrt(2 * depth) if name.rsplit(".", 1)[-1] in residual_out else 1.0
                    nn.init.normal_(module.weight, mean=0.0, std=std * scale)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, RMSNorm):
                    nn.init.ones_(module.weight)
        nn.init.normal_(self.projector.proj.weight, mean=0.0, std=std)
        # The ViT's input stream as SigLIP initialises it: the patch embedding fan-in scaled (LeCun normal), so
        # unit-scale pixels give unit-scale patch features, and positions at 1/sqrt(width). With init_std (0.02)
        # the stream starts at ~0.1 RMS, the blocks' attention outputs soon outweigh it, and every patch of an
        # image drifts towards the image mean: colour, shape and position are lost before the decoder sees them.
        patch = self.vision.patch_embedding.weight  # [hidden, 3, patch, patch]
        nn.init.normal_(patch, mean=0.0, std=patch[0].numel() ** -0.5)
        nn.init.normal_(self.vision.position_embedding.weight, mean=0.0, std=self.cfg.vision.hidden_size**-0.5)

    # ------------------------------------------------------------------------------------------------------
    # images

    def normalize(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """uint8 [n, 3, H, W] -> (x / 255 - mean) / std in the vision encoder's parameter dtype.

        mean and std are made once per device: building them from Python lists copies from pageable host memory,
        which on CUDA waits for every kernel already queued (twice per step). Not buffers: they stay fp32 when
        the model is cast to bf16, and out of checkpoints."""
        dev, v = pixel_values.device, self.cfg.vision
        if torch.compiler.is_compiling():  # constants of the graph (the cache would add a guard and a recompile)
            mean, std = (torch.tensor(c, device=dev).view(1, 3, 1, 1) for c in (v.image_mean, v.image_std))
        else:
            if dev not in self._pixel_stats:
                with torch.inference_mode(False):  # usable in training also when first made by generate()
                    stats = tuple(torch.tensor(c, device=dev).view(1, 3, 1, 1) for c in (v.image_mean, v.image_std))
                self._pixel_stats[dev] = stats
            mean, std = self._pixel_stats[dev]
        x = (pixel_values.float() / 255.0 - mean) / std
        return x.to(self.vision.patch_embedding.weight.dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """uint8 [n, 3, H, W] -> [n, image_token_count, language hidden]."""
        if pixel_values.dtype != torch.uint8:
            raise TypeError(f"pixel_values must be uint8 (normalised on the device), got {pixel_values.dtype}")
        return self.projector(self.vision(self.normalize(pixel_values)))

    def embed(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, sample_names=None, cu_seqlens=None, check=True
    ):
        """Token embeddings [B, T, hidden] with the image placeholders replaced by projected image embeddings.

        ``check=False`` (static packs): no placeholder count (a host sync); the pack's maker checked it, and
        ``pixel_values`` may hold blank slots after the real images, which no placeholder reads."""
        embeds = self.language.embed_tokens(input_ids)
        n_images = 0 if pixel_values is None else pixel_values.shape[0]
        is_image = input_ids == self.image_token_id
        if check and int(is_image.sum()) != n_images * self.image_token_count:  # a host sync: the clear error
            raise ValueError(self._mismatch_message(is_image, n_images, sample_names, cu_seqlens))
        if n_images:
            image_embeds = self.encode_images(pixel_values).to(embeds.dtype)  # [n, itc, hidden]
            embeds = embeds.masked_scatter(is_image[..., None], image_embeds)
        elif self.vision_every_forward or (
            torch.is_grad_enabled()
            and any(p.requires_grad for p in (*self.vision.parameters(), *self.projector.parameters()))
        ):
            # A pack without images still runs the vision path on one blank image, scaled by zero: every
            # parameter then takes part in the graph (gradient 0), as DDP requires of each rank at each step, and
            # a sharded model gathers the same weights on every rank (see vision_every_forward).
            size = self.cfg.vision.image_size
            blank = torch.zeros(1, 3, size, size, dtype=torch.uint8, device=input_ids.device)
            embeds = embeds + 0.0 * self.encode_images(blank).sum().to(embeds.dtype)
        return embeds

    def _mismatch_message(self, is_image, n_images, sample_names, cu_seqlens) -> str:
        itc = self.image_token_count
        n = int(is_image.sum())
        if cu_seqlens is not None:  # packed [1, T]: count per segment
            bounds = cu_seqlens.tolist()
            counts = [int(is_image[0, a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
        else:  # padded: one sample per row
            counts = is_image.sum(dim=1).tolist()
        names = list(sample_names) if sample_names else []
        names += [f"segment {i}" for i in range(len(names), len(counts))]
        per_sample = ", ".join(
            f"{name}: {c}" + ("" if c % itc == 0 else f" (not a multiple of {itc})")
            for name, c in zip(names, counts)
            if c
        )
        return (
            f"image placeholder/image count mismatch: the batch has {n} <image> tokens "
            f"({n / itc:g} images at {itc} tokens each) but pixel_values holds {n_images} images. "
            f"Placeholder tokens per sample: {per_sample or 'none'}. Each image must appear as exactly {itc} "
            f"placeholder tokens (image_token_count for this model config) and every image must be in pixel_values."
        )

    # ------------------------------------------------------------------------------------------------------
    # training forward

    def forward(self, batch: dict, return_logits: bool = True) -> dict:
        """Packed batch ([1, T] + cu_seqlens) or padded batch ([B, T] + attention_mask) -> loss, logits, n_loss_tokens.

        labels are unshifted: logits[:, :-1] predict labels[:, 1:]. loss is the mean cross-entropy over labels
        != -100; a batch without any loss token gives a zero loss that is still part of the graph.
        An optional ``inputs_embeds`` [B, T, hidden] replaces ``embed`` (token embeddings with the projected
        images in place): the vision path is then skipped, e.g. for features cached from a frozen encoder.

        ``return_logits=False`` (training and validation) runs the LM head only on the positions that predict a
        loss token and returns ``logits`` None: image, prompt and padding positions need no logits. In VLM data
        those are most positions (85% in the demo data), and the head is a large share of a small decoder's
        FLOPs (fp32 logits of every position of an 8192-token pack with a 49K vocabulary are 1.6 GB). The loss
        is the same up to float rounding (the head's GEMM sees fewer rows).
        """
        if DEFERRED_JPEGS in batch:  # their rows of pixel_values are still grey canvases
            raise ValueError(
                "the batch still holds JPEGs to decode on the device (data.image_decode=device): move it with "
                "PackedMultimodalDataModule.transfer_batch_to_device (Lightning does), or use data.image_decode=worker"
            )
        if batch.get("static"):
            keys = ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values")
            return self.static_forward(*(batch[k] for k in keys), return_logits=return_logits)
        input_ids = batch["input_ids"]
        cu_seqlens = batch.get("cu_seqlens")
        attention_mask = batch.get("attention_mask")
        position_ids = batch.get("position_ids")
        if position_ids is None:
            if cu_seqlens is not None:
                raise ValueError("a packed batch (cu_seqlens) needs position_ids that restart at 0 for each sample")
            if attention_mask is not None:  # right- or left-padded rows: count real tokens
                position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        max_seqlen = batch.get("max_seqlen")
        if cu_seqlens is not None and max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        labels = batch.get("labels")
        rows = None
        if labels is not None and not return_logits:
            # Found before the forward (nonzero() is a host sync): the GPU then holds little work to wait for.
            rows = loss_rows(labels)
        embeds = batch.get("inputs_embeds")  # precomputed [B, T, hidden] (e.g. cached frozen-vision features)
        if embeds is None:
            embeds = self.embed(input_ids, batch.get("pixel_values"), batch.get("sample_keys"), cu_seqlens)
        # logits [B, T, vocab]; with loss rows, the final hidden states [B, T, hidden] (the head comes below)
        x = self.language(
            embeds,
            position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            attention_mask=attention_mask,
            return_hidden=rows is not None,
        )
        out = {"logits": x if rows is None else None, "loss": None, "n_loss_tokens": None}
        if labels is None:
            return out
        if rows is None:  # the head ran on every position: shift, and let ignore_index drop the rest
            logits = x[:, :-1].reshape(-1, x.shape[-1])  # [B * (T - 1), vocab]
            target = labels[:, 1:].reshape(-1)
            loss_sum = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
        else:  # the head on the loss positions only: [N, hidden] -> [N, vocab], chunked when configured
            hidden = x.reshape(-1, x.shape[-1]).index_select(0, rows)
            target = labels.reshape(-1).index_select(0, rows + 1)  # row r predicts the token after it
            loss_sum = self.head_loss(hidden, target)
        n_loss_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        out["loss"] = loss_sum / n_loss_tokens.clamp(min=1)  # no host sync; 0 (with a graph) when n == 0
        out["n_loss_tokens"] = n_loss_tokens
        return out

    def head_loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the LM head on ``hidden`` [N, hidden] against ``target`` [N], with the kernel of
        ``model.loss_kernel`` (no [N, vocab] logits with Liger or ``loss_chunk_rows``)."""
        kernel = resolve_loss_kernel(self.cfg.loss_kernel, hidden.device)
        return linear_cross_entropy(hidden, self.language.lm_head.weight, target, self.cfg.loss_chunk_rows, kernel)

    def static_forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        pixel_values: torch.Tensor,
        return_logits: bool = False,
    ) -> dict:
        """``forward`` of a static pack (collate.StaticLayout): tensors in, no host sync, one graph for every pack.

        input_ids, labels, position_ids [1, T]; cu_seqlens [segments + 1]; pixel_values [slots, 3, H, W] uint8.
        This is what ``trainer.compile=step`` compiles. Every image slot is encoded, and the LM head runs on all
        T positions (a fixed-size loss buffer; positions without a loss target count 0), so the graph does not
        depend on how many images or loss tokens a pack has. Same outputs as ``forward``.
        """
        embeds = self.embed(input_ids, pixel_values, check=False)
        x = self.language(
            embeds,
            position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=input_ids.shape[1],
            return_hidden=not return_logits,
            static=True,
        )
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # [B * T]: t predicts label t + 1
        if return_logits:
            loss_sum = F.cross_entropy(
                x.reshape(-1, x.shape[-1]).float(), target, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        else:
            hidden = x.reshape(-1, x.shape[-1])  # [B * T, hidden]
            loss_sum = self.head_loss(hidden, target)
        n_loss_tokens = (target != IGNORE_INDEX).sum()
        loss = loss_sum / n_loss_tokens.clamp(min=1)
        return {"logits": x if return_logits else None, "loss": loss, "n_loss_tokens": n_loss_tokens}

    # ------------------------------------------------------------------------------------------------------
    # generation

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float | None = 1.0,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Decode one sample with a KV cache. input_ids [1, L] (placeholders expanded, as in training).

        temperature 0 = greedy; otherwise sampling from softmax(logits / temperature) restricted to the smallest
        set of tokens whose probability reaches top_p. Returns only the new tokens, [1, L_new] with
        L_new <= max_new_tokens; decoding stops after ``eos_token_id`` (which is included).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(
                f"generate decodes one sample: input_ids must be [1, L] with L > 0, got {tuple(input_ids.shape)}"
            )
        top_p = 1.0 if top_p is None else top_p
        if max_new_tokens < 0 or not temperature >= 0 or not top_p >= 0:  # `not >=` also refuses nan
            raise ValueError(
                f"need max_new_tokens >= 0, temperature >= 0 and top_p >= 0; got {max_new_tokens}, {temperature}, "
                f"{top_p}"
            )
        device = input_ids.device
        prompt_len = input_ids.shape[1]
        context = self.cfg.language.max_position_embeddings
        if prompt_len > context or prompt_len + max_new_tokens - 1 > context:  # the last new token is never fed
            raise ValueError(
                f"a {prompt_len}-token prompt + max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_position_embeddings={context} (positions past it were never trained)"
            )
        embeds = self.embed(input_ids, pixel_values)
        cache = KVCache(self.cfg.language, prompt_len + max_new_tokens, device, embeds.dtype)
        positions = torch.arange(prompt_len, device=device)[None]
        logits = self.language(embeds, positions, cache=cache)[:, -1]
        new_tokens = []
        for step in range(max_new_tokens):
            token = self._sample(logits.float(), temperature, top_p, generator)  # [1]
            new_tokens.append(token)
            if (eos_token_id is not None and int(token) == eos_token_id) or step == max_new_tokens - 1:
                break
            position = torch.full((1, 1), prompt_len + step, device=device)
            logits = self.language(self.language.embed_tokens(token[None]), position, cache=cache)[:, -1]
        if not new_tokens:
            return input_ids.new_zeros(1, 0)
        return torch.stack(new_tokens, dim=1)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
        """logits [1, V] -> token [1]."""
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
            drop[..., 0] = False  # top_p = 0: the top token alone
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
