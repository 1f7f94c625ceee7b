"""What a run logs: every scalar is declared once, as a Metric, by the part that computes it.

The loop declares its own (LOOP_METRICS in mpp/training/meters.py), an objective those of its loss (through its target, for
MPP), an evaluator those it scores. TensorBoard's Custom Scalars layout, HParams' metric columns, the progress bar,
results.json and the model card are all built from these declarations: a part that declares a metric shows up in
each of them, and no other module spells its tag.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

@dataclass(frozen=True)
class Category:
    """A group of charts in TensorBoard's Custom Scalars, declared by the part that logs into it: its title, its place
    among the groups (by `order`: how the model does first, how the run runs last) and, for a group that measures the
    model rather than the run, its rank among results.json's final metrics and a model card's (held-out scores first)."""

    title: str
    order: int
    card_rank: int | None = None  # None: the run's own measures (speed, data, optimisation), left out of a model's results


# The groups more than one part logs into; a part with a group of its own declares it beside its metrics.
TRAINING = Category("training", order=10, card_rank=50)
VALIDATION = Category("pretext validation", order=20, card_rank=10)
EVALUATION = Category("evaluation", order=30, card_rank=0)

# Tags that more than one module reads (the loop writes them, the report or a test reads them back).
LR = "train/lr"
TOP1, TOP5 = "eval/top1", "eval/top5"
BALANCED_ACC = "eval/balanced_acc"  # the mean of the per-class top-1s (mpp.evaluation.per_class)
CLASS_TOP1 = "eval/class_top1/"  # + a class id: that class's top-1
PRETEXT_LOSS = "pretext_loss"  # MPP's loss, train/pretext_loss: its own name, so no chart mixes it with a classification loss
VAL_LOSS, VAL_PRETEXT_LOSS = "val/loss", f"val/{PRETEXT_LOSS}"
KNN_TOP1 = "knn/top1"
PROBE_TOP1 = "probe/top1"


@dataclass(frozen=True)
class Metric:
    """One logged scalar and where it shows."""

    tag: str  # the TensorBoard tag, e.g. "train/loss"
    category: Category  # its Custom Scalars group
    chart: str  # the chart's title within the category; metrics with one title are drawn on one chart
    headline: bool = False  # one of the few numbers that tell runs apart: an HParams metric column
    bar: str | None = None  # its label in the progress bar, if it is shown there
    percent: bool = False  # a fraction, shown as a percentage

    def show(self, value: float) -> str:
        return f"{value:.1%}" if self.percent else f"{value:.3f}"


def split_metric(split: str, name: str, chart: str, held_out: str = "held-out images", **options) -> Metric:
    """The metric `name` of an objective's loss on the `split` it is computed on: train (the training batches, as
    train/<name> in the training category) or val (the pretext validation, val/<name>, never in the bar, its chart
    titled with `held_out`: what the validation holds fixed)."""
    if split == "train":
        return Metric(f"train/{name}", TRAINING, chart, **options)
    return Metric(f"val/{name}", VALIDATION, f"{chart} ({held_out})", **{**options, "bar": None})


def layout(metrics: Iterable[Metric]) -> dict[str, dict[str, list[str]]]:
    """{category title: {chart title: [tag regexes]}} in the categories' order, each chart's tags in declaration order."""
    charts: dict[Category, dict[str, list[str]]] = {}
    for metric in metrics:
        charts.setdefault(metric.category, {}).setdefault(metric.chart, []).append(f"^{metric.tag}$")
    return {category.title: charts[category] for category in sorted(charts, key=lambda c: c.order)}


def model_metrics(metrics: Iterable[Metric], values: dict[str, float]) -> dict[str, float]:
    """The values of the metrics that measure the model (not the run's speed or data): held-out scores first, then
    the training ones (by their category's card_rank), each group in declaration order."""
    held_out_first = sorted((m for m in metrics if m.category.card_rank is not None), key=lambda m: m.category.card_rank)
    return {m.tag: values[m.tag] for m in held_out_first if m.tag in values}


def unique(metrics: Iterable[Metric]) -> list[Metric]:
    """Metrics by tag, first declaration kept."""
    seen: dict[str, Metric] = {}
    for metric in metrics:
        seen.setdefault(metric.tag, metric)
    return list(seen.values())
