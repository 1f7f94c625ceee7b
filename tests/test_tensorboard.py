"""What a user sees in TensorBoard and on the terminal after a run: one run per stage, HParams with metrics and
typed values, the headline charts first, one aligned image panel, and a progress bar that says whether it learns."""

import multiprocessing

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from mpp.config import load_config
from mpp.training.panel import PANEL_GAP, PANEL_IMAGES, panel_grid
from pipelines.stages import finetune, pretrain
from pipelines.run.tracking import SCORES_SUFFIX, hparams_summaries, hparam_columns, log_scores

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
    guide = (ROOT / "docs" / "finetuning.md").read_text()  # the comparison's section, moved there from README
    assert all(f"`{name}`" in guide for name in listed)


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
    assert [m.name.tag for m in experiment.metric_infos] == ["train/pretext_loss", "train/color_acc"]  # the run's headline metrics
    assert {"train/pretext_loss", "train/color_acc"} <= set(acc.Tags()["scalars"])  # the metrics' values, logged by the run
    # The few settings that tell runs apart, not the whole config (that is under Text); the same columns for every stage.
    assert [h.name for h in experiment.hparam_infos] == list(hparam_columns()) and len(hparam_columns()) <= 20
    start = hparams_content(acc, "_hparams_/session_start_info").session_start_info
    assert start.hparams["train.lr"].string_value == "0.001"  # as written, not HParams' five digits (0.0010000)
    assert start.hparams["objective"].string_value == "mpp" and start.hparams["mpp.target"].string_value == "color"
    # Integers as integers: as text, since HParams shows every number to five digits (8 as 8.0000).
    assert start.hparams["model.width"].string_value == "64"  # the model's, also where the config leaves it to the variant
    assert start.hparams["train.global_batch_size"].string_value == "8"  # images per step, though the config says null
    assert start.hparams["train.steps"].string_value == "4" and start.hparams["train.seed"].string_value == "0"
    # Shown at first: the five columns a comparison's runs differ in, not the model's shape, the same in all of them.
    # TensorBoard sorts the columns by name after those marked as differing, and shows the first five.
    assert [h.name for h in experiment.hparam_infos if h.differs] == ["objective", "train.optimizer", "train.lr", "train.steps",
                                                                      "train.seed"]
    assert "train.label_smoothing" not in start.hparams  # blank: it does not apply to MPP
    assert "config/text_summary" in acc.Tags()["tensors"]  # the whole config, as text
    assert hparams_content(acc, "_hparams_/session_end_info").session_end_info.status == 1  # STATUS_SUCCESS

    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category][0] == "training" and layout.category[-1].title == "data"
    charts = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    # Accuracy and its prior on one chart, whose title says which line is which (Custom Scalars draws no legend).
    assert list(charts.values()) == [["^train/pretext_loss$"], ["^train/color_acc$", "^train/color_acc_prior$"]]
    assert "lower line, its prior's" in list(charts)[1]
    # Nothing was skipped: no flat-zero skip charts ahead of the loss in Time Series' first screen.
    assert not [tag for tag in acc.Tags()["scalars"] if tag.startswith("data/skipped_")]

    # Time Series sorts tags by name and opens the first two groups: train/ is the first, its loss and colour accuracy
    # the first charts, the panel and the speed after them.
    groups = sorted({tag.split("/")[0] for kind in ("scalars", "images") for tag in acc.Tags()[kind]})
    assert groups == ["train"]
    assert acc.Tags()["images"] == ["train/panel"]
    panel = acc.Images("train/panel")[-1]
    assert panel.width == PANEL_GAP + 4 * (128 + PANEL_GAP) and panel.height > PANEL_IMAGES * (128 + PANEL_GAP)  # 4 views

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


def test_hparams_keep_booleans_boolean():
    # torch's summary.hparams tests for int before bool and would log a True as the number 1.
    experiment, start = (hparams_content_of(summary) for summary in hparams_summaries({"flag": True, "lr": 0.1, "steps": 6},
                                                                                     {"flag": True}, []))
    assert [h.type for h in experiment.experiment.hparam_infos] == [api_pb2.DATA_TYPE_BOOL, api_pb2.DATA_TYPE_STRING,
                                                                   api_pb2.DATA_TYPE_STRING]
    assert start.session_start_info.hparams["flag"].WhichOneof("kind") == "bool_value"
    assert "lr" not in start.session_start_info.hparams  # a column this run leaves blank


def hparams_content_of(summary):
    return plugin_data_pb2.HParamsPluginData.FromString(summary.value[0].metadata.plugin_data.content)


def test_panel_is_a_column_per_view_under_its_name_legible_in_time_series():
    # 32-px crops as log_panel shows them: upscaled to 128 px cells.
    columns = {name: torch.randint(0, 256, (PANEL_IMAGES, 3, 128, 128), dtype=torch.uint8)
               for name in ("crops", "corrupted", "target", "predicted")}
    grid = panel_grid(columns)
    assert grid.dtype == torch.uint8 and grid.shape[0] == 3
    height, width = grid.shape[1:]
    header = height - PANEL_IMAGES * (128 + PANEL_GAP)
    assert width == PANEL_GAP + 4 * (128 + PANEL_GAP)  # one column per view
    # Time Series fits an image into about 370 x 210 px: the cells stay ~60 px and the names (ascender to
    # descender) at least 11 px high there.
    shown = min(370 / width, 210 / height)
    inked = (grid[:, :header] < 128).any(0).any(-1).nonzero()
    assert 128 * shown >= 60 and (inked.max() - inked.min() + 1) * shown >= 11
    for c, (name, images) in enumerate(columns.items()):
        left = PANEL_GAP + c * (128 + PANEL_GAP)
        label = grid[:, :header, left:left + 128]
        assert (label < 128).any(), name  # the view's name is drawn above its column
        for r in range(PANEL_IMAGES):
            top = header + r * (128 + PANEL_GAP)
            assert torch.equal(grid[:, top:top + 128, left:left + 128], images[r]), (name, r)  # row r: image r in every view


def test_validation_charts_say_what_the_validation_holds_fixed():
    # MPP's pretext validation fixes its corruption; supervised pretraining corrupts nothing, and its charts say so.
    from mpp.model.registry import OBJECTIVES
    from mpp.model.vit import build_backbone

    def val_charts(objective):
        cfg = load_config(None, [*TINY, f"objective={objective}"])
        built = OBJECTIVES[objective].objective(build_backbone(cfg.model), cfg, 3)
        return {metric.chart for metric in built.metrics("val")}

    assert all(chart.endswith("(held-out images, fixed corruption)") for chart in val_charts("mpp"))
    assert all(chart.endswith("(held-out images)") for chart in val_charts("supervised"))


def score_repeatedly(directory, times, errors):
    try:
        for _ in range(times):
            log_scores(directory, {"test/top1": 0.5}, 300)
    except Exception as failure:  # noqa: BLE001: the failure is what the test reports
        errors.put(repr(failure))


def test_two_compare_processes_scoring_one_finished_run_together_leave_its_scores_once(tmp_path):
    # Two compare processes of one plan both re-log a finished run's test scores as they pass it. Before, one removed
    # the event file the other had just listed (FileNotFoundError ended that whole compare process, 2 h 25 min into
    # the emoji plan), or each wrote its own and TensorBoard showed every score twice.
    directory = tmp_path / "tensorboard" / "finetune"
    forked = multiprocessing.get_context("fork")
    errors = forked.Queue()
    workers = [forked.Process(target=score_repeatedly, args=(directory, 300, errors)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert errors.empty(), errors.get()
    files = list(directory.glob(f"*{SCORES_SUFFIX}"))
    assert len(files) == 1
    scalars = EventAccumulator(str(directory)).Reload().Scalars("test/top1")
    assert [(s.step, s.value) for s in scalars] == [(300, 0.5)]
