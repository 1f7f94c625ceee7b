"""The one training loop. Pretraining and fine-tuning differ only in the objective module and its evaluators.

`train_step` is one optimiser step; `train` runs them, logs, draws the panel, checkpoints, evaluates and stops on a
signal. Beside it in mpp/training/: what the loop measures (meters.py), how a run uses the machine (runtime.py), its
checkpoints (resume.py), signals (preemption.py), the image panel (panel.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from mpp.model.checkpoint import save_weights
from mpp.config import LogConfig, TrainConfig
from mpp.data.stream import Batch, StreamState
from mpp.training.ema import WeightAverage
from mpp.training.meters import LOOP_METRICS, LogWindow, ProgressBar, write_line
from mpp.metrics import Metric
from mpp.model.objectives import Objective, StepOutput
from mpp.training.optim import LambdaLR, build_optimizer, build_schedule, head_lr, param_groups
from mpp.training.panel import log_panel
from mpp.training.preemption import Preempted, SignalWhileWaiting, StopOnSignal, stopped_waiting
from mpp.training.resume import WRITE_ERRORS, restore, save_checkpoint, weights_not_saved
from mpp.rundir import RunDir
from mpp.training.runtime import Device, compiled, resolve_compile


@dataclass
class Evaluator:
    """What the loop evaluates: `run(objective, step)` is called on every process every `every` steps and after the
    last, with the bare objective (its `backbone` is the encoder being trained), and returns the scalars to log under
    their tags ({'fewshot/5shot': 0.41}), each declared in `metrics`; they also go into train's results.
    `baselines()` gives, after the last evaluation, what those scores are shown beside (mpp.evaluation.baselines).

    An implementer returns the same tags on every process, leaves the training RNG and data stream alone (a
    private generator, its own loader: the run's weights do not change with it), and may leave the module in eval
    mode (the loop sets train mode again). Stages build theirs from config: pipelines/evaluations/evaluators.py.
    """

    every: int
    run: Callable[[nn.Module, int], dict[str, float]]
    metrics: tuple[Metric, ...] = ()
    # {tag: {kind: value}}, the scores that know nothing its metrics are shown beside (mpp.evaluation.baselines), asked after the
    # last evaluation
    baselines: Callable[[], dict[str, dict[str, float]]] = dict


@dataclass
class Progress:
    """Checkpointed with the model by the main process: the step counter, the last step whose evaluations ran, the
    scalars logged up to the checkpoint's step, the log window's counts (LogWindow.state_dict: the steps since the
    last log line, which a resumed run's next line averages with its own), and the seconds spent training up to it
    over every invocation (the steps an interrupted invocation trained after its last checkpoint are trained again,
    so their time is not).

    A step's checkpoint is written before its evaluations, so a resume from it runs them first. A finished run resumed
    trains nothing and logs nothing: it reports the scalars its last checkpoint kept. Each rank's data stream position
    is its own and is saved by each rank beside it (mpp.training.resume.save_checkpoint).
    """

    step: int = 0
    evaluated: int = 0
    logged: dict[str, float] = field(default_factory=dict)
    window: dict | None = None  # None: not known (a checkpoint of an earlier mpp)
    seconds: float | None = 0.0  # None: not known (a checkpoint of an earlier mpp)
    earlier_seconds: float | None = field(default=0.0, init=False, repr=False)  # up to the checkpoint resumed from
    started: float = field(default=0.0, init=False, repr=False)  # this invocation's start (time.perf_counter)

    def state_dict(self) -> dict:
        return {"step": self.step, "evaluated": self.evaluated, "logged": self.logged, "window": self.window,
                "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evaluated = state["step"], state["evaluated"]
        self.logged = dict(state.get("logged", {}))  # absent from the checkpoints of an earlier mpp
        self.window = state.get("window")  # absent from the checkpoints of an earlier mpp
        self.seconds = state.get("seconds")  # absent from the checkpoints of an earlier mpp

    def start_clock(self) -> None:
        """This invocation trains from here: its seconds add to those of the checkpoint it resumed from, if any."""
        self.earlier_seconds, self.started = self.seconds, time.perf_counter()

    def record(self, results: dict[str, float], window: dict | None) -> None:
        """What a checkpoint of this step keeps beside the weights: the scalars logged, the log window, the seconds
        trained."""
        self.logged, self.window = dict(results), window
        if self.earlier_seconds is not None:
            self.seconds = self.earlier_seconds + time.perf_counter() - self.started


@dataclass
class Trained:
    """What `train` leaves besides its files: the last logged scalars and evaluator results, the seconds the
    earlier invocations of the run spent training up to the checkpoint this one resumed from (0 for a run that
    started here, None where that checkpoint did not record them), and the seconds every invocation spent training
    the run's steps, up to its last checkpoint (None where not known)."""

    scores: dict[str, float]
    earlier_seconds: float | None
    seconds: float | None = None


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


def train(accelerator: Accelerator, objective: Objective, make_batches: Callable[[StreamState], Iterable[Batch]],
          cfg: TrainConfig, log: LogConfig, run_dir: RunDir, *, resume_from: Path | None = None,
          evaluators: tuple[Evaluator, ...] = (), max_skip_fraction: float = 1.0, data_workers: int = 0,
          resume_hint: str = "the same command with --resume") -> Trained:
    """Train `objective` (see the Objective contract) for cfg.steps optimiser steps.

    `resume_from` (see mpp.training.resume.resumable_checkpoint) continues a run under this `cfg`: a changed train.lr, warmup,
    steps, weight decay, betas or momentum applies from the resumed step on. A finished run only runs the evaluations
    its last checkpoint precedes.

    Returns the last logged scalars and evaluator results and the earlier invocations' training time (Trained);
    writes checkpoints, TensorBoard events and `model.safetensors` (the objective's `export_weights()`) in `run_dir`.
    Raises Preempted after saving a checkpoint when signalled, TrainingDiverged after
    cfg.max_nonfinite_steps bad steps in a row, and DataError when more than `max_skip_fraction` of the samples read
    could not be used. Says once, on stderr, when the steps have slowed many times over, naming `data_workers`.
    """
    model, forward, optimizer, scheduler, ema = prepare_to_train(accelerator, objective, cfg)
    scored = ema.module if ema else objective  # what the evaluators score and model.safetensors holds
    progress, stream = Progress(), StreamState()
    accelerator.register_for_checkpointing(scheduler, progress, *([ema] if ema else []))
    if resume_from is not None:
        restore(accelerator, resume_from, stream, optimizer, scheduler, cfg)
    results = dict(progress.logged)  # a resumed run's scalars up to its checkpoint; none for a fresh one
    evaluations = Evaluations(accelerator, scored, evaluators, cfg.steps, progress)
    results.update(evaluations.pending())  # none for a fresh run: nothing precedes step 0
    progress.start_clock()

    feed = Feed(accelerator, iter(make_batches(stream)), stream)
    window = LogWindow(accelerator, cfg.max_nonfinite_steps, max_skip_fraction, data_workers, progress.window)
    bar = ProgressBar(accelerator, [*objective.metrics("train"), *LOOP_METRICS, *evaluations.metrics], cfg.steps, progress.step)

    def checkpoint() -> Path:
        """The checkpoint of the step reached, with what Progress keeps beside the weights; every rank saves it."""
        progress.record(results, window.state_dict())
        return save_checkpoint(accelerator, run_dir, progress.step, cfg.keep_checkpoints, stream, resume_hint)

    objective.train()
    # The bar is closed before anything propagates, so an error's line does not share a line with it.
    with StopOnSignal(cfg.stop_data_wait_s) as stop, contextlib.closing(bar):
        while progress.step < cfg.steps:
            try:
                result = train_step(accelerator, model, forward, optimizer, scheduler, feed.micro_batches(cfg.grad_accum, window, stop),
                                    cfg.clip_grad_norm)
            except SignalWhileWaiting as signalled:
                raise stopped_waiting(accelerator, run_dir, progress.step, cfg.steps, signalled, resume_hint, checkpoint) from None
            if ema:
                ema.update(objective)
            progress.step += 1
            step, last = progress.step, progress.step == cfg.steps
            window.stepped(step, result)
            bar.step()
            if step % log.every == 0 or last:
                results.update(write_line(window, step, head_lr(optimizer), run_dir, cfg.checkpoint_every, resume_hint))
                bar.update(results)
            if step % log.images_every == 0 or last:
                log_panel(accelerator, objective, feed.last, step)

            stopping = stop.agreed(accelerator)
            # Saved before evaluating: an evaluation that fails loses no training (a resume runs it first).
            if step % cfg.checkpoint_every == 0 or last or stopping:
                saved = checkpoint()
            if stopping and not last:
                accelerator.end_training()
                raise Preempted(f"stopped at step {step} of {cfg.steps} on a signal; checkpoint saved in {saved}; "
                                f"continue with {resume_hint}")
            results.update(evaluations.run(step))
            bar.update(results)

    save_final_weights(accelerator, scored, run_dir, resume_hint)
    return Trained(results, progress.earlier_seconds, progress.seconds)


def prepare_to_train(accelerator: Accelerator, objective: Objective, cfg: TrainConfig):
    """(model, forward, optimizer, scheduler, ema) for training `objective` on this process: `model` on its device
    (DDP-wrapped under several processes), `forward` what computes its loss (the model or its compiled form), the
    weight average when cfg.ema_decay is set, else None. The weight average (mpp.training.ema) follows the training and is
    checkpointed with it; the evaluators score it and model.safetensors holds it, as timm validates and saves its
    model EMA."""
    ema = WeightAverage(objective, cfg.ema_decay, accelerator.device) if cfg.ema_decay is not None else None
    model = accelerator.prepare(objective)
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    scheduler = build_schedule(optimizer, cfg)  # not prepared: Accelerate would step it once per process
    forward = compiled(model, cfg.compile_backend, cfg.compile_mode) if resolve_compile(cfg.compile, Device.this_process()) else model
    return model, forward, optimizer, scheduler, ema


def save_final_weights(accelerator: Accelerator, scored: nn.Module, run_dir: RunDir, resume_hint: str) -> None:
    """model.safetensors, written by the main process once the last step's evaluations are done."""
    if accelerator.is_main_process:
        try:
            save_weights(scored, run_dir.weights)
        except WRITE_ERRORS as exc:
            raise weights_not_saved(run_dir, exc, resume_hint) or exc
    accelerator.wait_for_everyone()


class Evaluations:
    """The run's evaluators, each at its period and all after the last step: scores logged, steps recorded in Progress."""

    def __init__(self, accelerator: Accelerator, objective: Objective, evaluators: tuple[Evaluator, ...], steps: int,
                 progress: Progress):
        self.accelerator, self.objective, self.evaluators, self.steps, self.progress = accelerator, objective, evaluators, steps, progress
        self.metrics = [m for evaluator in evaluators for m in evaluator.metrics]

    def run(self, step: int) -> dict[str, float]:
        due = [e for e in self.evaluators if step % e.every == 0 or step == self.steps]
        if due and step == self.steps and self.accelerator.is_main_process:
            tqdm.write(f"step {step} of {self.steps}: running the final evaluation")
        scores: dict[str, float] = {}
        for evaluator in due:
            scores.update(evaluator.run(self.objective, step))
            self.objective.train()
        if scores:
            self.accelerator.log(scores, step=step)
        self.progress.evaluated = step
        return scores

    def pending(self) -> dict[str, float]:
        """The evaluations a resumed checkpoint precedes (a checkpoint is written before its step's evaluations)."""
        return self.run(self.progress.step) if self.progress.evaluated < self.progress.step else {}


class Feed:
    """The data stream as steps consume it: each micro-batch moved to the device, its wait timed, the stream's position
    advanced; the last one kept for the panel. A signal while waiting raises SignalWhileWaiting, marked with whether
    the step it interrupted had consumed nothing yet (see preemption.stopped_waiting)."""

    def __init__(self, accelerator: Accelerator, batches: Iterator[Batch], stream: StreamState):
        self.device, self.batches, self.stream = accelerator.device, batches, stream
        self.last: Batch | None = None

    def micro_batches(self, count: int, window: LogWindow, stop: StopOnSignal) -> Iterator[Batch]:
        for index in range(count):
            started = time.perf_counter()
            try:
                batch = next_batch(self.batches, self.device, stop)
            except SignalWhileWaiting as signalled:
                signalled.at_step_boundary = index == 0
                raise
            window.read(batch, time.perf_counter() - started)
            self.stream.advance(batch)
            self.last = batch
            yield batch


def next_batch(batches: Iterator[Batch], device: torch.device, stop: StopOnSignal | None = None) -> Batch:
    """The next batch on `device`; a signal while waiting for it raises SignalWhileWaiting (see StopOnSignal)."""
    with stop.waiting_for_data() if stop else contextlib.nullcontext():
        batch = next(batches)
    return Batch(batch.images.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True),
                 batch.skipped, batch.worker, batch.position, batch.keys)
