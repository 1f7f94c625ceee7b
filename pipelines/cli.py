"""mpp's one command line: `mpp STAGE [--config FILE|NAME] [key=value ...]` (in a checkout: `python launch.py STAGE
...`; for several processes: `accelerate launch -m mpp.pipelines STAGE ...` installed, `accelerate launch launch.py
STAGE ...` in a checkout)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import shutil
import sys
import textwrap
import warnings
import time
from pathlib import Path

# Set before torch loads its OpenMP runtime, which reads it once: a thread that finishes its share of an operation
# then sleeps instead of spinning while the others catch up. On 2 cores shared with other jobs the main job took
# 3-20 s per step without it and 0.25-1.1 s with it (docs/benchmarks.md). A value the user exported wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from omegaconf import OmegaConf  # noqa: E402 (after the OpenMP setting above)

import mpp  # noqa: E402
from mpp.config import Config, ConfigError, config_reference, config_to_yaml, load_config  # noqa: E402
from mpp.errors import TERMINATED_STATUS, Terminated, UserError, command  # noqa: E402


def shipped_configs() -> Path:
    """The configs/ directory shipped with mpp: package data in an installed wheel (mpp/pipelines/configs), the
    top-level configs/ of a checkout (what pyproject.toml installs there)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


CONFIGS = shipped_configs()
CONFIG_KINDS = ("pretrain", "finetune", "compare")  # the sub-folders of configs/: the stages whose --config they are
RUN_CONFIG_STAGES = ("pretrain", "finetune", "fewshot", "knn", "probe", "inspect", "export", "predict")  # the stages that take a run config
# the stages that score --ckpt and write beside it, with their modules in pipelines/evaluations
EVALUATION_STAGES = {"fewshot": "fewshot", "knn": "knn", "probe": "probe", "inspect": "inspection"}
RANK_ERROR_GRACE_S = 20
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
AFTER_CTRL_C = {"compare": "; the stages it finished are kept, and the same command goes on from them"}  # what a stage keeps
OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+=")  # a dotted key=value, not a file name holding '='



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
    """The run config of a stage that takes one: --config (a training stage's default; for --resume without it, the
    saved config of the run in output_dir; the run that wrote --ckpt), then the key=value overrides. A stage that
    scores --ckpt writes beside it unless output_dir is among the overrides."""
    with_every_part()
    if args.stage in ("pretrain", "finetune"):
        default = str(CONFIGS / args.stage / "default.yaml")
        if args.resume and args.config is None:
            from .run.run_policy import resume_config

            return resume_config(default, args.overrides)
        path = config_file(args.stage, args.config or default)
        cfg = load_config(path, args.overrides)
        if args.stage == "finetune" and args.ckpt and not {"pos_embed", "stem_padding"} <= cfg.model.model_fields_set:
            from .run.start import with_saved_kinds  # reads the weights, once the config holds

            cfg = with_saved_kinds(cfg, path, args.ckpt, args.overrides)
        return cfg
    from .run.start import checkpoint_config

    cfg = checkpoint_config(args.ckpt, args.config, args.overrides)
    if args.stage in EVALUATION_STAGES and not any(o.startswith("output_dir=") for o in args.overrides):
        from .evaluations.frozen import beside_checkpoint

        cfg = cfg.model_copy(update={"output_dir": str(beside_checkpoint(args.ckpt))})
    return cfg


def with_every_part() -> None:
    """Import every registry, so the run config has every part's section (pipelines/parts.py). The registries load
    no torch (the parts they name load it when a run builds them), so a stage's --help, --print-config and every
    error about the command line answer in well under a second; here, not at the top, as `mpp --help` and
    `--list-configs` need no config at all."""
    from . import parts  # noqa: F401


def config_keys_help() -> str:
    """The --help of a stage that takes a run config: every key with its default and meaning, from the schema."""
    with_every_part()
    width = max(60, shutil.get_terminal_size().columns - 2)
    lines = textwrap.wrap("config keys, set in the --config file or as key=value (the defaults are the schema's; a "
                          "--config file sets its own, and --print-config shows what a run gets):", width)
    for key, default, meaning in config_reference():
        lines += [f"  {key} = {default}", *textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)]
    return "\n".join(lines)


def stage_parser(stages, name: str, summary: str) -> argparse.ArgumentParser:
    """A stage that takes a run config: its --help lists the config keys, and --print-config shows the config."""
    parser = stages.add_parser(name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.keys_in_help = True
    parser.add_argument("--print-config", action="store_true",
                        help="print the config the stage would run with (the file, then the overrides) and exit")
    return parser


def checkpoint_stage(stages, name: str, summary: str, example: str, more_checkpoints: str = "") -> None:
    """A stage that reads a saved backbone (`fewshot`, `knn`, `inspect`, `probe`): --ckpt, --config and overrides."""
    stage = stage_parser(stages, name, summary)
    stage.add_argument("--ckpt", required=True, help=f"a run directory, a checkpoints/step_N directory or a .safetensors file{more_checkpoints}")
    stage.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    stage.add_argument("overrides", nargs="*", metavar="key=value",
                       help=f"dotted overrides, e.g. {example}; output_dir=DIR: where the result goes (default: the run "
                            f"directory --ckpt names, else NAME-eval beside the checkpoint, file or folder it names)")


RESUME_AUTO = "--resume=auto"  # what `--resume auto` becomes before parsing (resume_auto_as_one_word)


def add_run_choice(stage: argparse.ArgumentParser) -> None:
    """What a training stage does with a run already in its output_dir: continue it or start over."""
    choice = stage.add_mutually_exclusive_group()
    choice.add_argument("--resume", action="store_true",
                        help="continue the run in output_dir from its newest checkpoint that verifies (refused where "
                             "output_dir holds no run); `--resume auto` continues it where output_dir holds a "
                             "checkpoint and starts a fresh run where it holds none, so one command serves a cluster "
                             "job's first submission and every requeue")
    choice.add_argument(RESUME_AUTO, dest="resume", action="store_const", const="auto", default=False, help=argparse.SUPPRESS)
    choice.add_argument("--overwrite", action="store_true",
                        help="start over in an output_dir that holds a run: delete what runs of mpp wrote there "
                             "(its checkpoints/, tensorboard/, config.yaml, results.json, model.safetensors, as its "
                             "run.json lists them; other files stay); refused while another run works there")


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


def resume_auto_as_one_word(argv: list[str]) -> list[str]:
    """`--resume auto` as the one word `--resume=auto`: parsed apart, `auto` would be taken for an override, and a
    --resume that took an optional value would swallow the override after it (`--resume train.steps=9`)."""
    words = []
    for word in argv:
        if word == "auto" and words[-1:] == ["--resume"]:
            words[-1] = RESUME_AUTO
        else:
            words.append(word)
    return words


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" names the config key a `--name value` meant."""

    argv: list[str] = []  # the command line parsed, for the hint
    keys_in_help = False  # a stage's parser whose --help ends with every config key (built when --help asks)

    def format_help(self) -> str:
        if self.keys_in_help and self.epilog is None:
            self.epilog = config_keys_help()
        return super().format_help()

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            message += flag_hint(message.removeprefix("unrecognized arguments:").split(), self.argv)
        super().error(message.replace(RESUME_AUTO, "--resume auto"))  # as the user wrote it, not as parsed


def flag_hint(unknown: list[str], argv: list[str]) -> str:
    """For the first `--name value` (or `--name=value`) among `unknown` (what follows it in `argv` is its value): the
    config keys it may mean, written as the key=value override they take; '' if none is close."""
    with_every_part()
    keys = [key for key, _, _ in config_reference()]
    for token in unknown:
        if not token.startswith("--"):
            continue
        name, _, value = token[2:].partition("=")
        after = argv[argv.index(token) + 1:] if token in argv else []
        value = value or (after[0] if after and not after[0].startswith("-") and "=" not in after[0] else "VALUE")
        name = name.replace("-", "_")
        matches = [key for key in keys if key.rsplit(".", 1)[-1] == name] or difflib.get_close_matches(name, keys, n=2)
        if matches:
            return f"; config keys are set as key=value, not as flags: {' or '.join(f'{key}={value}' for key in matches)}"
    return ""


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv = resume_auto_as_one_word(argv)
    parser = Parser(description=__doc__)
    Parser.argv = argv
    parser.add_argument("--list-configs", action=ListConfigs)
    stages = parser.add_subparsers(dest="stage", required=True)

    pretrain = stage_parser(stages, "pretrain", "masked patch prediction pretraining")
    pretrain.add_argument("--config", help=f"a YAML file, or the name of a shipped config (see --list-configs; default: "
                                           f"{CONFIGS / 'pretrain' / 'default.yaml'}); --resume without it starts from "
                                           f"the run's saved config.yaml; keys it leaves unset take the defaults below")
    add_run_choice(pretrain)
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=1000")

    finetune = stage_parser(stages, "finetune", "fine-tune a pretrained backbone (or a fresh one) with a linear head")
    finetune.add_argument("--ckpt", help="a run directory, a checkpoints/step_N directory or a .safetensors file "
                                         "from pretrain (either objective) or finetune; omit it to train from scratch")
    finetune.add_argument("--config", help=f"a YAML file, or the name of a shipped config (see --list-configs; default: "
                                           f"{CONFIGS / 'finetune' / 'default.yaml'}); --resume without it starts from "
                                           f"the run's saved config.yaml; keys it leaves unset take the defaults below")
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

    export = stage_parser(stages, "export", "write a checkpoint as a Hugging Face transformers ViT, or a hybrid as timm's")
    export.add_argument("--ckpt", required=True, help="a run directory, a checkpoints/step_N directory or a .safetensors file")
    export.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"), help="hf DIR: a transformers ViT checkpoint in DIR; timm DIR: a hybrid (model.stem=resnet) in timm's layout")
    export.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model.image_size=64")

    predict = stage_parser(stages, "predict", "a fine-tuned classifier's top-k classes for images, prepared as evaluation prepares them")
    predict.add_argument("--ckpt", required=True, help="a fine-tuning run directory, a checkpoints/step_N directory or a .safetensors file")
    predict.add_argument("--config", help="YAML config (default: the config.yaml of the run that wrote --ckpt)")
    predict.add_argument("--top-k", type=int, default=5, help="classes shown per image, most probable first (default: %(default)s)")
    predict.add_argument("--out", help="write the predictions to this .csv or .json file instead of printing them")
    predict.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default: %(default)s)")
    predict.add_argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER",
                         help="image files and folders of them (searched recursively); key=value among them are config overrides")

    compare = stages.add_parser("compare", help="MPP vs supervised pretraining vs scratch: pretrain, fine-tune, few-shot, report")
    compare.add_argument("--config", default=str(CONFIGS / "compare" / "tiny.yaml"), help="comparison YAML file, or the name of a shipped plan (see --list-configs; default: %(default)s)")
    compare.add_argument("--print-config", action="store_true", help="print the plan as loaded (the file, then the overrides) and exit")
    compare.add_argument("--dry-run", action="store_true", help="check the plan and its data, say the smallest gap its design can resolve (and whether that meets target_gap), and exit without training")
    compare.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. pretrain.train.steps=2000")

    add_prepare(stages)
    return with_overrides_anywhere(parser, argv)


def add_prepare(stages) -> None:
    """`prepare`'s arguments: the source, where the shards go, and how they are written."""
    prepare = stages.add_parser("prepare", help="write WebDataset shards from images, a datasets corpus or 'synthetic'")
    prepare.add_argument("source", help="a folder of images (class = sub-folder), a tar of them or of per-class tars "
                                        "(ImageNet's ILSVRC2012_img_train.tar), a Hugging Face dataset name or local path, "
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
    prepare.add_argument("--workers", type=int, default=None, metavar="N",
                         help="processes encoding and writing shards, each a whole shard at a time (default: the cores "
                              "this process may use); the shards are the same whatever N is")
    prepare.add_argument("--class-names", type=class_name_list, default=None, metavar="NAMES",
                         help="the names of the source's class ids 0, 1, ... (before --classes picks and relabels "
                              "them): comma-separated, or @FILE with one name per line; they replace the source's own. "
                              "Lines that begin with the source's own class names (ImageNet's LOC_synset_mapping.txt: "
                              "'n01440764 tench, ...') are matched by that word instead, the ids following the file. "
                              "IDX files store none: MNIST's and Fashion-MNIST's are known when a folder or the file "
                              "name says which (mnist, fashion-mnist)")


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
    warnings.formatwarning = plain_warning  # data loader workers, forked, inherit it
    cfg = None  # a run config, for the stages that take one
    if args.stage == "predict":  # its images and its overrides share the positional arguments
        args.overrides = [item for item in args.inputs if OVERRIDE.match(item)]
        args.inputs = [item for item in args.inputs if not OVERRIDE.match(item)]
    if args.stage in RUN_CONFIG_STAGES:
        try:  # without torch, but where it reads a checkpoint (--resume, --ckpt)
            cfg = run_config(args)
        except UserError as err:
            return fail(one_line(err))
        if args.print_config:
            print(printed_config(args.stage, cfg), end="")
            return 0
    # Here, once the command line and its config hold: they load torch.
    from mpp.training.loop import Preempted
    from mpp.training.preemption import EXIT_STATUS as STOPPED
    from .run.start import RanksDisagree
    from .run.tracking import end_process

    try:
        run_stage(args, cfg)
        end_process()
    except UserError as err:
        if isinstance(err, RanksDisagree):  # every rank raised it at one point, after the same gather: close the process
            end_process()  # group here, not in the interpreter's exit, where gloo aborted once
        return fail(one_line(err), said_by_rank_0=isinstance(err, RanksDisagree))
    except KeyboardInterrupt:  # outside a training loop, which stops at a step with a checkpoint (Preempted)
        print(f"stopped by Ctrl-C{AFTER_CTRL_C.get(args.stage, '')}", file=sys.stderr)
        return INTERRUPTED
    except Preempted as stop:  # saved; a later SIGTERM, SIGUSR1 or SIGUSR2 no longer stops it (mpp.training.preemption.StopOnSignal)
        print(stop, file=sys.stderr)
        return STOPPED
    except Terminated as stop:  # SIGTERM to work that is not resumable (prepare): what it cleaned up
        print(stop, file=sys.stderr)
        return TERMINATED_STATUS
    except Exception as err:
        if lost := peer_lost(err):
            print(f"(rank {os.environ.get('RANK', '0')}) stopped: another process of this run has ended ({lost}); its "
                  f"own message above, or the launcher's report, says why", file=sys.stderr)
            return 1
        return explained_failure(err, args, cfg)
    return 0


def run_stage(args: argparse.Namespace, cfg: Config | None) -> None:
    """Runs the parsed stage. Each stage's module is imported here, when it runs."""
    if args.stage == "pretrain":
        from .stages import pretrain

        pretrain.run(cfg, resume=args.resume, overwrite=args.overwrite)
    elif args.stage == "finetune":
        from .stages import finetune

        finetune.run(cfg, ckpt=args.ckpt, resume=args.resume, overwrite=args.overwrite)
    elif args.stage in EVALUATION_STAGES:
        evaluation = importlib.import_module(f"{__package__}.evaluations.{EVALUATION_STAGES[args.stage]}")
        evaluation.run(cfg, ckpt=args.ckpt)
    elif args.stage == "export":
        from .stages import export

        export.run(cfg, ckpt=args.ckpt, to=args.to[0], out_dir=args.to[1])
    elif args.stage == "predict":
        from .stages import predict

        predict.run(cfg, ckpt=args.ckpt, inputs=args.inputs, top_k=args.top_k, out=args.out, batch_size=args.batch_size)
    elif args.stage == "compare":
        from .comparison import plan
        from .stages import compare

        cc = plan.load_compare_config(config_file("compare", args.config), args.overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cc.model_dump(mode="json")), end="")
            return
        if args.dry_run:
            compare.check(cc)
            return
        compare.run(cc)
    elif args.stage == "prepare":
        from .stages import prepare

        prepare.run(args.source, args.out, samples_per_shard=args.samples_per_shard, size=args.size,
                    count=args.count, split=args.split, overwrite=args.overwrite, short_side=args.short_side,
                    quality=args.quality, classes=args.classes, class_names=args.class_names, workers=args.workers)


def explained_failure(err: Exception, args: argparse.Namespace, cfg: Config | None) -> int:
    """A failure a user can fix without a traceback (compile, memory) said in one line; anything else raised on."""
    from mpp.model.registry import OBJECTIVES
    from mpp.training.runtime import compile_failure, model_too_big, out_of_memory

    if compile_failure(err):
        return fail(f"torch.compile could not compile the model ({compile_cause(err)}); set train.compile=false to "
                    f"train without it")
    if out_of_memory(err):  # outside training (building the model, evaluating): the model itself is too big
        pretraining = args.stage == "pretrain" and cfg is not None
        classifier = args.stage == "finetune" or (pretraining and OBJECTIVES[cfg.objective].reads_labels)
        return fail(model_too_big(err, cfg, classifier=classifier, mpp_head=pretraining and cfg.objective == "mpp"))
    raise err


def printed_config(stage: str, cfg: Config) -> str:
    """--print-config's YAML: fine-tuning trains a classifier whatever `objective` says (the pretraining objective),
    so its config is shown without that key."""
    if stage != "finetune":
        return config_to_yaml(cfg)
    return OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in cfg.model_dump(mode="json").items() if k != "objective"}))


OWN_CODE = (str(Path(mpp.__file__).resolve().parent), str(Path(__file__).resolve().parent))  # mpp/ and pipelines/
python_warning = warnings.formatwarning


def plain_warning(message, category, filename, lineno, line=None) -> str:
    """mpp's own warnings as a user reads them, one line each ("warning: ..."), without the line of mpp's code that
    raised them; other libraries' as Python prints them."""
    if str(Path(filename).resolve()).startswith(OWN_CODE):
        return f"warning: {message}\n"
    return python_warning(message, category, filename, lineno, line)


def fail(message: str, said_by_rank_0: bool = False) -> int:
    """One line, from one process: under `accelerate launch` every rank meets the same error, and rank 0 says it.

    Another rank waits first: once rank 0 has printed and exited, the launcher stops the other ranks, so a rank
    still running after the wait met an error of its own (bad data in its shards) and says it, naming itself. An
    error every rank is known to have met together (`said_by_rank_0`: found over the process group) is left to
    rank 0 at once, and every rank exits 2.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank and said_by_rank_0:
        return 2
    if rank:
        time.sleep(RANK_ERROR_GRACE_S)
        message = f"(rank {rank}) {message}"
    print(f"error: {message}", file=sys.stderr)
    return 2


# What a collective raises in a rank whose peer has gone (gloo's words; a socket's errors for the rendezvous store).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(err: BaseException) -> str | None:
    """What a rank of several failed of when another rank ended (its error, printed by it, or its crash), to say in
    one line instead of a traceback of torch.distributed's code; None for any other failure."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    while err is not None:
        if isinstance(err, ConnectionError):
            return f"{type(err).__name__}: {err}"
        if isinstance(err, RuntimeError):
            lost = next((words for words in PEER_LOST if words in str(err)), None)
            if lost:
                return lost
        err = err.__cause__ or err.__context__
    return None


def compile_cause(err: Exception) -> str:
    """The line of a torch.compile error that says what went wrong (its message ends with advice for torch's own
    developers)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if "Error:" in line or "error:" in line), lines[0] if lines else type(err).__name__)


def one_line(err: Exception) -> str:
    """A UserError raised in a dataloader worker arrives wrapped with the worker's traceback: keep its message."""
    last = str(err).strip().splitlines()[-1]
    return last.split(": ", 1)[1] if last.startswith(("mpp.", "pipelines.")) and ": " in last else last
