"""A classifier's weights outside their run: a copied model.safetensors or an export says what it predicts (its
class names, what its head reads), and `predict` and `export` take that from the file, never from the default
config, whose shards are the synthetic corpus."""

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import launch
from mpp.config import load_config
from pipelines.stages import finetune, prepare

from conftest import TINY, reset_accelerator
from test_user_folder import CLASSES, colour_folder


def fine_tuned(tmp_path, name, *overrides):
    try:
        return finetune.run(load_config(None, [
            *TINY, f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}",
            f"output_dir={tmp_path / name}", "train.steps=6", "train.warmup_steps=1", "train.batch_size=6",
            "finetune.eval_every=2", "train.checkpoint_every=6", "train.lr=0.01", *overrides]), ckpt=None)
    finally:
        reset_accelerator()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two classifiers fine-tuned on a user's folder of colour images (cat, dog, owl): one reading the [class]
    token, one the mean of the patch outputs."""
    tmp_path = tmp_path_factory.mktemp("names")
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [8, 8, 8])), str(tmp_path / "train"))
    prepare.run(str(colour_folder(tmp_path / "photos" / "val", [4, 4, 4], seed=1)), str(tmp_path / "val"))
    fine_tuned(tmp_path, "cls")
    fine_tuned(tmp_path, "mean", "finetune.pool=mean")
    return tmp_path


def predicted(capsys, ckpt, *more) -> tuple[dict[str, list[tuple[str, float]]], str]:
    """`mpp predict --ckpt CKPT` on the validation images (under the runs' folder, which holds CKPT): {image: [(class,
    probability %), ...]}, and what it said on stderr."""
    root = next(p for p in ckpt.parents if (p / "photos").is_dir())
    images = sorted(str(p) for p in (root / "photos" / "val").rglob("*.*"))
    assert launch.main(["predict", "--ckpt", str(ckpt), *images, *more, "--top-k", "3"]) == 0
    out = capsys.readouterr()
    rows = dict(line.split("\t") for line in out.out.splitlines())
    return {image: [(c.rsplit(" ", 1)[0], float(c.rsplit(" ", 1)[1].rstrip("%"))) for c in top.split(", ")]
            for image, top in rows.items()}, out.err


def older_mpp_file(source, target):
    """`source` as an mpp before this change wrote it: its `mpp` metadata without pool and class_names."""
    with safe_open(str(source), framework="pt") as f:
        about = json.loads(f.metadata()["mpp"])
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(load_file(source), str(target), metadata={"mpp": json.dumps(
        {k: v for k, v in about.items() if k not in ("pool", "class_names")})})
    return target


def test_a_copied_weights_file_and_an_export_predict_with_their_own_class_names(runs, capsys):
    in_run, _ = predicted(capsys, runs / "cls")
    assert {name for top in in_run.values() for name, _ in top} == set(CLASSES)

    loose = runs / "loose" / "clf.safetensors"  # copied out of its run, no config.yaml beside it
    loose.parent.mkdir()
    shutil.copy(runs / "cls" / "model.safetensors", loose)
    assert predicted(capsys, loose)[0] == in_run  # were the synthetic corpus's names: disc, square, ...

    assert launch.main(["export", "--ckpt", str(loose), "--to", "hf", str(runs / "hf")]) == 0
    capsys.readouterr()
    assert json.loads((runs / "hf" / "config.json").read_text())["id2label"] == dict(zip("012", CLASSES))
    exported, _ = predicted(capsys, runs / "hf")  # read from config.json's id2label, as transformers' pipeline reads it
    assert exported.keys() == in_run.keys()
    for image, top in exported.items():
        assert [name for name, _ in top] == [name for name, _ in in_run[image]], image
        assert [p for _, p in top] == pytest.approx([p for _, p in in_run[image]], abs=0.2), image


def test_an_older_file_outside_its_run_predicts_class_ids_and_says_why(runs, capsys):
    old = older_mpp_file(runs / "cls" / "model.safetensors", runs / "old" / "clf.safetensors")
    got, said = predicted(capsys, old, "finetune.pool=cls")
    assert {name for top in got.values() for name, _ in top} == {"0", "1", "2"}
    assert f"{old} records no class names and lies outside its run, so classes are shown by id; set data.shards to " \
           f"its training shards to name them" in said
    named, _ = predicted(capsys, old, "finetune.pool=cls", f"data.shards={runs / 'train'}")
    assert named == predicted(capsys, runs / "cls")[0]


def test_a_mean_pooled_classifier_outside_its_run_is_predicted_and_exported_as_trained(runs, capsys):
    in_run, _ = predicted(capsys, runs / "mean")
    loose = runs / "loose-mean" / "mean.safetensors"
    loose.parent.mkdir()
    shutil.copy(runs / "mean" / "model.safetensors", loose)
    assert predicted(capsys, loose)[0] == in_run  # was read as a [class]-token classifier: other classes

    assert launch.main(["export", "--ckpt", str(loose), "--to", "hf", str(runs / "hf-mean")]) == 0
    assert "wrote a transformers Dinov2ForImageClassification" in capsys.readouterr().out  # its file says: mean

    assert launch.main(["predict", "--ckpt", str(loose), str(next((runs / "photos").rglob("*.png"))), "finetune.pool=cls"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {loose} holds a classifier fine-tuned with finetune.pool=mean but the config says finetune.pool=cls; "
        f"drop that setting (a head reads what it was trained on)")


def test_an_older_file_outside_its_run_does_not_guess_its_pooling(runs, capsys):
    old = older_mpp_file(runs / "mean" / "model.safetensors", runs / "old-mean" / "mean.safetensors")
    for stage in (["predict", "--ckpt", str(old), str(next((runs / "photos").rglob("*.png")))],
                  ["export", "--ckpt", str(old), "--to", "hf", str(runs / "hf-old-mean")]):
        assert launch.main(stage) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {old} does not record whether its classifier reads the [class] token or the mean of the patch "
            f"outputs (an older mpp's file, with no run's config.yaml beside it); set finetune.pool=cls or "
            f"finetune.pool=mean as its fine-tuning did (its run's config.yaml says), or pass the file inside its run "
            f"directory")
    assert predicted(capsys, old, "finetune.pool=mean", f"data.shards={runs / 'train'}")[0] == predicted(capsys, runs / "mean")[0]


def test_the_model_card_of_the_best_weights_gives_the_best_step_and_its_score(tmp_path, capsys):
    # One class: every evaluation scores 100%. Ties go to the later evaluation, so the run's own best is its last; the
    # card must describe whichever step results.json names as the best, so the best is put at step 2 here, as a run
    # whose score fell after step 2 would have it.
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [6])), str(tmp_path / "train"))
    prepare.run(str(colour_folder(tmp_path / "photos" / "val", [3], seed=1)), str(tmp_path / "val"))
    results = fine_tuned(tmp_path, "run", "finetune.keep_best=true")
    assert results["best"]["step"] == 6 and results["history"][-1][0] == 6
    results["best"] = {**results["best"], "step": 2}
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    assert launch.main(["export", "--ckpt", str(tmp_path / "run" / "best.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "- **Steps**: 2 of 6," in card  # was 6 of 6, with the final metrics
    assert f"- **Metrics at step 2, its best evaluation (finetune.keep_best)**: eval/top1 100.0% (eval/*: on `{tmp_path / 'val'}`)." in card
    assert "Final metrics" not in card
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf-final")]) == 0
    assert "- **Steps**: 6 of 6," in (tmp_path / "hf-final" / "README.md").read_text()
