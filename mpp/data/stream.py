"""Stream a data set's samples (image under jpg/png/webp, optional label in cls, json or txt) as uint8 batches: tar
shards, or whatever format a reader of mpp.data.readers reads."""

from __future__ import annotations

import functools
import io
import json
import math
import os
import random
import re
import signal
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds
from einops import rearrange
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mpp.errors import DataError, command
from mpp.data.images import to_rgb, upright
from mpp.data.randaugment import RandAugment
from mpp.data.shardformat import IMAGE_KEYS, is_remote, shard_summary, summary_beside
from mpp.data.tars import LossEstimate, ShardEnd, end_commands_and_exit, forget_inherited_commands
from mpp.data.readers import read_samples, reader_of



@dataclass
class Batch:
    images: torch.Tensor  # (B, 3, H, W) uint8
    labels: torch.Tensor  # (B,) int64, -1 where labels are not read or the sample has none
    skipped: Counter = field(default_factory=Counter)  # samples dropped since the previous batch, by reason
    worker: int = 0  # the logical worker that produced it
    position: StreamPosition | None = None  # that worker's stream position after this batch
    keys: tuple[str, ...] = ()  # each image's sample, as "<shard file name>/<key>": unique in a shard set

    def pin_memory(self) -> Batch:
        return Batch(self.images.pin_memory(), self.labels.pin_memory(), self.skipped, self.worker, self.position, self.keys)


# ---------------------------------------------------------------- decoding and augmentation


def open_image(sample: dict) -> Image.Image:
    """The sample's image, upright (EXIF orientation applied) and in a mode crop_resize converts correctly."""
    key = next((k for k in IMAGE_KEYS if k in sample), None)
    if key is None:
        raise KeyError("no image")
    return upright(Image.open(io.BytesIO(sample[key])))


def random_resized_box(width: int, height: int, scale: tuple[float, float], rng: random.Random) -> tuple[int, int, int, int]:
    """Inception-style crop: area fraction in `scale`, aspect ratio in [3/4, 4/3] (log-uniform)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, x + w, y + h
    return center_box(width, height)


def center_box(width: int, height: int) -> tuple[int, int, int, int]:
    side = min(width, height)
    x, y = (width - side) // 2, (height - side) // 2
    return x, y, x + side, y + side


def crop_resize(img: Image.Image, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """The box of `img` resized to (3, size, size) uint8, decoding only what the crop needs.

    JPEGs decode at a reduced DCT scale (draft) when the crop is at least twice the output; the resize is torch's
    uint8 antialiased bilinear kernel, which follows PIL's filter to within a grey level at 2-3x its speed.
    """
    width, height = img.size
    shrink = min((box[2] - box[0]) / size, (box[3] - box[1]) / size)
    if img.format == "JPEG" and shrink >= 2:
        img.draft("RGB", (math.ceil(width / shrink), math.ceil(height / shrink)))
        fx, fy = img.size[0] / width, img.size[1] / height
        box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
    img = to_rgb(img)
    left, top = min(round(box[0]), img.size[0] - 1), min(round(box[1]), img.size[1] - 1)
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8))[top:bottom, left:right]  # (h, w, 3)
    crop = rearrange(pixels, "h w c -> 1 c h w")  # a channels-last view: the layout torch's fast kernel wants
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


@dataclass(frozen=True)
class TrainTransform:
    """Random-resized crop, horizontal flip, then RandAugment on the crop (timm's order), all drawn from `rng`."""

    size: int
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    randaugment: RandAugment | None = None

    def __call__(self, img: Image.Image, rng: random.Random) -> torch.Tensor:
        image = crop_resize(img, random_resized_box(*img.size, self.crop_scale, rng), self.size)
        image = image.flip(-1) if self.hflip and rng.random() < 0.5 else image
        return self.randaugment(image, rng) if self.randaugment else image


@dataclass(frozen=True)
class EvalTransform:
    """Centre square of the short side, resized: no augmentation."""

    size: int

    def __call__(self, img: Image.Image, rng: random.Random) -> torch.Tensor:
        return crop_resize(img, center_box(*img.size), self.size)


# ---------------------------------------------------------------- labels

LARGEST_ID = 2**63 - 1  # labels travel as int64
# A largest id over this many times the distinct ids (and over SPARSE_FLOOR) is taken for a stray label, not a
# class count: one stray 1000000000 among ids 0 to 9 would otherwise size the head for a billion classes.
SPARSE_FACTOR, SPARSE_FLOOR = 10, 1000


class BadLabel(ValueError):
    """A sample's label that cannot be turned into a class id; the message says what it holds."""


def raw_label(sample: dict) -> int | str | None:
    """The label as stored: `cls` text, `json`'s "label" (or "cls") field, or `txt` text; None where there is none."""
    if "cls" in sample:
        return _label_text(sample["cls"])
    if "json" in sample:
        try:
            record = json.loads(sample["json"])
        except ValueError as exc:
            raise BadLabel(f"json that does not parse ({exc})") from None
        value = next((record[k] for k in ("label", "cls") if k in record), None) if isinstance(record, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return _class_id(value)
        if value is None or isinstance(value, str):
            return value.strip() if isinstance(value, str) else value
        raise BadLabel(f"json label {value!r}, neither an integer nor a class name")
    if "txt" in sample:
        return _label_text(sample["txt"])
    return None


def _label_text(data: bytes) -> int | str:
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadLabel("label bytes that are not UTF-8 text") from None
    return _class_id(int(text)) if re.fullmatch(r"[+-]?\d+", text) else text


def _class_id(value: int) -> int:
    if value > LARGEST_ID:
        raise BadLabel(f"label {value}, larger than any class id can be")
    return value


@dataclass(frozen=True)
class LabelReader:
    """Sample -> class id: integers as they are, class names through `class_names` (id = position); -1 if unlabelled.

    `stored_names`, where a set's integer ids are its own (an evaluation set prepared apart, with its own summary.json
    class_names), names those ids, so that each is read as the id of the same name in `class_names`."""

    class_names: tuple[str, ...] = ()
    stored_names: tuple[str, ...] = ()

    def __call__(self, sample: dict) -> int:
        value = raw_label(sample)
        if value is None:
            return -1
        if isinstance(value, int):
            if value < 0:
                raise BadLabel(f"label {value}, below 0")
            if not self.stored_names:
                return value
            if value >= len(self.stored_names):
                raise BadLabel(f"label {value}, beyond the {len(self.stored_names)} class names of its summary.json")
            value = self.stored_names[value]
        if value in self.class_names:
            return self.class_names.index(value)
        if not self.class_names:
            raise BadLabel(f"class name {value!r} and no class names to map it to an id (summary.json's class_names)")
        alike = next((name for name in self.class_names if name.casefold() == value.casefold()), None)
        hint = f" ({alike!r} is: names are matched exactly, case included)" if alike else ""
        raise BadLabel(f"class name {value!r}, not one of the {len(self.class_names)} class names of the shard set{hint}")


@dataclass(frozen=True)
class LabelSpace:
    """What a shard set's labels are: class names (id = position) and the class count (0: no labels, None: unknown)."""

    count: int | None
    class_names: tuple[str, ...] = ()
    source: str = ""  # where this was read from, for messages


@functools.lru_cache(maxsize=8)
def label_space(urls: tuple[str, ...]) -> LabelSpace:
    """The summary.json that `mpp prepare` writes beside the shards, else a scan of the shards' label fields.

    The scan (local shards only) reads tar headers and the small label members, not the images; the class names
    it finds are sorted, so every process and every run over the same shards maps a name to the same id. Integer
    ids give the count as the largest id + 1, unless that is far more than the ids found (SPARSE_FACTOR): then the
    count is unknown and the source names the largest label and where it is.
    """
    summary = shard_summary(urls)
    if summary is not None:
        names = tuple(summary.class_names or ())
        count = len(names) or summary.classes if summary.labels else 0
        return LabelSpace(count, names, summary_beside(urls[0]))
    remote = [u for u in urls if is_remote(u)]
    if remote:
        return LabelSpace(None, (), f"no summary.json beside {remote[0]}, and remote shards are not scanned")
    ids, names = set(), set()
    largest, where = -1, ""
    for url in urls:
        for sample in label_members(url):
            value = _raw_or_none(sample)  # a bad label is the stream's to count
            if isinstance(value, int) and value >= 0:
                ids.add(value)
                if value > largest:
                    largest, where = value, f"sample {sample['__key__']} of {url}"
            elif isinstance(value, str):
                names.add(value)
    if ids and names:  # names cannot be given ids that do not collide with the ids in use
        return LabelSpace(None, (), f"the shards beside {urls[0]} label some samples with class ids and others with "
                                    f"class names (e.g. {min(ids)} and {sorted(names)[0]!r}), and no summary.json's "
                                    f"class_names relates them")
    source = f"a scan of {len(urls)} shard(s) (no summary.json)"
    if names:
        return LabelSpace(len(names), tuple(sorted(names)), source)
    if largest + 1 > max(SPARSE_FACTOR * len(ids), SPARSE_FLOOR):
        below = f", the next largest being {sorted(ids)[-2]}" if len(ids) > 1 else ""
        return LabelSpace(None, (), f"its largest label, {largest} ({where}), would size the head for {largest + 1} "
                                    f"classes although only {len(ids)} distinct labels occur{below}, so it looks like a "
                                    f"stray label to correct")
    return LabelSpace(largest + 1 if ids else 0, (), source)


def label_names(urls: tuple[str, ...]) -> tuple[str, ...]:
    """The names that class-name labels map through (id = position), without a full scan where none is needed:
    summary.json's class_names, else, if the first shard labels samples by name, the names of `label_space`."""
    first = urls[0]
    if os.path.isfile(summary_beside(first)) or is_remote(first):
        return label_space(urls).class_names
    named = any(isinstance(_raw_or_none(sample), str) for sample in label_members(first))
    return label_space(urls).class_names if named else ()


def evaluation_labels(training: tuple[str, tuple[str, ...]], evaluation: tuple[str, tuple[str, ...]]
                      ) -> tuple[LabelReader, str | None]:
    """How an evaluation set's labels are read as the training set's class ids (each given as (spec, its shards)):
    by name wherever both sets name their classes (summary.json's class_names, class folders, labels that are names),
    so a set prepared apart, with a class more or less, is scored against the right classes. Returns the reader and,
    where only one set names its classes and ids are matched as they are, a warning saying so.

    An evaluation class the training set lacks is refused, naming it: no head trained on these shards can score it,
    whatever model.num_classes says.
    """
    (train_spec, train_urls), (spec, urls) = training, evaluation
    names = label_names(train_urls)
    if spec == train_spec:
        return LabelReader(names), None
    own = label_names(urls)
    summary = shard_summary(urls)
    stored = tuple(summary.class_names or ()) if summary is not None else ()
    if not names and not own:
        return LabelReader(), None
    if not names or not own:
        if own and not stored:  # labelled by name, and the training set has no names to match them with
            raise DataError(f"{spec} labels its images by class name ({_listed(own)}) but the training set {train_spec} "
                            f"labels its images by id and names no classes (no summary.json class_names), so the two "
                            f"cannot be matched; prepare both with `{command('prepare')}`, which writes the names")
        named, unnamed = (train_spec, spec) if names else (spec, train_spec)
        return LabelReader(names), (f"the labels of {spec} are taken as the class ids of {train_spec} as they are: "
                                    f"{unnamed} names no classes (no summary.json class_names), so they cannot be "
                                    f"matched by name with those of {named}")
    _refuse_case_twins(train_spec, names, spec, own)
    missing = [name for name in own if name not in names and _holds(urls, name, stored)]
    if missing:
        empty = [name for name in missing if os.path.isdir(os.path.join(train_spec, name))]
        why = (f"; the training folder {os.path.join(train_spec, empty[0])} holds no images" if len(empty) == 1 else
               f"; the training folders of {_listed(empty)} hold no images" if empty else "")
        keys = {name.split(maxsplit=1)[0] for name in names if name.strip()}
        if all(name in keys for name in missing):  # prepared with and without --class-names @LOC_synset_mapping.txt
            why += (f"; the training set's class names begin with {'these' if len(missing) > 1 else 'this'}: prepare "
                    f"{spec} with the same --class-names as the training set")
        raise DataError(f"{spec} holds class{'es' if len(missing) > 1 else ''} {_listed(missing)}, which the training "
                        f"set {train_spec} does not have{why} ({len(names)} classes: {_listed(names)}); a model "
                        f"trained on that set cannot score {'them' if len(missing) > 1 else 'it'}: leave "
                        f"{'their' if len(missing) > 1 else 'its'} images out of {spec}, or add "
                        f"{'those classes' if len(missing) > 1 else 'that class'} to the training set")
    return LabelReader(names, stored), None


def _holds(urls: tuple[str, ...], name: str, stored: tuple[str, ...]) -> bool:
    """Whether a set holds images of class `name`: a summary.json that counts its classes may list one it has none of."""
    summary = shard_summary(urls)
    counts = summary.class_counts if summary is not None else None
    if not stored or not counts or name not in stored:
        return True
    index = stored.index(name)
    return index < len(counts) and counts[index] > 0


def _listed(names: Sequence[str], most: int = 5) -> str:
    return ", ".join(map(repr, names[:most])) + (f" and {len(names) - most} more" if len(names) > most else "")


def _refuse_case_twins(spec: str, mine: Sequence[str], other_spec: str, other: Sequence[str]) -> None:
    """Names that differ only in case between two sets are refused: matched exactly, 'cat' in the training shards
    and 'Cat' in the evaluation shards would be two classes, each never seen by the other set."""
    pairs = sorted((a, b) for a in set(mine) - set(other) for b in set(other) - set(mine) if a.casefold() == b.casefold())
    if pairs:
        shown = ", ".join(f"{a!r} and {b!r}" for a, b in pairs[:3]) + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")
        raise DataError(f"class names differ only in case between {spec} and {other_spec} ({shown}); names are "
                        f"matched exactly, so each spelling would be a class of its own that the other set never "
                        f"shows, whatever model.num_classes says; spell the names of one set as the other does")


def _raw_or_none(sample: dict) -> int | str | None:
    try:
        return raw_label(sample)
    except BadLabel:
        return None


def sample_key(url: str, key: str) -> str:
    """A sample's key as batches carry it (predictions.json's, finetune.val_split's): its shard file / its key there."""
    return f"{os.path.basename(url)}/{key}"


def label_members(url: str) -> Iterator[dict]:
    """{"__key__": key, label member: bytes} per labelled sample of a unit, as its reader reads them without images."""
    return reader_of(url).label_members(url)


# ---------------------------------------------------------------- streaming

SHARDS_PER_GROUP = 8  # resampled streams draw shards in groups; a resume replays at most one group, undecoded


@dataclass(frozen=True)
class StreamPosition:
    """Where one worker's stream stands: `consumed` samples read in shard group `group`."""

    group: int = 0
    consumed: int = 0


@dataclass
class StreamState:
    """What a rank has consumed of its stream: enough to restart it exactly where it stopped.

    `drawn_from` is the optimiser step its draw began at: 0 for a run's own start, else the step of a resume on
    another process count, where every rank starts a fresh draw (keyed by the seed, that step and the rank).
    """

    batches: int = 0
    positions: dict[int, StreamPosition] = field(default_factory=dict)
    drawn_from: int = 0

    def advance(self, batch: Batch) -> None:
        self.batches += 1
        self.positions[batch.worker] = batch.position

    def state_dict(self) -> dict:
        return {"batches": self.batches, "positions": {w: (p.group, p.consumed) for w, p in self.positions.items()},
                "drawn_from": self.drawn_from}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]
        self.positions = {int(w): StreamPosition(*p) for w, p in state["positions"].items()}
        self.drawn_from = state.get("drawn_from", 0)  # absent from the checkpoints of an earlier mpp


BARREN_GROUPS = 4  # resampled groups in a row without a usable image that prove a shard set unusable (32 draws)


class ShardStream(IterableDataset):
    """Batches from shards, split across ranks and dataloader workers.

    resampled: each (rank, worker) draws groups of shards with replacement forever, so no rank runs dry.
    otherwise: rank r takes shards r, r + world, ...; its worker w every num_workers-th of those; one group is
    one pass, which visits each sample of the shard set once across all ranks and workers. `loop` repeats passes.

    Randomness is keyed by (seed, rank, worker, group, sample index), and by `drawn_from` where it is not 0 (see
    StreamState), and the shuffle buffer is emptied at group ends, so the stream is a pure function of those and can
    restart at any `StreamPosition` by reading, not decoding, the samples of the current group already consumed.
    `worker_offset` rotates which logical worker a DataLoader worker plays, so a resumed DataLoader (which always
    starts at worker 0) keeps the batch order.

    labels: reads each sample's class id (a bad one is a skipped sample); None leaves labels unread (-1). An image
    without a label whose label lies elsewhere (a member of its shard not next to it, or of the shard before or
    after it) raises DataError saying how to write the tar.

    A shard that cannot be read, whole or from a damage on (see mpp.data.tars), is named in a warning and counts as the
    samples it lost (`LossEstimate`, with `samples_per_shard` from summary.json) under unreadable_shard, so that
    data.max_skip_fraction judges shards by what they held.
    A worker whose pass (or BARREN_GROUPS resampled groups in a row) yields no usable image raises DataError
    naming the shards and the counts by reason: otherwise it would loop over them forever and the loader, which
    waits for every worker in turn, would never deliver another batch.
    """

    def __init__(self, urls: list[str], transform: Callable, batch_size: int, *, rank: int = 0, world: int = 1,
                 seed: int = 0, resampled: bool = True, shuffle_buffer: int = 0, loop: bool = True,
                 start: dict[int, StreamPosition] | None = None, worker_offset: int = 0,
                 labels: Callable[[dict], int] | None = None, samples_per_shard: float | None = None,
                 drawn_from: int = 0, keep: Callable[[str], bool] | None = None):
        super().__init__()
        self.urls, self.transform, self.batch_size = urls, transform, batch_size
        self.rank, self.world = rank, world
        self.draw = f"{seed}-{drawn_from}" if drawn_from else f"{seed}"  # a run's own draw keeps its keys
        self.resampled, self.shuffle_buffer, self.loop = resampled, shuffle_buffer, loop
        self.start, self.worker_offset, self.labels = start or {}, worker_offset, labels
        self.samples_per_shard = samples_per_shard
        self.keep = keep
        self.place = {url: i for i, url in enumerate(urls)}

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers = info.num_workers if info else 1
        worker = ((info.id if info else 0) + self.worker_offset) % workers
        start = self.start.get(worker, StreamPosition())
        skips = _Skips(LossEstimate(self.samples_per_shard))
        images, labels, keys = [], [], []
        last_group = 10**12 if self.loop or self.resampled else 1
        for group in range(start.group, last_group):
            key = f"{self.draw}-{self.rank}-{worker}-{group}"
            shards = self._group_shards(worker, workers, random.Random(key))
            if not shards:
                return
            skips.barren.shards.update(shards)
            got_image = False
            samples = read_samples(shards, on_end=skips.shard_ended)
            if self.shuffle_buffer:
                samples = wds.shuffle(self.shuffle_buffer, min(self.shuffle_buffer, 100), rng=random.Random(key))(samples)
            skips.resume_at, skips.pulled = (start.consumed if group == start.group else 0), 0
            for index, sample in enumerate(samples, start=1):
                skips.pulled = index
                if index <= skips.resume_at:
                    continue
                if self.keep is not None and not self.keep(sample_key(sample["__url__"], sample.get("__key__", "?"))):
                    continue  # on the other side of finetune.val_split
                skips.barren.read += 1
                decoded = self._decoded(sample, random.Random(f"{key}-{index}"), skips)
                if decoded is None:
                    continue
                got_image = True
                images.append(decoded[0])
                labels.append(decoded[1])
                keys.append(sample_key(sample["__url__"], sample.get("__key__", "?")))
                if len(images) == self.batch_size:
                    yield Batch(torch.stack(images), torch.tensor(labels), skips.since_batch.copy(), worker,
                                StreamPosition(group, index), tuple(keys))
                    images, labels, keys = [], [], []
                    skips.since_batch.clear()
            if got_image or skips.resume_at:  # a group read past on a resume may have held images: judge the next ones
                skips.barren = Barren()
                continue
            skips.barren.groups += 1
            if skips.barren.groups >= (BARREN_GROUPS if self.resampled else 1):
                raise DataError(skips.barren.message(worker, self.rank, self.resampled))
        if images:
            yield Batch(torch.stack(images), torch.tensor(labels), skips.since_batch.copy(), worker,
                        StreamPosition(last_group, 0), tuple(keys))

    def _decoded(self, sample: dict, rng: random.Random, skips: _Skips) -> tuple[torch.Tensor, int] | None:
        """The sample's transformed image and its label (-1 unread), or None for a sample skipped and counted."""
        name = sample.get("__key__", "?")
        try:
            label = self.labels(sample) if self.labels else -1
        except BadLabel as exc:
            skips.skip("bad_label", f"{name}: {exc}")
            return None
        try:
            image = self.transform(open_image(sample), rng)
        except KeyError:
            skips.skip("missing_image", f"{name} has only {', '.join(k for k in sample if not k.startswith('__')) or 'no members'}")
            return None
        except Exception as exc:
            skips.skip("undecodable_image", f"{name}: {exc}")
            return None
        if label < 0 and self.labels:
            url = sample["__url__"]
            at = self.place[url]
            misplaced = reader_of(url).misplaced_label(url, name, self.urls[max(at - 1, 0):at] + self.urls[at + 1:at + 2])
            if misplaced:
                raise DataError(misplaced)
        return image, label

    def _group_shards(self, worker: int, workers: int, rng: random.Random) -> list[str]:
        if self.resampled:
            return [rng.choice(self.urls) for _ in range(SHARDS_PER_GROUP)]
        mine = self.urls[self.rank :: self.world][worker::workers]
        if self.shuffle_buffer:
            rng.shuffle(mine)
        return mine


@dataclass
class Barren:
    """What a worker read in its groups in a row without a usable image."""

    groups: int = 0
    read: int = 0  # samples, all unusable
    shards: set[str] = field(default_factory=set)
    reasons: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def message(self, worker: int, rank: int, resampled: bool) -> str:
        names = sorted(self.shards)
        shards = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        span = f"{self.groups} groups of {SHARDS_PER_GROUP} draws" if resampled else "a whole pass"
        counts = ", ".join(f"{n} {reason} (first: {self.first[reason]})" for reason, n in self.reasons.most_common())
        if self.read:
            what = f"{self.read} samples and not one usable image: {counts}"
        else:
            what = f"no samples at all: {counts or 'the tars are empty'}"
        return (f"dataloader worker {worker} of rank {rank} read {span} over shard(s) {shards} and got {what}; "
                f"fix or remove these shards, or point the setting that names them (data.shards, data.val_shards or an "
                f"evaluator's shards) at usable ones")


class _Skips:
    """What one worker's stream skipped: the counts since its last batch by reason, one warning per reason and per
    damaged shard, and the run of samples without a usable image (`Barren`). `resume_at` and `pulled` are the current
    group's samples read past on a resume and pulled so far: a shard ended while reading past was counted before."""

    def __init__(self, losses: LossEstimate):
        self.since_batch: Counter = Counter()
        self.barren = Barren()
        self.warned: set[str] = set()  # reasons and shards
        self.losses = losses
        self.resume_at = self.pulled = 0

    def count(self, reason: str, detail: str, samples: int = 1) -> str:
        detail = " ".join(detail.split())[:200]  # one line: it ends up in an error message
        self.since_batch[reason] += samples
        self.barren.reasons[reason] += 1  # events: samples, or shards for unreadable_shard
        self.barren.first.setdefault(reason, detail)
        return detail

    def skip(self, reason: str, detail: str) -> None:
        detail = self.count(reason, detail)
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"skipping samples with {reason} (first: {detail}); counts are logged as data/skipped_*", stacklevel=3)

    def shard_ended(self, end: ShardEnd) -> None:
        if end.damage is not None and self.pulled >= self.resume_at:
            lost = self.losses.lost(end)
            self.count("unreadable_shard", f"{end.url}: {end.damage}", lost)
            if end.url not in self.warned:
                self.warned.add(end.url)
                read = f"read to its end ({end.damage}) after {end.samples} samples" if end.samples else f"read ({end.damage})"
                warnings.warn(f"shard {end.url} could not be {read}: an estimated {lost} sample(s) lost, counted as "
                              f"data/skipped_unreadable_shard, which data.max_skip_fraction judges", stacklevel=2)
        self.losses.record(end)


class StreamSettings(Protocol):
    """What make_loader reads of the run config's data section."""

    num_workers: int  # resolved: no "auto" here
    shuffle_buffer: int
    resampled: bool


def make_loader(urls: list[str], data: StreamSettings, transform: Callable, batch_size: int, *, rank: int = 0,
                world: int = 1, seed: int = 0, one_pass: bool = False, pin_memory: bool = False,
                state: StreamState | None = None, labels: bool = True, class_names: Sequence[str] | None = None,
                stored_names: Sequence[str] = (), keep: Callable[[str], bool] | None = None) -> DataLoader:
    """A DataLoader over a ShardStream of `data`'s workers and shuffle buffer; `state` (from a checkpoint) continues
    a stream where it stopped.

    The training stream loops forever, drawing shards as data.resampled says; `one_pass` reads each rank's shards
    once, in order (evaluation). labels=False never reads labels (pretraining without them must not stop on one it
    cannot parse); class names map to ids through `class_names`, by default the shard set's own (`label_names`), and
    integer ids through `stored_names` where they are another set's (`LabelReader`).
    `keep` (of a sample key, `sample_key`) reads only the samples it accepts: one side of finetune.val_split.
    """
    num_workers, resampled, loop = data.num_workers, data.resampled and not one_pass, not one_pass
    if loop and not resampled:
        if len(urls) < world:
            raise DataError(f"{len(urls)} shards cannot give each of {world} processes one; write more shards or set data.resampled=true")
        # A looping worker without a shard would end the stream at once; cap workers so each gets one.
        num_workers = min(num_workers, len(urls) // world)
    state = state or StreamState()
    if labels:
        reader = LabelReader(tuple(label_names(tuple(urls)) if class_names is None else class_names), tuple(stored_names))
    summary = shard_summary(urls)
    per_shard = summary.samples / summary.shards if summary and summary.samples and summary.shards else None
    stream = ShardStream(urls, transform, batch_size, rank=rank, world=world, seed=seed,
                         resampled=resampled, shuffle_buffer=data.shuffle_buffer, loop=loop, start=state.positions,
                         worker_offset=state.batches % max(num_workers, 1), labels=reader if labels else None,
                         samples_per_shard=per_shard, drawn_from=state.drawn_from, keep=keep)
    # Its own generator: starting workers must not draw from the global RNG that drives corruption,
    # or a resumed run (which starts its loader after restoring RNG state) would diverge.
    return WorkerLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers else None,
                      generator=torch.Generator(), worker_init_fn=functools.partial(worker_signals, os.getpid()))


PASSED_ON = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}  # the stop signals a worker passes on to its trainer


class WorkerLoader(DataLoader):
    """A DataLoader whose workers start with the stop signals blocked (see worker_signals): a worker is forked from
    the thread that first iterates the loader and inherits its signal mask, as does every thread started in the
    worker before its init runs (torch starts one), which would otherwise take a signal meant for worker_signals'
    thread. The trainer's own mask is restored at once; a signal that came meanwhile is delivered then."""

    def __iter__(self):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def worker_signals(trainer: int, worker_id: int) -> None:
    """A dataloader worker's init: the signals that stop a run are its trainer's (pid `trainer`) to act on.

    Schedulers and launchers signal a run's process group or every process of it (torch's elastic agent sends
    SIGTERM to each rank's group, which holds the rank's workers), and a worker that died of it ended the run with
    `DataLoader worker (pid ...) exited unexpectedly` before the trainer reached its checkpoint. So a worker goes on
    delivering batches up to the step boundary where the trainer saves; a SIGTERM, SIGUSR1 or SIGUSR2 it gets from anyone but
    its trainer is passed on to the trainer (sent to the worker alone, it still stops the run; sent to every
    process, the trainer takes the repeat as nothing new), and SIGINT, which a terminal's Ctrl-C sends the trainer as
    well, is ignored.

    A SIGTERM from the trainer is its loader stopping a worker (one blocked on a stalled `pipe:` command does not stop
    when asked, and every worker is ended at exit): the worker ends its commands and exits. Only sigwaitinfo tells who
    sent a signal, so the worker's threads block the stop signals (WorkerLoader) and one thread takes them; a
    signal that still reaches the main thread (while it starts a `pipe:` command with SIGTERM unblocked,
    tars.CommandOutput) ends the worker as before.
    """
    forget_inherited_commands()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, end_commands_and_exit)
    signal.signal(signal.SIGUSR1, end_commands_and_exit)
    signal.signal(signal.SIGUSR2, end_commands_and_exit)
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    threading.Thread(target=take_signals, args=(trainer,), name="mpp-worker-signals", daemon=True).start()


def take_signals(trainer: int) -> None:
    """A worker's signal thread (see worker_signals)."""
    while True:
        sent = signal.sigwaitinfo(PASSED_ON)
        if sent.si_signo == signal.SIGTERM and sent.si_pid == trainer:
            end_commands_and_exit()
        try:
            os.kill(trainer, sent.si_signo)
        except ProcessLookupError:  # the trainer is gone: so is the reason to keep working
            end_commands_and_exit()
