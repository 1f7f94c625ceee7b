"""The one training loop. Pretraining and fine-tuning differ only in the objective module and its evaluators."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration, broadcast_object_list
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from tqdm.auto import tqdm

from mpp.checkpoint import save_weights
from mpp.config import LogConfig, TrainConfig
from mpp.data import Batch, DataError, StreamState
from mpp.errors import UserError
from mpp.objectives import Objective
from mpp.rundir import TENSORBOARD, WEIGHTS, checkpoint_dir, checkpoint_fault, checkpoint_root, complete_checkpoints, write_manifest

SKIP_REASONS = ("missing_image", "undecodable_image", "unreadable_shard", "bad_label")
PANEL_IMAGES = 8
PANEL_GAP = 4  # white pixels between the panel's cells


@dataclass
class Evaluator:
    """What the loop evaluates: `run(module, step)` is called on every process every `every` steps and after the
    last, with the unwrapped objective (its `backbone` is the encoder being trained), and returns the scalars to log
    under their TensorBoard tags ({'fewshot/5shot': 0.41}); they also go into train's results.

    An implementer returns the same tags on every process, leaves the training RNG and data stream alone (a
    private generator, its own loader: the run's weights do not change with it), and may leave the module in eval
    mode (the loop sets train mode again). Stages build theirs from config: pipelines/evaluators.py.
    """

    every: int
    run: Callable[[nn.Module, int], dict[str, float]]


@dataclass
class Progress:
    """Checkpointed with the model: the step counter, the last step whose evaluations ran, the data stream's position.

    A step's checkpoint is written before its evaluations, so a resume from it runs them first.
    """

    step: int = 0
    evaluated: int = 0
    stream: StreamState = field(default_factory=StreamState)

    def state_dict(self) -> dict:
        return {"step": self.step, "evaluated": self.evaluated, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evaluated = state["step"], state["evaluated"]
        self.stream.load_state_dict(state["stream"])


def accelerator_settings(cfg: TrainConfig) -> tuple[str, bool]:
    """(mixed precision, compile) with auto resolved for this machine. Accelerate keeps both in its per-process
    state, set by the process's first Accelerator: stages that run in one process must agree on them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = default_precision(device) if cfg.mixed_precision == "auto" else cfg.mixed_precision
    return precision, (device == "cuda" if cfg.compile == "auto" else cfg.compile)


def cpu_processes() -> bool:
    """Several processes without GPUs: Accelerate 1.x sets up gloo for them only when told cpu=True; otherwise every
    process silently trains alone. The process's first state decides, so everything that makes one asks this."""
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_state() -> PartialState:
    """The process's Accelerate state, set up as make_accelerator sets it up, for code that runs outside a run
    (compare between its stages): a bare PartialState() made first would leave CPU processes each on its own."""
    return PartialState(cpu=cpu_processes())


def make_accelerator(cfg: TrainConfig, output_dir: str | Path) -> Accelerator:
    precision, compile_model = accelerator_settings(cfg)
    project = ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / TENSORBOARD))
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.grad_accum, cpu=cpu_processes(),
                              dynamo_backend="inductor" if compile_model else "no", log_with="tensorboard",
                              project_config=project)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg))
    return accelerator


def default_precision(device: str) -> str:
    """train.mixed_precision auto: bf16 on GPU and on CPUs with bf16 dot-product instructions, fp32 elsewhere.

    On an AVX512-BF16 CPU, bf16 matrix multiplications ran 2.2x to 2.7x faster than fp32 ones (docs/benchmarks.md);
    CPUs without such instructions have no bf16 hardware for it to use, so they stay fp32.
    """
    if device == "cuda":
        return "bf16"
    native = (getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return "bf16" if any(native) else "no"


def precision_label(mixed_precision: str) -> str:
    """Accelerate's 'no', 'bf16' or 'fp16' as people say it: 'fp32', 'bf16' or 'fp16'."""
    return "fp32" if mixed_precision == "no" else mixed_precision


def cpu_threads(cfg: TrainConfig) -> int:
    """train.cpu_threads, with auto sharing this process's CPUs among the processes on this machine.

    Set here rather than left to OMP_NUM_THREADS: `accelerate launch` sets that to 1 unless told otherwise,
    which on a CPU-only machine trains on one core however many there are.
    """
    if cfg.cpu_threads != "auto":
        return cfg.cpu_threads
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # os.sched_getaffinity counts what a container or taskset allows; macOS and Windows lack it.
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available // local_processes)


def layer_id(name: str, depth: int, tokens: set[str]) -> int:
    """BEiT/MAE layer numbering of a parameter of an objective: the patch embedding and the input `tokens` ([class],
    position embeddings, [mask]) are layer 0, block i is layer i + 1, the final norm and every head layer depth + 1."""
    if name in tokens or name.startswith("backbone.patch_embed."):
        return 0
    if name.startswith("backbone.blocks."):
        return int(name.split(".")[2]) + 1
    return depth + 1


def build_optimizer(objective: Objective, cfg: TrainConfig) -> torch.optim.Optimizer:
    """No weight decay on biases, norms and the objective's no_weight_decay() tokens (common ViT practice); with
    cfg.layer_decay < 1, layer l learns at lr x decay^(depth + 1 - l) (BEiT/MAE), one group per layer and decay.

    Each group's lr is its peak; the scheduler's factor multiplies every group's own, so warmup and cosine keep
    the ratios. With decay 1 every layer has scale 1 and the groups are today's two.
    """
    depth, tokens = objective.backbone.depth, objective.no_weight_decay()
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, param in objective.named_parameters():
        if param.requires_grad:
            scale = cfg.layer_decay ** (depth + 1 - layer_id(name, depth, tokens))
            exempt = param.ndim <= 1 or name in tokens
            groups.setdefault((scale, exempt), []).append(param)
    groups = [{"params": params, "lr": cfg.lr * scale, "lr_scale": scale, "weight_decay": 0.0 if exempt else cfg.weight_decay}
              for (scale, exempt), params in sorted(groups.items())]
    # Fused kernels (CPU and CUDA): one pass over all parameters, and they honour `found_inf` (see apply_gradients).
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    optimizer = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return optimizer(groups, lr=cfg.lr, betas=cfg.betas, fused=True)


def head_lr(scheduler) -> float:
    """The learning rate of the head (the top layer, scale 1): what train/lr shows under layer decay."""
    return max(scheduler.get_last_lr())


def apply_gradients(accelerator: Accelerator, objective: nn.Module, optimizer, clip_grad_norm: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip, then step unless the gradient is non-finite; returns (grad_norm, finite) as device tensors.

    No host sync: a fused optimiser given `found_inf` leaves weights, moments and step count untouched when it
    is set, so a NaN/inf gradient never reaches them and the GPU never waits for the CPU to decide.
    """
    grad_norm = accelerator.clip_grad_norm_(objective.parameters(), clip_grad_norm or math.inf)
    finite = torch.isfinite(grad_norm)
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
    torch_optimizer.found_inf = (~finite).float()
    optimizer.step()
    return grad_norm, finite


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


# ---------------------------------------------------------------- checkpoints


def resumable_checkpoint(accelerator: Accelerator, output_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies, saying which newer ones were skipped and why; None when there is none yet.

    The main process verifies (reading each file once) and tells the others.
    """
    choice: list = [None, None, 0]  # path, the newest one's fault, candidates
    if accelerator.is_main_process:
        candidates = complete_checkpoints(output_dir)
        choice[2] = len(candidates)
        for candidate in reversed(candidates):
            fault = checkpoint_fault(candidate, accelerator.num_processes)
            if fault is None:
                choice[0] = str(candidate)
                break
            choice[1] = choice[1] or f"{candidate.name}: {fault}"
            print(f"skipping checkpoint {candidate}: {fault}", file=sys.stderr, flush=True)
    broadcast_object_list(choice)
    path, newest_fault, candidates = choice
    if path is None and candidates:
        raise UserError(f"none of the {candidates} checkpoint(s) in {checkpoint_root(output_dir)} verifies (newest, "
                        f"{newest_fault}); move them aside to start afresh")
    if path is None:
        accelerator.print(f"resume: {checkpoint_root(output_dir)} holds no checkpoint yet, so this run starts at step 0")
    return None if path is None else Path(path)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, keep: int) -> Path:
    """Write to a temporary name, then rename: a crash mid-save never leaves a checkpoint that looks complete."""
    root = checkpoint_root(output_dir)
    final, partial = checkpoint_dir(output_dir, step), checkpoint_dir(output_dir, step, partial=True)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(partial, accelerator.num_processes)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# ---------------------------------------------------------------- logging helpers


def for_display(images: torch.Tensor, min_size: int = 128) -> torch.Tensor:
    """Small crops are upscaled (nearest) so patches stay visible in TensorBoard."""
    scale = max(1, min_size // images.shape[-1])
    return F.interpolate(images.float(), scale_factor=scale, mode="nearest").to(torch.uint8).cpu()


class Meter:
    """Sums per-step scalars on the device; syncs with the host only when a log line is written.

    `keep` (a device bool) drops a step's values without a sync: skipped non-finite steps are not averaged in.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, values: dict[str, torch.Tensor], keep: torch.Tensor) -> None:
        for name, value in values.items():
            value = torch.where(keep, value.detach().float(), 0.0)
            self.sums[name] = self.sums[name] + value if name in self.sums else value
            self.counts[name] = self.counts[name] + keep.float() if name in self.counts else keep.float()

    def means(self, accelerator: Accelerator) -> dict[str, float]:
        """Means over the kept steps of every rank; a name with no kept step is left out."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        stacked = torch.stack([torch.stack([self.sums[n], self.counts[n]]) for n in names])  # (names, 2)
        self.sums, self.counts = {}, {}
        totals = accelerator.reduce(stacked, reduction="sum").tolist()
        return {n: s / c for n, (s, c) in zip(names, totals) if c > 0}


class LogWindow:
    """The steps between two log lines: what they trained on, how long they waited for data, what they skipped.

    The loop reports each batch read (`read`) and each optimiser step (`stepped`); `write` closes the window,
    logging the line's scalars (train/* means of the kept steps, data/skipped_* and train/nonfinite_steps since the
    start, train/lr, perf/*), and opens the next. It is also where the run stops on too many non-finite steps in a
    row (counted on the device, so checked only here: the host never waits on the GPU for them; the skipped steps
    in between left the weights untouched) or on too many unusable samples.
    """

    def __init__(self, accelerator: Accelerator, max_nonfinite_steps: int, max_skip_fraction: float) -> None:
        self.accelerator, self.max_nonfinite_steps, self.max_skip_fraction = accelerator, max_nonfinite_steps, max_skip_fraction
        self.meter, self.skipped = Meter(), Counter()
        self.start, self.waited, self.images, self.images_total = time.perf_counter(), 0.0, 0, 0
        self.nonfinite = {name: torch.zeros((), dtype=torch.long, device=accelerator.device) for name in ("total", "run", "diverged_at")}

    def read(self, batch: Batch, waited: float) -> None:
        self.waited += waited
        self.skipped.update(batch.skipped)
        self.images += batch.images.shape[0]

    def stepped(self, step: int, outputs: list, grad_norm: torch.Tensor, finite: torch.Tensor) -> None:
        for out in outputs:
            self.meter.add({"loss": out.loss, **out.metrics}, keep=finite)
        self.meter.add({"grad_norm": grad_norm}, keep=finite)
        self.nonfinite["total"] += ~finite
        self.nonfinite["run"] = torch.where(finite, 0, self.nonfinite["run"] + 1)
        reached = (self.nonfinite["run"] >= self.max_nonfinite_steps) & (self.nonfinite["diverged_at"] == 0)
        self.nonfinite["diverged_at"] = torch.where(reached, step, self.nonfinite["diverged_at"])

    def write(self, step: int, lr: float) -> dict[str, float]:
        """Log the line's scalars at `step` and return them."""
        accelerator = self.accelerator
        diverged_at = int(self.nonfinite["diverged_at"])
        if diverged_at:
            raise TrainingDiverged(
                f"{self.max_nonfinite_steps} consecutive steps had a non-finite loss or gradient, the last at step "
                f"{diverged_at} (lr {lr:.3g}); lower train.lr, lengthen train.warmup_steps, "
                f"keep train.clip_grad_norm set, or use train.mixed_precision=no, then --resume from the last checkpoint")
        elapsed = time.perf_counter() - self.start
        scalars = {f"train/{k}": v for k, v in self.meter.means(accelerator).items()}
        self.images_total += self.images
        totals = accelerator.reduce(torch.tensor([float(self.skipped[r]) for r in SKIP_REASONS] + [float(self.images_total)],
                                                 device=accelerator.device), reduction="sum").tolist()
        scalars.update({f"data/skipped_{r}": c for r, c in zip(SKIP_REASONS, totals)})
        scalars["train/nonfinite_steps"] = int(self.nonfinite["total"])
        scalars["train/lr"] = lr
        scalars["perf/images_per_sec"] = self.images * accelerator.num_processes / elapsed
        scalars["perf/data_wait_fraction"] = self.waited / elapsed
        accelerator.log(scalars, step=step)
        self.start, self.waited, self.images = time.perf_counter(), 0.0, 0
        check_skip_rate(sum(totals[:-1]), totals[-1], self.max_skip_fraction)
        return scalars


# ---------------------------------------------------------------- the loop


def next_batch(batches: Iterator[Batch], device: torch.device, stop: StopOnSignal | None = None) -> Batch:
    """The next batch on `device`; a signal while waiting for it raises SignalWhileWaiting (see StopOnSignal)."""
    with stop.waiting_for_data() if stop else contextlib.nullcontext():
        batch = next(batches)
    return Batch(batch.images.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True),
                 batch.skipped, batch.worker, batch.position)


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint; the message says how to resume."""


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class SignalWhileWaiting(Exception):
    """A stop signal arrived while the loop was blocked waiting for the data stream."""


class StopOnSignal:
    """The first SIGTERM/SIGINT asks for a stop at the next step boundary; a second one exits at once.

    A signal that arrives while the loop waits for data raises SignalWhileWaiting out of the wait: a stream that
    never delivers (a `pipe:` command that hangs, a stalled network read) must not keep the process alive.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.waiting = False
        self.previous: dict[int, object] = {}
        self.pending: torch.Tensor | None = None  # the last step's all-reduced flag (several processes)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False

    def _handle(self, signum: int, frame) -> None:
        self.requested = True
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if self.waiting:
            self.waiting = False
            print(f"\nreceived {signal.Signals(signum).name} while waiting for data: stopping", file=sys.stderr, flush=True)
            raise SignalWhileWaiting(signal.Signals(signum).name)
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def agreed(self, accelerator: Accelerator) -> bool:
        """Every rank stops at the same step, even if only one of them got the signal.

        With several processes the flag is all-reduced every step but read one step later, so the host waits for
        the step before, not for the one it just queued on the GPU; the ranks stop one step after the signal.
        """
        if accelerator.num_processes == 1:
            return self.requested
        previous = self.pending
        self.pending = accelerator.reduce(torch.tensor(float(self.requested), device=accelerator.device), "sum")
        return previous is not None and bool(previous > 0)


def train(accelerator: Accelerator, objective: Objective, make_batches: Callable[[StreamState], Iterable[Batch]],
          cfg: TrainConfig, log: LogConfig, output_dir: str | Path, *, resume_from: Path | None = None,
          evaluators: tuple[Evaluator, ...] = (), max_skip_fraction: float = 1.0,
          resume_hint: str = "the same command with --resume") -> dict[str, float]:
    """Train `objective` (see the Objective contract) for cfg.steps optimiser steps.

    `resume_from` (see resumable_checkpoint) continues a run under this `cfg`: a changed train.lr, warmup, steps,
    weight decay, betas or momentum applies from the resumed step on. A finished run only runs the evaluations
    its last checkpoint precedes.

    Returns the last logged scalars and evaluator results. Writes checkpoints, TensorBoard events and
    `model.safetensors` (the objective's `export_weights()`) under output_dir. Raises Preempted after saving
    a checkpoint when signalled, TrainingDiverged after cfg.max_nonfinite_steps bad steps in a row, and
    DataError when more than `max_skip_fraction` of the samples read could not be used.
    """
    output_dir = Path(output_dir)
    optimizer = build_optimizer(objective, cfg)
    objective, optimizer = accelerator.prepare(objective, optimizer)
    # Stepped once per optimiser step on every process; not prepared, so Accelerate does not re-scale it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
    progress = Progress()
    accelerator.register_for_checkpointing(scheduler, progress)

    results: dict[str, float] = {}

    bar: tqdm | None = None

    def evaluate(step: int) -> None:
        if step == cfg.steps and evaluators and accelerator.is_main_process:
            tqdm.write(f"step {step} of {cfg.steps}: running the final evaluation")
        for evaluator in evaluators:
            if step % evaluator.every == 0 or step == cfg.steps:
                scores = evaluator.run(accelerator.unwrap_model(objective), step)
                objective.train()
                accelerator.log(scores, step=step)
                results.update(scores)
                if bar is not None:
                    show_progress(bar, results)
        progress.evaluated = step

    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        if progress.step > cfg.steps:
            raise UserError(f"{resume_from} is at step {progress.step}, past train.steps={cfg.steps}; set train.steps to "
                            f"at least {progress.step} to resume it, or finetune/fewshot from it with --ckpt")
        apply_hyperparameters(optimizer, scheduler, cfg)
        accelerator.print(f"resumed from {resume_from} at step {progress.step}"
                          + (f": the run is finished (train.steps={cfg.steps}), nothing to train" if progress.step == cfg.steps else ""))
        if progress.evaluated < progress.step:
            evaluate(progress.step)

    batches = iter(make_batches(progress.stream))
    bar = tqdm(total=cfg.steps, initial=progress.step, disable=not accelerator.is_main_process, desc="train", dynamic_ncols=True)
    window = LogWindow(accelerator, cfg.max_nonfinite_steps, max_skip_fraction)
    objective.train()
    with StopOnSignal() as stop:
        while progress.step < cfg.steps:
            outputs = []
            for _ in range(cfg.grad_accum):
                wait_start = time.perf_counter()
                try:
                    batch = next_batch(batches, accelerator.device, stop)
                except SignalWhileWaiting as signalled:
                    bar.close()
                    raise stopped_waiting(accelerator, output_dir, progress.step, cfg, str(signalled), resume_hint,
                                          at_step_boundary=not outputs) from None
                window.read(batch, time.perf_counter() - wait_start)
                progress.stream.advance(batch)
                with accelerator.accumulate(objective):
                    out = objective(batch.images, batch.labels)
                    accelerator.backward(out.loss)
                    if accelerator.sync_gradients:
                        grad_norm, finite = apply_gradients(accelerator, objective, optimizer, cfg.clip_grad_norm)
                    optimizer.zero_grad(set_to_none=True)
                outputs.append(out)
            scheduler.step()
            progress.step += 1
            step = progress.step
            bar.update(1)
            window.stepped(step, outputs, grad_norm, finite)

            if step % log.every == 0 or step == cfg.steps:
                scalars = window.write(step, head_lr(scheduler))
                show_progress(bar, {**results, **scalars})
                results.update(scalars)

            if step % log.images_every == 0 or step == cfg.steps:
                log_panel(accelerator, objective, batch, step)

            stopping = stop.agreed(accelerator)
            # Saved before evaluating: an evaluation that fails loses no training (a resume runs it first).
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                saved = save_checkpoint(accelerator, output_dir, step, cfg.keep_checkpoints)
            if stopping and step < cfg.steps:
                bar.close()
                accelerator.end_training()
                raise Preempted(f"stopped at step {step} of {cfg.steps} on a signal; checkpoint saved in {saved}; "
                                f"continue with {resume_hint}")
            evaluate(step)
    bar.close()

    if accelerator.is_main_process:
        save_weights(accelerator.unwrap_model(objective), output_dir / WEIGHTS)
    accelerator.wait_for_everyone()
    return results


def show_progress(bar: tqdm, scalars: dict[str, float]) -> None:
    """The loss, and what tells whether it is learning: colour or class accuracy, the last evaluation's top-1."""
    shown = {"loss": ("train/loss", "{:.3f}"), "color_acc": ("train/color_acc", "{:.1%}"),
             "acc": ("train/accuracy", "{:.1%}"), "top1": ("eval/top1", "{:.1%}")}
    bar.set_postfix({label: fmt.format(scalars[tag]) for label, (tag, fmt) in shown.items() if tag in scalars}, refresh=False)


def stopped_waiting(accelerator: Accelerator, output_dir: Path, step: int, cfg: TrainConfig, signal_name: str,
                    resume_hint: str, *, at_step_boundary: bool) -> Preempted:
    """The stop for a signal that came while the loop waited for data, after saving what can be saved.

    Between steps of a single process everything up to `step` is consistent, so it is checkpointed as at any step
    end. Several processes cannot save together (the others are not at the barrier), nor can a half-accumulated
    step: then the newest checkpoint is what a resume starts from.
    """
    newest = complete_checkpoints(output_dir)
    if at_step_boundary and accelerator.num_processes == 1 and step > 0:
        if not newest or newest[-1].name != checkpoint_dir(output_dir, step).name:
            newest = [save_checkpoint(accelerator, output_dir, step, cfg.keep_checkpoints)]
        accelerator.end_training()
        return Preempted(f"stopped at step {step} of {cfg.steps} on {signal_name} while waiting for data; checkpoint "
                         f"saved in {newest[-1]}; continue with {resume_hint}")
    accelerator.end_training()
    kept = f"the newest checkpoint is {newest[-1]}; continue with {resume_hint}" if newest else "no checkpoint was written yet"
    return Preempted(f"stopped at step {step} of {cfg.steps} on {signal_name} while waiting for data, without saving "
                     f"this step; {kept}")


def apply_hyperparameters(optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: TrainConfig) -> None:
    """Put `cfg` in force over the optimiser and scheduler state a checkpoint restored, which carries the saved run's
    lr, weight decay, betas and momentum; the schedule (its lambda is rebuilt from cfg, not saved) continues from
    the restored step. With an unchanged config every value is the one restored, bit for bit."""
    factor = scheduler.lr_lambdas[0]
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):  # build_optimizer's two groups
        group.update(initial_lr=cfg.lr, lr=cfg.lr * factor(scheduler.last_epoch), weight_decay=weight_decay)
        if "betas" in group:
            group["betas"] = cfg.betas
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def check_skip_rate(skipped: float, used: float, max_fraction: float) -> None:
    """Stop rather than train on a trickle: judged once a few hundred samples have been read."""
    read = skipped + used
    if read >= 200 and skipped / read > max_fraction:
        raise DataError(f"{skipped:.0f} of {read:.0f} samples read ({skipped / read:.0%}) could not be used, over "
                        f"data.max_skip_fraction={max_fraction}; check the shards (data/skipped_* in TensorBoard "
                        f"says why) or raise the threshold")


def log_panel(accelerator: Accelerator, objective: nn.Module, batch: Batch, step: int) -> None:
    """The panel of `objective` (prepared: unwrapped here) for this batch, if it draws one (see Objective.panel)."""
    if not accelerator.is_main_process:
        return
    module: Objective = accelerator.unwrap_model(objective)
    module.eval()
    with accelerator.autocast():
        panel = module.panel(batch.images[:PANEL_IMAGES])
    module.train()
    if not panel:
        return
    tracker = accelerator.get_tracker("tensorboard", unwrap=True)
    tracker.add_image("panel", panel_grid({name: for_display(images) for name, images in panel.items()}), global_step=step)


def panel_grid(rows: dict[str, torch.Tensor], gap: int = PANEL_GAP) -> torch.Tensor:
    """One image (3, H, W) uint8: a row per entry of `rows` (each (B, 3, h, w) uint8), labelled with its name on
    the left, so column j of every row shows the same image (crop, corrupted view, true and predicted targets)."""
    names, images = list(rows), list(rows.values())
    b, _, h, w = images[0].shape
    font = ImageFont.load_default(size=max(10, min(16, h // 3)))
    label_width = gap + max(math.ceil(font.getlength(name)) for name in names) + gap
    grid = Image.new("RGB", (label_width + b * (w + gap), gap + len(rows) * (h + gap)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (name, row) in enumerate(zip(names, images)):
        top = gap + r * (h + gap)
        draw.text((gap, top + h / 2), name, fill="black", font=font, anchor="lm")
        for c in range(b):
            grid.paste(Image.fromarray(row[c].permute(1, 2, 0).numpy()), (label_width + c * (w + gap), top))
    return torch.from_numpy(np.array(grid)).permute(2, 0, 1)
