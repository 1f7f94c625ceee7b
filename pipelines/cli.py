"""mpp's one command line: `mpp STAGE [--config FILE|NAME] [key=value ...]` (in a checkout: `python launch.py STAGE
...`; for several processes: `accelerate launch -m mpp.pipelines STAGE ...` installed, `accelerate launch launch.py
STAGE ...` in a checkout)."""

from __future__ import annotations

import argparse
import difflib
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
from mpp.config import Config, config_reference, config_to_yaml, load_config  # noqa: E402
from mpp.errors import TERMINATED_STATUS, Terminated, UserError  # noqa: E402
from mpp.model.registry import implementation  # noqa: E402
from .commands import (CONFIG_KINDS, CONFIGS, COMMANDS, RESUME_AUTO, add_command, config_file,  # noqa: E402
                       shipped)


RANK_ERROR_GRACE_S = 20
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+=")  # a dotted key=value, not a file name holding '='


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


def run_config(args: argparse.Namespace) -> Config:
    """The run config of a stage that takes one: --config (a training stage's default; for --resume without it, the
    saved config of the run in output_dir; the run that wrote --ckpt), then the key=value overrides. A stage that
    scores --ckpt writes beside it unless output_dir is among the overrides."""
    with_every_part()
    command = COMMANDS[args.stage]
    if command.config == "training":
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
    if command.writes_beside_ckpt and not any(o.startswith("output_dir=") for o in args.overrides):
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
    commands = parser.add_subparsers(dest="stage", required=True)
    for name, command in COMMANDS.items():
        add_command(commands, name, command)
    args = with_overrides_anywhere(parser, argv)
    if among := COMMANDS[args.stage].overrides_among:  # its own words and its overrides share a positional
        words = getattr(args, among)
        args.overrides = [word for word in words if OVERRIDE.match(word)]
        setattr(args, among, [word for word in words if not OVERRIDE.match(word)])
    return args


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
    if COMMANDS[args.stage].config:
        try:  # without torch, but where it reads a checkpoint (--resume, --ckpt)
            cfg = run_config(args)
        except UserError as err:
            return fail(one_line(err))
        if args.print_config:
            print(printed_config(args.stage, cfg), end="")
            return 0
    # Here, once the command line and its config hold: they load torch.
    from mpp.training.preemption import EXIT_STATUS as STOPPED, Preempted
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
        print(f"stopped by Ctrl-C{COMMANDS[args.stage].after_ctrl_c}", file=sys.stderr)
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
    """Runs the parsed command's entry, its module imported now."""
    implementation(COMMANDS[args.stage].entry)(args, cfg)


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
