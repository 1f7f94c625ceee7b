"""Labels: read only where a run needs them, from cls, json or txt, as ids or class names (issues 11 and 16)."""

import io
import json
import re
import subprocess
import sys

import pytest
import webdataset as wds

from mpp.config import DataConfig, load_config
from mpp.data.stream import DataError, EvalTransform, label_space, make_loader
from mpp.data.synthetic import synthetic_image
from pipelines.stages import pretrain
from pipelines.run.loaders import num_classes

from conftest import ROOT, TINY, reset_accelerator


@pytest.fixture(autouse=True)
def fresh_state():
    label_space.cache_clear()  # tests rewrite shards under the same names
    yield
    reset_accelerator()


def jpeg(i):
    buffer = io.BytesIO()
    synthetic_image(i, 16)[0].save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def write_labelled(directory, labels, field="cls", class_names=None):
    """One shard whose sample i carries labels[i] under `field` (json: {"label": value}); summary.json if class_names."""
    directory.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(directory / "s-000000.tar")) as sink:
        for i, label in enumerate(labels):
            value = json.dumps({"label": label}) if field == "json" else str(label)
            sink.write({"__key__": f"k{i:04d}", "jpg": jpeg(i), field: value.encode()})
    if class_names is not None:
        (directory / "summary.json").write_text(json.dumps({"labels": True, "classes": len(class_names),
                                                            "class_names": class_names}))
    return [str(directory / "s-000000.tar")]


def stream_labels(urls, **kw):
    batches = list(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 4, one_pass=True, **kw))
    return [int(x) for b in batches for x in b.labels], sum((b.skipped for b in batches), start=batches[0].skipped.__class__())


@pytest.mark.parametrize("field", ["cls", "json", "txt"])
def test_class_names_map_through_summary_json(tmp_path, field):
    urls = write_labelled(tmp_path / "s", ["dog", "cat", "bird", "dog"], field, class_names=["cat", "dog", "bird"])
    assert stream_labels(urls)[0] == [1, 0, 2, 1]


def test_integer_labels_in_json_and_cls(tmp_path):
    assert stream_labels(write_labelled(tmp_path / "j", [3, 0, 7, 1], "json"))[0] == [3, 0, 7, 1]
    assert stream_labels(write_labelled(tmp_path / "c", [3, 0, 7, 1], "cls"))[0] == [3, 0, 7, 1]


def test_without_summary_a_scan_finds_the_classes(tmp_path):
    names = write_labelled(tmp_path / "names", ["zebra", "ant", "mole", "ant"], "txt")
    cfg = load_config(None, ["data.shards=x"])
    assert num_classes(cfg, names) == 3
    assert stream_labels(names)[0] == [2, 0, 1, 0]  # sorted names: ant, mole, zebra
    ids = write_labelled(tmp_path / "ids", [4, 0, 2, 2], "json")
    assert num_classes(cfg, ids) == 5
    mixed = write_labelled(tmp_path / "mixed", [1, "cat", 2, 0], "cls")
    with pytest.raises(DataError, match="some samples with class ids and others with class names.*set model.num_classes"):
        num_classes(cfg, mixed)


def test_remote_shards_without_summary_ask_for_num_classes(tmp_path):
    urls = write_labelled(tmp_path / "s", [1, 2, 0, 1])
    with pytest.raises(DataError, match="set model.num_classes"):
        num_classes(load_config(None, ["data.shards=x"]), [f"pipe:cat {urls[0]}"])
    assert num_classes(load_config(None, ["data.shards=x", "model.num_classes=4"]), [f"pipe:cat {urls[0]}"]) == 4


def test_bad_labels_are_counted_skips_when_labels_are_read(tmp_path):
    urls = write_labelled(tmp_path / "s", [1, -3, "cat", 2, 0, "+1"], "cls")
    with pytest.warns(UserWarning, match="bad_label"):
        labels, skipped = stream_labels(urls)
    assert labels == [1, 2, 0, 1] and skipped["bad_label"] == 2
    assert stream_labels(urls, labels=False)[0] == [-1] * 6  # not read at all


def test_shards_whose_every_label_is_bad_stop_with_one_line(tmp_path):
    urls = write_labelled(tmp_path / "s", [-3] * 5, "cls")
    with pytest.raises(DataError, match=r"5 bad_label \(first: k0000: label -3, below 0\)"):
        stream_labels(urls, class_names=())


def test_mpp_pretraining_never_reads_labels(tmp_path):
    write_labelled(tmp_path / "s", ["cat", "not a label", -3, "{"] * 4, "cls")
    cfg = load_config(None, [f"data.shards={tmp_path / 's'}", f"output_dir={tmp_path / 'run'}", *TINY,
                             "train.steps=2", "train.warmup_steps=1", "train.batch_size=4"])
    results = pretrain.run(cfg)
    assert results["skipped"] == {} and (tmp_path / "run" / "model.safetensors").is_file()


def test_supervised_pretraining_skips_bad_labels_and_stops_on_too_many(tmp_path):
    write_labelled(tmp_path / "s", [0, 1, -3, "cat", 2, 1, 0, 2] * 30, "cls")
    common = [f"data.shards={tmp_path / 's'}", *TINY, "objective=supervised", "model.num_classes=3",
              "train.warmup_steps=1", "train.batch_size=8", "log.every=1"]
    tolerant = load_config(None, [*common, f"output_dir={tmp_path / 'a'}", "train.steps=3", "data.max_skip_fraction=0.5"])
    with pytest.warns(UserWarning, match="bad_label"):
        assert pretrain.run(tolerant)["skipped"]["bad_label"] > 0
    reset_accelerator()
    strict = load_config(None, [*common, f"output_dir={tmp_path / 'b'}", "train.steps=60"])
    with pytest.warns(UserWarning, match="bad_label"), pytest.raises(DataError, match="could not be used, over data.max_skip_fraction"):
        pretrain.run(strict)


def test_training_and_evaluation_shards_share_one_name_map(tmp_path):
    """Without summaries, ids come from the training set's names: an evaluation set that lacks a class keeps the ids."""
    from pipelines.run.loaders import class_names, label_reader

    write_labelled(tmp_path / "train", ["zebra", "ant", "mole", "ant"], "txt")
    val = write_labelled(tmp_path / "val", ["zebra", "mole"], "txt")
    cfg = load_config(None, [f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}"])
    names = class_names(cfg, None, cfg.data.shards)
    assert names == ("ant", "mole", "zebra") == label_reader(cfg, None, cfg.data.val_shards).class_names
    assert stream_labels(val, class_names=names)[0] == [2, 1]


def test_integer_labels_need_no_scan_of_every_shard(tmp_path):
    import mpp.data.stream

    urls = write_labelled(tmp_path / "a", [1, 2, 0, 1]) + write_labelled(tmp_path / "b", [3, 0])
    assert mpp.data.stream.label_names(tuple(urls)) == ()
    assert mpp.data.stream.label_space.cache_info().currsize == 0  # the full scan never ran


# ---------------------------------------------------------------- labels and summaries that used to end in a traceback


def test_a_label_too_large_for_an_id_is_a_counted_bad_label(tmp_path):
    """A 20-digit label overflowed int64: a traceback at the scan (the head's size) and in the stream (the batch)."""
    urls = write_labelled(tmp_path / "s", [0, 1, 12345678901234567890, 2] * 2, "cls")
    assert num_classes(load_config(None, ["data.shards=x"]), urls) == 3  # the scan leaves it to the stream
    with pytest.warns(UserWarning, match=r"bad_label \(first: k0002: label 12345678901234567890, larger than any class id"):
        labels, skipped = stream_labels(urls)
    assert labels == [0, 1, 2] * 2 and skipped["bad_label"] == 2


def test_a_stray_huge_label_is_named_not_taken_for_the_class_count(tmp_path):
    """One label 1000000000 among 0 to 2 sized the head for a billion classes: 'out of memory ... reduce batch size'."""
    urls = write_labelled(tmp_path / "s", [0, 1, 1000000000, 2] * 2, "cls")
    with pytest.raises(DataError, match=rf"largest label, 1000000000 \(sample k0002 of {urls[0]}\), would size the head "
                                        r"for 1000000001 classes although only 4 distinct labels occur, the next largest "
                                        r"being 2, so it looks like a stray label to correct\); set model.num_classes"):
        num_classes(load_config(None, ["data.shards=x"]), urls)


def test_a_label_beyond_the_head_is_told_a_stray_label_from_a_short_head():
    """With model.num_classes=10, a label 10^9 advised raising num_classes, which sized the head for a billion classes
    and ran out of memory (round 4, rows 135-136); a label just past the head is a class count to raise."""
    import torch

    from mpp.data.stream import Batch
    from pipelines.run.loaders import labelled

    def first_error(label):
        batch = Batch(torch.zeros(3, 3, 8, 8, dtype=torch.uint8), torch.tensor([1, label, 2]), keys=("s.tar/a", "s.tar/b", "s.tar/c"))
        with pytest.raises(DataError) as err:
            list(labelled([batch], 10, "data.shards (DIR)"))
        return str(err.value)

    assert first_error(1000000000) == (
        "data.shards (DIR) holds label 1000000000 (sample s.tar/b) but the head has 10 classes (0 to 9); a label that "
        "far beyond them looks like a stray one: correct that sample's label or remove the sample from the shards (set "
        "model.num_classes only if the shards really hold 1000000001 classes)")
    assert first_error(12).endswith("holds label 12 (sample s.tar/b) but the head has 10 classes (0 to 9); set "
                                    "model.num_classes to the number of classes")


@pytest.mark.parametrize("summary, complaint", [
    ("{not json", "it is not JSON"),
    ('{"labels": true, "classes": "three"}', "classes: input should be a valid integer"),
    ('{"labels": true, "classes": 3, "class_names": "abc"}', "class_names: input should be a valid array"),
    ('{"labels": "yes", "classes": 3}', "labels: input should be a valid boolean"),
    ("[1, 2]", "the whole file: input should be an object"),
], ids=["not-json", "classes-text", "class-names-string", "labels-text", "a-list"])
def test_a_malformed_summary_is_named_with_what_is_wrong(tmp_path, summary, complaint):
    urls = write_labelled(tmp_path / "s", [0, 1, 2, 1], "cls")
    (tmp_path / "s" / "summary.json").write_text(summary)
    with pytest.raises(DataError, match=rf"{tmp_path / 's' / 'summary.json'} cannot be read: {re.escape(complaint)}.*"
                                        r"correct it, or delete it"):
        num_classes(load_config(None, ["data.shards=x"]), urls)
    with pytest.raises(DataError, match="summary.json cannot be read"):  # the stream reads it too (samples per shard)
        stream_labels(urls, labels=False)


def test_class_names_that_differ_in_case_between_sets_are_named(tmp_path):
    """Training 'cat'/'dog', evaluation 'Cat'/'Dog': the error said to set model.num_classes, which trained to 0%."""
    from pipelines.run.loaders import label_reader

    write_labelled(tmp_path / "train", ["cat", "dog", "cat", "dog"], "txt")
    write_labelled(tmp_path / "val", ["Cat", "Dog"], "txt")
    cfg = load_config(None, [f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}"])
    with pytest.raises(DataError, match=rf"class names differ only in case between {tmp_path / 'train'} and "
                                        rf"{tmp_path / 'val'} \('cat' and 'Cat', 'dog' and 'Dog'\).*whatever "
                                        r"model.num_classes says"):
        label_reader(cfg, None, cfg.data.val_shards)
    # with a summary's names, each evaluation sample is a bad label whose message shows the other spelling
    labelled = write_labelled(tmp_path / "named", ["Cat"], "cls", class_names=["cat", "dog"])
    with pytest.raises(DataError, match=r"class name 'Cat', not one of the 2 class names of the shard set \('cat' is: "
                                        r"names are matched exactly, case included\)"):
        stream_labels(labelled)


def test_cli_names_a_stray_label_instead_of_running_out_of_memory(tmp_path):
    write_labelled(tmp_path / "s", [0, 1, 1000000000, 2] * 2, "cls")
    proc = subprocess.run([sys.executable, "launch.py", "pretrain", "objective=supervised", f"data.shards={tmp_path / 's'}",
                           f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=2", "train.warmup_steps=1",
                           "train.batch_size=4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith("error: cannot tell how many classes") and "1000000000 (sample k0002" in proc.stderr
    assert not (tmp_path / "run").exists()
