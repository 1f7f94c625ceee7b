"""Where a run's numbers go besides TensorBoard (`log.trackers`): Accelerate's MLflow and Weights & Biases
integrations, and log.txt in the run directory, one JSON line of scalars per logged step (as MAE and timm write).

Scalars reach every tracker through `accelerator.log`; images through `log_image`; the config and the final metrics
through pipelines/tracking.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from mpp.errors import UserError

# log.trackers name -> (the module it imports, what to install for it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny (or mlflow)"),
            "wandb": ("wandb", "wandb")}


def check_installed(trackers: list[str]) -> None:
    """One line naming the package to install for each tracker asked for whose package is missing."""
    missing = [name for name in trackers if importlib.util.find_spec(TRACKERS[name][0]) is None]
    if missing:
        packages = " ".join(TRACKERS[name][1].split(" ")[0] for name in missing)
        raise UserError(f"log.trackers names {', '.join(missing)}, whose package is not installed: pip install {packages} "
                        f"(or leave {'it' if len(missing) == 1 else 'them'} out of log.trackers)")


class JsonLines(GeneralTracker):
    """log.txt: each logged step's scalars (the loop's and the evaluations' of that step together) as one JSON line.

    Written as each step is logged, not held for a later one: a run killed, or ending on its own error, leaves every
    step it logged, the step of its last checkpoint included. Scalars logged later at the same step (its evaluations,
    run after the step's checkpoint) join that step's line, rewritten in place. A resume (`resume_at`) first drops
    the lines of the steps after its checkpoint, which it trains again, as TensorBoard's purge_step hides them, so
    the file holds each step once."""

    name = "log.txt"
    requires_logging_directory = False

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.last: dict | None = None  # the file's last line, which a later log of its step rewrites
        self.last_at, self.last_size = 0, 0  # where that line starts in the file, and its bytes

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass  # config.yaml beside it holds the settings

    def resume_at(self, step: int) -> None:
        """Keep the lines of the steps up to `step` (a resume's checkpoint; 0: a run started again from nothing) and
        continue after them; a line cut short by a kill is dropped with the rest."""
        kept, size = [], 0
        if self.path.is_file():
            for line in self.path.read_text().splitlines(keepends=True):
                try:
                    row = json.loads(line)
                except ValueError:
                    break
                if not line.endswith("\n") or row.get("step", 0) > step:
                    break
                kept.append((size, len(line.encode()), row))
                size += len(line.encode())
            partial = self.path.with_name(f".partial-{self.path.name}")
            partial.write_bytes(self.path.read_bytes()[:size])
            os.replace(partial, self.path)
        self.last_at, self.last_size, self.last = kept[-1] if kept else (0, 0, None)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("r+b" if self.path.is_file() else "wb") as file:
            if self.last is not None and self.last["step"] == step:
                # One write over the old line, padded to its length where shorter (JSON allows the spaces): no kill
                # can leave the step without the scalars it had, nor a tail of the old line.
                self.last = {**self.last, **scalars}
                line = (json.dumps(self.last).ljust(self.last_size - 1) + "\n").encode()
                file.seek(self.last_at)
            else:
                self.last_at = file.seek(0, os.SEEK_END)
                self.last = {"step": step, **scalars}
                line = (json.dumps(self.last) + "\n").encode()
            file.write(line)
            self.last_size = len(line)


def resume_log_lines(accelerator: Accelerator, step: int) -> None:
    """Continue log.txt after `step`, the checkpoint a run resumes from (0 for a run that starts from nothing)."""
    for tracker in accelerator.trackers:
        if isinstance(tracker, JsonLines) and accelerator.is_main_process:
            tracker.resume_at(step)


def log_image(accelerator: Accelerator, tag: str, image: np.ndarray, step: int) -> None:
    """An (H, W, 3) uint8 image under `tag` at `step`, in every tracker that takes images (main process only)."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, image, global_step=step, dataformats="HWC")
        elif tracker.name == "wandb":
            tracker.log_images({tag: [image]}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            mlflow.log_image(image, key=tag.replace("/", "_"), step=step)


def log_final(accelerator: Accelerator, final: dict[str, float], step: int) -> None:
    """The run's final metrics (what results.json's `final` holds) in MLflow (as the metrics' values at the last
    step) and W&B (its run summary); TensorBoard has them as the last logged values already."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.run.summary.update(final)
        elif tracker.name == "mlflow":
            tracker.log(final, step=step)
