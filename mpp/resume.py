"""A run's training state on disk: writing a checkpoint under output_dir, finding the one to resume, restoring it.

What a checkpoint directory holds and how it is verified is mpp/rundir.py's; this module adds Accelerate's state and
each rank's data stream position.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from mpp.data import StreamState
from mpp.errors import UserError
from mpp.rundir import checkpoint_dir, checkpoint_fault, checkpoint_root, complete_checkpoints, usual_mode, write_manifest

STREAM_STATE = "stream_state_{rank}.json"  # each rank's data stream position, in every checkpoint


def resumable_checkpoint(accelerator: Accelerator, output_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies, saying which newer ones were skipped and why; None when there is none yet.

    The main process verifies (reading each file once) and tells the others; every rank then checks that it sees the
    checkpoint's files too (ranks on other nodes see output_dir only on a filesystem all nodes share).
    """
    choice: list = [None, None, 0]  # path, the newest one's fault, candidates
    if accelerator.is_main_process:
        candidates = complete_checkpoints(output_dir)
        choice[2] = len(candidates)
        for candidate in reversed(candidates):
            fault = checkpoint_fault(candidate, accelerator.num_processes)
            if fault is None:
                choice[0] = str(candidate)
                break
            choice[1] = choice[1] or f"{candidate.name}: {fault}"
            print(f"skipping checkpoint {candidate}: {fault}", file=sys.stderr, flush=True)
    broadcast_object_list(choice)
    path, newest_fault, candidates = choice
    if path is None and candidates:
        raise UserError(f"none of the {candidates} checkpoint(s) in {checkpoint_root(output_dir)} verifies (newest, "
                        f"{newest_fault}); move them aside to start afresh")
    if path is None:
        accelerator.print(f"resume: {checkpoint_root(output_dir)} holds no checkpoint yet, so this run starts at step 0")
        return None
    check_seen_by_every_rank(accelerator, Path(path))
    return Path(path)


def check_seen_by_every_rank(accelerator: Accelerator, checkpoint: Path) -> None:
    """Refuse, on every rank, a checkpoint that some rank cannot read its own stream state from."""
    blind = [rank for rank, seen in enumerate(gather_object([stream_state_file(checkpoint, accelerator.process_index).is_file()]))
             if not seen]
    if blind:
        raise UserError(f"checkpoint {checkpoint} is not visible to rank(s) {', '.join(map(str, blind))}: with several "
                        f"nodes, output_dir must be on a filesystem every node shares (NFS, Lustre, a mounted bucket); "
                        f"set output_dir to such a directory")


def stream_state_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / STREAM_STATE.format(rank=rank)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, keep: int, stream: StreamState) -> Path:
    """Write to a temporary name, then rename: a crash mid-save never leaves a checkpoint that looks complete.

    Accelerate saves the model, optimiser, scheduler, Progress and every rank's RNG; each rank adds its own `stream`
    position (Accelerate saves registered objects from the main process only).
    """
    root = checkpoint_root(output_dir)
    final, partial = checkpoint_dir(output_dir, step), checkpoint_dir(output_dir, step, partial=True)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    stream_state_file(partial, accelerator.process_index).write_text(json.dumps(stream.state_dict()) + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        usual_mode(*(p for p in partial.iterdir() if p.is_file()))  # Accelerate's model.safetensors included
        write_manifest(partial, accelerator.num_processes)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, stream: StreamState) -> None:
    """Restore what save_checkpoint wrote, this rank's own stream position included."""
    accelerator.load_state(str(checkpoint))
    stream.load_state_dict(json.loads(stream_state_file(checkpoint, accelerator.process_index).read_text()))
