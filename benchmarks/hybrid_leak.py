"""How much an MPP-pretrained model reads a masked patch's own pixels: its colour accuracy on the [mask]ed patches,
as trained, and again with those patches' pixels also greyed out before the stem.

    python benchmarks/hybrid_leak.py RUN_DIR [RUN_DIR ...] [--images 1024]

For a plain ViT, or a hybrid corrupted in pixels (mpp.corrupt_in=pixels), greying a [mask]ed patch changes nothing the
model sees: its tokens never held those pixels. A hybrid corrupted in embeddings (mpp.corrupt_in=embeddings) keeps
them in its neighbours' tokens, mixed in by the ResNet's convolutions; the drop in accuracy when they are greyed is
what the model took from that leak. Images are the embedded synthetic corpus's, from indices no run of 5000 or
fewer images trained on; the corruption is drawn from a fixed seed, the same for every run and both conditions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpp.config import load_config  # noqa: E402
from mpp.model.vit import build_backbone  # noqa: E402
from mpp.model.objectives import MASK, gather_positions  # noqa: E402
from mpp.model.registry import OBJECTIVES  # noqa: E402
from mpp.rundir import complete_checkpoints  # noqa: E402
from mpp.data.synthetic import synthetic_image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def accuracy_on_masked(objective, images: torch.Tensor, corruption, grey: bool) -> float:
    """Colour accuracy at the [mask]ed positions; `grey`: their pixels set to mid-grey in the input first."""
    p, g = objective.backbone.patch_size, objective.backbone.grid
    shown = images.clone()
    if grey:
        for b, (positions, kinds) in enumerate(zip(corruption.positions, corruption.kinds)):
            for position in positions[kinds == MASK].tolist():
                r, c = divmod(position, g)
                shown[b, :, r * p: (r + 1) * p, c * p: (c + 1) * p] = 128
    with torch.no_grad():
        predictions, _ = objective.predict(shown, corruption)
    predicted = objective.target.decode(predictions.float())  # (B, K)
    targets = gather_positions(objective.targets(images), corruption.positions)
    masked = corruption.kinds == MASK
    return float((predicted == targets)[masked].float().mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="MPP pretraining run directories (their last checkpoint is read)")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--first-index", type=int, default=100_000, help="synthetic corpus index of the first image")
    args = parser.parse_args(argv)
    for run in args.runs:
        cfg = load_config(run / "config.yaml")
        objective = OBJECTIVES["mpp"].objective(build_backbone(cfg.model), cfg, None)
        state = load_file(complete_checkpoints(run)[-1] / "model.safetensors")
        objective.load_state_dict(state)
        objective.eval()
        size = cfg.model.image_size
        images = torch.from_numpy(np.stack([np.asarray(synthetic_image(args.first_index + i, size)[0].convert("RGB"))
                                            for i in range(args.images)])).permute(0, 3, 1, 2).contiguous()
        corruption = objective.draw_corruption(args.images, "cpu", torch.Generator().manual_seed(0))
        seen = accuracy_on_masked(objective, images, corruption, grey=False)
        greyed = accuracy_on_masked(objective, images, corruption, grey=True)
        print(f"{run}: stem {cfg.model.stem}, corrupted in {objective.corrupt_in}: colour accuracy on [mask]ed patches "
              f"{seen:.1%}; with their pixels greyed {greyed:.1%} ({greyed - seen:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
