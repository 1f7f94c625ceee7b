"""Wiring shared by the stages: config -> backbone, shards, loaders, trackers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from mpp.config import Config, config_to_yaml
from mpp.data import StreamState, TrainTransform, expand_shards, make_loader
from mpp.errors import UserError
from mpp.model import VisionTransformer, build_vit
from mpp.shards import synthetic_samples, write_shards
from mpp.train import complete_checkpoints

SYNTHETIC_ROOT = Path("data")


def build_backbone(cfg: Config) -> VisionTransformer:
    m = cfg.model
    return build_vit(m.name, m.image_size, m.patch_size, width=m.width, depth=m.depth, heads=m.heads)


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
    args = [a for a in sys.argv if a != "--resume"]
    args.insert(args.index(next(a for a in args if a in ("pretrain", "finetune"))) + 1 if any(a in ("pretrain", "finetune") for a in args) else len(args), "--resume")
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
