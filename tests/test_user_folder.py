"""A new user's first day: a folder of their own colour images, of several sizes, in class sub-folders, through
prepare, fine-tuning, prediction and export, and what each says about the result."""

import json

import numpy as np
import pytest
from PIL import Image

from mpp.config import load_config
from pipelines import finetune, prepare

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
    assert results["at_or_below_baseline"] == ["eval/top1"]
    assert f"eval/top1 {results['top1']:.1%} (majority class 41.7%, chance 33.3%)" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning: this run ended at or below its baseline"))
    assert "too few steps for the data: 4 steps of 6 images are 2.0 passes over the 12 training images" in warning
    assert "the model sees 8 px crops of images whose short sides are 24-30 px (median 24): raise model.image_size" in warning
    assert "train.lr=0.001" in warning and "3 classes with 3-5 training images each" in warning
    records = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert len(records) == 12 and all(set(r) == {"label", "predicted", "correct"} for r in records.values())
    assert all(r["correct"] == int(r["label"] == r["predicted"]) for r in records.values())
    assert sum(r["correct"] for r in records.values()) / 12 == pytest.approx(results["top1"])
