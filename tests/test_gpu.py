"""The device-independent promises on a CUDA GPU: bf16 and fp16, torch.compile, fused kernels, no host syncs, NCCL.

Every test here is marked `gpu`: skipped where torch sees no CUDA device (conftest's device_of_the_test), selected alone
with `pytest -m gpu`. They run in `python benchmarks/gpu_report.py` on a GPU machine. Tolerances are bf16's: its
8-bit mantissa rounds to about 0.4%, and a compiled graph fuses (so rounds) differently from eager kernels.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpp.config import DataConfig, TrainConfig
from mpp.data.stream import Batch, TrainTransform, make_loader
from mpp.model.vit import build_vit
from mpp.model.objectives import MaskedPatchPrediction
from mpp.training.optim import build_optimizer, build_schedule, param_groups
from mpp.rundir import complete_checkpoints
from mpp.training.runtime import compiled, make_accelerator
from mpp.training.loop import next_batch, train_step

from conftest import ROOT, TINY, write_test_shards

pytestmark = pytest.mark.gpu

# bf16 compiled against eager: the loss within 2% and each gradient within 5% of its own norm (measured in fp32).
BF16_LOSS_RTOL, BF16_GRAD_REL = 0.02, 0.05


def objective(seed: int = 0, width: int = 128, heads: int = 2) -> MaskedPatchPrediction:
    torch.manual_seed(seed)
    return MaskedPatchPrediction(build_vit("vit_ti", 32, 4, width=width, depth=2, heads=heads))


def uint8_images(batch: int = 16, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def stepper(tmp_path, model, **train):
    """The training loop's own step on this GPU under TrainConfig(**train): (step(batch, forward=None), accelerator, optimizer)."""
    cfg = TrainConfig(warmup_steps=0, compile=False, **train)
    accelerator = make_accelerator(cfg, tmp_path)
    prepared = accelerator.prepare(model)
    optimizer = accelerator.prepare(build_optimizer(param_groups(model, cfg.layer_decay), cfg))
    schedule = build_schedule(optimizer, cfg)

    def step(batch: Batch, forward=None):
        return train_step(accelerator, prepared, prepared if forward is None else forward, optimizer, schedule, [batch], cfg.clip_grad_norm)

    return step, accelerator, prepared, optimizer


def test_compiled_bf16_step_gives_the_eager_loss_and_gradients():
    device = torch.device("cuda")
    eager, compiled_model = objective().to(device), objective().to(device)
    compiled_forward = torch.compile(compiled_model)
    images = uint8_images().to(device)
    corruption = eager.draw_corruption(images.shape[0], "cpu", torch.Generator().manual_seed(1)).to(device)
    results = []
    for module, forward in ((eager, eager), (compiled_model, compiled_forward)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(images, corruption=corruption).loss
        loss.backward()
        results.append((loss.detach().float(), [p.grad.float() for p in module.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(eager_loss, compiled_loss, rtol=BF16_LOSS_RTOL), (eager_loss, compiled_loss)
    for (name, _), a, b in zip(eager.named_parameters(), eager_grads, compiled_grads):
        assert (a - b).norm() <= BF16_GRAD_REL * a.norm() + 1e-6, (name, (a - b).norm() / a.norm())


def test_a_nonfinite_gradient_under_fused_adamw_on_cuda_leaves_weights_moments_and_step_count_untouched(tmp_path):
    model = objective()
    step, accelerator, prepared, optimizer = stepper(tmp_path, model, optimizer="adamw", mixed_precision="bf16")
    assert optimizer.optimizer.defaults["fused"] and accelerator.device.type == "cuda"
    batch = Batch(uint8_images().cuda(), torch.full((16,), -1, device="cuda"))

    def poisoned(images, labels):
        out = prepared(images, labels)
        out.loss = out.loss * float("nan")
        return out

    def snapshot():
        return ([p.detach().clone() for p in model.parameters()],
                [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()])

    assert bool(step(batch).stepped)
    before = snapshot()
    result = step(batch, poisoned)
    assert not bool(result.stepped) and bool(result.nonfinite)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)  # moments and "step"
    assert bool(step(batch).stepped)
    assert not all(torch.equal(a, b) for a, b in zip(after[0], snapshot()[0]))


@pytest.mark.parametrize("compile_step", [False, True], ids=["eager", "compiled"])
def test_a_step_fed_by_the_loader_with_pinned_memory_never_waits_for_the_host(tmp_path, compile_step):
    shards = write_test_shards(tmp_path / "shards", [64, 64], size=40)
    data = DataConfig(shards=str(tmp_path / "shards"), num_workers=2, shuffle_buffer=20)
    loader = make_loader(shards, data, TrainTransform(32), 16, pin_memory=True)
    model = objective()
    step, accelerator, prepared, _ = stepper(tmp_path, model, optimizer="adamw", mixed_precision="bf16")
    forward = compiled(prepared, "inductor") if compile_step else prepared
    batches = iter(loader)
    for _ in range(3):  # compilation, cuBLAS handles and the loader's start-up happen here
        step(next_batch(batches, accelerator.device), forward)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            result = step(next_batch(batches, accelerator.device), forward)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(result.stepped)


def test_fp16_with_a_loss_scaler_trains_and_skips_an_overflow(tmp_path):
    model = objective()
    step, accelerator, prepared, _ = stepper(tmp_path, model, optimizer="adamw", mixed_precision="fp16", lr=2e-3)
    assert accelerator.scaler is not None
    batch = Batch(uint8_images().cuda(), torch.full((16,), -1, device="cuda"))
    losses = [step(batch).outputs[0].loss.item() for _ in range(30)]
    assert losses[-1] < losses[0] - 0.3, losses  # one batch, learnt
    scale = accelerator.scaler.get_scale()
    weights = [p.detach().clone() for p in model.parameters()]

    def overflowing(images, labels):  # a finite loss whose scaled fp16 gradients overflow
        out = prepared(images, labels)
        out.loss = out.loss * 1e6
        return out

    result = step(batch, overflowing)
    assert not bool(result.stepped) and not bool(result.nonfinite)  # the scaler's call, not a bad step
    assert accelerator.scaler.get_scale() < scale
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert bool(step(batch).stepped)


def test_the_attention_of_a_bf16_step_runs_a_fused_kernel_not_the_math_one(tmp_path):
    model = objective(width=256, heads=4)  # head dimension 64, as in ViT-B
    step, *_ = stepper(tmp_path, model, optimizer="adamw", mixed_precision="bf16")
    batch = Batch(uint8_images().cuda(), torch.full((16,), -1, device="cuda"))
    # With the math backend left out, an attention no fused kernel takes raises "No available kernel".
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        assert bool(step(batch).stepped)


def pretrain(tmp_path, *overrides, resume=False, deterministic=False, cwd=ROOT, timeout=600):
    """`launch.py pretrain` on this GPU in a child process (deterministic: torch.use_deterministic_algorithms first)."""
    args = ["pretrain", *(["--resume"] if resume else []), f"output_dir={tmp_path / 'run'}", *overrides]
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import torch; "
            f"torch.use_deterministic_algorithms({deterministic}); import launch; sys.exit(launch.main({args!r}))")
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # what deterministic cuBLAS needs
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_an_interrupted_and_resumed_compiled_bf16_run_ends_with_the_uninterrupted_weights(tmp_path):
    write_test_shards(tmp_path / "shards", [40] * 3, size=32)
    common = [f"data.shards={tmp_path / 'shards'}", *TINY, "train.steps=6", "train.warmup_steps=2",
              "train.batch_size=8", "train.checkpoint_every=3", "train.keep_checkpoints=5", "data.num_workers=1",
              "train.compile=true", "train.mixed_precision=bf16"]
    first = pretrain(tmp_path, *common, deterministic=True)
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted = load_file(tmp_path / "run" / "model.safetensors")
    checkpoints = complete_checkpoints(tmp_path / "run")
    assert [c.name for c in checkpoints] == ["step_00000003", "step_00000006"]
    shutil.rmtree(checkpoints[-1])  # as if the run had died after step 3's checkpoint
    (tmp_path / "run" / "model.safetensors").unlink()
    resumed_run = pretrain(tmp_path, *common, resume=True, deterministic=True)
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_an_out_of_memory_batch_is_one_line_naming_train_micro_batch_size(tmp_path):
    # ViT-B/16 at 224 px, 4096 images per forward pass: hundreds of GB of activations, more than any one GPU has.
    write_test_shards(tmp_path / "shards", [64], size=32)
    result = pretrain(tmp_path, f"data.shards={tmp_path / 'shards'}", "model.name=vit_b16", "model.image_size=224",
                      "data.num_workers=0", "train.global_batch_size=8192", "train.micro_batch_size=4096",
                      "train.steps=1", "train.compile=false")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: out of memory with 4096 images per process per forward pass (")
    assert "set train.micro_batch_size below 4096" in error


def test_the_main_job_completes_compiled(tmp_path):
    """The README's main job as it runs on a GPU (compile auto = on), from a fresh working directory."""
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", str(ROOT / "launch.py"), "pretrain",
                           f"output_dir={tmp_path / 'run'}", "train.compile=true"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compile on" in proc.stdout, proc.stdout[-2000:]
    final = json.loads((tmp_path / "run" / "results.json").read_text())["final"]
    assert final["train/color_acc"] > 2 * final["train/color_acc_prior"], final


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_match_one_gpu_with_twice_the_batch_or_accumulation(tmp_path):
    script = str(ROOT / "tests" / "distributed_equivalence.py")
    two_gpus = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--gpu_ids", "0,1"]
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}  # fp32 without TF32: the layouts then differ only in summation order
    runs = {"two": [*two_gpus, script, str(tmp_path / "two"), "4", "1"],
            "one_big": [sys.executable, script, str(tmp_path / "one_big"), "4", "1"],
            "one_accum": [sys.executable, script, str(tmp_path / "one_accum"), "4", "2"]}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        if name == "two":
            assert "trained with 2 process(es)" in proc.stdout
    reference = load_file(tmp_path / "two" / "model.safetensors")
    for layout in ("one_big", "one_accum"):
        weights = load_file(tmp_path / layout / "model.safetensors")
        worst = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-4, (layout, worst)
