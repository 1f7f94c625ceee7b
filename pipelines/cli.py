"""mpp's one command line: `mpp STAGE [--config FILE|NAME] [key=value ...]` (in a checkout: `python launch.py STAGE
...`; for several processes: `accelerate launch -m mpp.pipelines STAGE ...` installed, `accelerate launch launch.py
STAGE ...` in a checkout)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

# Set before torch loads its OpenMP runtime, which reads it once: a thread that finishes its share of an operation
# then sleeps instead of spinning while the others catch up. On 2 cores shared with other jobs the main job took
# 3-20 s per step without it and 0.25-1.1 s with it (docs/benchmarks.md). A value the user exported wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from omegaconf import OmegaConf  # noqa: E402 (after the OpenMP setting above)

from mpp.config import Config, ConfigError, config_reference, config_to_yaml, load_config  # noqa: E402
from mpp.errors import UserError, command  # noqa: E402
from mpp.objectives import OBJECTIVES  # noqa: E402
from mpp.runtime import compile_failure, model_too_big, out_of_memory  # noqa: E402
from mpp.train import Preempted  # noqa: E402


def shipped_configs() -> Path:
    """The configs/ directory shipped with mpp: package data in an installed wheel (mpp/pipelines/configs), the
    top-level configs/ of a checkout (what pyproject.toml installs there)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


CONFIGS = shipped_configs()
CONFIG_KINDS = ("pretrain", "finetune", "compare")  # the sub-folders of configs/: the stages whose --config they are
RUN_CONFIG_STAGES = ("pretrain", "finetune", "fewshot", "knn", "probe", "inspect", "export")  # the stages that take a run config
RANK_ERROR_GRACE_S = 20


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


def class_ids(text: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5], for prepare --classes."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of class ids (e.g. 0,2,4)") from None


def run_config(args: argparse.Namespace) -> Config:
    """The run config of a stage that takes one: --config (a training stage's default, or the run that wrote --ckpt),
    then the key=value overrides."""
    if args.stage in ("pretrain", "finetune"):
        return load_config(config_file(args.stage, args.config), args.overrides)
    from .start import checkpoint_config

    return checkpoint_config(args.ckpt, args.config, args.overrides)


def config_keys_help() -> str:
    """The --help of a stage that takes a run config: every key with its default and meaning, from the schema."""
    width = max(60, shutil.get_terminal_size().columns - 2)
    lines = textwrap.wrap("config keys, set in the --config file or as key=value (the defaults are the schema's; a "
                          "--config file sets its own, and --print-config shows what a run gets):", width)
    for key, default, meaning in config_reference():
        lines += [f"  {key} = {default}", *textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)]
    return "\n".join(lines)


def stage_parser(stages, name: str, summary: str) -> argparse.ArgumentParser:
    """A stage that takes a run config: its --help lists the config keys, and --print-config shows the config."""
    parser = stages.add_parser(name, help=summary, description=summary, epilog=config_keys_help(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-config", action="store_true",
                        help="print the config the stage would run with (the file, then the overrides) and exit")
    return parser


def checkpoint_stage(stages, name: str, summary: str, example: str, more_checkpoints: str = "") -> None:
    """A stage that reads a saved backbone (`fewshot`, `knn`, `inspect`, `probe`): --ckpt, --config and overrides."""
    stage = stage_parser(stages, name, summary)
    stage.add_argument("--ckpt", required=True, help=f"a run directory, a checkpoints/step_N directory or a .safetensors file{more_checkpoints}")
    stage.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    stage.add_argument("overrides", nargs="*", metavar="key=value", help=f"dotted overrides, e.g. {example}")


def add_run_choice(stage: argparse.ArgumentParser) -> None:
    """What a training stage does with a run already in its output_dir: continue it or start over."""
    choice = stage.add_mutually_exclusive_group()
    choice.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir that verifies")
    choice.add_argument("--overwrite", action="store_true",
                        help="start over in an output_dir that holds a run: delete its checkpoints/, tensorboard/, "
                             "config.yaml, results.json and model.safetensors (other files stay); refused while "
                             "another run works there")


def class_name_list(text: str) -> list[str]:
    """'cat,dog' -> ['cat', 'dog']; '@names.txt' -> the file's lines (one name each, blank lines skipped), for
    prepare --class-names."""
    if not text.startswith("@"):
        return [name.strip() for name in text.split(",")]
    try:
        lines = Path(text[1:]).read_text().splitlines()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read the class names in {text[1:]} ({exc.strerror})") from None
    return [line.strip() for line in lines if line.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list-configs", action=ListConfigs)
    stages = parser.add_subparsers(dest="stage", required=True)

    pretrain = stage_parser(stages, "pretrain", "masked patch prediction pretraining")
    pretrain.add_argument("--config", default=str(CONFIGS / "pretrain" / "default.yaml"),
                          help="a YAML file, or the name of a shipped config (see --list-configs; default: %(default)s); "
                               "keys it leaves unset take the defaults below")
    add_run_choice(pretrain)
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=1000")

    finetune = stage_parser(stages, "finetune", "fine-tune a pretrained backbone (or a fresh one) with a linear head")
    finetune.add_argument("--ckpt", help="a run directory, a checkpoints/step_N directory or a .safetensors file "
                                         "from pretrain (either objective) or finetune; omit it to train from scratch")
    finetune.add_argument("--config", default=str(CONFIGS / "finetune" / "default.yaml"),
                          help="a YAML file, or the name of a shipped config (see --list-configs; default: %(default)s); "
                               "keys it leaves unset take the defaults below")
    add_run_choice(finetune)
    finetune.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_shards=DIR")

    checkpoint_stage(stages, "fewshot", "few-shot linear evaluation of a backbone's frozen features",
                     "data.val_shards=DIR fewshot.shots=[5]")
    checkpoint_stage(stages, "knn", "k-nearest-neighbour evaluation of a backbone's frozen features",
                     "data.val_shards=DIR knn.features=mean")
    checkpoint_stage(stages, "inspect", "the paper's inspection views of a backbone (section 4.5): patch-embedding "
                     "filters, position-embedding similarity, mean attention distance, attention rollout, as PNGs and JSON",
                     "inspect.shards=DIR inspect.images=256", " or a Hugging Face ViT directory (as `export --to hf` writes it)")
    checkpoint_stage(stages, "probe", "linear probe (SGD on frozen features, as MAE evaluates) of a backbone",
                     "data.val_shards=DIR probe.epochs=30")

    export = stage_parser(stages, "export", "write a checkpoint as a Hugging Face transformers ViT")
    export.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    export.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"), help="hf DIR: a transformers ViT checkpoint in DIR")
    export.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model.image_size=64")

    compare = stages.add_parser("compare", help="MPP vs supervised pretraining vs scratch: pretrain, fine-tune, few-shot, report")
    compare.add_argument("--config", default=str(CONFIGS / "compare" / "tiny.yaml"), help="comparison YAML file, or the name of a shipped plan (see --list-configs; default: %(default)s)")
    compare.add_argument("--print-config", action="store_true", help="print the plan as loaded (the file, then the overrides) and exit")
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
    prepare.add_argument("--class-names", type=class_name_list, default=None, metavar="NAMES",
                         help="the names of the source's class ids 0, 1, ... (before --classes picks and relabels "
                              "them): comma-separated, or @FILE with one name per line; they replace the source's own. "
                              "IDX files store none: MNIST's and Fashion-MNIST's are known when a folder or the file "
                              "name says which (mnist, fashion-mnist)")
    return with_overrides_anywhere(parser, argv)


def with_overrides_anywhere(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed line, with key=value overrides taken wherever they stand: argparse fills the `overrides` positional
    only from the words before the first option that follows them, and calls the rest (`--resume train.steps=30`,
    `--ckpt RUN data.shards=DIR`) unrecognized. Words after a flag keep their order, so a later override still wins."""
    args, rest = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        args.overrides += [word for word in rest if not word.startswith("-")]
        rest = [word for word in rest if word.startswith("-")]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = None  # a run config, for the stages that take one
    try:
        if args.stage in RUN_CONFIG_STAGES:
            cfg = run_config(args)
            if args.print_config:
                print(config_to_yaml(cfg), end="")
                return 0
        if args.stage == "pretrain":
            from . import pretrain

            pretrain.run(cfg, resume=args.resume, overwrite=args.overwrite)
        elif args.stage == "finetune":
            from . import finetune

            finetune.run(cfg, ckpt=args.ckpt, resume=args.resume, overwrite=args.overwrite)
        elif args.stage == "fewshot":
            from . import fewshot

            fewshot.run(cfg, ckpt=args.ckpt)
        elif args.stage == "knn":
            from . import knn

            knn.run(cfg, ckpt=args.ckpt)
        elif args.stage == "probe":
            from . import probe

            probe.run(cfg, ckpt=args.ckpt)
        elif args.stage == "inspect":
            from . import inspection

            inspection.run(cfg, ckpt=args.ckpt)
        elif args.stage == "export":
            from . import export

            export.run(cfg, ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])
        elif args.stage == "compare":
            from . import compare, plan

            cc = plan.load_compare_config(config_file("compare", args.config), args.overrides)
            if args.print_config:
                print(OmegaConf.to_yaml(cc.model_dump(mode="json")), end="")
                return 0
            compare.run(cc)
        elif args.stage == "prepare":
            from . import prepare

            prepare.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size,
                        count=args.count, split=args.split, overwrite=args.overwrite, short_side=args.short_side,
                        quality=args.quality, classes=args.classes, class_names=args.class_names)
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
            pretraining = args.stage == "pretrain" and cfg is not None
            classifier = args.stage == "finetune" or (pretraining and OBJECTIVES[cfg.objective].reads_labels)
            return fail(model_too_big(err, cfg, classifier=classifier, mpp_head=pretraining and cfg.objective == "mpp"))
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
