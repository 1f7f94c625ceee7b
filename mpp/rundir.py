"""The run directory: what a run writes where, and which run wrote a given file.

    output_dir/
      config.yaml                   the settings in force, with a comment line per resume that changed some
      results.json                  the stage's final metrics and the command that ran it
      predictions.json              fine-tuning: its last evaluation, image by image: label, top-1 class, 1 or 0 if right
      started_from.json             a fine-tuning's starting point (--ckpt and its weights' sha256), written as it starts
      model.safetensors             the exported weights (the objective's export_weights())
      best.safetensors              fine-tuning with finetune.keep_best: the weights of its best evaluation
      log.txt                       one JSON line of scalars per log step
      tensorboard/<stage>/          event files
      checkpoints/step_00000040/    Accelerate's state (its model.safetensors among it) and manifest.json
      checkpoints/.partial-step_*   a checkpoint being written; renamed to step_* once complete
      .lock                         the pid of the run working there (locked while it runs)

Everything that reads or writes these names goes through this module; it knows nothing of Accelerate or the loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

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
RUN_OUTPUTS = (CHECKPOINTS, TENSORBOARD, CONFIG, RESULTS, PREDICTIONS, STARTED_FROM, WEIGHTS, BEST, LOG_LINES)  # what a run writes in output_dir, besides its LOCK


def remove_run_outputs(output_dir: str | Path) -> list[str]:
    """Delete what a run wrote in output_dir (RUN_OUTPUTS) and nothing else, for a run that starts over there;
    returns the names it deleted. The caller holds the run's LOCK, which stays."""
    removed = []
    for name in RUN_OUTPUTS:
        path = Path(output_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def checkpoint_dir(output_dir: str | Path, step: int, *, partial: bool = False) -> Path:
    """checkpoints/step_N (zero-padded, so names sort by step), or the temporary name it is written under."""
    name = f"{CHECKPOINT_PREFIX}{step:08d}"
    return checkpoint_root(output_dir) / (f".partial-{name}" if partial else name)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first; a save in progress lives under a temporary name and is ignored."""
    root = checkpoint_root(output_dir)
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
