"""CUDA checks (marker ``gpu``, skipped without a GPU): the varlen kernels agree with the fp32 sdpa reference
within bf16 tolerance, forward and backward, and a packed NanoVLM runs in bf16 with the fast backend."""

import importlib

import pytest
import torch

from nanovlm.config import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig
from nanovlm.model import NanoVLM
from nanovlm.model.attention import attention, resolve_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _flash_missing() -> str | None:
    try:
        importlib.import_module("flash_attn")
    except Exception as e:
        return f"flash_attn is not importable here ({type(e).__name__}: {e})"
    return None


def _pre_ampere() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 8


_NO_FLASH_KERNELS = pytest.mark.skipif(_pre_ampere(), reason="FlashAttention kernels need compute capability >= 8.0")
KERNELS = [
    pytest.param("torch_varlen", marks=_NO_FLASH_KERNELS),
    pytest.param(
        "flash_attn",
        marks=[_NO_FLASH_KERNELS, pytest.mark.skipif(_flash_missing() is not None, reason=str(_flash_missing()))],
    ),
]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4)], ids=["mha", "gqa"])
def test_kernel_matches_fp32_reference(backend, causal, heads):
    hq, hkv = heads
    lengths = [1, 37, 128, 300, 64, 513]
    g = torch.Generator(device="cuda").manual_seed(0)
    total, dim = sum(lengths), 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q32, k32, v32 = (torch.randn(total, h, dim, device="cuda", generator=g) for h in (hq, hkv, hkv))
    grad_out = torch.randn(total, hq, dim, device="cuda", generator=g)

    def run(q, k, v, name):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, cu, max(lengths), causal=causal, backend=name)
        out.backward(grad_out.to(out.dtype))
        return out, q.grad, k.grad, v.grad

    ref = run(q32, k32, v32, "sdpa")  # fp32, per-segment SDPA
    got = run(q32.bfloat16(), k32.bfloat16(), v32.bfloat16(), backend)
    low = run(q32.bfloat16(), k32.bfloat16(), v32.bfloat16(), "sdpa")  # what bf16 itself costs
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (total, hq, dim)
    for name, g_, r, lo in zip(("out", "dq", "dk", "dv"), got, ref, low):
        err, base = rel_err(g_, r), rel_err(lo, r)
        assert err < 2e-2, f"{backend} {name}: relative error {err:.2e} vs fp32 reference"
        assert err <= 2 * base + 1e-3, f"{backend} {name}: error {err:.2e} is far above bf16 sdpa's {base:.2e}"


def test_auto_picks_a_varlen_kernel_for_bf16():
    chosen = resolve_backend("auto", "cuda", torch.bfloat16)
    if _pre_ampere():
        assert chosen == "sdpa"
    else:
        assert chosen == ("torch_varlen" if _flash_missing() else "flash_attn")
    assert resolve_backend("auto", "cuda", torch.float32) == "sdpa"


def tiny_gpu_model() -> NanoVLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vision=VisionConfig(
            image_size=32, patch_size=4, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256
        ),
        projector=ProjectorConfig(pixel_shuffle_factor=2),  # 8x8 patches -> 16 image tokens
        language=LanguageConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
        attn_backend="auto",
    )
    return NanoVLM(cfg, vocab_size=256, image_token_id=5).cuda()


def packed_batch(lengths, images, itc=16, image_token_id=5):
    g = torch.Generator().manual_seed(1)
    ids, labels, pos, pixels = [], [], [], []
    for n, n_img in zip(lengths, images):
        x = torch.randint(10, 256, (n,), generator=g)
        for i in range(n_img):
            x[2 + i * (itc + 3) : 2 + i * (itc + 3) + itc] = image_token_id
        y = x.clone()
        y[x == image_token_id] = -100
        y[0] = -100
        ids.append(x), labels.append(y), pos.append(torch.arange(n))
        pixels.append(torch.randint(0, 256, (n_img, 3, 32, 32), dtype=torch.uint8, generator=g))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(pos)[None],
        "cu_seqlens": cu,
        "max_seqlen": max(lengths),
        "pixel_values": torch.cat(pixels),
        "sample_keys": [f"s{i}" for i in range(len(lengths))],
    }
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def test_packed_nanovlm_bf16_matches_fp32_alone():
    model = tiny_gpu_model()
    lengths, images = [70, 23, 150, 41, 9], [1, 0, 2, 1, 0]
    packed = packed_batch(lengths, images)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(packed)
    assert out["logits"].dtype == torch.bfloat16 and torch.isfinite(out["loss"])
    out["loss"].backward()
    bf16_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()

    ref = model(packed)  # fp32: auto -> sdpa, the reference path
    ref["loss"].backward()
    assert abs(out["loss"].detach().item() - ref["loss"].detach().item()) < 2e-2 * ref["loss"].detach().item()
    # Per parameter, relative to its own gradient, with a floor tied to the whole gradient: some gradients are
    # zero in exact arithmetic (a key bias shifts every score of a row equally) and only rounding noise remains.
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    for name, p in model.named_parameters():
        err = (bf16_grads[name] - p.grad).norm()
        assert err <= 5e-2 * p.grad.norm() + 1e-4 * total, f"{name}: {err:.2e} vs grad norm {p.grad.norm():.2e}"

    start = 0
    with torch.no_grad():
        for i, n in enumerate(lengths):  # each sample alone, fp32
            n_img_before = sum(images[:i])
            alone = {
                "input_ids": packed["input_ids"][:, start : start + n],
                "position_ids": packed["position_ids"][:, start : start + n],
                "cu_seqlens": torch.tensor([0, n], dtype=torch.int32, device="cuda"),
                "max_seqlen": n,
                "pixel_values": packed["pixel_values"][n_img_before : n_img_before + images[i]],
            }
            want = model(alone)["logits"][0]
            assert rel_err(out["logits"][0, start : start + n], want) < 2e-2, f"sample {i}"
            start += n


def test_pure_bf16_model_forward_and_generate():
    model = tiny_gpu_model().bfloat16()
    packed = packed_batch([40, 60], [1, 1])
    out = model(packed)
    assert torch.isfinite(out["loss"])
    tokens = model.generate(packed["input_ids"][:, :40], packed["pixel_values"][:1], max_new_tokens=5)
    assert tokens.shape == (1, 5) and tokens.device.type == "cuda"


def test_training_forward_with_the_head_on_loss_positions_matches_the_full_head_in_bf16():
    """What training runs (``return_logits=False``: loss rows found before the forward, head on them only)."""
    model = tiny_gpu_model()
    packed = packed_batch([70, 23, 150, 41, 9], [1, 0, 2, 1, 0])
    grads = []
    for return_logits in (True, False):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(packed, return_logits=return_logits)
        out["loss"].backward()
        grads.append((out["loss"].detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    (full, g_full), (rows, g_rows) = grads
    assert torch.isfinite(rows) and abs(float(rows - full)) < 1e-2 * float(full)
    for a, b in zip(g_rows, g_full):
        assert (a - b).norm() <= 2e-2 * b.norm() + 1e-5


def test_compiled_blocks_run_as_one_graph_each_and_match_eager():
    """``trainer.compile=blocks``: the backend is resolved outside the blocks, so no block splits into several graphs."""
    from torch._dynamo.utils import counters

    from nanovlm.train.strategies import apply_compile

    eager = tiny_gpu_model()
    compiled = tiny_gpu_model()
    apply_compile(compiled)
    packed = packed_batch([70, 23, 150, 41, 9], [1, 0, 2, 1, 0])
    counters.clear()
    losses = []
    for model in (eager, compiled, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(packed, return_logits=False)["loss"]
        loss.backward()
        losses.append(float(loss))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert abs(losses[1] - losses[0]) < 1e-2 * losses[0] and abs(losses[2] - losses[1]) < 1e-6 * losses[1]


def static_batch(lengths, images, segments=8, slots=4):
    """``packed_batch`` with the static layout ``collate_packed`` gives under ``data.static_shapes``."""
    batch = packed_batch(lengths, images)
    cu, pixels = batch["cu_seqlens"], batch["pixel_values"]
    total = int(cu[-1])
    batch["cu_seqlens"] = torch.cat([cu, cu.new_full((segments + 1 - cu.numel(),), total)])
    batch["pixel_values"] = torch.cat([pixels, pixels.new_zeros((slots - len(pixels), *pixels.shape[1:]))])
    return {**batch, "max_seqlen": total, "static": True}


def test_the_compiled_step_replays_as_a_cuda_graph_and_matches_eager():
    """``trainer.compile=step`` on CUDA (``reduce-overhead``): packs of different mixes with one static shape
    compile once and give the eager loss (bf16 tolerance) and gradients."""
    from torch._dynamo.utils import counters

    from nanovlm.train.strategies import compile_step

    eager, compiled = tiny_gpu_model(), tiny_gpu_model()
    compile_step(compiled, torch.device("cuda"))
    counters.clear()
    packs = [([70, 23, 150, 41, 9, 219], [1, 0, 2, 1, 0, 0]), ([300, 100, 112], [3, 0, 1]), ([256, 256], [0, 0])]
    for lengths, images in packs * 2:
        batch = static_batch(lengths, images)
        losses = []
        for model in (eager, compiled):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(batch, return_logits=False)["loss"]
            loss.backward()
            losses.append(float(loss))
        assert abs(losses[1] - losses[0]) < 1e-2 * losses[0], losses
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert (a.grad - b.grad).norm() <= 5e-2 * a.grad.norm() + 1e-5, name
            a.grad, b.grad = None, None
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def _liger_missing() -> str | None:
    from nanovlm.model.loss import _liger_loss

    problem = _liger_loss()
    return problem if isinstance(problem, str) else None


@pytest.mark.skipif(_liger_missing() is not None, reason=str(_liger_missing()))
def test_liger_fused_loss_matches_the_plain_head():
    """``model.loss_kernel=liger``: the loss and both gradients equal the plain head in fp32 (tolerance), and in
    bf16 within bf16 tolerance."""
    from nanovlm.model.loss import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 4096, 256, 32000
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[::7] = -100
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        hidden = torch.randn(n, d, device="cuda", generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(v, d, device="cuda", generator=g) * 0.02).to(dtype).requires_grad_()
        results = []
        for kernel in ("torch", "liger"):
            loss = linear_cross_entropy(hidden, weight, target, kernel=kernel)
            gh, gw = torch.autograd.grad(loss, (hidden, weight))
            results.append((loss.float(), gh.float(), gw.float()))
        (lt, ht, wt), (ll, hl, wl) = results
        assert abs(float(ll - lt)) <= tol * abs(float(lt)), (dtype, float(ll), float(lt))
        assert rel_err(hl, ht) < tol and rel_err(wl, wt) < tol, dtype


def test_nvjpeg_decode_matches_the_worker_decoder():
    """data.image_decode=device on CUDA: nvJPEG's pixels against Pillow's, through the same resize and paste,
    including a batch nvJPEG refuses (a JPEG with no scan) decoded by Pillow instead and counted."""
    import io

    import numpy as np
    from PIL import Image, ImageFilter

    from nanovlm.data.device_decode import DeviceDecoder

    rng = np.random.default_rng(0)
    datas = []
    for w, h in [(640, 480), (333, 500), (48, 48), (1024, 200)]:
        noise = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noise).filter(ImageFilter.GaussianBlur(3)).save(buf, "JPEG", quality=90)
        datas.append(buf.getvalue())
    deferred = [(d, i, (0, 0, 64, 64), f"k{i}") for i, d in enumerate(datas)]
    decoder = DeviceDecoder()
    gpu = decoder(torch.zeros(4, 3, 64, 64, dtype=torch.uint8, device="cuda"), deferred)
    cpu = decoder(torch.zeros(4, 3, 64, 64, dtype=torch.uint8), deferred)  # the same path with Pillow
    diff = (gpu.cpu().int() - cpu.int()).abs().float()
    assert decoder.fallbacks == 0 and diff.mean() < 1.0 and diff.max() <= 32, (diff.mean(), diff.max())
    no_scan = datas[2][: datas[2].index(b"\xff\xda")] + b"\xff\xd9"
    with pytest.raises(RuntimeError, match="sample 'bad'"):
        decoder(
            torch.zeros(2, 3, 64, 64, dtype=torch.uint8, device="cuda"),
            [*deferred[:1], (no_scan, 1, (0, 0, 64, 64), "bad")],
        )
    assert decoder.fallbacks == 1
