"""compare's length search (lengths, max_length) and its pretraining-length axis (pretrain_lengths): which fine-tuning
and pretraining lengths run, which are reused, and what the report says of a curve that may still rise."""
import json
import re

import pytest

from mpp.config import ConfigError, load_config
from pipelines.comparison.report import budget_markdown
from pipelines.stages import compare

from test_compare import tiny


def test_the_pick_fine_tunes_longer_while_dev_top1_rises(tmp_path):
    report = compare.run(tiny(tmp_path, "arms=[scratch]", "lengths=[1,2,4]"))
    entry = report["arms"]["scratch"]
    tried = [m for m in ("1", "2", "4") if m in entry["lengths"]]
    dev = [entry["lengths"][m] for m in tried]
    # Longer until a length fell below the best so far (by more than the split resolves); the best dev top-1 is kept.
    assert len(dev) == 3 or dev[-1] < max(dev)
    kept = dev.index(max(dev)) + 1
    assert entry["recipe"] == (entry["grid_pick"] if kept == 1 else f"{entry['grid_pick']}-x{tried[kept - 1]}")
    assert entry["settings"].get("train.steps", 4) == 4 * int(tried[kept - 1])
    results = json.loads((tmp_path / "cmp" / "ft" / "scratch" / f"{entry['grid_pick']}-x2" / "results.json").read_text())
    assert results["steps"] == 8  # twice the plan's 4 steps
    with pytest.raises(ConfigError, match=r"lengths must start at 1 .* got \[2.0\]"):
        tiny(tmp_path, "lengths=[2]")


def scripted_dev(monkeypatch, dev_top1):
    """Fine-tuning runs for real, but each scores on the dev split as dev_top1(cfg) says: its first images right."""
    run_stage = compare.finetune_stage

    def scripted(cfg, ckpt):
        result = run_stage(cfg, ckpt)
        keys = sorted(result["correct"])
        right = round(dev_top1(cfg) * len(keys))
        return {**result, "top1": dev_top1(cfg), "correct": {k: int(i < right) for i, k in enumerate(keys)}}

    monkeypatch.setattr(compare, "finetune_stage", scripted)


def test_one_recipe_with_several_lengths_searches_the_length_on_the_dev_split(tmp_path, monkeypatch):
    # The shipped pretext ablation has one recipe and lengths [1, 2]: with nothing but lengths to pick, compare once
    # skipped the dev split and with it the length search, fine-tuning every arm at the first length alone.
    scripted_dev(monkeypatch, lambda cfg: {4: 0.5, 8: 0.7}[cfg.train.steps])
    report = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2]", "grid=[{name: sgd, train: {optimizer: sgd, lr: 0.03}}]"))
    entry = report["arms"]["scratch"]
    assert report["select_on_dev"] and entry["lengths"] == {"1": 0.5, "2": 0.7} and entry["recipe"] == "sgd-x2"
    assert "each arm's fine-tuning length picked for the one recipe (`sgd`, its keys below) by top-1 on a dev split" in \
        (tmp_path / "cmp" / "report.md").read_text()


def test_an_equal_dev_score_fine_tunes_longer_and_keeps_the_longer_length(tmp_path, monkeypatch):
    # by train.steps: x2 rises, x4 equals it, x8 falls by 5 images (p = 0.06: not resolved), x16 by 20 (resolved)
    dev_top1 = {4: 0.5, 8: 0.6, 16: 0.6, 32: 0.55, 64: 0.4}
    scripted_dev(monkeypatch, lambda cfg: dev_top1[cfg.train.steps])
    entry = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2,4,8,16,32]"))["arms"]["scratch"]
    # the equal score went on, so did the fall the split cannot resolve; the resolved fall ended it before x32
    assert entry["lengths"] == {"1": 0.5, "2": 0.6, "4": 0.6, "8": 0.55, "16": 0.4}
    # x4 equals x2 and x8 is 5 images short of them (McNemar p = 0.06): near-best on 100 dev images; the equal
    # scores go to the longer training
    assert entry["recipe"].endswith("-x4") and entry["length"] == "4"
    assert entry["length_pick"]["tie"] and set(entry["length_pick"]["tied"]) == {f"{entry['grid_pick']}-x{m}" for m in (2, 4, 8)}
    # A plan without the sensitivity runs says that a verdict may rest on those ties, not that it was checked.
    picks = (tmp_path / "cmp" / "report.md").read_text().split("## The dev split and the picks")[1]
    assert "this plan does not test those (sensitivity: false)" in picks and "are tested too" not in picks


def test_picks_follow_the_dev_scores_when_one_arm_improves_with_length_and_the_other_does_not(tmp_path, monkeypatch):
    """The bias the pick rule must not have: scratch still rises with length on the dev split while the pretrained arm
    is flat. The old rule (the cheapest of the near-best) held scratch at a shorter length than its best."""
    rising = {4: 0.50, 8: 0.55, 16: 0.58}  # scratch, by train.steps
    flat = {4: 0.60, 8: 0.60, 16: 0.60}  # mpp

    def dev_top1(cfg):
        if cfg.train.optimizer == "adamw":  # the grid's other recipe, well behind for both arms
            return 0.3
        return (flat if "/ft/mpp/" in cfg.output_dir else rising)[cfg.train.steps]

    scripted_dev(monkeypatch, dev_top1)
    report = compare.run(tiny(tmp_path, "arms=[mpp,scratch]", "seeds=[]", "lengths=[1,2,4]", "sensitivity=true"))
    mpp, scratch = report["arms"]["mpp"], report["arms"]["scratch"]
    assert scratch["recipe"] == "sgd-0.03-x4" and scratch["dev_top1"] == 0.58  # its best, 3 images above x2
    assert mpp["recipe"] == "sgd-0.03-x4"  # equal scores: the longer training, the same rule for both arms
    # near-best (McNemar p >= 0.05 against the pick): scratch's x2 (3 discordant images), mpp's x1 and x2 (equal)
    assert set(scratch["near_best"]) == {"sgd-0.03-x2"} and set(mpp["near_best"]) == {"sgd-0.03", "sgd-0.03-x2"}
    gap = report["gaps"][0]
    assert len(gap["sensitivity"]) == 3 * 2  # each arm at its pick or one of its near-best candidates
    assert {(row["mpp"], row["scratch"]) for row in gap["sensitivity"]} == {
        (m, s) for m in ("sgd-0.03-x4", "sgd-0.03", "sgd-0.03-x2") for s in ("sgd-0.03-x4", "sgd-0.03-x2")}
    line = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if line.startswith("- mpp - scratch:"))
    assert "Sensitivity: with each arm at each of its near-best candidates (6 combinations)" in line


def test_the_length_search_goes_on_past_a_drop_the_dev_split_cannot_resolve_and_says_when_an_arm_may_be_short(tmp_path, monkeypatch):
    # x2 is one dev image below x1 (noise on 100 images); x4 is 8 images above: the search used to stop at x2 and keep x1.
    dev_top1 = {4: 0.50, 8: 0.49, 16: 0.58}
    scripted_dev(monkeypatch, lambda cfg: dev_top1[cfg.train.steps])
    entry = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2,4]", "grid=[{name: sgd, train: {lr: 0.03}}]"))["arms"]["scratch"]
    assert entry["lengths"] == {"1": 0.5, "2": 0.49, "4": 0.58} and entry["recipe"] == "sgd-x4"
    assert entry["at_longest_length"]  # the longest length the plan tries: it may be short
    text = (tmp_path / "cmp" / "report.md").read_text().split("## Fine-tuning length")[1]
    assert "- **scratch kept the longest length the plan tries (x4): its dev top-1 may still have been rising, so that " \
           "arm may be short of its best; add a longer multiple to `lengths`, or set max_length to extend the search, " \
           "to know.**" in text


def test_an_arm_whose_longest_length_is_an_image_below_its_pick_is_said_to_maybe_be_short(tmp_path, monkeypatch):
    # x2 one dev image below x1: x1 is kept, but nothing says the curve peaked (the emoji semi plan's scratch arm at 10
    # labels per class); the report said nothing of it, as if a resolved fall had ended the search.
    scripted_dev(monkeypatch, lambda cfg: {4: 0.50, 8: 0.49}[cfg.train.steps])
    entry = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2]", "grid=[{name: sgd, train: {lr: 0.03}}]"))["arms"]["scratch"]
    assert entry["recipe"] == "sgd" and not entry["at_longest_length"] and entry["longest_near_best"]
    assert not entry["length_cap_reached"]
    text = (tmp_path / "cmp" / "report.md").read_text().split("## Fine-tuning length")[1]
    assert ("- **scratch's longest length tried, x2, scored below its pick (x1) by less than the dev split resolves: its "
            "dev top-1 may not have peaked, so it may be short of its best; add a longer multiple to `lengths`, or set "
            "max_length to extend the search, to know.**") in text


def test_an_arm_that_keeps_its_longest_length_is_fine_tuned_longer_up_to_max_length(tmp_path, monkeypatch):
    # by train.steps: rising all the way, so the search doubles past the plan's x2 to x4 and x8, and the cap (8)
    # stops it before x16; a second plan whose x4 falls by 5 images (not resolved) goes on to x8, where a fall of
    # 20 images (resolved) ends it under the cap
    rising = {4: 0.50, 8: 0.55, 16: 0.60, 32: 0.65, 64: 0.70}
    scripted_dev(monkeypatch, lambda cfg: rising[cfg.train.steps])
    entry = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2]", "max_length=8",
                             "grid=[{name: sgd, train: {lr: 0.03}}]"))["arms"]["scratch"]
    assert entry["lengths"] == {"1": 0.5, "2": 0.55, "4": 0.6, "8": 0.65} and entry["recipe"] == "sgd-x8"
    assert entry["extended"] == ["4", "8"] and entry["at_longest_length"] and entry["length_cap_reached"]
    assert json.loads((tmp_path / "cmp" / "ft" / "scratch" / "sgd-x8" / "results.json").read_text())["steps"] == 32
    assert not (tmp_path / "cmp" / "ft" / "scratch" / "sgd-x16").exists()
    text = (tmp_path / "cmp" / "report.md").read_text().split("## Fine-tuning length")[1]
    assert "going on past the plan's lengths at twice the longest tried, up to max_length 8" in text
    assert ("- scratch: no length the plan tries fell below its best by more than the dev split resolves, so the search "
            "went on past them: x4, x8 tried.") in text
    assert "- **scratch kept x8, the longest length the cap allows (max_length 8): the cap stopped its search" in text
    peaked = {4: 0.50, 8: 0.60, 16: 0.55, 32: 0.40}
    scripted_dev(monkeypatch, lambda cfg: peaked[cfg.train.steps])
    entry = compare.run(tiny(tmp_path / "peaked", "arms=[scratch]", "seeds=[]", "lengths=[1,2]", "max_length=16",
                             "grid=[{name: sgd, train: {lr: 0.03}}]"))["arms"]["scratch"]
    assert entry["lengths"] == {"1": 0.5, "2": 0.6, "4": 0.55, "8": 0.4} and entry["recipe"] == "sgd-x2"
    assert entry["extended"] == ["4", "8"] and not entry["at_longest_length"] and not entry["length_cap_reached"]
    text = (tmp_path / "peaked" / "cmp" / "report.md").read_text()
    assert "the cap stopped" not in text and "may be short" not in text
    with pytest.raises(ConfigError, match=r"max_length 2 is below the longest of lengths \[1.0, 4.0\]"):
        tiny(tmp_path, "lengths=[1,4]", "max_length=2")


def test_a_longest_length_a_few_dev_images_below_the_best_is_extended_as_a_rising_one_is(tmp_path, monkeypatch):
    # The emoji semi plan at 10 labels per class (5 folds over 90 images): scratch's x2 scored one image below its
    # x1 and its search stopped there, at 300 steps, while MPP's rising curve was extended to x8 (2,400 steps): an
    # arm was cut short by the dev split's noise and its rival was not. Both go on now until a resolved fall.
    one_image_down = {4: 0.50, 8: 0.49, 16: 0.56, 32: 0.30}
    scripted_dev(monkeypatch, lambda cfg: one_image_down[cfg.train.steps])
    entry = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[]", "lengths=[1,2]", "max_length=8",
                             "grid=[{name: sgd, train: {lr: 0.03}}]"))["arms"]["scratch"]
    assert entry["lengths"] == {"1": 0.5, "2": 0.49, "4": 0.56, "8": 0.3} and entry["recipe"] == "sgd-x4"
    assert entry["extended"] == ["4", "8"] and not entry["at_longest_length"]


def test_pretraining_lengths_run_each_from_its_own_pretraining_and_reuse_a_finished_plans_runs(tmp_path, capsys):
    plain = ["arms=[mpp,scratch]", "grid=[]", "seeds=[]"]
    compare.run(tiny(tmp_path, *plain))
    out = tmp_path / "cmp"

    def runs():  # every training run's directory (each writes its run.json)
        return {p.parent.relative_to(out).as_posix() for p in out.glob("**/run.json")}

    before = runs()
    assert before == {"pre/mpp", "ft/mpp/base", "ft/scratch/base"}
    capsys.readouterr()
    result = compare.run(tiny(tmp_path, *plain, "pretrain_lengths=[1,2]"))
    log = capsys.readouterr().out
    # x1 is the plan without the axis, stage for stage: nothing of it is run again; x2 pretrains anew and fine-tunes
    # mpp from it, and scratch (nothing of it depends on pretraining) is the x1 runs'
    assert log.count("finished before, skipped") == len(before) + 2  # its frozen features: scratch's, mpp's
    assert runs() == before | {"pretrain-x2/pre/mpp", "pretrain-x2/ft/mpp/base"}
    assert load_config(out / "pretrain-x2" / "pre" / "mpp" / "config.yaml").train.steps == 6
    assert json.loads((out / "pretrain-x2" / "pre" / "mpp" / "results.json").read_text())["steps"] == 6
    assert load_config(out / "pretrain-x2" / "ft" / "mpp" / "base" / "config.yaml").data.shards == \
        load_config(out / "ft" / "mpp" / "base" / "config.yaml").data.shards
    assert result["multiples"] == ["1", "2"]
    points = result["budgets"][""]["mpp"]["points"]
    assert [points[m]["pretrain_steps"] for m in ("1", "2")] == [3, 6]
    x2 = json.loads((out / "pretrain-x2" / "results.json").read_text())
    gap = next(g for g in x2["gaps"] if g["arms"] == ["mpp", "scratch"])
    assert (points["2"]["gap"], points["2"]["low"], points["2"]["high"]) == (gap["gap"], gap["low"], gap["high"])
    assert x2["arms"]["scratch"]["run"] == str(out / "ft" / "scratch" / "base")
    step = result["budgets"][""]["mpp"]["rising_step"]
    assert step["gap"] == pytest.approx(points["2"]["test"]["top1"] - points["1"]["test"]["top1"])
    text = (out / "pretrain_length.md").read_text()
    assert text.startswith("# Pretraining length: each gap over scratch")
    assert re.search(r"\| mpp \| [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]( resolved)? \(3 steps\) \| "
                     r"[+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]( resolved)? \(6 steps\) \|", text)
    assert "- **mpp: still rising" in text or "- mpp: not rising" in text
    assert (out / "pretrain_length.png").is_file() and (out / "pretrain_length.svg").is_file()
    assert (out / "report.md").read_text().startswith("# mpp vs scratch")  # x1's own report, as without the axis
    with pytest.raises(ConfigError, match="pretrain_lengths must start at 1"):
        tiny(tmp_path, *plain, "pretrain_lengths=[2,4]")
    with pytest.raises(ConfigError, match="needs the arm scratch"):
        tiny(tmp_path, "arms=[mpp,supervised]", "pretrain_lengths=[1,2]")


def test_the_pretraining_length_report_says_whether_each_curve_still_rises():
    from pipelines.comparison.gaps import rising_step
    from pipelines.comparison.report import rising_line

    def entry(hits):  # one seed's runs on 100 test images, the first `hits` right
        return {"correct": {"0": {f"i{k:03d}": int(k < hits) for k in range(100)}}}

    resolved = rising_step([entry(40), entry(60)])  # 20 images more, none fewer: resolved
    assert resolved["rising"] and resolved["excludes_zero"] and resolved["gap"] == pytest.approx(0.2)
    assert rising_line("mpp", {"rising_step": resolved}, ["1", "3", "10"]).startswith(
        "- **mpp: still rising at the longest pretraining length**, +20.00 points [")
    assert "from x3 to x10, resolved: pretraining longer than x10 may gain more." in rising_line("mpp", {"rising_step": resolved}, ["1", "3", "10"])
    barely = rising_step([entry(50), entry(51)])  # one image more: the point estimate rises, the interval includes 0
    assert barely["rising"] and not barely["excludes_zero"]
    assert "still rising at the longest pretraining length** by its point estimate, +1.00 points" in \
        rising_line("mpp", {"rising_step": barely}, ["1", "2"]) and "not resolved" in rising_line("mpp", {"rising_step": barely}, ["1", "2"])
    level = rising_step([entry(50), entry(50)])
    assert not level["rising"] and rising_line("mpp", {"rising_step": level}, ["1", "2"]) == \
        "- mpp: not rising at the longest pretraining length, +0.00 points [+0.00, +0.00] from x1 to x2, not resolved."
    assert rising_step([entry(50)]) is None


def test_pretraining_lengths_with_label_budgets_run_each_budget_per_length_and_scratch_once(tmp_path):
    result = compare.run(tiny(tmp_path, "arms=[mpp,scratch]", "grid=[]", "seeds=[]", "labels_per_class=[4]",
                              "pretrain_lengths=[1,2]"))
    out = tmp_path / "cmp"
    assert {p.parent.relative_to(out).as_posix() for p in out.glob("**/run.json")} == {
        "pre/mpp", "budget-4/ft/mpp/base", "budget-4/ft/scratch/base", "pretrain-x2/pre/mpp", "pretrain-x2/budget-4/ft/mpp/base"}
    points = result["budgets"]["4"]["mpp"]["points"]
    budget = json.loads((out / "pretrain-x2" / "results.json").read_text())["budgets"]["4"]
    assert points["2"]["gap"] == budget["gaps"][0]["gap"] and points["2"]["pretrain_steps"] == 6
    assert "## Label budget 4" in (out / "pretrain_length.md").read_text()


def test_the_label_efficiency_report_says_what_each_budgets_gap_rests_on(tmp_path, monkeypatch):
    # Before, the top-level curve kept only each gap's interval: the range of the gap over the arms' near-best picks
    # and the warning on a worse arm that kept its longest length stayed in that budget's own report, so the curve
    # read firmer than the budget reports did (the emoji plan: scratch's folds picked 300 steps while its 2,400-step
    # runs scored 4 points higher on the test images).
    rising, flat = {4: 0.50, 8: 0.55, 16: 0.58}, {4: 0.60, 8: 0.60, 16: 0.60}
    scripted_dev(monkeypatch, lambda cfg: (flat if "/ft/mpp/" in cfg.output_dir else rising)[cfg.train.steps])
    cc = tiny(tmp_path, "arms=[mpp,scratch]", "seeds=[]", "lengths=[1,2,4]", "sensitivity=true", "dev_folds=0",
              "grid=[{name: sgd, train: {lr: 0.03}}]", "labels_per_class=[40]")
    budget = compare.run(cc)["budgets"]["40"]
    assert budget["arms"]["mpp"]["at_longest_length"] and budget["arms"]["mpp"]["length"] == "4"
    rows = budget["gaps"][0]["sensitivity"]
    assert len(rows) >= 2
    line = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines()
                if line.startswith("- Budget 40, mpp − scratch:"))
    assert f"Sensitivity: with each arm at each of its near-best candidates ({len(rows)} combinations)" in line
    lost = {**budget["gaps"][0], "gap": -0.2, "low": -0.3, "high": -0.1, "excludes_zero": True}  # had mpp lost
    text = budget_markdown({**json.loads((tmp_path / "cmp" / "results.json").read_text()),
                            "budgets": {"40": {**budget, "gaps": [lost]}}}, cc)
    assert "**mpp, the worse arm, kept the longest fine-tuning it was given (x4)" in text
