"""Static packs (``data.static_shapes``) and the compiled step (``trainer.compile=step``): every pack has one
shape, the whole forward + backward is one graph, and the numbers are the eager, dynamic-layout ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.runs import tiny_overrides
from helpers.training import IMAGE_ID, PAD_ID, Sample, tiny_cfg, tiny_model

from nanovlm.config import ConfigError, image_token_count, load_config
from nanovlm.data.collate import StaticLayout, collate_packed
from nanovlm.model.attention import attention

TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values")  # static_forward's arguments


def _samples(seed: int, n: int, itc: int, size: int) -> list[Sample]:
    """n samples of 0 or 1 image, a 2-5 token prompt and a 3-token answer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(n):
        n_img = j % 2
        prompt = torch.randint(1, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        answer = torch.randint(40, 90, (3,), generator=g)
        ids = torch.cat([torch.full((itc * n_img,), IMAGE_ID), prompt, answer])
        labels = torch.full_like(ids, -100)
        labels[-3:] = answer
        pixels = torch.randint(0, 256, (n_img, 3, size, size), generator=g, dtype=torch.uint8)
        out.append(Sample(f"s{seed}_{j}", ids, labels, pixels))
    return out


@pytest.fixture
def micro(tmp_path):
    cfg = tiny_cfg(tmp_path)
    itc, size, t = image_token_count(cfg.model), cfg.model.vision.image_size, cfg.data.max_tokens
    return cfg, itc, size, t, StaticLayout(t // 5 + 1, 4, IMAGE_ID, itc)  # samples have >= 5 tokens


def test_segments_come_from_the_shortest_sample():
    layout = StaticLayout.for_lengths(np.array([0, 7, 30, 12]), 64, 4, 9, 4)  # 0 = an empty sample, never packed
    assert (layout.segments, layout.image_slots) == (64 // 7 + 1, 4)  # 9 samples of 7 tokens + the padding tail
    assert StaticLayout.for_lengths(np.array([100, 80]), 64, 4, 9, 4).segments == 2  # truncated: one a pack
    assert StaticLayout.for_lengths(np.zeros(3, dtype=np.int32), 64, 4, 9, 4).segments == 2


def test_static_packs_have_one_shape_and_the_dynamic_contents(micro):
    cfg, itc, size, t, static = micro
    for seed, n in enumerate([0, 1, 2, 3, 4]):
        samples = _samples(seed, n, itc, size)
        d = collate_packed(samples, t, PAD_ID, size)
        s = collate_packed(samples, t, PAD_ID, size, static=static)
        assert s["cu_seqlens"].shape == (static.segments + 1,) and s["cu_seqlens"].dtype == torch.int32
        assert s["pixel_values"].shape == (static.image_slots, 3, size, size) and s["max_seqlen"] == t
        for k in ("input_ids", "labels", "position_ids"):
            assert torch.equal(s[k], d[k]), k
        k = d["cu_seqlens"].numel()
        assert torch.equal(s["cu_seqlens"][:k], d["cu_seqlens"]) and (s["cu_seqlens"][k:] == t).all()
        m = d["pixel_values"].shape[0]
        assert torch.equal(s["pixel_values"][:m], d["pixel_values"]) and not s["pixel_values"][m:].any()
        assert s["meta"]["n_images"] == m == n // 2 and s["static"] is True


def test_a_static_layout_refuses_a_pack_it_cannot_hold(micro):
    cfg, itc, size, t, static = micro
    samples = _samples(0, 4, itc, size)
    with pytest.raises(ValueError, match="segments"):
        collate_packed(samples, t, PAD_ID, size, static=StaticLayout(3, 4, IMAGE_ID, itc))
    with pytest.raises(ValueError, match="image slots"):
        collate_packed(samples, t, PAD_ID, size, static=StaticLayout(static.segments, 1, IMAGE_ID, itc))
    samples[1].input_ids[0] = 7  # one placeholder of its image lost
    with pytest.raises(ValueError, match="placeholder"):
        collate_packed(samples, t, PAD_ID, size, static=static)


@pytest.mark.parametrize("causal", [True, False])
def test_masked_sdpa_equals_the_segment_loop_with_empty_segments(causal):
    """The static CPU kernel: one masked call; the empty tail segments (cu_seqlens repeating T) change nothing."""
    g = torch.Generator().manual_seed(0)
    lengths, tail = [5, 17, 1, 9], 6  # 32 tokens, the last 6 a padding segment
    t = sum(lengths) + tail
    q, k, v = (torch.randn(t, h, 8, generator=g, requires_grad=True) for h in (6, 2, 2))
    cu = torch.tensor([0, 5, 22, 23, 32, 38], dtype=torch.int32)
    static_cu = torch.cat([cu, torch.full((4,), t, dtype=torch.int32)])
    grad_out = torch.randn(t, 6, 8, generator=g)
    ref = attention(q, k, v, cu, 17, causal, "sdpa")
    out = attention(q, k, v, static_cu, t, causal, "sdpa", kernel="sdpa_masked")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [0, 16], ids=["plain-head", "chunked-head"])
def test_static_forward_equals_forward_and_every_sample_alone(micro, chunk):
    """fp64: a static pack gives the dynamic pack's loss, and each segment's logits are the sample's run alone."""
    cfg, itc, size, t, static = micro
    cfg.model.loss_chunk_rows = chunk
    model = tiny_model(cfg).double()
    for seed, n in enumerate([1, 3, 4]):
        samples = _samples(seed, n, itc, size)
        s = collate_packed(samples, t, PAD_ID, size, static=static)
        logits = model(s)["logits"][0]
        at = 0
        for sample in samples:
            alone = model(collate_packed([sample], len(sample.input_ids), PAD_ID, size))["logits"][0]
            torch.testing.assert_close(logits[at : at + len(alone)], alone, atol=1e-10, rtol=1e-10)
            at += len(alone)
        d_out = model(collate_packed(samples, t, PAD_ID, size), return_logits=False)
        s_out = model(s, return_logits=False)
        assert int(s_out["n_loss_tokens"]) == int(d_out["n_loss_tokens"]) == 3 * n
        torch.testing.assert_close(s_out["loss"], d_out["loss"], atol=1e-6, rtol=1e-6)  # the loss is fp32


def test_a_whole_demo_epoch_of_static_packs_is_one_graph(small_demo, tmp_path):
    """fullgraph compile of forward + backward over every training pack of an epoch: one compilation, no graph
    break, although packs differ in samples, images and loss tokens (checked, so the test can fail)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from nanovlm.data.datamodule import PackedMultimodalDataModule
    from nanovlm.model import build_model

    cfg = load_config([], [*tiny_overrides(small_demo), "data.static_shapes=true", "data.num_workers=0"])
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=0, world_size=1)
    dm.setup("fit")
    torch.manual_seed(0)
    model = build_model(cfg.model, dm.tokenizer)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.static_forward, backend=counter, fullgraph=True)
    seen, n = set(), dm.current_split().batches_per_rank()
    for batch in itertools.islice(dm.train_dataloader(), n):  # the loader runs on into the next epoch
        seen.add((len(batch["sample_keys"]), batch["meta"]["n_images"], batch["meta"]["loss_tokens"]))
        out = step(*(batch[k] for k in TENSORS))
        out["loss"].backward()
        assert torch.isfinite(out["loss"])
    assert n > 10 and len(seen) > n // 2  # many different mixes of samples, images and loss tokens
    assert counter.frame_count == 1, counter.frame_count
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["trainer.compile=step"], "data.static_shapes=true"),
        (["trainer.compile=step", "data.static_shapes=true", "trainer.strategy=fsdp"], "fsdp"),
        (["data.static_shapes=true", "data.packing=pad_to_longest"], "data.packing=packed"),
        (["trainer.compile=true"], "trainer.compile"),
    ],
)
def test_config_refuses_a_compiled_step_it_cannot_build(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


def test_telemetry_counts_the_real_images_of_a_static_pack(micro):
    """MFU counts useful work: a static pack's blank image slots are not images (the FLOPs would be overstated)."""
    from nanovlm.train.callbacks import batch_stats

    cfg, itc, size, t, static = micro
    samples = _samples(0, 3, itc, size)  # 1 image among them, 4 slots
    assert batch_stats(collate_packed(samples, t, PAD_ID, size, static=static))["images"] == 1
