"""A fine-tuning run's periodic evaluation: its images decoded once and kept, against decoded at every evaluation.

    python benchmarks/evaluation.py                      # the embedded synthetic corpus, 2,000 images
    python benchmarks/evaluation.py data.shards=data/fmnist_all/train data.val_shards=data/fmnist_all/test

A fine-tuning run scores its classifier on data.val_shards every finetune.eval_every steps (TopK in
pipelines.evaluations.evaluators). This scores a fresh classifier of --config (default: the shipped fine-tuning
config) --evaluations times each way, alternating in one process so background load hits both alike: `kept` (the
first pass decoded, the later ones from memory: KeptPass) and `read` (every pass decoded, as before). It prints the
seconds of the first pass and of each later one, medians over --rounds, and their ratio. Overrides are key=value
settings of the config.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mpp.config import load_config  # noqa: E402
from mpp.training.runtime import make_accelerator  # noqa: E402
from pipelines.evaluations.evaluators import Stage, TopK  # noqa: E402
from pipelines.run.loaders import KeptPass, num_classes, resolve_shards  # noqa: E402
from pipelines.stages.finetune import build_classifier  # noqa: E402


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "finetune" / "default.yaml")
    parser.add_argument("--evaluations", type=int, default=5, help="evaluations in one run (the first decodes)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--images", type=int, default=2000, help="data.synthetic_size, where the data is synthetic")
    parser.add_argument("overrides", nargs="*", help="key=value settings (data.val_shards=DIR, model.image_size=28, ...)")
    return parser


def timed_run(top: TopK, classifier, evaluations: int) -> tuple[float, list[float], dict]:
    """The first evaluation's seconds, each later one's, and the last scores."""
    seconds = []
    for _ in range(evaluations):
        began = time.perf_counter()
        scores = top.scores(classifier)
        seconds.append(time.perf_counter() - began)
    return seconds[0], seconds[1:], scores


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    if args.evaluations < 2 or args.rounds < 1:
        argument_parser().error("--evaluations must be at least 2 and --rounds at least 1")
    with tempfile.TemporaryDirectory() as work:
        cfg = load_config(args.config, ["data.shards=synthetic", "data.val_shards=synthetic",
                                        f"data.synthetic_size={args.images}", f"output_dir={work}", *args.overrides])
        accelerator = make_accelerator(cfg.train, cfg.output_dir, trackers=())
        classes = num_classes(cfg, resolve_shards(cfg.data.shards, cfg, accelerator))
        classifier = build_classifier(cfg, None, classes).to(accelerator.device)
        stage = Stage("finetune", classes)
        times: dict[str, dict[str, list[float]]] = {way: {"first": [], "later": []} for way in ("kept", "read")}
        scores = {}
        for _ in range(args.rounds):
            for way in ("kept", "read"):
                top = TopK(cfg, accelerator, stage)
                if way == "read":
                    top.batches = KeptPass(top.batches.read, limit=0)  # never kept: every pass decodes
                first, later, scores[way] = timed_run(top, classifier, args.evaluations)
                times[way]["first"].append(first)
                times[way]["later"] += later
        assert scores["kept"] == scores["read"], scores  # the same images scored either way
        images = len(top.predictions)
        backbone = classifier.backbone
        print(f"{images} evaluation images ({cfg.data.val_shards}) at {cfg.model.image_size} px, {cfg.model.name} width "
              f"{backbone.width} depth {len(backbone.blocks)}, batch {cfg.train.batch_size}, "
              f"{cfg.data.num_workers} data worker(s), {torch.get_num_threads()} thread(s); {args.rounds} round(s) of "
              f"{args.evaluations} evaluations each way, alternating; medians")
        print(f"{'':8}{'first pass s':>14}{'later pass s':>14}")
        for way, t in times.items():
            print(f"{way:8}{statistics.median(t['first']):14.2f}{statistics.median(t['later']):14.2f}")
        later = statistics.median(times["read"]["later"]) / statistics.median(times["kept"]["later"])
        print(f"a later evaluation: read / kept = {later:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
