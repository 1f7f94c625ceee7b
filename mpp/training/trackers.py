"""Where a run's numbers go besides TensorBoard (`log.trackers`): Accelerate's MLflow and Weights & Biases
integrations, and log.txt in the run directory, one JSON line of scalars per logged step (as MAE and timm write).

Scalars reach every tracker through `accelerator.log`; images through `log_image`; the config and the final metrics
through pipelines/tracking.py.
"""

from __future__ import annotations

import importlib.util
import json
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
    """log.txt: each logged step's scalars (the loop's and the evaluations' of that step together) as one JSON line,
    appended when a later step is logged and when the run ends, so a resumed run continues the file."""

    name = "log.txt"
    requires_logging_directory = False

    def __init__(self, path: str | Path):
        super().__init__()
        self.path, self.pending = Path(path), None

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass  # config.yaml beside it holds the settings

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        if self.pending is not None and self.pending["step"] != step:
            self.flush()
        self.pending = {**(self.pending or {"step": step}), **{k: v for k, v in values.items() if isinstance(v, (int, float))}}

    def flush(self) -> None:
        if self.pending is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps(self.pending) + "\n")
            self.pending = None

    def finish(self) -> None:
        self.flush()


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
