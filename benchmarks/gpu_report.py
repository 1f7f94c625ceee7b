"""What this project does on one GPU, in one command: environment, GEMM ceiling, step speed, kernels, data, tests.

    python benchmarks/gpu_report.py --out DIR              # on a GPU machine: 7 minutes at most (--budget-s 420)
    python benchmarks/gpu_report.py --out DIR --smoke      # every part at a tiny size on the CPU (CI runs this)

Each part runs in its own process under its own time limit, so a crash or a hang in one leaves the others' results;
a part's output goes to DIR/<part>.log as it runs and its numbers to DIR/<part>.json. The report as a whole keeps to
its budget: the parts run in the order of what they decide, each under its own limit or what is left of the budget,
whichever is less, and a part the budget no longer has room for is named as not run. DIR/gpu_report.md and .json are
rewritten after every part, so a report killed from outside still holds what finished. The whole test suite runs
beside the GPU-timing parts (its tests train on the CPU, on the cores the GPU parts leave), after the end-to-end data
measurement, which needs every core; each test's outcome is in DIR/suite.log the moment it finishes, and every
failure is named in the report. At the end: DIR/gpu_report.md, DIR/gpu_report.json and the summary table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "benchmarks" / "step.py"

# What the report needs to run at all, by import name (pip name where it differs), and what it can do without.
REQUIRED = {"torch": "torch", "accelerate": "accelerate", "webdataset": "webdataset", "braceexpand": "braceexpand",
            "pydantic": "pydantic", "omegaconf": "omegaconf", "einops": "einops", "tensorboard": "tensorboard",
            "safetensors": "safetensors", "PIL": "pillow", "numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm",
            "matplotlib": "matplotlib", "pytest": "pytest"}
OPTIONAL = {"vit_pytorch": "vit-pytorch (the peer in the step benchmark)", "xdist": "pytest-xdist (the suite in parallel)",
            "transformers": "transformers (the export tests)", "triton": "triton (torch.compile on GPUs)"}

# Kernel categories of the profile, by kernel name (first match wins).
KERNEL_CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated|_efficient_attention", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|sm\d+_.*_tn|matmul|aten::(mm|addmm|bmm|linear)\b", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("triton fused element-wise / norm", re.compile(r"^triton_", re.I)),
]


def missing_imports() -> list[str]:
    return [pip for name, pip in REQUIRED.items() if importlib.util.find_spec(name) is None]


# ----------------------------------------------------------------------------------------------- the parts' plans


def plan(smoke: bool, cores: int, peak: float | None, out: Path) -> tuple[list[dict], dict]:
    """The parts that run one after another, and the suite, which runs beside them from the step benchmarks on. Each
    part: its command, its time limit, and the seconds it needs to say anything at all (a budget with less left does
    not start it). The order is what a budget that runs out should cut last: the machine, the main step (with the
    peer) and where its time goes, then whether the promises hold on the GPU (the gpu tests), then the lever that
    could change a default (max-autotune), then the other sizes."""
    me = [sys.executable, str(Path(__file__).resolve()), "--out", str(out)]
    mode = ["--smoke"] if smoke else []
    part = lambda name, cmd, limit, needs, **extra: {"name": name, "cmd": cmd, "limit": limit, "needs": 3 if smoke else needs, **extra}
    if smoke:  # the step with the peer, and the compile modes side by side: the other sizes are the first's code
        tiny = [sys.executable, str(STEP), "--device", "cpu", "--model", "vit_ti", "--width", "32", "--depth", "1", "--heads", "2",
                "--patch-size", "4", "--image-size", "16", "--rounds", "1", "--steps", "1", "--warmup", "1", "--batch-size", "8"]
        main_step = part("step_b16", tiny, 60, 3, json=True)
        # The mode's path, without inductor's C++ GEMM template search, which times nothing a GPU report uses and took
        # 35-55 s more of a cold compile cache on 2 cores (no difference with a warm one).
        other_steps = [part("step_b16_autotune", [*tiny, "--no-peer", "--compile", "on", "--compare-compile-mode",
                                                  "max-autotune-no-cudagraphs"], 120, 3, json=True,
                            env={"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS": "ATEN"})]
        suite = [sys.executable, "-m", "pytest", "tests/test_config_model.py", "-k", "mixed_precision_no", "-m", "not gpu"]
    else:
        full = ["--device", "cuda", "--image-size", "224", "--rounds", "3", "--steps", "5", *(["--peak-tflops", str(peak)] if peak else [])]
        step = lambda name, model, batch, limit, needs, *extra: part(
            name, [sys.executable, str(STEP), *full, "--model", model, "--batch-size", str(batch), *extra], limit, needs, json=True)
        main_step = step("step_b16", "vit_b16", 256, 150, 90)
        other_steps = [step("step_b16_autotune", "vit_b16", 256, 240, 150, "--no-peer", "--compare-compile-mode", "max-autotune-no-cudagraphs"),
                       step("step_s16", "vit_s16", 256, 75, 45, "--no-peer"), step("step_l16", "vit_l16", 128, 100, 60, "--no-peer"),
                       step("step_b16_b128", "vit_b16", 128, 75, 45, "--no-peer"), step("step_b16_b512", "vit_b16", 512, 90, 60, "--no-peer")]
        suite = [sys.executable, "-m", "pytest", "-m", "not gpu", *(["-n", str(max(1, cores - 4))] if has("xdist") else []),
                 *(["--timeout", "300"] if has("pytest_timeout") else [])]
    # Each test trains on all the cores it may use, beside the other xdist workers: threads that sleep while they
    # wait, not spin (docs/benchmarks.md, OpenMP's wait policy), or they starve one another.
    report_log = lambda name: ["--report-log", str(out / f"{name}.jsonl")] if has("pytest_reportlog") else []
    parts = [
        part("env", [*me, "--part", "env", *mode], 60, 10),
        part("gemm", [*me, "--part", "gemm", *mode], 60, 15),
        part("e2e", [*me, "--part", "e2e", *mode, "--workers", str(max(1, cores - 2))], 60 if smoke else 150, 90),
        main_step,
        part("profile", [*me, "--part", "profile", *mode], 60 if smoke else 90, 45),
        part("gpu_tests", [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-o", "addopts=", "-v", "-rA",
                           "-p", "no:cacheprovider", *report_log("gpu_tests")], 60 if smoke else 420, 60),
        *other_steps,
    ]
    suite_part = part("suite", [*suite, "-o", "addopts=", "-v", "-rA", "-p", "no:cacheprovider", *report_log("suite")],
                      60 if smoke else 420, 60, env={"OMP_WAIT_POLICY": "PASSIVE"})
    if smoke:  # on the CPU even where a GPU is visible
        for each in (*parts, suite_part):
            each["env"] = {**each.get("env", {}), "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}
    return parts, suite_part


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------------------------- running parts


class Budget:
    """The whole report's time: a part gets its own limit or what is left, whichever is less, and does not start when
    what is left is shorter than it needs to say anything (a step benchmark on a GPU spends half a minute compiling)."""

    REPORT_S = 5  # kept back for writing the report

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def limit(self, part: dict) -> float | None:
        left = self.end - time.perf_counter() - self.REPORT_S
        return min(part["limit"], left) if left >= part["needs"] else None


NOT_RUN = "not run: the report's time budget was spent"
NOT_RUN_RESULT = {"status": NOT_RUN, "seconds": 0, "log": None}
RUNNING: set[subprocess.Popen] = set()  # parts started and not yet collected: stopped with the report


class StopSignal:
    """SIGTERM's handler: a scheduler's or a person's stop ends the report with status 128 + signum, and the parts'
    process groups go with it. A stop that arrives while a part is starting is held until the part is in RUNNING:
    raised inside Popen (the child forked, Popen not yet returned), it left that part running on after the report."""

    def __init__(self) -> None:
        self.starting, self.pending = False, None

    def __call__(self, signum, frame) -> None:
        if self.starting:
            self.pending = signum
            return
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def held(self):
        self.starting = True
        try:
            yield
        finally:
            self.starting = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise SystemExit(128 + signum)


STOP = StopSignal()


def start(part: dict, out: Path, limit: float, cpus: list[int] | None = None) -> subprocess.Popen:
    cmd = list(part["cmd"])
    if part.get("json"):
        cmd += ["--json", str(out / f"{part['name']}.json")]
    log = open(out / f"{part['name']}.log", "w")
    log.write(" ".join(cmd) + "\n\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **part.get("env", {})}
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with STOP.held():
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec,
                                start_new_session=True)
        proc.part, proc.log, proc.started, proc.limit = part, log, time.perf_counter(), limit
        RUNNING.add(proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def finish(proc: subprocess.Popen, out: Path) -> dict:
    """Wait for a part (up to its limit), stop its whole process group if it overran, and collect what it left."""
    part = proc.part
    remaining = proc.limit - (time.perf_counter() - proc.started)
    try:
        rc = proc.wait(timeout=max(remaining, 0.1))
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        stop(proc)
        status = (f"timed out after {part['limit']} s" if proc.limit >= part["limit"]
                  else f"stopped after {proc.limit:.0f} s, at the end of the report's time budget")
    RUNNING.discard(proc)
    proc.log.close()
    seconds = time.perf_counter() - proc.started
    result = {"status": status, "seconds": round(seconds, 1), "log": f"{part['name']}.log"}
    path = out / f"{part['name']}.json"
    if path.is_file():
        try:
            result["data"] = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    if part["name"] in ("suite", "gpu_tests"):
        result["tests"] = test_outcomes((out / f"{part['name']}.log").read_text(errors="replace"))
    print(f"  {part['name']:<18s} {status} in {seconds:.0f} s", flush=True)
    return result


OUTCOME = re.compile(r"(?:(tests/\S+::\S+(?:\[[^\]]*\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS))|"
                     r"(?:(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+::\S+))")


def test_outcomes(log: str) -> dict:
    """Each test's outcome as pytest -v printed it (serial: 'name OUTCOME'; xdist: 'OUTCOME name')."""
    outcomes: dict[str, str] = {}
    for match in OUTCOME.finditer(log):
        name, outcome = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        outcomes[name] = outcome  # a failing teardown after a pass reports ERROR last
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "failed": sorted(n for n, o in outcomes.items() if o in ("FAILED", "ERROR"))}


# ----------------------------------------------------------------------------------------------- in-process parts


def part_env(args) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "triton": version_of("triton"), "accelerate": version_of("accelerate"), "cpus": len(os.sched_getaffinity(0)),
            "cpu": cpu_model()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                 "gpu_memory_gib": round(props.total_memory / 2**30, 1), "capability": list(torch.cuda.get_device_capability(0))}
        smi = shutil.which("nvidia-smi")
        if smi:
            query = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
            info["driver"] = query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else None
    else:
        info["gpu"] = None
    return info


def version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return None


def part_gemm(args) -> dict:
    """bf16 matmul TFLOP/s (2 FLOPs per multiply-add): a large square one and the ViT-B/16 MLP's at batch 256."""
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    shapes = {"8192^3": (8192, 8192, 8192), "ViT-B MLP (256*197)x768x3072": (256 * 197, 768, 3072)}
    if not cuda:
        shapes = {"256^3": (256, 256, 256), "(4*65)x64x256": (4 * 65, 64, 256)}
    results = {}
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        reps = 50 if cuda else 3
        if cuda:
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(5):
                begin.record()
                for _ in range(reps):
                    a @ b
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end) / 1e3 / reps)
        else:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(reps):
                    a @ b
                times.append((time.perf_counter() - started) / reps)
        results[name] = {"m": m, "k": k, "n": n, "tflops": 2 * m * k * n / min(times) / 1e12}
    return {"device": device, "dtype": "bf16", "shapes": results}


def part_profile(args) -> dict:
    """Kernel time of one training step of ViT-B/16 at batch 256 (compiled, bf16), by category, from torch.profiler."""
    import tempfile

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    from mpp.config import TrainConfig
    from mpp.data.stream import Batch
    from mpp.model.vit import build_vit
    from mpp.model.objectives import MaskedPatchPrediction
    from mpp.training.optim import build_optimizer, build_schedule, param_groups
    from mpp.training.runtime import Device, compiled, make_accelerator, resolve_compile
    from mpp.training.loop import train_step

    cuda = torch.cuda.is_available() and not args.smoke
    cfg = TrainConfig(lr=1e-4, warmup_steps=0, batch_size=256 if cuda else 8)
    accelerator = make_accelerator(cfg, tempfile.mkdtemp(prefix="mpp-profile-"))
    vit = build_vit("vit_b16", 224) if cuda else build_vit("vit_ti", 16, 4, width=32, depth=1, heads=2)
    objective = MaskedPatchPrediction(vit, corrupt_rate=0.5, mask_prob=0.8, random_prob=0.1)
    model = accelerator.prepare(objective)
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    schedule = build_schedule(optimizer, cfg)
    compiling = resolve_compile(cfg.compile, Device.this_process())
    forward = compiled(model, cfg.compile_backend) if compiling else model
    images = torch.randint(0, 256, (cfg.batch_size, 3, vit.image_size, vit.image_size), dtype=torch.uint8, device=accelerator.device)
    batch = Batch(images, torch.full((cfg.batch_size,), -1, device=accelerator.device))

    def step():
        train_step(accelerator, model, forward, optimizer, schedule, [batch], cfg.clip_grad_norm)

    for _ in range(3):
        step()
    steps = 3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps
    categories: dict[str, float] = {}
    top: list[tuple[float, str, str]] = []
    for event in prof.key_averages():
        # GPU: the kernels themselves (the operators that launch them would count their time twice); CPU: the operators.
        if cuda:
            us = event.self_device_time_total if event.device_type == DeviceType.CUDA else 0
        else:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        if us <= 0:
            continue
        category = next((c for c, pattern in KERNEL_CATEGORIES if pattern.search(event.key)), "other")
        categories[category] = categories.get(category, 0.0) + us / 1e3 / steps
        top.append((us / 1e3 / steps, category, event.key[:120]))
    total = sum(categories.values())
    return {"device": accelerator.device.type, "model": "vit_b16 224 px" if cuda else "tiny", "batch": cfg.batch_size,
            "compiled": compiling, "precision": accelerator.mixed_precision, "step_wall_ms": wall * 1e3,
            "kernel_ms": total, "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"ms": ms, "category": c, "name": n} for ms, c, n in sorted(top, reverse=True)[:15]]}


def part_e2e(args) -> dict:
    """Pretraining from generated photo-sized JPEG shards (500x375, the size of a typical photo collection's),
    `--workers` data workers: the images per second the data pipeline and the step reach together."""
    out = Path(args.out) / "e2e"
    shutil.rmtree(out, ignore_errors=True)
    shards = out / "shards"
    shards.mkdir(parents=True)
    count, size, per_shard = (96, (100, 75), 48) if args.smoke else (4096, (500, 375), 256)
    started = time.perf_counter()
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(shards / f"photos-{s:06d}.tar", range(s * per_shard, min((s + 1) * per_shard, count)), size)
            for s in range((count + per_shard - 1) // per_shard)]
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        list(pool.map(write_photo_shard, *zip(*jobs)))
    generated = time.perf_counter() - started
    run = out / "run"
    cmd = [sys.executable, str(ROOT / "launch.py"), "pretrain", *e2e_overrides(args.smoke, shards, run, args.workers)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    if proc.returncode != 0:
        raise SystemExit(f"pretraining failed (exit {proc.returncode})")
    results = json.loads((run / "results.json").read_text())
    final = results["final"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rates, waits = [], []
    for events in (run / "tensorboard").iterdir():
        acc = EventAccumulator(str(events)).Reload()
        if "train/perf/images_per_sec" in acc.Tags()["scalars"]:
            rates = [e.value for e in acc.Scalars("train/perf/images_per_sec")][1:]  # the first window holds the compile
            waits = [e.value for e in acc.Scalars("train/perf/data_wait_fraction")][1:]
    return {"images": count, "image_size": list(size), "shards": len(jobs), "generate_s": generated, "workers": args.workers,
            "wall_s": wall, "images_per_s_median": statistics.median(rates) if rates else final.get("train/perf/images_per_sec"),
            "data_wait_median": statistics.median(waits) if waits else final.get("train/perf/data_wait_fraction"),
            "images_per_s_with_start": results.get("timing", {}).get("images_per_sec"), "final_loss": final.get("train/pretext_loss"),
            "command": " ".join(cmd)}


def e2e_overrides(smoke: bool, shards: Path, run: Path, workers: int) -> list[str]:
    """The end-to-end part's pretraining settings: ViT-B/16 at 224 px and batch 256 for 100 steps (smoke: a tiny ViT)."""
    if smoke:
        model = ["model.name=vit_ti", "model.width=32", "model.depth=1", "model.heads=2", "model.image_size=16", "model.patch_size=4"]
        train = ["train.steps=6", "train.batch_size=8", "log.every=2"]
    else:
        model = ["model.name=vit_b16", "model.image_size=224"]
        train = ["train.steps=100", "train.batch_size=256", "log.every=10"]
    return [f"data.shards={shards}", f"output_dir={run}", *model, *train, f"data.num_workers={workers}", "train.warmup_steps=2",
            "train.checkpoint_every=100000", "log.images_every=100000", "data.shuffle_buffer=500"]


def write_photo_shard(path: Path, keys: range, size: tuple[int, int]) -> None:
    """A shard of photo-sized JPEGs: the synthetic corpus's images scaled up, with noise, so they do not compress
    like flat colour (quality 90, as a camera's)."""
    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from mpp.data.synthetic import synthetic_image

    rng = np.random.default_rng(keys.start)
    with tarfile.open(path, "w") as tar:
        for key in keys:
            image, label = synthetic_image(key, 64)
            pixels = np.asarray(image.resize(size, Image.BILINEAR), dtype=np.int16)
            pixels = np.clip(pixels + rng.integers(-12, 13, pixels.shape), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            for suffix, payload in (("jpg", buffer.getvalue()), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key:08d}.{suffix}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


PARTS = {"env": part_env, "gemm": part_gemm, "profile": part_profile, "e2e": part_e2e}


# ----------------------------------------------------------------------------------------------- the report


def summary_rows(results: dict) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    env = results.get("env", {}).get("data")
    if env:
        rows.append(("device", f"{env.get('gpu') or 'CPU: ' + str(env.get('cpu'))}, {env.get('cpus')} CPUs; driver "
                               f"{env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                               f"cuDNN {env.get('cudnn')}, triton {env.get('triton')}"))
    for name, shape in results.get("gemm", {}).get("data", {}).get("shapes", {}).items():
        rows.append((f"bf16 GEMM {name}", f"{shape['tflops']:.3g} TFLOP/s"))
    for part, result in results.items():
        if not part.startswith("step_"):
            continue
        data = result.get("data")
        if not data:
            rows.append((part, result["status"]))
            continue
        ours_name, *peers = data["rows"]
        ours = data["rows"][ours_name]
        mfu = f", {ours['mfu']:.1%} MFU" if ours.get("mfu") else ""
        mode = f", {data['compile_mode']}" if data.get("compile_mode", "default") != "default" else ""
        text = f"{ours['images_per_s']:,.0f} img/s{mfu}, warm-up {ours['warmup_s']:.0f} s{mode}"
        for peer in peers:
            text += f"; {peer} {data['rows'][peer]['images_per_s']:,.0f} ({ours['images_per_s'] / data['rows'][peer]['images_per_s']:.2f}x)"
        modes = ", compile modes side by side" if any("max-autotune" in name for name in data["rows"]) else ""
        rows.append((f"step {data['model']} b{data['batch_size']} {data['image_size']} px{modes}", text))
    profile = results.get("profile", {}).get("data")
    if profile:
        total = profile["kernel_ms"]
        split = ", ".join(f"{c} {ms:.1f} ({ms / total:.0%})" for c, ms in profile["categories_ms"].items())
        rows.append((f"kernel time of one step ({profile['model']}, b{profile['batch']})", f"{total:.1f} ms: {split}"))
    e2e = results.get("e2e", {}).get("data")
    if e2e:
        rows.append((f"pretraining from {e2e['image_size'][0]}x{e2e['image_size'][1]} JPEG shards, {e2e['workers']} workers",
                     f"{e2e['images_per_s_median']:,.0f} img/s, data wait {e2e['data_wait_median']:.1%}"))
    for part in ("gpu_tests", "suite"):
        if part in results and results[part]["status"] == NOT_RUN:
            rows.append((part.replace("_", " "), NOT_RUN))
        elif part in results:
            tests = results[part].get("tests", {})
            counts = ", ".join(f"{n} {o.lower()}" for o, n in sorted(tests.get("counts", {}).items())) or "no test finished"
            failed = tests.get("failed", [])
            rows.append((part.replace("_", " "), f"{results[part]['status']}; {counts}" + (f"; failed: {', '.join(failed)}" if failed else "")))
    for part, result in results.items():
        if result["status"] != "ok" and part not in ("gpu_tests", "suite") and not part.startswith("step_"):
            rows.append((part, result["status"] + (f" (see {result['log']})" if result["log"] else "")))
    return rows


def write_report(out: Path, results: dict, started: float, command: str, state: str) -> str:
    """state: running (written after each part), finished, or stopped (by a signal or an error, before the end)."""
    rows = summary_rows(results)
    width = max((len(k) for k, _ in rows), default=0)
    table = "\n".join(f"{k:<{width}s}  {v}" for k, v in rows)
    seconds = f"{time.time() - started:.0f} s"
    elapsed = {"running": f"{seconds} so far, still running.", "finished": f"{seconds} in all.",
               "stopped": f"stopped before its end, after {seconds}."}[state]
    md = ["# GPU report", "", f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {elapsed}",
          "", "| measurement | result |", "|---|---|",
          *(f"| {k} | {v} |" for k, v in rows), "", "## Parts", "", "| part | status | seconds | log |", "|---|---|---|---|",
          *(f"| {p} | {r['status']} | {r['seconds']} | {r['log'] or '-'} |" for p, r in results.items())]
    (out / "gpu_report.md").write_text("\n".join(md) + "\n")
    (out / "gpu_report.json").write_text(json.dumps({"command": command, "started": started, "state": state,
                                                     "parts": results}, indent=1))
    return table


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the report, the parts' logs and their numbers")
    parser.add_argument("--smoke", action="store_true", help="every part at a tiny size on the CPU (seconds, for CI)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak for MFU (H100/H200 SXM: 989)")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="the whole report's time in seconds (default 420, 7 minutes): parts that no longer fit are "
                             "named as not run, and the suite beside them is stopped when it is spent")
    parts = [p["name"] for p in plan(False, 1, None, Path())[0]]
    parser.add_argument("--skip", nargs="*", default=[], metavar="PART", choices=parts,
                        help=f"parts to leave out: {' '.join(parts)} (the suite runs beside them while the budget lasts)")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)

    missing = missing_imports()
    if missing:
        print(f"error: missing Python packages: {', '.join(missing)} (install them; without network, carry them as "
              f"wheels, install with pip install --no-index --no-deps --target DIR and set PYTHONPATH=DIR: docs/speed.md, "
              f"'Measuring a GPU')", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        parser.error(f"--out {args.out} is a file; choose a directory for the report")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out} cannot be created ({exc.strerror}); choose a directory that can be written")
    if args.part:
        result = PARTS[args.part](args)
        (out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return 0

    import torch

    if not args.smoke and not torch.cuda.is_available():
        parser.error("torch sees no CUDA GPU; --smoke runs every part at a tiny size on the CPU")
    command = " ".join(["python", "benchmarks/gpu_report.py", *(argv if argv is not None else sys.argv[1:])])
    started = time.time()
    cpus = sorted(os.sched_getaffinity(0))
    absent = [desc for name, desc in OPTIONAL.items() if not has(name)]
    if absent:
        print(f"not installed (the parts that use them say so): {'; '.join(absent)}", flush=True)
    gpu_parts, suite = plan(args.smoke, len(cpus), args.peak_tflops, out)
    gpu_parts = [part for part in gpu_parts if part["name"] not in args.skip]
    budget = Budget(args.budget_s)
    results: dict[str, dict] = {}
    suite_proc, completed = None, False

    signal.signal(signal.SIGTERM, STOP)
    try:
        for part in gpu_parts:
            if part["name"] == "step_b16" and suite_proc is None and (limit := budget.limit(suite)):
                # After the end-to-end part, which wants every core: the suite's CPU tests on all cores but 4.
                suite_proc = start(suite, out, limit, cpus[4:] if len(cpus) > 6 else None)
            limit = budget.limit(part)
            if limit is None:
                results[part["name"]] = dict(NOT_RUN_RESULT)
                continue
            results[part["name"]] = finish(start(part, out, limit, cpus[:4] if suite_proc and len(cpus) > 6 else None), out)
            write_report(out, results, started, command, "running")
        if suite_proc is None and (limit := budget.limit(suite)):
            suite_proc = start(suite, out, limit)
        results["suite"] = finish(suite_proc, out) if suite_proc else dict(NOT_RUN_RESULT)
        completed = True
    finally:
        for proc in list(RUNNING):
            stop(proc)
        table = write_report(out, results, started, command, "finished" if completed else "stopped")
    print(f"\n{table}\n\nwritten: {out / 'gpu_report.md'}, {out / 'gpu_report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
