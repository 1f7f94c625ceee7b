"""The comparison's figure, drawn with matplotlib from plain data (no run directories read here).

Drawn on an explicit Figure with the Agg canvas, never through pyplot, so it needs no display and leaves no global
figure state behind in a long compare process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpp.rundir import written_whole

Curve = Sequence[Sequence[float]]  # [[step, value], ...]
# The pretraining curves drawn, in order: tag -> (panel title, scale of the logged value).
PRETRAIN_PANELS = {"val/pretext_loss": ("val/pretext_loss", 1), "val/loss": ("validation val/loss", 1),
                   "knn/top1": ("kNN top-1 (%)", 100)}


def arm_colours(arms: Sequence[str]) -> dict[str, tuple]:
    """One colour per arm, in order: tab10's while there are at most 10 arms, else evenly along turbo."""
    if len(arms) <= 10:
        return {arm: colormaps["tab10"](i) for i, arm in enumerate(arms)}
    return {arm: colormaps["turbo"](i / (len(arms) - 1)) for i, arm in enumerate(arms)}


def seed_band(curves: Mapping[object, Curve]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-seed (step, value) curves -> steps, the mean over seeds and the min and max over seeds at each step (a
    step counts the seeds that logged it)."""
    at: dict[float, list[float]] = {}
    for curve in curves.values():
        for step, value in curve:
            at.setdefault(step, []).append(value)
    steps = np.array(sorted(at))
    values = [np.array(at[step]) for step in steps]
    return (steps, np.array([v.mean() for v in values]), np.array([v.min() for v in values]),
            np.array([v.max() for v in values]))


def draw_finetuning(ax: Axes, finetune: Mapping[str, Mapping[object, Curve]], colours: dict[str, tuple], ylabel: str) -> None:
    for arm, curves in finetune.items():
        steps, mean, low, high = seed_band(curves)
        seeds = len(curves)
        ax.plot(steps, 100 * mean, marker="o", markersize=3, color=colours[arm],
                label=f"{arm} (mean of {seeds} seeds)" if seeds > 1 else arm)
        if seeds > 1:
            ax.fill_between(steps, 100 * low, 100 * high, color=colours[arm], alpha=0.2, linewidth=0)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel(f"{ylabel} (%)")
    ax.set_title(f"(a) fine-tuning: {ylabel}" + (", band: min-max over seeds" if any(len(c) > 1 for c in finetune.values()) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def draw_gaps(ax: Axes, gaps: Sequence[Mapping]) -> None:
    """Each gap (percentage points) with its interval as a horizontal error bar, the first at the top."""
    rows = np.arange(len(gaps))[::-1]
    gap = np.array([100 * g["gap"] for g in gaps])
    low, high = np.array([100 * g["low"] for g in gaps]), np.array([100 * g["high"] for g in gaps])
    ax.errorbar(gap, rows, xerr=[gap - low, high - gap], fmt="o", color="black", capsize=4)
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_yticks(rows, [f"{g['arms'][0]} − {g['arms'][1]}" for g in gaps])
    ax.set_ylim(-0.7, len(gaps) - 0.3)
    ax.set_xlabel("test top-1 gap (points)")
    confidence = {g.get("confidence", 0.95) for g in gaps}
    ax.set_title(f"(c) test top-1 gaps, {'/'.join(f'{100 * c:g}%' for c in sorted(confidence))} paired bootstrap intervals")
    ax.grid(axis="x", alpha=0.3)


def saved(figure: Figure, path: str | Path) -> tuple[Path, Path]:
    """`figure` written as path.png and path.svg (the folder made as needed), each whole; the two files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(".png"), path.with_suffix(".svg")
    for file in written:
        written_whole(file, lambda temporary: figure.savefig(temporary, dpi=120, format=file.suffix[1:]))
    return written


def comparison_figure(finetune: Mapping[str, Mapping[object, Curve]], pretraining: Mapping[str, Mapping[str, Curve]],
                      gaps: Sequence[Mapping], path: str | Path, ylabel: str = "dev top-1") -> tuple[Path, Path]:
    """Draw the comparison and write it as path.png and path.svg (the same figure; `path`'s own suffix, if any, is
    replaced); returns both paths.

    finetune: {arm: {seed: [[step, top1], ...]}}, top-1 as fractions of 1: panel (a), each arm's mean over seeds as
    a line with the min-max band over seeds. pretraining: {arm: {tag: [[step, value], ...]}}: panel (b), a small
    panel per pretrained arm and tag of PRETRAIN_PANELS; arms and tags absent are skipped. gaps: [{"arms": [a, b],
    "gap", "low", "high", optionally "confidence"}], fractions of 1 (as `mpp.evaluation.stats.GapInterval` holds them): panel
    (c), left out when empty.
    """
    arms = [*finetune, *(arm for arm in pretraining if arm not in finetune)]
    colours = arm_colours(arms)
    panels = {arm: [tag for tag in PRETRAIN_PANELS if pretraining[arm].get(tag)] for arm in pretraining}
    panels = {arm: tags for arm, tags in panels.items() if tags}
    columns = max((len(tags) for tags in panels.values()), default=0)

    gaps_height = 0.35 * len(gaps) + 1.2  # inches: a row per gap and room for the axis
    figure = Figure(figsize=(11 if panels else 7, max(4 + (gaps_height if gaps else 0), 2.2 * len(panels))),
                    layout="constrained")
    FigureCanvasAgg(figure)
    main, side = figure.subfigures(1, 2, width_ratios=[3, 2]) if panels else (figure, None)
    heights = [4, gaps_height] if gaps else [1]
    axes = main.subplots(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    draw_finetuning(axes[0], finetune, colours, ylabel)
    if gaps:
        draw_gaps(axes[1], gaps)
    if side is not None:
        side.suptitle("(b) pretraining", fontsize="medium")
        small = side.subplots(len(panels), columns, squeeze=False)
        for row, (arm, tags) in zip(small, panels.items()):
            for ax, tag in zip(row, tags):
                title, scale = PRETRAIN_PANELS[tag]
                steps, values = np.array(pretraining[arm][tag], dtype=float).T
                ax.plot(steps, scale * values, marker="o", markersize=2, color=colours[arm])
                ax.set_title(f"{arm}: {title}", fontsize="small")
                ax.tick_params(labelsize="x-small")
                ax.grid(alpha=0.3)
            for ax in row[len(tags):]:
                ax.set_visible(False)
            row[0].set_xlabel("pretraining step", fontsize="x-small")

    return saved(figure, path)


def label_efficiency_figure(result: Mapping, path: str | Path) -> tuple[Path, Path]:
    """The label-efficiency curve of a plan with label budgets (results.json's content): (a) each arm's test top-1
    against the budget, the mean over seeds with the min-max band over seeds; (b) each gap against the budget with its
    paired 95% interval as an error bar, a line at 0. Written as path.png and path.svg."""
    budgets = result["budgets"]
    names = list(budgets)
    x = np.arange(len(names))
    arms = list(budgets[names[0]]["arms"])
    colours = arm_colours(arms)
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    curve, gaps = figure.subplots(1, 2)
    for arm in arms:
        tests = [budgets[name]["arms"][arm]["test"] for name in names]
        seeds = [np.array(list(test["top1_seeds"].values())) for test in tests]
        curve.plot(x, [100 * test["top1"] for test in tests], marker="o", color=colours[arm], label=arm)
        if any(len(s) > 1 for s in seeds):
            curve.fill_between(x, [100 * s.min() for s in seeds], [100 * s.max() for s in seeds], color=colours[arm],
                               alpha=0.2, linewidth=0)
    curve.set_xticks(x, names)
    curve.set_xlabel(f"label budget ({result['kind']})")
    curve.set_ylabel("test top-1 (%)")
    curve.set_title("(a) test top-1 per label budget, band: min-max over seeds")
    curve.grid(alpha=0.3)
    curve.legend(fontsize="small")
    pairs = [g["arms"] for g in budgets[names[0]]["gaps"]]
    for i, pair in enumerate(pairs):
        found = [next(g for g in budgets[name]["gaps"] if g["arms"] == pair) for name in names]
        gap = np.array([100 * g["gap"] for g in found])
        low, high = np.array([100 * g["low"] for g in found]), np.array([100 * g["high"] for g in found])
        offset = (i - (len(pairs) - 1) / 2) * 0.08  # pairs side by side at each budget
        gaps.errorbar(x + offset, gap, yerr=[gap - low, high - gap], fmt="o", capsize=4, label=f"{pair[0]} − {pair[1]}")
    gaps.axhline(0, color="grey", linewidth=1)
    gaps.set_xticks(x, names)
    gaps.set_xlabel(f"label budget ({result['kind']})")
    gaps.set_ylabel("test top-1 gap (points)")
    gaps.set_title("(b) gaps with their paired 95% intervals")
    gaps.grid(alpha=0.3)
    if pairs:
        gaps.legend(fontsize="small")
    return saved(figure, path)


def pretrain_length_figure(result: Mapping, path: str | Path) -> tuple[Path, Path]:
    """Each pretrained arm's gap over scratch against its pretraining length (pretrain_length.json's content), with
    its paired 95% interval as an error bar and a line at 0; one panel per label budget. Written as path.png and .svg."""
    budgets = result["budgets"]
    multiples = [float(m) for m in result["multiples"]]
    figure = Figure(figsize=(5.5 * len(budgets), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = np.atleast_1d(figure.subplots(1, len(budgets)))
    for ax, (budget, arms) in zip(axes, budgets.items()):
        colours = arm_colours(list(arms))
        for i, (arm, entry) in enumerate(arms.items()):
            points = list(entry["points"].values())
            gap = np.array([100 * p["gap"] for p in points])
            low, high = np.array([100 * p["low"] for p in points]), np.array([100 * p["high"] for p in points])
            x = np.array(multiples) * 1.04 ** (i - (len(arms) - 1) / 2)  # arms side by side at each length
            ax.errorbar(x, gap, yerr=[gap - low, high - gap], fmt="o-", capsize=4, color=colours[arm], label=f"{arm} − scratch")
        ax.axhline(0, color="grey", linewidth=1)
        ax.set_xscale("log")
        ax.set_xticks(multiples, [f"x{m:g}" for m in multiples])
        ax.minorticks_off()
        ax.set_xlabel("pretraining length (multiple of the plan's pretraining steps)")
        ax.set_ylabel("test top-1 gap over scratch (points)")
        ax.set_title(f"label budget {budget}: gaps, paired 95% intervals" if budget else "gaps with their paired 95% intervals")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return saved(figure, path)
