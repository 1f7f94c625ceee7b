"""What a stage may do with its output_dir: write there, continue a run there, change which settings on a resume.

A run holds an exclusive lock on its output_dir and writes there only over what runs of mpp wrote (mpp.rundir's
run.json), never over the weights it starts from; a resume starts from the run's saved config, may change only the
config fields marked resumable (mpp.config.RESUMABLE), each applied from the resumed step on, checked against the
config its checkpoint carries (not a config.yaml edited since), and a fine-tuning resumes only from the weights it
started from (its StartingPoint).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from mpp.model.checkpoint import resolve_checkpoint
from mpp.config import Config, as_saved, dotted, resumable_keys, load_config, load_saved_config, read_layers
from mpp.errors import UserError
from mpp.training.resume import resumable_checkpoint
from mpp.rundir import (RunDir, CONFIG, LOCK, RUN_OUTPUTS, STARTED_FROM, complete_checkpoints, remove_run_outputs, sha256,
                        too_long, PRETRAIN_OUTPUTS, checkpoint_config, not_written_by_a_run, read_run_manifest, record_run)
from mpp.training.runtime import process_state
from .invocation import resume_command, command_line


@dataclass(frozen=True)
class StartingPoint:
    """Where a fine-tuning's weights start: `--ckpt` as given and the sha256 of the weights file it names, or a fresh
    backbone (all None).

    The file's content is the starting point, not its path: a checkpoint moved or named another way is the same start,
    and a run directory whose weights were rewritten since (a pretraining resumed for longer) is another one.
    """

    ckpt: str | None = None
    weights: str | None = None  # the .safetensors file `ckpt` resolves to, absolute
    sha256: str | None = None

    @classmethod
    def of(cls, ckpt: str | None) -> StartingPoint:
        if ckpt is None:
            return cls()
        weights = resolve_checkpoint(ckpt).absolute()
        return cls(str(ckpt), str(weights), sha256(weights))

    def __str__(self) -> str:
        return "a fresh backbone (no --ckpt)" if self.ckpt is None else self.ckpt

    def record(self, run_dir: RunDir) -> None:
        """Write it into the run's directory as the run starts (under the run's lock, before its first checkpoint)."""
        run_dir.started_from.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")


def check_starting_point(out: Path, start: StartingPoint) -> None:
    """Refuse a resume of the fine-tuning in `out` from other weights than it started from: its checkpoint holds
    weights that came from the first, and results.json would name the second."""
    recorded_file = out / STARTED_FROM
    if not recorded_file.is_file():
        return  # a run of an mpp that did not record where it started: nothing to hold the resume to
    try:
        recorded = StartingPoint(**json.loads(recorded_file.read_text()))
    except (ValueError, TypeError):
        raise UserError(f"{recorded_file} cannot be read, so where the fine-tuning in output_dir {out} started is not "
                        f"known; set output_dir to a new directory to fine-tune afresh") from None
    if recorded.sha256 == start.sha256:
        return
    if recorded.weights is not None and recorded.weights == start.weights:
        raise UserError(f"output_dir {out} holds a fine-tuning that started from {recorded}, whose weights have changed "
                        f"since ({start.weights} no longer has the sha256 recorded in {recorded_file}); a resume continues "
                        f"from the earlier weights, so set output_dir to a new directory to fine-tune from the new ones")
    fix = "drop --ckpt" if recorded.ckpt is None else f"pass --ckpt {recorded.ckpt}"
    raise UserError(f"output_dir {out} holds a fine-tuning that started from {recorded}, and this resume names {start}; "
                    f"its checkpoints continue the weights it started from, so {fix} to resume it, or set output_dir to "
                    f"a new directory to fine-tune from {start}")


def continues_a_run(output_dir: str | Path, resume: bool | Literal["auto"]) -> bool:
    """Whether a training stage given --resume (True), --resume auto or neither (False) continues the run in output_dir.

    `--resume auto` continues where output_dir holds a checkpoint and starts afresh where it holds none (nothing,
    other files, or a run stopped before its first checkpoint), so one command serves a cluster job's first
    submission and every requeue. A plain --resume is refused where output_dir holds nothing a run writes: a mistyped
    output_dir would otherwise start a run at step 0 under a command that says it continues one.
    """
    out = Path(output_dir)
    if resume == "auto":
        if complete_checkpoints(out):
            return True
        process_state().print(f"--resume auto: {out} holds no checkpoint, so this run starts afresh")
        return False
    if resume and not any((out / name).exists() for name in RUN_OUTPUTS):
        raise UserError(f"--resume: output_dir {out} holds no run to continue; check output_dir, drop --resume to start a "
                        f"run there, or pass --resume auto, which starts a run where there is none and continues it where "
                        f"there is")
    return bool(resume)


def check_writable(out: Path, what: str = "output_dir", choose: str = "set output_dir to") -> None:
    """Refuse a directory that cannot be created or written, before any work (what is in it is not looked at); `what`
    and `choose` name it and its setting in the message."""
    if (reason := too_long(out)) is not None:
        raise UserError(f"{what} {out} cannot be created: {reason}; {choose} a shorter path")
    nearest = next(p for p in (out, *out.absolute().parents) if p.exists())  # created later, under the run's lock
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as exc:
        raise UserError(f"{what} {out} cannot be written ({exc.strerror}); {choose} a writable directory") from None


def run_outputs(start: StartingPoint | None) -> tuple[str, ...]:
    """The names a training stage writes in its output_dir: a fine-tuning (`start` given) also its predictions and
    starting point."""
    return PRETRAIN_OUTPUTS if start is None else RUN_OUTPUTS


def check_ownership(out: Path, start: StartingPoint | None, overwrite: bool) -> None:
    """Refuse a run that would write over (or, starting over, delete) the weights it starts from, or over a file in
    output_dir that no run of mpp wrote there (a config of the user's, weights copied in)."""
    names = run_outputs(start)
    if start is not None and start.weights is not None:
        weights = Path(os.path.realpath(start.weights))
        for name in names:
            written = Path(os.path.realpath(out / name))
            if weights == written or written in weights.parents:
                raise UserError(f"output_dir {out} holds the weights this fine-tuning starts from ({start.weights}), and "
                                f"the run would {'delete' if overwrite else 'write over'} them; set output_dir to another "
                                f"directory (e.g. {str(out).rstrip('/')}-finetune)")
    foreign = not_written_by_a_run(out, names)
    if foreign:
        listed = ", ".join(f"{name}/" if (out / name).is_dir() else name for name in foreign)
        raise UserError(f"output_dir {out} holds {listed}, which no run of mpp wrote there, and a run writes "
                        f"{'those names' if len(foreign) > 1 else 'that name'}; move {'them' if len(foreign) > 1 else 'it'} "
                        f"elsewhere, or set output_dir to a new directory (nothing was written)")


def check_output_dir(cfg: Config, settings: dict, resume: bool, start: StartingPoint | None = None,
                     overwrite: bool = False) -> list[str]:
    """Refuse an output_dir that cannot be written, that holds another run's checkpoints (unless the run starts over
    there, `overwrite`), files no run wrote or the weights the run starts from, or whose run a resume would change in
    a way it cannot apply (for a fine-tuning, `start`: where its weights come from); returns what the resume changes
    (`settings`, `cfg` as dotted keys, against the run's), as `key before -> after`."""
    out = Path(cfg.output_dir)
    check_writable(out)
    if out.is_dir():
        check_ownership(out, start, overwrite)
    if overwrite or not complete_checkpoints(out):
        return []
    if not resume:
        raise UserError(f"output_dir {out} already holds checkpoints of a run; pass --resume to continue it, --overwrite "
                        f"to start over there, or set output_dir to a new directory")
    if start is not None:
        check_starting_point(out, start)
    trained, source = trained_config(out)
    before, now = dotted(trained), settings
    changed = [key for key in sorted({*before, *now}) if before.get(key) != now.get(key)
               # config.yaml holds the per-process batch (and accumulation) derived from train.global_batch_size, and
               # how that batch splits into micro-batches changes no step beyond rounding: a run moving to a process
               # count its old micro-batch does not divide picks another; the process count is checked on its own
               and not (key in ("train.batch_size", "train.grad_accum", "train.micro_batch_size")
                        and now.get("train.global_batch_size") is not None)]
    resumable = resumable_keys()
    refused = [key for key in changed if key not in resumable]
    if refused:
        key = refused[0]
        raise UserError(f"output_dir {out} holds a run with a different '{key.split('.')[0]}' config ({key}: {before.get(key)} "
                        f"in {source}, {now.get(key)} now); a resume may change only the length (train.steps, train.epochs), the learning-rate "
                        f"schedule, the optimiser's hyperparameters and how the run logs, evaluates and saves; resume "
                        f"from its saved config with {command_without(refused)}, or set output_dir to a new directory")
    return [f"{key} {before.get(key)} -> {now.get(key)}" for key in changed if key != "output_dir"]


def trained_config(out: Path) -> tuple[dict, str]:
    """The config the run in `out` was trained with and where it was read: its newest checkpoint's copy, once
    config.yaml (what a resume starts from) is checked against it; a run of an older mpp, whose checkpoints carry
    none, its config.yaml. A config.yaml missing, unreadable or changed where a resume cannot change it is refused,
    with the command that restores it."""
    saved = out / CONFIG
    carried, trained = next(((c, t) for c in map(checkpoint_config, reversed(complete_checkpoints(out)))
                             if c is not None and (t := readable(c)) is not None), (None, None))
    restore = f"restore it with `cp {shlex.quote(str(carried))} {shlex.quote(str(saved))}`" if carried else \
        "restore it from a copy"
    if not saved.is_file():
        raise UserError(f"{saved} is missing, and a resume starts from it; {restore}, or set output_dir to a new "
                        f"directory to start afresh")
    try:
        edited = yaml.safe_load(saved.read_text())
        if not isinstance(edited, dict):
            raise ValueError("it holds no mapping of sections")
    except (ValueError, yaml.YAMLError) as exc:
        raise UserError(f"{saved} cannot be read ({one_line_cause(exc)}), and a resume starts from it; {restore}") from None
    edited = as_saved(edited)  # both as the run was built, where an older mpp wrote them
    if carried is None:
        return edited, f"its {CONFIG}"
    trained = as_saved(trained)
    resumable, flat = resumable_keys(), dotted(trained)
    for key, value in dotted(edited).items():
        if key not in resumable and key in flat and flat[key] != value:
            raise UserError(f"{saved} says {key}: {value}, but the run was trained with {flat[key]} (its checkpoint "
                            f"{carried.parent.name} says so): config.yaml was edited, and a resume cannot change "
                            f"{key}; {restore}, or set output_dir to a new directory to train with {key}={value}")
    return trained, f"its checkpoint {carried.parent.name}"


def readable(config: Path) -> dict | None:
    """A checkpoint's config.yaml as data (None where it cannot be read: the checkpoint fails its manifest then)."""
    try:
        tree = yaml.safe_load(config.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return tree if isinstance(tree, dict) else None


def one_line_cause(exc: Exception) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def command_without(keys: list[str]) -> str:
    """This process's resume command without --config and the overrides of `keys`: it starts from the run's saved
    config, so it resumes the run as it was trained."""
    args, skip = [], False
    for arg in sys.argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif not arg.startswith("--config=") and arg.split("=", 1)[0] not in keys:
            args.append(arg)
    if "--resume" not in args:
        stage = next((i for i, a in enumerate(args) if a in ("pretrain", "finetune")), len(args) - 1)
        args.insert(stage + 1, "--resume")
    return f"`{command_line(args)}`"


def resume_config(default_config: str, overrides: list[str]) -> Config:
    """The config of `--resume` without --config: the run's saved config.yaml in output_dir (checked against the config
    its checkpoint carries) with `overrides` on top; where output_dir holds no checkpoint yet, `default_config` with
    them (the run starts afresh there)."""
    out = read_layers(default_config, overrides).get("output_dir", Config.model_fields["output_dir"].default)
    if not complete_checkpoints(out):
        return load_config(default_config, overrides)
    trained_config(Path(out))  # a config.yaml that is missing, unreadable or edited is refused with its fix
    return load_saved_config(Path(out) / CONFIG, overrides).model_copy(update={"output_dir": str(out)})


class RunInUse(UserError):
    """output_dir is locked by another run (its process is alive)."""


class OutputDirLock:
    """An exclusive flock on output_dir/.lock holding the owner's pid, for the life of a run.

    The kernel drops the lock when its process dies, so a crashed run's lock file never blocks the next run.
    """

    def __init__(self, accelerator: Accelerator, output_dir: str | Path):
        self.accelerator, self.path, self.file = accelerator, Path(output_dir) / LOCK, None

    def __enter__(self) -> OutputDirLock:
        holder = [None]
        if self.accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a+")
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.seek(0)
                holder[0] = self.file.read().strip() or "unknown"
                self.file.close()
            else:
                self.file.truncate(0)
                self.file.write(f"{os.getpid()}\n")
                self.file.flush()
        broadcast_object_list(holder)
        if holder[0] is not None:
            raise RunInUse(f"output_dir {self.path.parent} is in use by another run (pid {holder[0]}); wait for it to end, "
                            f"stop it, or set output_dir to another directory")
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # releases the lock


def start_over(accelerator: Accelerator, output_dir: str | Path) -> None:
    """--overwrite: delete what earlier runs of mpp wrote in output_dir (its checkpoints, TensorBoard events,
    config.yaml, results.json, model.safetensors, ... as run.json lists them; other files stay), once this run holds
    the lock there."""
    if accelerator.is_main_process:
        removed = remove_run_outputs(output_dir)
        if removed:
            accelerator.print(f"--overwrite: removed the earlier run's {', '.join(removed)} from {output_dir}")
    accelerator.wait_for_everyone()


def resume_point(accelerator: Accelerator, run_dir: RunDir, resume: bool, changes: list[str],
                 global_batch: int | None) -> Path | None:
    """The checkpoint in `run_dir` to continue from (None: a fresh start), saying what the resume `changes`;
    `global_batch` is train.global_batch_size (see resumable_checkpoint)."""
    if not resume:
        return None
    latest = resumable_checkpoint(accelerator, run_dir, relaunch=resume_command, global_batch=global_batch)
    if latest is not None and changes:
        accelerator.print(f"resuming with changed settings, applied from {latest.name} on: {', '.join(changes)}")
    return latest


def record_run_start(accelerator: Accelerator, run_dir: RunDir, cfg: Config, start: StartingPoint | None,
                     resumed: bool) -> str | None:
    """What a run records as it starts, before it writes anything else in output_dir: run.json (the names it writes,
    the config it trains with (`cfg`, as config.yaml shows it; every checkpoint carries it) and the command that
    started the run) and, for a fine-tuning that starts here (not `resumed`), where its weights come from (`start`).
    Returns the command that started the run (None where an mpp without run.json started it), for results.json."""
    if accelerator.is_main_process:
        record_run(run_dir.root, run_outputs(start), cfg.model_dump(mode="json"), command_line(), started=not resumed)
        if start is not None and not resumed:
            start.record(run_dir)
    accelerator.wait_for_everyone()
    return (read_run_manifest(run_dir.root) or {}).get("command")
