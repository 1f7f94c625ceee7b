"""A training run resolved once, before it starts: what every later step of run_training reads instead of deriving
it again from the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mpp.config import Config, dotted
from mpp.rundir import RunDir
from mpp.training.runtime import process_state
from .loaders import with_run_length
from .run_policy import StartingPoint, check_output_dir, continues_a_run
from .start import check_same_config


@dataclass(frozen=True)
class RunPlan:
    """A training run as this launch runs it, resolved from its config, the process count and its run directory."""

    cfg: Config  # what the run trains with: train.steps from train.epochs, train.global_batch_size split per process
    processes: int  # the processes of this launch
    global_batch: int  # images per optimiser step over all processes (per-process batch x processes x accumulation)
    settings: dict  # `cfg` as dotted keys ({'train.lr': 0.1}): what a resume compares, the ranks check, HParams show
    run_dir: RunDir  # output_dir and the paths of what the run writes there
    resume: bool  # whether the run continues the one in run_dir
    changes: list[str]  # what the resume changes, as `key before -> after` (empty for a fresh start)
    samples: int | None  # the training images, as the reader of data.shards counts them (None where it cannot)


def plan_run(cfg: Config, resume: bool | Literal["auto"], start: StartingPoint | None, overwrite: bool) -> RunPlan:
    """The plan of a training run under `cfg`, or the UserError of a run that cannot start: its length (from
    train.epochs, over the training images it counts), the same config on every rank (start.check_same_config), its
    batch split over the processes of this launch, whether it continues the run in output_dir (`resume`, see
    run_policy.continues_a_run) and what its output_dir allows (for a fine-tuning from `start`; `overwrite` starts
    over there)."""
    processes = process_state().num_processes
    cfg, samples = with_run_length(cfg, processes)
    if processes > 1:  # before the split: a batch that one rank cannot split must not leave the others waiting
        check_same_config(dotted(cfg.model_dump(mode="json")), processes)
    cfg = cfg.split_over(processes)
    settings = dotted(cfg.model_dump(mode="json"))
    run_dir = RunDir(Path(cfg.output_dir))
    resume = continues_a_run(run_dir.root, resume)
    changes = check_output_dir(cfg, settings, resume, start, overwrite)
    return RunPlan(cfg, processes, cfg.train.global_batch(processes), settings, run_dir, resume, changes, samples)
