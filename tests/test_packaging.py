"""A non-editable install, as `pip install .` or a git URL gives a user: the `mpp` command and its shipped configs."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, write_test_shards

SOURCES = ("pyproject.toml", "README.md", "launch.py", "mpp", "pipelines", "configs")


def test_non_editable_install_ships_the_mpp_command_and_its_default_configs(tmp_path):
    pytest.importorskip("setuptools", reason="building without network (--no-build-isolation) needs setuptools here")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:  # a copy, so the build leaves nothing in the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, mpp = venv / "bin" / "python", venv / "bin" / "mpp"
    # This environment's site-packages lend torch & co., setuptools and pip itself (no network, no ensurepip), as
    # plain paths: its own .pth files (an editable mpp among them) are not run, and the venv's packages come first.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "lend.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)  # whatever the install needs must now come from the venv

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    help_text = subprocess.run([str(mpp), "pretrain", "--help"], cwd=elsewhere, capture_output=True, text=True, check=True,
                               timeout=120, env={**os.environ, "COLUMNS": "1000"}).stdout  # no wrapping inside the path
    default = re.search(r"\(default: (\S+)\)", help_text).group(1)
    assert default.startswith(str(venv)) and default.endswith("pretrain/default.yaml"), default
    assert Path(default).is_file()

    shards = write_test_shards(tmp_path / "shards", [40])
    run = subprocess.run([str(mpp), "pretrain", f"data.shards={shards[0]}", f"output_dir={tmp_path / 'run'}",
                          "data.num_workers=0", "model.width=32", "model.depth=1", "model.heads=2", "model.image_size=16",
                          "train.steps=2", "train.warmup_steps=1", "train.batch_size=8", "log.images_every=100"],
                         cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    used = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert used["data"]["crop_scale"] == [0.35, 1.0]  # from the shipped pretrain/default.yaml, not the schema's default
    assert "mpp pretraining" in run.stdout


def test_the_installed_command_is_what_resume_and_model_cards_repeat(monkeypatch):
    from pipelines.invocation import command_line, resume_command

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mpp", "pretrain", "train.steps=9"])
    assert command_line() == "mpp pretrain train.steps=9"
    assert resume_command() == "`mpp pretrain --resume train.steps=9`"
    assert command_line(["launch.py", "export", "--ckpt", "runs/x"]) == "python launch.py export --ckpt runs/x"
