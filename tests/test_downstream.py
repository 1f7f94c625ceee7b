import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import webdataset as wds
from accelerate.utils import set_seed
from PIL import Image
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.model.checkpoint import CheckpointError, load_backbone, resolve_checkpoint
from mpp.config import ConfigError, DataConfig, load_config
from mpp.data.stream import EvalTransform, make_loader
from mpp.errors import UserError
from mpp.model.vit import VisionTransformer, build_vit, resize_pos_embed
from mpp.model.objectives import Classification, finetuning_head
from mpp.rundir import complete_checkpoints
from pipelines.stages import finetune, pretrain
from mpp.model.vit import build_backbone
from pipelines.run.invocation import resume_command

from conftest import ROOT, TINY, TWO_PROCESSES, cpu_env, reset_accelerator, write_test_shards


def pretrain_config(tmp_path, *overrides):
    return load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'pre'}", *TINY,
                              "train.steps=4", "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=2",
                              *overrides])


def finetune_config(tmp_path, *overrides, out="ft"):
    return load_config(ROOT / "configs" / "finetune" / "default.yaml", [
        f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'val'}", f"output_dir={tmp_path / out}",
        *TINY, "model.num_classes=10", "train.steps=6", "train.warmup_steps=1", "train.batch_size=8",
        "train.checkpoint_every=3", "finetune.eval_every=3", *overrides])


@pytest.fixture
def labelled_data(tmp_path, make_shards):
    make_shards([30, 30], size=24)
    write_test_shards(tmp_path / "val", [7, 5, 3], size=24)  # uneven on purpose


# ---------------------------------------------------------------- position embeddings


def test_resize_pos_embed_keeps_same_size_and_resamples_over_the_grid():
    pos = torch.randn(1, 1 + 16, 8)
    assert torch.equal(resize_pos_embed(pos, 4), pos)

    # 4 x 4 -> 12 x 12: new cell k sits at old coordinate (k + 0.5) / 3 - 0.5 = (k - 1) / 3, so cells 1, 4, 7, 10
    # fall on old cell centres and must carry those embeddings exactly, row for row and column for column.
    field = torch.randn(1, 1 + 16, 3, dtype=torch.float64)
    resized = resize_pos_embed(field, 12)
    assert resized.shape == (1, 1 + 144, 3)
    assert torch.equal(resized[:, :1], field[:, :1])  # [class] keeps its embedding
    on_centres = resized[0, 1:].reshape(12, 12, 3)[1::3, 1::3]
    assert torch.allclose(on_centres, field[0, 1:].reshape(4, 4, 3), atol=1e-12)

    # A linear ramp (slopes 2 and -3 per old cell) stays that ramp in between, up to the overshoot of bicubic
    # (a = -0.75) at quarter positions (measured: at most 0.41 inside the 2-cell border, against 3 per old cell).
    ii, jj = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    ramp = torch.cat([torch.zeros(1, 1, 1), (2 * ii - 3 * jj).reshape(1, 64, 1)], dim=1)
    grid = resize_pos_embed(ramp, 16)[0, 1:, 0].reshape(16, 16)
    coords = torch.tensor([(k + 0.5) / 2 - 0.5 for k in range(16)])
    expected = 2 * coords[:, None] - 3 * coords[None, :]
    assert (grid - expected)[2:-2, 2:-2].abs().max() < 0.5
    assert (grid.diff(dim=0) > 0).all() and (grid.diff(dim=1) < 0).all()


# ---------------------------------------------------------------- checkpoints


def test_pretrained_backbone_round_trips_into_finetuning(tmp_path, labelled_data):
    pretrain.run(pretrain_config(tmp_path))
    exported = load_file(tmp_path / "pre" / "model.safetensors")
    cfg = finetune_config(tmp_path)
    for ckpt in (tmp_path / "pre", tmp_path / "pre" / "model.safetensors"):
        backbone = load_backbone(str(ckpt), cfg.model)
        state = backbone.state_dict()
        assert state.keys() == exported.keys()
        assert all(torch.equal(state[k], exported[k]) for k in exported)
    # A training checkpoint holds the whole objective (backbone.*, [mask], head): the backbone is picked out.
    step = complete_checkpoints(tmp_path / "pre")[0]
    assert resolve_checkpoint(step) == step / "model.safetensors"
    saved = load_file(step / "model.safetensors")
    from_step = load_backbone(str(step), cfg.model).state_dict()
    assert all(torch.equal(from_step[k], saved[f"backbone.{k}"]) for k in exported)

    (tmp_path / "pre" / "model.safetensors").unlink()  # a run dir without its export: newest checkpoint
    assert resolve_checkpoint(tmp_path / "pre") == complete_checkpoints(tmp_path / "pre")[-1] / "model.safetensors"

    classifier = finetune.build_classifier(cfg, str(tmp_path / "pre"), 10)
    assert classifier.head.weight.shape == (10, 64) and not classifier.head.weight.any() and not classifier.head.bias.any()
    finetune.run(cfg, ckpt=str(tmp_path / "pre"))
    tuned = load_file(tmp_path / "ft" / "model.safetensors")
    assert tuned.keys() == exported.keys() | {"head.weight", "head.bias"}
    assert tuned["head.weight"].shape == (10, 64) and tuned["head.weight"].any()


def test_scratch_and_checkpoint_runs_share_one_code_path(tmp_path, labelled_data):
    cfg = finetune_config(tmp_path, out="scratch")
    set_seed(cfg.train.seed)  # what run() does before building the backbone
    save_file(build_backbone(cfg.model).state_dict(), str(tmp_path / "init.safetensors"))
    scratch = finetune.run(cfg, ckpt=None)
    reset_accelerator()
    loaded = finetune.run(finetune_config(tmp_path, out="loaded"), ckpt=str(tmp_path / "init.safetensors"))
    a, b = load_file(tmp_path / "scratch" / "model.safetensors"), load_file(tmp_path / "loaded" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert scratch["top1"] == loaded["top1"]
    assert json.loads((tmp_path / "scratch" / "results.json").read_text())["ckpt"] is None


def test_finetuning_at_a_higher_resolution_interpolates_position_embeddings(tmp_path, labelled_data):
    pretrain.run(pretrain_config(tmp_path))  # 16 px, patch 4: a 4 x 4 grid
    cfg = finetune_config(tmp_path, "model.image_size=24")  # 6 x 6
    backbone = load_backbone(str(tmp_path / "pre"), cfg.model)
    pretrained = load_file(tmp_path / "pre" / "model.safetensors")["pos_embed"]
    assert backbone.pos_embed.shape == (1, 37, 64)
    assert torch.equal(backbone.pos_embed, resize_pos_embed(pretrained, 6))
    results = finetune.run(cfg, ckpt=str(tmp_path / "pre"))
    assert 0 <= results["top1"] <= 1
    assert load_file(tmp_path / "ft" / "model.safetensors")["pos_embed"].shape == (1, 37, 64)


def test_checkpoints_that_do_not_fit_are_refused_with_one_line(tmp_path):
    cfg = load_config(None, TINY)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_backbone(str(tmp_path / "nowhere"), cfg.model)
    save_file({"weight": torch.zeros(3, 3)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="is not a ViT of this project"):
        load_backbone(str(tmp_path / "other.safetensors"), cfg.model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_backbone(str(tmp_path / "junk.safetensors"), cfg.model)


def vit_weights_with(**changes):
    weights = {k: v.clone() for k, v in VisionTransformer(16, 4, 64, 2, 2).state_dict().items()}
    for key, value in changes.items():
        if value is None:
            weights = {k: v for k, v in weights.items() if not k.startswith(key)}
        else:
            weights[key] = value
    return weights


@pytest.mark.parametrize("changes, message", [
    ({"blocks.": None}, "holds no Transformer blocks (no blocks.* tensors)"),
    ({"pos_embed": torch.zeros(1, 1 + 12, 64)}, "has position embeddings of shape (1, 13, 64), not (1, 1 + N, D) over a square grid"),
    ({"patch_embed.proj.weight": torch.zeros(64 * 48)}, "has a patch projection of shape (3072,)"),
], ids=["no-blocks", "non-square-grid", "1d-projection"])
def test_malformed_vit_checkpoints_are_refused_with_one_line(tmp_path, changes, message):
    save_file(vit_weights_with(**changes), str(tmp_path / "odd.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_backbone(str(tmp_path / "odd.safetensors"), load_config(None, TINY).model)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- the CLI's errors


def launch(*args):
    env = cpu_env()
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr[-2000:]
    # The progress bar may share stderr; the error is one line of its own.
    lines = [line.split("error: ", 1)[1] for line in proc.stderr.splitlines() if "error: " in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_refuses_a_patch_size_mismatch(tmp_path, labelled_data):
    save_file(VisionTransformer(16, 4, 64, 2, 2).state_dict(), str(tmp_path / "p4.safetensors"))
    proc = launch("finetune", "--ckpt", str(tmp_path / "p4.safetensors"), f"data.shards={tmp_path / 'shards'}",
                  f"data.val_shards={tmp_path / 'val'}", f"output_dir={tmp_path / 'ft'}", *TINY, "model.patch_size=8",
                  "model.num_classes=10")
    assert_one_line_error(proc, "(64, 48)", "(64, 192)", "model.patch_size=4")
    assert not (tmp_path / "ft" / "checkpoints").exists()


def test_cli_refuses_supervised_pretraining_without_labels(tmp_path, make_shards):
    make_shards([20], size=24, labels=False)
    common = ["pretrain", "objective=supervised", f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'pre'}",
              *TINY, "train.steps=2", "train.warmup_steps=1", "train.batch_size=4"]
    assert_one_line_error(launch(*common), "set model.num_classes")  # no summary.json to count classes from
    assert_one_line_error(launch(*common, "model.num_classes=10"), "without a label")


def test_finetuning_needs_val_shards_before_any_work(tmp_path, labelled_data):
    cfg = finetune_config(tmp_path, "data.val_shards=null")
    with pytest.raises(ConfigError, match="set data.val_shards"):
        finetune.run(cfg, ckpt=None)
    assert not (tmp_path / "ft").exists()


# ---------------------------------------------------------------- supervised pretraining


COLOURS = [(220, 40, 40), (40, 200, 60), (50, 60, 220), (230, 220, 60)]


def write_colour_shards(directory, count):
    """Labelled images whose class is their dominant colour: learnable in a few dozen steps."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(directory / "shard-000000.tar")) as sink:
        for i in range(count):
            label = i % len(COLOURS)
            pixels = np.clip(np.array(COLOURS[label]) + rng.normal(0, 30, (16, 16, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            sink.write({"__key__": f"{i:05d}", "jpg": buf.getvalue(), "cls": str(label).encode()})


def test_supervised_pretraining_lowers_its_loss(tmp_path):
    write_colour_shards(tmp_path / "shards", 200)
    cfg = pretrain_config(tmp_path, "objective=supervised", "model.num_classes=4", "train.steps=30",
                          "train.warmup_steps=3", "train.batch_size=16", "train.lr=2e-3", "log.every=10",
                          "train.checkpoint_every=30")
    results = pretrain.run(cfg)
    events = next((tmp_path / "pre" / "tensorboard").rglob("events.out.tfevents*"))
    acc = EventAccumulator(str(events.parent)).Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses[-1] < losses[0] / 2, losses
    assert [e.value for e in acc.Scalars("train/accuracy")][-1] > 0.9 and results["final"]["train/accuracy"] > 0.9
    weights = load_file(tmp_path / "pre" / "model.safetensors")
    assert weights.keys() == build_vit("vit_ti", 16, 4, width=64, depth=2, heads=2).state_dict().keys()


# ---------------------------------------------------------------- results and resume


def recount(run_dir, val_dir):
    """Top-1 and top-5 of a fine-tuned run's exported weights over every evaluation image, in one process."""
    weights = load_file(run_dir / "model.safetensors")
    classifier = Classification(VisionTransformer(16, 4, 64, 2, 2), finetuning_head(64, 10), export_head=True)
    classifier.load_state_dict({k if k.startswith("head.") else f"backbone.{k}": v for k, v in weights.items()})
    classifier.eval()
    urls = sorted(str(p) for p in val_dir.glob("*.tar"))
    top1 = top5 = total = 0
    with torch.no_grad():
        for batch in make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(16), 4, one_pass=True):
            ranked = classifier.logits(batch.images).topk(5, dim=-1).indices
            top1 += (ranked[:, 0] == batch.labels).sum().item()
            top5 += (ranked == batch.labels[:, None]).any(-1).sum().item()
            total += len(batch.labels)
    assert total == 15
    return top1 / total, top5 / total


def test_results_json_reports_exact_top1_and_top5(tmp_path, labelled_data):
    finetune.run(finetune_config(tmp_path, "train.steps=7", "log.every=7"), ckpt=None)
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert {"top1", "top5", "steps", "ckpt", "images_seen", "wall_time_s", "history"} <= results.keys()
    assert results["steps"] == 7 and results["images_seen"] == 7 * 8 and results["ckpt"] is None
    assert [step for step, _ in results["history"]] == [3, 6, 7]
    assert results["history"][-1][1] == results["top1"] and results["wall_time_s"] > 0
    top1, top5 = recount(tmp_path / "ft", tmp_path / "val")
    assert results["top1"] == pytest.approx(top1) and results["top5"] == pytest.approx(top5)


def test_evaluation_is_exact_over_two_processes_with_uneven_shards(tmp_path, labelled_data):
    # 3 evaluation shards of 7, 5 and 3 images: rank 0 reads 10 of them, rank 1 reads 5. Evaluated at steps 1 and 2,
    # with a data worker in each rank: the second pass is scored from the images each rank kept from its first.
    cmd = [*TWO_PROCESSES, "launch.py",
           "finetune", f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'val'}",
           f"output_dir={tmp_path / 'ft'}", *TINY, "model.num_classes=10", "train.steps=2", "train.warmup_steps=1",
           "train.global_batch_size=8", "finetune.eval_every=1", "data.num_workers=1"]
    env = cpu_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with 2 process(es)" in proc.stdout, proc.stdout[-2000:]
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    top1, top5 = recount(tmp_path / "ft", tmp_path / "val")
    assert results["images_seen"] == 2 * 4 * 2  # train.global_batch_size 8 split into 4 per process
    assert results["top1"] == pytest.approx(top1) and results["top5"] == pytest.approx(top5)


def test_finetuning_resumes_to_the_same_weights_and_history(tmp_path, labelled_data):
    cfg = finetune_config(tmp_path, "train.keep_checkpoints=5")
    finetune.run(cfg, ckpt=None)
    uninterrupted = load_file(tmp_path / "ft" / "model.safetensors")
    history = json.loads((tmp_path / "ft" / "results.json").read_text())["history"]

    reset_accelerator()
    with pytest.raises(UserError, match="pass --resume"):
        finetune.run(cfg, ckpt=None)
    shutil.rmtree(complete_checkpoints(tmp_path / "ft")[-1])  # as if it had died after step 3's checkpoint
    (tmp_path / "ft" / "model.safetensors").unlink()
    reset_accelerator()
    finetune.run(cfg, ckpt=None, resume=True)
    resumed = load_file(tmp_path / "ft" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    assert json.loads((tmp_path / "ft" / "results.json").read_text())["history"] == history


def test_resume_command_puts_resume_after_the_stage(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py", "finetune", "--ckpt", "runs/pre", "--resume", "train.steps=9"])
    assert resume_command() == "`python launch.py finetune --resume --ckpt runs/pre train.steps=9`"
    for auto in (["--resume", "auto"], ["--resume=auto"]):  # a stop of a `--resume auto` run continues with --resume
        monkeypatch.setattr(sys, "argv", ["launch.py", "pretrain", "x=1", *auto, "y=2"])
        assert resume_command() == "`python launch.py pretrain --resume x=1 y=2`"
    monkeypatch.setattr(sys, "argv", ["train.py", "x=1"])
    assert resume_command() == "`python train.py x=1 --resume`"
    monkeypatch.setattr(sys, "argv", ["launch.py", "compare", "--config", "plan.yaml", "arms=[mpp]"])
    assert resume_command() == "`python launch.py compare --config plan.yaml 'arms=[mpp]'`"  # compare takes no --resume
    monkeypatch.setattr(sys, "argv", ["launch.py", "pretrain", "data.shards=pipe:curl -s URL/{0..9}.tar"])
    assert resume_command() == "`python launch.py pretrain --resume 'data.shards=pipe:curl -s URL/{0..9}.tar'`"  # as typed in a shell


def test_class_count_comes_from_the_config_or_the_shards_summary(tmp_path, make_shards):
    from mpp.data.prepare_inputs import synthetic_samples
    from mpp.data.shardwriter import write_shards
    from pipelines.run.loaders import num_classes

    write_shards(synthetic_samples(20, 16), tmp_path / "syn")
    urls = [str(p) for p in sorted((tmp_path / "syn").glob("*.tar"))]
    assert num_classes(load_config(None, [f"data.shards={tmp_path / 'syn'}"]), urls) == len(json.loads(
        (tmp_path / "syn" / "summary.json").read_text())["class_names"])
    assert num_classes(load_config(None, ["model.num_classes=3"]), urls) == 3
    unlabelled = make_shards([5], labels=False)
    (tmp_path / "shards" / "summary.json").write_text(json.dumps({"samples": 5, "classes": 0, "labels": False}))
    with pytest.raises(UserError, match="have no labels"):
        num_classes(load_config(None, [f"data.shards={tmp_path / 'shards'}"]), unlabelled)


def test_heads_come_from_the_model_name_when_nothing_else_says_and_a_warning_says_so(tmp_path):
    # Red team round 4, part 1 row 21: a file without metadata loaded under model.heads=4 trained with the wrong head
    # split without a word (4 heads over width 64 fit every shape).
    save_file(VisionTransformer(16, 4, 96, 1, 3).state_dict(), str(tmp_path / "bare.safetensors"))  # no config.yaml
    cfg = load_config(None, ["model.name=vit_ti", "model.image_size=16", "model.patch_size=4"])  # vit_ti: 3 heads
    with pytest.warns(UserWarning, match=r"bare.safetensors carries no architecture metadata .* its attention head count "
                                         r"cannot be checked, and 3 is assumed; if it was trained with another, set model.heads"):
        backbone = load_backbone(str(tmp_path / "bare.safetensors"), cfg.model)
    assert (backbone.width, backbone.depth, backbone.heads) == (96, 1, 3)


def test_a_file_without_metadata_beside_its_config_refuses_another_explicit_head_count(tmp_path):
    save_file(VisionTransformer(16, 4, 96, 1, 3).state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.yaml").write_text("model:\n  name: vit_ti\n  heads: 3\n")  # the run it came from
    cfg = load_config(None, ["model.name=vit_ti", "model.image_size=16", "model.patch_size=4", "model.heads=4"])
    with pytest.raises(CheckpointError, match=r"holds a ViT with 3 attention heads but model.heads=4; set model.heads=3"):
        load_backbone(str(tmp_path / "model.safetensors"), cfg.model)
