"""Readers other than tars: an image folder (class = sub-folder) and a directory of Parquet files (the Hugging Face
Hub's layout), streamed with the split, resume, skip counting and damage handling the tar shards have."""

import io
import itertools
import json

import pytest
import torch

from mpp.config import DataConfig, load_config
from mpp.data.stream import EvalTransform, StreamState, TrainTransform, label_space, make_loader
from mpp.data.readers import expand_shards
from mpp.errors import DataError
from mpp.data.readers import READERS, reader_for
from mpp.data.synthetic import synthetic_image
from pipelines.stages import pretrain

from conftest import TINY

NAMES = ("circle", "square", "stripes")


def jpeg(index: int, size: int = 24) -> tuple[bytes, int]:
    image, label = synthetic_image(index, size)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), label % len(NAMES)


def image_folder(root, count: int) -> str:
    """`count` JPEGs in one sub-folder per class name."""
    for i in range(count):
        data, label = jpeg(i)
        (root / NAMES[label]).mkdir(parents=True, exist_ok=True)
        (root / NAMES[label] / f"{i:04d}.jpg").write_bytes(data)
    return str(root)


def parquet_files(root, counts: list[int], struct: bool = True) -> str:
    """Parquet files as the Hub stores them (data/train-0000k-of-0000n.parquet), an image column of {bytes, path}
    structs (or plain bytes) and an integer label column. Skips the test where pyarrow (which `datasets` brings) is
    not installed, as on a GPU machine that carries only what the GPU report needs."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (root / "data").mkdir(parents=True)
    index = 0
    for k, count in enumerate(counts):
        images, labels = [], []
        for _ in range(count):
            data, label = jpeg(index)
            images.append({"bytes": data, "path": f"{index}.jpg"} if struct else data)
            labels.append(label)
            index += 1
        pq.write_table(pa.table({"image": images, "label": labels}), root / "data" / f"train-{k:05d}-of-{len(counts):05d}.parquet",
                       row_group_size=4)
    return str(root)


def data_set(kind: str, tmp_path, total: int = 43) -> str:
    return image_folder(tmp_path / "folder", total) if kind == "folder" else parquet_files(tmp_path / "pq", [9, 8, 7, 10, 9])


def ids(loader) -> list[bytes]:
    return [bytes(img.flatten().tolist()) for batch in loader for img in batch.images]


@pytest.mark.parametrize("kind", ["folder", "parquet"])
def test_each_sample_once_per_pass_across_ranks_and_workers_with_labels(kind, tmp_path):
    spec = data_set(kind, tmp_path)
    assert reader_for(spec) is READERS["images" if kind == "folder" else "parquet"]
    urls = expand_shards(spec)
    one = make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 5, one_pass=True)
    everything = ids(one)
    assert len(everything) == 43 and len(set(everything)) == 43
    seen = []
    for rank in range(2):
        seen += ids(make_loader(urls, DataConfig(num_workers=2, shuffle_buffer=10), EvalTransform(8), 5, rank=rank,
                                world=2, one_pass=True))
    assert sorted(seen) == sorted(everything)
    batch = next(iter(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 43, one_pass=True)))
    expected = [jpeg(i)[1] for i in range(43)]
    if kind == "folder":  # class names, ids by sorted name as ImageFolder gives them
        assert label_space(tuple(urls)).class_names == NAMES
        assert sorted(batch.labels.tolist()) == sorted(expected)
    else:
        assert label_space(tuple(urls)).count == 3 and batch.labels.tolist() == expected


@pytest.mark.parametrize("kind,resampled", [("folder", True), ("folder", False), ("parquet", True), ("parquet", False)])
def test_stream_restarts_exactly_where_it_stopped(kind, resampled, tmp_path):
    urls = expand_shards(data_set(kind, tmp_path))
    data = DataConfig(num_workers=2, resampled=resampled, shuffle_buffer=6)
    full = [b.images for b in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3), 15)]
    state = StreamState()
    for batch in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3), 7):
        state.advance(batch)
    restored = StreamState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    rest = [b.images for b in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3, state=restored), 8)]
    assert len(rest) == 8 and all(torch.equal(a, b) for a, b in zip(full[7:], rest))


def damaged_folder(root) -> str:
    image_folder(root, 10)
    (root / "circle" / "garbled.jpg").write_bytes(b"not an image")
    (root / "square" / "gone.jpg").symlink_to(root / "nowhere.jpg")  # listed, cannot be read
    return str(root)


def damaged_parquet_files(root) -> str:
    parquet_files(root, [6, 6])
    whole = (root / "data" / "train-00001-of-00002.parquet").read_bytes()
    (root / "data" / "train-00001-of-00002.parquet").write_bytes(whole[: len(whole) // 2])  # cut short
    return str(root)


@pytest.mark.parametrize("kind,usable,counted", [("folder", 10, {"undecodable_image": 1, "unreadable_shard": 1}),
                                                 ("parquet", 6, {"unreadable_shard": 6})])
def test_damaged_images_and_files_are_skipped_and_counted(kind, usable, counted, tmp_path):
    spec = damaged_folder(tmp_path / "folder") if kind == "folder" else damaged_parquet_files(tmp_path / "pq")
    loader = make_loader(expand_shards(spec), DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 100, one_pass=True)
    with pytest.warns(UserWarning):
        batches = list(loader)
    assert sum(len(b.images) for b in batches) == usable
    skipped = sum((b.skipped for b in batches), start=type(batches[0].skipped)())
    assert dict(skipped) == counted


def test_plain_bytes_image_column_is_read(tmp_path):
    urls = expand_shards(parquet_files(tmp_path / "pq", [5], struct=False))
    batch = next(iter(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 5, one_pass=True)))
    assert batch.images.shape == (5, 3, 8, 8) and batch.keys[0] == "train-00000-of-00001.parquet/00000000"


def test_supervised_pretraining_reads_an_image_folder_without_prepare(tmp_path, capsys):
    # data.shards=<a folder of class sub-folders>: the labels are the folder names, no prepare, no summary.json.
    folder = image_folder(tmp_path / "folder", 24)
    results = pretrain.run(load_config(None, [f"data.shards={folder}", f"output_dir={tmp_path / 'run'}", *TINY,
                                              "objective=supervised", "train.steps=2", "train.warmup_steps=1",
                                              "train.batch_size=4"]))
    assert "train/accuracy" in results["final"]
    assert "params) on 24 images with 1 process(es)" in capsys.readouterr().out  # the start line: 24 units, each an image


def test_parquet_float_labels_are_class_ids(tmp_path):
    """Row 100: labels 0.0 to 3.0 (ids pandas stored as floats) were read as the class names '0.0', ..., and then
    refused as names without a name map, every sample a bad label."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"image": [jpeg(i)[0] for i in range(8)], "label": [float(i % 4) for i in range(8)]}),
                   tmp_path / "pq" / "train.parquet")
    urls = expand_shards(str(tmp_path / "pq"))
    assert label_space(tuple(urls)).count == 4 and label_space(tuple(urls)).class_names == ()
    batch = next(iter(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 8, one_pass=True)))
    assert batch.labels.tolist() == [0, 1, 2, 3] * 2 and not any(batch.skipped.values())


def test_a_parquet_image_column_that_holds_no_images_is_named(tmp_path):
    """Row 102: an int column called image made every row an undecodable image ('a bytes-like object is required')."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"image": list(range(4)), "jpg": [jpeg(i)[0] for i in range(4)]}), tmp_path / "pq" / "t.parquet")
    urls = expand_shards(str(tmp_path / "pq"))
    with pytest.raises(DataError, match=r"t.parquet has a column 'image' of int64 values, not encoded images .*; "
                                        r"rename it, and name the column of encoded images 'image'"):
        next(iter(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 4, one_pass=True)))
