"""A stage's data, from config: the shard lists, the training stream, one-pass evaluation loaders, label spaces."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator

from mpp.evaluation.baselines import class_baselines
from mpp.config import Config, ConfigError, Pooling
from mpp.training.runtime import data_workers, process_state
from mpp.data.stream import (Batch, DataError, EvalTransform, LabelReader, StreamState, TrainTransform,
                             evaluation_labels, label_space, make_loader, SPARSE_FACTOR, SPARSE_FLOOR)
from mpp.data.readers import Uncounted
from mpp.data.source import DataSource, open_source
from mpp.errors import UserError, command
from mpp.evaluation.ridge import FewShotError, LabelledImages
from mpp.model.vit import VisionTransformer
from mpp.data.randaugment import RandAugment
from mpp.data.shardformat import SUMMARY
from mpp.data.prepare_inputs import synthetic_samples
from mpp.data.shardwriter import write_shards
from mpp.data.synthetic import is_synthetic
from mpp.evaluation.neighbours import missing_classes

SYNTHETIC_ROOT = Path("data")


def resolve_source(spec: str, cfg: Config, accelerator: Accelerator) -> DataSource:
    """The data set `spec` names; 'synthetic' is the embedded corpus, generated once (by the main process) under data/."""
    if is_synthetic(spec):
        out = SYNTHETIC_ROOT / f"synthetic-{cfg.data.synthetic_size}"
        with accelerator.main_process_first():
            if accelerator.is_main_process and not (out / SUMMARY).is_file():
                accelerator.print(f"generating the embedded synthetic corpus ({cfg.data.synthetic_size} images) in {out}")
                write_shards(synthetic_samples(cfg.data.synthetic_size), out, overwrite=True, progress=True)
        spec = str(out)
    return open_source(spec)


def resolve_shards(spec: str, cfg: Config, accelerator: Accelerator) -> list[str]:
    """The units of `spec` (resolve_source) that the stream splits."""
    return list(resolve_source(spec, cfg, accelerator).units)


def train_transform(cfg: Config) -> TrainTransform:
    d = cfg.data
    randaugment = RandAugment(d.randaugment_ops, d.randaugment_magnitude, d.randaugment_magnitude_std) if d.randaugment_ops else None
    return TrainTransform(cfg.model.image_size, d.crop_scale, d.hflip, randaugment)


def with_run_length(cfg: Config, processes: int) -> tuple[Config, int | None]:
    """(`cfg` with train.steps from train.epochs over the training set's size at the global batch of `processes`
    processes, that size): counted once, for the length and the closing line's advice. Without train.epochs, `cfg`
    itself, and the size None where it cannot be counted."""
    try:
        samples = training_samples(cfg)
    except UserError:
        if cfg.train.epochs is not None:
            raise
        # Counted for the advice alone: data.shards that cannot be opened is the stage's loaders' to refuse, once the
        # ranks have checked that they share one config (a rank must not stop alone here while the others wait).
        samples = None
    if cfg.train.epochs is None:
        return cfg, samples
    train = cfg.train.with_epochs(samples, processes)
    process_state().print(f"train.epochs {cfg.train.epochs:g} over {samples} training images: {train.steps} steps")
    return cfg.model_copy(update={"train": train}), samples


def training_samples(cfg: Config) -> int:
    """The training set's size (train.epochs' length, the closing line's advice): of the embedded corpus, or the
    images its reader counts in the data set data.shards names (mpp.data.source.DataSource.images)."""
    if is_synthetic(cfg.data.shards):
        return cfg.data.synthetic_size
    try:
        return open_source(cfg.data.shards).images
    except Uncounted as exc:
        raise ConfigError(f"train.epochs needs the number of training images, and data.shards ({cfg.data.shards}) "
                          f"{exc}; give the length in train.steps instead (with train.epochs=null)"
                          f"{', ' + exc.remedy if exc.remedy else ''}") from None


def train_loader(urls: list[str], cfg: Config, accelerator: Accelerator, state: StreamState, *, labels: bool = True,
                 keep: Callable[[str], bool] | None = None):
    """The training stream of `urls` from `state`; `keep` (of a sample key) leaves out the images it refuses (those
    finetune.val_split holds out)."""
    data = cfg.data.model_copy(update={"num_workers": data_workers(cfg.data.num_workers)})  # auto, resolved here
    return make_loader(
        urls, data, train_transform(cfg), cfg.train.batch_size,
        rank=accelerator.process_index, world=accelerator.num_processes, seed=cfg.train.seed,
        pin_memory=accelerator.device.type == "cuda", state=state, labels=labels,
        class_names=class_names(cfg, accelerator, cfg.data.shards) if labels else None, keep=keep)


def eval_batches(spec: str, cfg: Config, accelerator: Accelerator, batch_size: int, *, labelled_by: str | None = None,
                 labels: bool = True, num_workers: int = 0, keep: Callable[[str], bool] | None = None):
    """One pass over `spec`, split across processes, no augmentation, no shuffling: the loader of every evaluation,
    its own, so the training stream is not touched.

    Labels are read as the class ids of `labelled_by` (default data.shards), matched by name (`label_reader`);
    labels=False never reads them. Without workers (the default) each process reads its shards in
    order, so the first n images are the same at every evaluation; a whole pass may decode in `num_workers`.
    `keep` (of a sample key) reads only the images it accepts (those finetune.val_split holds out).
    """
    reader = label_reader(cfg, accelerator, spec, labelled_by) if labels else LabelReader()
    data = cfg.data.model_copy(update={"num_workers": num_workers, "shuffle_buffer": 0})
    return make_loader(resolve_shards(spec, cfg, accelerator), data, EvalTransform(cfg.model.image_size), batch_size,
                       rank=accelerator.process_index, world=accelerator.num_processes, one_pass=True, labels=labels,
                       class_names=reader.class_names, stored_names=reader.stored_names, keep=keep)


KEPT_PASS_BYTES = 1 << 30  # this process's part of an evaluation set kept decoded in memory, at most (uint8 images)


class KeptPass:
    """The batches of one evaluation pass, decoded from the shards the first time it is iterated and replayed from
    memory every later time, where this process's images fit `limit` bytes (a larger set is read each time, as
    before). A fine-tuning run scores the same images every finetune.eval_every steps, and decoding them again was a
    quarter of a later evaluation of Fashion-MNIST's test set on a CPU and three fifths of one for a tiny ViT
    (docs/benchmarks.md). Only a whole pass is kept: one an error or the caller stopped is
    read again. Each image is kept as a copy: a batch from a data worker holds a shared-memory file descriptor,
    and thousands of them kept would run a process out of descriptors.

    `read()` -> a fresh one-pass loader over the same images (eval_batches).
    """

    def __init__(self, read: Callable[[], Iterable[Batch]], limit: int = KEPT_PASS_BYTES):
        self.read, self.limit = read, limit
        self.kept: list[Batch] | None = None

    def __iter__(self) -> Iterator[Batch]:
        if self.kept is not None:
            yield from self.kept
            return
        kept: list[Batch] | None = []
        size = 0
        for batch in self.read():
            size += batch.images.nbytes
            kept = kept if kept is not None and size <= self.limit else None
            if kept is not None:
                kept.append(Batch(batch.images.clone(), batch.labels.clone(), keys=batch.keys))
            yield batch
        self.kept = kept


class FrozenFeatureSets:
    """A labelled pool and the evaluation images, read once, for scoring a frozen backbone's features (few-shot, kNN).

    `section` is the evaluator's config section: its shards (default data.shards), val_shards (default
    data.val_shards), train_images, eval_images, batch_size and features. `features(backbone)` -> (pool_x, pool_y,
    eval_x, eval_y), identical on every process.
    """

    def __init__(self, cfg: Config, accelerator: Accelerator, section, name: str, key: str, pool_name: str):
        read = section.shards_read(cfg.data)
        pool_shards, eval_shards = read["shards"], read["val_shards"]
        if eval_shards is None:
            raise FewShotError(f"{name} evaluation needs evaluation images; set {key}.val_shards or data.val_shards to "
                               f"labelled shards (or {key}.every=0 to turn it off)")
        self.section, self.accelerator, self.name, self.key = section, accelerator, name, key
        self.pool_shards = pool_shards

        def images(spec: str, count: int, what: str) -> LabelledImages:
            batches = eval_batches(spec, cfg, accelerator, section.batch_size, labelled_by=pool_shards)
            return LabelledImages(accelerator, batches, count, what)

        self.pool = images(pool_shards, section.train_images, f"{pool_name} {pool_shards}")
        self.eval = images(eval_shards, section.eval_images, f"evaluation shards {eval_shards}")
        pool_y, eval_y = self.pool.all_labels(accelerator), self.eval.all_labels(accelerator)
        classes = int(max(pool_y.max(), eval_y.max())) + 1 if len(pool_y) and len(eval_y) else 1
        # What the frozen features' accuracy is shown beside: always the pool's majority class, and chance.
        self.baseline = class_baselines(torch.bincount(pool_y, minlength=classes).tolist(), eval_y.tolist(), classes)

    def warn_of_missing_classes(self, pool: str) -> None:
        """One warning, before any training, where the pool (`pool` says what it is) holds no image of some classes
        of the evaluation images, with the ceiling that puts on top-1. A pool short of a few classes of many is normal
        (5000 images, 1000 classes) and top-1 still measures the features; one short of most measures only that."""
        eval_y = self.eval.all_labels(self.accelerator)
        missing, share = missing_classes(self.pool.all_labels(self.accelerator), eval_y)
        if missing and self.accelerator.is_main_process:
            listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            warnings.warn(f"the {pool} ({self.pool_shards}, first {self.pool.total} images) holds no image of "
                          f"{len(missing)} of the {len(torch.unique(eval_y))} classes of the evaluation images (class "
                          f"{listed}); the {share:.0%} of them in those classes can never be classified right, so "
                          f"{self.name} top-1 is at most {1 - share:.1%}; raise {self.key}.train_images or use shards "
                          f"that mix classes (`{command('prepare')}` shuffles them)", stacklevel=3)

    def features(self, backbone: VisionTransformer, pooling: Pooling | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pooling` (default: the section's features) lets one read of the images serve both poolings."""
        c, pooling = self.section, pooling or self.section.features
        return (*self.pool.features(self.accelerator, backbone, pooling, c.batch_size),
                *self.eval.features(self.accelerator, backbone, pooling, c.batch_size))


def class_names(cfg: Config, accelerator: Accelerator, spec: str) -> tuple[str, ...]:
    """The class names of the training set `spec` (id = position), which every loader of a run maps labels into:
    the class_names of the summary.json beside it, else the sorted names its labels or class folders give."""
    return resolve_source(spec, cfg, accelerator).class_names


def label_reader(cfg: Config, accelerator: Accelerator, spec: str, labelled_by: str | None = None) -> LabelReader:
    """How the labels of `spec` are read as the class ids of the training set `labelled_by` (default data.shards):
    matched by name where both name their classes, an evaluation class the training set lacks refused (one line);
    where only one names them, ids as they are, with one warning saying so."""
    training = labelled_by or cfg.data.shards
    reader, warning = evaluation_labels((training, tuple(resolve_shards(training, cfg, accelerator))),
                                        (spec, tuple(resolve_shards(spec, cfg, accelerator))))
    if warning and (accelerator is None or accelerator.is_main_process):
        warnings.warn(warning)  # from this one line, so Python shows it once however many loaders ask
    return reader


def num_classes(cfg: Config, urls: list[str]) -> int:
    """model.num_classes, else the class count of the shards: from the summary.json that `mpp prepare` wrote
    beside them, or without one from a scan of their labels (cls, json or txt; class names count once each)."""
    if cfg.model.num_classes:
        return cfg.model.num_classes
    space = label_space(tuple(urls))
    if space.count is None:
        raise DataError(f"cannot tell how many classes data.shards ({cfg.data.shards}) holds ({space.source}); "
                        f"set model.num_classes")
    if not space.count:
        raise DataError(f"the shards of {cfg.data.shards} have no labels ({space.source} finds no cls, json label "
                        f"or txt); supervised training needs labelled shards (write them with `{command('prepare')}` "
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
            label = int(labels.max())
            sample = f" (sample {batch.keys[int(labels.argmax())]})" if batch.keys else ""
            if label + 1 > max(SPARSE_FACTOR * classes, SPARSE_FLOOR):  # as label_space tells a stray label
                raise DataError(f"{what} holds label {label}{sample} but the head has {classes} classes (0 to "
                                f"{classes - 1}); a label that far beyond them looks like a stray one: correct that "
                                f"sample's label or remove the sample from the shards (set model.num_classes only "
                                f"if the shards really hold {label + 1} classes)")
            raise DataError(f"{what} holds label {label}{sample} but the head has {classes} classes (0 to "
                            f"{classes - 1}); set model.num_classes to the number of classes")
        yield batch
