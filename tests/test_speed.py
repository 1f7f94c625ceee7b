"""The fast paths compute what the plain ones do: compiled step, corrupted-only head, sync-free skip, decode, shards."""

import importlib.util
import io
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
import webdataset as wds
from PIL import Image

from mpp.config import TrainConfig
from mpp.data import EvalTransform, TrainTransform, crop_resize
from mpp.model import Attention, build_vit
from mpp.objectives import MaskedPatchPrediction, corrupt_patches, gather_positions, normalize
from mpp.train import apply_gradients, build_optimizer, cpu_threads, default_precision, make_accelerator
from pipelines import prepare

from conftest import ROOT


def tiny_objective(seed=0):
    torch.manual_seed(seed)
    return MaskedPatchPrediction(build_vit("vit_ti", 16, 4, width=32, depth=1, heads=2))


def images(batch=4, size=16, seed=0):
    return torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_compiled_step_gives_the_eager_loss_and_gradients():
    pytest.importorskip("torch._inductor")
    eager = tiny_objective()
    compiled = torch.compile(tiny_objective())
    batch = images()
    results = []
    for module in (eager, compiled):
        torch.manual_seed(1)
        with torch._inductor.config.patch(fallback_random=True):  # the same random corruption as eager
            loss = module(batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in module.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(eager_grads, compiled_grads))


def test_head_at_corrupted_positions_only_gives_the_loss_of_all_positions_masked():
    objective = tiny_objective()
    batch = images()
    torch.manual_seed(3)
    loss = objective(batch).loss

    torch.manual_seed(3)
    tokens = objective.backbone.embed_patches(normalize(batch))
    tokens, corruption = corrupt_patches(tokens, objective.mask_embedding, objective.corrupt_rate,
                                         objective.mask_prob, objective.random_prob)
    logits = objective.head(objective.backbone.encode(tokens)[:, 1:])  # every position, as the peer does
    corrupted = torch.zeros(logits.shape[:2], dtype=torch.bool).scatter(1, corruption.positions, True)
    reference = F.cross_entropy(logits[corrupted], objective.targets(batch)[corrupted])
    assert torch.allclose(loss, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(gather_positions(objective.targets(batch), corruption.positions).sort(1).values,
                       objective.targets(batch)[corrupted].view(4, -1).sort(1).values)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_nonfinite_gradient_leaves_weights_moments_and_step_count_untouched(tmp_path, optimizer):
    cfg = TrainConfig(optimizer=optimizer, warmup_steps=0, compile=False)
    accelerator = make_accelerator(cfg, tmp_path)
    objective = tiny_objective()
    prepared, opt = accelerator.prepare(objective, build_optimizer(objective, cfg))
    batch = images()

    def step(poison: bool):
        loss = prepared(batch).loss * (float("nan") if poison else 1.0)
        accelerator.backward(loss)
        _, finite = apply_gradients(accelerator, prepared, opt, cfg.clip_grad_norm)
        opt.zero_grad(set_to_none=True)
        return bool(finite)

    def snapshot():
        weights = [p.detach().clone() for p in objective.parameters()]
        state = [{k: v.clone() for k, v in s.items()} for s in opt.optimizer.state.values()]
        return weights, state

    assert step(poison=False)
    before = snapshot()
    assert not step(poison=True)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
    assert step(poison=False)
    assert not all(torch.equal(a, b) for a, b in zip(after[0], snapshot()[0]))


def test_flop_count_matches_torch_flop_counter():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    objective = tiny_objective()
    # The math backend spells attention as matmuls, which the counter sees (it skips CPU's fused kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        objective.predict(images(batch=1))
    k = objective.corrupt_rate * objective.backbone.num_patches
    assert bench.forward_flops(objective.backbone, round(k)) == counter.get_total_flops()


def photo(width, height, seed=0, cell=16):
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // cell + 1, width // cell + 1, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC)


def jpeg(image, quality=95):
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def pil_crop_resize(data, box, size):
    """The reference: the same reduced-scale JPEG decode, then PIL's bilinear resize over the exact box."""
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    shrink = min((box[2] - box[0]) / size, (box[3] - box[1]) / size)
    if shrink >= 2:
        img.draft("RGB", (math.ceil(width / shrink), math.ceil(height / shrink)))
    fx, fy = img.size[0] / width, img.size[1] / height
    return np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR, box=(box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)))


@pytest.mark.parametrize("box", [(0, 0, 200, 150), (30, 20, 150, 140), (10, 5, 60, 40), (7, 9, 19, 21), (0, 0, 32, 32)])
def test_crop_resize_matches_pil(box):
    data = jpeg(photo(200, 150))
    ours = crop_resize(Image.open(io.BytesIO(data)), box, 32)
    assert ours.shape == (3, 32, 32) and ours.dtype == torch.uint8
    diff = np.abs(ours.permute(1, 2, 0).numpy().astype(int) - pil_crop_resize(data, box, 32).astype(int))
    # Differences come from rounding a box at reduced scale to whole pixels; PIL's and torch's filters agree.
    assert diff.mean() < 1 and np.percentile(diff, 99) <= 8, (diff.mean(), diff.max())


def test_transforms_flip_and_convert_like_pil():
    gray = Image.open(io.BytesIO(jpeg(photo(40, 40).convert("L"))))
    out = EvalTransform(40)(gray, random.Random(0))
    assert out.shape == (3, 40, 40) and torch.equal(out[0], out[1])
    image = Image.open(io.BytesIO(jpeg(photo(40, 40))))
    flips = [TrainTransform(16, (1.0, 1.0))(Image.open(io.BytesIO(jpeg(photo(40, 40)))), random.Random(s)) for s in range(8)]
    plain = crop_resize(image, (0, 0, 40, 40), 16)
    assert any(torch.equal(f, plain) for f in flips) and any(torch.equal(f, plain.flip(-1)) for f in flips)


def test_prepare_short_side_downsizes_large_images_only(tmp_path):
    folder = tmp_path / "images" / "cat"
    folder.mkdir(parents=True)
    big, small = jpeg(photo(300, 200, cell=50)), jpeg(photo(50, 40))
    (folder / "big.jpg").write_bytes(big)
    (folder / "small.jpg").write_bytes(small)
    summary = prepare.run(str(tmp_path / "images"), str(tmp_path / "shards"), short_side=64, quality=85)
    assert summary["samples"] == 2 and "short side <= 64 px" in summary["source"]
    stored = {s["__key__"]: s["jpg"] for s in wds.WebDataset(str(tmp_path / "shards" / "shard-000000.tar"), shardshuffle=False)}
    assert stored["cat_small"] == small  # within the bound: the original bytes
    downsized = Image.open(io.BytesIO(stored["cat_big"]))
    assert downsized.size == (96, 64) and downsized.format == "JPEG" and len(stored["cat_big"]) < len(big)
    expected = np.asarray(photo(300, 200, cell=50).resize((96, 64), Image.LANCZOS)).astype(int)
    assert np.abs(np.asarray(downsized.convert("RGB")).astype(int) - expected).mean() < 3


def test_prepare_short_side_refuses_impossible_values(tmp_path):
    with pytest.raises(ValueError, match="short-side bound must be a positive number of pixels"):
        prepare.run("synthetic", str(tmp_path / "shards"), count=2, short_side=0)


def test_cpu_threads_follow_the_config_or_share_the_cpus(monkeypatch, tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        make_accelerator(TrainConfig(cpu_threads=2), tmp_path)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_threads(TrainConfig()) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_threads(TrainConfig()) == 1


def test_cpu_bf16_attention_matches_fp32_scaled_dot_product_attention():
    torch.manual_seed(0)
    attention = Attention(64, heads=4)
    x = torch.randn(2, 17, 64, requires_grad=True)
    reference = attention(x)  # fp32: F.scaled_dot_product_attention
    reference.square().sum().backward()
    reference_grads = [x.grad.clone(), attention.qkv.weight.grad.clone()]
    x.grad = attention.qkv.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(x)  # bf16 activations: the explicit softmax(QK^T)V form
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert torch.allclose(out.float(), reference, rtol=0.05, atol=0.02)
    for grad, expected in zip([x.grad, attention.qkv.weight.grad], reference_grads):
        assert torch.allclose(grad, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


def test_auto_precision_is_bf16_on_gpu_and_on_cpus_with_bf16_instructions(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert default_precision("cuda") == "bf16"
    assert default_precision("cpu") == "no"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert default_precision("cpu") == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert default_precision("cpu") == "bf16"
