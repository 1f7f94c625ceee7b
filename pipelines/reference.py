"""The reference, docs/reference.md, generated from the registries and the schemas: every command with its arguments
(pipelines.commands.COMMANDS), every run-config key (the core sections and every registered part's) and every
comparison-plan key, with its default and meaning. A new command or part's settings appear there when it is
registered; `python -m pipelines.reference` rewrites the file (tests/test_config_model.py fails while it is stale).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpp.config import config_reference
from . import parts  # noqa: F401  (every part's section)
from .commands import COMMANDS, CONFIGS, add_command
from .comparison.plan import CompareConfig

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"

HEADER = """# Command and config reference

Generated from the commands and the schemas by `python -m pipelines.reference` (do not edit by hand): the same
commands and arguments as `mpp --help` and `mpp COMMAND --help`, and the same keys, defaults and meanings as
`mpp pretrain --help`, whose meanings name the values a key with a fixed set of them takes. Set the keys in a
`--config` YAML file or as `key=value` on the command line; `--print-config` shows what a run would get.

Besides the config, `pretrain` and `finetune` take what to do with a run already in `output_dir`: `--resume`
continues it from its newest checkpoint that verifies (refused where `output_dir` holds no run), `--resume auto`
continues it where `output_dir` holds a checkpoint and starts a fresh run where it holds none (one command for a
cluster job's first submission and every requeue), `--overwrite` starts over there; without any of them an
`output_dir` holding a run's checkpoints is refused.
"""


def argument_name(action: argparse.Action) -> str:
    """How a command line writes the argument: `--top-k TOP_K`, `--to FORMAT DIR`, `--resume`, `IMAGE_OR_FOLDER`."""
    if not action.option_strings:
        return action.metavar or action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = action.metavar or action.dest.upper()
    return f"{', '.join(action.option_strings)} {' '.join(metavar) if isinstance(metavar, tuple) else metavar}"


def command_reference() -> str:
    """Each command of COMMANDS: its one-line help, then its arguments and their meanings, as its --help gives them
    (the shipped configs' folder written as in a checkout, `configs/`)."""
    commands = argparse.ArgumentParser(prog="mpp").add_subparsers()
    sections = ["| command | what it does |", "|---|---|", *(f"| `{name}` | {c.help} |" for name, c in COMMANDS.items())]
    for name, command in COMMANDS.items():
        rows = [(argument_name(action), (action.help or "") % {"default": action.default})
                for action in add_command(commands, name, command) if action.help != argparse.SUPPRESS]
        keys = " and every run-config key below as `key=value`" if command.config else ""
        sections += ["", f"### `mpp {name}`", "", f"{command.help[0].upper()}{command.help[1:]}. Arguments{keys}:", "",
                     "| argument | meaning |", "|---|---|", *(f"| `{arg}` | {meaning} |" for arg, meaning in rows)]
    return "\n".join(sections).replace(f"{CONFIGS}/", "configs/")


def table(rows: list[tuple[str, str, str]]) -> str:
    return "\n".join(["| key | default | meaning |", "|---|---|---|",
                      *(f"| `{key}` | `{default}` | {meaning} |" for key, default, meaning in rows)])


def plan_reference() -> list[tuple[str, str, str]]:
    """(key, default as JSON, description) of every comparison-plan setting."""
    return [(name, json.dumps(field.get_default(call_default_factory=True)), field.description)
            for name, field in CompareConfig.model_fields.items()]


def reference_markdown() -> str:
    return "\n".join([
        HEADER,
        "## Commands",
        "",
        command_reference(),
        "",
        "## Run configs",
        "",
        f"{', '.join(f'`{name}`' for name, command in COMMANDS.items() if command.config)}:",
        "",
        table(config_reference()),
        "",
        "## Comparison plans",
        "",
        "`compare`; the `common`, `pretrain` and `finetune` sections hold run-config keys as above:",
        "",
        table(plan_reference()),
        "",
    ])


if __name__ == "__main__":
    REFERENCE.write_text(reference_markdown())
    print(f"wrote {REFERENCE}", file=sys.stderr)
