"""The one training loop. Pretraining and fine-tuning differ only in the objective module and its evaluators."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from tqdm.auto import tqdm

from mpp.checkpoint import save_weights
from mpp.config import LogConfig, TrainConfig
from mpp.data import Batch, DataError, StreamState
from mpp.errors import UserError
from mpp.objectives import Objective, StepOutput
from mpp.optim import LambdaLR, apply_hyperparameters, build_optimizer, build_schedule, head_lr, param_groups
from mpp.rundir import WEIGHTS, checkpoint_dir, checkpoint_fault, checkpoint_root, complete_checkpoints, write_manifest
from mpp.runtime import Device, compiled, resolve_compile

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
    """Checkpointed with the model by the main process: the step counter and the last step whose evaluations ran.

    A step's checkpoint is written before its evaluations, so a resume from it runs them first. Each rank's data
    stream position is its own and is saved by each rank beside it (save_checkpoint).
    """

    step: int = 0
    evaluated: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "evaluated": self.evaluated}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evaluated = state["step"], state["evaluated"]


@dataclass
class StepResult:
    """One optimiser step's outcome, as device tensors (reading them is a host sync: the loop does so only to log)."""

    outputs: list[StepOutput]  # each micro-batch's loss and metrics
    grad_norm: torch.Tensor  # before clipping
    stepped: torch.Tensor  # bool: the gradient was finite and the optimiser changed the weights
    nonfinite: torch.Tensor  # bool: counts towards train.max_nonfinite_steps


def train_step(accelerator: Accelerator, model: nn.Module, forward: Callable[..., StepOutput], optimizer,
               scheduler: LambdaLR, micro_batches: Iterable[Batch], clip_grad_norm: float | None) -> StepResult:
    """One optimiser step over `micro_batches` (train.grad_accum of them): forward, backward, and on the last one clip
    and step unless the gradient is non-finite; then the schedule.

    `model` is the prepared objective (its DDP wrapper under several processes: accumulation skips its all-reduce
    until the last micro-batch), `forward` what computes its loss (the model, or its compiled form).

    No host sync: a fused optimiser given `found_inf` leaves weights, moments and step count untouched when it is
    set, so a NaN/inf gradient never reaches them and the GPU never waits for the CPU to decide. Under fp16 the loss
    scaler makes that call itself (an overflow lowers its scale), and only a non-finite loss counts as non-finite.
    """
    outputs = []
    for batch in micro_batches:
        with accelerator.accumulate(model):
            out = forward(batch.images, batch.labels)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_grad_norm or math.inf)
                stepped = torch.isfinite(grad_norm)
                torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
                torch_optimizer.found_inf = (~stepped).float()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        outputs.append(out)
    scheduler.step()
    if accelerator.scaler is not None:
        nonfinite = ~torch.stack([torch.isfinite(out.loss.detach()) for out in outputs]).all()
    else:
        nonfinite = ~stepped
    return StepResult(outputs, grad_norm, stepped, nonfinite)


# ---------------------------------------------------------------- checkpoints


STREAM_STATE = "stream_state_{rank}.json"  # each rank's data stream position, in every checkpoint


def resumable_checkpoint(accelerator: Accelerator, output_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies, saying which newer ones were skipped and why; None when there is none yet.

    The main process verifies (reading each file once) and tells the others; every rank then checks that it sees the
    checkpoint's files too (ranks on other nodes see output_dir only on a filesystem all nodes share).
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
        return None
    check_seen_by_every_rank(accelerator, Path(path))
    return Path(path)


def check_seen_by_every_rank(accelerator: Accelerator, checkpoint: Path) -> None:
    """Refuse, on every rank, a checkpoint that some rank cannot read its own stream state from."""
    blind = [rank for rank, seen in enumerate(gather_object([stream_state_file(checkpoint, accelerator.process_index).is_file()]))
             if not seen]
    if blind:
        raise UserError(f"checkpoint {checkpoint} is not visible to rank(s) {', '.join(map(str, blind))}: with several "
                        f"nodes, output_dir must be on a filesystem every node shares (NFS, Lustre, a mounted bucket); "
                        f"set output_dir to such a directory")


def stream_state_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / STREAM_STATE.format(rank=rank)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, keep: int, stream: StreamState) -> Path:
    """Write to a temporary name, then rename: a crash mid-save never leaves a checkpoint that looks complete.

    Accelerate saves the model, optimiser, scheduler, Progress and every rank's RNG; each rank adds its own `stream`
    position (Accelerate saves registered objects from the main process only).
    """
    root = checkpoint_root(output_dir)
    final, partial = checkpoint_dir(output_dir, step), checkpoint_dir(output_dir, step, partial=True)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    stream_state_file(partial, accelerator.process_index).write_text(json.dumps(stream.state_dict()) + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(partial, accelerator.num_processes)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, stream: StreamState) -> None:
    """Restore what save_checkpoint wrote, this rank's own stream position included."""
    accelerator.load_state(str(checkpoint))
    stream.load_state_dict(json.loads(stream_state_file(checkpoint, accelerator.process_index).read_text()))


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

    def stepped(self, step: int, result: StepResult) -> None:
        for out in result.outputs:
            self.meter.add({"loss": out.loss, **out.metrics}, keep=result.stepped)
        self.meter.add({"grad_norm": result.grad_norm}, keep=result.stepped)
        self.nonfinite["total"] += result.nonfinite
        self.nonfinite["run"] = torch.where(result.nonfinite, self.nonfinite["run"] + 1, 0)
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


class SignalWhileWaiting(BaseException):
    """A stop signal arrived while the loop was blocked waiting for the data stream.

    A BaseException, as KeyboardInterrupt is: raised wherever the wait happens to be (reading a shard, decoding an
    image), it must not be caught as one more unreadable shard or undecodable image by code that catches Exception.
    """


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
        self.pending: tuple | None = None  # the last step's all-reduce of the flag and its result (several processes)

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

        With several processes the flag is summed over ranks every step by an asynchronous all-reduce of a host
        tensor over a gloo group of its own, and read one step later: the device is never involved (no copy, no
        sync), and the wait is for a reduction that finished during the step. The ranks stop one step after the signal.
        """
        if accelerator.num_processes == 1:
            return self.requested
        previous = self.pending
        flag = torch.tensor([float(self.requested)])  # in host memory
        self.pending = (torch.distributed.all_reduce(flag, group=host_group(), async_op=True), flag)
        if previous is None:
            return False
        work, total = previous
        work.wait()
        return total.item() > 0


@functools.cache
def host_group():
    """A gloo process group of every rank for small host-side agreements, made once per process (every rank makes
    it at the same point: the first step of its first run)."""
    return torch.distributed.new_group(backend="gloo")


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
    model = accelerator.prepare(objective)  # on its device; DDP-wrapped under several processes
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    # Stepped once per optimiser step on every process; not prepared, so Accelerate does not re-scale it.
    scheduler = build_schedule(optimizer, cfg)
    forward = compiled(model, cfg.compile_backend) if resolve_compile(cfg.compile, Device.this_process()) else model
    progress, stream = Progress(), StreamState()
    accelerator.register_for_checkpointing(scheduler, progress)

    results: dict[str, float] = {}

    bar: tqdm | None = None

    def evaluate(step: int) -> None:
        if step == cfg.steps and evaluators and accelerator.is_main_process:
            tqdm.write(f"step {step} of {cfg.steps}: running the final evaluation")
        for evaluator in evaluators:
            if step % evaluator.every == 0 or step == cfg.steps:
                scores = evaluator.run(objective, step)
                objective.train()
                accelerator.log(scores, step=step)
                results.update(scores)
                if bar is not None:
                    show_progress(bar, results)
        progress.evaluated = step

    if resume_from is not None:
        load_checkpoint(accelerator, resume_from, stream)
        if progress.step > cfg.steps:
            raise UserError(f"{resume_from} is at step {progress.step}, past train.steps={cfg.steps}; set train.steps to "
                            f"at least {progress.step} to resume it, or finetune/fewshot from it with --ckpt")
        apply_hyperparameters(optimizer, scheduler, cfg)
        accelerator.print(f"resumed from {resume_from} at step {progress.step}"
                          + (f": the run is finished (train.steps={cfg.steps}), nothing to train" if progress.step == cfg.steps else ""))
        if progress.evaluated < progress.step:
            evaluate(progress.step)

    batches = iter(make_batches(stream))
    bar = tqdm(total=cfg.steps, initial=progress.step, disable=not accelerator.is_main_process, desc="train", dynamic_ncols=True)
    window = LogWindow(accelerator, cfg.max_nonfinite_steps, max_skip_fraction)
    last: list[Batch] = []  # the step's last micro-batch, for the panel

    def micro_batches(stop: StopOnSignal) -> Iterator[Batch]:
        for index in range(cfg.grad_accum):
            wait_start = time.perf_counter()
            try:
                batch = next_batch(batches, accelerator.device, stop)
            except SignalWhileWaiting as signalled:
                raise stopped_waiting(accelerator, output_dir, progress.step, cfg, str(signalled), resume_hint,
                                      at_step_boundary=index == 0, stream=stream) from None
            window.read(batch, time.perf_counter() - wait_start)
            stream.advance(batch)
            last[:] = [batch]
            yield batch

    objective.train()
    # The bar is closed before anything propagates, so an error's line does not share a line with it.
    with StopOnSignal() as stop, contextlib.closing(bar):
        while progress.step < cfg.steps:
            result = train_step(accelerator, model, forward, optimizer, scheduler, micro_batches(stop), cfg.clip_grad_norm)
            progress.step += 1
            step = progress.step
            bar.update(1)
            window.stepped(step, result)

            if step % log.every == 0 or step == cfg.steps:
                scalars = window.write(step, head_lr(optimizer))
                show_progress(bar, {**results, **scalars})
                results.update(scalars)

            if step % log.images_every == 0 or step == cfg.steps:
                log_panel(accelerator, objective, last[0], step)

            stopping = stop.agreed(accelerator)
            # Saved before evaluating: an evaluation that fails loses no training (a resume runs it first).
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                saved = save_checkpoint(accelerator, output_dir, step, cfg.keep_checkpoints, stream)
            if stopping and step < cfg.steps:
                accelerator.end_training()
                raise Preempted(f"stopped at step {step} of {cfg.steps} on a signal; checkpoint saved in {saved}; "
                                f"continue with {resume_hint}")
            evaluate(step)

    if accelerator.is_main_process:
        save_weights(objective, output_dir / WEIGHTS)
    accelerator.wait_for_everyone()
    return results


def show_progress(bar: tqdm, scalars: dict[str, float]) -> None:
    """The loss, and what tells whether it is learning: colour or class accuracy, the last evaluation's top-1."""
    shown = {"loss": ("train/loss", "{:.3f}"), "color_acc": ("train/color_acc", "{:.1%}"),
             "acc": ("train/accuracy", "{:.1%}"), "top1": ("eval/top1", "{:.1%}")}
    bar.set_postfix({label: fmt.format(scalars[tag]) for label, (tag, fmt) in shown.items() if tag in scalars}, refresh=False)


def stopped_waiting(accelerator: Accelerator, output_dir: Path, step: int, cfg: TrainConfig, signal_name: str,
                    resume_hint: str, *, at_step_boundary: bool, stream: StreamState) -> Preempted:
    """The stop for a signal that came while the loop waited for data, after saving what can be saved.

    Between steps of a single process everything up to `step` is consistent, so it is checkpointed as at any step
    end. Several processes cannot save together (the others are not at the barrier), nor can a half-accumulated
    step: then the newest checkpoint is what a resume starts from.
    """
    newest = complete_checkpoints(output_dir)
    if at_step_boundary and accelerator.num_processes == 1 and step > 0:
        if not newest or newest[-1].name != checkpoint_dir(output_dir, step).name:
            newest = [save_checkpoint(accelerator, output_dir, step, cfg.keep_checkpoints, stream)]
        accelerator.end_training()
        return Preempted(f"stopped at step {step} of {cfg.steps} on {signal_name} while waiting for data; checkpoint "
                         f"saved in {newest[-1]}; continue with {resume_hint}")
    accelerator.end_training()
    kept = f"the newest checkpoint is {newest[-1]}; continue with {resume_hint}" if newest else "no checkpoint was written yet"
    return Preempted(f"stopped at step {step} of {cfg.steps} on {signal_name} while waiting for data, without saving "
                     f"this step; {kept}")


def check_skip_rate(skipped: float, used: float, max_fraction: float) -> None:
    """Stop rather than train on a trickle: judged once a few hundred samples have been read."""
    read = skipped + used
    if read >= 200 and skipped / read > max_fraction:
        raise DataError(f"{skipped:.0f} of {read:.0f} samples read ({skipped / read:.0%}) could not be used, over "
                        f"data.max_skip_fraction={max_fraction}; check the shards (data/skipped_* in TensorBoard "
                        f"says why) or raise the threshold")


def log_panel(accelerator: Accelerator, objective: Objective, batch: Batch, step: int) -> None:
    """The panel of `objective` for this batch, if it draws one (see Objective.panel), from the main process."""
    if not accelerator.is_main_process:
        return
    objective.eval()
    with accelerator.autocast():
        panel = objective.panel(batch.images[:PANEL_IMAGES])
    objective.train()
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
