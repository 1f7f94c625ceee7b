"""docs/extending.md as a contributor follows it: each part's module and registry lines are taken from the guide,
written to a file of their own and registered, and each part shows everywhere the guide says (--help, the generated
reference, the charts, HParams, results.json, the model card, a tiny pretraining run that uses it)."""

import importlib.util
import re
import sys

import pytest

import pipelines.commands
import pipelines.evaluations.registry
import mpp.model.registry
from mpp.config import config_reference, load_config
from pipelines import cli
from pipelines.reference import REFERENCE, reference_markdown
from pipelines.stages import pretrain

from conftest import ROOT, TINY, exported_card, where_metrics_show
from test_doc_commands import fences, problems

GUIDE = ROOT / "docs" / "extending.md"


def guide_block(first_line: str) -> str:
    """The body, after its first line, of the guide's python block that begins with `first_line`."""
    blocks = [body for language, _, body in fences(GUIDE.read_text()) if language == "python" and body.startswith(first_line + "\n")]
    assert len(blocks) == 1, f"docs/extending.md has {len(blocks)} python blocks beginning {first_line!r}"
    return blocks[0].split("\n", 1)[1]


def load_module(monkeypatch, tmp_path, name: str):
    """The guide's module `name` (mpp.model.grey), written to a file and imported under its name, as the registry's
    "module:name" imports it."""
    path = tmp_path / f"{name.rsplit('.', 1)[1]}.py"
    path.write_text(guide_block(f"# {name.replace('.', '/')}.py"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def register(monkeypatch, registry_module, name: str, *blocks: str) -> None:
    """Runs the guide's blocks for `registry_module` (`# FILE, beside ...:` adds code there, `# FILE, in NAME:` holds
    lines of the dict NAME) in that module's namespace, and adds the lines to the dict."""
    namespace = dict(vars(registry_module))
    path = registry_module.__name__.replace(".", "/") + ".py"
    for block in blocks:
        code = guide_block(f"# {path}, {block}:")
        if block.startswith("in "):
            for key, entry in eval("{" + code + "}", namespace).items():
                monkeypatch.setitem(getattr(registry_module, name), key, entry)
        else:
            exec(code, namespace)


@pytest.fixture
def parts(monkeypatch, tmp_path):
    """The guide's three parts, registered as the guide says."""
    for module in ("mpp.model.grey", "pipelines.evaluations.spread", "pipelines.stages.params"):
        load_module(monkeypatch, tmp_path, module)
    register(monkeypatch, mpp.model.registry, "TARGETS", "in TARGETS")
    register(monkeypatch, pipelines.evaluations.registry, "EVALUATORS", "beside the imports", "in EVALUATORS")
    register(monkeypatch, pipelines.commands, "COMMANDS", "in COMMANDS")


def help_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_three_parts_show_in_help_and_the_reference_which_is_then_stale(parts, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per meaning
    keys = {key: meaning for key, _, meaning in config_reference()}
    assert "grey, its mean grey level at mpp.color_bits" in keys["mpp.target"]
    assert {"spread.every", "spread.images"} <= set(keys)
    assert "params              a saved backbone's parameters, by part" in help_of(capsys)
    shown = help_of(capsys, "params")
    assert "--per-block" in shown and "spread.images = 256" in shown and "grey, its mean grey level" in shown
    reference = reference_markdown()
    assert "| `params` | a saved backbone's parameters, by part |" in reference and "| `--per-block` |" in reference
    assert "| `spread.every` | `0` |" in reference and "grey, its mean grey level" in reference
    # The second file outside each part's module: the reference, regenerated (tests/test_config_model.py fails on it).
    assert reference != REFERENCE.read_text()


def test_the_parts_run_in_a_tiny_pretraining_and_the_command_reads_its_output(parts, tmp_path, make_shards, capsys):
    make_shards([40], size=32)
    run = tmp_path / "run"
    pretrain.run(load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={run}", *TINY, "mpp.target=grey",
                                    "spread.every=2", "spread.images=16", "train.steps=4", "train.warmup_steps=1",
                                    "train.batch_size=8", "log.every=2"]))
    assert "grey_acc=" in capsys.readouterr().err  # the progress bar
    shows = where_metrics_show(run, "pretrain")
    assert shows["charts"]["training"] == ["train/pretext_loss", "train/grey_acc"]
    assert shows["charts"]["feature spread"] == ["spread/feature_std"]  # its own group, placed by its order
    assert list(shows["charts"]) == ["training", "feature spread", "optimisation", "speed", "data"]
    assert {"train/grey_acc", "spread/feature_std"} <= set(shows["hparams"])
    final = shows["results"]["final"]
    assert 0 <= final["train/grey_acc"] <= 1 and final["spread/feature_std"] > 0
    assert load_config(run / "config.yaml").spread.images == 16
    card = exported_card(run, tmp_path / "hf")
    assert "its 3-bit mean grey level (8 classes)" in card and "spread/feature_std" in card
    capsys.readouterr()
    assert cli.main(["params", "--ckpt", str(run), "--per-block"]) == 0
    counted = dict(re.findall(r"^(\S+) +([\d,]+)$", capsys.readouterr().out, re.M))
    assert list(counted) == ["cls_token", "pos_embed", "patch_embed", "blocks.0", "blocks.1", "norm", "total"]
    assert counted["blocks.0"] == f"{12 * 64 * 64 + 13 * 64:,}"  # width 64: attention and MLP weights, biases, norms
    assert int(counted["total"].replace(",", "")) == sum(int(v.replace(",", "")) for k, v in counted.items() if k != "total")
    assert cli.main(["params", "--ckpt", str(tmp_path / "missing")]) == 2  # a mistake: one line, exit 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_guides_commands_parse_with_its_parts_registered(parts, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    tally = {"checked": 0}
    found = problems("docs/extending.md", GUIDE.read_text(), tally)
    capsys.readouterr()
    assert found == [] and tally["checked"] == 2, (found, tally)
