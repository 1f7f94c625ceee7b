"""A new user's first day: a folder of their own colour images, of several sizes, in class sub-folders, through
prepare, fine-tuning, prediction and export, and what each says about the result."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.config import load_config
from pipelines.stages import finetune, prepare

from conftest import TINY

CLASSES = ("cat", "dog", "owl")


def image_folder(root, counts, sizes=((40, 24), (24, 36), (30, 30)), same=False, seed=0):
    """counts[c] images of class CLASSES[c] under root/<class>/, of the `sizes` (width, height) in turn: random
    colours, or all one grey image (`same`: nothing tells the classes apart)."""
    rng = np.random.default_rng(seed)
    for c, count in enumerate(counts):
        (root / CLASSES[c]).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = sizes[i % len(sizes)]
            pixels = np.full((h, w, 3), 128, np.uint8) if same else rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / CLASSES[c] / f"{i:03d}.png")
    return root


def finetune_config(tmp_path, *overrides):
    return load_config(None, [*TINY, f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}",
                              f"output_dir={tmp_path / 'run'}", "train.steps=4", "train.warmup_steps=1",
                              "train.batch_size=6", "finetune.eval_every=2", "train.checkpoint_every=2", *overrides])


def test_a_run_that_cannot_learn_says_it_ended_at_or_below_its_baseline(tmp_path, capsys):
    # One grey image for every class: no model can beat always answering the training labels' majority class.
    prepare.run(str(image_folder(tmp_path / "photos" / "train", [5, 4, 3], same=True)), str(tmp_path / "train"))
    prepare.run(str(image_folder(tmp_path / "photos" / "val", [5, 4, 3], same=True)), str(tmp_path / "val"))
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["image_short_side"] == {"min": 24, "median": 24, "max": 30} and summary["class_counts"] == [5, 4, 3]

    results = finetune.run(finetune_config(tmp_path, "model.image_size=8"), ckpt=None)

    out = capsys.readouterr().out
    assert "training at 8 px, 3.0x smaller than the images' median (their short sides are 24-30 px, median 24" in out
    assert results["baselines"]["eval/top1"] == {"majority": pytest.approx(5 / 12), "chance": pytest.approx(1 / 3)}
    assert results["at_or_below_baseline"] == ["eval/balanced_acc", "eval/top1"]
    assert f"eval/top1 {results['top1']:.1%} (majority class 41.7%, chance 33.3%)" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning: this run ended at or below its baseline"))
    assert "too few steps for the data: 4 steps of 6 images are 2.0 passes over the 12 training images" in warning
    assert "the model sees 8 px crops of images whose short sides are 24-30 px (median 24): raise model.image_size" in warning
    assert "train.lr=0.001" in warning and "3 classes with 3-5 training images each" in warning
    records = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert len(records) == 12 and all(set(r) == {"label", "predicted", "correct"} for r in records.values())
    assert all(r["correct"] == int(r["label"] == r["predicted"]) for r in records.values())
    assert sum(r["correct"] for r in records.values()) / 12 == pytest.approx(results["top1"])


def colour_folder(root, counts, seed=0):
    """counts[c] non-square images of class c, mostly of that class's colour (red, green, blue) with noise; PNGs and
    JPEGs of several sizes and both orientations."""
    rng = np.random.default_rng(seed)
    sizes = ((48, 24), (24, 40), (56, 36), (30, 64))
    for c, count in enumerate(counts):
        (root / CLASSES[c]).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = sizes[i % len(sizes)]
            pixels = rng.integers(0, 90, (h, w, 3))
            pixels[..., c] += 150
            Image.fromarray(pixels.astype(np.uint8)).save(root / CLASSES[c] / f"{i:03d}.{'jpg' if i % 3 == 0 else 'png'}")
    return root


@pytest.fixture(scope="module")
def colour_run(tmp_path_factory):
    """A classifier fine-tuned (from scratch, briefly) on a user's folder of colour images, keeping its best step."""
    from conftest import reset_accelerator

    tmp_path = tmp_path_factory.mktemp("colours")
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [8, 8, 8])), str(tmp_path / "train"))
    prepare.run(str(colour_folder(tmp_path / "photos" / "val", [4, 4, 4], seed=1)), str(tmp_path / "val"))
    try:
        results = finetune.run(finetune_config(tmp_path, "train.steps=6", "finetune.keep_best=true", "train.lr=0.01"), ckpt=None)
    finally:
        reset_accelerator()
    return tmp_path, results


def test_keep_best_keeps_the_weights_of_the_best_evaluation(colour_run):
    from safetensors.torch import load_file

    tmp_path, results = colour_run
    best_step, best_top1 = max(results["history"], key=lambda point: (point[1], point[0]))  # ties: the later
    assert results["best"] == {"step": best_step, "eval/top1": best_top1, "weights": str(tmp_path / "run" / "best.safetensors")}
    kept = load_file(tmp_path / "run" / "best.safetensors")
    checkpoint = load_file(tmp_path / "run" / "checkpoints" / f"step_{best_step:08d}" / "model.safetensors")
    assert all(torch.equal(kept[f"head.{name}"], checkpoint[f"head.{name}"]) for name in ("weight", "bias"))


def test_keep_best_picks_the_step_of_the_highest_score_not_the_last_and_a_tie_to_the_later():
    from types import SimpleNamespace
    from mpp.training.loop import Evaluator

    history, kept = finetune.History(), []
    history.keep = SimpleNamespace(write=lambda module: kept.append(module))
    scores = iter([0.5, 0.9, 0.7, 0.9, 0.8])
    evaluator = Evaluator(2, lambda module, step: {"eval/top1": next(scores)})
    evaluator.run.classified = {}
    run = history.recording(evaluator).run
    for step in (2, 4, 6, 8, 10):
        run(f"weights at step {step}", step)
    assert history.best == [8, 0.9] and kept == ["weights at step 2", "weights at step 4", "weights at step 8"]
    restored = finetune.History()
    restored.load_state_dict(history.state_dict())
    assert restored.best == [8, 0.9]


def test_predict_keeps_to_the_cpu_it_is_told_to_use_on_a_machine_with_a_gpu(colour_run, monkeypatch, capsys):
    import launch

    tmp_path, _ = colour_run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as there; conftest exports ACCELERATE_USE_CPU=true
    image = next((tmp_path / "photos" / "val").rglob("*.png"))
    assert launch.main(["predict", "--ckpt", str(tmp_path / "run" / "best.safetensors"), str(image)]) == 0
    assert "for 1 image(s) on cpu" in capsys.readouterr().err


def test_predict_a_folder_with_an_unreadable_file(colour_run, capsys):
    import launch

    tmp_path, results = colour_run
    folder = tmp_path / "photos" / "val"
    (folder / "owl" / "broken.jpg").write_bytes(b"not an image")
    (folder / "notes.txt").write_text("not an image either, and not an image file: left alone")
    try:
        assert launch.main(["predict", "--ckpt", str(tmp_path / "run" / "best.safetensors"), str(folder), "--top-k", "2",
                            "--out", str(tmp_path / "predicted.json")]) == 0
        said = capsys.readouterr().err
        assert "predicted the top 2 of 3 classes for 12 image(s) on cpu" in said
        assert f"1 file(s) could not be read as images and were skipped: {folder / 'owl' / 'broken.jpg'} (" in said
        written = json.loads((tmp_path / "predicted.json").read_text())
        assert list(written["unreadable"]) == [str(folder / "owl" / "broken.jpg")]
        assert len(written["predictions"]) == 12
        for record in written["predictions"]:
            assert [t["class"] for t in record["top"]] == [CLASSES[t["id"]] for t in record["top"]]  # names from summary.json
            assert record["top"][0]["probability"] >= record["top"][1]["probability"]
        # The best step's weights, prepared as evaluation prepares images, score what its evaluation scored.
        right = sum(r["top"][0]["class"] == Path(r["image"]).parent.name for r in written["predictions"])
        assert right / 12 == pytest.approx(results["best"]["eval/top1"])
        assert launch.main(["predict", "--ckpt", str(tmp_path / "run"), str(folder / "cat" / "001.png"), "--top-k", "1"]) == 0
        assert capsys.readouterr().out.startswith(f"{folder / 'cat' / '001.png'}\t")
    finally:
        (folder / "owl" / "broken.jpg").unlink()
        (folder / "notes.txt").unlink()


def test_the_exported_pipeline_predicts_what_mpp_predicts_on_non_square_images(colour_run, capsys):
    transformers = pytest.importorskip("transformers")
    import launch

    tmp_path, _ = colour_run
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    # Wide and tall images whose centre square is one class's colour and whose flanks, as large, another's: squashed
    # to a square they are mostly the flanks' colour.
    (tmp_path / "flanked").mkdir()
    rng = np.random.default_rng(2)
    for i, (centre, flank) in enumerate([(0, 1), (1, 2), (2, 0), (0, 2)]):
        side = 24
        pixels = rng.integers(0, 90, (side, 3 * side, 3))
        pixels[..., flank] += 150
        pixels[:, side:2 * side] = rng.integers(0, 90, (side, side, 3))
        pixels[:, side:2 * side, centre] += 150
        Image.fromarray(pixels.astype(np.uint8).transpose(1, 0, 2) if i % 2 else pixels.astype(np.uint8)).save(tmp_path / "flanked" / f"{i}.png")
    images = sorted((tmp_path / "photos" / "val").rglob("*.*")) + sorted((tmp_path / "flanked").glob("*.png"))
    assert launch.main(["predict", "--ckpt", str(tmp_path / "run"), *map(str, images), "--top-k", "3",
                        "--out", str(tmp_path / "ours.json")]) == 0
    ours = {r["image"]: r["top"] for r in json.loads((tmp_path / "ours.json").read_text())["predictions"]}
    classify = transformers.pipeline("image-classification", model=str(tmp_path / "hf"), device="cpu")
    for image in images:
        theirs = classify(Image.open(image), top_k=3)
        assert Image.open(image).width != Image.open(image).height
        assert [p["label"] for p in theirs] == [t["class"] for t in ours[str(image)]], image
        assert [p["score"] for p in theirs] == pytest.approx([t["probability"] for t in ours[str(image)]], abs=2e-3), image


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline W&B run's `run-*.wandb` file: W&B's 7-byte header, then LevelDB's log
    format (32 KiB blocks of records, each a 7-byte header and a piece of one Record)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, pieces, records = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        pieces, pos = pieces + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(Record.FromString(pieces))
            pieces = b""
    return records


def wandb_offline_run(path: Path) -> tuple[dict, dict]:
    """The last summary and the config of an offline W&B run, read once W&B's core process has written the run's
    `exit` record: it writes the final summary just before it, and may do so after the run's finish() has returned
    (a read before it missed eval/top1 once in a full suite run)."""
    deadline = time.monotonic() + 60
    kinds = lambda records: [record.WhichOneof("record_type") for record in records]
    while "exit" not in kinds(records := wandb_records(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "exit" in kinds(records), kinds(records)[-10:]
    summary, config = {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.summary.update if kind == "summary" else record.config.update if kind == "config" else []
        for item in updates:
            *parents, key = item.nested_key or [item.key]  # an image's summary is a dict: ["inspect/rollout", "_type"]
            values = summary if kind == "summary" else config
            for parent in parents:
                values = values.setdefault(parent, {})
            values[key] = json.loads(item.value_json)
    return summary, config


def test_mlflow_and_wandb_offline_hold_what_results_json_holds(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    # As a user runs it: docs/monitoring.md's form of MLFLOW_TRACKING_URI, no W&B key (a HOME of its own) and no WANDB_MODE.
    uri = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [4, 4, 4])), str(tmp_path / "train"))
    prepare.run(str(colour_folder(tmp_path / "photos" / "val", [2, 2, 2], seed=1)), str(tmp_path / "val"))
    results = finetune.run(finetune_config(tmp_path, "log.trackers=[mlflow,wandb]", "inspect.every=4",
                                           "inspect.images=4", "inspect.rollout_images=2"), ckpt=None)
    final = results["final"]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what reading a folder store takes in MLflow 3
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert all(run.data.metrics[k] == pytest.approx(v) for k, v in final.items())
    assert run.data.params["train.lr"] == "0.001" and run.data.params["log.trackers"] == '["tensorboard", "mlflow", "wandb"]'
    images = {f.path for f in client.list_artifacts(run.info.run_id, "images")}
    assert any("inspect_rollout" in path for path in images), images

    # What `wandb sync` would upload: the offline run's own record on disk.
    (record,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    summary, config = wandb_offline_run(record)
    assert all(summary[k] == pytest.approx(v) for k, v in final.items())
    (rollout,) = summary["inspect/rollout"]["filenames"]  # an image, its PNG beside the record
    assert (record.parent / "files" / rollout).stat().st_size > 0
    assert config["train.lr"] == 0.001

    lines = [json.loads(line) for line in (tmp_path / "run" / "log.txt").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4]  # log.every=5 and the last step; evaluations at 2 and 4
    assert lines[-1]["eval/top1"] == pytest.approx(final["eval/top1"]) and "train/loss" in lines[-1]


def test_a_tracker_whose_package_is_missing_is_one_line(tmp_path, monkeypatch):
    import importlib.util
    import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert launch.main(["finetune", f"data.shards={tmp_path}", f"data.val_shards={tmp_path}", "log.trackers=[wandb]",
                        f"output_dir={tmp_path / 'run'}"]) == 2


def test_pretraining_shows_its_pretext_accuracy_beside_the_prior(tmp_path, capsys):
    from pipelines.stages import pretrain

    prepare.run(str(image_folder(tmp_path / "photos", [4, 4, 4])), str(tmp_path / "train"))
    results = pretrain.run(load_config(None, [*TINY, f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'train'}",
                                              f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.warmup_steps=1",
                                              "train.batch_size=4", "eval.every=2", "eval.images=8"]))
    final = results["final"]
    assert results["baselines"]["val/color_acc"] == {"prior": final["val/color_acc_prior"]}
    assert f"val/color_acc {final['val/color_acc']:.1%} (prior {final['val/color_acc_prior']:.1%})" in capsys.readouterr().out


def test_the_below_baseline_warning_counts_the_shards_data_shards_names_not_their_whole_directory(tmp_path, capsys):
    # Red team round 4, rows 14-16: over part of a directory it counted the directory's summary.json, all of it.
    photos = image_folder(tmp_path / "photos" / "train", [5, 4, 3], same=True)
    prepare.run(str(photos), str(tmp_path / "all"), samples_per_shard=6)  # 2 shards of 6
    prepare.run(str(image_folder(tmp_path / "photos" / "val", [5, 4, 3], same=True)), str(tmp_path / "val"))
    cfg = finetune_config(tmp_path, "model.image_size=8", f"data.shards={tmp_path / 'all' / 'shard-000000.tar'}")
    finetune.run(cfg, ckpt=None)
    warning = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: this run ended"))
    assert "4 steps of 6 images are 4.0 passes over the 6 training images" in warning
