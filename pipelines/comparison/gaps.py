"""How two arms' test results compare, image by image: each pair's gap with its paired 95% interval, McNemar's test,
the resolution the pair turned out to have, the verdict's sensitivity to the picks, and an arm's balanced accuracy."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict

from mpp.evaluation.stats import balanced_accuracy, mcnemar, paired_bootstrap_gap
from .groups import key_groups
from .plan import SCRATCH, CompareConfig, CompareError
from .report import observed_resolution


def gaps(arms: dict[str, dict], cc: CompareConfig) -> list[dict]:
    """Every pair of arms: the difference of mean test top-1, its paired 95% bootstrap interval over the test images
    and the seeds (mpp.evaluation.stats.paired_bootstrap_gap), McNemar's exact test for each seed's pair of runs, whether
    the gap exceeds the seeds' spread (the sum of the two standard deviations; None with one seed), and the resolution
    the comparison turned out to have (`observed_resolution`)."""
    result = []
    for a, b in itertools.combinations(arms, 2):
        ea, eb = arms[a], arms[b]
        keys = sorted(next(iter(ea["correct"].values())))
        if sorted(next(iter(eb["correct"].values()))) != keys:
            raise CompareError(f"arms {a} and {b} were scored on different evaluation images; rerun their test stages "
                               f"on the plan's finetune data.val_shards")
        matrix = {name: [[e["correct"][seed][k] for k in keys] for seed in e["correct"]] for name, e in ((a, ea), (b, eb))}
        groups = key_groups(cc.image_groups, keys)  # None: every test image independent
        interval = paired_bootstrap_gap(matrix[a], matrix[b], groups=groups)
        per_seed = {seed: asdict(mcnemar(ra, rb, groups)) for seed, ra, rb in zip(ea["correct"], matrix[a], matrix[b])}
        ta, tb = ea["test"], eb["test"]
        spread = None if ta["top1_std"] is None or tb["top1_std"] is None else ta["top1_std"] + tb["top1_std"]
        result.append({"arms": [a, b], "gap": ta["top1"] - tb["top1"], **{k: v for k, v in asdict(interval).items() if k != "gap"},
                       "images": len(keys), "mcnemar": per_seed, "spread": spread,
                       "exceeds_spread": None if spread is None else abs(ta["top1"] - tb["top1"]) > spread,
                       "resolution": observed_resolution(matrix[a], matrix[b], ta, tb, cc, groups),
                       **({"sensitivity": sensitivity(a, ea, b, eb, keys, groups)} if "near_best" in ea or "near_best" in eb else {})})
    return result


def verdict(interval) -> int:
    """+1: the first arm is better, -1: the second, 0: the interval includes 0 (unresolved)."""
    return 0 if not interval.excludes_zero else (1 if interval.gap > 0 else -1)


def sensitivity(a: str, ea: dict, b: str, eb: dict, keys: list[str], groups: list | None) -> list[dict]:
    """The gap a - b with each arm at each of its near-best candidates (its pick included): every combination's paired
    interval and verdict, so the report can say whether the verdict depends on the picks."""
    def choices(entry: dict) -> dict[str, dict]:
        return {entry["recipe"]: entry["correct"], **{name: alt["correct"] for name, alt in entry.get("near_best", {}).items()}}

    rows = []
    for (ra, ca), (rb, cb) in itertools.product(choices(ea).items(), choices(eb).items()):
        interval = paired_bootstrap_gap([[ca[seed][k] for k in keys] for seed in ca], [[cb[seed][k] for k in keys] for seed in cb], groups=groups)
        rows.append({a: ra, b: rb, "gap": interval.gap, "low": interval.low, "high": interval.high, "verdict": verdict(interval)})
    return rows


def balanced_over_seeds(correct: dict[str, dict[str, int]], labels: dict[str, int]) -> dict:
    """Balanced accuracy (mean per-class recall) of one arm's runs on the test set: mean over seeds and each seed's."""
    missing = set(next(iter(correct.values()))) - set(labels)
    if missing:
        raise CompareError(f"{len(missing)} of the images the arms were scored on (e.g. {min(missing)}) are not labelled "
                           f"images of the evaluation shards ({len(labels)}); rerun the comparison in a new output_dir")
    seeds = {seed: balanced_accuracy(hits, {key: labels[key] for key in hits}) for seed, hits in correct.items()}
    return {"mean": statistics.fmean(seeds.values()), "seeds": seeds}


def pretrain_length_results(cc: CompareConfig, reports: dict[str, dict], entries: dict[str, dict[str, dict[str, dict]]],
                            steps: dict[str, dict[str, int]]) -> dict:
    """pretrain_length.json: for every label budget ('' without budgets) and pretrained arm, its test top-1 and its gap
    over scratch with the paired 95% interval at each pretraining length (from that length's report), and whether its
    curve still rises at the longest (`rising_step`)."""
    multiples = list(reports)
    budgets, scratch = {}, {}
    for budget in entries[multiples[0]]:
        at = {multiple: reports[multiple]["budgets"][budget] if budget else reports[multiple] for multiple in multiples}
        scratch[budget] = at[multiples[0]]["arms"][SCRATCH]["test"]
        arms = {}
        for arm in (name for name, e in entries[multiples[0]][budget].items() if e["pretrain"] is not None):
            points = {}
            for multiple in multiples:
                report = at[multiple]
                gap = next(g for g in report["gaps"] if set(g["arms"]) == {arm, SCRATCH})
                sign = 1 if gap["arms"][0] == arm else -1
                low, high = sorted((sign * gap["low"], sign * gap["high"]))
                points[multiple] = {"pretrain_steps": steps[multiple][arm], "test": report["arms"][arm]["test"],
                                    "gap": sign * gap["gap"], "low": low, "high": high, "excludes_zero": gap["excludes_zero"]}
            arms[arm] = {"points": points, "rising_step": rising_step([entries[m][budget][arm] for m in multiples[-2:]], cc.image_groups)}
        budgets[budget] = arms
    return {"config": cc.model_dump(mode="json"), "multiples": multiples, "budgets": budgets, "scratch": scratch}


def rising_step(entries: list[dict], image_groups: str | None = None) -> dict | None:
    """The last step up the pretraining lengths of one arm: its test top-1 at the longest minus at the one before, with
    the paired 95% interval over the test images and seeds (scratch is one set of runs at every length, so this is also
    the step of the gap over scratch). The curve still rises there when the step's point estimate is above 0 (whether
    or not the interval resolves it: an unresolved rise is no evidence the curve has levelled off); test images grouped
    by `image_groups` are resampled by group, as in `gaps`. None: one length."""
    if len(entries) < 2:
        return None
    before, last = entries
    keys = sorted(next(iter(last["correct"].values())))
    interval = paired_bootstrap_gap([[hits[k] for k in keys] for hits in last["correct"].values()],
                                    [[hits[k] for k in keys] for hits in before["correct"].values()],
                                    groups=key_groups(image_groups, keys))
    return {"gap": interval.gap, "low": interval.low, "high": interval.high, "excludes_zero": interval.excludes_zero,
            "rising": interval.gap > 0}
