import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.config import ConfigError, Section, config_reference, load_config
from mpp.metrics import split_metric
from mpp.model.vit import normalize
from mpp.model.objectives import Objective, StepOutput
from mpp.model.registry import OBJECTIVES, ObjectiveKind
from mpp.training.runtime import Device, resolve_precision
from mpp.rundir import complete_checkpoints
from pipelines.stages import pretrain

from conftest import ACCELERATE_LAUNCH, ROOT, TINY, cpu_env, exported_card, reset_accelerator, where_metrics_show


def config(tmp_path, shards, *overrides):
    return load_config(None, [f"data.shards={shards}", f"output_dir={tmp_path / 'run'}", *TINY, *overrides])


def test_short_pretrain_learns_and_beats_the_colour_prior(tmp_path, make_shards):
    make_shards([100] * 4, size=32)
    cfg = config(tmp_path, tmp_path / "shards", "train.steps=200", "train.warmup_steps=10", "train.batch_size=32",
                 "train.lr=2e-3", "log.every=10", "train.checkpoint_every=200")
    results = pretrain.run(cfg)
    events = list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    assert events, "no TensorBoard events written"
    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0}).Reload()
    losses = [e.value for e in acc.Scalars("train/pretext_loss")]
    assert losses[-1] < losses[0] - 0.5, losses  # the first value already averages 10 steps of learning
    final = results["final"]
    assert final["train/color_acc"] > 2 * final["train/color_acc_prior"], results
    for tag in ("train/lr", "train/grad_norm", "train/perf/images_per_sec", "train/perf/data_wait_fraction"):
        assert tag in acc.Tags()["scalars"]
    assert acc.Tags()["images"] == ["train/panel"]  # crops, corrupted, target and predicted columns in one grid
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert "pos_embed" in weights and not any(k.startswith("head") for k in weights)
    assert (tmp_path / "run" / "config.yaml").read_text().count("vit_ti") == 1


class BrightnessConfig(Section):
    hparams = ("weight",)

    weight: float = Field(1.0, gt=0, description="Weight of the brightness loss.")


class MeanBrightness(Objective):
    """A test-local objective: regress each image's mean brightness from its [class] token (no panel, no own tokens)."""

    description = "regression of each image's mean brightness"

    def __init__(self, backbone, weight=1.0):
        super().__init__()
        self.backbone, self.weight = backbone, weight
        self.head = torch.nn.Linear(backbone.width, 1)

    def forward(self, images, labels=None):
        x = normalize(images)
        predicted = self.head(self.backbone(x)[:, 0]).squeeze(-1).float()
        return StepOutput(self.weight * F.mse_loss(predicted, x.mean(dim=(1, 2, 3))))

    def metrics(self, split):
        return [split_metric(split, "loss", "brightness error", headline=True, bar="loss")]

    def export_weights(self):
        return self.backbone.state_dict()


def test_a_registered_objective_is_chosen_by_the_config_and_shows_everywhere(tmp_path, make_shards, monkeypatch):
    # One class and one OBJECTIVES line: selectable, trained by the loop, its metric charted, in HParams, the progress
    # bar, results.json and the model card, validated by the pretext validation.
    monkeypatch.setitem(OBJECTIVES, "brightness", ObjectiveKind(
        lambda backbone, cfg, classes: MeanBrightness(backbone, cfg.brightness.weight), reads_labels=False,
        summary="mean brightness", section=lambda: ("brightness", BrightnessConfig)))
    with pytest.raises(ConfigError, match="Input should be 'mpp', 'supervised' or 'brightness' \\(got 'brightnes'\\)"):
        load_config(None, ["objective=brightnes"])
    reference = {key: meaning for key, _, meaning in config_reference()}
    assert "brightness (mean brightness)" in reference["objective"] and "brightness.weight" in reference
    make_shards([20] * 2, size=32)
    cfg = config(tmp_path, tmp_path / "shards", "objective=brightness", "train.steps=4", "train.warmup_steps=1",
                 "train.batch_size=4", "log.every=2", "log.images_every=2", f"data.val_shards={tmp_path / 'shards'}",
                 "eval.every=2", "eval.images=8", "eval.batch_size=4", "brightness.weight=2")
    pretrain.run(cfg)
    shows = where_metrics_show(tmp_path / "run", "pretrain")
    assert shows["values"]["brightness.weight"] == "2" and "mpp.target" not in shows["values"]  # MPP's columns blank
    assert shows["charts"]["training"] == ["train/loss"] and shows["charts"]["pretext validation"] == ["val/loss"]
    assert {"train/loss", "val/loss"} <= set(shows["hparams"]) and {"train/loss", "val/loss"} <= set(shows["results"]["final"])
    assert shows["results"]["description"] == MeanBrightness.description
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"images": 0}).Reload()
    assert not acc.Tags()["images"]  # no panel: the default draws none
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert "pos_embed" in weights and not any(k.startswith("head") for k in weights)
    card = exported_card(tmp_path / "run", tmp_path / "hf")
    assert f"**Objective**: {MeanBrightness.description} (pretraining" in card and "train/loss " in card


def test_resume_continues_to_the_same_weights(tmp_path, make_shards):
    make_shards([40] * 3, size=32)
    common = ["train.steps=6", "train.warmup_steps=2", "train.batch_size=8", "train.checkpoint_every=3",
              "train.keep_checkpoints=5", "data.num_workers=1"]
    pretrain.run(config(tmp_path, tmp_path / "shards", *common))
    uninterrupted = load_file(tmp_path / "run" / "model.safetensors")
    checkpoints = complete_checkpoints(tmp_path / "run")
    assert [c.name for c in checkpoints] == ["step_00000003", "step_00000006"]

    shutil.rmtree(checkpoints[-1])  # as if the run had died after step 3's checkpoint
    (tmp_path / "run" / "model.safetensors").unlink()
    reset_accelerator()
    pretrain.run(config(tmp_path, tmp_path / "shards", *common), resume=True)
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_accelerate_launch_on_cpu_trains_on_every_core(tmp_path, make_shards):
    # accelerate launch sets OMP_NUM_THREADS=1 for its process; left at that, the README's main job used one core.
    make_shards([20], size=32)
    cmd = [*ACCELERATE_LAUNCH, "launch.py", "pretrain", f"data.shards={tmp_path / 'shards'}",
           f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=2", "train.warmup_steps=1", "train.batch_size=4"]
    env = {k: v for k, v in cpu_env(threads=None).items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    precision = "bf16" if resolve_precision("auto", Device.this_process()) == "bf16" else "fp32"  # what auto picks here
    assert f"on cpu ({len(os.sched_getaffinity(0))} thread(s) each), {precision}," in proc.stdout, proc.stdout[-2000:]


def test_the_tenth_run_compiled_in_one_process_is_still_compiled(tmp_path, make_shards, monkeypatch):
    # compare runs every stage in one process; each new model fails dynamo's guards, and past its recompile limit
    # (8) every later model would silently run eager. A counting backend shows which runs were really compiled.
    make_shards([20], size=24)
    compiled_in, run_index = [], [0]
    real_compile = torch.compile

    def counting_compile(model, backend, **options):
        def count(graph, example_inputs):
            compiled_in.append(run_index[0])
            return graph.forward

        return real_compile(model, backend=count)

    monkeypatch.setattr(torch, "compile", counting_compile)
    for run_index[0] in range(10):
        pretrain.run(load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / f'run{run_index[0]}'}",
                                        *TINY, "model.depth=1", "train.steps=1", "train.warmup_steps=0",
                                        "train.batch_size=4", "train.compile=true", "train.mixed_precision=no"]))  # depth 1: less to trace
    assert 9 in compiled_in, sorted(set(compiled_in))
