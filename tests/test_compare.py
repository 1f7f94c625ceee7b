import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import webdataset as wds
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from PIL import Image
from safetensors.torch import load_file

from mpp.config import ConfigError, load_config
from mpp.evaluation.stats import gap_resolution
from pipelines.stages import compare
from pipelines.comparison.plan import load_compare_config, pretrain_config, recipes, stage_config

from conftest import ROOT, cpu_env, reset_accelerator, write_test_shards, writes_cut_short

TINY_RUNS = ["common.data.num_workers=0", "common.data.shuffle_buffer=50", "common.model.width=32", "common.model.depth=1",
             "common.model.heads=2", "common.model.image_size=16", "common.log.every=2", "common.log.images_every=50",
             "common.fewshot.shots=[1,2]", "common.fewshot.draws=2", "common.fewshot.train_images=60",
             "common.fewshot.eval_images=40", "pretrain.train.steps=3", "pretrain.train.warmup_steps=1",
             "pretrain.train.batch_size=8", "finetune.train.steps=4", "finetune.train.warmup_steps=1",
             "finetune.train.batch_size=8", "finetune.finetune.eval_every=2", "dev_fraction=0.25", "dev_folds=0",
             "sensitivity=false"]
# The shipped tiny plan's grid (SGD and the AdamW/layer-decay/mean-pooling recipe) and seeds [0, 1], as they are.


def tiny(tmp_path, *overrides):
    return load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", tiny_overrides(tmp_path, *overrides))


def tiny_overrides(tmp_path, *overrides) -> list[str]:
    """The tiny plan's overrides (as `launch.py compare --config configs/compare/tiny.yaml` takes them) on shards
    written here."""
    write_test_shards(tmp_path / "up", [40, 40], size=32)
    write_test_shards(tmp_path / "down", [200, 200], size=32)  # 40 per class: 10 of each in the dev split
    val = write_test_shards(tmp_path / "val", [30], size=32)
    for directory in ("up", "down"):  # the class count comes from summary.json, as `launch.py prepare` writes it
        (tmp_path / directory / "summary.json").write_text(json.dumps({"labels": True, "classes": 10}))
    return [f"output_dir={tmp_path / 'cmp'}", f"pretrain.data.shards={tmp_path / 'up'}", f"finetune.data.shards={tmp_path / 'down'}",
            f"finetune.data.val_shards={val[0]}", f"common.data.val_shards={val[0]}", *TINY_RUNS, *overrides]


def test_compare_with_a_mixed_grid_and_seeds_reports_mean_and_std_and_a_rerun_skips_finished_stages(tmp_path, capsys):
    cc = tiny(tmp_path)
    report = compare.run(cc)
    out = tmp_path / "cmp"
    assert set(report["arms"]) == {"mpp", "supervised", "scratch"}
    text = (out / "report.md").read_text()
    table = text.split("## Gaps")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert [r.split(" | ")[0] for r in rows] == ["| mpp", "| supervised", "| scratch"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 9 and all(cells), row  # no empty cell
        assert cells[3] in ("sgd-0.03", "mim")  # the recipe each arm picked
        assert re.fullmatch(r"\d+\.\d\d%", cells[6]) and re.fullmatch(r"\*\*\d+\.\d\d% ± \d+\.\d\d\*\*", cells[7])  # dev; test mean ± std
        assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d", cells[8])  # each seed's top-1
    frozen = [line for line in text.split("## Frozen features")[1].split("##")[0].splitlines() if line.startswith("| ")]
    assert frozen[0] == "| arm | kNN cls | kNN mean | 1-shot cls | 1-shot mean | 2-shot cls | 2-shot mean |"
    assert [r.split(" | ")[0] for r in frozen[1:]] == ["| mpp", "| supervised", "| scratch"]
    assert "**mpp**" in text.split("## Pretraining")[1] and "| val/pretext_loss |" in text  # the pretraining curves
    grid_rows = [line for line in text.split("## The whole grid")[1].splitlines() if line.startswith(("| sgd-0.03", "| mim"))]
    assert len(grid_rows) == 2 and sum(row.count("**") for row in grid_rows) == 2 * 3  # every arm's pick in bold
    assert "`mim`: train.optimizer=adamw, train.lr=0.001, train.weight_decay=0.05, train.layer_decay=0.75, finetune.pool=mean" in text
    assert "79.9%" in text and "mpp - scratch:" in text and "the spread" in text
    assert "Compute: 11 training runs under" in text  # 2 pretrainings, 3 arms x (2 recipes + 1 more seed)
    # HParams names each run by what tells it apart first (sgd-0.03-s1 (mpp)), not by its run path below the logdir,
    # which its narrow first column cut to the same ft/scratch/mim-... for several runs (issue 51).
    trials = {run.parent.parent.relative_to(out).as_posix(): trial_of(run) for run in out.glob("**/tensorboard/*")}
    assert len(trials) == 11 and trials["pre/mpp"] == "mpp (pretraining, cmp)" and trials["ft/scratch/mim"] == "mim (scratch, cmp)"
    assert len(set(trials.values())) == 11, trials
    results = json.loads((out / "results.json").read_text())
    assert results["arms"]["scratch"]["pretrain"] is None and results["arms"]["mpp"]["pretrain"]["images_seen"] == 24
    assert results["seeds"] == [0, 1]
    for arm in results["arms"].values():
        assert set(arm["grid"]) == {"sgd-0.03", "mim"} and arm["recipe"] in arm["grid"]
        test = arm["test"]
        seeds = list(test["top1_seeds"].values())
        assert set(test["top1_seeds"]) == {"0", "1"}
        assert test["top1"] == pytest.approx(sum(seeds) / 2)
        assert test["top1_std"] == pytest.approx(abs(seeds[0] - seeds[1]) / 2 ** 0.5)  # sample std of two
    gap = next(g for g in results["gaps"] if g["arms"] == ["mpp", "scratch"])
    assert gap["exceeds_spread"] == (abs(gap["gap"]) > gap["spread"])
    split = json.loads((out / "split" / "stage.json").read_text())
    assert split["train_images"] + split["dev_images"] == 400 and split["dev_images_per_class"] == {str(c): 10 for c in range(10)}
    with Image.open(out / "comparison.png") as png:
        assert png.size[0] > 720
    assert (out / "comparison.svg").read_text().lstrip().startswith("<?xml")
    for g in results["gaps"]:  # every gap paired: its interval over the same test images, McNemar for each seed
        assert g["low"] <= g["gap"] <= g["high"] and g["images"] == 30 and set(g["mcnemar"]) == {"0", "1"}
    assert re.search(r"- mpp - scratch: [+-]\d+\.\d\d points top-1, 95% CI \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] over 30 "
                     r"test images and 2 seed\(s\): (excludes 0|includes 0: the data cannot resolve this gap)", text)
    assert "A dev split of 100 images (10 of class 0," in text and "One image is worth 1.00 points of top-1" in text
    assert results["dev_resolution"]["images"] == 100
    # Short TensorBoard run names: ft/<arm>/<recipe>[-s<seed>], pre/<arm>.
    events = {str(p.relative_to(out)).split("/tensorboard/")[0] for p in out.rglob("tensorboard/*/events.out.tfevents*")}
    picked = results["arms"]["mpp"]["recipe"]
    assert {"pre/mpp", "pre/supervised", "ft/scratch/sgd-0.03", "ft/mpp/mim", f"ft/mpp/{picked}-s1"} <= events
    assert max(len(name) for name in events) <= len("ft/supervised/sgd-0.03-s1")

    capsys.readouterr()
    reset_accelerator()
    assert compare.run(tiny(tmp_path)) == report
    log = capsys.readouterr().out
    # 2 pretrainings, the split, 3 arms x (2 recipes + 1 more seed), 3 x 2 test scorings, 3 frozen-feature evaluations
    assert log.count("finished before, skipped") == 2 + 1 + 9 + 6 + 3 and "running in" not in log


def trial_of(run_dir):
    start = EventAccumulator(str(run_dir)).Reload().SummaryMetadata("_hparams_/session_start_info")
    return plugin_data_pb2.HParamsPluginData.FromString(start.plugin_data.content).session_start_info.group_name


def test_a_plan_with_both_lrs_and_grid_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="both lrs and grid"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["lrs=[0.1]"])
    with pytest.raises(ConfigError, match="grid recipe name 'a' is taken"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["grid=[{name: a}, {name: a, train: {lr: 0.1}}]"])
    with pytest.raises(ConfigError, match=r"cannot read .* \(ScannerError"):  # YAML flow maps need a space after ':'
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["grid=[{train:{lr:0.1}}]"])
    with pytest.raises(ConfigError, match="'finetune' runs .*train.lrr"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["grid=[{train: {lrr: 0.1}}]"])


def test_a_plan_with_a_repeated_seed_or_a_pretrained_scratch_arm_is_refused_at_load():
    """seeds: [0, 0] was reported as two seeds with a spread of 0.00 (round 4, row 101)."""
    with pytest.raises(ConfigError, match=r"^seeds \[0, 0\] repeats 0: the same fine-tuning counted twice"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["seeds=[0, 0]"])
    with pytest.raises(ConfigError, match=r"^lrs \[0.1, 0.1\] repeats 0.1: the same recipe tried twice"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["grid=[]", "lrs=[0.1, 0.1]"])
    # an arm that pretrains under the fresh backbone's name, reported as 'scratch | masked patch prediction' (row 107)
    with pytest.raises(ConfigError, match=r"arm name 'scratch' is the fresh backbone's, and this arm pretrains with mpp"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["arms=[{name: scratch, objective: mpp}]"])


def test_null_in_a_grid_recipe_or_an_arms_keys_is_none_as_on_the_command_line():
    """A null became the string 'None' on its way to the run config, and was refused (round 4, rows 111-113)."""
    plan = ["grid=[{train.clip_grad_norm: null}, {name: b, model.num_classes: null, data.crop_scale: [0.5, 1.0]}]",
            "arms=[{name: m, objective: mpp, pretrain: {train.clip_grad_norm: null}}, scratch]"]
    cc = load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", plan)
    assert pretrain_config(cc, cc.arms[0]).train.clip_grad_norm is None
    picked = {name: stage_config(cc, "finetune", **recipe) for name, recipe in recipes(cc).items()}
    assert [c.train.clip_grad_norm for c in picked.values()][0] is None and picked["b"].model.num_classes is None
    assert picked["b"].data.crop_scale == (0.5, 1.0)


def test_an_interrupted_stage_is_rerun_and_the_others_are_not(tmp_path, capsys):
    cc = tiny(tmp_path, "arms=[scratch]", "grid=[]", "seeds=[]")
    compare.run(cc)
    (tmp_path / "cmp" / "frozen" / "scratch" / "stage.json").unlink()  # as if it had crashed before finishing
    capsys.readouterr()
    compare.run(cc)
    log = capsys.readouterr().out
    assert "scratch frozen features (kNN, few-shot): running" in log and log.count("finished before, skipped") == 1


def test_ctrl_c_outside_training_is_one_line_and_the_same_command_goes_on(tmp_path, monkeypatch, capsys):
    # Training stops on Ctrl-C at a step with a checkpoint; compare also spends its time outside training (frozen
    # features, test passes), where a Ctrl-C printed a traceback of wherever it landed.
    import yaml
    from pipelines import cli

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(tiny(tmp_path, "arms=[scratch]", "grid=[]", "seeds=[]").model_dump(mode="json")))
    frozen = compare.frozen_stage

    def pressed_ctrl_c(cfg, ckpt):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "frozen_stage", pressed_ctrl_c)
    assert cli.main(["compare", "--config", str(plan)]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "stopped by Ctrl-C; the stages it finished are kept, and the same command goes on from them"
    assert "Traceback" not in err
    monkeypatch.setattr(compare, "frozen_stage", frozen)
    assert cli.main(["compare", "--config", str(plan)]) == 0
    log = capsys.readouterr().out
    assert re.search(r"scratch fine-tuning \S+: finished before, skipped", log) and "frozen features (kNN, few-shot): running" in log


def test_an_ablated_arms_pick_is_fine_tuned_from_earlier_pretraining_checkpoints(tmp_path):
    plan = ["arms=[mpp]", "ablate=[mpp]", "grid=[{name: sgd, train: {optimizer: sgd, lr: 0.03}}]", "pretrain.train.steps=4",
            "pretrain.train.checkpoint_every=2", "pretrain.train.warmup_steps=1"]
    entry = compare.run(tiny(tmp_path, *plan, "checkpoints=[2]"))["arms"]["mpp"]
    earlier = entry["checkpoints"]["2"]
    assert set(earlier["test"]["top1_seeds"]) == {"0", "1"} and {"cls", "mean"} <= set(earlier["frozen"])
    stage = json.loads((tmp_path / "cmp" / "ft" / "mpp" / "sgd-p2-s1" / "stage.json").read_text())
    assert stage["inputs"]["ckpt"].endswith("pre/mpp/checkpoints/step_00000002")
    text = (tmp_path / "cmp" / "report.md").read_text().split("## Pretraining length (mpp)")[1].split("##")[0]
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")][1:] == ["| 2", "| 4"]
    reset_accelerator()
    # refused when the plan loads, before any stage (round 4, rows 115-116: only after the pretraining and fine-tunings)
    with pytest.raises(ConfigError, match=r"checkpoints names pretraining step\(s\) 3, which the mpp pretraining will "
                                          r"not keep \(it keeps step\(s\) 2, 4: every pretrain.train.checkpoint_every=2"):
        tiny(tmp_path, *plan, "checkpoints=[3]")
    with pytest.raises(ConfigError, match=r"step\(s\) 2, which .* keeps step\(s\) 4: .*keep_checkpoints=1\)"):
        tiny(tmp_path, *plan, "checkpoints=[2]", "pretrain.train.keep_checkpoints=1")
    with pytest.raises(ConfigError, match=r"checkpoints \[4\] must be pretraining steps between 0 and pretrain.train.steps \(4\)"):
        tiny(tmp_path, "pretrain.train.steps=4", "checkpoints=[4]")


def test_an_ablated_arm_runs_every_recipe_at_every_seed_and_reports_each(tmp_path):
    report = compare.run(tiny(tmp_path, "arms=[scratch]", "ablate=[scratch]"))
    entry = report["arms"]["scratch"]
    assert set(entry["ablation"]) == {"sgd-0.03", "mim"}
    assert entry["ablation"][entry["recipe"]] == entry["test"]  # the pick's row is the headline
    for name, scores in entry["ablation"].items():
        assert set(scores["top1_seeds"]) == {"0", "1"}
        assert (tmp_path / "cmp" / "test" / "scratch" / f"{name}-s1" / "stage.json").is_file()
    ablation = (tmp_path / "cmp" / "report.md").read_text().split("## Ablation: every recipe at every seed")[1].split("##")[0]
    rows = [line.split(" | ")[0] for line in ablation.splitlines() if line.startswith("| ")][1:]
    assert rows[0] == f"| {entry['recipe']}" and sorted(rows) == ["| mim", "| sgd-0.03"]  # the pick first


def test_a_stage_another_process_is_running_is_waited_for_and_reused(tmp_path, capsys):
    import fcntl
    import threading

    directory = tmp_path / "ft" / "scratch" / "sgd"
    directory.parent.mkdir(parents=True)
    other = (directory.parent / ".sgd.stage-lock").open("a+")  # another compare process runs this stage
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def other_finishes():
        directory.mkdir()
        (directory / compare.STAGE_DONE).write_text(json.dumps({"top1": 0.5, "inputs": {"lr": 0.1}}))
        other.close()

    threading.Timer(0.5, other_finishes).start()
    done = compare.stage(directory, "scratch fine-tuning sgd", {"lr": 0.1}, lambda: pytest.fail("ran the stage twice"))
    assert done["top1"] == 0.5
    log = capsys.readouterr().out
    assert "running in another process, waiting for it" in log and "finished before, skipped" in log


def test_a_stage_whose_record_could_not_be_written_whole_runs_again_instead_of_failing_at_its_json(tmp_path,
                                                                                                     monkeypatch):
    # stage.json was written in place: a kill or a full disk mid-write left it cut short, and every later invocation
    # of the plan stopped with a JSONDecodeError traceback there.
    directory = tmp_path / "ft" / "scratch" / "sgd"
    writes_cut_short(monkeypatch, (compare.STAGE_DONE,))
    with pytest.raises(OSError, match="No space left"):
        compare.stage(directory, "scratch fine-tuning sgd", {"lr": 0.1}, lambda: {"top1": 0.5})
    monkeypatch.undo()
    assert not (directory / compare.STAGE_DONE).exists()
    assert compare.stage(directory, "scratch fine-tuning sgd", {"lr": 0.1}, lambda: {"top1": 0.75})["top1"] == 0.75
    assert compare.stage(directory, "scratch fine-tuning sgd", {"lr": 0.1}, lambda: pytest.fail("ran twice"))["top1"] == 0.75


def test_two_compare_processes_over_disjoint_arms_started_together_share_the_plans_data_stages(tmp_path):
    # Before, only training stages were held (by their run's lock): of two processes started together the second
    # was refused writing the plan's dev split ("another prepare ... is writing shards"), or wrote it again over the
    # first's.
    plan = ["launch.py", "compare", "--config", "configs/compare/tiny.yaml", *tiny_overrides(tmp_path, "seeds=[]"),
            "common.train.cpu_threads=1"]
    procs = [subprocess.Popen([sys.executable, *plan, f"arms=[{arm}]"], cwd=ROOT, env=cpu_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for arm in ("mpp", "scratch")]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], logs
    split = [line for log in logs for line in log.splitlines() if line.startswith("[compare] dev split")]
    assert sum(": running in /" in line for line in split) == 1, split  # written once, then waited for or reused
    for arm in ("mpp", "scratch"):
        assert json.loads((tmp_path / "cmp" / "ft" / arm / "sgd-0.03" / "results.json").read_text())["steps"] == 4


def test_a_rerun_with_other_settings_refuses_to_reuse_finished_stages(tmp_path):
    compare.run(tiny(tmp_path, "arms=[scratch]", "grid=[]", "seeds=[]"))
    reset_accelerator()
    with pytest.raises(compare.CompareError, match=r"ft/scratch/base holds a scratch fine-tuning .* \(train\)"):
        compare.run(tiny(tmp_path, "arms=[scratch]", "grid=[]", "seeds=[]", "finetune.train.steps=5"))


def test_how_often_a_finetuning_evaluates_changes_neither_what_it_learns_nor_which_finished_runs_a_plan_reuses(tmp_path, capsys):
    # The Fashion-MNIST semi plan's seed runs spent more time scoring its 10,000 test images every 50 steps than
    # training: a plan that raises eval_every reuses its finished runs (their curves have more points), since
    # evaluating does not move what a run learns or its last score. Not so where the run keeps its best evaluation.
    plan = ("arms=[scratch]", "grid=[]", "seeds=[]")
    compare.run(tiny(tmp_path, *plan))  # evaluates every 2 of its 4 steps
    run = tmp_path / "cmp" / "ft" / "scratch" / "base"
    weights, top1 = load_file(run / "model.safetensors"), json.loads((run / "results.json").read_text())["top1"]
    reset_accelerator()
    capsys.readouterr()
    compare.run(tiny(tmp_path, *plan, "finetune.finetune.eval_every=4"))
    assert "scratch fine-tuning base: finished before, skipped" in capsys.readouterr().out
    reset_accelerator()
    compare.run(tiny(tmp_path, *plan, "finetune.finetune.eval_every=4", f"output_dir={tmp_path / 'once'}"))
    once = tmp_path / "once" / "ft" / "scratch" / "base"
    assert json.loads((once / "results.json").read_text())["top1"] == top1
    again = load_file(once / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)

    keeping = (*plan, "finetune.finetune.keep_best=true", f"output_dir={tmp_path / 'best'}")
    reset_accelerator()
    compare.run(tiny(tmp_path, *keeping))
    reset_accelerator()
    with pytest.raises(compare.CompareError, match=r"ft/scratch/base holds a scratch fine-tuning .* \(finetune\)"):
        compare.run(tiny(tmp_path, *keeping, "finetune.finetune.eval_every=4"))


def test_compare_config_mistakes_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"'finetune' runs .*train.stepz"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["finetune.train.stepz=3"])
    with pytest.raises(ConfigError, match="dev_fraction"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["dev_fraction=1.5"])


def test_a_plan_whose_stages_need_different_precisions_is_refused_at_load():
    # Every stage runs in this process, whose Accelerate state keeps the first stage's precision. Compile is each
    # stage's own (a recipe may turn it on).
    plan = ROOT / "configs" / "compare" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"mpp pretraining runs with train.mixed_precision fp32, "
                                          r"its fine-tuning and few-shot evaluation with bf16; .* in the plan's common section"):
        load_compare_config(plan, ["pretrain.train.mixed_precision=no", "finetune.train.mixed_precision=bf16"])
    assert load_compare_config(plan, ["common.train.mixed_precision=no", "common.train.compile=false",
                                              "grid=[{train.lr: 0.03}, {name: mim, train.compile: true}]"])


def test_shipped_tiny_plan_runs_on_the_synthetic_corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the synthetic corpus is generated under ./data
    cc = load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", [
        f"output_dir={tmp_path / 'cmp'}", "common.data.synthetic_size=400", "arms=[mpp,scratch]", "seeds=[0]", *TINY_RUNS])
    report = compare.run(cc)
    assert set(report["arms"]) == {"mpp", "scratch"} and (tmp_path / "cmp" / "report.md").is_file()
    split = json.loads((tmp_path / "cmp" / "split" / "stage.json").read_text())
    assert split["train_images"] + split["dev_images"] == 400


def uneven_shards(directory, per_class: dict[int, int], shards: int = 3) -> None:
    """Labelled JPEGs, per_class[c] of class c, dealt round-robin over `shards` tar files."""
    directory.mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 120, 150)).save(buf, format="JPEG")
    samples = [(f"c{c}-{i:04d}", c) for c, n in per_class.items() for i in range(n)]
    sinks = [wds.TarWriter(str(directory / f"shard-{s:06d}.tar")) for s in range(shards)]
    for i, (key, label) in enumerate(samples):
        sinks[i % shards].write({"__key__": key, "jpg": buf.getvalue(), "cls": str(label).encode()})
    for sink in sinks:
        sink.close()


def split_keys(directory) -> dict[str, int]:
    from webdataset.tariterators import tarfile_samples
    urls = sorted(str(p) for p in directory.glob("*.tar"))
    return {s["__key__"]: int(s["cls"]) for s in tarfile_samples({"url": u} for u in urls)}


def test_dev_split_is_stratified_exact_per_class_and_deterministic(tmp_path):
    uneven_shards(tmp_path / "down", {0: 100, 1: 50, 2: 31})
    cfg = load_config(None, [f"data.shards={tmp_path / 'down'}"])
    split = compare.split_stage(cfg, tmp_path / "a", 0.35)
    dev, train = split_keys(tmp_path / "a" / "dev"), split_keys(tmp_path / "a" / "train")
    counts = {c: sum(1 for label in dev.values() if label == c) for c in (0, 1, 2)}
    assert counts == {0: 35, 1: 18, 2: 11}  # round(0.35 x n) of every class
    assert split["dev_images_per_class"] == {"0": 35, "1": 18, "2": 11}
    assert not set(dev) & set(train) and len(dev) + len(train) == 181

    shuffled = load_config(None, [f"data.shards={tmp_path / 'down' / 'shard-{000002,000000,000001}.tar'}"])
    compare.split_stage(shuffled, tmp_path / "b", 0.35)
    assert split_keys(tmp_path / "b" / "dev") == dev  # the same images, whatever the shard order


def test_image_groups_keep_each_group_on_one_side_of_the_dev_split_and_in_one_fold(tmp_path):
    # Groups of 10 images per class (keys c<class>-<group><digit>): the emoji plan's drawings of one emoji, in miniature.
    uneven_shards(tmp_path / "down", {0: 100, 1: 50, 2: 30})
    cfg, pattern = load_config(None, [f"data.shards={tmp_path / 'down'}"]), r"(c\d-\d{3})\d$"
    group = lambda key: key[-6:-1]  # noqa: E731 (the key's group, as the pattern reads it)
    split = compare.split_stage(cfg, tmp_path / "a", 0.35, pattern)
    dev, train = split_keys(tmp_path / "a" / "dev"), split_keys(tmp_path / "a" / "train")
    assert not {group(k) for k in dev} & {group(k) for k in train} and len(dev) + len(train) == 180
    assert split["dev_images_per_class"] == {"0": 30, "1": 20, "2": 10}  # whole groups, nearest 35% of each class
    assert compare.split_stage(cfg, tmp_path / "b", 0.35, pattern)["dev_images_per_class"] == split["dev_images_per_class"]
    assert split_keys(tmp_path / "b" / "dev") == dev  # deterministic
    folds = compare.fold_stage(cfg, tmp_path / "f", 3, pattern)["folds"]
    fold_groups = [{group(k) for k in split_keys(tmp_path / "f" / f"fold{i}" / "dev")} for i in range(len(folds))]
    assert sum(map(len, fold_groups)) == len(set().union(*fold_groups)) == 18  # every group in exactly one fold
    assert all(len({g[:2] for g in groups}) == 3 for groups in fold_groups)  # every fold holds every class


def test_dev_split_too_small_to_rank_the_grid_is_refused(tmp_path):
    uneven_shards(tmp_path / "down", {0: 100, 1: 50, 2: 30})
    cfg = load_config(None, [f"data.shards={tmp_path / 'down'}"])
    with pytest.raises(compare.CompareError, match=r"at least 10 images of every class \(class 2 has 30 images, so 6 in dev\)"):
        compare.split_stage(cfg, tmp_path / "split", 0.2)
    assert not (tmp_path / "split").exists()  # refused before writing anything


def test_a_dev_split_too_small_is_refused_before_any_pretraining(tmp_path):
    cc = tiny(tmp_path, "dev_fraction=0.05")  # 2 dev images per class
    with pytest.raises(compare.CompareError, match="too small to pick"):
        compare.run(cc)
    assert not (tmp_path / "cmp" / "pre").exists()  # no pretraining spent on a comparison that cannot rank its grid


def test_the_report_reads_a_resumed_runs_curves_whole(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from pipelines.comparison.report import last_quarter_change, scalar_history

    for part, steps in enumerate(([0, 1000, 2000], [2000, 3000, 4000])):  # a run resumed at step 2000
        with SummaryWriter(str(tmp_path / "run" / "tensorboard" / f"part{part}")) as writer:
            for step in steps:
                writer.add_scalar("val/loss", 1.0 / (1 + step / 1000) + part, step)
    curve = scalar_history(tmp_path / "run", ("val/loss", "knn/top1"))["val/loss"]
    assert [step for step, _ in curve] == [0, 1000, 2000, 3000, 4000]
    assert curve[2][1] == pytest.approx(1 + 1 / 3)  # the step both parts logged: the resumed part's value
    assert last_quarter_change(curve) == pytest.approx((1 + 1 / 5) - (1 + 1 / 4))  # step 4000 minus step 3000


def test_five_arms_three_of_them_mpp_variants_run_in_one_plan(tmp_path):
    # The paper's pretext ablations (target, corruption rate) as arms, beside supervised pretraining and scratch.
    arms = ("arms=[mpp, {name: mpp-pixel, objective: mpp, pretrain: {mpp.target: pixels}}, "
            "{name: mpp-15pct, objective: mpp, pretrain: {mpp: {corrupt_rate: 0.15}}}, supervised, scratch]")
    report = compare.run(tiny(tmp_path, arms, "grid=[]", "seeds=[0]"))
    assert list(report["arms"]) == ["mpp", "mpp-pixel", "mpp-15pct", "supervised", "scratch"]
    assert len(report["gaps"]) == 10
    configs = {arm: load_config(tmp_path / "cmp" / "pre" / arm / "config.yaml") for arm in ("mpp", "mpp-pixel", "mpp-15pct")}
    assert [(c.mpp.target, c.mpp.corrupt_rate) for c in configs.values()] == [("color", 0.5), ("pixels", 0.5), ("color", 0.15)]
    assert report["arms"]["mpp-pixel"]["objective"] == "masked patch prediction (mpp.target=pixels)"
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert text.startswith("# mpp vs mpp-pixel vs mpp-15pct vs supervised vs scratch") and "- mpp-pixel - scratch:" in text


def test_arms_are_checked_when_the_plan_is_loaded(tmp_path):
    plan = ROOT / "configs" / "compare" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"arm 'byol' names objective 'byol'; choose one of mpp, supervised \(or the arm scratch\)"):
        load_compare_config(plan, ["arms=[byol]"])
    with pytest.raises(ConfigError, match=r"arm name 'mpp' is taken"):
        load_compare_config(plan, ["arms=[mpp, {name: mpp, objective: mpp}]"])
    with pytest.raises(ConfigError, match=r"'pretrain' runs .*mpp.targte"):
        load_compare_config(plan, ["arms=[{name: x, objective: mpp, pretrain: {mpp.targte: pixels}}]"])


def test_a_registered_objective_is_an_arm(tmp_path, monkeypatch):
    from mpp.model.registry import OBJECTIVES, ObjectiveKind
    from test_pretrain import MeanBrightness

    monkeypatch.setitem(OBJECTIVES, "brightness", ObjectiveKind(lambda backbone, cfg, classes: MeanBrightness(backbone),
                                                                reads_labels=False, summary="mean brightness"))
    report = compare.run(tiny(tmp_path, "arms=[brightness, scratch]", "grid=[]", "seeds=[0]"))
    assert report["arms"]["brightness"]["objective"] == "mean brightness"
    assert report["arms"]["brightness"]["pretrain"]["description"] == MeanBrightness.description


def test_dev_folds_pick_by_cross_validation_and_fine_tune_the_pick_on_every_image(tmp_path):
    report = compare.run(tiny(tmp_path, "arms=[scratch]", "seeds=[0]", "dev_folds=2"))
    entry = report["arms"]["scratch"]
    assert report["dev_folds"] == 2 and report["dev_resolution"]["images"] == 400  # every labelled image scored once
    runs = {p.name for p in (tmp_path / "cmp" / "ft" / "scratch").iterdir()}
    assert {"sgd-0.03-f0", "sgd-0.03-f1", "mim-f0", "mim-f1", f"{entry['recipe']}-s0"} == runs
    trained_on = load_config(tmp_path / "cmp" / "ft" / "scratch" / f"{entry['recipe']}-s0" / "config.yaml").data.shards
    assert trained_on == str(tmp_path / "down")  # the pick trains on all labelled images
    folds = json.loads((tmp_path / "cmp" / "split" / "stage.json").read_text())["folds"]
    assert [f["dev_images"] for f in folds] == [200, 200] and all(f["train_images"] == 200 for f in folds)
    assert "2-fold cross-validation over the 400 labelled images" in (tmp_path / "cmp" / "report.md").read_text()
    with pytest.raises(ConfigError, match="dev_folds 1 is no cross-validation"):
        tiny(tmp_path, "dev_folds=1")


def test_the_dev_split_reads_labels_as_training_does(tmp_path):
    # Labels in json, as class names: the split used to read integer `cls` members only.
    (tmp_path / "down").mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 120, 150)).save(buf, format="JPEG")
    with wds.TarWriter(str(tmp_path / "down" / "shard-000000.tar")) as sink:
        for i in range(60):
            sink.write({"__key__": f"k{i:04d}", "jpg": buf.getvalue(), "json": json.dumps({"label": ("cat", "dog")[i % 2]}).encode()})
    split = compare.split_stage(load_config(None, [f"data.shards={tmp_path / 'down'}"]), tmp_path / "split", 0.34)
    assert split["dev_images_per_class"] == {"0": 10, "1": 10} and split["train_images"] == 40
    summary = json.loads((tmp_path / "split" / "dev" / "summary.json").read_text())
    assert summary["class_names"] == ["cat", "dog"] and summary["samples"] == 20


def test_a_plan_of_one_recipe_names_that_recipe_in_its_report():
    # The leak plan's report said "one recipe (sgd, lr 0.03)", the finetune section's, while every arm ran its one
    # grid recipe (AdamW).
    from pipelines.comparison.report import selection_text

    cc = load_compare_config(ROOT / "configs" / "compare" / "hybrid_leak.yaml")
    base = stage_config(cc, "finetune")
    text = selection_text({"recipes": recipes(cc), "selection": {}, "select_on_dev": False}, cc, base)
    assert text.startswith("one recipe (`mim-nodp`, its keys below) for every arm") and "sgd" not in text
    plain = load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["grid=[]", "lrs=[]"])
    text = selection_text({"recipes": recipes(plain), "selection": {}, "select_on_dev": False}, plain, stage_config(plain, "finetune"))
    assert re.match(r"one recipe \(\w+, lr [0-9.e-]+\) for every arm", text), text


def test_dry_run_states_the_smallest_gap_the_design_resolves_and_trains_nothing(tmp_path, capsys):
    import math

    import yaml
    from pipelines import cli

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(tiny(tmp_path, "target_gap=0.02").model_dump(mode="json")))
    assert cli.main(["compare", "--config", str(plan), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 30 test images, seeds [0, 1], the plan's assumed 20% disagreement and 0.5-point seed spread:
    # standard error sqrt(0.2 / 30 + 2 x 0.005^2 / 2); x 1.96 for the half-width, x (1.96 + 0.84) at 80% power.
    error = math.sqrt(0.2 / 30 + 0.005**2)
    assert "30 test images and 2 seed(s) per arm" in out
    assert f"beyond ±{100 * 1.959964 * error:.2f} points is resolved" in out  # 16.03
    assert f"a true gap of {100 * 2.801585 * error:.2f} points is resolved 4 times in 5" in out  # 22.92
    # the dev split: 25% of 400 labelled images, 100: 2.8016 x sqrt(0.2 / 100) = 12.53 points
    assert "The dev images (100) tell two candidates apart, 4 times in 5, when they differ by 12.53 points" in out
    # 2 points need 0.2 / ((0.02 / 2.8016)^2 - 0.005^2) = 7,703.3 -> 7,704 test images at 2 seeds
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: this comparison resolves gaps of 22.92 points, wider than its target_gap of 2.00 "
                       "points; about 7,704 test images at 2 seed(s) would resolve it."]
    # What it can cost, to size it: 3 arms x (2 candidates of 4 steps on the dev split + the pick at its second seed,
    # its first being its candidate run; no sensitivity lines) = 9 runs of 36 steps, as the tiny plan runs them; mpp
    # and supervised pretrain 3 steps each.
    assert "At most 6 pretraining steps and 9 fine-tuning runs of 36 steps in all" in out
    assert not (tmp_path / "cmp").exists()  # nothing split, pretrained or fine-tuned
    # lengths x2 and x4 of the pick (8, 16 steps), every candidate near-best and so tested at both seeds, two
    # pretraining lengths: 5 fine-tuning sides (scratch once) x (4 candidates, 32 steps, + each at its second seed,
    # 32 more) and each pretrained arm at 3 + 6 steps
    assert cli.main(["compare", "--config", str(plan), "--dry-run", "lengths=[1,2]", "max_length=4", "sensitivity=true",
                     "pretrain_lengths=[1,2]"]) == 0
    assert "At most 18 pretraining steps and 40 fine-tuning runs of 320 steps in all" in capsys.readouterr().out
    # A seed spread too wide for the target at any test-set size asks for seeds instead: 2 x 0.02^2 / (0.01 / 2.8016)^2 = 62.8
    assert cli.main(["compare", "--config", str(plan), "--dry-run", "target_gap=0.01", "assumed_seed_std=0.02"]) == 0
    assert "the seeds' spread alone is too wide for it at 2 seed(s): it needs at least 63 seeds per arm" in capsys.readouterr().out
    assert cli.main(["compare", "--config", str(plan), "--dry-run", "target_gap=0.3"]) == 0
    out = capsys.readouterr().out
    assert "That is within the target_gap of 30.00 points." in out and "Finished in" not in out

    # Run in part (the scratch arm: its 2 candidates and its pick's second seed, 12 steps), the dry run says what a
    # rerun reuses and the most left: 36 - 12 fine-tuning steps, and both pretrainings' 6 steps.
    compare.run(load_compare_config(plan, ["arms=[scratch]"]))
    reset_accelerator()
    assert cli.main(["compare", "--config", str(plan), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"Finished in {re.escape(str(tmp_path / 'cmp'))} already, and reused by a rerun: 3 fine-tuning runs "
                     rf"of 12 steps and 0 pretraining steps; left: at most 24 fine-tuning steps \(about [\d.]+ h of runs "
                     rf"at the [\d.]+ s a step the finished ones took over all their starts; .*\) and 6 pretraining steps\.", out), out


def test_what_a_plan_finished_counts_its_fine_tunings_over_every_start_and_its_pretrainings_only(tmp_path):
    from pipelines.comparison.plan import finished_training

    records = {"budget-10/ft/scratch/base-x8-s0": {"steps": 2400, "wall_time_s": 900.0, "stage_wall_time_s": 300.0},  # resumed
               "budget-10/ft/mpp/base-f0": {"steps": 300, "wall_time_s": 60.0, "stage_wall_time_s": 61.0},
               "pre/mpp": {"steps": 8000, "wall_time_s": 1400.0}, "budget-10/test/mpp/base-s0": {"steps": 7},
               "budgets": {"images": 100}, "budget-10/frozen/mpp": {"knn": 0.5}}
    for directory, record in records.items():
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / compare.STAGE_DONE).write_text(json.dumps(record))
    (tmp_path / "budget-10/ft/scratch/base-x4-f0").mkdir()
    (tmp_path / "budget-10/ft/scratch/base-x4-f0" / compare.STAGE_DONE).write_text('{"steps": 12')  # an older mpp cut it
    assert finished_training(tmp_path) == {"directory": str(tmp_path), "finetune_runs": 2, "finetune_steps": 2700,
                                           "finetune_s": 960.0, "pretrain_steps": 8000}


def test_image_groups_that_miss_a_test_images_key_are_one_plain_error_naming_the_key_and_the_field(tmp_path, capsys):
    import yaml
    from pipelines import cli

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(tiny(tmp_path).model_dump(mode="json")))
    assert cli.main(["compare", "--config", str(plan), "--dry-run", "image_groups=^shard-000000.tar/(00)-000"]) != 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.strip().count("\n") == 0
    assert ("image shard-000000.tar/00-0010 does not match image_groups '^shard-000000.tar/(00)-000', whose first "
            "capture group must name what the image shows; fix the pattern or set image_groups: null") in captured.err
    # Grouped by the key's last digit: 30 test images in 10 groups of 3, assumed answered alike (as 10 images).
    assert cli.main(["compare", "--config", str(plan), "--dry-run", "image_groups=(.)$"]) == 0
    assert "30 test images in 10 groups (image_groups), each group's images assumed answered alike, so they count as 10 " \
           "independent images and 2 seed(s) per arm" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="image_groups 'abc' has no capture group"):
        load_compare_config(ROOT / "configs" / "compare" / "tiny.yaml", ["image_groups=abc"])


def test_gaps_over_grouped_test_images_resample_the_groups_and_state_their_design_effect(tmp_path):
    """Two arms' results on 100 images, each scored as 4 identical renditions: grouped, the comparison is the one on the
    100 originals; without image_groups it would claim twice the precision."""
    rng = np.random.default_rng(0)
    right = {"a": rng.random((2, 100)) < 0.7, "b": rng.random((2, 100)) < 0.6}
    keys = [f"s.tar/x_v{v}-{i:03d}" for i in range(100) for v in range(4)]
    arms = {arm: {"correct": {str(seed): {k: int(row[i // 4]) for i, k in enumerate(keys)} for seed, row in enumerate(r)},
                  "test": {"top1": float(r.mean()), "top1_std": float(r.mean(axis=1).std(ddof=1))}}
            for arm, r in right.items()}
    grouped, = compare.gaps(arms, tiny(tmp_path, r"image_groups=-(\d+)$", "target_gap=0.2"))
    plain, = compare.gaps(arms, tiny(tmp_path, "target_gap=0.2"))
    assert grouped["resolution"]["design_effect"] == pytest.approx(4.0) and plain["resolution"]["design_effect"] == 1.0
    r = plain["resolution"]  # the same disagreement and seed spread, over the 100 originals
    originals = gap_resolution(100, 2, r["disagreement"], r["seed_std"])
    assert grouped["resolution"]["resolvable"] == pytest.approx(originals.resolvable)
    assert originals.resolvable > r["resolvable"]
    assert grouped["resolution"]["grouped"] and grouped["resolution"]["images_needed"] > 3 * plain["resolution"]["images_needed"]
    assert grouped["high"] - grouped["low"] > 1.5 * (plain["high"] - plain["low"])
    assert all(grouped["mcnemar"][s]["p_value"] > plain["mcnemar"][s]["p_value"] for s in ("0", "1"))
    # The report says so: planned (groups assumed answered alike), observed, and which McNemar test it printed.
    from pipelines.comparison.report import design_record, gap_lines, resolution_lines
    cc = tiny(tmp_path, r"image_groups=-(\d+)$", "target_gap=0.2")
    report = {"gaps": [grouped], "design": design_record(cc, keys, 2, None), "config": cc.model_dump(mode="json"), "arms": arms}
    text = "\n".join(resolution_lines(report) + gap_lines(report, [0, 1]))
    assert ("400 test images in 100 groups (image_groups), each group's images assumed answered alike, so they count as "
            "100 independent images") in text
    assert "test images (grouped, with an observed design effect of 4.00: as 100 independent images)" in text
    assert "the bootstrap resamples whole groups, and McNemar's test is the clustered one" in text


def test_a_resolved_gap_whose_worse_arm_kept_its_longest_fine_tuning_is_said_to_maybe_be_that_arms_short_training():
    # The Fashion-MNIST semi plan reported MPP +26 points over a scratch arm that kept the longest of its lengths; at
    # four times the fine-tuning the gap was +3.6. The gap's own line must say it, not only the length section.
    from pipelines.comparison.report import short_loser_text
    gap = {"arms": ["scratch", "mpp"], "gap": -0.26, "excludes_zero": True}
    arms = {"scratch": {"at_longest_length": True, "length": "2"}, "mpp": {"at_longest_length": True, "length": "2"}}
    assert "**scratch, the worse arm, kept the longest fine-tuning it was given (x2)" in short_loser_text(gap, arms)
    assert "may be its short training" in short_loser_text(gap, arms)
    assert short_loser_text(gap, {**arms, "scratch": {"at_longest_length": False, "length": "1"}}) == ""  # only the better arm
    assert short_loser_text({**gap, "excludes_zero": False}, arms) == ""  # unresolved: no gain to explain
    assert "mpp, the worse arm" in short_loser_text({**gap, "gap": 0.1}, arms)
    # kept x1, with its longest length tried (x2) an image or two below it: no fall the dev split resolves ended it
    level = {"at_longest_length": False, "longest_near_best": True, "length": "1", "lengths": {"1": 0.5, "2": 0.49}}
    assert ("**scratch, the worse arm, was fine-tuned no longer than x2, which scored below its pick (x1) by less than "
            "the dev split resolves: its dev top-1 may not have peaked: part of this gap") in short_loser_text(gap, {**arms, "scratch": level})


def test_the_report_puts_the_test_sets_baselines_and_balanced_accuracy_beside_top1(tmp_path):
    # An imbalanced test set of one grey image repeated (20 of class 0, 5 each of classes 1 and 2): a classifier gives
    # every image the same class, so its balanced accuracy is 1/3 when that class is 0, 1 or 2 and 0 otherwise.
    uneven_shards(tmp_path / "uneven", {0: 20, 1: 5, 2: 5}, shards=1)
    val = tmp_path / "uneven" / "shard-000000.tar"
    report = compare.run(tiny(tmp_path, "arms=[scratch]", "grid=[]", "seeds=[0]", f"finetune.data.val_shards={val}",
                              f"common.data.val_shards={val}"))
    assert report["test_set"] == {"baselines": {"majority": 20 / 30, "chance": 0.1}, "images": 30,
                                  "per_class": {"0": 20, "1": 5, "2": 5}, "imbalanced": True}
    entry = report["arms"]["scratch"]
    top1 = entry["test"]["top1"]
    assert top1 in (20 / 30, 5 / 30, 0.0)
    assert entry["balanced_accuracy"]["mean"] == pytest.approx(1 / 3 if top1 else 0.0)
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "The test set: 30 images of 3 classes (5 to 20 images per class); a classifier that knows nothing scores " \
           "majority class 66.67%, chance 10.00% there." in text
    head = next(line for line in text.splitlines() if line.startswith("| arm |"))
    assert head.endswith("| top-1 (seed 0; majority class 66.67%, chance 10.00%) | each seed | balanced accuracy (chance 10.00%) |")
    row = next(line for line in text.splitlines() if line.startswith("| scratch |"))
    assert row.endswith(f"| {100 * entry['balanced_accuracy']['mean']:.2f}% |")
    # no better than always answering class 0
    assert f"> **Warning:** scratch's test top-1 ({100 * top1:.2f}%) is no better than a classifier that knows nothing" in text


def test_frozen_scores_at_or_below_the_random_init_backbones_are_flagged_in_words():
    from pipelines.comparison.report import frozen_flags

    def frozen(knn, shot):
        return {pool: {"knn": knn, "fewshot": {"5": shot}} for pool in ("cls", "mean")}

    arms = {"mpp": {"pretrain": {"steps": 10}, "frozen": frozen(0.30, 0.50)},
            "supervised": {"pretrain": {"steps": 10}, "frozen": frozen(0.60, 0.70)},
            "scratch": {"pretrain": None, "frozen": frozen(0.40, 0.50)}}
    lines = frozen_flags(arms, [5])
    assert len([line for line in lines if line]) == 1  # supervised is above the random-init backbone everywhere
    assert lines[0].startswith("- **mpp's frozen features score at or below a random-init backbone's** (kNN cls 30.00% "
                               "against 40.00%; kNN mean 30.00% against 40.00%; 5-shot cls 50.00% against 50.00%; "
                               "5-shot mean 50.00% against 50.00%)")
    assert "no verdict on it" in lines[0]
    assert frozen_flags({"mpp": arms["mpp"]}, [5])[0].startswith("No scratch arm in this plan")


def test_label_budgets_are_nested_draws_run_per_budget_with_one_pretraining_per_arm(tmp_path, capsys):
    report = compare.run(tiny(tmp_path, "arms=[mpp,scratch]", "grid=[]", "seeds=[0,1]", "labels_per_class=[4,8]"))
    out = tmp_path / "cmp"
    draws = {name: split_keys(out / "budgets" / name) for name in ("4", "8")}
    for name, keys in draws.items():  # stratified: that many of each of the 10 classes
        assert sorted(list(keys.values()).count(c) for c in range(10)) == [int(name)] * 10
    assert set(draws["4"]) < set(draws["8"])  # nested
    log = capsys.readouterr().out
    assert log.count("mpp pretraining: running") == 1 and log.count("mpp pretraining: finished before, skipped") == 1
    assert not list(out.glob("budget-*/pre"))
    for name in ("4", "8"):
        for arm in ("mpp", "scratch"):
            for seed in ("", "-s1"):  # every arm and seed fine-tunes on the budget's own draw
                cfg = load_config(out / f"budget-{name}" / "ft" / arm / f"base{seed}" / "config.yaml")
                assert cfg.data.shards == str(out / "budgets" / name)
        assert load_config(out / f"budget-{name}" / "ft" / "mpp" / "base" / "config.yaml").data.val_shards == \
            load_config(out / "budget-4" / "ft" / "mpp" / "base" / "config.yaml").data.val_shards  # one test set
        assert (out / f"budget-{name}" / "report.md").is_file()
        assert json.loads((out / f"budget-{name}" / "ft" / "scratch" / "base" / "results.json").read_text())["steps"] == 4
    assert list(report["budgets"]) == ["4", "8"] and report["kind"] == "labels per class"
    assert [report["budgets"][n]["images"] for n in ("4", "8")] == [40, 80]
    for budget in report["budgets"].values():
        (gap,) = budget["gaps"]
        assert gap["arms"] == ["mpp", "scratch"] and gap["low"] <= gap["gap"] <= gap["high"] and gap["images"] == 30
        assert set(budget["arms"]["mpp"]["test"]["top1_seeds"]) == {"0", "1"}
    text = (out / "report.md").read_text()
    assert text.startswith("# Label efficiency: mpp vs scratch")
    rows = [line for line in text.splitlines() if line.startswith(("| 4 |", "| 8 |"))]
    assert len(rows) == 2 and all(re.search(r"\| [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]", row) for row in rows)
    assert (out / "label_efficiency.png").is_file() and (out / "label_efficiency.svg").is_file()


def test_a_label_budget_larger_than_a_class_is_refused_before_any_pretraining(tmp_path):
    with pytest.raises(compare.CompareError, match=r"labels_per_class 50 needs that many images of every class, and "
                                                   r"class 0 of .*down has 40; lower the budget to at most 40"):
        compare.run(tiny(tmp_path, "arms=[mpp,scratch]", "grid=[]", "labels_per_class=[10,50]"))
    assert not (tmp_path / "cmp" / "pre").exists() and not (tmp_path / "cmp" / "budgets").exists()
    with pytest.raises(ConfigError, match=r"label budgets must be positive and increase"):
        tiny(tmp_path, "labels_per_class=[25,10]")
    with pytest.raises(ConfigError, match=r"both labels_per_class and label_fractions"):
        tiny(tmp_path, "labels_per_class=[10]", "label_fractions=[0.5]")


def test_a_negative_control_pretrained_on_pure_noise_shows_no_resolved_gain_over_scratch(tmp_path):
    import numpy as np

    control = "{name: mpp-noise, objective: mpp, control: noise}"
    # kNN and few-shot while it pretrains, as a plan that watches its arms does: scored on the plan's labelled images
    watched = ["pretrain.knn.every=3", "common.knn.train_images=40", "common.knn.eval_images=30", "pretrain.fewshot.every=3"]
    report = compare.run(tiny(tmp_path, f"arms=[{control}, scratch]", "grid=[]", "seeds=[0,1]", "noise_images=40", *watched))
    out = tmp_path / "cmp"
    pretraining = load_config(out / "pre" / "mpp-noise" / "config.yaml")
    assert pretraining.data.shards == str(out / "noise") and pretraining.objective == "mpp"
    assert pretraining.knn.shards == pretraining.fewshot.shards == str(tmp_path / "up")
    assert {"knn/top1", "fewshot/1shot"} <= set(json.loads((out / "pre" / "mpp-noise" / "results.json").read_text())["final"])
    from webdataset.tariterators import tarfile_samples
    images = [s["png"] for s in tarfile_samples({"url": str(u)} for u in sorted((out / "noise").glob("*.tar")))]
    assert len(images) == 40
    pixels = np.asarray(Image.open(io.BytesIO(images[0])), dtype=float)
    assert pixels.shape == (16, 16, 3) and abs(pixels.mean() - 127.5) < 12 and pixels.std() > 65  # uniform noise
    (gap,) = report["gaps"]
    assert gap["arms"] == ["mpp-noise", "scratch"] and not gap["excludes_zero"]
    text = (out / "report.md").read_text().split("## Negative control")[1]
    assert f"- Negative control: mpp-noise (pretrained on pure noise) - scratch, {100 * gap['gap']:+.2f} points" in text
    assert "no resolved gain, as there should be none; the comparison is able to say no." in text
    assert report["arms"]["mpp-noise"]["objective"] == "masked patch prediction (on pure-noise images: a negative control)"
    with pytest.raises(ConfigError, match="arm 'x' is a noise control without an objective"):
        tiny(tmp_path, "arms=[{name: x, control: noise}, scratch]")


def test_a_negative_control_ahead_of_scratch_warns_that_the_comparison_can_flatter():
    from pipelines.comparison.report import control_lines

    report = {"arms": {"scratch": {"control": None}, "noise": {"control": "noise"}},
              "gaps": [{"arms": ["scratch", "noise"], "gap": -0.04, "low": -0.07, "high": -0.01, "excludes_zero": True}]}
    lines = control_lines(report)
    assert lines[2] == ("> **Warning:** the negative control noise (pretrained on pure noise) came out ahead of scratch, "
                        "+4.00 points [+1.00, +7.00]: this comparison can show a gain where there is none to find, so do "
                        "not trust its other gains over scratch until that is explained (a weak scratch recipe, a short "
                        "scratch length).")


def test_the_semi_supervised_fashion_mnist_plan_loads_and_its_dry_run_checks_it(tmp_path, capsys):
    # The shipped plan with its data paths pointed at small shards (the real ones need its prepare commands): every
    # stage's config validates, the dry run counts the test images, checks the budgets and states the resolution.
    write_test_shards(tmp_path / "train", [500], size=28)  # 50 images per class
    val = write_test_shards(tmp_path / "test", [200], size=28)
    (tmp_path / "train" / "summary.json").write_text(json.dumps({"labels": True, "classes": 10}))
    plan = ROOT / "configs" / "compare" / "fashion_mnist_semi.yaml"
    data = [f"pretrain.data.shards={tmp_path / 'train'}", f"finetune.data.shards={tmp_path / 'train'}",
            f"finetune.data.val_shards={val[0]}", f"output_dir={tmp_path / 'cmp'}"]
    cc = load_compare_config(plan, [*data, "labels_per_class=[10,25]"])
    assert [arm.control for arm in cc.arms] == [None, None, "noise"] and cc.target_gap == 0.02
    design = compare.check(cc)
    assert (design["test_images"], design["seeds"], design["dev_images"]) == (200, 3, None)
    out = capsys.readouterr().out
    assert "[compare] design: 200 test images and 3 seed(s) per arm" in out
    assert "warning: this comparison resolves gaps of" in out and "wider than its target_gap of 2.00 points" in out
    assert not (tmp_path / "cmp").exists()
    with pytest.raises(compare.CompareError, match=r"labels_per_class 100 needs that many images of every class"):
        compare.check(load_compare_config(plan, data))  # the plan's own budgets need the real 6,000 per class


