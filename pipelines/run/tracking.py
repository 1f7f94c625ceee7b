"""A run in TensorBoard: its event files under output_dir/tensorboard/<stage>, the config (as text, as HParams and as
config.yaml beside them) and the Custom Scalars layout of the metrics the run declares."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path

import torch
from accelerate import Accelerator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from torch.utils.tensorboard import SummaryWriter

from mpp.config import Config, Section, config_schema, config_to_yaml
from mpp.metrics import Metric, layout
from mpp.model.registry import CLASSIFICATION_SETTINGS, OBJECTIVES
from mpp.rundir import write_whole
from mpp.training.runtime import process_state
from mpp.training.trackers import log_final
from .plan import RunPlan


# Set by a comparison while it runs its stages: how it names a run (its output_dir) in HParams' table, whose first
# column shows about 15 characters, so the part that tells runs apart comes first (mim-x2-s1 (scratch, tiny)), not the
# whole run path below TensorBoard's logdir, which the table cut to the same ft/scratch/mim-... for several runs.
TRIAL_NAMES: ContextVar[Callable[[Path], str] | None] = ContextVar("trial_names", default=None)

# The test scores a comparison gives each run it tests (log_scores), which HParams lists as metrics of its runs.
TEST_METRICS = ("test/top1", "test/top5", "test/balanced_acc")
SCORES_SUFFIX = ".test-scores"  # the event file log_scores writes, replaced when it writes again


def trial_name(output_dir: str | Path) -> str:
    """The run's name in HParams' table: what the comparison running it calls it, else '' (TensorBoard then names
    it by its run path, unique below any logdir; a shorter name of a run outside a comparison could be another's,
    and HParams would merge the two rows)."""
    name_of = TRIAL_NAMES.get()
    return "" if name_of is None else name_of(Path(output_dir))


def log_scores(directory: Path, scores: dict[str, float], step: int, summaries: Sequence[Summary] = ()) -> None:
    """Scalars `scores` at `step` in the TensorBoard run `directory` (a finished run's), where Scalars charts them and
    HParams reads them as the run's metrics, in an event file of their own (with `summaries`) that replaces the one an
    earlier call left there: a comparison run again writes each score once."""
    if not process_state().is_main_process:
        return
    directory.mkdir(parents=True, exist_ok=True)
    # Several compare processes of one plan reach a finished run's scores together: one removing the file another is
    # about to remove crashed that one (FileNotFoundError), and each writing its own left the scores twice. The
    # directory's own flock makes the replacement one process's at a time, with no lock file to leave behind.
    held = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        for earlier in directory.glob(f"*{SCORES_SUFFIX}"):
            earlier.unlink()
        with SummaryWriter(str(directory), filename_suffix=SCORES_SUFFIX) as writer:
            for summary in summaries:
                writer.file_writer.add_summary(summary)
            for tag, value in scores.items():
                writer.add_scalar(tag, value, step)
    finally:
        os.close(held)


def log_session(directory: Path, like: Path, leave_out: tuple[str, ...], scores: dict[str, float], step: int) -> None:
    """A run of its own in `directory` for HParams and Scalars: the settings of the run `like` (its TensorBoard
    directory) less those in `leave_out`, named by the comparison (trial_name), with `scores` as its metrics."""
    if not process_state().is_main_process:
        return
    start = plugin_data_pb2.HParamsPluginData.FromString(
        EventAccumulator(str(like)).Reload().SummaryMetadata("_hparams_/session_start_info").plugin_data.content)
    info = start.session_start_info
    for key in leave_out:
        info.hparams.pop(key, None)
    info.group_name = trial_name(directory)
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
    log_scores(directory, scores, step, [hparams_summary("_hparams_/session_start_info", start),
                                         hparams_summary("_hparams_/session_end_info", plugin_data_pb2.HParamsPluginData(session_end_info=end))])


SHOWN_HPARAMS = 5  # the columns TensorBoard's HParams table shows before the user ticks others


def hparam_columns() -> tuple[str, ...]:
    """HParams' columns: the few settings that tell runs apart (the whole config is under Text and in config.yaml), as
    each section declares them (`Section.hparams`), section by section after `objective`. One list for every stage,
    as TensorBoard takes the columns from one run of the logdir; a run leaves blank what does not apply to it
    (`applies`). HParams' table shows the first five (SHOWN_HPARAMS) at first: the objective and train's first four
    (optimizer, lr, steps, seed), what a comparison's runs differ in; the model's shape, the same in all of them, is a
    tick away."""
    sections = [(name, field.annotation) for name, field in config_schema().model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, Section)]
    sections.sort(key=lambda section: section[0] != "train")  # stable: the others keep the schema's order
    return ("objective", *(f"{name}.{key}" for name, section in sections for key in section.hparams))


def start_tracking(accelerator: Accelerator, plan: RunPlan, run_name: str, metrics: list[Metric],
                   resumed_from: Path | None = None) -> None:
    """What TensorBoard shows of a run whose trackers have started (mpp.training.trackers.start_trackers): its config
    as text, and as config.yaml beside the run's event files under output_dir/tensorboard/<run_name>.

    config.yaml holds the settings now in force; a resume from `resumed_from` that changed some (plan.changes) adds a
    comment line naming the checkpoint and the earlier values, after those of earlier resumes.

    The run gets the settings that tell runs apart as HParams (run_hparams, with its headline metrics, their last
    logged values, so runs sort by them), and a Custom Scalars layout of `metrics` (what the objective, the loop and
    the evaluators declare), grouped and ordered as mpp.metrics lays them out.
    """
    if not accelerator.is_main_process:
        return
    cfg, changes = plan.cfg, plan.changes
    columns, values = run_hparams(plan, stage_objective(cfg, run_name))
    trial = trial_name(cfg.output_dir)  # a comparison's run: its test scores are metrics too, whichever run TensorBoard's columns come from
    headline = [m.tag for m in metrics if m.headline] + (list(TEST_METRICS) if trial else [])
    hparams = hparams_summaries(columns, values, headline, trial)
    text = config_to_yaml(cfg)
    saved = plan.run_dir.config
    notes = [line for line in saved.read_text().splitlines(keepends=True) if line.startswith("#")] if resumed_from and saved.is_file() else []
    if resumed_from and changes:
        notes.append(f"# resumed from {resumed_from.name} with {', '.join(changes)}; the steps before it ran with the earlier values\n")
    plan.run_dir.root.mkdir(parents=True, exist_ok=True)
    write_whole(saved, "".join(notes) + text)  # a kill mid-write leaves the earlier one, which a resume reads
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    writer.add_text("config", f"```\n{text}\n```")
    for summary in hparams:
        writer.file_writer.add_summary(summary)
    writer.add_custom_scalars({category: {title: ["Multiline", tags] for title, tags in group.items()}
                               for category, group in layout(metrics).items()})
    writer.flush()


def end_tracking(accelerator: Accelerator, final: dict[str, float] | None = None, step: int = 0) -> None:
    """Give the trackers the run's `final` metrics (mpp.training.trackers.log_final), mark the run's HParams session as
    finished, then close the trackers.

    Not Accelerator.end_training: that also ends the process group, which belongs to the process and serves its
    later stages (compare runs several); end_process closes it when the command is done.
    """
    if final:
        log_final(accelerator, final, step)
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


def stage_objective(cfg: Config, stage: str) -> str:
    """What a stage trains: pretraining its config's objective, fine-tuning a classification."""
    return cfg.objective if stage == "pretrain" else "classification"


def run_hparams(plan: RunPlan, objective: str) -> tuple[dict, dict]:
    """HParams of a run training `objective` as `plan` runs it: (every HParams column (hparam_columns) with the value
    the run's config gives it, which also sets the column's type; the columns that apply to the run). The model's
    width and depth are its resolved ones, train.global_batch_size the images per optimiser step over all processes."""
    values = {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
              for key, value in plan.settings.items()}
    variant = plan.cfg.model.variant
    values.update({"objective": objective, "model.width": variant.width, "model.depth": variant.depth,
                   "train.global_batch_size": plan.global_batch})
    columns = {key: values[key] for key in hparam_columns()}
    return columns, {key: value for key, value in columns.items() if applies(key, objective)}


def applies(key: str, objective: str) -> bool:
    """Whether the setting `key` changes what a run training `objective` does: it does unless some objectives declare
    it theirs alone (their section, or `ObjectiveKind.reads`) and `objective` is not one of them. Fine-tuning's
    "classification" reads what supervised pretraining does."""
    owned = {name: kind.settings() for name, kind in OBJECTIVES.items()} | {"classification": CLASSIFICATION_SETTINGS}
    owners = [name for name, keys in owned.items() if any(key.startswith(k) if k.endswith(".") else key == k for k in keys)]
    return not owners or objective in owners


def hparam_kind(value: bool | int | float | str) -> tuple[str, str, bool | str]:
    """(HParams data type, field of the value, the value as stored) of `value`. bool is tested before int, which it
    subclasses; a number is stored as its shortest text (6, 0.001, 2e-05; a whole float as an int: weight=2 as 2, not
    2.0), since HParams shows every number to five significant digits (6 steps as 6.0000, lr 0.001 as 0.0010000)."""
    if isinstance(value, bool):
        return "DATA_TYPE_BOOL", "bool_value", value
    if isinstance(value, (int, float)):
        return "DATA_TYPE_STRING", "string_value", repr(value).removesuffix(".0")
    return "DATA_TYPE_STRING", "string_value", value


def hparams_summaries(columns: dict[str, bool | int | float | str], values: dict[str, bool | int | float | str],
                      metrics: list[str], trial: str = "") -> list[Summary]:
    """The HParams plugin's experiment summary (its columns: `columns`, typed by their values, then `metrics`) and
    session-start summary (this run's `values`). Written by hand because torch's `summary.hparams` tests for int
    before bool, which turns every boolean into a number."""
    start = plugin_data_pb2.SessionStartInfo(group_name=trial)
    for name, value in values.items():
        _, field, stored = hparam_kind(value)
        setattr(start.hparams[name], field, stored)
    # TensorBoard sorts the columns by name after those marked as differing across runs, and shows the first five:
    # hparam_columns' first five are marked so, the settings a comparison's runs differ in.
    infos = [api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(hparam_kind(value)[0]), differs=i < SHOWN_HPARAMS)
             for i, (name, value) in enumerate(columns.items())]
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics])
    return [hparams_summary("_hparams_/experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment)),
            hparams_summary("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start))]


def hparams_summary(tag: str, content: plugin_data_pb2.HParamsPluginData) -> Summary:
    plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])
