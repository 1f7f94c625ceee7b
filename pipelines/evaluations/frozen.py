"""The commands that score a saved backbone's frozen features (`fewshot`, `knn`, `probe`): one shape for all three."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator

from mpp.model.checkpoint import load_backbone
from mpp.config import Config
from mpp.model.vit import VisionTransformer
from ..run.start import start_run


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
    accelerator.wait_for_everyone()  # no process tears down its process group while another still uses it
    return result
