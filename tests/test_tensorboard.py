"""What a user sees in TensorBoard and on the terminal after a run: one run per stage, HParams with metrics and
typed values, the headline charts first, one aligned image panel, and a progress bar that says whether it learns."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from mpp.config import load_config
from mpp.panel import PANEL_GAP, panel_grid
from pipelines import finetune, pretrain

from conftest import ROOT, TINY, reset_accelerator


def runs(run_dir):
    """Directories holding event files: what TensorBoard lists as runs."""
    return sorted({p.parent.relative_to(run_dir) for p in run_dir.rglob("events.out.tfevents*")})


def test_the_run_names_tensorboard_lists_for_a_comparison_are_the_ones_the_readme_shows(tmp_path, make_shards):
    # A comparison's layout: pretraining in pre/<arm>, fine-tuning in ft/<arm>/<recipe>, one logdir above them.
    make_shards([40], size=32)
    common = [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}", *TINY, "train.steps=2",
              "train.warmup_steps=1", "train.batch_size=8", "model.num_classes=10", "finetune.eval_every=2"]
    logdir = tmp_path / "compare"
    pretrain.run(load_config(None, [*common, f"output_dir={logdir / 'pre' / 'mpp'}"]))
    reset_accelerator()
    finetune.run(load_config(None, [*common, f"output_dir={logdir / 'ft' / 'scratch' / 'sgd-0.03'}"]), ckpt=None)
    listed = EventMultiplexer().AddRunsFromDirectory(str(logdir)).Runs()  # what `tensorboard --logdir` lists
    assert set(listed) == {"pre/mpp/tensorboard/pretrain", "ft/scratch/sgd-0.03/tensorboard/finetune"}
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in listed)


def hparams_content(accumulator, tag):
    return plugin_data_pb2.HParamsPluginData.FromString(accumulator.SummaryMetadata(tag).plugin_data.content)


def test_pretraining_run_reads_at_a_glance(tmp_path, make_shards, capsys):
    make_shards([40], size=32)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                             "train.steps=4", "train.warmup_steps=1", "train.batch_size=8", "log.every=2", "log.images_every=4"])
    pretrain.run(cfg)
    assert runs(tmp_path / "run") == [tmp_path.joinpath("tensorboard", "pretrain").relative_to(tmp_path)]  # listed once

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "pretrain"), size_guidance={"images": 0}).Reload()
    experiment = hparams_content(acc, "_hparams_/experiment").experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["train/loss", "train/color_acc"]  # the run's headline metrics
    assert {"train/loss", "train/color_acc"} <= set(acc.Tags()["scalars"])  # the metrics' values, logged by the run
    start = hparams_content(acc, "_hparams_/session_start_info").session_start_info
    assert start.hparams["data.hflip"].WhichOneof("kind") == "bool_value" and start.hparams["data.hflip"].bool_value
    assert start.hparams["train.lr"].number_value == pytest.approx(cfg.train.lr)
    assert start.hparams["objective"].string_value == "mpp"
    assert hparams_content(acc, "_hparams_/session_end_info").session_end_info.status == 1  # STATUS_SUCCESS

    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category][0] == "training" and layout.category[-1].title == "data"
    charts = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    colour = next(tags for title, tags in charts.items() if title.startswith("colour accuracy"))
    assert colour == ["^train/color_acc$", "^train/color_acc_prior$"]  # on one chart

    assert acc.Tags()["images"] == ["panel"]
    panel = acc.Images("panel")[-1]
    assert panel.width > 8 * 128 and panel.height == PANEL_GAP + 4 * (128 + PANEL_GAP)  # 8 images per row, 4 rows

    out = capsys.readouterr()
    assert "(width 64, depth 2, 2 heads, patch 4, 16 px" in out.out  # the model that trains, not just its name
    assert "color_acc=" in out.err and "loss=" in out.err


def test_fine_tuning_bar_shows_top1_and_announces_the_final_evaluation(tmp_path, make_shards, capsys):
    make_shards([40], size=32)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, "model.num_classes=10", "train.steps=4",
                             "train.warmup_steps=1", "train.batch_size=8", "finetune.eval_every=2", "log.every=2"])
    finetune.run(cfg, ckpt=None)
    out = capsys.readouterr()
    assert "step 4 of 4: running the final evaluation" in out.out
    assert "top1=" in out.err and "acc=" in out.err
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "finetune")).Reload()
    assert runs(tmp_path / "run") == [tmp_path.joinpath("tensorboard", "finetune").relative_to(tmp_path)]
    assert "eval/top1" in acc.Tags()["scalars"]


def test_panel_grid_rows_line_up_per_image():
    rows = {name: torch.randint(0, 256, (5, 3, 12, 10), dtype=torch.uint8) for name in ("crops", "corrupted", "target", "predicted")}
    grid = panel_grid(rows)
    assert grid.dtype == torch.uint8 and grid.shape[0] == 3
    assert grid.shape[1] == PANEL_GAP + 4 * (12 + PANEL_GAP)
    label_width = grid.shape[2] - 5 * (10 + PANEL_GAP)
    assert label_width > 4 * PANEL_GAP  # room for the row names
    for r, images in enumerate(rows.values()):
        top = PANEL_GAP + r * (12 + PANEL_GAP)
        for c in range(5):
            left = label_width + c * (10 + PANEL_GAP)
            assert torch.equal(grid[:, top:top + 12, left:left + 10], images[c]), (r, c)  # column c: image c in every row
    labels = grid[:, PANEL_GAP:PANEL_GAP + 12, :label_width]
    assert (labels < 128).any()  # the row's name is drawn beside it
