"""The commands that score a saved backbone's frozen features (`fewshot`, `knn`, `probe`): one shape for all three."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator

from mpp.baselines import beside, not_above
from mpp.checkpoint import load_backbone
from mpp.config import Config
from mpp.model import VisionTransformer
from .start import start_run


def evaluate_checkpoint(cfg: Config, ckpt: str, file_name: str,
                        measure: Callable[[Config, Accelerator, VisionTransformer], tuple[dict, str]]) -> dict:
    """Load the backbone in `ckpt`, `measure(cfg, accelerator, backbone)` -> (result, one line saying it), write
    output_dir/`file_name` and print the line from the main process; returns the result (with the checkpoint)."""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    backbone = load_backbone(ckpt, cfg.model).to(accelerator.device)
    measured, line = measure(cfg, accelerator, backbone)
    result = {"ckpt": str(ckpt), **measured}
    if accelerator.is_main_process:
        out = Path(cfg.output_dir) / file_name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{line} of {ckpt} ({accelerator.num_processes} process(es)); written to {out}")
        scores = [measured["top1"]] if "top1" in measured else list(measured.get("accuracy", {}).values())
        if scores and "baseline" in measured and all(not_above("top1", s, measured["baseline"]) for s in scores):
            baseline = beside("", measured["baseline"], "{:.1%}".format).strip()
            print(f"warning: the frozen features score at or below the baseline {baseline}: "
                  f"they separate these classes no better than a guess. Likely causes: a backbone pretrained too briefly "
                  f"or at a resolution far below the images' (model.image_size), or too few labelled images")
    accelerator.wait_for_everyone()  # no process tears down its process group while another still uses it
    return result
