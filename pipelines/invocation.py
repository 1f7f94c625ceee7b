"""The command line that ran this process, as the user typed it: what results.json records and a stop says to rerun."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mpp.errors import program


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs `argv` (default: this process's) again, as the user typed it."""
    args = list(sys.argv if argv is None else argv)
    if Path(args[0]).name == "mpp":  # the installed console script runs as itself
        return " ".join(["mpp", *args[1:]])
    runner = "accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ else "python"
    started = program(args[0])
    if started.startswith("python -m "):  # argv[0] is the package's __main__.py: name the module, as it was typed
        return f"{runner} {started.removeprefix('python ')} {' '.join(args[1:])}"
    return f"{runner} {' '.join(args)}"


def resume_command() -> str:
    """This process's command line with --resume right after the stage name (or at the end if there is none) and
    without --overwrite;
    under compare, its command line as it is: compare resumes its stages itself and takes no --resume."""
    args = [a for a in sys.argv if a not in ("--resume", "--overwrite")]
    if "compare" not in args:
        stage = next((i for i, a in enumerate(args) if a in ("pretrain", "finetune")), len(args) - 1)
        args.insert(stage + 1, "--resume")
    return f"`{command_line(args)}`"
