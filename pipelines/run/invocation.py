"""The command line that ran this process, as the user typed it: what results.json records and a stop says to rerun.

A rank started by a launcher sees only its own arguments (`launch.py STAGE ...`), not the launcher's. Those are read
back from the environment the launcher gives every rank: Accelerate's launch sets ACCELERATE_MIXED_PRECISION (for one
process too); for several processes both it and torchrun run torch's elastic agent, which sets TORCHELASTIC_RUN_ID,
WORLD_SIZE (the processes of the whole run), GROUP_WORLD_SIZE and GROUP_RANK (the machines, and this one among them)
and MASTER_ADDR and MASTER_PORT (where they meet). These are what the ranks themselves start from, so they hold
whatever way the launcher was given its settings (flags, `accelerate config`'s file).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from mpp.errors import program


def launcher(processes: int | None = None) -> str:
    """The launcher part of this process's command line, for `processes` processes (default: this run's)."""
    env = os.environ
    accelerate = "ACCELERATE_MIXED_PRECISION" in env
    elastic = "TORCHELASTIC_RUN_ID" in env
    processes = int(env.get("WORLD_SIZE", "1")) if processes is None else processes
    if processes == 1:
        return "accelerate launch" if accelerate else "python"
    machines = int(env.get("GROUP_WORLD_SIZE", "1")) if elastic else 1
    where = (env.get("GROUP_RANK", "0"), env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500"))
    if elastic and not accelerate:
        nodes = (" --nnodes {} --node_rank {} --master_addr {} --master_port {}".format(machines, *where)
                 if machines > 1 else "")
        return f"torchrun{nodes} --nproc_per_node {processes // machines}"
    nodes = (" --num_machines {} --machine_rank {} --main_process_ip {} --main_process_port {}".format(machines, *where)
             if machines > 1 else "")
    return f"accelerate launch --multi_gpu{nodes} --num_processes {processes}"


def command_line(argv: list[str] | None = None, processes: int | None = None) -> str:
    """The command that runs `argv` (default: this process's) again, as the user typed it, with `processes`
    processes (default: as many as this run has)."""
    args = list(sys.argv if argv is None else argv)
    run_by = launcher(processes)
    if Path(args[0]).name == "mpp" and run_by == "python":  # the installed console script runs as itself
        return shlex.join(["mpp", *args[1:]])
    started = program(args[0])
    if started.startswith("python -m "):  # argv[0] is the package's __main__.py: name the module, as it was typed
        return f"{run_by} {started.removeprefix('python ')} {shlex.join(args[1:])}"
    return f"{run_by} {shlex.join(args)}"


def resume_command(processes: int | None = None) -> str:
    """This process's command line with --resume right after the stage name (or at the end if there is none) and
    without --overwrite, for `processes` processes (default: as many as this run has); under compare, its command
    line as it is: compare resumes its stages itself and takes no --resume."""
    args = [a for i, a in enumerate(sys.argv) if a not in ("--resume", "--resume=auto", "--overwrite")
            and not (a == "auto" and sys.argv[i - 1] == "--resume")]  # `--resume auto` continues as --resume
    if "compare" not in args:
        stage = next((i for i, a in enumerate(args) if a in ("pretrain", "finetune")), len(args) - 1)
        args.insert(stage + 1, "--resume")
    return f"`{command_line(args, processes)}`"
