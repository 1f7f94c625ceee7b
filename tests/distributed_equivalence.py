"""Driven by tests/test_distributed.py: train on the same fixed global batches laid out as 2 processes x b,
1 process x 2b, or 1 process x b with gradient accumulation 2; the final weights must agree.

Usage: [accelerate launch ...] distributed_equivalence.py OUTPUT_DIR HALF_BATCH GRAD_ACCUM
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch import nn  # noqa: E402

from mpp.config import load_config  # noqa: E402
from mpp.data.stream import Batch, StreamPosition  # noqa: E402
from mpp.metrics import split_metric  # noqa: E402
from mpp.model.vit import build_vit  # noqa: E402
from mpp.model.objectives import Objective, StepOutput  # noqa: E402
from mpp.training.runtime import make_accelerator  # noqa: E402
from mpp.rundir import RunDir  # noqa: E402
from mpp.training.loop import train  # noqa: E402

STEPS, CLASSES = 4, 4


class LabelPrediction(Objective):
    """A deterministic objective (MPP draws corruptions per rank), so every layout must take the same steps."""

    description = "label prediction from the [class] token"

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.width, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        return StepOutput(F.cross_entropy(self.head(self.backbone(images.float() / 255)[:, 0]), labels))

    def metrics(self, split: str) -> list:
        return [split_metric(split, "loss", "loss")]

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.state_dict()


def global_batches(rank: int, world: int, half: int, accum: int):
    """Each step's global batch of 2 * half images, cut into this process's micro-batches."""
    generator = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        images = torch.randint(0, 256, (2 * half, 3, 16, 16), generator=generator, dtype=torch.uint8)
        labels = torch.randint(0, CLASSES, (2 * half,), generator=generator)
        size = 2 * half // (world * accum)
        for part in range(rank * accum, (rank + 1) * accum):
            rows = slice(part * size, (part + 1) * size)
            yield Batch(images[rows], labels[rows], position=StreamPosition(step, part))


def main(output_dir: str, half: int, accum: int) -> None:
    cfg = load_config(None, [f"output_dir={output_dir}", f"train.steps={STEPS}", "train.warmup_steps=1",
                             f"train.grad_accum={accum}", "train.lr=1e-3", "log.every=1", "data.num_workers=0",
                             # fp32: bf16 rounds a half batch's activations differently from a whole one's.
                             "train.mixed_precision=no"])
    accelerator = make_accelerator(cfg.train, output_dir)
    set_seed(0)
    objective = LabelPrediction(build_vit("vit_ti", 16, 4, width=32, depth=2, heads=2))
    rank, world = accelerator.process_index, accelerator.num_processes
    train(accelerator, objective, lambda state: global_batches(rank, world, half, accum), cfg.train, cfg.log, RunDir(Path(output_dir)))
    accelerator.print(f"trained with {world} process(es)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
