"""mpp's one command line: `mpp STAGE [--config FILE] [key=value ...]` (in a checkout: `python launch.py STAGE ...`;
for several processes: `accelerate launch launch.py STAGE ...`, or `accelerate launch -m launch STAGE ...` installed)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Set before torch loads its OpenMP runtime, which reads it once: a thread that finishes its share of an operation
# then sleeps instead of spinning while the others catch up. On 2 cores shared with other jobs the main job took
# 3-20 s per step without it and 0.25-1.1 s with it (docs/benchmarks.md). A value the user exported wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from mpp.errors import UserError  # noqa: E402 (after the OpenMP setting above)
from mpp.runtime import compile_failure, out_of_memory  # noqa: E402
from mpp.train import Preempted  # noqa: E402


def shipped_configs() -> Path:
    """The configs/ directory shipped with mpp: package data in an installed wheel, the top-level configs/ of a
    checkout (what pyproject.toml packages as pipelines/configs)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


CONFIGS = shipped_configs()
RANK_ERROR_GRACE_S = 20


def class_ids(text: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5], for prepare --classes."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of class ids (e.g. 0,2,4)") from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    stages = parser.add_subparsers(dest="stage", required=True)

    pretrain = stages.add_parser("pretrain", help="masked patch prediction pretraining")
    pretrain.add_argument("--config", default=str(CONFIGS / "pretrain" / "default.yaml"),
                          help="YAML config (default: %(default)s); keys it leaves unset take the defaults in README.md")
    pretrain.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir that verifies")
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=1000")

    finetune = stages.add_parser("finetune", help="fine-tune a pretrained backbone (or a fresh one) with a linear head")
    finetune.add_argument("--ckpt", help="a run directory, a checkpoints/step_N directory or a .safetensors file "
                                         "from pretrain (either objective) or finetune; omit it to train from scratch")
    finetune.add_argument("--config", default=str(CONFIGS / "finetune" / "default.yaml"),
                          help="YAML config (default: %(default)s); keys it leaves unset take the defaults in README.md")
    finetune.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir that verifies")
    finetune.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR")

    fewshot = stages.add_parser("fewshot", help="few-shot linear evaluation of a backbone's frozen features")
    fewshot.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    fewshot.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    fewshot.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR fewshot.shots=[5]")

    knn = stages.add_parser("knn", help="k-nearest-neighbour evaluation of a backbone's frozen features")
    knn.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    knn.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    knn.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR knn.features=mean")

    probe = stages.add_parser("probe", help="linear probe (SGD on frozen features, as MAE evaluates) of a backbone")
    probe.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    probe.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    probe.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR probe.epochs=30")

    export = stages.add_parser("export", help="write a checkpoint as a Hugging Face transformers ViT")
    export.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    export.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"), help="hf DIR: a transformers ViT checkpoint in DIR")
    export.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model.image_size=64")

    compare = stages.add_parser("compare", help="MPP vs supervised pretraining vs scratch: pretrain, fine-tune, few-shot, report")
    compare.add_argument("--config", default=str(CONFIGS / "compare" / "tiny.yaml"), help="comparison YAML (default: %(default)s)")
    compare.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. pretrain.train.steps=2000")

    prepare = stages.add_parser("prepare", help="write WebDataset shards from images, a datasets corpus or 'synthetic'")
    prepare.add_argument("source", help="a folder of images (class = sub-folder), a Hugging Face dataset name or local path, "
                                        "an MNIST-style *-images-idx3-ubyte file, CIFAR-10/100's python-version "
                                        ".tar.gz or folder, or 'synthetic'")
    prepare.add_argument("--out", required=True, help="directory for the shards and summary.json")
    prepare.add_argument("--samples-per-shard", type=int, default=1000)
    prepare.add_argument("--split", default="train", help="dataset split for Hugging Face and CIFAR sources")
    prepare.add_argument("--count", type=int, default=20000, help="images to generate for 'synthetic'")
    prepare.add_argument("--size", type=int, default=64, help="side in pixels of generated 'synthetic' images")
    prepare.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    prepare.add_argument("--short-side", type=int, default=None,
                         help="store images whose short side is longer downsized to this many pixels (JPEG at --quality): "
                              "faster decoding in training; keep it at least the training crop size")
    prepare.add_argument("--quality", type=int, default=90, help="JPEG quality of images downsized by --short-side")
    prepare.add_argument("--classes", type=class_ids, default=None,
                         help="keep only these class ids, comma-separated, relabelled 0..k-1 in the order given "
                              "(e.g. 1,3,5,7,9 upstream and 0,2,4,6,8 downstream for a transfer split)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.stage == "pretrain":
            from mpp.config import load_config
            from pipelines import pretrain

            pretrain.run(load_config(args.config, args.overrides), resume=args.resume)
        elif args.stage == "finetune":
            from mpp.config import load_config
            from pipelines import finetune

            finetune.run(load_config(args.config, args.overrides), ckpt=args.ckpt, resume=args.resume)
        elif args.stage == "fewshot":
            from pipelines import fewshot
            from pipelines.start import checkpoint_config

            fewshot.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "knn":
            from pipelines import knn
            from pipelines.start import checkpoint_config

            knn.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "probe":
            from pipelines import probe
            from pipelines.start import checkpoint_config

            probe.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "export":
            from pipelines import export
            from pipelines.start import checkpoint_config

            export.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])
        elif args.stage == "compare":
            from pipelines import compare, plan

            compare.run(plan.load_compare_config(args.config, args.overrides))
        elif args.stage == "prepare":
            from pipelines import prepare

            prepare.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size,
                        count=args.count, split=args.split, overwrite=args.overwrite, short_side=args.short_side,
                        quality=args.quality, classes=args.classes)
        from pipelines.tracking import end_process

        end_process()
    except UserError as err:
        return fail(one_line(err))
    except Preempted as stop:
        print(stop, file=sys.stderr)
    except Exception as err:
        if compile_failure(err):
            return fail(f"torch.compile could not compile the model ({compile_cause(err)}); set train.compile=false to "
                        f"train without it")
        if out_of_memory(err):  # outside training (building the model, evaluating): the model itself is too big
            return fail(f"out of memory ({one_line(err)}); shrink model.width, model.depth or model.image_size, or pick "
                        f"a smaller mpp.target / mpp.color_bits")
        raise
    return 0


def fail(message: str) -> int:
    """One line, from one process: under `accelerate launch` every rank meets the same error, and rank 0 says it.

    Another rank waits first: once rank 0 has printed and exited, the launcher stops the other ranks, so a rank
    still running after the wait met an error of its own (bad data in its shards) and says it, naming itself.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        time.sleep(RANK_ERROR_GRACE_S)
        message = f"(rank {rank}) {message}"
    print(f"error: {message}", file=sys.stderr)
    return 2


def compile_cause(err: Exception) -> str:
    """The line of a torch.compile error that says what went wrong (its message ends with advice for torch's own
    developers)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if "Error:" in line or "error:" in line), lines[0] if lines else type(err).__name__)


def one_line(err: Exception) -> str:
    """A UserError raised in a dataloader worker arrives wrapped with the worker's traceback: keep its message."""
    last = str(err).strip().splitlines()[-1]
    return last.split(": ", 1)[1] if last.startswith(("mpp.", "pipelines.")) and ": " in last else last
