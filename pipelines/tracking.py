"""A run in TensorBoard: its event files under output_dir/tensorboard/<stage>, the config (as text, as HParams and as
config.yaml beside them) and the Custom Scalars layout of the metrics the run declares."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import Accelerator
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from mpp.config import Config, config_to_yaml, dotted
from mpp.metrics import Metric, layout
from mpp.rundir import CONFIG


def start_tracking(accelerator: Accelerator, cfg: Config, run_name: str, metrics: list[Metric],
                   resumed_from: Path | None = None, changes: list[str] = ()) -> None:
    """TensorBoard run under output_dir/tensorboard/<run_name>, config.yaml beside it.

    config.yaml holds the settings now in force; a resume that changed some adds a comment line naming the
    checkpoint and the earlier values, after those of earlier resumes.

    The run gets the config as text and as HParams (with its headline metrics, their last logged values, so runs sort
    by them), and a Custom Scalars layout of `metrics` (what the objective, the loop and the evaluators declare),
    grouped and ordered as mpp.metrics lays them out.
    """
    # Without config=: Accelerate's own hparams call writes them to a timestamped sub-run, listing every run twice.
    accelerator.init_trackers(run_name)
    if not accelerator.is_main_process:
        return
    text = config_to_yaml(cfg)
    saved = Path(cfg.output_dir) / CONFIG
    notes = [line for line in saved.read_text().splitlines(keepends=True) if line.startswith("#")] if resumed_from and saved.is_file() else []
    if resumed_from and changes:
        notes.append(f"# resumed from {resumed_from.name} with {', '.join(changes)}; the steps before it ran with the earlier values\n")
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    saved.write_text("".join(notes) + text)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    writer.add_text("config", f"```\n{text}\n```")
    for summary in hparams_summaries(flat_config(cfg), [m.tag for m in metrics if m.headline]):
        writer.file_writer.add_summary(summary)
    writer.add_custom_scalars({category: {title: ["Multiline", tags] for title, tags in group.items()}
                               for category, group in layout(metrics).items()})
    writer.flush()


def end_tracking(accelerator: Accelerator) -> None:
    """Mark the run's HParams session as finished, then close the trackers.

    Not Accelerator.end_training: that also ends the process group, which belongs to the process and serves its
    later stages (compare runs several); end_process closes it when the command is done.
    """
    if accelerator.is_main_process:
        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        writer.file_writer.add_summary(hparams_summary("_hparams_/session_end_info", plugin_data_pb2.HParamsPluginData(session_end_info=end)))
    for tracker in accelerator.trackers:
        tracker.finish()


def end_process() -> None:
    """Close the process group of a multi-process launch, once the command's stages are all done."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def flat_config(cfg: Config) -> dict[str, bool | int | float | str]:
    """{'train.lr': 0.001, 'data.hflip': True, 'model.width': 'null', ...}: lists and nulls as text."""
    return {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
            for key, value in dotted(cfg.model_dump(mode="json")).items()}


def hparams_summaries(values: dict[str, bool | int | float | str], metrics: list[str]) -> list[Summary]:
    """The HParams plugin's experiment and session-start summaries. Written by hand because torch's
    `summary.hparams` tests for int before bool, which turns every boolean into a number."""
    start, infos = plugin_data_pb2.SessionStartInfo(), []
    for name, value in values.items():
        if isinstance(value, bool):
            start.hparams[name].bool_value, kind = value, "DATA_TYPE_BOOL"
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value, kind = value, "DATA_TYPE_FLOAT64"
        else:
            start.hparams[name].string_value, kind = value, "DATA_TYPE_STRING"
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics])
    return [hparams_summary("_hparams_/experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment)),
            hparams_summary("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start))]


def hparams_summary(tag: str, content: plugin_data_pb2.HParamsPluginData) -> Summary:
    plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])
