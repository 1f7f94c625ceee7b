"""mpp's commands, named once: COMMANDS holds each command's one-line help, its arguments, the run config it reads
and its entry. The command line (pipelines/cli.py), `mpp --help` and docs/reference.md's command list are built from
it, so adding a command is its entry function and one line here (docs/extending.md).

An entry is "module:function", imported when the command runs (so `--help` and every error in a command line load no
torch), or the function itself; it is called as entry(args, cfg) with the parsed arguments and the run config (None
for a command that reads none).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mpp.config import ConfigError
from mpp.errors import command as shown_command


def shipped_configs() -> Path:
    """The configs/ directory shipped with mpp: package data in an installed wheel (mpp/pipelines/configs), the
    top-level configs/ of a checkout (what pyproject.toml installs there)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


CONFIGS = shipped_configs()
CONFIG_KINDS = ("pretrain", "finetune", "compare")  # the sub-folders of configs/: the commands whose --config they are


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
                      f"({', '.join(shipped(kind))}; `{shown_command('--list-configs')}` shows where they are)")


class Argument:
    """One argument of a command, as argparse's add_argument takes it: Argument("--top-k", type=int, help=...)."""

    def __init__(self, *flags: str, **options):
        self.flags, self.options = flags, options


@dataclass(frozen=True)
class Command:
    """One command of `mpp`. `config` is the run config it reads: "training", its --config (default
    configs/NAME/default.yaml) with --resume and --overwrite; "checkpoint", the config of the run that wrote its
    --ckpt (or its --config); either brings --print-config, key=value overrides and every config key in its --help.
    None: it reads none (or, as compare, its own)."""

    help: str  # one line: `mpp --help`, the command's own --help and docs/reference.md
    entry: str | Callable  # "module:function" or the function, called as entry(args, cfg)
    arguments: tuple[Argument, ...] = ()  # its own, beside those its `config` brings
    config: Literal["training", "checkpoint"] | None = None
    example: str = "train.steps=1000"  # a key=value override, the example in --help
    overrides_among: str = ""  # a positional of its own whose key=value words are the overrides (predict's images)
    writes_beside_ckpt: bool = False  # its output_dir defaults to beside its --ckpt (the evaluations of a backbone)
    after_ctrl_c: str = ""  # what Ctrl-C leaves behind, said after "stopped by Ctrl-C"


RESUME_AUTO = "--resume=auto"  # what `--resume auto` becomes before parsing (cli.resume_auto_as_one_word)


def add_run_choice(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """What a training command does with a run already in its output_dir: continue it or start over."""
    choice = parser.add_mutually_exclusive_group()
    return [choice.add_argument("--resume", action="store_true",
                                help="continue the run in output_dir from its newest checkpoint that verifies (refused "
                                     "where output_dir holds no run); `--resume auto` continues it where output_dir "
                                     "holds a checkpoint and starts a fresh run where it holds none, so one command "
                                     "serves a cluster job's first submission and every requeue"),
            choice.add_argument(RESUME_AUTO, dest="resume", action="store_const", const="auto", default=False,
                                help=argparse.SUPPRESS),
            choice.add_argument("--overwrite", action="store_true",
                                help="start over in an output_dir that holds a run: delete what runs of mpp wrote there "
                                     "(its checkpoints/, tensorboard/, config.yaml, results.json, model.safetensors, as "
                                     "its run.json lists them; other files stay); refused while another run works there")]


def config_help(name: str, command: Command) -> str:
    if command.config == "checkpoint":
        return "YAML config (default: the config.yaml of the run that wrote --ckpt)"
    return (f"a YAML file, or the name of a shipped config (see --list-configs; default: {CONFIGS / name / 'default.yaml'}); "
            f"--resume without it starts from the run's saved config.yaml; keys it leaves unset take the defaults below")


def add_command(commands, name: str, command: Command) -> list[argparse.Action]:
    """Adds `command`'s parser to `commands` (argparse's subparsers): what its `config` brings, then its own
    arguments. Returns the arguments added, in order (docs/reference.md lists them)."""
    parser = commands.add_parser(name, help=command.help, description=command.help,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    added = []
    if command.config:
        parser.keys_in_help = True  # cli.Parser ends this --help with every config key
        added += [parser.add_argument("--print-config", action="store_true",
                                      help="print the config the stage would run with (the file, then the overrides) and exit"),
                  parser.add_argument("--config", help=config_help(name, command))]
    added += [parser.add_argument(*argument.flags, **argument.options) for argument in command.arguments]
    if command.config == "training":
        added += add_run_choice(parser)
    if command.config and not command.overrides_among:
        beside = ("; output_dir=DIR: where the result goes (default: the run directory --ckpt names, else NAME-eval "
                  "beside the checkpoint, file or folder it names)") if command.writes_beside_ckpt else ""
        added.append(parser.add_argument("overrides", nargs="*", metavar="key=value",
                                         help=f"dotted overrides, e.g. {command.example}{beside}"))
    return added


def class_ids(text: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5], for prepare --classes."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of class ids (e.g. 0,2,4)") from None


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


# ---------------------------------------------------------------- the built-in commands' entries

def pretrain(args, cfg) -> None:
    from .stages import pretrain as stage

    stage.run(cfg, resume=args.resume, overwrite=args.overwrite)


def finetune(args, cfg) -> None:
    from .stages import finetune as stage

    stage.run(cfg, ckpt=args.ckpt, resume=args.resume, overwrite=args.overwrite)


def export(args, cfg) -> None:
    from .stages import export as stage

    stage.run(cfg, ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])


def predict(args, cfg) -> None:
    from .stages import predict as stage

    stage.run(cfg, ckpt=args.ckpt, inputs=args.inputs, top_k=args.top_k, out=args.out, batch_size=args.batch_size)


def compare(args, cfg) -> None:
    from omegaconf import OmegaConf

    from .comparison import plan
    from .stages import compare as stage

    cc = plan.load_compare_config(config_file("compare", args.config), args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cc.model_dump(mode="json")), end="")
    elif args.dry_run:
        stage.check(cc)
    else:
        stage.run(cc)


def prepare(args, cfg) -> None:
    from .stages import prepare as stage

    stage.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size, count=args.count,
              split=args.split, overwrite=args.overwrite, short_side=args.short_side, quality=args.quality,
              classes=args.classes, class_names=args.class_names, workers=args.workers)


def score_checkpoint(args, cfg) -> None:
    """fewshot, knn, probe and inspect: the evaluation module of the command's name scores --ckpt."""
    import importlib

    module = {"inspect": "inspection"}.get(args.stage, args.stage)
    importlib.import_module(f"{__package__}.evaluations.{module}").run(cfg, ckpt=args.ckpt)


CKPT = "a run directory, a checkpoints/step_N directory or a .safetensors file"


def scored_checkpoint(more: str = "") -> Argument:
    return Argument("--ckpt", required=True, help=f"{CKPT}{more}")


PREPARE = (
    Argument("source", help="a folder of images (class = sub-folder), a tar of them or of per-class tars "
                            "(ImageNet's ILSVRC2012_img_train.tar), a Hugging Face dataset name or local path, an "
                            "MNIST-style *-images-idx3-ubyte file, CIFAR-10/100's python-version .tar.gz or folder, or "
                            "'synthetic'"),
    Argument("--out", required=True, help="directory for the shards and summary.json"),
    Argument("--samples-per-shard", type=int, default=1000),
    Argument("--split", default="train", help="dataset split for Hugging Face and CIFAR sources"),
    Argument("--count", type=int, default=20000, help="images to generate for 'synthetic'"),
    Argument("--size", type=int, default=64, help="side in pixels of generated 'synthetic' images"),
    Argument("--overwrite", action="store_true", help="replace shards already in --out"),
    Argument("--short-side", type=int, default=None,
             help="store images whose short side is longer downsized to this many pixels (JPEG at --quality): faster "
                  "decoding in training; keep it at least the training crop size"),
    Argument("--quality", type=int, default=90, help="JPEG quality of images downsized by --short-side"),
    Argument("--classes", type=class_ids, default=None,
             help="keep only these class ids, comma-separated, relabelled 0..k-1 in the order given (e.g. 1,3,5,7,9 "
                  "upstream and 0,2,4,6,8 downstream for a transfer split)"),
    Argument("--workers", type=int, default=None, metavar="N",
             help="processes encoding and writing shards, each a whole shard at a time (default: the cores this "
                  "process may use); the shards are the same whatever N is"),
    Argument("--class-names", type=class_name_list, default=None, metavar="NAMES",
             help="the names of the source's class ids 0, 1, ... (before --classes picks and relabels them): "
                  "comma-separated, or @FILE with one name per line; they replace the source's own. Lines that begin "
                  "with the source's own class names (ImageNet's LOC_synset_mapping.txt: 'n01440764 tench, ...') are "
                  "matched by that word instead, the ids following the file. IDX files store none: MNIST's and "
                  "Fashion-MNIST's are known when a folder or the file name says which (mnist, fashion-mnist)"),
)

# The command's name -> the command, in `mpp --help`'s order.
COMMANDS: dict[str, Command] = {
    "pretrain": Command("masked patch prediction pretraining", pretrain, config="training"),
    "finetune": Command("fine-tune a pretrained backbone (or a fresh one) with a linear head", finetune, (
        Argument("--ckpt", help=f"{CKPT} from pretrain (either objective) or finetune; omit it to train from scratch"),
    ), config="training", example="data.val_shards=DIR"),
    "fewshot": Command("few-shot linear evaluation of a backbone's frozen features", score_checkpoint, (scored_checkpoint(),),
                       config="checkpoint", example="data.val_shards=DIR fewshot.shots=[5]", writes_beside_ckpt=True),
    "knn": Command("k-nearest-neighbour evaluation of a backbone's frozen features", score_checkpoint, (scored_checkpoint(),),
                   config="checkpoint", example="data.val_shards=DIR knn.features=mean", writes_beside_ckpt=True),
    "inspect": Command("the paper's inspection views of a backbone (section 4.5): patch-embedding filters, position-"
                       "embedding similarity, mean attention distance, attention rollout, as PNGs and JSON", score_checkpoint,
                       (scored_checkpoint(" or a Hugging Face ViT directory (as `export --to hf` writes it)"),),
                       config="checkpoint", example="inspect.shards=DIR inspect.images=256", writes_beside_ckpt=True),
    "probe": Command("linear probe (SGD on frozen features, as MAE evaluates) of a backbone", score_checkpoint, (scored_checkpoint(),),
                     config="checkpoint", example="data.val_shards=DIR probe.epochs=30", writes_beside_ckpt=True),
    "export": Command("write a checkpoint as a Hugging Face transformers ViT, a hybrid as timm's, or any as an ONNX graph", export, (
        Argument("--ckpt", required=True, help=CKPT),
        Argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"),
                 help="hf DIR: a transformers ViT checkpoint in DIR; timm DIR: a hybrid (model.stem=resnet) in timm's "
                      "layout; onnx DIR: any ViT, plain or hybrid, as model.onnx for onnxruntime"),
    ), config="checkpoint", example="model.image_size=64"),
    "predict": Command("a fine-tuned classifier's top-k classes for images, prepared as evaluation prepares them", predict, (
        Argument("--ckpt", required=True, help="a fine-tuning run directory, a checkpoints/step_N directory or a .safetensors file"),
        Argument("--top-k", type=int, default=5, help="classes shown per image, most probable first (default: %(default)s)"),
        Argument("--out", help="write the predictions to this .csv or .json file instead of printing them"),
        Argument("--batch-size", type=int, default=64, help="images per forward pass (default: %(default)s)"),
        Argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER",
                 help="image files and folders of them (searched recursively); key=value among them are config overrides"),
    ), config="checkpoint", overrides_among="inputs"),
    "compare": Command("MPP vs supervised pretraining vs scratch: pretrain, fine-tune, few-shot, report", compare, (
        Argument("--config", default=str(CONFIGS / "compare" / "tiny.yaml"),
                 help="comparison YAML file, or the name of a shipped plan (see --list-configs; default: %(default)s)"),
        Argument("--print-config", action="store_true", help="print the plan as loaded (the file, then the overrides) and exit"),
        Argument("--dry-run", action="store_true", help="check the plan and its data, say the smallest gap its design can "
                                                        "resolve (and whether that meets target_gap), the most it can train and what is left of "
                                                        "that in output_dir, and exit without training"),
        Argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. pretrain.train.steps=2000"),
    ), after_ctrl_c="; the stages it finished are kept, and the same command goes on from them"),
    "prepare": Command("write WebDataset shards from images, a datasets corpus or 'synthetic'", prepare, PREPARE),
}
