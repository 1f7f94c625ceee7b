"""How every stage starts: its Accelerator, its config resolved for the processes of this launch, its ranks seeded."""

from __future__ import annotations

import json
from typing import NamedTuple

from accelerate import Accelerator
from accelerate.utils import set_seed

from mpp.checkpoint import read_weights, resolve_checkpoint
from mpp.config import Config, load_config
from mpp.rundir import run_config_of
from mpp.runtime import Device, make_accelerator, precision_label, process_state, resolve_compile


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
    runtime.make_accelerator.
    """
    train_cfg = cfg.train.for_processes(process_state().num_processes)
    accelerator = make_accelerator(train_cfg, cfg.output_dir)
    set_seed(train_cfg.seed, device_specific=per_process_seed)
    global_batch = train_cfg.batch_size * accelerator.num_processes * train_cfg.grad_accum
    return Run(accelerator, cfg.model_copy(update={"train": train_cfg}, deep=True), global_batch)


def run_settings(accelerator: Accelerator, cfg: Config, global_batch: int) -> str:
    """How the run computes, for its start line: precision, compile and how the global batch is split."""
    t = cfg.train
    compiling = resolve_compile(t.compile, Device.this_process())
    return (f"{precision_label(accelerator.mixed_precision)}, compile {f'on ({t.compile_backend})' if compiling else 'off'}, "
            f"global batch {global_batch} = {accelerator.num_processes} process(es) x {t.batch_size} images"
            f" x {t.grad_accum} accumulation step(s)")


ARCHITECTURE = ("image_size", "patch_size", "width", "depth", "heads")  # the model.* keys a weights file can say
STEM = ("stem", "stem_layers", "stem_width", "pos_embed")  # and those newer files say too (older ones: the defaults)


def checkpoint_config(ckpt: str, config: str | None, overrides: list[str]) -> Config:
    """--config if given, else the config.yaml of the run that wrote `ckpt` (its model and data carry over), else,
    for weights outside a run (an exported .safetensors, a Hugging Face directory), the defaults with the model the
    weights describe; then overrides."""
    if config is None:
        weights = resolve_checkpoint(ckpt)
        config = run_config_of(weights)
        if config is None:
            about = read_weights(weights).about
            if all(key in about for key in ARCHITECTURE):
                # A name without a patch size, so the file's own patch size is not contradicted by the default's.
                said = [key for key in (*ARCHITECTURE, *STEM) if key in about]
                overrides = ["model.name=vit_b", *(f"model.{key}={json.dumps(about[key])}" for key in said), *overrides]
    return load_config(config, overrides)
