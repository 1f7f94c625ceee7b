"""kNN evaluation stage: of a saved backbone (`launch.py knn`) or periodically during pretraining (`knn/top1`)."""

from __future__ import annotations

import json
from pathlib import Path

from accelerate import Accelerator

from mpp.checkpoint import load_backbone
from mpp.config import Config
from mpp.knn import knn_accuracy
from mpp.model import VisionTransformer
from pipelines.common import FrozenFeatureSets, start_run


class Knn:
    """The labelled neighbour pool and the evaluation images, read once; `scores(backbone)` evaluates a backbone.

    Features are gathered from every process before voting, so the accuracy is the same however many there are.
    """

    def __init__(self, cfg: Config, accelerator: Accelerator):
        self.cfg = cfg.knn
        self.sets = FrozenFeatureSets(cfg, accelerator, cfg.knn, "kNN", "knn", "kNN neighbour shards")

    def scores(self, backbone: VisionTransformer) -> dict[str, float]:
        c = self.cfg
        train_x, train_y, eval_x, eval_y = self.sets.features(backbone)
        return {"knn/top1": knn_accuracy(train_x, train_y, eval_x, eval_y, k=c.k, temperature=c.temperature)}


def run(cfg: Config, *, ckpt: str) -> dict:
    """Evaluate the backbone in `ckpt`; print the accuracy and write it to output_dir/knn.json."""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    backbone = load_backbone(ckpt, cfg.model).to(accelerator.device)
    knn = Knn(cfg, accelerator)
    c = cfg.knn
    result = {"ckpt": str(ckpt), "features": c.features, "k": c.k, "temperature": c.temperature,
              "train_images": knn.sets.pool.total, "eval_images": knn.sets.eval.total, "top1": knn.scores(backbone)["knn/top1"]}
    if accelerator.is_main_process:
        out = Path(cfg.output_dir) / "knn.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"kNN top-1 of {ckpt} ({c.features} features, k={c.k}, T={c.temperature:g}, {knn.sets.pool.total} neighbours, "
              f"{knn.sets.eval.total} evaluation images, {accelerator.num_processes} process(es)): "
              f"{100 * result['top1']:.2f}%; written to {out}")
    accelerator.wait_for_everyone()  # no process tears down its process group while another still uses it
    return result
