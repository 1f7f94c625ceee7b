"""Public weights as an arm of a comparison: the shipped plan configs/compare/public_weights.yaml run end to end with
weights made here, offline (a tiny transformers ViT saved with save_pretrained, and the same tensors in timm's
layout), and the plan's checks of an arm's weights when it loads; and the comparison as TensorBoard shows it (run
names, numbers, test scores), read back from its event files."""

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from mpp.config import ConfigError
from mpp.rundir import sha256
from pipelines.comparison.plan import load_compare_config, trial_name
from pipelines.stages import compare

from conftest import ROOT, write_test_shards
from test_compare import TINY_RUNS
from test_public_weights import timm_names

transformers = pytest.importorskip("transformers")

PLAN = ROOT / "configs" / "compare" / "public_weights.yaml"
WIDTH, HEADS, PATCH = 32, 2, 4


@pytest.fixture(scope="module")
def hub_vit(tmp_path_factory):
    """A ViTForImageClassification over 10 classes with random weights at 32 px, as the Hub holds one."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
                                    intermediate_size=4 * WIDTH, image_size=32, patch_size=PATCH, num_labels=10)
    directory = tmp_path_factory.mktemp("hub") / "vit-tiny-public"
    transformers.ViTForImageClassification(config).save_pretrained(directory)
    return directory


def shipped_plan(tmp_path, weights, *overrides, model=None):
    """The shipped plan with its vit-public arm pointed at `weights` (its model keys replaced by `model` where
    given), on tiny shards, at tiny lengths."""
    plan = yaml.safe_load(PLAN.read_text())
    public = next(arm for arm in plan["arms"] if isinstance(arm, dict) and arm.get("weights"))
    public["weights"] = str(weights)
    public["model"] = model or {"width": None, "depth": None, "heads": None, "patch_size": PATCH, "image_size": 16}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    write_test_shards(tmp_path / "up", [40], size=32)
    write_test_shards(tmp_path / "down", [60, 60], size=32)
    val = write_test_shards(tmp_path / "val", [30], size=32)
    for directory in ("up", "down"):
        (tmp_path / directory / "summary.json").write_text(json.dumps({"labels": True, "classes": 10}))
    data = [f"output_dir={tmp_path / 'cmp'}", f"pretrain.data.shards={tmp_path / 'up'}", "pretrain.data.val_shards=null",
            "pretrain.eval.every=0", f"finetune.data.shards={tmp_path / 'down'}", f"finetune.data.val_shards={val[0]}",
            f"common.knn.shards={tmp_path / 'down'}", f"common.knn.val_shards={val[0]}", "common.knn.train_images=60",
            "common.knn.eval_images=30", "common.train.mixed_precision=no", "pretrain.train.checkpoint_every=3",
            "finetune.train.checkpoint_every=4", "finetune.train.clip_grad_norm=null", "seeds=[0, 1]", "lengths=[1]",
            "grid=[{name: sgd, train: {optimizer: sgd, lr: 0.03}}]"]
    return load_compare_config(tmp_path / "plan.yaml", [*TINY_RUNS, *data, *overrides])


def test_the_shipped_plan_compares_mpp_with_public_weights_beside_scratch(tmp_path, hub_vit):
    report = compare.run(shipped_plan(tmp_path, hub_vit))

    out = tmp_path / "cmp"
    assert list(report["arms"]) == ["mpp", "vit-public", "scratch"]
    public = report["arms"]["vit-public"]
    assert public["pretrain"] is None and public["weights"] == str(hub_vit) and not (out / "pre" / "vit-public").exists()
    assert set(public["test"]["top1_seeds"]) == {"0", "1"}  # the same seeds and test as the other arms
    for run in ("sgd", "sgd-s1"):  # fine-tuned from the given weights at both seeds, at the plan's resolution
        stage = json.loads((out / "ft" / "vit-public" / run / "stage.json").read_text())
        assert stage["inputs"]["ckpt"] == str(hub_vit)
        assert stage["inputs"]["model"]["image_size"] == 16 and stage["inputs"]["model"]["patch_size"] == PATCH
    pairs = {tuple(g["arms"]) for g in report["gaps"]}
    assert pairs == {("mpp", "vit-public"), ("mpp", "scratch"), ("vit-public", "scratch")}
    assert all(g["low"] <= g["gap"] <= g["high"] for g in report["gaps"])
    text = (out / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| vit-public |"))
    assert f"given weights {hub_vit}" in row and "| elsewhere |" in row
    assert "- mpp - vit-public:" in text and "- vit-public - scratch:" in text
    assert "| vit-public | " in text.split("## Frozen features")[1]  # its frozen features scored too
    for run in ("sgd", "sgd-s1"):  # the given weights by their content too: a file replaced at the path is another start
        stage = json.loads((out / "ft" / "vit-public" / run / "stage.json").read_text())
        assert stage["inputs"]["weights_sha256"] == sha256(hub_vit / "model.safetensors")
    assert "weights_sha256" not in json.loads((out / "ft" / "mpp" / "sgd" / "stage.json").read_text())["inputs"]

    # TensorBoard (issue 51 item 7): HParams' first column shows about 15 characters; each run of the comparison
    # is told apart within them (ft/vit-public/sgd and ft/vit-public/sgd-s1 were not), numbers read as written, and
    # every tested run and every arm carries its test scores as scalars that HParams lists as metrics.
    sessions = {p.parent.relative_to(out).as_posix(): EventAccumulator(str(p.parent)).Reload()
                for p in out.rglob("events.out.tfevents*") if not p.name.endswith(".test-scores") or "summary" in p.parts}
    names = {run: hparams(acc, "session_start_info").group_name for run, acc in sessions.items()}
    assert names["ft/vit-public/sgd-s1/tensorboard/finetune"] == "sgd-s1 (vit-public, cmp)"
    assert names["pre/mpp/tensorboard/pretrain"] == "mpp (pretraining, cmp)" and names["summary/mpp"] == "mpp (mean over seeds, cmp)"
    assert len(names) == 10 and len({name[:15] for name in names.values()}) == 10, names
    start = hparams(sessions["ft/scratch/sgd/tensorboard/finetune"], "session_start_info")
    assert start.hparams["train.lr"].string_value == "0.03" and start.hparams["train.seed"].string_value == "0"
    assert [m.name.tag for m in hparams(sessions["pre/mpp/tensorboard/pretrain"], "experiment").metric_infos][-3:] == [
        "test/top1", "test/top5", "test/balanced_acc"]  # whichever run's columns TensorBoard takes
    for arm, entry in report["arms"].items():
        for seed, run in (("0", "sgd"), ("1", "sgd-s1")):
            scores = sessions[f"ft/{arm}/{run}/tensorboard/finetune"].Scalars("test/top1")
            assert [(s.step, s.value) for s in scores] == [(4, pytest.approx(entry["test"]["top1_seeds"][seed]))]
        summary = sessions[f"summary/{arm}"]
        assert summary.Scalars("test/top1")[0].value == pytest.approx(entry["test"]["top1"])
        assert summary.Scalars("test/balanced_acc")[0].value == pytest.approx(entry["balanced_accuracy"]["mean"])
        assert "train.seed" not in hparams(summary, "session_start_info").hparams  # a mean over the seeds
    compare.run(shipped_plan(tmp_path, hub_vit))  # run again: every stage skipped, each score written once
    assert len(list((out / "ft" / "mpp" / "sgd" / "tensorboard" / "finetune").glob("*.test-scores"))) == 1
    assert len(EventAccumulator(str(out / "summary" / "mpp")).Reload().Scalars("test/top1")) == 1


def hparams(accumulator, kind):
    content = accumulator.SummaryMetadata(f"_hparams_/{kind}").plugin_data.content
    return getattr(plugin_data_pb2.HParamsPluginData.FromString(content), kind)


def test_a_comparisons_runs_are_named_by_what_tells_them_apart_first(tmp_path):
    root = tmp_path / "cmp"
    assert [trial_name(root / path, root) for path in ("ft/scratch/mim-x2-s1", "ft/scratch/mim-x4", "pre/mpp",
                                                      "budget-10/ft/mpp/sgd-s1", "summary/vit-public")] == [
        "mim-x2-s1 (scratch, cmp)", "mim-x4 (scratch, cmp)", "mpp (pretraining, cmp)", "sgd-s1 (mpp, budget-10, cmp)",
        "vit-public (mean over seeds, cmp)"]
    assert trial_name(tmp_path / "elsewhere", root) == ""


def test_public_weights_in_timm_layout_are_an_arm_too(tmp_path, hub_vit):
    timm = tmp_path / "timm" / "model.safetensors"
    timm.parent.mkdir()
    save_file(timm_names(hub_vit), str(timm))
    model = {"width": None, "depth": None, "heads": HEADS, "patch_size": PATCH, "image_size": 16}  # timm's file has no heads
    arms = f"arms=[{{name: vit-public, weights: {timm}, model: {json.dumps(model)}}}, scratch]"
    report = compare.run(shipped_plan(tmp_path, timm, arms, "seeds=[0]"))
    assert report["arms"]["vit-public"]["weights"] == str(timm) and "scratch" in report["arms"]


def test_an_arms_weights_are_checked_when_the_plan_loads(tmp_path, hub_vit):
    with pytest.raises(ConfigError, match=r"^arm 'vit-public' starts from weights at \S+nowhere, which does not exist; "
                                          r"download them first .* and set the arm's weights to that path$"):
        shipped_plan(tmp_path, tmp_path / "nowhere")
    wrong_patch = {"width": None, "depth": None, "heads": None, "patch_size": 8, "image_size": 16}
    with pytest.raises(ConfigError, match=r"^arm 'vit-public' cannot fine-tune its weights: .* set model.patch_size=4 "):
        shipped_plan(tmp_path, hub_vit, model=wrong_patch)
    with pytest.raises(ConfigError, match=r"arm 'p' starts from given weights .* drop its objective"):
        shipped_plan(tmp_path, hub_vit, f"arms=[{{name: p, objective: mpp, weights: {hub_vit}}}]")
    with pytest.raises(ConfigError, match=r"arm 'p' names no objective and no weights"):
        shipped_plan(tmp_path, hub_vit, "arms=[{name: p}]")
