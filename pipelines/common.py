"""Wiring shared by the stages: config -> backbone, shards, loaders, trackers."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from omegaconf import OmegaConf
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from mpp.checkpoint import resolve_checkpoint
from mpp.config import Config, config_to_yaml, load_config
from mpp.data import Batch, DataError, EvalTransform, StreamState, TrainTransform, expand_shards, label_space, make_loader, shared_label_names
from mpp.errors import UserError
from mpp.fewshot import FewShotError, LabelledImages
from mpp.model import VisionTransformer, build_vit
from mpp.rundir import CONFIG, complete_checkpoints, run_config_of, too_long
from mpp.shards import synthetic_samples, write_shards
from mpp.runtime import Device, make_accelerator, precision_label, process_state, resolve_compile
from mpp.train import resumable_checkpoint

SYNTHETIC_ROOT = Path("data")


def build_backbone(cfg: Config) -> VisionTransformer:
    m = cfg.model
    return build_vit(m.name, m.image_size, m.patch_size, width=m.width, depth=m.depth, heads=m.heads, drop_path=m.drop_path,
                     grad_checkpointing=m.grad_checkpointing)


class Run(NamedTuple):
    """A started stage: what every stage reads first, resolved once for this process's launch.

    `cfg` is the stage's config with train.batch_size derived from train.global_batch_size for the processes (a new
    object; the config the stage was given is not changed); `global_batch` is the images per optimiser step over all
    processes (per-process batch x processes x accumulation steps), what the start line and images_seen report.
    Immutable, and it unpacks: `accelerator, cfg, global_batch = start_run(cfg)`.
    """

    accelerator: Accelerator
    cfg: Config
    global_batch: int


def start_run(cfg: Config, *, per_process_seed: bool = True) -> Run:
    """The one way a stage starts: its Accelerator, its resolved config, each rank seeded. A stage begins with
    `accelerator, cfg, global_batch = start_run(cfg)` and reads only the returned config from then on.

    Training ranks get different seeds (different corruptions and augmentations; DDP keeps their weights in sync);
    an evaluation (per_process_seed=False) seeds every rank alike, so a fresh backbone is the same on all of them.
    Stages run one after another in one process (compare) share the process's Accelerate state: see
    runtime.make_accelerator.
    """
    train = cfg.train.for_processes(process_state().num_processes)
    accelerator = make_accelerator(train, cfg.output_dir)
    set_seed(train.seed, device_specific=per_process_seed)
    global_batch = train.batch_size * accelerator.num_processes * train.grad_accum
    return Run(accelerator, cfg.model_copy(update={"train": train}, deep=True), global_batch)


def run_settings(accelerator: Accelerator, cfg: Config, global_batch: int) -> str:
    """How the run computes, for its start line: precision, compile and how the global batch is split."""
    t = cfg.train
    compiling = resolve_compile(t.compile, Device.this_process())
    return (f"{precision_label(accelerator.mixed_precision)}, compile {f'on ({t.compile_backend})' if compiling else 'off'}, "
            f"global batch {global_batch} = {accelerator.num_processes} process(es) x {t.batch_size} images"
            f" x {t.grad_accum} accumulation step(s)")


def resolve_shards(spec: str, cfg: Config, accelerator: Accelerator) -> list[str]:
    """'synthetic' is the embedded corpus, generated once (by the main process) under data/."""
    if spec == "synthetic":
        out = SYNTHETIC_ROOT / f"synthetic-{cfg.data.synthetic_size}"
        with accelerator.main_process_first():
            if accelerator.is_main_process and not (out / "summary.json").is_file():
                accelerator.print(f"generating the embedded synthetic corpus ({cfg.data.synthetic_size} images) in {out}")
                write_shards(synthetic_samples(cfg.data.synthetic_size), out, overwrite=True, progress=True)
        spec = str(out)
    return expand_shards(spec)


def train_loader(urls: list[str], cfg: Config, accelerator: Accelerator, state: StreamState, *, labels: bool = True):
    return make_loader(
        urls, cfg.data, TrainTransform(cfg.model.image_size, cfg.data.crop_scale, cfg.data.hflip), cfg.train.batch_size,
        rank=accelerator.process_index, world=accelerator.num_processes, seed=cfg.train.seed,
        pin_memory=torch.cuda.is_available(), state=state, labels=labels,
        class_names=class_names(cfg, accelerator, cfg.data.shards, cfg.data.val_shards) if labels else None)


def eval_batches(spec: str, cfg: Config, accelerator: Accelerator, batch_size: int, *, labelled_by: str | None = None,
                 labels: bool = True, num_workers: int = 0):
    """One pass over `spec`, split across processes, no augmentation, no shuffling: the loader of every evaluation,
    its own, so the training stream is not touched.

    Named labels map to ids as in training: through the class names of `labelled_by` (default data.shards) and
    `spec`; labels=False never reads them. Without workers (the default) each process reads its shards in
    order, so the first n images are the same at every evaluation; a whole pass may decode in `num_workers`.
    """
    names = class_names(cfg, accelerator, labelled_by or cfg.data.shards, spec) if labels else None
    data = cfg.data.model_copy(update={"num_workers": num_workers, "shuffle_buffer": 0})
    return make_loader(resolve_shards(spec, cfg, accelerator), data, EvalTransform(cfg.model.image_size), batch_size,
                       rank=accelerator.process_index, world=accelerator.num_processes, one_pass=True, labels=labels,
                       class_names=names)


class FrozenFeatureSets:
    """A labelled pool and the evaluation images, read once, for scoring a frozen backbone's features (few-shot, kNN).

    `section` is the evaluator's config section: its shards (default data.shards), val_shards (default
    data.val_shards), train_images, eval_images, batch_size and features. `features(backbone)` -> (pool_x, pool_y,
    eval_x, eval_y), identical on every process.
    """

    def __init__(self, cfg: Config, accelerator: Accelerator, section, name: str, key: str, pool_name: str):
        eval_shards = section.val_shards or cfg.data.val_shards
        if eval_shards is None:
            raise FewShotError(f"{name} evaluation needs evaluation images; set {key}.val_shards or data.val_shards to "
                               f"labelled shards (or {key}.every=0 to turn it off)")
        self.section, self.accelerator = section, accelerator
        pool_shards = section.shards or cfg.data.shards

        def images(spec: str, count: int, what: str) -> LabelledImages:
            batches = eval_batches(spec, cfg, accelerator, section.batch_size, labelled_by=pool_shards)
            return LabelledImages(accelerator, batches, count, what)

        self.pool = images(pool_shards, section.train_images, f"{pool_name} {pool_shards}")
        self.eval = images(eval_shards, section.eval_images, f"evaluation shards {eval_shards}")

    def features(self, backbone: VisionTransformer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.section
        return (*self.pool.features(self.accelerator, backbone, c.features, c.batch_size),
                *self.eval.features(self.accelerator, backbone, c.features, c.batch_size))


def class_names(cfg: Config, accelerator: Accelerator, *specs: str | None) -> tuple[str, ...]:
    """The class names every loader of a run maps named labels through (id = position): the class_names of the
    summary.json beside the first shard set, else the sorted names found in all of them, so that training and
    evaluation shards agree on each name's id even when one of them lacks a class."""
    return shared_label_names({spec: tuple(resolve_shards(spec, cfg, accelerator)) for spec in specs if spec})


def num_classes(cfg: Config, urls: list[str]) -> int:
    """model.num_classes, else the class count of the shards: from the summary.json that `launch.py prepare` wrote
    beside them, or without one from a scan of their labels (cls, json or txt; class names count once each)."""
    if cfg.model.num_classes:
        return cfg.model.num_classes
    space = label_space(tuple(urls))
    if space.count is None:
        raise DataError(f"cannot tell how many classes data.shards ({cfg.data.shards}) holds ({space.source}); "
                        f"set model.num_classes")
    if not space.count:
        raise DataError(f"the shards of {cfg.data.shards} have no labels ({space.source} finds no cls, json label "
                        f"or txt); supervised training needs labelled shards (write them with `launch.py prepare` "
                        f"from labelled images), or set model.num_classes if they are labelled after all")
    return space.count


def labelled(batches: Iterable[Batch], classes: int, what: str) -> Iterator[Batch]:
    """Batches whose labels are all in [0, classes), checked on the host before they reach the device.

    Labels that cannot be read at all (not a number, below 0, an unknown class name) never get here: the stream
    skips those samples and counts them as data/skipped_bad_label.
    """
    for batch in batches:
        labels = batch.labels
        if labels.numel() and labels.min() < 0:
            raise DataError(f"{what} holds images without a label (no cls, json label or txt); supervised pretraining "
                            f"and fine-tuning need a label for every image (use labelled shards, or objective=mpp)")
        if labels.numel() and labels.max() >= classes:
            raise DataError(f"{what} holds label {int(labels.max())} but the head has {classes} classes; "
                            f"set model.num_classes to the number of classes")
        yield batch


# What a resume may change; each is applied from the resumed step on (mpp.train.apply_hyperparameters for the
# optimiser's). Everything else shapes the model, its optimiser state or the data stream the checkpoint continues.
RESUMABLE = ("train.steps", "train.warmup_steps", "train.lr", "train.weight_decay", "train.betas", "train.momentum",
             "train.clip_grad_norm", "train.max_nonfinite_steps", "train.checkpoint_every", "train.keep_checkpoints",
             "train.compile", "train.compile_backend", "train.cpu_threads", "model.grad_checkpointing",
             "data.max_skip_fraction", "data.val_shards",
             "log.", "finetune.", "fewshot.", "output_dir")


def dotted(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def check_output_dir(cfg: Config, resume: bool) -> list[str]:
    """Refuse an output_dir that cannot be written, that holds another run's checkpoints, or whose run a resume
    would change in a way it cannot apply; returns what the resume changes, as `key before -> after`."""
    out = Path(cfg.output_dir)
    if (reason := too_long(out)) is not None:
        raise UserError(f"output_dir {out} cannot be created: {reason}; set output_dir to a shorter path")
    nearest = next(p for p in (out, *out.absolute().parents) if p.exists())  # created later, under the run's lock
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as exc:
        raise UserError(f"output_dir {out} cannot be written ({exc.strerror}); set output_dir to a writable directory") from None
    if not complete_checkpoints(out):
        return []
    if not resume:
        raise UserError(f"output_dir {out} already holds checkpoints of a run; pass --resume to continue it or set output_dir to a new directory")
    saved = out / CONFIG
    if not saved.is_file():
        return []
    before, now = dotted(OmegaConf.to_container(OmegaConf.load(saved))), dotted(cfg.model_dump(mode="json"))
    changed = [key for key in sorted({*before, *now}) if before.get(key) != now.get(key)
               # config.yaml holds the per-process batch (and accumulation) derived from train.global_batch_size;
               # the checkpoint's process count is checked on its own
               and not (key in ("train.batch_size", "train.grad_accum") and now.get("train.global_batch_size") is not None)]
    refused = [key for key in changed if not key.startswith(RESUMABLE)]
    if refused:
        key = refused[0]
        raise UserError(f"output_dir {out} holds a run with a different '{key.split('.')[0]}' config ({key}: {before.get(key)} "
                        f"in its config.yaml, {now.get(key)} now); a resume may change only train.steps, the learning-rate "
                        f"schedule, the optimiser's hyperparameters and how the run logs, evaluates and saves; resume with the "
                        f"saved value or set output_dir to a new directory")
    return [f"{key} {before.get(key)} -> {now.get(key)}" for key in changed if key != "output_dir"]


class RunInUse(UserError):
    """output_dir is locked by another run (its process is alive)."""


class OutputDirLock:
    """An exclusive flock on output_dir/.lock holding the owner's pid, for the life of a run.

    The kernel drops the lock when its process dies, so a crashed run's lock file never blocks the next run.
    """

    def __init__(self, accelerator: Accelerator, output_dir: str | Path):
        self.accelerator, self.path, self.file = accelerator, Path(output_dir) / ".lock", None

    def __enter__(self) -> OutputDirLock:
        holder = [None]
        if self.accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a+")
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.seek(0)
                holder[0] = self.file.read().strip() or "unknown"
                self.file.close()
            else:
                self.file.truncate(0)
                self.file.write(f"{os.getpid()}\n")
                self.file.flush()
        broadcast_object_list(holder)
        if holder[0] is not None:
            raise RunInUse(f"output_dir {self.path.parent} is in use by another run (pid {holder[0]}); wait for it to end, "
                            f"stop it, or set output_dir to another directory")
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # releases the lock


def resume_point(accelerator: Accelerator, cfg: Config, resume: bool, changes: list[str]) -> Path | None:
    """The checkpoint to continue from (None: a fresh start), saying what the resume changes."""
    if not resume:
        return None
    latest = resumable_checkpoint(accelerator, cfg.output_dir)
    if latest is not None and changes:
        accelerator.print(f"resuming with changed settings, applied from {latest.name} on: {', '.join(changes)}")
    return latest


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs `argv` (default: this process's) again, as the user typed it."""
    args = list(sys.argv if argv is None else argv)
    if Path(args[0]).name == "mpp":  # the installed console script runs as itself
        return " ".join(["mpp", *args[1:]])
    runner = "accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ else "python"
    return f"{runner} {' '.join(args)}"


def resume_command() -> str:
    """This process's command line with --resume right after the stage name (or at the end if there is none);
    under compare, its command line as it is: compare resumes its stages itself and takes no --resume."""
    args = [a for a in sys.argv if a != "--resume"]
    if "compare" not in args:
        stage = next((i for i, a in enumerate(args) if a in ("pretrain", "finetune")), len(args) - 1)
        args.insert(stage + 1, "--resume")
    return f"`{command_line(args)}`"


# Every run declares the same metrics: TensorBoard's HParams dashboard takes the metric list of one run (any) for all.
HPARAMS_METRICS = ("train/loss", "train/color_acc", "train/accuracy", "eval/top1", "eval/top5")


def start_tracking(accelerator: Accelerator, cfg: Config, run_name: str, headline: dict[str, list[str]],
                   resumed_from: Path | None = None, changes: list[str] = ()) -> None:
    """TensorBoard run under output_dir/tensorboard/<run_name>, config.yaml beside it.

    config.yaml holds the settings now in force; a resume that changed some adds a comment line naming the
    checkpoint and the earlier values, after those of earlier resumes.

    The run gets the config as text and as HParams (with HPARAMS_METRICS, their last logged values, so runs sort by
    them), and a Custom Scalars layout: the stage's `headline` charts (title -> tag regexes, several tags sharing one
    chart) first, then optimisation, speed and skipped samples.
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
    for summary in hparams_summaries(flat_config(cfg), HPARAMS_METRICS):
        writer.file_writer.add_summary(summary)
    charts = {"training": headline}
    if cfg.eval.every and cfg.data.val_shards and run_name == "pretrain":
        charts["pretext validation"] = {"loss and accuracy on fixed held-out images, fixed corruption": ["^val/"]}
    if cfg.knn.every:
        charts["kNN evaluation"] = {"kNN top-1 of frozen features": ["^knn/"]}
    if cfg.fewshot.every:
        charts["few-shot evaluation"] = {"few-shot accuracy by shots per class": ["^fewshot/"]}
    charts["optimisation"] = {"learning rate": ["^train/lr$"], "gradient norm (before clipping)": ["^train/grad_norm$"],
                              "skipped non-finite steps": ["^train/nonfinite_steps$"]}
    charts["speed"] = {"images per second": ["^perf/images_per_sec$"], "share of time waiting for data": ["^perf/data_wait_fraction$"]}
    charts["data"] = {"skipped samples by reason": ["^data/skipped_"]}
    writer.add_custom_scalars({category: {title: ["Multiline", tags] for title, tags in group.items()}
                               for category, group in charts.items()})
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
    flat = {}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}{key}.", inner)
        else:
            flat[prefix[:-1]] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)

    flatten("", cfg.model_dump(mode="json"))
    return flat


def hparams_summaries(values: dict[str, bool | int | float | str], metrics: tuple[str, ...]) -> list[Summary]:
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


def checkpoint_config(ckpt: str, config: str | None, overrides: list[str]) -> Config:
    """--config if given, else the config.yaml of the run that wrote `ckpt` (its model and data carry over); then overrides."""
    if config is None:
        config = run_config_of(resolve_checkpoint(ckpt))
    return load_config(config, overrides)
