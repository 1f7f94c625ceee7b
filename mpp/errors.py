"""Errors that are the user's to fix: the CLI prints their one-line message, without a traceback. A message that
tells the user to run a stage names it as they started this process (`command`)."""

from __future__ import annotations

import sys
from pathlib import Path


class UserError(Exception):
    """A mistake in a config, a path or the data; the message names the thing and the fix."""


class DataError(UserError):
    """A user-facing problem with the shard set; the message names it and the fix."""


class Terminated(BaseException):
    """SIGTERM (from `timeout`, systemd, a scheduler) met by work that cleans up on the way out, raised where the
    process is, as Ctrl-C raises KeyboardInterrupt (so no `except Exception` swallows it); the message says what was
    left. The command line prints it and exits TERMINATED_STATUS."""


TERMINATED_STATUS = 143  # 128 + SIGTERM, as a shell reports a command a SIGTERM ended


def program(argv0: str | None = None) -> str:
    """How the user started mpp's command line (default: this process): `python launch.py` for a checkout's script
    (as typed), `python -m mpp.pipelines` for the installed package run as a module (what `accelerate launch -m`
    runs; `python -m pipelines` in a checkout), else `mpp`, the installed command."""
    first = sys.argv[0] if argv0 is None else argv0
    path = Path(first)
    if path.name == "launch.py":
        return f"python {first}"
    if path.name == "__main__.py" and path.parent.name == "pipelines":
        installed = (path.parent.parent / "__init__.py").is_file()  # site-packages/mpp/pipelines/__main__.py
        return f"python -m {'mpp.pipelines' if installed else 'pipelines'}"
    return "mpp"


def command(words: str) -> str:
    """`words` (a stage and its arguments) as the command to type, e.g. `mpp prepare SOURCE --out DIR` or, in a
    checkout, `python launch.py prepare SOURCE --out DIR`."""
    return f"{program()} {words}"
