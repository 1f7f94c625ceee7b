"""Step time of each masked-image-modelling lever against the same step without it, in one process.

Fine-tuning levers on a classification step (layer decay, drop path, mean pooling, label smoothing), block masking
on an MPP step, and the cost of one pretext validation and one kNN evaluation. Runs alternate (base, lever, base,
lever, ...) so drift on a shared machine hits both alike; the median per-step time of each is printed.

    python benchmarks/levers.py [--steps 20] [--repeats 3] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpp.config import TrainConfig  # noqa: E402
from mpp.evaluation.neighbours import knn_accuracy  # noqa: E402
from mpp.model.vit import VisionTransformer, normalize, pool  # noqa: E402
from mpp.model.objectives import Classification, MaskedPatchPrediction, finetuning_head  # noqa: E402
from mpp.data.stream import Batch  # noqa: E402
from mpp.training.optim import build_optimizer, build_schedule, param_groups  # noqa: E402
from mpp.training.runtime import make_accelerator  # noqa: E402
from mpp.training.loop import train_step  # noqa: E402

WIDTH, DEPTH, HEADS, IMAGE, PATCH = 192, 6, 3, 32, 4  # configs/finetune/default.yaml's ViT


def step_time(accelerator, make, cfg: TrainConfig, images, labels, steps: int) -> float:
    """Median seconds of the training loop's own step (mpp.training.loop.train_step) on a fresh objective."""
    torch.manual_seed(0)
    objective = make()
    model = accelerator.prepare(objective)
    optimizer = accelerator.prepare(build_optimizer(param_groups(objective, cfg.layer_decay), cfg))
    schedule = build_schedule(optimizer, cfg)
    batch = Batch(images, labels)
    objective.train()
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        train_step(accelerator, model, model, optimizer, schedule, [batch], cfg.clip_grad_norm)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    accelerator = make_accelerator(TrainConfig(), tempfile.mkdtemp(prefix="mpp-levers-"))  # train.mixed_precision auto
    autocast = accelerator.mixed_precision == "bf16"
    images = torch.randint(0, 256, (args.batch_size, 3, IMAGE, IMAGE), dtype=torch.uint8)
    labels = torch.arange(args.batch_size) % 10
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'bf16 autocast' if autocast else 'fp32'}, "
          f"ViT width {WIDTH} depth {DEPTH} at {IMAGE} px patch {PATCH}, batch {args.batch_size}, median of {args.steps} steps")

    def classifier(drop_path=0.0, pooling="cls", smoothing=0.0):
        return lambda: Classification(VisionTransformer(IMAGE, PATCH, WIDTH, DEPTH, HEADS, drop_path),
                                      finetuning_head(WIDTH, 10), export_head=True, pool=pooling, label_smoothing=smoothing)

    def mpp(masking="random"):
        return lambda: MaskedPatchPrediction(VisionTransformer(IMAGE, PATCH, WIDTH, DEPTH, HEADS), masking=masking)

    sgd, adamw = TrainConfig(optimizer="sgd", lr=0.01), TrainConfig(optimizer="adamw", lr=1e-3)
    cases = {
        "fine-tune, layer_decay 0.75 (AdamW)": ((classifier(), adamw), (classifier(), adamw.model_copy(update={"layer_decay": 0.75}))),
        "fine-tune, drop_path 0.1 (SGD)": ((classifier(), sgd), (classifier(drop_path=0.1), sgd)),
        "fine-tune, pool mean (SGD)": ((classifier(), sgd), (classifier(pooling="mean"), sgd)),
        "fine-tune, label_smoothing 0.1 (SGD)": ((classifier(), sgd), (classifier(smoothing=0.1), sgd)),
        "MPP pretraining, masking block (AdamW)": ((mpp(), adamw), (mpp("block"), adamw)),
    }
    for name, ((make_base, cfg_base), (make_lever, cfg_lever)) in cases.items():
        base, lever = [], []
        for _ in range(args.repeats):
            base.append(step_time(accelerator, make_base, cfg_base, images, labels, args.steps))
            lever.append(step_time(accelerator, make_lever, cfg_lever, images, labels, args.steps))
        b, lv = statistics.median(base), statistics.median(lever)
        print(f"{name:42s} without {1000 * b:7.1f} ms/step, with {1000 * lv:7.1f} ms/step ({lv / b:.2f}x)")

    torch.manual_seed(0)
    objective = MaskedPatchPrediction(VisionTransformer(IMAGE, PATCH, WIDTH, DEPTH, HEADS)).eval()
    held_out = torch.randint(0, 256, (512, 3, IMAGE, IMAGE), dtype=torch.uint8)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        for i in range(0, 512, 128):
            objective(held_out[i : i + 128], corruption=objective.draw_corruption(128, generator=torch.Generator().manual_seed(i)))
    print(f"one pretext validation (eval.images 512, batch 128): {time.perf_counter() - start:.2f} s")
    pool_images = torch.randint(0, 256, (7000, 3, IMAGE, IMAGE), dtype=torch.uint8)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        features = torch.cat([pool(objective.backbone(normalize(pool_images[i : i + 256])), "cls").float() for i in range(0, 7000, 256)])
    extracted = time.perf_counter() - start
    start = time.perf_counter()
    knn_accuracy(features[:5000], torch.arange(5000) % 10, features[5000:], torch.arange(2000) % 10)
    print(f"one kNN evaluation (knn.train_images 5000, eval_images 2000): features {extracted:.2f} s, vote {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
