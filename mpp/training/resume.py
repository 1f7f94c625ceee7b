"""A run's training state on disk: writing a checkpoint in its run directory (mpp.rundir.RunDir), finding the one to resume, restoring it.

What a checkpoint directory holds and how it is verified is mpp/rundir.py's; this module adds Accelerate's state and
each rank's data stream position.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from safetensors import SafetensorError

from mpp.data.stream import StreamState
from mpp.config import TrainConfig
from mpp.errors import UserError
from mpp.training.optim import LambdaLR, apply_hyperparameters
from mpp.rundir import (MANIFEST, RunDir, checkpoint_fault, checkpoint_step, complete_checkpoints, newest_verified,
                        saved_processes, cause_of, out_of_space)

STREAM_STATE = "stream_state_{rank}.json"  # each rank's data stream position, in every checkpoint
# What a failed write raises in a save: an OSError from Python's own writes, safetensors' error for the model, and
# torch.save's RuntimeError for the optimiser, scheduler and RNG states.
WRITE_ERRORS = (OSError, SafetensorError, RuntimeError)


class SaveFailed(UserError):
    """A checkpoint or the run's weights could not be written (a full disk, a file system gone read-only); the
    checkpoints written before are intact."""


def resumable_checkpoint(accelerator: Accelerator, run_dir: RunDir, relaunch: Callable[[int], str],
                        global_batch: int | None) -> Path | None:
    """The newest checkpoint that verifies, saying which newer ones were skipped and why; None when there is none yet.

    The main process verifies (reading each file once) and tells the others. A checkpoint saved by another process
    count resumes when the run's `global_batch` (train.global_batch_size) is fixed, saying what it continues exactly
    and what not (see load_checkpoint); with the batch set per process (`global_batch` None) it is refused with
    `relaunch(n)`, the command that resumes with the n processes that saved it. Then every rank checks that it sees
    the checkpoint's files (ranks on other nodes see output_dir only on a filesystem all nodes share).
    """
    choice: list = [None, None, 0, None]  # path, the newest one's fault, candidates, processes that saved the path
    if accelerator.is_main_process:
        candidates = complete_checkpoints(run_dir.root)
        choice[2] = len(candidates)
        for candidate in reversed(candidates):
            fault = checkpoint_fault(candidate)
            if fault is None:
                choice[0], choice[3] = str(candidate), saved_processes(candidate)
                break
            choice[1] = choice[1] or f"{candidate.name}: {fault}"
            print(f"skipping checkpoint {candidate}: {fault}", file=sys.stderr, flush=True)
    broadcast_object_list(choice)
    path, newest_fault, candidates, saved_by = choice
    if path is None and candidates:
        raise UserError(f"none of the {candidates} checkpoint(s) in {run_dir.checkpoints} verifies (newest, "
                        f"{newest_fault}); move them aside to start afresh")
    if path is None:
        accelerator.print(f"resume: {run_dir.checkpoints} holds no checkpoint yet, so this run starts at step 0")
        return None
    processes = accelerator.num_processes
    if saved_by != processes and global_batch is None:
        raise UserError(f"checkpoint {path} was saved by {saved_by} process(es) and this run has {processes}; the run sets "
                        f"its batch per process (train.batch_size), so its global batch would change with the process "
                        f"count: relaunch the run with {saved_by}: {relaunch(saved_by)} (a run started with "
                        f"train.global_batch_size resumes on any number of processes)")
    if saved_by != processes:
        accelerator.print(f"resuming {path}, saved by {saved_by} process(es), with {processes}: exact in weights, optimiser "
                          f"state, schedule and step, with the global batch of {global_batch} split over {processes}, but "
                          f"not in data order: each rank starts a fresh draw of its data stream and random numbers, "
                          f"seeded by train.seed, the step and the rank")
    check_seen_by_every_rank(accelerator, Path(path), same_processes=saved_by == processes)
    return Path(path)


def check_seen_by_every_rank(accelerator: Accelerator, checkpoint: Path, same_processes: bool = True) -> None:
    """Refuse, on every rank, a checkpoint that some rank cannot read what it resumes from: its own stream state, or
    with another process count (where no rank reads one), the manifest."""
    needed = stream_state_file(checkpoint, accelerator.process_index) if same_processes else checkpoint / MANIFEST
    blind = [rank for rank, seen in enumerate(gather_object([needed.is_file()])) if not seen]
    if blind:
        raise UserError(f"checkpoint {checkpoint} is not visible to rank(s) {', '.join(map(str, blind))}: with several "
                        f"nodes, output_dir must be on a filesystem every node shares (NFS, Lustre, a mounted bucket); "
                        f"set output_dir to such a directory")


def stream_state_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / STREAM_STATE.format(rank=rank)


def save_checkpoint(accelerator: Accelerator, run_dir: RunDir, step: int, keep: int, stream: StreamState,
                    resume_hint: str = "the same command with --resume") -> Path:
    """Write to a temporary name, then rename: a crash mid-save never leaves a checkpoint that looks complete.

    Accelerate saves the model, optimiser, scheduler, Progress and every rank's RNG; each rank adds its own `stream`
    position (Accelerate saves registered objects from the main process only), and the main process the config the
    run trains with (RunDir.seal_checkpoint). A write that fails (a full disk) raises SaveFailed naming the newest
    checkpoint that survives and `resume_hint`, the command that continues.
    """
    partial = run_dir.checkpoint(step, partial=True)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(partial))
        stream_state_file(partial, accelerator.process_index).write_text(json.dumps(stream.state_dict()) + "\n")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            run_dir.seal_checkpoint(step, accelerator.num_processes, keep)
    except WRITE_ERRORS as exc:
        raise not_saved(accelerator, run_dir, step, partial, exc, resume_hint) or exc
    accelerator.wait_for_everyone()
    return run_dir.checkpoint(step)


def not_saved(accelerator: Accelerator, run_dir: RunDir, step: int, partial: Path, exc: Exception,
              resume_hint: str) -> SaveFailed | None:
    """The error for a save of `step` into `partial` (its temporary name) that failed with `exc` when a write failed,
    None when `exc` is no failed write. The main process removes the partial checkpoint; another may not (the main one
    may still be writing into it)."""
    earlier = complete_checkpoints(run_dir.root)
    needed = tree_bytes(earlier[-1] if earlier else partial)  # measured before the partial goes
    left = space_left(run_dir.checkpoints)
    full = out_of_space(exc) or left < needed
    if not full and not isinstance(exc, OSError | SafetensorError):
        return None  # a RuntimeError of torch.save that did not fail for want of space: not a write we can name
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        removed = "the partial checkpoint was removed"
    else:
        removed = f"the partial checkpoint {partial} is left (a resume ignores it)"
    survivor = newest_verified(run_dir.root)
    survives = (f"the newest checkpoint that survives is {survivor}" if survivor is not None else
                "no earlier checkpoint survives, so the run starts again at step 0")
    cause = cause_of(exc)
    if full:
        return SaveFailed(f"cannot save the checkpoint of step {step}: the disk holding {run_dir.checkpoints} is "
                          f"full ({megabytes(left)} left, a checkpoint of this run takes {megabytes(needed)}; the write "
                          f"failed with: {cause}); {removed} and {survives}; free some space, then continue with {resume_hint}")
    return SaveFailed(f"cannot save the checkpoint of step {step} in {run_dir.checkpoints} ({cause}); {removed} "
                      f"and {survives}; once it can be written, continue with {resume_hint}")


def weights_not_saved(run_dir: RunDir, exc: Exception, resume_hint: str) -> SaveFailed | None:
    """The error for the run's final weights (output_dir/model.safetensors) that could not be written, None when `exc`
    is no failed write. The run's last checkpoint holds them, and a resume of the finished run writes them."""
    if not isinstance(exc, OSError | SafetensorError):
        return None
    weights = run_dir.weights
    weights.unlink(missing_ok=True)  # a file cut short would be taken for the run's weights
    why = "the disk holding it is full" if out_of_space(exc) else "it cannot be written"
    fix = "free some space" if out_of_space(exc) else "once it can be written"
    return SaveFailed(f"cannot write the run's weights {weights}: {why} ({cause_of(exc)}); its last checkpoint "
                      f"{newest_verified(run_dir.root)} holds them: {fix}, then continue with {resume_hint}, which writes "
                      f"them from it")


def space_left(directory: Path) -> int:
    """Bytes this process may still write on `directory`'s file system (root may write into the blocks kept for it)."""
    stat = os.statvfs(directory)
    return (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize


def tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, stream: StreamState, seed: int) -> None:
    """Restore what save_checkpoint wrote, this rank's own stream position included.

    A checkpoint saved by another process count restores what all ranks share (weights, optimiser, schedule, scaler,
    step, the EMA); the per-rank state it holds (random states, stream positions) belongs to ranks of another split of
    the data, so each rank is seeded afresh by (`seed`, step, rank) and its stream starts a fresh draw at this step.
    """
    accelerator.load_state(str(checkpoint))
    # Accelerate counts micro-batches in `step` to decide when accumulation syncs, and restores it from each rank's
    # random state file: a rank without one, or another number of accumulation steps, would sync at another
    # micro-batch than the others. Every checkpoint is at a step boundary, where the count starts again.
    accelerator.step = 0
    if saved_processes(checkpoint) == accelerator.num_processes:
        stream.load_state_dict(json.loads(stream_state_file(checkpoint, accelerator.process_index).read_text()))
        return
    step = checkpoint_step(checkpoint)
    set_seed(fresh_seed(seed, step, accelerator.process_index))
    stream.load_state_dict(StreamState(drawn_from=step).state_dict())


def fresh_seed(seed: int, step: int, rank: int) -> int:
    """A seed for the random number generators of `rank` from `step` on, distinct for every (seed, step, rank)."""
    return int.from_bytes(hashlib.sha256(f"{seed}-{step}-{rank}".encode()).digest()[:4], "little")


def restore(accelerator: Accelerator, checkpoint: Path, stream: StreamState, optimizer, scheduler: LambdaLR,
            cfg: TrainConfig) -> None:
    """Continue from `checkpoint` under `cfg`, whose schedule and optimiser hyperparameters apply from here on. Its
    step is its name's (RunDir.checkpoint), as the Progress it holds says."""
    load_checkpoint(accelerator, checkpoint, stream, cfg.seed)
    step = checkpoint_step(checkpoint)
    if step > cfg.steps:
        raise UserError(f"{checkpoint} is at step {step}, past train.steps={cfg.steps}; set train.steps to "
                        f"at least {step} to resume it, or finetune/fewshot from it with --ckpt")
    apply_hyperparameters(optimizer, scheduler, cfg)
    finished = f": the run is finished (train.steps={cfg.steps}), nothing to train" if step == cfg.steps else ""
    accelerator.print(f"resumed from {checkpoint} at step {step}{finished}")
