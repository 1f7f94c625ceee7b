import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml

from mpp.config import ConfigError, TrainConfig, config_reference, load_config, settings, validate_config
from mpp.model.vit import VIT_SIZES, build_vit
from mpp.model.registry import OBJECTIVES, TARGETS
from pipelines import cli

ROOT = Path(__file__).parents[1]
# configs/compare/ holds comparison plans (their own schema, with run configs inside); the rest are run configs.
COMPARE_CONFIGS = sorted(ROOT.glob("configs/compare/*.yaml"))
CONFIGS = sorted(set(ROOT.glob("configs/**/*.yaml")) - set(COMPARE_CONFIGS))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_the_library_loads_every_shipped_run_config_without_the_pipelines():
    # A user scripting with `mpp` alone (no command line) reads the shipped configs: the library registers its own
    # parts' settings on import. A child process, since this one imported the pipelines (conftest).
    code = ("import sys, mpp.config\n"
            f"for path in {[str(p) for p in CONFIGS]!r}: mpp.config.load_config(path)\n"
            "assert not any(name == 'pipelines' or name.startswith(('pipelines.', 'mpp.pipelines')) for name in sys.modules)\n"
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", COMPARE_CONFIGS, ids=lambda p: p.name)
def test_shipped_comparison_plans_load(path):
    from pipelines.comparison.plan import load_compare_config

    if path.name == "public_weights.yaml":  # its weights are downloaded by the user (tests/test_compare_weights.py makes some)
        with pytest.raises(ConfigError, match=r"^arm 'vit-public' starts from weights at weights/vit-base-patch16-224-in21k, which does not exist; download them"):
            load_compare_config(path, [])
        return
    load_compare_config(path, [])


def test_overrides_win_over_file_and_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 50\n  warmup_steps: 5\nmodel:\n  name: vit_s16\n")
    cfg = load_config(path, ["train.steps=70", "model.image_size=32"])
    assert (cfg.train.steps, cfg.train.warmup_steps, cfg.model.patch_size, cfg.model.image_size) == (70, 5, 16, 32)
    assert cfg.train.batch_size == 64  # default


def test_mixed_precision_no_is_not_read_as_false(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  mixed_precision: no\n")
    assert load_config(path, []).train.mixed_precision == "no"
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"


@pytest.mark.parametrize("overrides, message", [
    (["train.stpes=3"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    (["model.image_size=30", "model.patch_size=4"], "not divisible by model.patch_size 4"),
    # a hybrid's patch is its stem's stride, which the user may never have set
    (["model.stem=resnet", "model.stem_layers=[1]", "model.image_size=18"],
     "model.image_size 18 is not divisible by the ResNet stem's stride 4 (model.patch_size, from the 1 stages in model.stem_layers)"),
    (["model.name=vit_b16", "model.patch_size=8"], "implies patch size 16"),
    (["train.batch_size=zero"], "invalid value for 'train.batch_size'"),
    (["mpp.target=edges"], "invalid value for 'mpp.target'"),
    (["mpp.target=edges"], "invalid value for 'mpp.target': Input should be 'color', 'color4x4' or 'pixels' (got 'edges')"),
    (["objective=edges"], "invalid value for 'objective': Input should be 'mpp' or 'supervised' (got 'edges')"),
    (["mpp.mask_prob=0.95"], "mpp.mask_prob + mpp.random_prob must be at most 1"),
    (["steps"], "not of the form key=value"),
    (["train.betas=[0.9,1.5]"], "train.betas must both lie in [0, 1), got [0.9, 1.5]"),
    (["mpp.target=color4x4", "model.image_size=24", "model.patch_size=6"], "model.patch_size must be divisible by 4, got 6"),
    (["mpp.target=color4x4", "mpp.color_bits=8", "model.width=64", "model.heads=2"],
     "needs a 268,435,456-way prediction head of 69.8 GB (width 64); heads over 1.0 GB are refused"),
    (["train.steps=20", "train.warmup_steps=20"], "train.warmup_steps (20) must be smaller than train.steps (20)"),
])
def test_bad_config_is_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_yaml_whose_top_level_is_a_list_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- train.steps: 3\n- model.depth: 2\n")
    with pytest.raises(ConfigError, match="holds a list at its top level; it must be a mapping of sections"):
        load_config(path)


@pytest.mark.parametrize("text, held", [("hello\n", "the single value 'hello'"), ("42\n", "the single value 42"),
                                        ("true\n", "the single value True")])
def test_yaml_holding_a_single_value_is_refused_as_such(tmp_path, text, held):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:  # was "not valid YAML (OSError)", or "unknown config key 'hello'"
        load_config(path)
    assert str(err.value) == (f"config file {path} holds {held} at its top level; it must be a mapping of sections "
                              f"(train:, model:, ...) as in the shipped configs (`mpp --list-configs` shows where they are)")


@pytest.mark.parametrize("steps, warmup", [(1, 0), (20, 2), (600, 60), (5000, 100)])
def test_unset_warmup_is_a_tenth_of_the_run_at_most_100(steps, warmup):
    assert load_config(None, [f"train.steps={steps}"]).train.warmup_steps == warmup
    assert load_config(ROOT / "configs" / "pretrain" / "default.yaml", [f"train.steps={steps}"]).train.warmup_steps == warmup


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name, width, depth, heads", [
    ("vit_ti", 192, 12, 3), ("vit_s", 384, 12, 6), ("vit_b", 768, 12, 12), ("vit_l", 1024, 24, 16), ("vit_h", 1280, 32, 16)])
def test_paper_sizes(name, width, depth, heads):
    size = VIT_SIZES[name]
    assert (size.width, size.depth, size.heads) == (width, depth, heads)


def test_vit_shapes_and_init():
    vit = build_vit("vit_ti", 32, 4, depth=2)
    out = vit(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 1 + 64, 192)
    assert vit.blocks[0].mlp[0].out_features == 4 * 192
    assert torch.all(vit.blocks[0].attn.qkv.bias == 0)
    assert vit.patch_embed.proj.weight.abs().max() <= 2 * 0.02 + 1e-6  # truncated normal, std 0.02
    assert build_vit("vit_b16", 224, depth=1).num_patches == 196  # one block: the patch grid is what is checked


def test_every_config_key_has_a_meaning_and_the_generated_reference_is_current():
    from pipelines.reference import REFERENCE, reference_markdown

    assert [key for key, _, description in config_reference() if not description] == []
    assert REFERENCE.read_text() == reference_markdown(), "docs/reference.md is stale: run python -m pipelines.reference"


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "knn"])
def test_help_lists_every_config_key_with_its_default_and_meaning(stage, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per meaning
    with pytest.raises(SystemExit) as done:
        cli.main([stage, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for key, default, meaning in config_reference():
        assert f"\n  {key} = {default}\n      {meaning}\n" in shown, key
    assert "train.optimizer = \"adamw\"\n      Optimiser: adam, adamw or sgd (with momentum).\n" in shown


def test_print_config_shows_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    args = ["--config", "supervised", "train.global_batch_size=128", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(["pretrain", *args, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    resolved = load_config(ROOT / "configs" / "pretrain" / "supervised.yaml", args[2:])
    assert validate_config(printed) == resolved
    assert printed["objective"] == "supervised" and printed["train"]["steps"] == 600  # from the file
    assert (printed["train"]["global_batch_size"], printed["train"]["batch_size"]) == (128, 64)  # as held, not split
    assert not (tmp_path / "run").exists()
    assert cli.main(["compare", "--config", "tiny", "arms=[mpp]", "--print-config"]) == 0
    plan = yaml.safe_load(capsys.readouterr().out)
    assert plan["arms"] == ["mpp"] and plan["output_dir"] == "runs/compare/tiny"


@pytest.mark.parametrize("line", [
    ["pretrain", "train.steps=20", "--resume", "train.steps=30", "output_dir=runs/a"],
    ["finetune", "train.steps=20", "--ckpt", "runs/base", "train.steps=30", "output_dir=runs/a"],
    ["finetune", "train.steps=20", "--overwrite", "train.steps=30", "--config", "default", "output_dir=runs/a"],
    ["knn", "--ckpt", "runs/base", "train.steps=20", "--config", "f.yaml", "train.steps=30", "output_dir=runs/a"],
])
def test_overrides_are_taken_wherever_they_stand_on_the_line(line):
    assert cli.parse_args(line).overrides == ["train.steps=20", "train.steps=30", "output_dir=runs/a"]  # in order: the last wins


def test_resume_auto_is_named_as_written_when_refused_beside_overwrite(capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["pretrain", "--resume", "auto", "--overwrite"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "argument --overwrite: not allowed with argument --resume auto" in err, err


def test_an_unknown_flag_among_overrides_is_still_refused(capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["pretrain", "train.steps=20", "--steps", "30"])
    assert done.value.code == 2 and "unrecognized arguments: --steps" in capsys.readouterr().err


def test_readme_contents_link_every_section_by_its_github_anchor():
    readme = (ROOT / "README.md").read_text()
    headings = [h for h in re.findall(r"^## (.+)$", readme, re.M) if h != "Contents"]
    contents = readme.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    anchor = lambda heading: re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")  # GitHub's rule
    assert re.findall(r"^- \[(.+)\]\(#(.+)\)$", contents, re.M) == [(h, anchor(h)) for h in headings]


def allowed_values(annotation) -> list[str]:
    """The words a key with a Literal among its types admits, as YAML spells them (with bool: true, false); [] for a
    key without one (a number, a path, a plain flag)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(v) for v in typing.get_args(annotation)]
    options = typing.get_args(annotation)
    words = [v for arg in options if typing.get_origin(arg) is typing.Literal for v in typing.get_args(arg)]
    return [*map(str, words), *(["true", "false"] if words and bool in options else [])]


def test_every_enumerated_key_names_its_values_in_its_description():
    registries = {"objective": OBJECTIVES, "mpp.target": TARGETS}  # validated against a registry, not a Literal
    for key, field in settings():
        values = list(registries.get(key, ())) or allowed_values(field.annotation)
        missing = [v for v in values if not re.search(rf"\b{re.escape(v)}\b", field.description)]
        assert not missing, f"{key}'s description does not name {missing}"


def test_a_micro_batch_splits_the_global_batch_into_accumulation_steps():
    paper = TrainConfig(global_batch_size=4096, micro_batch_size=128)
    assert [(t.batch_size, t.grad_accum) for t in (paper.for_processes(n) for n in (1, 4, 32))] == [(128, 32), (128, 8), (128, 1)]
    with pytest.raises(ConfigError, match=r"train.global_batch_size 4096 is not a whole number of micro-batches of 128 "
                                          r"images on each of 3 process\(es\)"):
        paper.for_processes(3)
    with pytest.raises(ConfigError, match=r"train.global_batch_size 4096 is not a whole number .* on each of 64 process"):
        paper.for_processes(64)  # 64 images each: fewer than one micro-batch
    without = TrainConfig(global_batch_size=4096, grad_accum=2)  # the accumulation given, the batch derived
    assert (without.for_processes(4).batch_size, without.for_processes(4).grad_accum) == (512, 2)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size splits train.global_batch_size, which is not set"):
        TrainConfig(micro_batch_size=32).for_processes(1)


def test_epochs_come_to_steps_at_the_global_batch_and_leave_an_unset_warmup_to_them():
    paper = TrainConfig(epochs=2, global_batch_size=64, micro_batch_size=16)
    assert paper.warmup_steps is None  # unknown until the steps are
    run = paper.with_epochs(1000, processes=2)  # 2 x 1000 / 64 = 31.25 -> 32 steps, 2 x 16 images x 2 accumulations
    assert (run.steps, run.warmup_steps, run.epochs) == (32, 3, 2)
    assert TrainConfig(steps=70).with_epochs(1000, processes=1).steps == 70  # without epochs: as it is
    with pytest.raises(ConfigError, match=r"train.warmup_steps \(40\) must be smaller than the 32 steps train.epochs \(2\)"):
        TrainConfig(epochs=2, global_batch_size=64, warmup_steps=40).with_epochs(1000, processes=1)
    shipped = load_config(ROOT / "configs" / "pretrain" / "default.yaml", ["train.epochs=3"])
    assert (shipped.train.epochs, shipped.train.warmup_steps) == (3, None)  # its steps: 600 no longer set the length


def test_grad_checkpointing_gives_the_same_loss_and_gradients():
    # Stochastic depth on: the recomputed forward must drop the same residual branches as the first one.
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        vit = build_vit("vit_ti", 16, 4, width=32, depth=3, heads=2, drop_path=0.3, grad_checkpointing=checkpointing)
        images = torch.randn(4, 3, 16, 16)
        torch.manual_seed(1)
        loss = vit(images).square().mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in vit.parameters()]))
    (loss, grads), (checkpointed_loss, checkpointed_grads) = results
    assert torch.equal(loss, checkpointed_loss)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads, checkpointed_grads))


def test_a_flag_named_like_a_config_key_says_the_override_it_means(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["pretrain", "--epochs", "1"])
    assert done.value.code == 2
    assert "unrecognized arguments: --epochs; config keys are set as key=value, not as flags: train.epochs=1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["--list-configs"], ["nosuchstage"], ["pretrain", "--help"],
                                  ["finetune", "--help"], ["pretrain", "--print-config"], ["finetune", "--print-config"],
                                  ["pretrain", "--epochs", "1"], ["pretrain", "train.stepz=3"], ["pretrain", "mpp.target=grey"],
                                  ["pretrain", "model.patch_size=5"], ["finetune", "--config", "nosuch.yaml"]])
def test_help_and_command_line_errors_do_not_load_torch(argv):
    """What makes `mpp --help` take seconds is loading torch; these answers need none of it: the registries declare
    every part's settings without it (mpp.model.registry, pipelines.evaluations.registry)."""
    import subprocess
    import sys

    probe = f"import sys\nfrom pipelines import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines()[-1] == "False", done.stderr


def test_finetune_print_config_leaves_out_the_pretraining_objective(capsys):
    assert cli.main(["finetune", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert "objective" not in printed and printed["finetune"]["pool"] == "cls"


def test_the_same_seed_gives_the_same_weights_in_every_process():
    """Two processes of one run start from one seed; their weights must not depend on the process's hash seed (a set's
    iteration order does), or DDP's one process and two-process runs start apart. Each process builds both position
    embeddings (one interpreter start per hash seed, not per embedding)."""
    import subprocess
    import sys

    probe = ("import torch\nfrom mpp.model.vit import build_vit\n"
             "for pos_embed in ('learned', 'learned_2d'):\n"
             "    torch.manual_seed(0)\n"
             "    v = build_vit('vit_ti', 16, 4, width=32, depth=2, heads=2, pos_embed=pos_embed)\n"
             "    print(pos_embed, sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(v.parameters())))")
    sums = {subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(sums) == 1 and len(next(iter(sums)).splitlines()) == 2, sums
