"""Faults in what runs leave on disk: checkpoints taken for what they are not, weights that are not finite, exports
written over a run. Each injects the fault into a tiny real run and asserts the outcome docs/reliability.md gives."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import launch
from mpp.model.checkpoint import CheckpointError, classifier_head, load_backbone
from mpp.config import load_config
from pipelines.stages import finetune, pretrain

from conftest import TINY, reset_accelerator, write_test_shards

CLASS_NAMES = ["disc", "square", "triangle", "ring", "h-stripes", "v-stripes", "checkers", "cross", "blob", "star"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An MPP pretraining (checkpoints at steps 1 and 2) and a fine-tuning of it with 12 classes, over shards whose
    summary.json names 10."""
    root = tmp_path_factory.mktemp("runs")
    write_test_shards(root / "shards", [30, 30], size=24)
    (root / "shards" / "summary.json").write_text(json.dumps(
        {"samples": 60, "classes": 10, "labels": True, "class_names": CLASS_NAMES}))
    common = [f"data.shards={root / 'shards'}", f"data.val_shards={root / 'shards'}", *TINY, "train.steps=2",
              "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=1"]
    try:
        pretrain.run(load_config(None, [*common, f"output_dir={root / 'pre'}"]))
        reset_accelerator()
        finetune.run(load_config(None, [*common, f"output_dir={root / 'ft'}", "model.num_classes=12",
                                        "finetune.eval_every=2"]), ckpt=str(root / "pre"))
    finally:
        reset_accelerator()
    return root


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line.split("error: ", 1)[1] for line in err.splitlines() if "error: " in line]


def metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["mpp"])


def test_final_weights_carry_their_architecture_and_another_head_count_is_refused(runs, tmp_path):
    architecture = {"width": 64, "depth": 2, "heads": 2, "patch_size": 4, "image_size": 16, "stem": "patch", "pos_embed": "learned"}
    assert metadata(runs / "pre" / "model.safetensors") == {**architecture, "holds": "backbone"}
    assert metadata(runs / "ft" / "model.safetensors") == {**architecture, "holds": "classifier", "pool": "cls"}  # 12 outputs, 10 names: none

    bare = tmp_path / "backbone.safetensors"  # copied away from its run: no config.yaml says the heads
    shutil.copy(runs / "pre" / "model.safetensors", bare)
    tiny = [o for o in TINY if not o.startswith(("model.heads", "model.width"))]  # vit_ti: 192 wide, 3 heads
    with pytest.raises(CheckpointError) as err:  # 4 heads over width 64 fit the shapes: it used to load silently
        load_backbone(bare, load_config(None, [*tiny, "model.heads=4"]).model)
    assert str(err.value) == (f"{bare} holds a ViT with 2 attention heads but model.heads=4; set model.heads=2 or drop "
                              f"the override (a ViT cannot change its head count)")
    assert load_backbone(bare, load_config(None, tiny).model).heads == 2  # vit_ti's 3 heads give way to the file's


def test_a_pretraining_checkpoint_exports_as_a_backbone(runs, tmp_path, capsys):
    pytest.importorskip("transformers", minversion="5", reason="exporting needs transformers>=5")
    step = runs / "pre" / "checkpoints" / "step_00000001"
    assert "mask_embedding" in load_file(step / "model.safetensors")  # the MPP objective, 512-way colour head and all
    assert launch.main(["export", "--ckpt", str(step), "--to", "hf", str(tmp_path / "step1")]) == 0
    assert json.loads((tmp_path / "step1" / "config.json").read_text())["architectures"] == ["ViTModel"]
    card = (tmp_path / "step1" / "README.md").read_text()
    assert "masked patch prediction" in card and "**Steps**: 1 of 2" in card

    unfinished = tmp_path / "unfinished"  # a run stopped before its model.safetensors, its shards elsewhere
    shutil.copytree(runs / "pre" / "checkpoints", unfinished / "checkpoints")
    (unfinished / "config.yaml").write_text((runs / "pre" / "config.yaml").read_text().replace(
        str(runs / "shards"), str(tmp_path / "not-here")))
    assert launch.main(["export", "--ckpt", str(unfinished), "--to", "hf", str(tmp_path / "early")]) == 0
    assert json.loads((tmp_path / "early" / "config.json").read_text())["architectures"] == ["ViTModel"]
    assert "fine-tuned" not in (tmp_path / "early" / "README.md").read_text()

    # A fine-tuning's checkpoint is still a classifier; without its results.json the card does not guess the start.
    unfinished_ft = tmp_path / "unfinished-ft"
    shutil.copytree(runs / "ft" / "checkpoints", unfinished_ft / "checkpoints")
    shutil.copy(runs / "ft" / "config.yaml", unfinished_ft / "config.yaml")
    with pytest.warns(UserWarning, match="name 10 classes but the classifier has 12 outputs"):
        assert launch.main(["export", "--ckpt", str(unfinished_ft), "--to", "hf", str(tmp_path / "ft-early")]) == 0
    config = json.loads((tmp_path / "ft-early" / "config.json").read_text())
    assert config["architectures"] == ["ViTForImageClassification"] and len(config["id2label"]) == 12
    assert "a starting point not recorded" in (tmp_path / "ft-early" / "README.md").read_text()


def test_a_classifier_with_more_classes_than_the_summary_names_exports_with_numbered_labels(runs, tmp_path):
    pytest.importorskip("transformers", minversion="5", reason="exporting needs transformers>=5")
    with pytest.warns(UserWarning) as warned:  # was a traceback: size mismatch for classifier.weight, 12 vs 10
        assert launch.main(["export", "--ckpt", str(runs / "ft"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert [str(w.message) for w in warned if w.category is UserWarning] == [
        f"the training shards ({runs / 'shards'}) name 10 classes but the classifier has 12 outputs, so the classifier's "
        f"labels were exported as LABEL_0 to LABEL_11; the fine-tuning set model.num_classes=12, so no names are known for its "
        f"other outputs"]  # it advised setting data.shards to the fine-tuning's shards, which they were (round 4, Part 1 row 25)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {str(i): f"LABEL_{i}" for i in range(12)}


def test_an_export_into_a_run_is_refused_and_the_run_stays_usable(runs, tmp_path, capsys):
    pytest.importorskip("transformers", minversion="5", reason="exporting needs transformers>=5")
    weights_only = tmp_path / "weights-only"  # an mpp model.safetensors alone, without its config.yaml
    weights_only.mkdir()
    shutil.copy(runs / "ft" / "model.safetensors", weights_only / "model.safetensors")
    in_our_layout = "its model.safetensors, in this project's layout"
    targets = {runs / "ft": "its config.yaml", runs / "pre" / "checkpoints" / "step_00000002": "its config.yaml",
               weights_only: in_our_layout}  # a checkpoint carries the config it was trained with
    for target, found in targets.items():
        before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
        assert launch.main(["export", "--ckpt", str(runs / "ft"), "--to", "hf", str(target)]) == 2
        assert error_lines(capsys) == [
            f"{target} holds a run of this project ({found}); "
            f"the export would replace its model.safetensors with the transformers layout, which finetune, fewshot and "
            f"knn cannot read: choose another directory (--to hf DIR)"]
        assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    assert load_backbone(runs / "ft", load_config(None, TINY).model).width == 64  # finetune --ckpt reads it still
    # An earlier export is not a run: exporting over it again is fine.
    with pytest.warns(UserWarning, match="12 outputs"):
        for _ in range(2):
            assert launch.main(["export", "--ckpt", str(runs / "ft"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert launch.main(["export", "--ckpt", str(runs / "ft"), "--to", "hf", str(tmp_path / ("x" * 300))]) == 2
    assert error_lines(capsys)[0].endswith("more than the 255 its file system allows; choose a shorter path (--to hf DIR)")


def test_nonfinite_weights_are_refused_naming_the_file_and_the_tensor(runs, tmp_path, capsys):
    diverged = tmp_path / "diverged"
    shutil.copytree(runs / "ft", diverged, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    weights = load_file(diverged / "model.safetensors")
    weights["blocks.1.mlp.0.weight"][3, 5] = float("nan")
    save_file(weights, str(diverged / "model.safetensors"))
    message = (f"{diverged / 'model.safetensors'} holds non-finite values (NaN or infinity) in blocks.1.mlp.0.weight: "
               f"the run that wrote it diverged or the file is damaged; pass an earlier checkpoint of that run "
               f"(RUN/checkpoints/step_N) or retrain it")
    with pytest.raises(CheckpointError) as err:  # what finetune, fewshot, knn, compare and export load through
        load_backbone(diverged, load_config(None, TINY).model)
    assert str(err.value) == message
    # kNN scored these weights 10.00%, few-shot gave a number, fine-tuning ran: now each stops with that line.
    assert launch.main(["knn", "--ckpt", str(diverged), f"output_dir={tmp_path / 'knn'}"]) == 2
    assert error_lines(capsys) == [message]
    assert not (tmp_path / "knn").exists()

    weights = load_file(runs / "ft" / "model.safetensors")
    weights["head.bias"][0] = float("inf")  # a classifier's head is checked too (export writes it)
    save_file(weights, str(tmp_path / "head.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds non-finite values \(NaN or infinity\) in head.bias"):
        classifier_head(tmp_path / "head.safetensors")
    assert torch.isfinite(classifier_head(runs / "ft")["weight"]).all()
