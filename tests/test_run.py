"""One way to start a run: start_run resolves the config once, for every stage, and changes nothing it is given; a
training run is planned once (plan_run) before it starts."""

import json

import pytest

from mpp.config import ConfigError, load_config
from pipelines import cli
from pipelines.stages import compare, pretrain
from pipelines.evaluations import fewshot, knn
from pipelines.run.plan import plan_run
from pipelines.run.start import Run, start_run

from conftest import TINY


def test_start_run_resolves_a_new_config_and_leaves_its_argument_alone(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", *TINY, "train.global_batch_size=12", "train.grad_accum=3"])
    run = start_run(cfg)
    assert cfg.train.batch_size == 64 and cfg.train.global_batch_size == 12  # as given
    assert run.cfg is not cfg and run.cfg.train.batch_size == 4 and run.global_batch == 12
    with pytest.raises(AttributeError):
        run.global_batch = 24
    accelerator, resolved, global_batch = run
    assert isinstance(run, Run) and accelerator is run.accelerator and (resolved, global_batch) == (run.cfg, 12)


def test_a_stage_without_global_batch_size_keeps_its_batch(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", *TINY, "train.batch_size=6", "train.grad_accum=2"])
    assert start_run(cfg, per_process_seed=False).global_batch == 12


@pytest.mark.parametrize("stage", [fewshot.run, knn.run])
def test_evaluation_commands_start_through_start_run_and_resolve_the_global_batch(tmp_path, stage):
    # A global batch that does not split is refused as in training, before the checkpoint is even looked at.
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", *TINY, "train.global_batch_size=8", "train.grad_accum=3"])
    with pytest.raises(ConfigError, match="train.global_batch_size 8 does not split evenly over 1 process"):
        stage(cfg, ckpt=str(tmp_path / "missing"))


def test_compare_reads_images_seen_from_the_run_not_from_its_config(tmp_path, make_shards):
    make_shards([40], size=32)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                             "train.steps=2", "train.warmup_steps=1", "train.global_batch_size=8", "train.grad_accum=2"])
    assert compare.pretrain_stage(cfg)["images_seen"] == 2 * 8
    assert cfg.train.batch_size == 64  # the stage's config is not resolved in place


def test_stages_in_one_process_share_its_accelerate_state_so_compare_refuses_plans_that_differ(tmp_path):
    # Why the refusal: the process's first Accelerator fixes the precision, and Accelerate has no public reset.
    start_run(load_config(None, [f"output_dir={tmp_path / 'a'}", "train.mixed_precision=no"]))
    start_run(load_config(None, [f"output_dir={tmp_path / 'b'}", "train.mixed_precision=no", "train.grad_accum=2"]))
    with pytest.raises(ValueError, match="AcceleratorState has already been initialized"):
        start_run(load_config(None, [f"output_dir={tmp_path / 'c'}", "train.mixed_precision=bf16"]))


def test_epochs_set_the_length_from_the_training_set_and_a_resume_keeps_it(tmp_path, make_shards, capsys):
    make_shards([40], size=32)
    (tmp_path / "shards" / "summary.json").write_text(json.dumps({"samples": 40, "labels": True, "classes": 10}))
    args = [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY, "train.batch_size=8",
            "train.steps=500", "train.epochs=1.5"]  # the length comes from the epochs, whatever train.steps says
    assert pretrain.run(load_config(None, args))["steps"] == 8  # ceil(1.5 x 40 / 8)
    assert "train.epochs 1.5 over 40 training images: 8 steps" in capsys.readouterr().out
    saved = load_config(tmp_path / "run" / "config.yaml")  # as fewshot, knn and export read it back
    assert (saved.train.steps, saved.train.epochs, saved.train.warmup_steps) == (8, 1.5, 0)

    pretrain.run(load_config(None, args), resume=True)  # the same command again: the same length, nothing changed
    out = capsys.readouterr().out
    assert "the run is finished (train.steps=8), nothing to train" in out and "changed settings" not in out
    pretrain.run(load_config(None, [*args, "train.epochs=2"]), resume=True)  # a longer run: 10 steps
    assert "resuming with changed settings, applied from step_00000008 on: train.epochs 1.5 -> 2.0, train.steps 8 -> 10" in capsys.readouterr().out


def test_epochs_without_the_training_set_size_or_in_a_comparison_are_refused(tmp_path, make_shards, capsys):
    make_shards([20], size=32)  # no summary.json
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY, "train.epochs=2"])
    with pytest.raises(ConfigError) as err:
        pretrain.run(cfg)
    assert str(err.value) == (f"train.epochs needs the number of training images, and data.shards ({tmp_path / 'shards'}) "
                              f"has no summary.json giving its samples beside {tmp_path / 'shards' / 'shard-000000.tar'}; give "
                              f"the length in train.steps instead "
                              f"(with train.epochs=null), or write the shards with `mpp prepare`, which writes one")
    assert not (tmp_path / "run").exists()
    assert cli.main(["compare", "--config", "tiny", "finetune.train.epochs=2", f"output_dir={tmp_path / 'cmp'}"]) == 2
    assert "set train.steps in the plan instead of train.epochs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train.steps is null and train.epochs is not set"):
        load_config(None, ["train.steps=null"])


def test_a_training_run_is_planned_once_from_its_config_the_process_count_and_its_run_directory(tmp_path, make_shards):
    make_shards([40], size=32)
    (tmp_path / "shards" / "summary.json").write_text(json.dumps({"samples": 40, "labels": True, "classes": 10}))
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                             "train.epochs=2", "train.global_batch_size=16", "train.grad_accum=2"])
    plan = plan_run(cfg, resume="auto", start=None, overwrite=False)
    # The length over the global batch (ceil(2 x 40 / 16)), the batch split per process, both in the settings too.
    assert (plan.processes, plan.global_batch, plan.cfg.train.steps, plan.cfg.train.batch_size) == (1, 16, 5, 8)
    assert (plan.settings["train.steps"], plan.settings["train.batch_size"], plan.settings["train.epochs"]) == (5, 8, 2.0)
    assert plan.run_dir.checkpoints == tmp_path / "run" / "checkpoints" and (plan.resume, plan.changes) == (False, [])
    assert cfg.train.batch_size == 64 and cfg.train.epochs == 2  # the config given is not changed


def test_the_plan_counts_the_training_images_once_with_or_without_epochs_and_refuses_nothing_it_cannot_count(
        tmp_path, make_shards):
    make_shards([30, 10], size=32)
    shards = f"data.shards={tmp_path / 'shards'}"
    plan = lambda *args: plan_run(load_config(None, [f"output_dir={tmp_path / 'run'}", *TINY, *args]), resume=False,
                                  start=None, overwrite=False)
    assert plan(shards).samples is None  # tars without summary.json: not counted, and the run still plans
    (tmp_path / "shards" / "summary.json").write_text(json.dumps({"samples": 40, "labels": True, "classes": 10}))
    assert plan(shards).samples == plan(shards, "train.epochs=1").samples == 40  # what the closing line's advice reads
    assert plan("data.synthetic_size=300").samples == 300  # the embedded corpus, before it is generated
    # Shards that are not there are the stage's loaders' to refuse, with their own line, once every rank has planned.
    assert plan(f"data.shards={tmp_path / 'missing'}").samples is None
