"""What the loop measures between two log lines, the progress bar, and the one line that says a run has slowed down.

The loop declares its own metrics here (LOOP_METRICS: the learning rate, the gradient norm, speed, skipped samples);
an objective's and an evaluator's come from them (mpp.metrics).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from mpp.data.stream import Batch, DataError
from mpp.errors import UserError
from mpp.metrics import LR, Category, Metric
from mpp.rundir import RunDir, complete_checkpoints
from mpp.training.runtime import available_cpus

# The run's own measures, after the model's in TensorBoard and left out of its results.
OPTIMISATION = Category("optimisation", order=80)
SPEED = Category("speed", order=90)
DATA = Category("data", order=100)
SKIP_REASONS = ("missing_image", "undecodable_image", "unreadable_shard", "bad_label")
GRAD_NORM, NONFINITE_STEPS = "train/grad_norm", "train/nonfinite_steps"
# Under train/, after its other tags: TensorBoard's Time Series sorts tags by name, groups them by their first part
# and opens the first two groups, so a clean pretraining run opens on train/color_acc and train/pretext_loss.
IMAGES_PER_SEC, DATA_WAIT = "train/perf/images_per_sec", "train/perf/data_wait_fraction"

LOOP_METRICS = (
    Metric(LR, OPTIMISATION, "learning rate (of the top layer)"),
    Metric(GRAD_NORM, OPTIMISATION, "gradient norm (before clipping)"),
    Metric(NONFINITE_STEPS, OPTIMISATION, "skipped non-finite steps"),
    Metric(IMAGES_PER_SEC, SPEED, "images per second"),
    Metric(DATA_WAIT, SPEED, "share of time waiting for data"),
    *(Metric(f"data/skipped_{reason}", DATA, "skipped samples by reason") for reason in SKIP_REASONS),
)

# A run says once when its steps take SLOWDOWN times as long as they did at first: the median of the last
# RECENT_STEPS steps against the median of this invocation's steps EARLY_STEPS (after the first steps' set-up).
EARLY_STEPS = (5, 25)
RECENT_STEPS = 20
SLOWDOWN = 5.0


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient."""


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

    def totals(self, accelerator: Accelerator) -> dict[str, tuple[float, float]]:
        """{name: (sum, kept steps)} over every rank (a collective: every rank calls it)."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        stacked = torch.stack([torch.stack([self.sums[n], self.counts[n]]) for n in names])  # (names, 2)
        return {n: (s, c) for n, (s, c) in zip(names, accelerator.reduce(stacked, reduction="sum").tolist())}

    def means(self, accelerator: Accelerator) -> dict[str, float]:
        """Means over the kept steps of every rank; a name with no kept step is left out."""
        totals = self.totals(accelerator)
        self.sums, self.counts = {}, {}
        return {n: s / c for n, (s, c) in totals.items() if c > 0}

    def restore(self, totals: dict[str, tuple[float, float]], device: torch.device, holder: bool) -> None:
        """Continue from `totals` (a checkpoint's): `holder` (one rank) takes them, the others start from zero with
        the same names, so the sums over the ranks, and the order of the additions on the holder, are as they were."""
        self.sums = {n: torch.tensor(s if holder else 0.0, device=device) for n, (s, _) in totals.items()}
        self.counts = {n: torch.tensor(c if holder else 0.0, device=device) for n, (_, c) in totals.items()}


class LogWindow:
    """The steps between two log lines: what they trained on, how long they waited for data, what they skipped.

    The loop reports each batch read (`read`) and each optimiser step (`stepped`); `write` closes the window,
    logging the line's scalars (train/* means of the kept steps, train/nonfinite_steps since the start and, once a
    sample was skipped for it, data/skipped_* of that reason since the start, train/lr, train/perf/*), and opens the next.
    It is also where the run stops on too many non-finite steps in a row (counted on the device, so checked only
    here: the host never waits on the GPU for them; the skipped steps in between left the weights untouched) or on
    too many unusable samples, and where it says once that its steps have slowed down (StepPace).
    """

    def __init__(self, accelerator: Accelerator, max_nonfinite_steps: int, max_skip_fraction: float,
                 data_workers: int = 0, state: dict | None = None) -> None:
        """`state`: a checkpoint's window (state_dict) to continue from; None: a window opened now."""
        self.accelerator, self.max_nonfinite_steps, self.max_skip_fraction = accelerator, max_nonfinite_steps, max_skip_fraction
        self.meter, self.skipped, self.pace, self.data_workers = Meter(), Counter(), StepPace(), data_workers
        self.start, self.waited, self.images, self.images_total = time.perf_counter(), 0.0, 0, 0
        self.last_step = self.start
        self.nonfinite = {name: torch.zeros((), dtype=torch.long, device=accelerator.device) for name in ("total", "run", "diverged_at")}
        if state is not None:
            self.load_state_dict(state)

    def read(self, batch: Batch, waited: float) -> None:
        self.waited += waited
        self.skipped.update(batch.skipped)
        self.images += batch.images.shape[0]

    def stepped(self, step: int, result) -> None:
        """Count the optimiser step `result` (a train.StepResult) took at `step`; no host sync."""
        now = time.perf_counter()
        self.pace.add(now - self.last_step)
        self.last_step = now
        for out in result.outputs:
            self.meter.add({out.loss_name: out.loss, **out.metrics}, keep=result.stepped)
        self.meter.add({"grad_norm": result.grad_norm}, keep=result.stepped)
        self.nonfinite["total"] += result.nonfinite
        self.nonfinite["run"] = torch.where(result.nonfinite, self.nonfinite["run"] + 1, 0)
        reached = (self.nonfinite["run"] >= self.max_nonfinite_steps) & (self.nonfinite["diverged_at"] == 0)
        self.nonfinite["diverged_at"] = torch.where(reached, step, self.nonfinite["diverged_at"])

    def write(self, step: int, lr: float) -> dict[str, float]:
        """Log the line's scalars at `step` and return them. A run stopping on too many non-finite steps logs its
        line first, so log.txt and TensorBoard end at the step it stopped."""
        accelerator = self.accelerator
        diverged_at = int(self.nonfinite["diverged_at"])
        elapsed = time.perf_counter() - self.start
        scalars = {f"train/{k}": v for k, v in self.meter.means(accelerator).items()}
        self.images_total += self.images
        totals = accelerator.reduce(torch.tensor([float(self.skipped[r]) for r in SKIP_REASONS] + [float(self.images_total)],
                                                 device=accelerator.device), reduction="sum").tolist()
        # Only reasons that occurred: a flat zero chart per reason would fill TensorBoard's first screen.
        scalars.update({f"data/skipped_{r}": c for r, c in zip(SKIP_REASONS, totals) if c})
        scalars[NONFINITE_STEPS] = int(self.nonfinite["total"])
        scalars[LR] = lr
        scalars[IMAGES_PER_SEC] = self.images * accelerator.num_processes / elapsed
        scalars[DATA_WAIT] = self.waited / elapsed
        accelerator.log(scalars, step=step)
        if diverged_at:
            raise TrainingDiverged(
                f"{self.max_nonfinite_steps} consecutive steps had a non-finite loss or gradient, the last at step "
                f"{diverged_at} (lr {lr:.3g}); lower train.lr, lengthen train.warmup_steps, "
                f"keep train.clip_grad_norm set, or use train.mixed_precision=no")
        self.start, self.waited, self.images = time.perf_counter(), 0.0, 0
        check_skip_rate(sum(totals[:-1]), totals[-1], self.max_skip_fraction)
        slowed = self.pace.slowed()
        if slowed and accelerator.is_main_process:
            tqdm.write(slowdown_line(*slowed, threads=torch.get_num_threads(), workers=self.data_workers), file=sys.stderr)
        return scalars

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the window (in Progress): the steps counted since the last line and the counts
        since the run started, summed over the ranks, so a resumed run's next line averages the steps an
        uninterrupted run's does, and its counts go on from the checkpoint's. A collective (every rank calls it), at a
        checkpoint, where the ranks meet anyway: no step waits for it."""
        accelerator = self.accelerator
        counts = torch.tensor([float(self.skipped[r]) for r in SKIP_REASONS] + [float(self.images_total), float(self.images)],
                              device=accelerator.device)
        *skipped, images_total, images = accelerator.reduce(counts, reduction="sum").tolist()
        return {"meter": self.meter.totals(accelerator), "skipped": dict(zip(SKIP_REASONS, skipped)),
                "images_total": images_total, "images": images, "waited": self.waited,
                "seconds": time.perf_counter() - self.start, "nonfinite": {k: int(v) for k, v in self.nonfinite.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's window (state_dict), on any number of processes: the main process holds its
        sums and counts; the window's images are shared out; its seconds go on from the checkpoint's, not counting
        the time until the resume."""
        accelerator, main = self.accelerator, self.accelerator.is_main_process
        self.meter.restore({n: tuple(v) for n, v in state["meter"].items()}, accelerator.device, holder=main)
        self.skipped = Counter({r: round(c) for r, c in state["skipped"].items()} if main else {})
        self.images_total = round(state["images_total"]) if main else 0
        self.images = round(state["images"]) // accelerator.num_processes
        self.waited, self.start = state["waited"], time.perf_counter() - state["seconds"]
        self.nonfinite = {k: torch.tensor(v, dtype=torch.long, device=accelerator.device) for k, v in state["nonfinite"].items()}


def write_line(window: LogWindow, step: int, lr: float, run_dir: RunDir, checkpoint_every: int,
               resume_hint: str) -> dict[str, float]:
    """The log line of `step` (LogWindow.write); a stop on non-finite steps says what the run continues with: its
    newest checkpoint in `run_dir`, or, before its first (due at `checkpoint_every`), a new start."""
    try:
        return window.write(step, lr)
    except TrainingDiverged as diverged:
        saved = complete_checkpoints(run_dir.root)
        then = (f"continue from its last checkpoint {saved[-1]} with {resume_hint}" if saved else
                f"start the run again with --overwrite: it saved no checkpoint to continue from (the first was due at "
                f"step {checkpoint_every}, train.checkpoint_every)")
        raise TrainingDiverged(f"{diverged}, then {then}") from None


def check_skip_rate(skipped: float, used: float, max_fraction: float) -> None:
    """Stop rather than train on a trickle: judged once a few hundred samples have been read."""
    read = skipped + used
    if read >= 200 and skipped / read > max_fraction:
        raise DataError(f"{skipped:.0f} of {read:.0f} samples read ({skipped / read:.0%}) could not be used, over "
                        f"data.max_skip_fraction={max_fraction}; check the shards (data/skipped_* in TensorBoard "
                        f"says why) or raise the threshold")



class StepPace:
    """The time of each optimiser step of this invocation, and the rule that says the run has slowed down: the median
    of the last RECENT_STEPS steps over SLOWDOWN times the median of steps EARLY_STEPS, told once.

    Medians, so that an evaluation or a checkpoint between two steps is not taken for slowness. A step's time is the
    host's clock between two steps, which needs no host sync: on a GPU the host runs at most a queue ahead of the
    device, so the times follow the device's pace.
    """

    def __init__(self) -> None:
        self.steps, self.early, self.recent, self.told = 0, [], deque(maxlen=RECENT_STEPS), False

    def add(self, seconds: float) -> None:
        self.steps += 1
        first, last = EARLY_STEPS
        if first <= self.steps <= last:
            self.early.append(seconds)
        elif self.steps > last:
            self.recent.append(seconds)

    def slowed(self) -> tuple[float, float] | None:
        """(recent, early): the two medians in seconds, the first time the rule holds; None before and after."""
        if self.told or len(self.recent) < RECENT_STEPS:
            return None
        recent, early = statistics.median(self.recent), statistics.median(self.early)
        if recent < SLOWDOWN * early:
            return None
        self.told = True
        return recent, early


def slowdown_line(recent: float, early: float, threads: int, workers: int) -> str:
    """What a slowed-down run prints: how much slower, how loaded the machine is, what the run uses, what to change."""
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "unknown"
    return (f"warning: steps take {recent / early:.0f}x as long as this run's steps {EARLY_STEPS[0]}-{EARLY_STEPS[1]} "
            f"did ({recent:.2f} s against {early:.2f} s, medians); load average {load} on {available_cpus()} CPU(s), "
            f"with {threads} training thread(s) and {workers} data worker(s) per process here. A load above the CPUs "
            f"means other jobs compete for them: stop those, or lower train.cpu_threads and data.num_workers to the "
            f"CPUs they leave")


class ProgressBar:
    """tqdm over the run's steps, showing the metrics declared with a `bar` label (the loss, and what tells whether
    it learns: colour or class accuracy, the last evaluation's top-1), on the main process only."""

    def __init__(self, accelerator: Accelerator, metrics: Iterable[Metric], total: int, initial: int):
        self.shown = [m for m in metrics if m.bar]
        self.bar = tqdm(total=total, initial=initial, disable=not accelerator.is_main_process, desc="train", dynamic_ncols=True)

    def update(self, values: dict[str, float]) -> None:
        self.bar.set_postfix({m.bar: m.show(values[m.tag]) for m in self.shown if m.tag in values}, refresh=False)

    def step(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
