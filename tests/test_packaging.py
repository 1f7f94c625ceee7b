"""A non-editable install, as `pip install .` or a git URL gives a user: one top-level package, the `mpp` command and
its shipped configs, and messages that name what exists outside a checkout."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, write_test_shards

SHIPPED_PLANS = ", ".join(sorted(p.stem for p in (ROOT / "configs" / "compare").glob("*.yaml")))  # as the CLI lists them
SOURCES = ("pyproject.toml", "README.md", "launch.py", "mpp", "pipelines", "configs")
TINY_RUN = ["data.num_workers=0", "model.width=32", "model.depth=1", "model.heads=2", "model.image_size=16",
            "train.steps=2", "train.warmup_steps=1", "train.batch_size=8", "log.images_every=100"]
# Still importing `pipelines.*` by its checkout name, which an install does not have (they are being rewritten).


class Installed:
    """A venv holding mpp installed from a copy of the checkout (then deleted), and a folder outside any checkout."""

    def __init__(self, root: Path):
        self.venv, self.elsewhere = root / "venv", root / "elsewhere"
        self.python, self.mpp = self.venv / "bin" / "python", self.venv / "bin" / "mpp"

    def run(self, *args, check=True, timeout=300):
        return subprocess.run([str(a) for a in args], cwd=self.elsewhere, capture_output=True, text=True, check=check,
                              timeout=timeout, env={**os.environ, "COLUMNS": "1000"})  # no wrapping inside a path


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    pytest.importorskip("setuptools", reason="building without network (--no-build-isolation) needs setuptools here")
    root = tmp_path_factory.mktemp("install")
    source = root / "src"
    source.mkdir()
    for name in SOURCES:  # a copy, so the build leaves nothing in the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    env = Installed(root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env.venv)], check=True)
    # This environment's site-packages lend torch & co., setuptools and pip itself (no network, no ensurepip), as
    # plain paths: its own .pth files (an editable mpp among them) are not run, and the venv's packages come first.
    env.purelib = Path(subprocess.run([str(env.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    (env.purelib / "lend.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    subprocess.run([str(env.python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)  # whatever the install needs must now come from the venv
    env.elsewhere.mkdir()
    return env


def test_non_editable_install_ships_the_mpp_command_and_its_default_configs(installed, tmp_path):
    # One top-level name: no `pipelines` or `launch` beside other projects' modules.
    assert {p.name for p in installed.purelib.iterdir()} - {"lend.pth"} == {"mpp", "mpp-0.1.0.dist-info"}

    help_text = installed.run(installed.mpp, "pretrain", "--help").stdout
    default = re.search(r"\(see --list-configs; default: (\S+)\)", help_text).group(1)
    assert default.startswith(str(installed.venv)) and default.endswith("pretrain/default.yaml"), default
    assert Path(default).is_file()

    shards = write_test_shards(tmp_path / "shards", [40])
    run = installed.run(installed.mpp, "pretrain", f"data.shards={shards[0]}", f"output_dir={tmp_path / 'run'}", *TINY_RUN,
                        check=False)
    assert run.returncode == 0, run.stderr
    used = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert used["data"]["crop_scale"] == [0.35, 1.0]  # from the shipped pretrain/default.yaml, not the schema's default
    assert "mpp pretraining" in run.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["command"].startswith("mpp pretrain data.shards=")


def test_the_installed_package_runs_as_a_module_and_its_shipped_configs_go_by_name(installed, tmp_path):
    listed = installed.run(installed.python, "-m", "mpp.pipelines", "--list-configs").stdout  # accelerate launch -m's form
    assert re.search(rf"compare: {SHIPPED_PLANS}  \(in \S+/mpp/pipelines/configs/compare\)", listed), listed
    assert "pretrain: default, supervised, vit_b16_paper" in listed

    run = installed.run(installed.python, "-m", "mpp.pipelines", "pretrain", "--config", "supervised",
                        f"data.shards={write_test_shards(tmp_path / 'shards', [40])[0]}", f"output_dir={tmp_path / 'run'}",
                        *TINY_RUN, check=False)
    assert run.returncode == 0, run.stderr
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["objective"] == "supervised"
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["command"].startswith("python -m mpp.pipelines pretrain --config supervised ")


def test_installed_errors_name_the_installed_command_and_configs(installed, tmp_path):
    (tmp_path / "empty").mkdir()
    empty = installed.run(installed.mpp, "pretrain", f"data.shards={tmp_path / 'empty'}", check=False)
    assert empty.returncode == 2
    assert f"write shards into it with `mpp prepare SOURCE --out {tmp_path / 'empty'}`" in empty.stderr
    plan = installed.run(installed.mpp, "compare", "--config", "configs/compare/tiny.yaml", check=False)
    assert plan.returncode == 2
    assert plan.stderr.strip() == ("error: config file configs/compare/tiny.yaml does not exist; pass a YAML file or the "
                                   f"name of a shipped compare config ({SHIPPED_PLANS}; `mpp --list-configs` shows "
                                   "where they are)")


def test_every_installed_module_imports(installed):
    assert import_failures(installed) == {}


def test_the_installed_registries_name_parts_that_import(installed):
    # The registries name each part's implementation as "module:name", imported when a run builds it: installed, the
    # checkout's pipelines/ is mpp.pipelines, and the names must follow.
    script = ("from mpp.model.registry import OBJECTIVES, TARGETS, implementation\n"
              "from mpp.pipelines.evaluations.registry import EVALUATORS\n"
              "parts = [*(k.build for k in OBJECTIVES.values()), *(t.implementation for t in TARGETS.values()),\n"
              "         *(r.build for r in EVALUATORS.values())]\n"
              "print(sum(callable(implementation(part)) for part in parts), len(parts))\n")
    resolved, parts = installed.run(installed.python, "-c", script).stdout.split()
    assert resolved == parts == "11"


def import_failures(installed) -> dict[str, str]:
    """{module: error} of the installed mpp's modules that fail to import, each in turn in one interpreter."""
    if not hasattr(installed, "import_failures"):
        script = ("import importlib, json, pkgutil, mpp, mpp.pipelines\n"
                  "failed = {}\n"
                  "for package in (mpp, mpp.pipelines):\n"
                  "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
                  "        if info.name.endswith('__main__'):\n"
                  "            continue\n"
                  "        try:\n"
                  "            importlib.import_module(info.name)\n"
                  "        except Exception as exc:\n"
                  "            failed[info.name] = repr(exc)\n"
                  "print(json.dumps(failed))\n")
        installed.import_failures = json.loads(installed.run(installed.python, "-c", script).stdout)
    return installed.import_failures


def test_the_installed_command_is_what_resume_and_model_cards_repeat(monkeypatch):
    from pipelines.run.invocation import command_line, resume_command

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mpp", "pretrain", "train.steps=9"])
    assert command_line() == "mpp pretrain train.steps=9"
    assert resume_command() == "`mpp pretrain --resume train.steps=9`"
    assert command_line(["launch.py", "export", "--ckpt", "runs/x"]) == "python launch.py export --ckpt runs/x"


def test_a_module_run_is_repeated_as_a_module_run(monkeypatch, tmp_path):
    from mpp.errors import command
    from pipelines.run.invocation import command_line

    main = tmp_path / "site-packages" / "mpp" / "pipelines" / "__main__.py"
    main.parent.mkdir(parents=True)
    (main.parent.parent / "__init__.py").write_text("")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # under accelerate launch
    assert command_line([str(main), "pretrain", "train.steps=9"]) == "accelerate launch -m mpp.pipelines pretrain train.steps=9"
    monkeypatch.setattr(sys, "argv", [str(main), "pretrain"])
    assert command("prepare") == "python -m mpp.pipelines prepare"  # a hint names the single-process form
    monkeypatch.setattr(sys, "argv", ["launch.py", "pretrain"])
    assert command("prepare") == "python launch.py prepare"
    checkout = ROOT / "pipelines" / "__main__.py"
    assert command_line([str(checkout), "knn"]) == "accelerate launch -m pipelines knn"
