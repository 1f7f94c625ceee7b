"""Classes are matched by name wherever names exist (issue 48, item 1): evaluation data prepared apart, image
folders read directly or prepared, class folders whose name is not text, ImageNet archives and their class list."""

import io
import json
import os
import tarfile
import warnings

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from mpp.config import load_config
from mpp.data.readers import expand_shards
from mpp.data.shards import SourceError
from mpp.data.stream import DataError, label_space
from pipelines.run.loaders import class_names
from pipelines.stages import finetune, prepare, pretrain

from conftest import TINY, reset_accelerator
from test_shards import label_of, read_shards

STEPS = ["train.steps=2", "train.warmup_steps=1", "train.batch_size=4", "log.every=1"]


@pytest.fixture(autouse=True)
def fresh_state():
    label_space.cache_clear()  # tests write sets under names an earlier test used
    yield
    reset_accelerator()


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def folders(root, classes: dict, per_class: int = 4):
    """root/<class>/<i>.jpg for each class (a class given 0 images is an empty folder); class names may be bytes."""
    for k, name in enumerate(classes):
        folder = os.path.join(os.fsencode(root), os.fsencode(name))
        os.makedirs(folder, exist_ok=True)
        for i in range(classes[name] if isinstance(classes, dict) else per_class):
            with open(os.path.join(folder, b"%d.jpg" % i), "wb") as file:
                file.write(jpeg(100 * k + i))
    return str(root)


def prepared(tmp_path, name: str, classes: dict) -> str:
    prepare.run(folders(tmp_path / f"{name}_images", classes), str(tmp_path / name), workers=1)
    return str(tmp_path / name)


def finetuning(tmp_path, train: str, val: str):
    return load_config(None, [*TINY, *STEPS, f"data.shards={train}", f"data.val_shards={val}",
                              f"output_dir={tmp_path / 'finetuned'}"])


# ---------------------------------------------------------------- evaluation data whose classes differ from training's


def test_evaluation_shards_prepared_apart_are_scored_by_class_name(tmp_path):
    """Worst #2: val prepared from cat/ and emu/ (its emu is id 1) was scored as training's id 1, dog."""
    train = prepared(tmp_path, "train", {"cat": 4, "dog": 4, "emu": 4})
    val = prepared(tmp_path, "val", {"cat": 4, "emu": 4})
    finetune.run(finetuning(tmp_path, train, val), ckpt=None)
    predictions = json.loads((tmp_path / "finetuned" / "predictions.json").read_text())
    by_class = {key.split("/")[-1].split("_")[0]: record["label"] for key, record in predictions.items()}
    assert by_class == {"cat": 0, "emu": 2}


def test_an_evaluation_class_the_training_set_lacks_is_named_not_sent_to_num_classes(tmp_path):
    """Row 24: the error said to set model.num_classes, which led back to the silent mismatch above."""
    train = prepared(tmp_path, "train", {"cat": 4, "emu": 4})
    val = prepared(tmp_path, "val", {"cat": 4, "dog": 4, "emu": 4})
    with pytest.raises(DataError) as refused:
        finetune.run(finetuning(tmp_path, train, val), ckpt=None)
    said = str(refused.value)
    assert said.startswith(f"{val} holds class 'dog', which the training set {train} does not have (2 classes: 'cat', "
                           f"'emu')") and "num_classes" not in said
    assert not (tmp_path / "finetuned" / "model.safetensors").exists()


def test_an_empty_training_class_folder_is_named_as_empty(tmp_path):
    """Row 93: train cat/, dog/, emu/ (empty); val cat/, dog/, emu/: the error blamed the head's size."""
    train = folders(tmp_path / "train", {"cat": 4, "dog": 4, "emu": 0})
    val = folders(tmp_path / "val", {"cat": 2, "dog": 2, "emu": 2})
    with pytest.raises(DataError, match=rf"holds class 'emu', which the training set {train} does not have; the "
                                        rf"training folder {train}/emu holds no images"):
        finetune.run(finetuning(tmp_path, train, val), ckpt=None)


def test_where_one_set_names_no_classes_ids_are_kept_with_one_warning(tmp_path):
    train = prepared(tmp_path, "train", {"cat": 2, "dog": 2})
    (tmp_path / "ids").mkdir()
    with wds.TarWriter(str(tmp_path / "ids" / "s-000000.tar")) as sink:  # shards of ids without a summary.json
        for i, label in enumerate([1, 0]):
            sink.write({"__key__": f"k{i}", "jpg": jpeg(i), "cls": str(label).encode()})
    from pipelines.run.loaders import label_reader

    cfg = finetuning(tmp_path, train, str(tmp_path / "ids"))
    with pytest.warns(UserWarning, match=rf"the labels of {tmp_path / 'ids'} are taken as the class ids of {train} as "
                                         rf"they are: {tmp_path / 'ids'} names no classes"):
        reader = label_reader(cfg, None, cfg.data.val_shards)
    assert reader.class_names == ("cat", "dog") and reader({"cls": b"1"}) == 1
    # labels that are names cannot be matched with a training set of bare ids: one line, not every sample skipped
    named = folders(tmp_path / "named", {"cat": 1})
    cfg = finetuning(tmp_path, str(tmp_path / "ids"), named)
    with pytest.raises(DataError, match=rf"{named} labels its images by class name \('cat'\) but the training set "):
        label_reader(cfg, None, cfg.data.val_shards)
