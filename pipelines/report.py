"""The comparison's report: report.md (its tables, gaps and the paper's numbers for reference) and comparison.png
(the fine-tuning curves), from the results compare.run gathered."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.config import Config

if TYPE_CHECKING:
    from pipelines.compare import CompareConfig

COLORS = {"mpp": (214, 39, 40), "supervised": (31, 119, 180), "scratch": (90, 90, 90)}  # of each arm in comparison.png
PAPER = ("The paper (Dosovitskiy et al., 2021, section 4.6): ViT-B/16 pretrained with MPP on JFT-300M for 1M steps at "
         "batch 4096 (~14 epochs) and fine-tuned on ImageNet reaches **79.9%** top-1: **+2%** over training from "
         "scratch and **4% below** supervised pretraining on JFT. That is ~4 billion pretraining images and a "
         "86M-parameter model, orders of magnitude beyond the runs above.")


def training_time(run_dir: Path) -> float:
    """Seconds between the first and last logged training step of run_dir, summed over its TensorBoard event
    files (one per invocation), so a resumed run counts all its parts and not the pause between them."""
    total = 0.0
    for events in run_dir.rglob("events.out.tfevents*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0}).Reload()
        if "train/lr" in accumulator.Tags()["scalars"]:
            times = [e.wall_time for e in accumulator.Scalars("train/lr")]
            total += max(times) - min(times)
    return total


def val_shards_name(cfg: Config) -> str:
    return f"data.val_shards ({cfg.data.val_shards})"


def percent_with_spread(test: dict) -> str:
    return f"{100 * test['top1']:.2f}%" + (f" ± {100 * test['top1_std']:.2f}" if test["top1_std"] is not None else "")


def report_markdown(report: dict, cc: CompareConfig, base: Config) -> str:
    out = Path(cc.output_dir)
    arms, grid, seeds = report["arms"], report["recipes"], report["seeds"]
    shots = sorted({int(n) for e in arms.values() for n in e["fewshot"] if n.isdigit()})
    evaluated_on = "the dev split" if report["select_on_dev"] else val_shards_name(base)
    seeds_note = f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    head = ["run", "pretraining objective", "pretraining images seen", "fine-tuning recipe", "fine-tuning images seen",
            "wall time (s)", *(["dev top-1"] if report["select_on_dev"] else []), f"top-1 (evaluation shards, {seeds_note})",
            *[f"{n}-shot" for n in shots]]
    lines = ["# MPP vs supervised pretraining vs scratch", "",
             f"Fine-tuning: {base.train.steps} steps at batch {base.train.batch_size}, warmup {base.train.warmup_steps}, "
             f"then cosine; "
             + (f"each arm's recipe picked from the {len(grid)} of the grid below by top-1 on a dev split "
                f"({cc.dev_fraction:.0%} of {base.data.shards}, held out of fine-tuning), so no arm is held to a recipe "
                f"that suits another." if report["select_on_dev"]
                else f"one recipe ({base.train.optimizer}, lr {base.train.lr:g}) for every arm (no dev split: set `grid` "
                     f"or `lrs` for per-arm selection)."),
             f"Top-1 on the evaluation shards: the picked recipe fine-tuned with {seeds_note}.",
             f"Few-shot: ridge regression onto +-1 targets from frozen {base.fewshot.features} features, examples drawn "
             f"from the downstream training shards, mean of {base.fewshot.draws} draws, scored on {val_shards_name(base)}.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, e in arms.items():
        pre = e["pretrain"] or {}
        wall = (training_time(out / "pre" / arm) if pre else 0) + training_time(Path(e["run"]))
        row = [arm, e["objective"], f"{pre['images_seen']:,}" if pre else "0", e["recipe"],
               f"{e['finetune']['images_seen']:,}", f"{wall:.0f}",
               *([f"{100 * e['dev_top1']:.2f}%"] if report["select_on_dev"] else []), percent_with_spread(e["test"]),
               *[f"{100 * e['fewshot'][str(n)]:.1f}%" for n in shots]]
        lines.append("| " + " | ".join(row) + " |")
    if report["select_on_dev"]:
        lines += ["", "## The whole grid (dev top-1; the pick of each arm in bold)", "",
                  "| recipe | " + " | ".join(arms) + " |", "|" + "---|" * (len(arms) + 1)]
        for name in grid:
            cells = [f"**{100 * e['grid'][name]:.2f}%**" if e["recipe"] == name else f"{100 * e['grid'][name]:.2f}%"
                     for e in arms.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Recipes (run names under `ft/<arm>/`; keys on top of the plan's `finetune` section):", ""]
    lines += [f"- `{name}`: " + (", ".join(f"{k}={v}" for k, v in recipe.items()) or "the plan's finetune section as it is")
              for name, recipe in grid.items()]
    lines += ["", "## Gaps", ""]
    for g in report["gaps"]:
        a, b = g["arms"]
        verdict = ("one seed: no spread to judge the gap by (set `seeds`)" if g["spread"] is None else
                   f"{'exceeds' if g['exceeds_spread'] else 'does not exceed'} the spread (sum of the two std, {100 * g['spread']:.2f})")
        lines.append(f"- {a} - {b}: {100 * g['gap']:+.2f} points top-1; {verdict}.")
    lines += ["", f"Wall time: pretraining plus the picked fine-tuning run, from the first to the last logged training step "
              f"of each (TensorBoard event times, summed over resumed parts). Curves ({evaluated_on}) in comparison.png; every "
              f"run in TensorBoard (`tensorboard --logdir {cc.output_dir}`).", "", "## For reference", "", PAPER, ""]
    return "\n".join(lines)


def line_chart(series: dict[str, list[list[float]]], path: Path, title: str, xlabel: str, ylabel: str,
               size: tuple[int, int] = (720, 440)) -> None:
    """A plain line chart of (step, value) series as a PNG, drawn with Pillow (no plotting dependency)."""
    width, height = size
    left, right, top, bottom = 70, 150, 40, 50
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.font = ImageFont.load_default(size=13)
    points = [p for s in series.values() for p in s] or [[0, 0], [1, 1]]
    x_max = max(p[0] for p in points) or 1
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    y_lo, y_hi = max(0.0, y_lo - 0.05), min(1.0, y_hi + 0.05) if y_hi > y_lo else y_lo + 0.1

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + step / x_max * (width - left - right),
                height - bottom - (value - y_lo) / (y_hi - y_lo) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for i in range(6):
        value, step = y_lo + i * (y_hi - y_lo) / 5, i * x_max / 5
        _, y = xy(0, value)
        x, _ = xy(step, y_lo)
        draw.line([left, y, width - right, y], fill=(225, 225, 225))
        draw.text((left - 8, y), f"{100 * value:.0f}%", fill="black", anchor="rm")
        draw.text((x, height - bottom + 6), f"{step:.0f}" if x_max >= 10 else f"{step:.1f}", fill="black", anchor="ma")
    draw.text((width / 2 - right / 2, 12), title, fill="black", anchor="ma")
    draw.text((left + (width - left - right) / 2, height - 18), xlabel, fill="black", anchor="ma")
    draw.text((8, top - 20), ylabel, fill="black")
    for i, (name, curve) in enumerate(series.items()):
        color = COLORS.get(name, (0, 150, 0))
        line = [xy(step, value) for step, value in sorted(curve)]
        if len(line) > 1:
            draw.line(line, fill=color, width=2)
        for x, y in line:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        draw.line([width - right + 15, top + 20 + 22 * i, width - right + 40, top + 20 + 22 * i], fill=color, width=3)
        draw.text((width - right + 46, top + 20 + 22 * i), name, fill="black", anchor="lm")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
