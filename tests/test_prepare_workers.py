"""prepare with several worker processes, from an archive, and with another prepare on the same --out."""

import contextlib
import gzip
import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

import launch
from mpp.data import shardwriter
from mpp.data.prepare_inputs import Sample, Source, SourceError
from mpp.data.synthetic import synthetic_image
from pipelines.stages import prepare

from test_shards import encoded, label_of, read_shards

ROOT = Path(__file__).resolve().parents[1]


def files_of(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


@pytest.fixture
def small_sources_use_workers(monkeypatch):
    """Worker processes for the few inputs a test has (a real source needs INPUTS_PER_WORKER per worker)."""
    monkeypatch.setattr(shardwriter, "INPUTS_PER_WORKER", 1)


@pytest.fixture
def range_writes(monkeypatch):
    """How many times worker processes were asked to write ranges (so a test knows it took that path)."""
    calls = []
    real = shardwriter._RangeWorkers.write

    def counted(self, ranges):
        calls.append(self.workers)
        return real(self, ranges)

    monkeypatch.setattr(shardwriter._RangeWorkers, "write", counted)
    return calls


def test_shards_are_byte_identical_whatever_the_number_of_workers(tmp_path, range_writes, small_sources_use_workers):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "images"
    for i in range(11):
        (folder / ("cat", "dog", "emu")[i % 3]).mkdir(parents=True, exist_ok=True)
        synthetic_image(i, 40)[0].save(folder / ("cat", "dog", "emu")[i % 3] / f"{i}.{'png' if i % 2 else 'jpg'}")
    (folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")  # skipped: the ranges are packed into full shards
    images = [synthetic_image(i, 12)[0] for i in range(7)]
    datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(7)]},
                               features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
                               ).save_to_disk(str(tmp_path / "saved"))
    runs = {  # source, options
        "folder": (str(folder), {"short_side": 20}),
        "folder-classes": (str(folder), {"classes": [2, 0]}),
        "synthetic": ("synthetic", {"count": 9, "size": 16}),  # every range full: moved into place as it is
        "saved": (str(tmp_path / "saved"), {}),
    }
    for name, (source, options) in runs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the broken image's
            one = prepare.run(source, str(tmp_path / name / "1"), samples_per_shard=2, workers=1, **options)
            two = prepare.run(source, str(tmp_path / name / "2"), samples_per_shard=2, workers=2, **options)
        assert one == two and one["shards"] >= 3, name
        assert files_of(tmp_path / name / "1") == files_of(tmp_path / name / "2"), name
    assert range_writes == [2] * len(runs)
    assert json.loads((tmp_path / "folder" / "2" / "summary.json").read_text())["unreadable"] == [str(folder / "dog" / "broken.jpg")]
    assert [label_of(s) for s in read_shards(tmp_path / "folder-classes" / "2").values()].count(1) == 4  # the 4 cats


def jpeg_bytes(colour, size=(20, 12)) -> bytes:
    return encoded(Image.new("RGB", size, colour), "JPEG")


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def class_tar(name: str, count: int, colour) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(count):
            add(tar, f"{name}_{i}.JPEG", jpeg_bytes(colour))
    return buffer.getvalue()


COLOURS = {"n01440764": (220, 20, 20), "n01443537": (20, 220, 20), "n01484850": (20, 20, 220)}


def test_imagenet_training_archive_is_read_in_place_and_a_damaged_inner_tar_is_skipped(tmp_path, capsys, small_sources_use_workers):
    # ILSVRC2012_img_train.tar's layout: one uncompressed tar per class, named by its WordNet id, holding JPEGs.
    archive = tmp_path / "ILSVRC2012_img_train.tar"
    damaged = bytearray(class_tar("n01443537", 4, COLOURS["n01443537"]))
    header = damaged.find(b"n01443537_2.JPEG")  # the third member's header: the first two stay readable
    damaged[header:header + 100] = b"\x07" * 100
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tar:
        add(tar, "n01440764.tar", class_tar("n01440764", 5, COLOURS["n01440764"]))
        add(tar, "n01443537.tar", bytes(damaged))
        add(tar, "n01484850.tar", class_tar("n01484850", 3, COLOURS["n01484850"]))

    with pytest.warns(UserWarning) as warned:
        assert launch.main(["prepare", str(archive), "--out", str(tmp_path / "out"), "--samples-per-shard", "3",
                            "--workers", "2"]) == 0
    said = [str(w.message) for w in warned]
    assert any(f"reading {archive}:n01443537.tar stopped at a damaged header" in s and "keeping the 2 files" in s for s in said)
    assert "wrote 10 samples (3 classes, skipped 1 unreadable) in 4 shards" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["class_names"] == sorted(COLOURS) and summary["skipped"] == 1
    samples = read_shards(tmp_path / "out")
    assert sorted(samples) == sorted([f"n01440764_n01440764_{i}" for i in range(5)] + [f"n01443537_n01443537_{i}" for i in range(2)]
                                     + [f"n01484850_n01484850_{i}" for i in range(3)])
    for key, sample in samples.items():
        cls = summary["class_names"][label_of(sample)]
        assert key.startswith(cls) and sample["jpg"] == jpeg_bytes(COLOURS[cls])  # stored as they were, byte for byte
    assert len({label_of(s) for s in list(samples.values())[:3]}) > 1  # shards mix classes

    # A tar of class folders, and --class-names as for any source; a compressed archive is one line.
    folders = tmp_path / "folders.tar"
    with tarfile.open(folders, "w") as tar:
        for i, cls in enumerate(["b", "a", "b"]):
            add(tar, f"train/{cls}/{i}.jpg", jpeg_bytes((i * 90, 0, 0)))
    summary = prepare.run(str(folders), str(tmp_path / "folders"), class_names=["first", "second"], workers=1)
    assert summary["class_names"] == ["first", "second"] and summary["samples"] == 3
    assert {key: label_of(s) for key, s in read_shards(tmp_path / "folders").items()} == {"train_b_0": 1, "train_a_1": 0, "train_b_2": 1}
    (tmp_path / "train.tar.gz").write_bytes(gzip.compress(folders.read_bytes()))
    with pytest.raises(SourceError, match=r"train.tar.gz is compressed; .* decompress it first"):
        prepare.run(str(tmp_path / "train.tar.gz"), str(tmp_path / "gz"))


def test_an_error_in_one_worker_ends_them_all_with_one_line(tmp_path, capsys, small_sources_use_workers):
    folder = tmp_path / "images"
    for i in range(8):
        (folder / f"class{i % 4}").mkdir(parents=True, exist_ok=True)
        synthetic_image(i, 16)[0].save(folder / f"class{i % 4}" / f"{i}.png")
    capsys.readouterr()
    assert launch.main(["prepare", str(folder), "--out", str(tmp_path / "out"), "--class-names", "a,b",
                        "--samples-per-shard", "2", "--workers", "2"]) == 2
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("error: sample class") and "but --class-names names 2 classes" in lines[0]
    assert not multiprocessing.active_children() and not (tmp_path / "out").exists()


def as_a_terminal_starts_it() -> None:
    """Ctrl-C at its default in the child, as in a command typed at a terminal: a suite started in the background
    (`pytest &` in a script, or under nohup) ignores SIGINT, and a child inherits that and ignores its Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_and_a_second_prepare_leave_out_as_it_was(tmp_path):
    out = tmp_path / "out"
    prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=2, workers=1)
    before = files_of(out)
    writer = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "prepare", "synthetic", "--out", str(out),
                               "--overwrite", "--count", "100000", "--size", "64", "--samples-per-shard", "200",
                               "--workers", "2"], cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=as_a_terminal_starts_it)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(".partial-shards-*/inputs-*.part")):  # the workers are writing
            assert writer.poll() is None and time.monotonic() < deadline, writer.communicate()
            time.sleep(0.2)
        with pytest.raises(SourceError, match=rf"another prepare \(pid {writer.pid}\) is writing shards into {out}; wait"):
            prepare.run("synthetic", str(out), count=4, size=16, overwrite=True, workers=1)
        os.killpg(writer.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole process group
        writer.communicate(timeout=60)
        while time.monotonic() < deadline:  # every worker (and the process that starts them) ends
            try:
                os.killpg(writer.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("processes of the interrupted prepare are still running")
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
    assert writer.returncode != 0 and files_of(out) == before  # the old set, whole, and no partial folder or lock
    assert prepare.run("synthetic", str(out), count=6, size=16, overwrite=True, workers=1)["samples"] == 6


def test_the_lock_on_out_goes_with_a_process_that_dies(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(out / '.prepare.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242'); print('held', flush=True)\n"
                               "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SourceError, match=r"another prepare \(pid 4242\)"):
            prepare.run("synthetic", str(out), count=4, size=16, workers=1)
        assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]
    finally:
        holder.kill()
        holder.wait()
    assert prepare.run("synthetic", str(out), count=4, size=16, workers=1)["samples"] == 4  # killed: the lock is gone
    assert sorted(p.name for p in out.iterdir()) == ["shard-000000.tar", "summary.json"]


def test_a_full_disk_in_a_worker_leaves_out_as_it_was(tmp_path):
    import resource

    out = tmp_path / "out"
    prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=2, workers=1)
    before = files_of(out)

    def small_files():  # a file may grow to 64 KiB: a range of 40 64-px JPEGs does not fit, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "prepare", "synthetic", "--out", str(out),
                             "--overwrite", "--count", "2000", "--size", "64", "--samples-per-shard", "40", "--workers", "2"],
                            cwd=ROOT, preexec_fn=small_files, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert result.returncode == 2 and errors == [
        f"error: cannot write the shards in {out} (File too large); the partial shards were removed and {out} is as it "
        f"was: free some space or choose another output directory (--out)"], result.stderr
    assert files_of(out) == before


def test_short_side_decodes_large_jpegs_at_a_reduced_scale_and_keeps_the_size_exact(tmp_path, monkeypatch):
    (tmp_path / "images").mkdir()
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1200, 1600, 3), dtype=np.uint8))
    photo.save(tmp_path / "images" / "photo.jpg", quality=90)
    scales, real_draft = [], JpegImagePlugin.JpegImageFile.draft

    def draft(self, mode, size):  # the size the JPEG will decode at
        found = real_draft(self, mode, size)
        scales.append(self.size)
        return found

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", draft)
    prepare.run(str(tmp_path / "images"), str(tmp_path / "out"), short_side=256, workers=1)
    stored = Image.open(io.BytesIO(read_shards(tmp_path / "out")["photo"]["jpg"]))
    assert stored.size == (341, 256)
    assert scales == [(400, 300)]  # decoded at 1/4 scale, once


class FailingReader:
    """A source's reader (picklable, so worker processes can run it) whose input 5 fails as no image should."""

    def __call__(self, start=0, stop=None):
        for i in range(*slice(start, stop).indices(8)):
            if i == 5:
                raise RuntimeError("the decoder crashed")
            yield Sample(f"k{i}", encoded(Image.new("L", (4, 4), i), "PNG"), "png", i % 2, f"/data/k{i}.png")


def test_an_unexpected_error_in_a_worker_is_one_line_naming_the_input(tmp_path, monkeypatch, capsys, small_sources_use_workers):
    monkeypatch.setattr(prepare, "SOURCES", [(lambda r: r.source == "failing",
                                              lambda r: Source("failing source", 8, FailingReader(), indexed=True)),
                                             *prepare.SOURCES])
    assert launch.main(["prepare", "failing", "--out", str(tmp_path / "out"), "--samples-per-shard", "2", "--workers", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: cannot prepare input 5 of failing source (RuntimeError: the decoder crashed); fix or remove that input")
    assert not multiprocessing.active_children() and not (tmp_path / "out").exists()


class KillingReader:
    """A reader whose worker process is killed at input 3, as the system kills one that runs out of memory."""

    def __call__(self, start=0, stop=None):
        for i in range(*slice(start, stop).indices(8)):
            if i == 3 and multiprocessing.parent_process() is not None:  # only ever in a worker, never in pytest
                os.kill(os.getpid(), signal.SIGKILL)
            yield Sample(f"k{i}", encoded(Image.new("L", (4, 4), i), "PNG"), "png", i % 2)


def test_a_killed_worker_ends_the_others_with_one_line(tmp_path, small_sources_use_workers):
    with pytest.raises(SourceError, match=r"a prepare worker process was killed by signal 9 \(out of memory, if it was "
                                          r"SIGKILL\) while writing killed source; no shard was kept: run prepare again"):
        shardwriter.write_shards(Source("killed source", 8, KillingReader(), indexed=True), tmp_path / "out",
                            samples_per_shard=2, workers=2)
    assert not multiprocessing.active_children() and not (tmp_path / "out").exists()


def start_prepare_writing(out: Path) -> subprocess.Popen:
    """A prepare with two workers in its own process group, as a scheduler starts a job, once its workers write."""
    writer = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "prepare", "synthetic", "--out", str(out),
                               "--overwrite", "--count", "100000", "--size", "64", "--samples-per-shard", "200",
                               "--workers", "2"], cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob(".partial-shards-*/inputs-*.part")):
        assert writer.poll() is None and time.monotonic() < deadline, writer.communicate()
        time.sleep(0.2)
    return writer


def group_ends(group: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-process", "to-the-group"])
def test_sigterm_stops_the_workers_and_leaves_out_as_it_was(tmp_path, to_group):
    out = tmp_path / "out"
    prepare.run("synthetic", str(out), count=4, size=16, samples_per_shard=2, workers=1)
    before = files_of(out)
    writer = start_prepare_writing(out)
    try:
        (os.killpg if to_group else os.kill)(writer.pid, signal.SIGTERM)  # as timeout, systemd or a scheduler send it
        _, err = writer.communicate(timeout=60)
        assert group_ends(writer.pid), "processes of the stopped prepare are still running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(writer.pid, signal.SIGKILL)
    assert writer.returncode == 143 and err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM; the partial shards were removed and {out} is as it was (prepare does not resume: run it "
        f"again to write the shards)"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == sorted(before) and files_of(out) == before


def test_a_killed_prepare_takes_its_workers_along_and_the_next_removes_what_it_left(tmp_path):
    out = tmp_path / "out"
    writer = start_prepare_writing(out)
    try:
        os.kill(writer.pid, signal.SIGKILL)  # the process alone, as the kernel's out-of-memory killer does
        writer.communicate(timeout=60)
        assert group_ends(writer.pid), "the workers of a killed prepare are still running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(writer.pid, signal.SIGKILL)
    assert len(list(out.glob(".partial-shards-*"))) == 1
    with pytest.warns(UserWarning, match=r"removed 1 folder\(s\) of partial shards \(\.partial-shards-\w+, \.\.\.\) "
                                         rf"that a prepare killed before it finished left in {out}"):
        assert prepare.run("synthetic", str(out), count=4, size=16, workers=1)["samples"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["shard-000000.tar", "summary.json"]


def test_macos_metadata_and_extras_in_an_imagenet_archive_are_not_damage(tmp_path, capsys):
    # As an archive packed on a Mac arrives: `._NAME` AppleDouble files beside the class tars and the images, plus
    # the files that come with ImageNet (a README, the synset list, an empty placeholder tar).
    archive = tmp_path / "ILSVRC2012_img_train.tar"
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        add(tar, "n01443537_0.JPEG", jpeg_bytes(COLOURS["n01443537"]))
        add(tar, "._n01443537_0.JPEG", b"\x00\x05\x16\x07 AppleDouble")
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tar:
        add(tar, "._n01440764.tar", b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(100))
        add(tar, "n01440764.tar", class_tar("n01440764", 2, COLOURS["n01440764"]))
        add(tar, "n01443537.tar", inner.getvalue())
        add(tar, "README.txt", b"ImageNet")
        add(tar, "LOC_synset_mapping.txt", b"n01440764 tench, Tinca tinca\nn01443537 goldfish, Carassius auratus\n")
        add(tar, "devkit.tar", b"")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        summary = prepare.run(str(archive), str(tmp_path / "out"), workers=1)
    # No warning of damage or of unreadable inputs; the one that 2 synsets are not ImageNet's 1000 ids is expected.
    assert [str(w.message) for w in warned if "ImageNet synsets, not 1000" not in str(w.message)] == []
    assert summary["samples"] == 3 and summary["skipped"] == 0 and summary["class_names"] == ["n01440764", "n01443537"]


def test_a_small_folder_is_written_without_starting_workers(tmp_path, range_writes):
    folder = tmp_path / "images"
    for i in range(150):  # the size of folder that took 25-30 s on a busy machine, most of it starting workers
        (folder / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        synthetic_image(i, 16)[0].save(folder / f"class{i % 3}" / f"{i}.jpg")
    summary = prepare.run(str(folder), str(tmp_path / "out"), samples_per_shard=5, workers=2)
    assert summary["samples"] == 150 and summary["shards"] == 30
    assert range_writes == [] and not multiprocessing.active_children()
