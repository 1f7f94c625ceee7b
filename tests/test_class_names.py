"""Classes are matched by name wherever names exist (issue 48, item 1): evaluation data prepared apart, image
folders read directly or prepared, class folders whose name is not text, ImageNet archives and their class list."""

import io
import json
import os
import tarfile

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from mpp.config import load_config
from mpp.data.readers import expand_shards
from mpp.data.prepare_inputs import SourceError
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


# ---------------------------------------------------------------- image folders, read directly or prepared


def test_hidden_folders_are_no_class_and_nested_folders_belong_to_their_class(tmp_path):
    """Rows 92, 94: .ipynb_checkpoints/ and dog/puppies/ were classes of their own; prepare left out only the first."""
    root = folders(tmp_path / "train", {"cat": 2, "dog": 2, ".ipynb_checkpoints": 2})
    folders(tmp_path / "train" / "dog", {"puppies": 1})
    urls = expand_shards(root)
    assert len(urls) == 5 and label_space(tuple(urls)).class_names == ("cat", "dog")
    cfg = load_config(None, [*TINY, f"data.shards={root}"])
    assert class_names(cfg, None, root) == ("cat", "dog")  # as a run's loaders read it
    summary = prepare.run(root, str(tmp_path / "shards"), workers=1)
    assert summary["class_names"] == ["cat", "dog"] and summary["class_counts"] == [2, 3]
    assert label_of(read_shards(tmp_path / "shards")["dog_puppies_0"]) == 1


def test_a_class_folder_named_in_latin_1_is_read_without_labels_and_refused_with_them(tmp_path):
    """Row 95: a traceback (UnicodeEncodeError) in pretraining too, which reads no labels; row 96: prepare wrote the
    bytes as a lone surrogate into summary.json."""
    root = folders(tmp_path / "train", {b"caf\xe9": 4, "dog": 4})
    results = pretrain.run(load_config(None, [*TINY, *STEPS, f"data.shards={root}", f"output_dir={tmp_path / 'run'}"]))
    assert results["skipped"] == {} or not any(results["skipped"].values())
    reset_accelerator()
    fix = rf"class folder {root}/caf\\xe9 has a name that is not UTF-8 text, which a class name must be; rename it"
    with pytest.raises(DataError, match=fix):
        finetune.run(finetuning(tmp_path, root, root), ckpt=None)
    with pytest.raises(DataError, match=fix):
        prepare.run(root, str(tmp_path / "shards"), workers=1)


# ---------------------------------------------------------------- archives: ImageNet's and tars of class folders


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def class_tar(synset: str, count: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i in range(count):
            add(tar, f"{synset}_{i}.JPEG", jpeg(i))
    return buffer.getvalue()


SYNMAP = ["n01440764 tench, Tinca tinca", "n01443537 goldfish, Carassius auratus",
          "n01484850 great white shark, white shark, man-eater"]


def imagenet_archive(path, classes: dict) -> str:
    """ILSVRC2012_img_train.tar's layout: a tar per synset (given its image count), plus macOS's ._ twin of one."""
    with tarfile.open(path, "w") as tar:
        for synset, count in classes.items():
            add(tar, f"{synset}.tar", class_tar(synset, count))
        add(tar, "._n01440764.tar", b"\x00\x05\x16\x07" * 16)
    return str(path)


def test_a_nested_folder_in_a_tar_of_class_folders_is_its_class(tmp_path):
    """Row 16: val/n01440764/extra/deep.JPEG made a class 'extra' that sorted first and moved every synset id up."""
    archive = tmp_path / "val.tar"
    with tarfile.open(archive, "w") as tar:
        for k, synset in enumerate(SYNMAP):
            add(tar, f"val/{synset.split()[0]}/{k}.JPEG", jpeg(k))
        add(tar, "val/n01440764/extra/deep.JPEG", jpeg(9))
    summary = prepare.run(str(archive), str(tmp_path / "out"), workers=1)
    assert summary["class_names"] == [line.split()[0] for line in SYNMAP] and summary["class_counts"] == [2, 1, 1]


@pytest.mark.parametrize("count", [0, None])
def test_a_missing_or_empty_class_tar_is_named_where_ids_leave_imagenets(tmp_path, count):
    """Rows 14, 17: without n01443537's images, n01484850 became id 1 with no word."""
    classes = {"n01440764": 2, "n01443537": count, "n01484850": 2}
    archive = imagenet_archive(tmp_path / "train.tar", {k: v for k, v in classes.items() if v is not None})
    with pytest.warns(UserWarning, match=r"holds images of 2 ImageNet synsets, not 1000" + ("; n01443537 holds no images"
                                                                                            if count == 0 else ":")
                      + r".* pass --class-names @LOC_synset_mapping.txt"):
        summary = prepare.run(archive, str(tmp_path / "out"), workers=1)
    assert summary["class_names"] == ["n01440764", "n01484850"]


def test_class_names_that_begin_with_synsets_are_matched_to_the_archive_by_synset(tmp_path):
    """Row 20: the names were taken by position, so n01484850's images were called goldfish."""
    archive = imagenet_archive(tmp_path / "train.tar", {"n01440764": 2, "n01484850": 3})
    with pytest.warns(UserWarning, match=r"has no images of 1 of the 3 classes --class-names lists \(n01443537\): "
                                         r"ids follow the lines"):
        summary = prepare.run(archive, str(tmp_path / "out"), class_names=SYNMAP, workers=1)
    assert summary["class_names"] == SYNMAP
    labels = {key.split("_")[0]: label_of(sample) for key, sample in read_shards(tmp_path / "out").items()}
    assert labels == {"n01440764": 0, "n01484850": 2}
    with pytest.raises(SourceError, match=r"has class n01484850 that no line of --class-names begins with"):
        prepare.run(archive, str(tmp_path / "out2"), class_names=SYNMAP[:2], workers=1)
    # evaluation shards prepared without the list name their classes by synset alone: told to prepare them with it
    prepare.run(archive, str(tmp_path / "val"), workers=1)
    with pytest.raises(DataError, match=rf"the training set's class names begin with these: prepare {tmp_path / 'val'} "
                                        r"with the same --class-names as the training set"):
        finetune.run(finetuning(tmp_path, str(tmp_path / "out"), str(tmp_path / "val")), ckpt=None)


def test_more_class_names_than_classes_by_position_are_kept_with_a_warning(tmp_path):
    """Row 21: 1000 names for 3 classes were taken without a word."""
    root = folders(tmp_path / "images", {"a": 1, "b": 1})
    with pytest.warns(UserWarning, match=r"--class-names names 4 classes and folder .* has 2: ids 2 to 3 are named but "
                                         r"have no images"):
        summary = prepare.run(root, str(tmp_path / "out"), class_names=["ant", "bee", "cow", "dog"], workers=1)
    assert summary["class_names"] == ["ant", "bee", "cow", "dog"]
