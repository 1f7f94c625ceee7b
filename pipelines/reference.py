"""The config reference, docs/reference.md, generated from the schemas: every run-config key (the core sections and
every registered part's) and every comparison-plan key, with its default and meaning. A new part's settings appear
there when it is registered; `python -m pipelines.reference` rewrites the file (tests/test_config_model.py fails while
it is stale).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpp.config import config_reference
from . import parts  # noqa: F401  (every part's section)
from .comparison.plan import CompareConfig

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"

HEADER = """# Config reference

Generated from the schemas by `python -m pipelines.reference` (do not edit by hand): the same keys, defaults and
meanings as `mpp pretrain --help`, whose meanings name the values a key with a fixed set of them takes. Set them in
a `--config` YAML file or as `key=value` on the command line; `--print-config` shows what a run would get.

Besides the config, `pretrain` and `finetune` take what to do with a run already in `output_dir`: `--resume`
continues it from its newest checkpoint that verifies (refused where `output_dir` holds no run), `--resume auto`
continues it where `output_dir` holds a checkpoint and starts a fresh run where it holds none (one command for a
cluster job's first submission and every requeue), `--overwrite` starts over there; without any of them an
`output_dir` holding a run's checkpoints is refused.
"""


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
        "## Run configs",
        "",
        "`pretrain`, `finetune`, `fewshot`, `knn`, `probe`, `inspect`, `export`, `predict`:",
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
