"""The comparison's report.md: its tables, every gap with its paired interval, what the dev split could resolve,
and the paper's numbers for reference, from the results compare.run gathered (the figure is pipelines/plots.py's)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.config import Config
from mpp.evaluation.baselines import beside, not_above
from mpp.evaluation.stats import (assumed_design_effect, design_effect, disagreement, gap_resolution, images_to_resolve,
                                 seeds_needed)
from mpp.metrics import KNN_TOP1, LR, VAL_LOSS, VAL_PRETEXT_LOSS
from .groups import key_groups
from .plan import CompareConfig

PRIOR = "_prior"  # a metric's baseline that knows nothing (the batch's most frequent colour, its mean pixels)
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
        if LR in accumulator.Tags()["scalars"]:
            times = [e.wall_time for e in accumulator.Scalars(LR)]
            total += max(times) - min(times)
    return total


# What the report shows of each pretraining run, step by step: its validation loss (MPP's pretext loss, or supervised
# pretraining's classification loss) and kNN top-1.
PRETRAIN_CURVES = (VAL_PRETEXT_LOSS, VAL_LOSS, KNN_TOP1)


def scalar_history(run_dir: Path, tags: tuple[str, ...]) -> dict[str, list[list[float]]]:
    """{tag: [[step, value], ...]} of the TensorBoard scalars `tags` logged under run_dir, over every event file (a
    resumed run's parts; where two logged one step, the later file wins), sorted by step; tags never logged are left out."""
    series: dict[str, dict[int, float]] = {}
    for events in sorted(run_dir.rglob("events.out.tfevents*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0}).Reload()
        for tag in set(tags) & set(accumulator.Tags()["scalars"]):
            series.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return {tag: [[step, value] for step, value in sorted(series[tag].items())] for tag in tags if tag in series}


def last_quarter_change(curve: list[list[float]]) -> float | None:
    """How much a curve's value moved over the last quarter of its steps: the last value minus the value at 75% of
    the steps (the nearest logged step at or before it); None for a curve too short to tell."""
    if len(curve) < 3:
        return None
    last_step, last = curve[-1]
    before = [value for step, value in curve if step <= 0.75 * last_step]
    return last - before[-1] if before else None


def heading(title: str, cc: CompareConfig) -> list[str]:
    """A report's first lines: its title, then the plan's note where it has one."""
    return [f"# {title}", ""] + ([f"> **Note:** {cc.note}", ""] if cc.note else [])


def design_record(cc: CompareConfig, test_keys: Collection[str], seeds: int, dev_images: int | None) -> dict:
    """What the plan's design resolves before it trains (results.json's `design`): its test images (grouped by
    image_groups, each group's images assumed answered alike) and seeds under the plan's assumed disagreement and seed
    spread, what its dev split resolves between candidates, and what a missed `target_gap` would need."""
    test_images, groups = len(test_keys), key_groups(cc.image_groups, test_keys)
    effect = assumed_design_effect(groups) if groups else 1.0
    planned = gap_resolution(test_images, seeds, cc.assumed_disagreement, cc.assumed_seed_std, design_effect=effect)
    record = {"test_images": test_images, "seeds": seeds, "dev_images": dev_images, "target_gap": cc.target_gap,
              "test_groups": len(set(groups)) if groups else None,
              "planned": asdict(planned),
              # A candidate is one run scored on the dev images: the images alone, no seed term.
              "dev_resolvable": gap_resolution(dev_images, 1, cc.assumed_disagreement).resolvable if dev_images else None}
    return {**record, **target_needs(cc.target_gap, planned)}


def target_needs(target: float | None, resolution) -> dict:
    """Whether `resolution` reaches `target`, and where it does not, the test images (at its seeds) or seeds it needs."""
    if target is None:
        return {}
    images = images_to_resolve(target, resolution.seeds, resolution.disagreement, resolution.seed_std,
                               design_effect=resolution.design_effect)
    return {"meets_target": resolution.resolvable <= target, "images_needed": images, "grouped": resolution.design_effect > 1,
            "seeds_needed": None if images is not None else seeds_needed(target, resolution.seed_std)}


def observed_resolution(correct_a: list, correct_b: list, test_a: dict, test_b: dict, cc: CompareConfig, groups: list | None) -> dict:
    """The smallest gap this pair resolved, from the disagreement its runs showed, its seeds' spread (the root mean
    square of the two arms' standard deviations; the plan's assumed_seed_std where an arm has one seed) and the design
    effect its grouped test images showed, with what a missed target_gap would need."""
    stds = [test["top1_std"] for test in (test_a, test_b)]
    seed_std = (sum(std**2 for std in stds) / 2) ** 0.5 if None not in stds else cc.assumed_seed_std
    seeds = min(len(correct_a), len(correct_b))
    resolution = gap_resolution(len(correct_a[0]), seeds, disagreement(correct_a, correct_b), seed_std,
                                design_effect=design_effect(correct_a, correct_b, groups) if groups else 1.0)
    return {**asdict(resolution), "seed_std_assumed": None in stds, "target_gap": cc.target_gap,
            **target_needs(cc.target_gap, resolution)}


def target_line(record: dict, resolvable: float) -> str | None:
    """The one line of a design (or an observed comparison) that resolves only gaps wider than its target."""
    if record.get("meets_target", True):
        return None
    target = 100 * record["target_gap"]
    need = (f"about {record['images_needed']:,} test images{' grouped as these are' if record.get('grouped') else ''} "
            f"at {record['seeds']} seed(s) would resolve it"
            if record["images_needed"] is not None else
            f"the seeds' spread alone is too wide for it at {record['seeds']} seed(s): it needs at least "
            f"{record['seeds_needed']} seeds per arm, and then enough test images")
    return (f"this comparison resolves gaps of {100 * resolvable:.2f} points, wider than its target_gap of "
            f"{target:.2f} points; {need}.")


def design_lines(record: dict) -> list[str]:
    """The design's resolution in words: printed at compare's start and by --dry-run, and in the report."""
    planned = record["planned"]
    grouped = (f" in {record['test_groups']:,} groups (image_groups), each group's images assumed answered alike, so "
               f"they count as {record['test_images'] / planned['design_effect']:,.0f} independent images"
               if record.get("test_groups") else "")
    lines = [f"{record['test_images']:,} test images{grouped} and {record['seeds']} seed(s) per arm; assuming two arms' runs "
             f"disagree on {planned['disagreement']:.0%} of the test images and an arm's top-1 moves by "
             f"{100 * planned['seed_std']:.2f} points (std) between seeds, an observed gap beyond "
             f"±{100 * planned['half_width']:.2f} points is resolved (its 95% interval excludes 0), and a true gap of "
             f"{100 * planned['resolvable']:.2f} points is resolved 4 times in 5 (80% power)."]
    if record["dev_images"]:
        lines.append(f"The dev images ({record['dev_images']:,}) tell two candidates apart, 4 times in 5, when they "
                     f"differ by {100 * record['dev_resolvable']:.2f} points or more (at the same disagreement).")
    for name, budget in record.get("budgets", {}).items():
        picks = (f"{budget['folds']}-fold cross-validation over all {budget['images']:,}" if budget["folds"] else
                 f"a dev split of {budget['dev_images']:,} of its {budget['images']:,} labelled images")
        lines.append(f"Budget {name} ({budget['images']:,} labelled images) picks by {picks}, which tell two candidates "
                     f"apart, 4 times in 5, when they differ by {100 * budget['dev_resolvable']:.2f} points or more.")
    if most := record.get("most_training"):
        lines.append(f"At most {most['pretrain_steps']:,} pretraining steps and {most['finetune_runs']:,} fine-tuning runs "
                     f"of {most['finetune_steps']:,} steps in all: the bound, were every arm's length search to go on to "
                     f"its cap and every candidate to be near-best; multiply by a run's seconds per step to size the plan.")
        if (done := record.get("finished_training")) and (done["finetune_runs"] or done["pretrain_steps"]):
            lines.append(finished_line(done, most))
    if line := target_line(record, planned["resolvable"]):
        lines.append(f"warning: {line}")
    elif record["target_gap"] is not None:
        lines.append(f"That is within the target_gap of {100 * record['target_gap']:.2f} points.")
    return lines


def finished_line(done: dict, most: dict) -> str:
    """What a rerun of a plan reuses from its output_dir, and the most left to train, beside the bound."""
    left_ft = max(0, most["finetune_steps"] - done["finetune_steps"])
    left_pre = max(0, most["pretrain_steps"] - done["pretrain_steps"])
    pace = done["finetune_s"] / done["finetune_steps"] if done["finetune_steps"] else None
    hours = (f" (about {left_ft * pace / 3600:.1f} h of runs at the {pace:.3f} s a step the finished ones took over all "
             f"their starts; less in wall time where processes over disjoint arms run side by side)" if pace else "")
    return (f"Finished in {done['directory']} already, and reused by a rerun: {done['finetune_runs']:,} fine-tuning "
            f"runs of {done['finetune_steps']:,} steps and {done['pretrain_steps']:,} pretraining steps; left: at most "
            f"{left_ft:,} fine-tuning steps{hours} and {left_pre:,} pretraining steps.")


BUDGET_ARM_KEYS = ("test", "balanced_accuracy", "recipe", "length", "lengths", "at_longest_length", "longest_near_best")
BUDGET_GAP_KEYS = ("arms", "gap", "low", "high", "excludes_zero", "images", "sensitivity")


def budget_summary(report: dict) -> dict:
    """What the label-efficiency report keeps of one budget's report: each arm's scores and how long it fine-tuned,
    each gap with its interval and its verdict at the arms' near-best picks (the caveats travel with the gap)."""
    return {"arms": {arm: {k: e[k] for k in BUDGET_ARM_KEYS if k in e} for arm, e in report["arms"].items()},
            "gaps": [{k: g[k] for k in BUDGET_GAP_KEYS if k in g} for g in report["gaps"]]}


def budget_markdown(result: dict, cc: CompareConfig) -> str:
    """report.md of a plan with label budgets: each arm's test top-1 per budget, each gap at each budget with its
    paired 95% interval, the design's resolution and the test set's baselines; each budget's full report beside."""
    budgets, kind = result["budgets"], result["kind"]
    arms = list(next(iter(budgets.values()))["arms"])
    seeds = result["seeds"]
    seeds_note = f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    known = beside("", result["test_set"]["baselines"], lambda b: f"{100 * b:.2f}%").strip(" ()")
    lines = heading(f"Label efficiency: {' vs '.join(arms)}", cc)
    lines += [f"Each budget ({kind}) is a stratified draw of the labelled images, nested (each smaller draw inside every "
              f"larger one) and the same for every arm and seed; each arm was pretrained once, and at every budget its "
              f"recipe, length and seeds were picked and run as in a plan of its own (its report: budget-<budget>/report.md). "
              f"Test top-1 ({seeds_note}) on the same {result['test_set']['images']:,} test images at every budget; a "
              f"classifier that knows nothing scores {known} there.", ""]
    pairs = [g["arms"] for g in next(iter(budgets.values()))["gaps"]]
    head = ["budget", "labelled images", *arms, *[f"{a} − {b} (95% CI)" for a, b in pairs]]
    rows = []
    for name, budget in budgets.items():
        gaps = {tuple(g["arms"]): g for g in budget["gaps"]}
        rows.append([name, f"{budget['images']:,}", *[percent_with_spread(budget["arms"][arm]["test"]) for arm in arms],
                     *[f"{100 * g['gap']:+.2f} [{100 * g['low']:+.2f}, {100 * g['high']:+.2f}]" + (" resolved" if g["excludes_zero"] else "")
                       for g in (gaps[tuple(pair)] for pair in pairs)]])
    lines += table(head, rows) + [""]
    lines += ["A gap is resolved where its interval excludes 0; where it does not, the data cannot tell the arms apart "
              "at that budget, whatever the sign of the gap.", ""]
    for a, b in pairs:
        resolved = [name for name, budget in budgets.items() for g in budget["gaps"] if g["arms"] == [a, b] and g["excludes_zero"]]
        lines.append(f"- {a} − {b}: resolved at " + (", ".join(f"{name} ({'+' if g['gap'] > 0 else '-'})"
                     for name in resolved for g in budgets[name]["gaps"] if g["arms"] == [a, b]) if resolved else "no budget") + ".")
    caveats = [f"- Budget {name}, {' − '.join(g['arms'])}:{said}" for name, budget in budgets.items() for g in budget["gaps"]
               if (said := sensitivity_text(g) + short_loser_text(g, budget["arms"]))]
    if caveats:  # a gap in the table is its arms' picks; these say how far it rests on them and on a short arm
        lines += ["", "What a gap in the table rests on (each budget's report says more):", "", *caveats]
    lines += ["", "## What this comparison can resolve", "", " ".join(design_lines(result["design"])), ""]
    return "\n".join(lines)


def pretrain_length_markdown(result: dict, cc: CompareConfig) -> str:
    """pretrain_length.md: each pretrained arm's gap over scratch per pretraining length with its paired 95% interval
    (per label budget where the plan has budgets), and in words whether each curve still rises at the longest."""
    multiples = result["multiples"]
    lines = heading("Pretraining length: each gap over scratch", cc)
    lines += [f"Each pretrained arm pretrained at {', '.join(f'x{m}' for m in multiples)} its plan's pretraining steps, "
              f"each length its own run to its own schedule (warmup, then cosine to its last step), and the whole "
              f"fine-tuning side (picks, lengths, seeds, tests) run from each. x1 is the plan as it runs without this "
              f"axis (its report: report.md); x<m> lies in pretrain-x<m>/. Scratch is run once and paired with every "
              f"length. Each cell: test top-1 gap over scratch in points, with its paired 95% interval over the test "
              f"images and seeds; resolved where the interval excludes 0.", ""]
    for budget, arms in result["budgets"].items():
        if budget:
            lines += [f"## Label budget {budget}", ""]
        scratch = result["scratch"][budget]
        rows = [[arm, *[f"{100 * p['gap']:+.2f} [{100 * p['low']:+.2f}, {100 * p['high']:+.2f}]"
                        + (" resolved" if p["excludes_zero"] else "") + f" ({p['pretrain_steps']:,} steps)"
                        for p in (e["points"][m] for m in multiples)]] for arm, e in arms.items()]
        lines += table(["arm − scratch", *[f"x{m}" for m in multiples]], rows)
        lines += ["", f"Scratch: {percent_with_spread(scratch)} test top-1.", ""]
        lines += [rising_line(arm, e, multiples) for arm, e in arms.items()] + [""]
    lines += ["The curve still rises at the longest length when the arm's test top-1 grew over the last step up, its "
              "point estimate above 0, resolved or not (docs/statistics.md): a rise the interval does not resolve is no "
              "evidence that the curve has levelled off.", ""]
    return "\n".join(lines)


def rising_line(arm: str, entry: dict, multiples: list[str]) -> str:
    """In words: whether `arm`'s gap over scratch still rises at the longest pretraining length."""
    step = entry["rising_step"]
    if step is None:
        return f"- {arm}: one pretraining length, so no curve to say whether it still rises."
    before, last = multiples[-2:]
    shown = f"{100 * step['gap']:+.2f} points [{100 * step['low']:+.2f}, {100 * step['high']:+.2f}] from x{before} to x{last}"
    if step["rising"] and step["excludes_zero"]:
        return (f"- **{arm}: still rising at the longest pretraining length**, {shown}, resolved: pretraining longer "
                f"than x{last} may gain more.")
    if step["rising"]:
        return (f"- **{arm}: still rising at the longest pretraining length** by its point estimate, {shown}, not "
                f"resolved: it may or may not gain more; pretrain longer (or test on more images) to know.")
    fell = ", a resolved fall" if step["excludes_zero"] else ", not resolved"
    return f"- {arm}: not rising at the longest pretraining length, {shown}{fell}."


def val_shards_name(cfg: Config) -> str:
    return f"data.val_shards ({cfg.data.val_shards})"


def percent_with_spread(test: dict) -> str:
    return f"{100 * test['top1']:.2f}%" + (f" ± {100 * test['top1_std']:.2f}" if test["top1_std"] is not None else "")


def test_set_counts(test_set: dict) -> str:
    """'30 to 32 images per class', or 'N images per class' when every class has as many."""
    counts = test_set["per_class"].values()
    return (f"{min(counts):,} images per class" if min(counts) == max(counts)
            else f"{min(counts):,} to {max(counts):,} images per class")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(row) + " |" for row in rows)]


def never_learned(pretrain: dict | None) -> list[str]:
    """The pretext metrics a pretraining ended no better at than their prior (train/color_acc at or below
    train/color_acc_prior, train/pretext_loss at or above train/pretext_loss_prior): such an arm says nothing about its objective."""
    final = (pretrain or {}).get("final", {})
    flagged = []
    for prior_tag, prior in final.items():
        tag = prior_tag.removesuffix(PRIOR)
        if prior_tag.endswith(PRIOR) and tag in final:
            worse = final[tag] >= prior if "loss" in tag else final[tag] <= prior
            if worse:
                flagged.append(f"{tag} {final[tag]:.4g} against its prior's {prior:.4g}")
    return flagged


def selection_text(report: dict, cc: CompareConfig, base: Config) -> str:
    grid, info = report["recipes"], report["selection"]
    if not report["select_on_dev"]:
        (name, keys), = grid.items()  # a plan without a choice: one grid recipe, or the finetune section's own
        recipe = f"`{name}`, its keys below" if keys else f"{base.train.optimizer}, lr {base.train.lr:g}"
        return f"one recipe ({recipe}) for every arm (no dev split: give `grid` or `lrs` several for per-arm selection)."
    # One recipe is picked nothing of: its length is (the plan's `lengths`).
    picked = (f"each arm's recipe picked from the {len(grid)} of the grid below" if len(grid) > 1 else
              f"each arm's fine-tuning length picked for the one recipe (`{next(iter(grid))}`, its keys below)")
    if report["dev_folds"]:
        auto = info.get("auto_folds")
        why = (f" (`dev_folds: auto` chose k-fold: the set holds under {auto['below']} labelled images, too few for one "
               f"dev split to rank the candidates)" if auto else "")
        return (f"{picked} by {report['dev_folds']}-fold cross-validation over the {info['images']} labelled images of "
                f"{base.data.shards}{why} (every image scored once, by a run that did not train on it), then fine-tuned "
                f"on all of them, so no arm is held to a choice that suits another.")
    return (f"{picked} by top-1 on a dev split ({cc.dev_fraction:.0%} of {base.data.shards}, held out of fine-tuning), so "
            f"no arm is held to a choice that suits another.")


def gap_lines(report: dict, seeds: list[int]) -> list[str]:
    lines = ["## Gaps", "",
             "Each gap is the difference of mean test top-1, with its 95% interval from a paired bootstrap: the same test "
             "images resampled for both arms (that is the pairing), each arm's seeds resampled on their own "
             "(docs/statistics.md). An interval that excludes 0 resolves the gap; one that does not means the data "
             "cannot tell the arms apart. McNemar's exact test compares each seed's pair of runs on their discordant "
             "images.", ""]
    if pattern := report["config"].get("image_groups"):
        lines[-1:-1] = [f"The test images are grouped by image_groups {pattern!r} (renditions of one thing): the bootstrap "
                        f"resamples whole groups, and McNemar's test is the clustered one (Durkalski et al., 2003; "
                        f"chi-square, not exact).", ""]
    if not report["gaps"]:
        return lines + ["One arm: no gap to judge.", ""]
    for g in report["gaps"]:
        a, b = g["arms"]
        verdict = (f"excludes 0: {a if g['gap'] > 0 else b} is better" if g["excludes_zero"]
                   else "includes 0: the data cannot resolve this gap")
        mcnemar = ", ".join(f"seed {seed} p={m['p_value']:.3g} ({m['a_only']} vs {m['b_only']} discordant)" for seed, m in g["mcnemar"].items())
        spread = ("one seed: no seed spread to compare it with" if g["spread"] is None else
                  f"it {'exceeds' if g['exceeds_spread'] else 'does not exceed'} the spread of the seeds (sum of the two std, "
                  f"{100 * g['spread']:.2f})")
        lines.append(f"- {a} - {b}: {100 * g['gap']:+.2f} points top-1, 95% CI [{100 * g['low']:+.2f}, {100 * g['high']:+.2f}] "
                     f"over {g['images']} test images and {len(seeds)} seed(s): {verdict}. McNemar: {mcnemar}. Beside it, "
                     f"{spread}.{sensitivity_text(g)}{short_loser_text(g, report['arms'])}")
    return lines + [""]


def short_loser_text(gap: dict, arms: dict) -> str:
    """A resolved gap whose worse arm kept the longest fine-tuning it was given may be that arm's short training, not
    what the better arm brings: on Fashion-MNIST with 25 labels per class, scratch at 600 steps trailed MPP by 27
    points and at 2,400 by 4 (docs/results.md)."""
    if not gap["excludes_zero"]:
        return ""
    worse = gap["arms"][1] if gap["gap"] > 0 else gap["arms"][0]
    entry = arms.get(worse, {})
    if entry.get("at_longest_length"):
        why = f"kept the longest fine-tuning it was given (x{entry['length']}), where its dev top-1 may still have been rising"
    elif entry.get("longest_near_best"):
        why = (f"was fine-tuned no longer than x{longest_length(entry)}, which scored below its pick (x{entry['length']}) "
               f"by less than the dev split resolves: its dev top-1 may not have peaked")
    else:
        return ""
    return (f" **{worse}, the worse arm, {why}: part of this gap, or all of it, may be its short training; let the "
            f"length search go further (max_length) before reading it as what pretraining brings.**")


def longest_length(entry: dict) -> str:
    """The longest fine-tuning multiple an arm's length search tried, as its report names it."""
    return max(entry["lengths"], key=float)


VERDICTS = {1: "{a} is better", -1: "{b} is better", 0: "unresolved"}


def sensitivity_text(gap: dict) -> str:
    """Whether the gap's verdict depends on the picks: its verdict with each arm at each of its near-best candidates."""
    rows = gap.get("sensitivity")
    if not rows or len(rows) < 2:
        return ""
    a, b = gap["arms"]
    words = {v: text.format(a=a, b=b) for v, text in VERDICTS.items()}
    own = 0 if not gap["excludes_zero"] else (1 if gap["gap"] > 0 else -1)
    low, high = min(r["gap"] for r in rows), max(r["gap"] for r in rows)
    spread = (f" Sensitivity: with each arm at each of its near-best candidates ({len(rows)} combinations), the gap "
              f"runs from {100 * low:+.2f} to {100 * high:+.2f} points;")
    others = [r for r in rows if r["verdict"] != own]
    if not others:
        return spread + f" the verdict ({words[own]}) holds in every one."
    worst = others[0]
    return (spread + f" **the verdict depends on the pick**: {len(others)} of them give another verdict, e.g. {a} at "
            f"`{worst[a]}` and {b} at `{worst[b]}`: {100 * worst['gap']:+.2f} [{100 * worst['low']:+.2f}, "
            f"{100 * worst['high']:+.2f}] ({words[worst['verdict']]}).")


def pick_lines(report: dict) -> list[str]:
    """What the dev split could resolve, and which picks were ties."""
    if not report["select_on_dev"]:
        return []
    info, arms = report["selection"], report["arms"]
    resolution = report["dev_resolution"]
    if report["dev_folds"]:
        runs = report["dev_folds"] * len(report["recipes"])
        size = (f"{report['dev_folds']}-fold cross-validation over {resolution['images']} images: {runs} fine-tunings per "
                f"arm to score the grid (k per recipe), more for each longer length tried.")
    else:
        size = f"A dev split of {resolution['images']} images ({', '.join(f'{n} of class {c}' for c, n in info['dev_images_per_class'].items())})."
    tested = ("those are tested too, and each gap below says whether its verdict would change with them"
              if report["config"]["sensitivity"] else
              "this plan does not test those (sensitivity: false), so where a pick below is a tie, a gap's verdict may "
              "depend on it")
    lines = ["## The dev split and the picks", "",
             f"{size} One image is worth {100 * resolution['one_image']:.2f} points of top-1, and top-1's standard error "
             f"is up to ±{100 * resolution['standard_error']:.2f} points (at 50%). Each arm keeps the candidate with the "
             f"best dev top-1 (exactly equal scores go to the longer training, then the earlier in the grid). A candidate "
             f"is near-best when McNemar's exact test on the dev images cannot tell it from the pick (p >= 0.05); "
             f"{tested}.", ""]
    for arm, e in arms.items():
        for what, choice in (("recipe", e["pick"]), ("length", e["length_pick"] if e["lengths"] else {"p_value": {}})):
            if len(choice["p_value"]) < 2:
                continue
            others = [f"`{name}` (p={p:.2g})" for name, p in choice["p_value"].items() if name != choice["pick"]]
            if choice["tie"]:
                tied = ", ".join(f"`{name}`" for name in choice["tied"] if name != choice["pick"])
                lines.append(f"- {arm}, {what}: `{choice['pick']}`, **a tie** with {tied}: the split cannot tell them apart. "
                             f"Against the pick: {', '.join(others)}.")
            else:
                lines.append(f"- {arm}, {what}: `{choice['pick']}`, ahead of every other beyond what the split resolves: "
                             f"{', '.join(others)}.")
    return lines + [""]


def report_markdown(report: dict, cc: CompareConfig, base: Config) -> str:
    """report.md: the arms' results, then a section each for the frozen features, the pretraining curves, the
    fine-tuning lengths, the ablation, the pretraining lengths and the grid, then the recipes and the compute."""
    arms, seeds = report["arms"], report["seeds"]
    seeds_note = f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    shots = sorted({int(n) for e in arms.values() for n in e["frozen"]["cls"]["fewshot"]})
    lines = results_lines(report, cc, base, seeds_note)
    lines += frozen_lines(arms, base, shots)
    lines += curve_lines(arms)
    lines += length_lines(arms, base, cc)
    lines += ablation_lines(arms, seeds_note)
    for arm, e in arms.items():
        if e.get("checkpoints"):
            lines += checkpoint_lines(arm, e, shots, seeds_note)
    lines += grid_lines(report)
    lines += closing_lines(report, cc, base)
    return "\n".join(lines)


def results_lines(report: dict, cc: CompareConfig, base: Config, seeds_note: str) -> list[str]:
    """The title, the note and warnings, how fine-tuning ran and was picked, the arms' table, the gaps and picks."""
    arms, on_dev = report["arms"], report["select_on_dev"]
    lines = heading(' vs '.join(arms), cc)
    for arm, e in arms.items():
        if flagged := never_learned(e["pretrain"]):
            lines += [f"> **Warning:** the {arm} pretraining ended with {'; '.join(flagged)}: it never beat a guess that "
                      f"knows nothing, so this arm says nothing about its objective. Pretrain longer or check its data.", ""]
    test_set = report["test_set"]
    baseline = test_set["baselines"]
    known = beside("", baseline, lambda b: f"{100 * b:.2f}%").strip(" ()")
    lines += [f"Fine-tuning: {base.train.steps} steps at batch {base.train.batch_size}, warmup {base.train.warmup_steps}, "
              f"then cosine; {selection_text(report, cc, base)}",
              f"Top-1 on {val_shards_name(base)}: the picked recipe fine-tuned with {seeds_note}. The test set: "
              f"{test_set['images']:,} images of {len(test_set['per_class'])} classes "
              f"({test_set_counts(test_set)}); a classifier that knows nothing scores {known} there.", ""]
    balanced = test_set["imbalanced"]
    head = ["arm", "pretraining objective", "pretraining images seen", "fine-tuning recipe", "fine-tuning images seen",
            "wall time (s)", *(["dev top-1"] if on_dev else []), f"top-1 ({seeds_note}; {known})", "each seed",
            *([f"balanced accuracy (chance {100 * baseline['chance']:.2f}%)"] if balanced else [])]
    rows = []
    for arm, e in arms.items():
        pre = e["pretrain"] or {}
        wall = (training_time(Path(e["pretrain_run"])) if pre else 0) + training_time(Path(e["run"]))
        seen = f"{pre['images_seen']:,}" if pre else "elsewhere" if e.get("weights") else "0"
        rows.append([arm, e["objective"], seen, e["recipe"],
                     f"{e['finetune']['images_seen']:,}", f"{wall:.0f}", *([f"{100 * e['dev_top1']:.2f}%"] if on_dev else []),
                     f"**{percent_with_spread(e['test'])}**", " / ".join(f"{100 * t:.2f}" for t in e["test"]["top1_seeds"].values()),
                     *([f"{100 * e['balanced_accuracy']['mean']:.2f}%"] if balanced else [])])
    lines += table(head, rows)
    lines.append("")
    if balanced:
        lines += ["The test set's classes are imbalanced, so top-1 rewards the large classes: balanced accuracy (the "
                  "mean of each class's recall, on which any constant guess scores chance or less) is beside it.", ""]
    for arm, e in arms.items():
        if not_above("top1", e["test"]["top1"], baseline):
            lines += [f"> **Warning:** {arm}'s test top-1 ({100 * e['test']['top1']:.2f}%) is no better than a "
                      f"classifier that knows nothing ({known}): this arm learnt nothing the test set rewards.", ""]
    lines += gap_lines(report, report["seeds"])
    lines += control_lines(report)
    lines += resolution_lines(report)
    lines += pick_lines(report)
    return lines


def control_lines(report: dict) -> list[str]:
    """Each negative control's verdict against scratch: a pretraining on pure noise must give no resolved gain, or
    the comparison flatters pretraining."""
    lines = []
    for g in report["gaps"]:
        a, b = g["arms"]
        controls = [arm for arm in (a, b) if report["arms"][arm].get("control")]
        if len(controls) != 1 or "scratch" not in (a, b):
            continue
        control = controls[0]
        gain = g["gap"] if control == a else -g["gap"]
        low, high = (g["low"], g["high"]) if control == a else (-g["high"], -g["low"])
        shown = f"{100 * gain:+.2f} points [{100 * low:+.2f}, {100 * high:+.2f}]"
        if g["excludes_zero"] and gain > 0:
            lines.append(f"> **Warning:** the negative control {control} (pretrained on pure noise) came out ahead of "
                         f"scratch, {shown}: this comparison can show a gain where there is none to find, so do not "
                         f"trust its other gains over scratch until that is explained (a weak scratch recipe, a short "
                         f"scratch length).")
        else:
            lines.append(f"- Negative control: {control} (pretrained on pure noise) - scratch, {shown}: no resolved "
                         f"gain, as there should be none; the comparison is able to say no.")
    return ["## Negative control", "", *lines, ""] if lines else []


def resolution_lines(report: dict) -> list[str]:
    """What the design was planned to resolve, and what each gap's comparison resolved (docs/statistics.md)."""
    design = report["design"]
    planned = design_lines(design)
    lines = ["## What this comparison can resolve", "",
             "Planned, before any training: " + " ".join(line for line in planned if not line.startswith("warning: ")), "",
             *(f"> **Warning:** {line.removeprefix('warning: ')}\n" for line in planned if line.startswith("warning: "))]
    for g in report["gaps"]:
        a, b = g["arms"]
        r = g["resolution"]
        spread = (f"the plan's assumed seed spread of {100 * r['seed_std']:.2f} points (one seed: none observed)"
                  if r["seed_std_assumed"] else f"a seed spread of {100 * r['seed_std']:.2f} points (std)")
        lines.append(f"- {a} - {b}, observed: their runs disagree on {r['disagreement']:.1%} of the {r['test_images']:,} "
                     f"test images" + (f" (grouped, with an observed design effect of {r['design_effect']:.2f}: as "
                                       f"{r['test_images'] / r['design_effect']:,.0f} independent images)"
                                       if report["design"].get("test_groups") else "")
                     + f", with {spread}: an observed gap beyond ±{100 * r['half_width']:.2f} points is "
                     f"resolved, a true gap of {100 * r['resolvable']:.2f} points 4 times in 5."
                     + (f" **Short of the target:** {line}" if (line := target_line(r, r["resolvable"])) else ""))
    return lines + [""]


def frozen_lines(arms: dict, base: Config, shots: list[int]) -> list[str]:
    lines = ["", "## Frozen features", "",
             f"kNN (k={base.knn.k}, T={base.knn.temperature:g}) top-1 and few-shot ridge accuracy (mean of "
             f"{base.fewshot.draws} draws) of each arm's backbone before fine-tuning (scratch: a fresh one), read from "
             f"the [class] token (cls) and from the mean of the patch outputs (mean).", ""]
    lines += table(["arm", "kNN cls", "kNN mean", *[f"{n}-shot {pool}" for n in shots for pool in ("cls", "mean")]],
                   [[arm, f"{100 * e['frozen']['cls']['knn']:.2f}%", f"{100 * e['frozen']['mean']['knn']:.2f}%",
                     *[f"{100 * e['frozen'][pool]['fewshot'][str(n)]:.1f}%" for n in shots for pool in ("cls", "mean")]]
                    for arm, e in arms.items()])
    lines.append("")
    return lines + frozen_flags(arms, shots)


def frozen_flags(arms: dict, shots: list[int]) -> list[str]:
    """Each pretrained (or given-weights) arm's frozen-feature score at or below the random-init backbone's (the
    scratch arm's), in words."""
    fresh = next((e["frozen"] for e in arms.values() if e["pretrain"] is None and not e.get("weights")), None)
    if fresh is None:
        return ["No scratch arm in this plan, so no random-init backbone to hold these scores against.", ""]
    scores = {f"kNN {pool}": lambda f, pool=pool: f[pool]["knn"] for pool in ("cls", "mean")}
    scores.update({f"{n}-shot {pool}": lambda f, pool=pool, n=n: f[pool]["fewshot"][str(n)] for n in shots for pool in ("cls", "mean")})
    lines = []
    for arm, e in arms.items():
        if e["pretrain"] is None and not e.get("weights"):  # the random-init backbone itself
            continue
        below = [f"{name} {100 * score(e['frozen']):.2f}% against {100 * score(fresh):.2f}%" for name, score in scores.items()
                 if score(e["frozen"]) <= score(fresh)]
        if below:
            lines.append(f"- **{arm}'s frozen features score at or below a random-init backbone's** ({'; '.join(below)}): "
                         f"by these measures its pretraining gave the frozen network nothing. kNN and probes understate "
                         f"masked-image pretraining, so this is no verdict on it; fine-tuned top-1 above is.")
    return lines + [""] if lines else []


def curve_lines(arms: dict) -> list[str]:
    curves = {arm: e["pretrain_curves"] for arm, e in arms.items() if e.get("pretrain_curves")}
    if not curves:
        return []
    lines = ["## Pretraining", "",
             "Validation loss (MPP's `val/pretext_loss`, supervised pretraining's `val/loss`, on data.val_shards of "
             "the pretraining) and kNN top-1 of the "
             "downstream classes as pretraining went; `change` is over the last quarter of the steps (a flat curve "
             "changes little).", ""]
    for arm, curve in curves.items():
        steps = sorted({int(step) for series in curve.values() for step, _ in series})
        values = {tag: dict((int(step), value) for step, value in series) for tag, series in curve.items()}
        rows = [[tag, *[f"{values[tag][step]:.4f}" if step in values[tag] else "" for step in steps],
                 "" if (change := last_quarter_change(curve[tag])) is None else f"{change:+.4f}"] for tag in curve]
        lines += [f"**{arm}**", ""] + table(["step", *map(str, steps), "change"], rows) + [""]
    return lines


def length_lines(arms: dict, base: Config, cc: CompareConfig) -> list[str]:
    multiples = sorted({float(m) for e in arms.values() for m in e["lengths"]})
    if len(multiples) <= 1:
        return []
    lines = ["## Fine-tuning length", "",
             f"Each arm's grid pick fine-tuned at multiples of {base.train.steps} steps, in order, until dev top-1 "
             f"fell below its best so far by more than the dev split resolves (McNemar's exact p < 0.05)"
             + (f", going on past the plan's lengths at twice the longest tried, up to max_length {cc.max_length:g}"
                if cc.max_length is not None else "")
             + "; the kept length, the best dev top-1 (exactly equal: the longer), is in bold (its name ends in "
               "-x<multiple> when longer).", ""]
    rows = []
    for arm, e in arms.items():
        rows.append([arm, e["grid_pick"], *[("" if f"{m:g}" not in e["lengths"] else
                                             (f"**{100 * e['lengths'][f'{m:g}']:.2f}%**" if f"{m:g}" == e["length"]
                                              else f"{100 * e['lengths'][f'{m:g}']:.2f}%")) for m in multiples]])
    lines += table(["arm", "recipe", *[f"x{m:g} ({round(base.train.steps * m)} steps)" for m in multiples]], rows) + [""]
    lines += [f"- {arm}: no length the plan tries fell below its best by more than the dev split resolves, so the "
              f"search went on past them: x{', x'.join(e['extended'])} tried." for arm, e in arms.items() if e.get("extended")]
    for arm, e in arms.items():
        if e.get("longest_near_best"):
            lines.append(f"- **{arm}'s longest length tried, x{longest_length(e)}"
                         + (f", the longest the cap allows (max_length {cc.max_length:g})" if e.get("length_cap_reached") else "")
                         + f", scored below its pick (x{e['length']}) by less than the dev split resolves: its dev top-1 "
                           f"may not have peaked, so it may be short of its best; "
                         + ("raise max_length to know.**" if e.get("length_cap_reached") else
                            "add a longer multiple to `lengths`, or set max_length to extend the search, to know.**"))
        if not e.get("at_longest_length"):
            continue
        if e.get("length_cap_reached"):
            lines.append(f"- **{arm} kept x{e['length']}, the longest length the cap allows (max_length "
                         f"{cc.max_length:g}): the cap stopped its search while its dev top-1 may still have been rising, "
                         f"so it may be short of its best; raise max_length to know.**")
        else:
            lines.append(f"- **{arm} kept the longest length the plan tries (x{e['length']}): its dev top-1 may still "
                         f"have been rising, so that arm may be short of its best; add a longer multiple to `lengths`, "
                         f"or set max_length to extend the search, to know.**")
    if any(e.get("extended") or e.get("at_longest_length") or e.get("longest_near_best") for e in arms.values()):
        lines.append("")
    elif cc.max_length is not None:
        lines += [f"Every arm's dev top-1 fell below its best by more than the dev split resolves within the plan's "
                  f"lengths, so none went on toward max_length {cc.max_length:g}.", ""]
    return lines


def ablation_lines(arms: dict, seeds_note: str) -> list[str]:
    ablated = {arm: e["ablation"] for arm, e in arms.items() if "ablation" in e}
    if not ablated:
        return []
    lines = ["## Ablation: every recipe at every seed", "",
             f"Test top-1 ({seeds_note}) of every recipe of the grid, not only the pick; the levers differ between "
             f"recipes as their keys below say.", ""]
    names = [*{name: None for a in ablated.values() for name in a}]  # the picks (longer ones included) first
    lines += table(["recipe", *ablated], [[name, *[percent_with_spread(a[name]) if name in a else "" for a in ablated.values()]]
                                          for name in names])
    lines.append("")
    return lines


def checkpoint_lines(arm: str, e: dict, shots: list[int], seeds_note: str) -> list[str]:
    """The pick of `arm` fine-tuned from earlier checkpoints of its pretraining."""
    pre, most = e["pretrain"], max(shots)
    curves = e.get("pretrain_curves", {})
    loss = dict((int(step), value) for step, value in curves.get(VAL_PRETEXT_LOSS) or curves.get(VAL_LOSS, []))
    points = {**{int(step): c for step, c in e["checkpoints"].items()}, pre["steps"]: {"test": e["test"], "frozen": e["frozen"]}}
    lines = [f"## Pretraining length ({arm})", "",
             f"The pick ({e['recipe']}) fine-tuned from earlier checkpoints of the same pretraining (their learning "
             f"rate not yet annealed), {seeds_note}; kNN and {most}-shot accuracy of the frozen backbone there.", ""]
    lines += table(["pretraining steps", "images seen", "validation loss", "kNN cls", "kNN mean", f"{most}-shot cls",
                    f"{most}-shot mean", "test top-1"],
                   [[str(step), f"{step * pre['images_seen'] // pre['steps']:,}", f"{loss[step]:.4f}" if step in loss else "",
                     *[f"{100 * point['frozen'][pool]['knn']:.2f}%" for pool in ("cls", "mean")],
                     *[f"{100 * point['frozen'][pool]['fewshot'][str(most)]:.1f}%" for pool in ("cls", "mean")],
                     percent_with_spread(point["test"])] for step, point in sorted(points.items())])
    lines.append("")
    return lines


def grid_lines(report: dict) -> list[str]:
    """The whole grid's dev top-1 (when picked on a dev split) and every recipe's keys."""
    arms, grid = report["arms"], report["recipes"]
    lines = []
    if report["select_on_dev"]:
        lines += ["## The whole grid (dev top-1; the pick of each arm in bold)", ""]
        lines += table(["recipe", *arms], [[name, *[f"**{100 * e['grid'][name]:.2f}%**" if e["grid_pick"] == name
                                                   else f"{100 * e['grid'][name]:.2f}%" for e in arms.values()]] for name in grid])
    lines += ["", "Recipes (run names under `ft/<arm>/`; keys on top of the plan's `finetune` section):", ""]
    lines += [f"- `{name}`: " + (", ".join(f"{k}={v}" for k, v in recipe.items()) or "the plan's finetune section as it is")
              for name, recipe in grid.items()]
    return lines


def closing_lines(report: dict, cc: CompareConfig, base: Config) -> list[str]:
    """The compute spent, what the wall time counts, where the curves are, and the paper's numbers."""
    out = Path(cc.output_dir)
    evaluated_on = ("the dev split" if report["select_on_dev"] and not report["dev_folds"] else val_shards_name(base))
    runs = {events.parents[2] for events in out.rglob("tensorboard/*/events.out.tfevents*")}  # <run>/tensorboard/<stage>/
    return ["", f"Compute: {len(runs)} training runs under "
            f"{cc.output_dir}, {training_time(out) / 60:.0f} minutes of training time summed over them (runs side by "
            f"side each count their own time).",
            "", f"Wall time: pretraining plus the picked fine-tuning run, from the first to the last logged training step "
            f"of each (TensorBoard event times, summed over resumed parts). Curves ({evaluated_on}) in comparison.png/svg; every "
            f"run in TensorBoard (`tensorboard --logdir {cc.output_dir}`).", "", "## For reference", "", PAPER, ""]
