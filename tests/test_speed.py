"""The fast paths compute what the plain ones do: compiled step, corrupted-only head, sync-free skip, decode, shards;
and the concurrent-runs benchmark times a run both ways."""

import importlib.util
import io
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import webdataset as wds
from accelerate import Accelerator
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mpp.training import runtime as runtime
from mpp.config import TrainConfig
from mpp.data.stream import Batch, EvalTransform, TrainTransform, crop_resize
from mpp.errors import UserError
from mpp.model.vit import Attention, build_vit
from mpp.model.objectives import MaskedPatchPrediction, gather_positions, normalize
from mpp.training.optim import build_optimizer, build_schedule, param_groups
from mpp.training.runtime import (CompileUnavailable, Device, cpu_threads, make_accelerator, resolve_compile,
                                  resolve_precision)
from mpp.training.meters import EARLY_STEPS, RECENT_STEPS, LogWindow, StepPace
from mpp.training.loop import StepResult, train_step
from mpp.evaluation.views import patch_filters
from pipelines.stages import prepare

from conftest import ROOT, TINY, write_test_shards
from test_corruption import corrupt_patches


def tiny_objective(seed=0):
    torch.manual_seed(seed)
    return MaskedPatchPrediction(build_vit("vit_ti", 16, 4, width=32, depth=1, heads=2))


def images(batch=4, size=16, seed=0):
    return torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])  # train.compile_mode
def test_compiled_step_gives_the_eager_loss_and_gradients(mode):
    eager = tiny_objective()
    compiled = runtime.compiled(tiny_objective(), "inductor", mode)
    batch = images()
    # One corruption for both, drawn outside the model: inductor draws random numbers its own way.
    corruption = eager.draw_corruption(batch.shape[0], generator=torch.Generator().manual_seed(1))
    results = []
    for module in (eager, compiled):
        loss = module(batch, corruption=corruption).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in module.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(eager_grads, compiled_grads))


def test_an_inspection_between_compiled_steps_does_not_recompile_the_model():
    # The inspection evaluator reads the patch filters through einops, which caches a backend per exact type: a
    # Parameter's first visit grew the cache that the compiled forward guards on, and the whole model recompiled at
    # a run's first inspection (on a GPU, inductor's compile again, mid-run).
    plain = tiny_objective()
    compiled = runtime.compiled(plain, "aot_eager")
    compiled(images()).loss.backward()
    patch_filters(plain.backbone, count=4)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled(images(seed=1)).loss.backward()


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
    prepared = accelerator.prepare(objective)
    opt = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    schedule = build_schedule(opt, cfg)
    batch = Batch(images(), torch.full((4,), -1))

    def step(poison: bool):
        def forward(images, labels):
            out = prepared(images, labels)
            out.loss = out.loss * (float("nan") if poison else 1.0)
            return out

        result = train_step(accelerator, prepared, forward, opt, schedule, [batch], cfg.clip_grad_norm)
        assert bool(result.nonfinite) == poison  # without a loss scaler a non-finite gradient counts
        return bool(result.stepped)

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


@pytest.mark.parametrize("stem", ["patch", "resnet"])
def test_flop_count_matches_torch_flop_counter(stem):
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    objective = tiny_objective() if stem == "patch" else MaskedPatchPrediction(
        build_vit("vit_ti", 16, width=32, depth=1, heads=2, stem="resnet", stem_layers=(1,), stem_width=8))
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


@pytest.mark.parametrize("exported, spin", [(None, "0"), ("ACTIVE", "30000000000")], ids=["default", "user-exported"])
def test_the_command_line_makes_openmp_threads_sleep_rather_than_spin(exported, spin):
    # Spinning threads made the main job 20x slower when other jobs shared its 2 cores. OpenMP reads its wait policy
    # once, as torch loads it: importing the command line, which loads torch only later for a stage, must set it
    # first. libgomp (torch's OpenMP on Linux) prints its settings with OMP_DISPLAY_ENV; GOMP_SPINCOUNT is 0 under the
    # passive policy, 300000 when unset.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    if exported:
        env["OMP_WAIT_POLICY"] = exported
    shown = subprocess.run([sys.executable, "-c", "import pipelines.cli; import torch"], cwd=ROOT, env=env,
                           capture_output=True, text=True, check=True).stderr
    if "GOMP_SPINCOUNT" not in shown:
        pytest.skip("torch here does not use GNU OpenMP, whose settings this test reads")
    assert f"GOMP_SPINCOUNT = '{spin}'" in shown, shown  # the user's own setting wins


def paced(early: float, later: list[float]) -> StepPace:
    """A StepPace given this run's first 25 steps at `early` seconds each, then `later`."""
    pace = StepPace()
    for seconds in [early] * EARLY_STEPS[1] + later:
        pace.add(seconds)
    return pace


def test_a_run_says_once_when_its_steps_run_many_times_slower_than_its_own_early_steps():
    assert paced(0.2, [1.2] * (RECENT_STEPS - 1)).slowed() is None  # not enough recent steps to judge yet
    pace = paced(0.2, [1.2] * RECENT_STEPS)
    assert pace.slowed() == pytest.approx((1.2, 0.2))  # 6x
    pace.add(1.2)
    assert pace.slowed() is None  # said once
    assert paced(0.2, [0.9] * 100).slowed() is None  # 4.5x: under the threshold
    # Steps 1-4 (allocation, the first batches) are not the run's pace: slow ones there do not hide a slowdown.
    assert paced(0.2, [1.2] * RECENT_STEPS).early == [0.2] * (EARLY_STEPS[1] - EARLY_STEPS[0] + 1)
    # An evaluation or a checkpoint between two steps is one long step, not a slow run.
    assert paced(0.2, ([0.2] * 9 + [30.0]) * 10).slowed() is None


def test_the_slowdown_line_names_the_ratio_the_load_and_what_to_lower(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr("mpp.training.meters.time.perf_counter", lambda: clock[0])
    monkeypatch.setattr("os.getloadavg", lambda: (9.5, 8.0, 6.0), raising=False)
    window = LogWindow(Accelerator(cpu=True), max_nonfinite_steps=5, max_skip_fraction=1.0, data_workers=1)
    result = StepResult([], torch.tensor(1.0), torch.tensor(True), torch.tensor(False))
    said = {}
    for step in range(1, 81):
        clock[0] += 0.1 if step <= EARLY_STEPS[1] else 1.0  # steps 1-25 take 0.1 s, later ones 1 s
        window.stepped(step, result)
        if step % 20 == 0:
            window.write(step, lr=1e-3)
            said[step] = capsys.readouterr().err
    assert said[20] == said[40] == ""  # at step 40, 15 steps after the early ones: too few to judge
    line = said[60]
    assert line.count("\n") == 1 and line.startswith("warning: steps take 10x as long as this run's steps 5-25 did"), line
    assert "(1.00 s against 0.10 s, medians); load average 9.5 on " in line
    assert f"with {torch.get_num_threads()} training thread(s) and 1 data worker(s) per process" in line
    assert "lower train.cpu_threads and data.num_workers" in line
    assert said[80] == ""  # once


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


def test_auto_precision_is_bf16_where_the_hardware_has_it_else_fp16_on_gpus_and_fp32_on_cpus():
    ampere, volta = Device("cuda", native_bf16=True, capability=(8, 0)), Device("cuda", native_bf16=False, capability=(7, 0))
    assert resolve_precision("auto", ampere) == "bf16"
    assert resolve_precision("auto", volta) == "fp16"  # emulated bf16 is slow there
    assert resolve_precision("auto", Device("cpu", native_bf16=True)) == "bf16"
    assert resolve_precision("auto", Device("cpu", native_bf16=False)) == "no"
    assert resolve_precision("bf16", volta) == "bf16"  # what the user asks for
    with pytest.raises(UserError, match=r"train.mixed_precision=fp16 needs a GPU .*; use bf16 .* or no"):
        resolve_precision("fp16", Device("cpu", native_bf16=True))


def test_accelerate_launch_cpu_on_a_gpu_machine_decides_precision_and_compile_for_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU is visible ...
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # ... and `accelerate launch --cpu` keeps the run off it
    assert Device.this_process() == Device("cpu", runtime.cpu_has_bf16())
    assert not resolve_compile("auto", Device.this_process()) and runtime.cpu_processes()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # what the launcher exports without --cpu
    assert not runtime.cpu_processes()


def test_auto_data_workers_are_one_on_a_cpu_and_the_cores_of_each_gpu_process_less_one(monkeypatch):
    monkeypatch.setattr(runtime, "available_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert runtime.data_workers("auto") == 1 and runtime.data_workers(3) == 3  # this test trains on the CPU
    monkeypatch.setattr(runtime, "cuda_in_use", lambda: True)
    assert runtime.data_workers("auto") == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert runtime.data_workers("auto") == 1  # 2 cores per GPU process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert runtime.data_workers("auto") == 1 and runtime.data_workers(0) == 0


def test_cpu_bf16_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(runtime, "Path", lambda path: cpuinfo if path == "/proc/cpuinfo" else Path(path))
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert not runtime.cpu_has_bf16()
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    assert runtime.cpu_has_bf16()
    cpuinfo.unlink()
    assert not runtime.cpu_has_bf16()  # no /proc: fp32


def test_auto_compile_only_on_gpus_triton_supports_and_true_refuses_the_rest_in_one_line():
    h100 = Device("cuda", native_bf16=True, capability=(9, 0), triton=True)
    p100 = Device("cuda", native_bf16=False, capability=(6, 0), triton=True)
    no_triton = Device("cuda", native_bf16=True, capability=(8, 0), triton=False)
    cpu = Device("cpu", native_bf16=False)
    assert resolve_compile("auto", h100) and not resolve_compile("auto", p100)
    assert not resolve_compile("auto", no_triton) and not resolve_compile("auto", cpu)
    assert resolve_compile(True, cpu) and resolve_compile(True, h100) and not resolve_compile(False, h100)
    with pytest.raises(CompileUnavailable, match=r"train.compile=true cannot compile for a GPU of compute capability 6.0: "
                                                 r"Triton needs compute capability 7.0 or newer; set train.compile=false"):
        resolve_compile(True, p100)
    with pytest.raises(CompileUnavailable, match=r"Triton is not installed .*; set train.compile=false"):
        resolve_compile(True, no_triton)


def test_a_training_step_neither_reads_the_device_nor_builds_tensors_from_host_values(tmp_path):
    # On a GPU either would make the host wait for the device every step (a sync) or copy to it (torch.tensor of a
    # Python number is a blocking host-to-device copy); only log lines read values back. The profiler names both
    # on any device: `_local_scalar_dense` is a read of a tensor's value on the host, `lift_fresh` a tensor made from
    # host data.
    cfg = TrainConfig(warmup_steps=1, compile=False)
    accelerator = make_accelerator(cfg, tmp_path)
    objective = tiny_objective()
    model = accelerator.prepare(objective)
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    schedule = build_schedule(optimizer, cfg)
    window = LogWindow(accelerator, cfg.max_nonfinite_steps, max_skip_fraction=1.0)
    batch = Batch(images(), torch.full((4,), -1))
    for step in (1, 2):
        window.stepped(step, train_step(accelerator, model, model, optimizer, schedule, [batch], cfg.clip_grad_norm))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        window.stepped(3, train_step(accelerator, model, model, optimizer, schedule, [batch], cfg.clip_grad_norm))

    def inside_fused_optimizer(event) -> bool:  # the CPU kernel reads its scalars on the host; the CUDA one on the device
        while event is not None:
            if event.name.startswith("aten::_fused_"):
                return True
            event = event.cpu_parent
        return False

    assert "aten::_fused_adamw_" in {event.name for event in profile.events()}  # the optimiser step was profiled
    ops = {event.name for event in profile.events() if not inside_fused_optimizer(event)}
    assert not ops & {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::lift_fresh"}, ops


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "fp16-scaler"])
def test_under_a_loss_scaler_only_a_nonfinite_loss_counts_towards_max_nonfinite_steps(tmp_path, scaled):
    # fp16 training overflows now and then by design: the scaler skips the step and lowers its scale. Those steps
    # must not add up to a "diverged" stop; a non-finite loss still does. (fp16 needs a GPU: on a CPU a GradScaler
    # given to Accelerate before the optimiser is prepared plays the loop's part.)
    cfg = TrainConfig(warmup_steps=1, compile=False)
    accelerator = make_accelerator(cfg, tmp_path)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu")
    objective = tiny_objective()
    model = accelerator.prepare(objective)
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    schedule = build_schedule(optimizer, cfg)
    batch = Batch(images(), torch.full((4,), -1))

    def step(poison):
        def forward(images, labels):
            out = model(images, labels)
            if poison == "loss":
                out.loss = out.loss * float("nan")
            return out

        # A finite loss whose gradient overflows:
        hook = objective.head.bias.register_hook(lambda grad: grad * float("inf")) if poison == "gradient" else None
        result = train_step(accelerator, model, forward, optimizer, schedule, [batch], cfg.clip_grad_norm)
        if hook:
            hook.remove()
        return result

    overflow = step("gradient")
    assert not bool(overflow.stepped) and bool(overflow.nonfinite) == (not scaled)
    nan = step("loss")
    assert not bool(nan.stepped) and bool(nan.nonfinite)
    assert bool(step(None).stepped)


def test_the_concurrent_runs_benchmark_times_both_ways_and_prints_their_ratio(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("concurrent_runs", ROOT / "benchmarks" / "concurrent_runs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shards = tmp_path / "shards"
    write_test_shards(shards, [16], size=16)
    timings = tmp_path / "timings.json"
    assert bench.main(["--stage", "pretrain", "--config", str(ROOT / "configs" / "pretrain" / "default.yaml"), "--steps", "2",
                       "--rounds", "1", "--json", str(timings), f"data.shards={shards}", *TINY]) == 0
    rows = json.loads(timings.read_text())["rounds"]
    assert len(rows) == 1 and rows[0]["one_run_steps_per_s"] > 0 and rows[0]["side_by_side_steps_per_s"] > 0
    assert "2 runs side by side do" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--threads must be 2 or more"):
        bench.main(["--config", "configs/pretrain/default.yaml", "--threads", "1"])


def test_the_evaluation_benchmark_scores_both_ways_alike_and_prints_their_ratio(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("evaluation_benchmark", ROOT / "benchmarks" / "evaluation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    write_test_shards(tmp_path / "shards", [24, 16], size=16)
    shards = [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}"]
    assert bench.main(["--evaluations", "2", "--rounds", "1", *shards, *TINY]) == 0  # it asserts equal scores itself
    out = capsys.readouterr().out
    assert out.startswith("40 evaluation images") and "a later evaluation: read / kept = " in out
