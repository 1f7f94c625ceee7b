"""The evaluators as the run config knows them, without loading torch: EVALUATORS names every evaluator once.

Each Registration holds the stages it runs in, how often (read from its own config section; 0 turns it off), its
builder and that section. The builder, "module:name" imported when a training stage builds its evaluators (or the
builder itself), is called once, before training, as build(cfg, accelerator, stage) and returns what the loop calls
as evaluate(objective, step) -> {tag: value} (the contract: pipelines.evaluations.evaluators.Evaluate). The built-in
evaluators' sections are the library's (mpp.evaluation.settings, registered when `mpp` is imported); an evaluator
added here with a section of its own registers it below. Adding an evaluator is its class, its builder and one line
in EVALUATORS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpp.config import Config, SECTION_SOURCES, Section, section_field
from mpp.evaluation.settings import EvalConfig, FewShotConfig, InspectConfig, KnnConfig, ProbeConfig


@dataclass(frozen=True)
class Registration:
    """One evaluator: the stages it runs in, its period in steps from its config section (0: off), its builder
    ("module:name", or the callable itself) and its config section as (key, Section class), which the run config then
    holds (None: it reads others')."""

    stages: tuple[str, ...]
    every: Callable[[Config], int]
    build: str | Callable
    section: tuple[str, type[Section]] | None = None


BUILDERS = f"{__package__}.evaluators"  # pipelines.evaluations, or mpp.pipelines.evaluations installed

EVALUATORS: dict[str, Registration] = {
    "top1": Registration(("finetune",), lambda cfg: cfg.finetune.eval_every, f"{BUILDERS}:TopK"),
    "fewshot": Registration(("pretrain",), lambda cfg: cfg.fewshot.every, f"{BUILDERS}:fewshot", ("fewshot", FewShotConfig)),
    "knn": Registration(("pretrain",), lambda cfg: cfg.knn.every, f"{BUILDERS}:knn", ("knn", KnnConfig)),
    "probe": Registration(("pretrain",), lambda cfg: cfg.probe.every, f"{BUILDERS}:probe", ("probe", ProbeConfig)),
    "pretext": Registration(("pretrain",), lambda cfg: cfg.eval.every if cfg.data.val_shards else 0, f"{BUILDERS}:Pretext",
                            ("eval", EvalConfig)),
    "inspect": Registration(("pretrain", "finetune"), lambda cfg: cfg.inspect.every, f"{BUILDERS}:inspect", ("inspect", InspectConfig)),
}
# The built-in sections are registered already (the same fields again change nothing); a new evaluator's are added.
SECTION_SOURCES.append(lambda: {key: section_field(section) for key, section in
                                (r.section for r in EVALUATORS.values() if r.section)})
