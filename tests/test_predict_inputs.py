"""What `predict` is given that is not an image it can read: special files and links among the inputs, a folder it
cannot list, an --out it cannot write, a batch size of 0; each named for what it is, in one line or in the skipped
line, never a traceback and never after the work."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import launch
from mpp.model.checkpoint import save_weights
from mpp.model.objectives import Classification, finetuning_head
from mpp.model.vit import VisionTransformer

from conftest import CPU_ONLY, read_only

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def classifier(tmp_path):
    """A fine-tuned classifier's weights file, as a fine-tuning writes it (untrained: its classes do not matter here)."""
    model = Classification(VisionTransformer(16, 4, 32, 1, 2), finetuning_head(32, 3), export_head=True,
                           class_names=("cat", "dog", "owl"))
    save_weights(model, tmp_path / "clf.safetensors")
    return tmp_path / "clf.safetensors"


@pytest.fixture
def folder(tmp_path):
    """Two images, and beside them a FIFO, a link to itself and a link to nothing, all named as images."""
    pictures = tmp_path / "pictures"
    (pictures / "sub").mkdir(parents=True)
    for name in ("a.png", "sub/b.png"):
        Image.fromarray(np.full((20, 20, 3), 90, np.uint8)).save(pictures / name)
    os.mkfifo(pictures / "fifo.jpg")
    (pictures / "loop.jpg").symlink_to("loop.jpg")
    (pictures / "sub" / "dangling.jpg").symlink_to("gone.jpg")
    return pictures


def test_special_files_and_links_are_named_for_what_they_are(classifier, folder, capsys):
    for name, what in [("fifo.jpg", "is a FIFO (named pipe), not an image file"), ("loop.jpg", "is a symbolic link loop"),
                       ("sub/dangling.jpg", "is a symbolic link to gone.jpg, which does not exist")]:
        assert launch.main(["predict", "--ckpt", str(classifier), str(folder / name)]) == 2  # was "does not exist"
        assert capsys.readouterr().err.strip() == f"error: {folder / name} {what}; pass image files or folders holding them"

    assert launch.main(["predict", "--ckpt", str(classifier), str(folder), "--out", str(folder.parent / "p.json")]) == 0
    said = capsys.readouterr().err
    assert "for 2 image(s)" in said
    assert (f"3 file(s) could not be read as images and were skipped: {folder / 'fifo.jpg'} (a FIFO (named pipe), not "
            f"an image file); {folder / 'loop.jpg'} (a symbolic link loop); {folder / 'sub' / 'dangling.jpg'} (a symbolic "
            f"link to gone.jpg, which does not exist)") in said  # were passed over without a word
    written = json.loads((folder.parent / "p.json").read_text())
    assert len(written["predictions"]) == 2 and len(written["unreadable"]) == 3


def test_a_folder_that_cannot_be_listed_is_named(classifier, folder):
    locked = folder / "locked"
    locked.mkdir()
    shutil.copy(folder / "a.png", locked / "c.png")
    locked.chmod(0)
    # Root reads any folder: drop the capabilities that let it (as the red team did), so it meets the mode as a user does.
    without_root_reads = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    if without_root_reads and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no folder it cannot list")
    try:
        done = subprocess.run([*without_root_reads, sys.executable, str(ROOT / "launch.py"), "predict", "--ckpt",
                               str(classifier), str(folder)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **CPU_ONLY})
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert f"{locked} (a folder that cannot be listed: Permission denied)" in done.stderr  # was never mentioned


def test_an_out_that_cannot_be_written_is_refused_before_predicting(classifier, folder, tmp_path, capsys):
    restore = read_only(tmp_path / "ro")
    try:
        assert launch.main(["predict", "--ckpt", str(classifier), str(folder / "a.png"), "--out", str(tmp_path / "ro" / "p.json")]) == 2
    finally:
        restore()
    said = capsys.readouterr()
    assert said.err.startswith(f"error: the folder of --out {tmp_path / 'ro'} cannot be written (")  # was a traceback after the predictions
    assert said.err.endswith("); write --out into a writable directory\n") and said.err.count("\n") == 1
    assert "predicted" not in said.err


def test_a_batch_size_of_zero_is_refused(classifier, folder, capsys):
    assert launch.main(["predict", "--ckpt", str(classifier), str(folder / "a.png"), "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --batch-size must be at least 1, got 0"  # was one giant batch
