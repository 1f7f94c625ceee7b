"""How every stage starts: its Accelerator, its config resolved for the processes of this launch (the same on every
rank), its ranks seeded, its end tied to its launcher's."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from mpp.model.checkpoint import read_weights, resolve_checkpoint, stem_padding_of
from mpp.config import Config, dotted, load_config, load_saved_config
from mpp.errors import UserError
from mpp.training.preemption import host_group, stop_when_parent_dies
from mpp.rundir import run_config_of
from mpp.training.runtime import Device, make_accelerator, precision_label, process_state, resolve_compile


class Run(NamedTuple):
    """A started stage: what every stage reads first, resolved once for this process's launch.

    `cfg` is the stage's config with train.global_batch_size split over the processes (a new object; the config the
    stage was given is not changed); `global_batch` is the images per optimiser step over all processes (per-process
    batch x processes x accumulation steps), what the start line and images_seen report.
    Immutable, and it unpacks: `accelerator, cfg, global_batch = start_run(cfg)`.
    """

    accelerator: Accelerator
    cfg: Config
    global_batch: int


def start_run(cfg: Config, *, per_process_seed: bool = True) -> Run:
    """The one way a stage starts: its Accelerator, its resolved config, each rank seeded. A stage begins with
    `accelerator, cfg, global_batch = start_run(cfg)` and reads only the returned config from then on.

    Training ranks get different seeds (different corruptions and augmentations; DDP keeps their weights in sync);
    an evaluation (per_process_seed=False) seeds every rank alike, so a fresh backbone is the same on all of them.
    Stages run one after another in one process (compare) share the process's Accelerate state: see
    runtime.make_accelerator. A training stage splits its config in its RunPlan and starts with `start_accelerator` alone.
    """
    processes = process_state().num_processes
    if processes > 1:  # before the split: a batch that one rank cannot split must not leave the others waiting
        check_same_config(dotted(cfg.model_dump(mode="json")), processes)
    cfg = cfg.split_over(processes)
    return Run(start_accelerator(cfg, per_process_seed=per_process_seed), cfg, cfg.train.global_batch(processes))


def start_accelerator(cfg: Config, *, per_process_seed: bool = True) -> Accelerator:
    """The Accelerator of a stage under `cfg` (already split over the processes), this rank seeded (see start_run).
    A process a launcher started stops (with a checkpoint, in training) when the launcher dies: see
    preemption.stop_when_parent_dies."""
    if launched():
        stop_when_parent_dies()
    accelerator = make_accelerator(cfg.train, cfg.output_dir, cfg.log.trackers)
    set_seed(cfg.train.seed, device_specific=per_process_seed)
    return accelerator


# What `accelerate launch` (ACCELERATE_MIXED_PRECISION, for one process too) and torch's elastic agent (under torchrun
# and `accelerate launch --multi_gpu`) set in the processes they start; pipelines.run.invocation reads the same.
LAUNCHER_MARKS = ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")


def launched() -> bool:
    """Whether a launcher started this process (rather than a shell: `python launch.py ...`)."""
    return any(mark in os.environ for mark in LAUNCHER_MARKS)


class RanksDisagree(UserError):
    """The processes of one run were given different configs. Every rank finds it at once, together: rank 0 says it."""


def check_same_config(settings: dict, processes: int) -> None:
    """Every rank's resolved config (`settings`, as dotted keys), gathered over the host process group, must be the
    same: a rank given another train.steps waits forever for the others at the end (DDP), another train.lr trains
    silently apart, another model width ends in a DDP traceback. Raises RanksDisagree on every rank, naming the keys
    and each rank's value."""
    mine = {key: str(value) for key, value in settings.items()}
    every: list[dict[str, str]] = [{} for _ in range(processes)]
    torch.distributed.all_gather_object(every, mine, group=host_group())
    differing = sorted({key for config in every for key in config if any(c.get(key) != config.get(key) for c in every)})
    if not differing:
        return
    shown = "; ".join(f"{key} is {values_by_rank(every, key)}" for key in differing[:5])
    more = f" (and {len(differing) - 5} more keys)" if len(differing) > 5 else ""
    raise RanksDisagree(f"the {processes} processes of this run were given different configs: {shown}{more}; start "
                        f"them all with one command line (the same --config file and key=value overrides)")


def values_by_rank(every: list[dict[str, str]], key: str) -> str:
    """'20 on rank 0 and 40 on rank 1', ranks grouped by value."""
    ranks: dict[str, list[int]] = {}
    for rank, config in enumerate(every):
        ranks.setdefault(config.get(key, "unset"), []).append(rank)
    return " and ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:4]))}{', ...' if len(r) > 4 else ''}"
                        for value, r in ranks.items())


def run_settings(accelerator: Accelerator, cfg: Config, global_batch: int) -> str:
    """How the run computes, for its start line: precision, compile and how the global batch is split."""
    t = cfg.train
    compiling = resolve_compile(t.compile, Device.this_process())
    compile_how = t.compile_backend if t.compile_mode == "default" else f"{t.compile_backend}, {t.compile_mode}"
    return (f"{precision_label(accelerator.mixed_precision)}, compile {f'on ({compile_how})' if compiling else 'off'}, "
            f"global batch {global_batch} = {accelerator.num_processes} process(es) x {t.batch_size} images"
            f" x {t.grad_accum} accumulation step(s)")


ARCHITECTURE = ("image_size", "patch_size", "width", "depth", "heads")  # the model.* keys a weights file can say
STEM = ("stem", "stem_layers", "stem_width", "stem_padding", "pos_embed")  # and those newer files say too (older ones: the defaults)


def with_saved_kinds(cfg: Config, config: str, ckpt: str, overrides: list[str]) -> Config:
    """A fine-tuning's config (`config`, then the overrides), with the position embeddings and the hybrid stem's
    padding the weights in `ckpt` were trained with where it leaves them unset, as their head count is taken: the
    default would be refused (a ViT cannot change its position embeddings) or would misdescribe the stem."""
    saved, unset = read_weights(ckpt), {"pos_embed", "stem_padding"} - cfg.model.model_fields_set
    kinds = {"pos_embed": saved.about.get("pos_embed", cfg.model.pos_embed)}
    if saved.about.get("stem") == "resnet" or any(k.startswith(("patch_embed.stem.", "backbone.patch_embed.stem."))
                                                  for k in saved.tensors):
        kinds["stem_padding"] = stem_padding_of(saved)
    changed = [f"model.{key}={kind}" for key, kind in kinds.items() if key in unset and kind != getattr(cfg.model, key)]
    return load_config(config, [*changed, *overrides]) if changed else cfg


def checkpoint_config(ckpt: str, config: str | None, overrides: list[str]) -> Config:
    """--config if given, else the config.yaml of the run that wrote `ckpt` (its model and data carry over), else,
    for weights outside a run (an exported .safetensors, a Hugging Face directory), the defaults with the model the
    weights describe; then overrides."""
    if config is None:
        weights = resolve_checkpoint(ckpt)
        config = run_config_of(weights)
        if config is not None:
            return load_saved_config(config, overrides)  # as its run was built
        about = read_weights(weights).about
        if all(key in about for key in ARCHITECTURE):
            # A name without a patch size, so the file's own patch size is not contradicted by the default's.
            said = [key for key in (*ARCHITECTURE, *STEM) if key in about]
            overrides = ["model.name=vit_b", *(f"model.{key}={json.dumps(about[key])}" for key in said), *overrides]
    return load_config(config, overrides)
