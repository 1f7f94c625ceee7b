"""mpp's one command line: `mpp STAGE [--config FILE|NAME] [key=value ...]` (in a checkout: `python launch.py STAGE
...`; for several processes: `accelerate launch -m mpp.pipelines STAGE ...` installed, `accelerate launch launch.py
STAGE ...` in a checkout)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from mpp.config import ConfigError
from mpp.errors import UserError, command
from mpp.runtime import compile_failure, out_of_memory
from mpp.train import Preempted


def shipped_configs() -> Path:
    """The configs/ directory shipped with mpp: package data in an installed wheel (mpp/pipelines/configs), the
    top-level configs/ of a checkout (what pyproject.toml installs there)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


CONFIGS = shipped_configs()
CONFIG_KINDS = ("pretrain", "finetune", "compare")  # the sub-folders of configs/: the stages whose --config they are


def shipped(kind: str) -> list[str]:
    """The names of the configs shipped for `kind` (`default`, `supervised`, ...), what --config takes bare."""
    return sorted(path.stem for path in (CONFIGS / kind).glob("*.yaml"))


def config_file(kind: str, value: str) -> str:
    """--config as given: a YAML file, or the bare name of a config shipped for `kind` (`tiny` for compare's
    configs/compare/tiny.yaml), so the shipped configs are at hand without a checkout."""
    if Path(value).is_file():
        return value
    bare = CONFIGS / kind / f"{value.removesuffix('.yaml')}.yaml"
    if "/" not in value and bare.is_file():
        return str(bare)
    raise ConfigError(f"config file {value} does not exist; pass a YAML file or the name of a shipped {kind} config "
                      f"({', '.join(shipped(kind))}; `{command('--list-configs')}` shows where they are)")


class ListConfigs(argparse.Action):
    """--list-configs: print the shipped configs by stage, with their folder, and exit (as --version does)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="list the configs shipped with mpp, which --config takes by name, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print("configs shipped with mpp (--config takes a name or a path):")
        for kind in CONFIG_KINDS:
            print(f"  {kind}: {', '.join(shipped(kind))}  (in {CONFIGS / kind})")
        parser.exit()
RANK_ERROR_GRACE_S = 20


def class_ids(text: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5], for prepare --classes."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of class ids (e.g. 0,2,4)") from None


def add_run_choice(stage: argparse.ArgumentParser) -> None:
    """What a training stage does with a run already in its output_dir: continue it or start over."""
    choice = stage.add_mutually_exclusive_group()
    choice.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir that verifies")
    choice.add_argument("--overwrite", action="store_true",
                        help="start over in an output_dir that holds a run: delete its checkpoints/, tensorboard/, "
                             "config.yaml, results.json and model.safetensors (other files stay); refused while "
                             "another run works there")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list-configs", action=ListConfigs)
    stages = parser.add_subparsers(dest="stage", required=True)

    pretrain = stages.add_parser("pretrain", help="masked patch prediction pretraining")
    pretrain.add_argument("--config", default=str(CONFIGS / "pretrain" / "default.yaml"),
                          help="a YAML file, or the name of a shipped config (see --list-configs; default: %(default)s); "
                               "keys it leaves unset take the defaults in README.md")
    add_run_choice(pretrain)
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=1000")

    finetune = stages.add_parser("finetune", help="fine-tune a pretrained backbone (or a fresh one) with a linear head")
    finetune.add_argument("--ckpt", help="a run directory, a checkpoints/step_N directory or a .safetensors file "
                                         "from pretrain (either objective) or finetune; omit it to train from scratch")
    finetune.add_argument("--config", default=str(CONFIGS / "finetune" / "default.yaml"),
                          help="a YAML file, or the name of a shipped config (see --list-configs; default: %(default)s); "
                               "keys it leaves unset take the defaults in README.md")
    add_run_choice(finetune)
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
    compare.add_argument("--config", default=str(CONFIGS / "compare" / "tiny.yaml"), help="comparison YAML file, or the name of a shipped plan (see --list-configs; default: %(default)s)")
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
            from . import pretrain

            pretrain.run(load_config(config_file("pretrain", args.config), args.overrides), resume=args.resume,
                         overwrite=args.overwrite)
        elif args.stage == "finetune":
            from mpp.config import load_config
            from . import finetune

            finetune.run(load_config(config_file("finetune", args.config), args.overrides), ckpt=args.ckpt, resume=args.resume,
                         overwrite=args.overwrite)
        elif args.stage == "fewshot":
            from . import fewshot
            from .start import checkpoint_config

            fewshot.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "knn":
            from . import knn
            from .start import checkpoint_config

            knn.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt)
        elif args.stage == "export":
            from . import export
            from .start import checkpoint_config

            export.run(checkpoint_config(args.ckpt, args.config, args.overrides), ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])
        elif args.stage == "compare":
            plan = config_file("compare", args.config)
            from . import compare

            compare.run(compare.load_compare_config(plan, args.overrides))
        elif args.stage == "prepare":
            from . import prepare

            prepare.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size,
                        count=args.count, split=args.split, overwrite=args.overwrite, short_side=args.short_side,
                        quality=args.quality, classes=args.classes)
        from .tracking import end_process

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
