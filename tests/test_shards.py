import errno
import gzip
import io
import json
import os
import re
import struct
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import launch
from mpp.data.prepare_inputs import Sample, Source, SourceError, folder_samples, idx_samples
from mpp.data.shardwriter import write_shards
from mpp.data.synthetic import NUM_CLASSES, synthetic_image
from pipelines.stages import prepare

from conftest import read_only


def read_shards(out: Path) -> dict[str, dict]:
    """Every sample in out's shards by key, read with plain webdataset; fails on a repeated key."""
    samples = {}
    for sample in wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False):
        assert sample["__key__"] not in samples, f"{sample['__key__']} written twice"
        samples[sample["__key__"]] = sample
    return samples


def label_of(sample: dict) -> int | None:
    return int(sample["cls"]) if "cls" in sample else None


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def test_synthetic_images_are_deterministic_and_cover_all_classes():
    first, label = synthetic_image(123)
    again, label_again = synthetic_image(123)
    assert first.mode == "RGB" and first.size == (64, 64)
    assert np.array_equal(np.asarray(first), np.asarray(again)) and label == label_again
    assert not np.array_equal(np.asarray(first), np.asarray(synthetic_image(124)[0]))
    assert {synthetic_image(i, 32)[1] for i in range(3 * NUM_CLASSES)} == set(range(NUM_CLASSES))
    for i in range(NUM_CLASSES):  # hidden patches must differ in (3-bit) mean colour for the task to mean anything
        pixels = np.asarray(synthetic_image(i)[0], dtype=np.float32)
        means = pixels.reshape(4, 16, 4, 16, 3).mean(axis=(1, 3)).reshape(-1, 3)
        assert len({tuple(c) for c in (means // 32).astype(int)}) > 1


def test_folder_round_trip(tmp_path):
    root = tmp_path / "images"
    files = {  # relative path -> (format, expected label); class ids follow sorted folder names
        "cat/a.png": ("PNG", 0), "cat/b.jpg": ("JPEG", 0), "cat/c.bmp": ("BMP", 0),
        "dog/d.jpeg": ("JPEG", 1), "dog/e.png": ("PNG", 1),
    }
    for i, (name, (fmt, _)) in enumerate(files.items()):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(encoded(synthetic_image(i, 16)[0], fmt))
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (root / "cat" / "notes.txt").write_text("not an image")

    out = tmp_path / "shards"
    with pytest.warns(UserWarning, match=rf"skipped 1 unreadable image\(s\) in folder {root}: {root}/dog/broken.jpg; "
                                         r"summary.json lists them all \(unreadable\)"):
        summary = prepare.run(str(root), str(out), samples_per_shard=2)

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary == {"samples": 5, "classes": 2, "labels": True, "shards": 3, "skipped": 1,
                       "unreadable": [str(root / "dog" / "broken.jpg")],
                       "bytes": sum(p.stat().st_size for p in out.glob("*.tar")),
                       "source": f"folder {root}", "class_names": ["cat", "dog"],
                       "files": ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"],
                       "image_short_side": {"min": 16, "median": 16, "max": 16}, "class_counts": [3, 2]}
    samples = read_shards(out)
    assert sorted(samples) == ["cat_a", "cat_b", "cat_c", "dog_d", "dog_e"]
    for name, (fmt, label) in files.items():
        sample = samples[name.split(".")[0].replace("/", "_")]
        assert label_of(sample) == label
        if fmt == "BMP":  # not a shard format: re-encoded
            assert Image.open(io.BytesIO(sample["jpg"])).format == "JPEG"
        else:  # already a shard format: stored byte for byte
            assert sample["png" if fmt == "PNG" else "jpg"] == (root / name).read_bytes()


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    data = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 5, 4), dtype=np.uint8)
    labels = rng.integers(0, 3, 7, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", images, compress)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labels, compress)

    summary = prepare.run(str(tmp_path / f"t10k-images-idx3-ubyte{suffix}"), str(tmp_path / "out"), samples_per_shard=3)

    assert (summary["samples"], summary["shards"], summary["classes"]) == (7, 3, len(set(labels.tolist())))
    samples = read_shards(tmp_path / "out")
    assert len(samples) == 7
    for i in range(7):
        sample = samples[f"{i:08d}"]
        image = Image.open(io.BytesIO(sample["png"]))
        assert image.mode == "L" and np.array_equal(np.asarray(image), images[i])
        assert label_of(sample) == labels[i]


def test_classes_keeps_a_class_subset_relabelled_in_the_order_given(tmp_path, capsys):
    # A transfer split: upstream and downstream classes, each side a 0..k-1 label space.
    images = np.arange(8 * 4, dtype=np.uint8).reshape(8, 2, 2)
    labels = np.array([0, 1, 2, 3, 3, 1, 0, 2], np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", images, compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels, compress=False)
    source = str(tmp_path / "train-images-idx3-ubyte")

    summary = prepare.run(source, str(tmp_path / "down"), classes=[3, 1])

    assert (summary["samples"], summary["classes"]) == (4, 2) and "classes 3,1 as 0..1" in summary["source"]
    samples = read_shards(tmp_path / "down")
    assert {key: label_of(sample) for key, sample in samples.items()} == {"00000001": 1, "00000003": 0, "00000004": 0, "00000005": 1}
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(samples["00000003"]["png"]))), images[3])  # the image is untouched
    with pytest.raises(SourceError, match=r"no sample of .* is labelled with one of classes \[7\]"):
        prepare.run(source, str(tmp_path / "none"), classes=[7])
    with pytest.raises(SourceError, match="distinct"):
        prepare.run(source, str(tmp_path / "twice"), classes=[1, 1])
    with pytest.raises(SystemExit):
        launch.main(["prepare", source, "--out", str(tmp_path / "bad"), "--classes", "shirt,coat"])
    assert "'shirt,coat' is not a comma-separated list of class ids" in capsys.readouterr().err


def test_classes_keeps_the_names_of_the_classes_it_keeps(tmp_path):
    for name in ("cat", "dog", "emu"):
        (tmp_path / "images" / name).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "images" / name / "a.png")
    summary = prepare.run(str(tmp_path / "images"), str(tmp_path / "out"), classes=[2, 0])
    assert summary["class_names"] == ["emu", "cat"] and summary["samples"] == 2
    with pytest.raises(SourceError, match="names class 3, but .* has 3 classes"):
        prepare.run(str(tmp_path / "images"), str(tmp_path / "bad"), classes=[3])


def test_idx_files_get_the_class_names_their_folder_names(tmp_path, capsys):
    # MNIST and Fashion-MNIST ship the same file names: the folder says which (Debian's fashion-mnist/, torchvision's
    # FashionMNIST/raw/ and MNIST/raw/); files elsewhere get no names. --classes carries the names it keeps.
    images, labels = np.zeros((12, 2, 2), np.uint8), np.array([*range(10), 0, 2], np.uint8)
    for folder in ("fashion-mnist", "FashionMNIST/raw", "MNIST/raw", "kmnist", "idx"):
        (tmp_path / folder).mkdir(parents=True)
        write_idx(tmp_path / folder / "train-images-idx3-ubyte.gz", images, compress=True)
        write_idx(tmp_path / folder / "train-labels-idx1-ubyte.gz", labels, compress=True)

    def names(folder, *args):
        out = tmp_path / "out" / folder.replace("/", "-") / "-".join(args)
        assert launch.main(["prepare", str(tmp_path / folder / "train-images-idx3-ubyte.gz"), "--out", str(out), *args]) == 0
        return json.loads((out / "summary.json").read_text()).get("class_names")

    fashion = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt", "Sandal", "Sneaker", "Bag", "Ankle boot"]
    assert names("fashion-mnist") == names("FashionMNIST/raw") == fashion
    assert names("MNIST/raw") == [str(d) for d in range(10)]
    assert names("kmnist") is None and names("idx") is None  # Kuzushiji's classes are not digits; unknown files: none
    assert names("fashion-mnist", "--classes", "4,0") == ["Coat", "T-shirt/top"]

    (tmp_path / "names.txt").write_text("".join(f"kind {i}\n" for i in range(10)) + "\n")
    assert names("idx", "--class-names", "@" + str(tmp_path / "names.txt")) == [f"kind {i}" for i in range(10)]
    assert names("MNIST/raw", "--class-names", ",".join("abcdefghij"), "--classes", "2,9") == ["c", "j"]  # replaces the digits
    capsys.readouterr()
    assert launch.main(["prepare", str(tmp_path / "idx" / "train-images-idx3-ubyte.gz"), "--out", str(tmp_path / "few"),
                        "--class-names", "a,b,c"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: sample 00000003 of idx {tmp_path / 'idx' / 'train-images-idx3-ubyte.gz'} "
                                               f"has label 3, but --class-names names 3 classes (ids 0 to 2); name every class")
    assert not (tmp_path / "few").exists()
    write_idx(tmp_path / "MNIST/raw" / "train-labels-idx1-ubyte.gz", np.array([*range(10), 0, 46], np.uint8), compress=True)
    with pytest.raises(SourceError, match=r"holds label 46, but its path names it MNIST, which has 10 classes; pass the "
                                          r"class names of its labels with --class-names"):
        prepare.run(str(tmp_path / "MNIST/raw" / "train-images-idx3-ubyte.gz"), str(tmp_path / "emnist"))


def test_idx_count_mismatch_is_refused(tmp_path):
    write_idx(tmp_path / "images", np.zeros((3, 2, 2), np.uint8), compress=False)
    write_idx(tmp_path / "labels", np.zeros(2, np.uint8), compress=False)
    with pytest.raises(ValueError, match="3 images but .* 2 labels"):
        idx_samples(tmp_path / "images", tmp_path / "labels")


def test_existing_shards_are_refused_unless_overwriting(tmp_path):
    out = tmp_path / "out"
    assert prepare.run("synthetic", str(out), count=6, size=16, samples_per_shard=2)["shards"] == 3
    with pytest.raises(ValueError, match="already holds 3 .tar files"):
        prepare.run("synthetic", str(out), count=6, size=16)
    summary = prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=4, overwrite=True)
    assert summary["shards"] == 1 and len(list(out.glob("*.tar"))) == 1
    assert sorted(read_shards(out)) == [f"{i:08d}" for i in range(4)]


def test_a_directory_of_tars_prepare_did_not_write_is_refused_without_promising_to_replace_them(tmp_path):
    # Red team round 4, part 1 row 32: the refusal advised --overwrite "to replace them", which keeps them.
    out = tmp_path / "out"
    out.mkdir()
    (out / "backup-2024.tar").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        prepare.run("synthetic", str(out), count=6, size=16)
    assert str(err.value) == (f"{out} already holds 1 .tar files that prepare did not write, and a run on {out} would "
                              f"read them with the new shards; choose an empty output directory (--out)")


def test_missing_and_empty_sources_are_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # a mistyped path is refused without the hub's library
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare.run(str(tmp_path / "nowhere" / "images"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match="holds no images"):
        folder_samples(tmp_path / "empty")
    (tmp_path / "empty" / "bad.png").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="no readable images"):
        write_shards(folder_samples(tmp_path / "empty"), tmp_path / "out")


def test_unlabelled_folder(tmp_path):
    for i in range(3):
        synthetic_image(i, 16)[0].save(tmp_path / f"{i}.png")
    summary = prepare.run(str(tmp_path), str(tmp_path / "out"))
    assert (summary["samples"], summary["labels"], summary["classes"]) == (3, False, 0)
    assert all("cls" not in s for s in read_shards(tmp_path / "out").values())


def test_saved_hf_dataset_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]
    labels = [2, 0, 1, -1]  # -1: ClassLabel's "no label"
    features = datasets.Features({"picture": datasets.Image(), "kind": datasets.ClassLabel(names=["a", "b", "c"]),
                                  "note": datasets.Value("string")})
    images = [Image.new("RGB", (12, 10), colour) for colour in colours]
    dataset = datasets.Dataset.from_dict({"picture": images, "kind": labels, "note": ["x"] * 4}, features=features)
    dataset.save_to_disk(str(tmp_path / "saved"))

    summary = prepare.run(str(tmp_path / "saved"), str(tmp_path / "out"))

    assert (summary["samples"], summary["classes"], summary["labels"]) == (4, 3, True)
    assert summary["class_names"] == ["a", "b", "c"]
    samples = read_shards(tmp_path / "out")
    for i, (colour, label) in enumerate(zip(colours, labels)):
        sample = samples[f"{i:08d}"]
        assert label_of(sample) == (label if label >= 0 else None)
        image = Image.open(io.BytesIO(sample["jpg"]))
        assert image.format == "JPEG" and image.size == (12, 10)
        assert np.abs(np.asarray(image.convert("RGB"), dtype=int) - colour).max() <= 8  # JPEG quality 95


def test_16_bit_pngs_are_stored_as_scaled_8_bit(tmp_path):
    (tmp_path / "images").mkdir()
    Image.fromarray(np.full((8, 8), 32768, np.uint16)).save(tmp_path / "images" / "grey.png")  # 50% grey, mode I;16
    prepare.run(str(tmp_path / "images"), str(tmp_path / "out"))
    stored = Image.open(io.BytesIO(read_shards(tmp_path / "out")["grey"]["png"]))
    assert stored.mode == "L" and np.unique(np.asarray(stored)).tolist() == [128]


def test_short_side_applies_the_exif_orientation_it_would_drop(tmp_path):
    pixels = np.zeros((40, 80, 3), np.uint8)  # stored 80 wide x 40 high; right half white
    pixels[:, 40:] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: 40 wide x 80 high, white half at the bottom
    (tmp_path / "images").mkdir()
    Image.fromarray(pixels).save(tmp_path / "images" / "photo.jpg", quality=95, exif=exif)
    prepare.run(str(tmp_path / "images"), str(tmp_path / "out"), short_side=20)
    stored = Image.open(io.BytesIO(read_shards(tmp_path / "out")["photo"]["jpg"]))
    assert stored.size == (20, 40) and stored.getexif().get(0x0112, 1) == 1
    grey = np.asarray(stored.convert("L"), dtype=float)
    assert grey[:15].mean() < 30 and grey[-15:].mean() > 225


def test_an_output_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(prepare, "open_source", lambda *a, **kw: opened.append(a))
    (tmp_path / "file").write_text("a regular file")
    with pytest.raises(ValueError, match="lies under .*file, which is a file"):
        prepare.run("synthetic", str(tmp_path / "file" / "shards"))
    with pytest.raises(ValueError, match="shards2 is a file"):
        (tmp_path / "shards2").write_text("")
        prepare.run("synthetic", str(tmp_path / "shards2"))
    restore = read_only(tmp_path / "ro")
    try:
        with pytest.raises(ValueError, match="cannot write in .*ro .*choose a writable output directory"):
            prepare.run("synthetic", str(tmp_path / "ro" / "shards"))
    finally:
        restore()
    assert not opened


def test_a_missing_fashion_mnist_path_names_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist.*zalando-datasets/fashion_mnist"):
        prepare.run(str(tmp_path / "fashion-mnist" / "train-images-idx3-ubyte.gz"), str(tmp_path / "out"))


def py2_pickle(value) -> bytes:
    """`value` pickled as the CIFAR files are: by Python 2 with numpy 1 (protocol 2, byte strings as str, arrays
    through numpy.core.multiarray._reconstruct), written opcode by opcode since Python 3 pickles bytes differently."""
    if isinstance(value, dict):
        return b"}(" + b"".join(py2_pickle(k) + py2_pickle(v) for k, v in value.items()) + b"u"
    if isinstance(value, list):
        return b"](" + b"".join(map(py2_pickle, value)) + b"e"
    if isinstance(value, int):
        return b"J" + struct.pack("<i", value)
    if isinstance(value, bytes):
        return b"T" + struct.pack("<I", len(value)) + value
    assert isinstance(value, np.ndarray) and value.dtype == np.uint8
    dtype = (b"cnumpy\ndtype\n(" + py2_pickle(b"u1") + py2_pickle(0) + py2_pickle(1) + b"tR("
             + py2_pickle(3) + py2_pickle(b"|") + b"NNN" + py2_pickle(-1) + py2_pickle(-1) + py2_pickle(0) + b"tb")
    shape = b"(" + b"".join(py2_pickle(n) for n in value.shape) + b"t"
    return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n(" + py2_pickle(0) + b"t" + py2_pickle(b"b") + b"\x87R("
            + py2_pickle(1) + shape + dtype + b"\x89" + py2_pickle(value.tobytes()) + b"tb")


def write_cifar_file(path: Path, content: dict) -> None:
    path.write_bytes(b"\x80\x02" + py2_pickle(content) + b".")


def cifar_rows(images: np.ndarray) -> np.ndarray:
    """N x 32 x 32 x 3 images as CIFAR stores them: per image 1024 red, 1024 green, 1024 blue values."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(folder: Path, train: np.ndarray, train_labels: list[int], test: np.ndarray, test_labels: list[int]) -> None:
    """cifar-10-batches-py as the CIFAR-10 python-version archive unpacks: the training images over five batches."""
    folder.mkdir()
    write_cifar_file(folder / "batches.meta", {b"num_cases_per_batch": len(train) // 5,
                                               b"label_names": [n.encode() for n in CIFAR10_NAMES], b"num_vis": 3072})
    for i, (images, labels) in enumerate(zip(np.split(train, 5), np.split(np.array(train_labels), 5)), 1):
        write_cifar_file(folder / f"data_batch_{i}", {b"batch_label": f"training batch {i} of 5".encode(),
                                                      b"labels": labels.tolist(), b"data": cifar_rows(images),
                                                      b"filenames": [b"x.png"] * len(images)})
    write_cifar_file(folder / "test_batch", {b"batch_label": b"testing batch 1 of 1", b"labels": test_labels,
                                             b"data": cifar_rows(test), b"filenames": [b"x.png"] * len(test)})
    (folder / "readme.html").write_text("<html></html>")


def assert_images_and_labels(out: Path, images: np.ndarray, labels: list[int]) -> None:
    samples = read_shards(out)
    assert sorted(samples) == [f"{i:08d}" for i in range(len(images))]
    for i, (image, label) in enumerate(zip(images, labels)):
        stored = Image.open(io.BytesIO(samples[f"{i:08d}"]["png"]))
        assert stored.mode == "RGB" and np.array_equal(np.asarray(stored), image) and label_of(samples[f"{i:08d}"]) == label


def test_cifar10_python_version_is_read_from_its_folder_or_its_archive(tmp_path, capsys):
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8), rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    train_labels, test_labels = [3, 8, 1, 0, 9, 3, 5, 1, 7, 2], [6, 4, 3]
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder, train, train_labels, test, test_labels)

    summary = prepare.run(str(folder), str(tmp_path / "train"))

    assert summary == json.loads((tmp_path / "train" / "summary.json").read_text())
    assert (summary["samples"], summary["classes"], summary["labels"]) == (10, 8, True)
    assert summary["class_names"] == CIFAR10_NAMES and summary["source"] == f"CIFAR-10 {folder} (train)"
    assert_images_and_labels(tmp_path / "train", train, train_labels)

    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    assert launch.main(["prepare", str(archive), "--split", "test", "--out", str(tmp_path / "test")]) == 0
    assert "wrote 3 samples (3 classes)" in capsys.readouterr().out
    assert json.loads((tmp_path / "test" / "summary.json").read_text())["class_names"] == CIFAR10_NAMES
    assert_images_and_labels(tmp_path / "test", test, test_labels)

    summary = prepare.run(str(folder), str(tmp_path / "down"), classes=[3, 1])
    assert summary["class_names"] == ["cat", "automobile"] and summary["samples"] == 4
    assert {label_of(s) for s in read_shards(tmp_path / "down").values()} == {0, 1}


def test_cifar100_is_labelled_with_its_100_fine_classes(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    fine = [f"fine{i}".encode() for i in range(100)]
    write_cifar_file(folder / "meta", {b"fine_label_names": fine, b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]})
    images = np.random.default_rng(1).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    for split, labels in (("train", [99, 0, 42, 7]), ("test", [5, 5, 60, 1])):
        write_cifar_file(folder / split, {b"batch_label": split.encode(), b"fine_labels": labels, b"coarse_labels": [19, 0, 1, 2],
                                          b"data": cifar_rows(images), b"filenames": [b"x.png"] * 4})

    summary = prepare.run(str(folder), str(tmp_path / "out"), split="test")

    assert summary["class_names"] == [name.decode() for name in fine] and summary["classes"] == 3
    assert_images_and_labels(tmp_path / "out", images, [5, 5, 60, 1])
    with pytest.raises(SourceError, match="CIFAR has no split 'validation'; pass one of test, train"):
        prepare.run(str(folder), str(tmp_path / "val"), split="validation")


def test_a_damaged_or_code_running_cifar_file_is_refused_before_it_runs(tmp_path):
    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder, rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8), [0] * 5,
                  rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8), [0])
    ran = tmp_path / "ran"
    (folder / "test_batch").write_bytes(b"\x80\x02cos\nsystem\n(" + py2_pickle(f"touch {ran}".encode()) + b"tR.")
    with pytest.raises(SourceError, match="test_batch in .* is not a CIFAR pickle .*os.system.*download the python version again"):
        prepare.run(str(folder), str(tmp_path / "out"), split="test")
    assert not ran.exists()
    (folder / "data_batch_4").unlink()
    with pytest.raises(SourceError, match="lacks data_batch_4 of the CIFAR-10 train split; unpack the whole archive again"):
        prepare.run(str(folder), str(tmp_path / "out"))
    write_cifar_file(folder / "data_batch_4", {b"labels": [10], b"data": cifar_rows(np.zeros((1, 32, 32, 3), np.uint8))})
    with pytest.raises(SourceError, match="data_batch_4 in .* is not a CIFAR-10 batch .*labels below 10"):
        prepare.run(str(folder), str(tmp_path / "out"))
    write_cifar_file(folder / "batches.meta", {b"num_vis": 3072})
    with pytest.raises(SourceError, match="batches.meta in .* does not list the class names"):
        prepare.run(str(folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_missing_cifar_path_is_one_line_naming_how_to_get_it(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "data" / "cifar-10-python.tar.gz"
    monkeypatch.setattr(sys, "argv", ["launch.py", "prepare", str(missing)])  # the advice names the command that ran
    assert launch.main(["prepare", str(missing), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"error: {missing} does not exist; CIFAR-10 and CIFAR-100 come in no Debian or PyPI package")
    assert "https://www.cs.toronto.edu/~kriz/cifar.html" in err and "`python launch.py prepare uoft-cs/cifar10 --split train`" in err


def test_generating_the_synthetic_corpus_shows_progress(tmp_path, monkeypatch, capsys):
    from conftest import reset_accelerator
    from mpp.config import load_config
    from mpp.training.runtime import make_accelerator
    from pipelines.run import loaders

    monkeypatch.setattr(loaders, "SYNTHETIC_ROOT", tmp_path / "data")
    cfg = load_config(None, ["data.synthetic_size=30", f"output_dir={tmp_path / 'run'}"])
    try:
        urls = loaders.resolve_shards("synthetic", cfg, make_accelerator(cfg.train, cfg.output_dir))
    finally:
        reset_accelerator()
    bar = capsys.readouterr().err
    assert len(urls) == 1 and "writing shards" in bar and "30/30" in bar


def test_a_registered_source_kind_is_read_by_prepare_with_no_other_edit(tmp_path, monkeypatch):
    def gray_squares(request):
        def read():
            for i in range(request.count):
                buffer = io.BytesIO()
                Image.new("L", (8, 8), 10 * i).save(buffer, "PNG")
                yield Sample(f"g{i}", buffer.getvalue(), "png", i % 2)
        return Source("gray squares", request.count, read, class_names=["dark", "light"])

    monkeypatch.setattr(prepare, "SOURCES", [(lambda r: r.source == "gray", gray_squares), *prepare.SOURCES])
    summary = prepare.run("gray", str(tmp_path / "out"), count=6)
    assert (summary["samples"], summary["classes"], summary["class_names"]) == (6, 2, ["dark", "light"])
    assert prepare.run("synthetic", str(tmp_path / "synthetic"), count=4, size=16)["samples"] == 4  # the others still match


def test_overwrite_replaces_only_the_shards_summary_json_lists(tmp_path):
    out = tmp_path / "out"
    assert prepare.run("synthetic", str(out), count=6, size=16, samples_per_shard=2)["files"] == [
        "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    (out / "backup.tar").write_bytes(b"the user's own archive")
    with pytest.warns(UserWarning, match="keeping backup.tar in .*not written by prepare"):
        summary = prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=4, overwrite=True)
    assert summary["files"] == ["shard-000000.tar"]
    assert sorted(p.name for p in out.iterdir()) == ["backup.tar", "shard-000000.tar", "summary.json"]
    assert (out / "backup.tar").read_bytes() == b"the user's own archive"

    # A summary of an older mpp lists no files: what prepare names shard-NNNNNN.tar is its own, the rest is not.
    stored = json.loads((out / "summary.json").read_text())
    del stored["files"]
    (out / "summary.json").write_text(json.dumps(stored))
    with pytest.warns(UserWarning, match="keeping backup.tar"):
        prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=2, overwrite=True)
    assert sorted(p.name for p in out.glob("*.tar")) == ["backup.tar", "shard-000000.tar", "shard-000001.tar"]

    # A file named like a shard that the summary does not list is someone else's: refused, nothing touched.
    (out / "shard-000007.tar").write_bytes(b"not ours")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SourceError, match="holds shard-000007.tar, named like the shards .* not listed in its summary.json"):
        prepare.run("synthetic", str(out), count=4, size=16, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_folder_links_are_followed_once_and_never_in_a_loop(tmp_path):
    root, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    for i, name in enumerate(["cat/a.png", "dog/b.png", "../elsewhere/birds/c.png", "../elsewhere/d.png"]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        synthetic_image(i, 16)[0].save(root / name)
    (root / "cat" / "loop").symlink_to("..")  # root itself: would read everything again, forever
    (root / "cat" / "dogs").symlink_to("../dog")  # a folder read anyway: its dogs would be labelled cat
    (root / "cat" / "up").symlink_to(tmp_path)  # above root
    (root / "bird").symlink_to(elsewhere / "birds")  # a class folder kept elsewhere: read, once
    (root / "dog" / "birds-again").symlink_to(elsewhere / "birds")
    (root / "cat" / "d.png").symlink_to(elsewhere / "d.png")  # a link to a file: read
    (root / "dog" / "gone.png").symlink_to(tmp_path / "nothing.png")  # dangling: unreadable, skipped and counted

    with pytest.warns(UserWarning) as warned:
        summary = prepare.run(str(root), str(tmp_path / "shards"))
    said = [str(w.message) for w in warned]
    assert len(said) == 2 and re.search(r"not following 4 folder link\(s\) under .* \(first: cat/dogs\)", said[0])
    assert said[1].startswith(f"skipped 1 unreadable image(s) in folder {root}: {root}/dog/gone.png;")
    labels = {key: label_of(sample) for key, sample in read_shards(tmp_path / "shards").items()}
    assert labels == {"bird_c": 0, "cat_a": 1, "cat_d": 1, "dog_b": 2}  # classes bird, cat, dog
    assert summary["samples"] == 4 and summary["unreadable"] == [str(root / "dog" / "gone.png")]


def test_a_full_disk_leaves_the_output_directory_as_it_was(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    prepare.run("synthetic", str(out), count=6, size=16, samples_per_shard=2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_addfile, added = tarfile.TarFile.addfile, []

    def addfile_until_full(self, *args, **kwargs):  # the tar writer's write: the disk fills after 5 members
        added.append(1)
        if len(added) > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_addfile(self, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "addfile", addfile_until_full)
    capsys.readouterr()
    assert launch.main(["prepare", "synthetic", "--out", str(out), "--count", "20", "--size", "16",
                        "--samples-per-shard", "2", "--overwrite", "--workers", "1"]) == 2  # patched in this process
    error = capsys.readouterr().err
    assert "Traceback" not in error and [line for line in error.splitlines() if "error: " in line] == [
        f"error: cannot write the shards in {out} (No space left on device); the partial shards were removed and "
        f"{out} is as it was: free some space or choose another output directory (--out)"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old shard set, whole, and nothing else
    added.clear()
    assert launch.main(["prepare", "synthetic", "--out", str(tmp_path / "new"), "--count", "20", "--size", "16",
                        "--workers", "1"]) == 2
    assert not (tmp_path / "new").exists()


def test_an_output_name_longer_than_the_file_system_allows_is_one_line(tmp_path, capsys):
    assert launch.main(["prepare", "synthetic", "--out", str(tmp_path / ("x" * 300) / "shards")]) == 2
    assert "error: output directory" in capsys.readouterr().err
    with pytest.raises(SourceError, match=r"its name x{24}\.\.\. has 300 bytes, more than the 255 its file system allows"):
        prepare.run("synthetic", str(tmp_path / ("x" * 300)))


@pytest.mark.parametrize("flags, said", [
    (["--quality", "0"], "the JPEG quality must be 1-100, got 0 (--quality)"),  # without --short-side too
    (["--samples-per-shard", "0"], "the number of samples per shard must be at least 1, got 0 (--samples-per-shard)"),
])
def test_out_of_range_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, said):
    assert launch.main(["prepare", "synthetic", "--count", "4", "--size", "16", "--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {said}"
    assert not (tmp_path / "out").exists()


def test_a_folder_of_parquet_files_is_one_line_saying_a_run_reads_it_as_it_is(tmp_path, capsys):
    from test_readers import parquet_files

    folder = parquet_files(tmp_path / "pq", [3])
    assert launch.main(["prepare", folder, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {folder} holds Parquet files, which a run reads as they are "
                                               f"(data.shards={folder}), so it needs no prepare; point prepare at a "
                                               f"folder of images instead")
