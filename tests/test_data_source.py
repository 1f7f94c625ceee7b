"""The data source behind data.shards (mpp.data.source): its units, images and class names for every reader, so that
train.epochs works on image folders and Parquet files; a reader added from outside mpp (a CSV image list, as
docs/data.md's "Adding a reader" writes it) in one class and one registry line; and stream positions saved before the
source object existed resuming the same."""

import csv
import inspect
import itertools
import json
import os
from pathlib import Path

import pytest

from mpp.config import DataConfig, load_config
from mpp.data.readers import READERS, Reader, Uncounted, expand_shards
from mpp.data.source import open_source
from mpp.data.stream import StreamState, TrainTransform, make_loader
from mpp.data.tars import ShardEnd
from pipelines import cli
from pipelines.stages import pretrain

from conftest import TINY
from test_readers import NAMES, image_folder, jpeg, parquet_files

FIXTURES = Path(__file__).parent / "fixtures"


class CsvImageListReader(Reader):
    """A CSV file of `path,label` rows, paths relative to the file: each file a unit, its rows its samples."""

    units = "image lists"

    def claims(self, spec: str) -> bool:
        return spec.endswith(".csv") and os.path.isfile(spec)

    def expand(self, spec: str) -> list[str]:
        return [spec]

    def reads(self, url: str) -> bool:
        return url.endswith(".csv")

    def images(self, units: list[str]) -> int:
        return sum(1 for url in units for _ in self._rows(url))

    def samples(self, url: str, end: ShardEnd):
        for index, (path, label) in enumerate(self._rows(url)):
            with open(os.path.join(os.path.dirname(url), path), "rb") as file:
                yield {"__key__": f"{index:08d}", "__url__": url, "jpg": file.read(), "cls": label.encode()}
            end.samples += 1

    def label_members(self, url: str):
        for index, (_, label) in enumerate(self._rows(url)):
            yield {"__key__": f"{index:08d}", "cls": label.encode()}

    @staticmethod
    def _rows(url: str):
        with open(url, newline="") as file:
            yield from csv.reader(file)


def image_list(root: Path, count: int) -> str:
    """`count` JPEGs in root/images and root/list.csv naming each with its class name."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(count):
        data, label = jpeg(i)
        (root / "images" / f"{i}.jpg").write_bytes(data)
        rows.append([f"images/{i}.jpg", NAMES[label]])
    with open(root / "list.csv", "w", newline="") as file:
        csv.writer(file).writerows(rows)
    return str(root / "list.csv")


def test_the_reader_docs_data_md_adds_is_this_one():
    docs = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    assert inspect.getsource(CsvImageListReader) in docs and 'READERS["csv"] = CsvImageListReader()' in docs


def test_a_csv_reader_from_outside_mpp_trains_through_the_command_line_with_epochs(tmp_path, monkeypatch, capsys):
    spec = image_list(tmp_path / "list", 12)
    monkeypatch.setitem(READERS, "csv", CsvImageListReader())  # the registry line: READERS["csv"] = CsvImageListReader()
    source = open_source(spec)
    assert (source.units, source.images, source.class_names) == ((spec,), 12, NAMES)
    assert cli.main(["pretrain", f"data.shards={spec}", f"output_dir={tmp_path / 'run'}", *TINY, "data.num_workers=1",
                     "objective=supervised", "train.batch_size=4", "train.epochs=2", "train.warmup_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "train.epochs 2 over 12 training images: 6 steps" in out and "on 1 image lists" in out
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 6 and "train/accuracy" in results["final"]


@pytest.mark.parametrize("kind", ["folder", "parquet"])
def test_an_epoch_on_a_folder_or_parquet_files_runs_its_images_over_the_batch_in_steps(kind, tmp_path, capsys):
    # 26 images (9 + 8 + 9 rows), 8 a step: ceil(1.5 x 26 / 8) = 5 steps. Refused before: "has no summary.json".
    spec = image_folder(tmp_path / "folder", 26) if kind == "folder" else parquet_files(tmp_path / "pq", [9, 8, 9])
    assert open_source(spec).images == 26
    results = pretrain.run(load_config(None, [f"data.shards={spec}", f"output_dir={tmp_path / 'run'}", *TINY,
                                              "train.batch_size=8", "train.epochs=1.5", "train.warmup_steps=1"]))
    assert results["steps"] == 5
    assert "train.epochs 1.5 over 26 training images: 5 steps" in capsys.readouterr().out


def test_the_source_of_each_reader_gives_its_units_images_and_class_names(tmp_path, make_shards):
    folder = open_source(image_folder(tmp_path / "folder", 7))
    assert folder.reader is READERS["images"] and len(folder.units) == folder.images == 7 and folder.class_names == NAMES
    damaged = parquet_files(tmp_path / "pq", [3, 4])
    Path(damaged, "data", "train-00001-of-00002.parquet").write_bytes(b"cut")  # counted by the stream, not here
    parquet = open_source(damaged)
    assert parquet.reader is READERS["parquet"] and (len(parquet.units), parquet.images, parquet.class_names) == (2, 3, ())
    tars = open_source(os.path.dirname(make_shards([4, 4])[0]))  # no summary.json: uncountable before reading
    assert tars.reader is READERS["tar"] and len(tars.units) == 2
    with pytest.raises(Uncounted, match="has no summary.json giving its samples beside"):
        tars.images


def stream_record(units: list[str], resampled: bool) -> dict:
    """A training stream's state after 5 batches as a checkpoint stores it (stream_state_{rank}.json), and the keys of
    the 3 batches a stream resumed from it gives. tests/fixtures/stream_states_before_data_source.json holds these as
    mpp computed them before the data source object (commit f918df9), for image_folder(23) and parquet_files([5, 4, 6,
    5]) as test_readers makes them."""
    data = DataConfig(num_workers=2, resampled=resampled, shuffle_buffer=6)
    state = StreamState()
    for batch in itertools.islice(make_loader(units, data, TrainTransform(8), 4, seed=3), 5):
        state.advance(batch)
    saved = json.loads(json.dumps(state.state_dict()))
    return {"state": saved, "next_keys": resumed_keys(units, data, saved)}


def resumed_keys(units: list[str], data: DataConfig, saved: dict) -> list[list[str]]:
    restored = StreamState()
    restored.load_state_dict(saved)
    return [list(b.keys) for b in itertools.islice(make_loader(units, data, TrainTransform(8), 4, seed=3, state=restored), 3)]


@pytest.mark.parametrize("kind", ["folder", "parquet"])
def test_stream_states_saved_before_the_data_source_resume_the_same(kind, tmp_path):
    before = json.loads((FIXTURES / "stream_states_before_data_source.json").read_text())
    spec = image_folder(tmp_path / "folder", 23) if kind == "folder" else parquet_files(tmp_path / "pq", [5, 4, 6, 5])
    units = list(open_source(spec).units)
    assert units == expand_shards(spec)
    for resampled in (True, False):
        saved = before[f"{kind}-{'resampled' if resampled else 'passes'}"]
        data = DataConfig(num_workers=2, resampled=resampled, shuffle_buffer=6)
        assert resumed_keys(units, data, saved["state"]) == saved["next_keys"]  # an old checkpoint resumes the same
        assert stream_record(units, resampled) == saved  # and a new one is what the old code saved
