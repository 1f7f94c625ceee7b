"""How a run uses this machine: its Accelerator, mixed precision, torch.compile and CPU threads.

`auto` settings are resolved by pure functions of a `Device` (what the hardware supports), so the decisions are
tested with made-up devices on a machine that has none of them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration, parse_flag_from_env
from torch import nn

from mpp.errors import UserError
from mpp.rundir import LOG_LINES, TENSORBOARD
from mpp.training.trackers import JsonLines, check_trackers

# Inductor generates GPU code with Triton, which needs compute capability 7.0 (Volta) or newer.
MIN_TRITON_CAPABILITY = (7, 0)
CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}  # /proc/cpuinfo flags of bf16 dot-product instructions


class CompileUnavailable(UserError):
    """train.compile=true on a device torch.compile cannot generate code for."""


@dataclass(frozen=True)
class Device:
    """What the precision and compile decisions need to know of the device a process trains on."""

    kind: str  # "cuda" or "cpu"
    native_bf16: bool  # bf16 arithmetic in hardware: Ampere and newer GPUs, CPUs with AVX512-BF16 or AMX
    capability: tuple[int, int] | None = None  # CUDA compute capability
    triton: bool = False  # Triton installed (inductor's code generator for GPUs)

    @classmethod
    def this_process(cls) -> Device:
        if cuda_in_use():
            # including_emulation=False: pre-Ampere GPUs report bf16 as supported because it can be emulated.
            return cls("cuda", torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_capability(),
                       importlib.util.find_spec("triton") is not None)
        return cls("cpu", cpu_has_bf16())

    @property
    def name(self) -> str:
        return f"a GPU of compute capability {self.capability[0]}.{self.capability[1]}" if self.capability else "this CPU"


def cuda_in_use() -> bool:
    """Whether this process trains on a GPU: one is visible and Accelerate was not told to use the CPU
    (`accelerate launch --cpu` exports ACCELERATE_USE_CPU; the Accelerator then trains on the CPU, and the precision
    and compile decisions must be the CPU's too)."""
    return torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")


def cpu_has_bf16() -> bool:
    """Whether the CPU has bf16 dot-product instructions, read from the kernel's CPU flags (torch has no public
    query for them); elsewhere than Linux, False, and the run trains in fp32."""
    try:
        return bool(CPU_BF16_FLAGS & set(Path("/proc/cpuinfo").read_text().split()))
    except OSError:
        return False


def resolve_precision(setting: str, device: Device) -> str:
    """train.mixed_precision as Accelerate names it ('no', 'bf16' or 'fp16'), with auto resolved.

    auto: bf16 where the hardware computes it natively; else fp16 with a loss scaler on GPUs (T4, V100, P100:
    emulated bf16 is slower than fp32 there and has no fused attention kernel) and fp32 on CPUs, which have no fp16
    hardware either. On an AVX512-BF16 CPU, bf16 matrix multiplications ran 2.2x to 2.7x faster than fp32
    (docs/benchmarks.md).
    """
    if setting == "fp16" and device.kind == "cpu":
        raise UserError("train.mixed_precision=fp16 needs a GPU (Accelerate trains in fp32 on a CPU); use bf16 "
                        "(fast on CPUs with AVX512-BF16 or AMX) or no")
    if setting != "auto":
        return setting
    if device.native_bf16:
        return "bf16"
    return "fp16" if device.kind == "cuda" else "no"


def resolve_compile(setting: bool | str, device: Device) -> bool:
    """train.compile resolved: auto compiles on GPUs Triton supports (where compiling pays for its minutes), never
    on a CPU; true compiles anywhere inductor can generate code and refuses, in one line, a GPU it cannot."""
    capable = device.kind == "cpu" or (device.triton and device.capability >= MIN_TRITON_CAPABILITY)
    if setting == "auto":
        return device.kind == "cuda" and capable
    if setting and not capable:
        missing = ("Triton is not installed (pip install triton)" if not device.triton else
                   f"Triton needs compute capability {MIN_TRITON_CAPABILITY[0]}.{MIN_TRITON_CAPABILITY[1]} or newer")
        raise CompileUnavailable(f"train.compile=true cannot compile for {device.name}: {missing}; set train.compile=false")
    return bool(setting)


def precision_label(mixed_precision: str) -> str:
    """Accelerate's 'no', 'bf16' or 'fp16' as people say it: 'fp32', 'bf16' or 'fp16'."""
    return "fp32" if mixed_precision == "no" else mixed_precision


def cpu_processes() -> bool:
    """Whether this process trains on the CPU, told to Accelerate as cpu=True: with several processes and no GPU,
    Accelerate 1.x sets up gloo only when told (otherwise every process silently trains alone), and on a machine
    with a GPU that `accelerate launch --cpu` keeps out, a state made without it would take the GPU. The process's
    first state decides, so everything that makes one asks this."""
    return not cuda_in_use()


def process_state() -> PartialState:
    """The process's Accelerate state, set up as make_accelerator sets it up, for code that runs outside a run
    (compare between its stages): a bare PartialState() made first would leave CPU processes each on its own."""
    return PartialState(cpu=cpu_processes())


def make_accelerator(cfg, output_dir: str | Path, trackers: Sequence[str] = ("tensorboard",)) -> Accelerator:
    """The Accelerator of a run under `cfg` (a TrainConfig), logging to `trackers` (log.trackers) and log.txt.
    Accelerate keeps the precision in its per-process state, set by the process's first Accelerator: stages that run
    in one process must agree on it (compare checks)."""
    precision, threads = resolve_precision(cfg.mixed_precision, Device.this_process()), cpu_threads(cfg)
    check_trackers(list(trackers))
    log_with = [*trackers, JsonLines(Path(output_dir) / LOG_LINES)]
    project = ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / TENSORBOARD))
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.grad_accum, cpu=cpu_processes(),
                              log_with=log_with, project_config=project)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(threads)
    elif precision == "no":
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for fp32 training (Ampere and newer)
    return accelerator


def cpu_threads(cfg) -> int:
    """train.cpu_threads, with auto sharing this process's CPUs among the processes on this machine.

    Set here rather than left to OMP_NUM_THREADS: `accelerate launch` sets that to 1 unless told otherwise,
    which on a CPU-only machine trains on one core however many there are.

    The data workers are counted as sharing those CPUs, not as taking cores away: they decode in bursts, and under
    OpenMP's passive wait (pipelines/cli.py) the training threads sleep while a worker runs. On 2 cores with one
    worker, 2 threads beat 1 in every case measured (docs/benchmarks.md), all beside other jobs: the main job
    (0.25-0.27 against 0.36-0.41 s per step), a worker decoding 512-px JPEGs (0.38-0.49 against 0.60-0.72 s), and 3
    more busy processes (1.0-1.1 against 2.0-2.9 s).
    """
    if cfg.cpu_threads != "auto":
        return cfg.cpu_threads
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, available_cpus() // local_processes)


def data_workers(setting: int | str) -> int:
    """data.num_workers, with auto resolved for this process.

    On a GPU: the CPUs this process may use (its share of the machine's, as for train.cpu_threads) less one for the
    training process itself. The GPU consumes images faster than one worker decodes them: ViT-B/16 trains at about
    3,600 images/s on an H200 and one worker decodes about 260 photo-sized JPEGs a second (docs/benchmarks.md).
    On a CPU: one worker. The model step, not decoding, bounds a CPU run (the main job trains 100-400 images/s, one
    core decodes its 64-px JPEGs at about 3,100/s), and every further worker takes time from the training threads.
    """
    if setting != "auto":
        return setting
    if not cuda_in_use():
        return 1
    return max(1, available_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1)


def available_cpus() -> int:
    """The CPUs this process may run on: os.sched_getaffinity counts what a container or taskset allows; macOS and
    Windows lack it."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compiled(model: nn.Module, backend: str, mode: str = "default") -> nn.Module:
    """torch.compile of the prepared model (the DDP wrapper under several processes, so DDP's no_sync and bucketing
    stay visible to it), from a clean dynamo state: models compiled by earlier stages of this process (compare runs
    many) would otherwise use up dynamo's recompile limit, after which every later stage silently runs eager."""
    torch.compiler.reset()
    return torch.compile(model, backend=backend, mode=mode)


def compile_failure(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) came from torch.compile's tracing or code generation.

    Told by the module that defines its class: torch publishes no common base class for these errors (a missing
    Triton, a GPU too old for it, no C++ compiler for inductor on a CPU, an unsupported operation).
    """
    while exc is not None:
        if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class OutOfMemory(UserError):
    """Training ran out of memory; the message names what to lower under this run's batch settings."""


def out_of_memory(err: BaseException) -> bool:
    """torch.OutOfMemoryError on GPU; on CPU a RuntimeError from the allocator (or Python's MemoryError)."""
    text = str(err)
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or any(
        s in text for s in ("out of memory", "can't allocate memory", "not enough memory"))


def model_too_big(err: BaseException, cfg=None, *, classifier: bool = False, mpp_head: bool = False) -> str:
    """The line for running out of memory outside training (building the model, evaluating it): the settings that
    size this run's model (`cfg`, None where a stage runs several), as its objective has them: a classifier's
    model.num_classes, MPP's head. A classifier whose outputs outweigh the backbone is named alone: a stray label
    followed by a model.num_classes that takes it in makes a head of billions of weights."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    settings = ["model.width, model.depth or model.image_size"]
    if cfg is None or mpp_head:
        settings.append("pick a target with fewer outputs (mpp.target and its settings)")
    if cfg is not None and classifier:
        width, depth, classes = cfg.model.variant.width, cfg.model.variant.depth, cfg.model.num_classes
        blocks = 12 * depth * width ** 2  # a block's weights: attention 4 D^2, MLP 8 D^2
        if classes is not None and classes * width > blocks:
            return (f"out of memory ({first}); the classifier's model.num_classes={classes} outputs alone hold "
                    f"{classes * width:,} weights, more than the {blocks:,} of the backbone's blocks: set "
                    f"model.num_classes to the number of classes the shards hold")
        settings.append("lower model.num_classes")
    return f"out of memory ({first}); shrink {', or '.join(settings)}"


@contextlib.contextmanager
def explained_out_of_memory(cfg) -> Iterator[None]:
    """Turn running out of memory while training under `cfg` (a resolved TrainConfig) into one line naming the setting
    that sets the images per forward pass in this run, which is not train.batch_size when train.global_batch_size is."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not out_of_memory(err):
            raise
        if cfg.global_batch_size is None:
            fewer = "lower train.batch_size and raise train.grad_accum to keep the global batch"
        else:
            fewer = (f"set train.micro_batch_size below {cfg.batch_size} (train.grad_accum follows, so "
                     f"train.global_batch_size {cfg.global_batch_size} stays)")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OutOfMemory(f"out of memory with {cfg.batch_size} images per process per forward pass ({first}); {fewer}, "
                          f"or set model.grad_checkpointing=true") from None
