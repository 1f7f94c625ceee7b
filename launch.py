"""mpp's one command line: `accelerate launch launch.py STAGE [--config FILE] [key=value ...]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpp.errors import UserError
from mpp.train import Preempted

CONFIGS = Path(__file__).resolve().parent / "configs"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__)
    stages = parser.add_subparsers(dest="stage", required=True)

    pretrain = stages.add_parser("pretrain", help="masked patch prediction pretraining")
    pretrain.add_argument("--config", default=str(CONFIGS / "pretrain" / "default.yaml"),
                          help="YAML config (default: %(default)s); keys it leaves unset take the defaults in README.md")
    pretrain.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in output_dir")
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=1000")

    finetune = stages.add_parser("finetune", help="fine-tune a pretrained backbone (or a fresh one) with a linear head")
    finetune.add_argument("--ckpt", help="a run directory, a checkpoints/step_N directory or a .safetensors file "
                                         "from pretrain (either objective) or finetune; omit it to train from scratch")
    finetune.add_argument("--config", default=str(CONFIGS / "finetune" / "default.yaml"),
                          help="YAML config (default: %(default)s); keys it leaves unset take the defaults in README.md")
    finetune.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in output_dir")
    finetune.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR")

    fewshot = stages.add_parser("fewshot", help="few-shot linear evaluation of a backbone's frozen features")
    fewshot.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    fewshot.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    fewshot.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR fewshot.shots=[5]")

    knn = stages.add_parser("knn", help="k-nearest-neighbour evaluation of a backbone's frozen features")
    knn.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    knn.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    knn.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR knn.features=mean")

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
                                        "an MNIST-style *-images-idx3-ubyte file, or 'synthetic'")
    prepare.add_argument("--out", required=True, help="directory for the shards and summary.json")
    prepare.add_argument("--samples-per-shard", type=int, default=1000)
    prepare.add_argument("--split", default="train", help="dataset split for Hugging Face sources")
    prepare.add_argument("--count", type=int, default=20000, help="images to generate for 'synthetic'")
    prepare.add_argument("--size", type=int, default=64, help="side in pixels of generated 'synthetic' images")
    prepare.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    prepare.add_argument("--short-side", type=int, default=None,
                         help="store images whose short side is longer downsized to this many pixels (JPEG at --quality): "
                              "faster decoding in training; keep it at least the training crop size")
    prepare.add_argument("--quality", type=int, default=90, help="JPEG quality of images downsized by --short-side")
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
            from pipelines.common import checkpoint_config

            fewshot.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "knn":
            from pipelines import knn
            from pipelines.common import checkpoint_config

            knn.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "export":
            from pipelines import export
            from pipelines.common import checkpoint_config

            export.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])
        elif args.stage == "compare":
            from pipelines import compare

            compare.run(compare.load_compare_config(args.config, args.overrides))
        elif args.stage == "prepare":
            from pipelines import prepare

            prepare.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size,
                        count=args.count, split=args.split, overwrite=args.overwrite, short_side=args.short_side,
                        quality=args.quality)
    except UserError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except Preempted as stop:
        print(stop, file=sys.stderr)
    return 0


def one_line(err: Exception) -> str:
    """A UserError raised in a dataloader worker arrives wrapped with the worker's traceback: keep its message."""
    last = str(err).strip().splitlines()[-1]
    return last.split(": ", 1)[1] if last.startswith(("mpp.", "pipelines.")) and ": " in last else last


if __name__ == "__main__":
    sys.exit(main())
