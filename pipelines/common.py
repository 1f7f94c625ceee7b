"""Wiring shared by the stages: config -> backbone, shards, loaders, trackers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf

from mpp.checkpoint import resolve_checkpoint
from mpp.config import Config, config_to_yaml, load_config
from mpp.data import Batch, DataError, StreamState, TrainTransform, expand_shards, make_loader
from mpp.errors import UserError
from mpp.model import VisionTransformer, build_vit
from mpp.shards import synthetic_samples, write_shards
from mpp.train import complete_checkpoints, make_accelerator

SYNTHETIC_ROOT = Path("data")


def build_backbone(cfg: Config) -> VisionTransformer:
    m = cfg.model
    return build_vit(m.name, m.image_size, m.patch_size, width=m.width, depth=m.depth, heads=m.heads, drop_path=m.drop_path)


def start_training(cfg: Config) -> Accelerator:
    """The Accelerator of a training stage, with train.batch_size resolved for its processes and each rank seeded.

    Ranks get different seeds (different corruptions and augmentations); DDP keeps their weights in sync.
    """
    accelerator = make_accelerator(cfg.train, cfg.output_dir)
    cfg.train = cfg.train.for_processes(accelerator.num_processes)
    set_seed(cfg.train.seed, device_specific=True)
    return accelerator


def resolve_shards(spec: str, cfg: Config, accelerator: Accelerator) -> list[str]:
    """'synthetic' is the embedded corpus, generated once (by the main process) under data/."""
    if spec == "synthetic":
        out = SYNTHETIC_ROOT / f"synthetic-{cfg.data.synthetic_size}"
        with accelerator.main_process_first():
            if accelerator.is_main_process and not (out / "summary.json").is_file():
                accelerator.print(f"generating the embedded synthetic corpus ({cfg.data.synthetic_size} images) in {out}")
                write_shards(synthetic_samples(cfg.data.synthetic_size), out, overwrite=True)
        spec = str(out)
    return expand_shards(spec)


def train_loader(urls: list[str], cfg: Config, accelerator: Accelerator, state: StreamState):
    return make_loader(
        urls, TrainTransform(cfg.model.image_size, cfg.data.crop_scale, cfg.data.hflip), cfg.train.batch_size,
        num_workers=cfg.data.num_workers, rank=accelerator.process_index, world=accelerator.num_processes,
        seed=cfg.train.seed, resampled=cfg.data.resampled, shuffle_buffer=cfg.data.shuffle_buffer,
        pin_memory=torch.cuda.is_available(), state=state)


def num_classes(cfg: Config, urls: list[str]) -> int:
    """model.num_classes, else the class count in the summary.json that `launch.py prepare` wrote beside the shards."""
    if cfg.model.num_classes:
        return cfg.model.num_classes
    summary_path = Path(urls[0]).parent / "summary.json"
    if not summary_path.is_file():
        raise DataError(f"no summary.json beside the shards of {cfg.data.shards} to read the class count from; set model.num_classes")
    summary = json.loads(summary_path.read_text())
    if not summary.get("labels"):
        raise DataError(f"the shards of {cfg.data.shards} have no cls labels ({summary_path} says so); "
                        f"supervised training needs labelled shards (write them with `launch.py prepare` from labelled images)")
    return len(summary["class_names"]) if summary.get("class_names") else int(summary["classes"])


def labelled(batches: Iterable[Batch], classes: int, what: str) -> Iterator[Batch]:
    """Batches whose labels are all in [0, classes), checked on the host before they reach the device."""
    for batch in batches:
        labels = batch.labels
        if labels.numel() and labels.min() < 0:
            raise DataError(f"{what} holds images without a cls label; supervised pretraining and "
                            f"fine-tuning need a label for every image (use labelled shards, or objective=mpp)")
        if labels.numel() and labels.max() >= classes:
            raise DataError(f"{what} holds label {int(labels.max())} but the head has {classes} classes; "
                            f"set model.num_classes to the number of classes")
        yield batch


def check_output_dir(cfg: Config, resume: bool) -> None:
    """Refuse to mix two runs' checkpoints in one directory, or to resume one with another model or objective."""
    if not complete_checkpoints(cfg.output_dir):
        return
    if not resume:
        raise UserError(f"output_dir {cfg.output_dir} already holds checkpoints of a run; pass --resume to continue it or set output_dir to a new directory")
    saved = Path(cfg.output_dir) / "config.yaml"
    if saved.is_file():
        before = OmegaConf.to_container(OmegaConf.load(saved))
        now = cfg.model_dump(mode="json")
        for section in ("objective", "model", "mpp"):
            if before.get(section) != now.get(section):
                raise UserError(f"output_dir {cfg.output_dir} holds a run with a different '{section}' config ({before.get(section)}); "
                                f"resume with the same settings (see its config.yaml) or set output_dir to a new directory")


def resume_command() -> str:
    """This process's command line with --resume right after the stage name (or at the end if there is none)."""
    args = [a for a in sys.argv if a != "--resume"]
    stage = next((i for i, a in enumerate(args) if a in ("pretrain", "finetune")), len(args) - 1)
    args.insert(stage + 1, "--resume")
    runner = "accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ else "python"
    return f"`{runner} {' '.join(args)}`"


def start_tracking(accelerator: Accelerator, cfg: Config, run_name: str) -> None:
    """TensorBoard run under output_dir/tensorboard/<run_name>, with the config as hparams and text; config.yaml beside."""
    flat = {}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}{key}.", inner)
        else:
            flat[prefix[:-1]] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)

    flatten("", cfg.model_dump(mode="json"))
    accelerator.init_trackers(run_name, config=flat)
    if accelerator.is_main_process:
        text = config_to_yaml(cfg)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "config.yaml").write_text(text)
        accelerator.get_tracker("tensorboard", unwrap=True).add_text("config", f"```\n{text}\n```")


def checkpoint_config(ckpt: str, config: str | None, overrides: list[str]) -> Config:
    """--config if given, else the config.yaml of the run that wrote `ckpt` (its model and data carry over); then overrides."""
    if config is None:
        weights = resolve_checkpoint(ckpt)
        run_dir = weights.parent.parent.parent if weights.parent.parent.name == "checkpoints" else weights.parent
        config = run_dir / "config.yaml" if (run_dir / "config.yaml").is_file() else None
    return load_config(config, overrides)
