"""The run directory: what a run writes where, and which run wrote a given file.

    output_dir/
      run.json                      what runs of mpp wrote here (the names below), the config the run trains with
                                    (copied into every checkpoint) and the command that started it
      config.yaml                   the settings in force, with a comment line per resume that changed some
      results.json                  the stage's final metrics and the command that ran it
      predictions.json              fine-tuning: its last evaluation, image by image: label, top-1 class, 1 or 0 if right
      started_from.json             a fine-tuning's starting point (--ckpt and its weights' sha256), written as it starts
      model.safetensors             the exported weights (the objective's export_weights())
      best.safetensors              fine-tuning with finetune.keep_best: the weights of its best evaluation
      log.txt                       one JSON line of scalars per log step
      tensorboard/<stage>/          event files
      checkpoints/step_00000040/    Accelerate's state (its model.safetensors among it), the config.yaml it was
                                    trained with, and manifest.json
      checkpoints/.partial-step_*   a checkpoint being written; renamed to step_* once complete
      .lock                         the pid of the run working there (locked while it runs)

A run writes only names that run.json lists (or that no file holds yet, which it then lists): a file of the user's
at one of these names is never replaced, and starting over removes only what run.json lists. A directory of an mpp
from before run.json is taken for a run's when it holds a checkpoint of this layout or, beside tensorboard/, a
config.yaml as runs dump it (every section, no comment but resume notes); its config.yaml counts as the run's only
when it reads so.

Everything that reads or writes these names goes through this module; it knows nothing of Accelerate or the loop.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from safetensors import SafetensorError

CONFIG = "config.yaml"
RESULTS = "results.json"
PREDICTIONS = "predictions.json"  # a fine-tuning's last evaluation: {sample key: {"label", "predicted", "correct": 1 or 0}}
STARTED_FROM = "started_from.json"
WEIGHTS = "model.safetensors"  # the run's export, and also Accelerate's name for the model in a checkpoint
BEST = "best.safetensors"  # a fine-tuning's weights at its best eval/top1 (finetune.keep_best)
LOG_LINES = "log.txt"  # the logged scalars, one JSON line per log step
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
CHECKPOINT_PREFIX = "step_"
MANIFEST = "manifest.json"


LOCK = ".lock"
RUN_MANIFEST = "run.json"
PRETRAIN_OUTPUTS = (CHECKPOINTS, TENSORBOARD, CONFIG, RESULTS, WEIGHTS, LOG_LINES)  # what a pretraining writes in output_dir
RUN_OUTPUTS = (*PRETRAIN_OUTPUTS, PREDICTIONS, STARTED_FROM, BEST)  # what any run writes there, besides RUN_MANIFEST and LOCK
RUN_SECTIONS = ("objective", "output_dir", "data", "model", "train")  # what every config.yaml a run dumps holds
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class RunDir:
    """One run's output_dir and the paths a training run reads and writes there as it runs (the module's docstring
    lists every name)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def results(self) -> Path:
        return self.root / RESULTS

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS

    @property
    def started_from(self) -> Path:
        return self.root / STARTED_FROM

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int, *, partial: bool = False) -> Path:
        """checkpoints/step_N (zero-padded, so names sort by step), or the temporary name it is written under."""
        name = f"{CHECKPOINT_PREFIX}{step:08d}"
        return self.checkpoints / (f".partial-{name}" if partial else name)

    def seal_checkpoint(self, step: int, processes: int, keep: int) -> Path:
        """Make the checkpoint of `step`, whose files `processes` processes wrote under its temporary name, one that
        a resume finds and verifies: the config the run trains with (from run.json: a resume checks against it, not
        against a config.yaml edited since), the usual file modes, the manifest written last, then the rename into
        place; only the newest `keep` checkpoints stay. Returns the checkpoint."""
        partial, final = self.checkpoint(step, partial=True), self.checkpoint(step)
        if (config := run_config(self.root)) is not None:
            (partial / CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        usual_mode(*(p for p in partial.iterdir() if p.is_file()))  # Accelerate's model.safetensors included
        write_manifest(partial, processes)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in complete_checkpoints(self.root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def read_run_manifest(output_dir: str | Path) -> dict | None:
    """run.json of output_dir ({written: [names], config: {...}, command: str}), or None where there is none; one
    that cannot be read lists nothing (the run's files are then the user's to move)."""
    path = Path(output_dir) / RUN_MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def dumped_by_a_run(config: Path) -> bool:
    """Whether `config` reads as the config.yaml a run writes: every section of the config, and no comment but the
    notes of resumes (a config the user wrote has sections left to their defaults, or comments of their own)."""
    try:
        text = config.read_text()
        tree = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    notes = all(line.startswith("# resumed from ") for line in text.splitlines() if line.lstrip().startswith("#"))
    return notes and isinstance(tree, dict) and all(key in tree for key in RUN_SECTIONS)


def run_written(output_dir: str | Path) -> set[str]:
    """The names in output_dir that runs of mpp wrote (see the module's docstring for directories of an earlier mpp)."""
    out = Path(output_dir)
    manifest = read_run_manifest(out)
    if manifest is not None:
        written = manifest.get("written")
        return {name for name in written if name in RUN_OUTPUTS} if isinstance(written, list) else set()
    config_of_a_run = (out / TENSORBOARD).is_dir() and dumped_by_a_run(out / CONFIG)
    if not config_of_a_run and not any((c / MANIFEST).is_file() for c in complete_checkpoints(out)):
        return set()
    return set(RUN_OUTPUTS) - ({CONFIG} if (out / CONFIG).exists() and not dumped_by_a_run(out / CONFIG) else set())


def not_written_by_a_run(output_dir: str | Path, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that a file or folder in output_dir holds which no run of mpp wrote there."""
    written = run_written(output_dir)
    return [name for name in names if name not in written and ((Path(output_dir) / name).exists() or (Path(output_dir) / name).is_symlink())]


def record_run(output_dir: str | Path, names: tuple[str, ...], config: dict, command: str, started: bool) -> None:
    """Write run.json as a run starts in output_dir (under its lock, before it writes anything else): the `names` it
    writes added to those listed, the `config` it trains with, and `command` when the run `started` there (not
    resumed), else the command that started it (None where an older mpp started it)."""
    out = Path(output_dir)
    earlier = read_run_manifest(out) or {}
    written = sorted(run_written(out) | set(names))
    command = command if started else earlier.get("command")  # None: started by an mpp without run.json
    write_whole(out / RUN_MANIFEST, json.dumps({"written": written, "command": command, "config": config}, indent=1) + "\n")


def run_config(output_dir: str | Path) -> dict | None:
    """The config the run in output_dir trains with, as run.json records it (None: no run.json, or an older one)."""
    config = (read_run_manifest(output_dir) or {}).get("config")
    return config if isinstance(config, dict) else None


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, written whole (written_whole)."""
    written_whole(path, lambda temporary: temporary.write_text(text))


def written_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write` the file `path` under a temporary name beside it, then rename it into place: a failed write (a full
    disk, a kill) leaves no file cut short, and the one it would replace intact. The temporary name is this write's
    own: two processes writing one file at once (compare processes over disjoint arms publish the same budget report
    and figure) each rename a whole file into place, and the last one stays."""
    temporary = path.with_name(f".partial-{secrets.token_hex(8)}-{path.name}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def out_of_space(exc: BaseException) -> bool:
    """Whether a failed write says it ran out of space: an OSError by its errno, anywhere in the chain of causes;
    safetensors by quoting the system's message ('No space left on device (os error 28)'). torch.save says neither
    ('unexpected pos 576 vs 534'): mpp.training.resume asks the file system then."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if any(os.strerror(code) in str(exc) for code in NO_SPACE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def cause_of(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[-1]


class OutputNotWritten(Exception):
    """A stage's output could not be written (a full disk, a read-only folder); nothing of it was left behind."""

    def __init__(self, what: str, exc: Exception):
        self.full = out_of_space(exc)
        self.reason = f"{'the disk is full: ' if self.full else ''}{cause_of(exc)}"
        super().__init__(f"cannot write {what} ({self.reason})")


@contextlib.contextmanager
def staged(directory: Path, what: str) -> Iterator[Path]:
    """A folder to write a stage's output files (and folders) into; they are moved into `directory` (made if need be;
    see move_into) only once every one is written, so a failure leaves none of them, nor a `directory` this made. A
    write that fails raises OutputNotWritten naming `what`."""
    made = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    stage = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".partial-", dir=directory))
        yield stage
        move_into(stage, directory)
    except BaseException as exc:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
        if isinstance(exc, (OSError, SafetensorError)):
            raise OutputNotWritten(what, exc) from exc
        raise
    shutil.rmtree(stage, ignore_errors=True)


def move_into(source: Path, directory: Path) -> None:
    """Move what `source` holds into `directory` by renames (on one file system, none can fail for want of space),
    replacing files of the same names and merging folders into folders, so other files there stay."""
    for path in sorted(source.iterdir()):
        target = directory / path.name
        if path.is_dir() and target.is_dir() and not target.is_symlink():
            move_into(path, target)
        else:
            os.replace(path, target)


def remove_run_outputs(output_dir: str | Path) -> list[str]:
    """Delete what runs of mpp wrote in output_dir (run_written) and nothing else, for a run that starts over there;
    returns the names it deleted. The caller holds the run's LOCK, which stays."""
    removed = []
    written = run_written(output_dir)
    for name in RUN_OUTPUTS:
        if name not in written:
            continue
        path = Path(output_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first; a save in progress lives under a temporary name and is ignored."""
    root = RunDir(Path(output_dir)).checkpoints
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def is_checkpoint(directory: Path) -> bool:
    return directory.name.startswith(CHECKPOINT_PREFIX) and directory.parent.name == CHECKPOINTS


def checkpoint_step(directory: Path) -> int:
    return int(directory.name.removeprefix(CHECKPOINT_PREFIX))


def run_dir_of(weights_file: Path) -> Path:
    """The run directory that wrote `weights_file`: the one it lies in, or for a checkpoint's file, the checkpoint's run."""
    directory = weights_file.parent
    return directory.parent.parent if is_checkpoint(directory) else directory


def run_config_of(weights_file: Path) -> Path | None:
    """The config.yaml of the run that wrote `weights_file`, if there is one."""
    config = run_dir_of(weights_file) / CONFIG
    return config if config.is_file() else None


def usual_mode(*paths: Path) -> None:
    """Give files the mode a new file gets from this process (0o666 less its umask). safetensors (0.8) writes a file
    through a temporary one made 0600 and renames it, which left model.safetensors readable by its owner alone
    while every other file of a run is as readable as the umask allows."""
    umask = os.umask(0)  # the umask can only be read by setting it: put it back at once
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_config(directory: Path) -> Path | None:
    """The config.yaml a checkpoint carries (the config its run trained with), None in a checkpoint of an older mpp."""
    config = directory / CONFIG
    return config if config.is_file() else None


def write_manifest(directory: Path, processes: int) -> None:
    """Size and sha256 of every file of a checkpoint, written last: damage after the save shows on resume."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(directory.iterdir()) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"processes": processes, "files": files}, indent=1) + "\n")


def checkpoint_fault(directory: Path) -> str | None:
    """Why `directory`'s files do not verify against its manifest (damaged, incomplete, of an older mpp), or None
    when they do. Whether a run may resume from it also takes the process count that saved it (saved_processes)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files, saved_by = manifest["files"], manifest["processes"]
    except FileNotFoundError:
        if not any(directory.iterdir()):
            return "it is empty (a save or a copy cut off before any file was written)"
        return f"it has no {MANIFEST} (written by an mpp that did not verify its checkpoints)"
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes where {entry['bytes']} were written (truncated or overwritten)"
        if sha256(path) != entry["sha256"]:
            return f"{name} does not match the sha256 written with it (damaged)"
    if not isinstance(saved_by, int):
        return f"its {MANIFEST} is unreadable"
    return None


def saved_processes(directory: Path) -> int:
    """How many processes saved a checkpoint that verifies (each wrote its own random state and stream position)."""
    return json.loads((directory / MANIFEST).read_text())["processes"]


def newest_verified(output_dir: str | Path) -> Path | None:
    """The newest checkpoint whose files verify, for its weights (saved by any process count)."""
    return next((c for c in reversed(complete_checkpoints(output_dir)) if checkpoint_fault(c) is None), None)


def too_long(path: str | Path) -> str | None:
    """Why `path` cannot be created (a name, or the whole path, longer than its file system allows), or None.
    Checked without looking `path` up, since the kernel refuses even to look up such a path."""
    path = Path(path).absolute()
    size, limit = len(os.fsencode(str(path))), os.pathconf(path.anchor, "PC_PATH_MAX")
    if size >= limit:
        return f"the path has {size} bytes, more than the {limit - 1} the system allows"
    existing, descending = Path(path.anchor), True  # the deepest existing folder: its file system sets the limit
    for part in path.parts[1:]:
        size, limit = len(os.fsencode(part)), os.pathconf(existing, "PC_NAME_MAX")
        if size > limit:
            return f"its name {part[:24]}... has {size} bytes, more than the {limit} its file system allows"
        descending = descending and (existing / part).is_dir()
        if descending:
            existing = existing / part
    return None
