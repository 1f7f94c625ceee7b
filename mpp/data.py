"""Stream WebDataset shards (image under jpg/png/webp, optional cls label) as uint8 batches."""

from __future__ import annotations

import io
import math
import os
import random
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from glob import glob

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds
from webdataset.tariterators import tarfile_samples
from braceexpand import braceexpand
from einops import rearrange
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mpp.errors import UserError

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class DataError(UserError):
    """A user-facing problem with the shard set; the message names it and the fix."""


def expand_shards(spec: str) -> list[str]:
    """A directory, a brace pattern, URLs or `pipe:` commands (several joined by '::') -> shard list."""
    if os.path.isdir(spec):
        shards = sorted(glob(os.path.join(spec, "*.tar")))
        if not shards:
            raise DataError(f"shard directory {spec} holds no .tar files; write shards into it with `launch.py prepare SOURCE --out {spec}`")
        return shards
    shards = [url for part in spec.split("::") for url in braceexpand(part.strip()) if url]
    if not shards:
        raise DataError(f"shard spec '{spec}' names no shards; pass a directory, a brace pattern or URLs")
    local = [s for s in shards if not s.startswith("pipe:") and "://" not in s]
    missing = [s for s in local if not os.path.isfile(s)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"shard {missing[0]}{more} does not exist; check data.shards or create the shards with `launch.py prepare`")
    return shards


@dataclass
class Batch:
    images: torch.Tensor  # (B, 3, H, W) uint8
    labels: torch.Tensor  # (B,) int64, -1 where the sample has no cls
    skipped: Counter = field(default_factory=Counter)  # samples dropped since the previous batch, by reason
    worker: int = 0  # the logical worker that produced it
    position: StreamPosition | None = None  # that worker's stream position after this batch

    def pin_memory(self) -> Batch:
        return Batch(self.images.pin_memory(), self.labels.pin_memory(), self.skipped, self.worker, self.position)


# ---------------------------------------------------------------- decoding and augmentation


def open_image(sample: dict) -> Image.Image:
    key = next((k for k in IMAGE_KEYS if k in sample), None)
    if key is None:
        raise KeyError("no image")
    return Image.open(io.BytesIO(sample[key]))


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
    if img.mode != "RGB":
        img = img.convert("RGBA").convert("RGB") if img.mode in ("P", "LA", "PA") else img.convert("RGB")
    left, top = min(round(box[0]), img.size[0] - 1), min(round(box[1]), img.size[1] - 1)
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8))[top:bottom, left:right]  # (h, w, 3)
    crop = rearrange(pixels, "h w c -> 1 c h w")  # a channels-last view: the layout torch's fast kernel wants
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


@dataclass(frozen=True)
class TrainTransform:
    size: int
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True

    def __call__(self, img: Image.Image, rng: random.Random) -> torch.Tensor:
        image = crop_resize(img, random_resized_box(*img.size, self.crop_scale, rng), self.size)
        return image.flip(-1) if self.hflip and rng.random() < 0.5 else image


@dataclass(frozen=True)
class EvalTransform:
    """Centre square of the short side, resized: no augmentation."""

    size: int

    def __call__(self, img: Image.Image, rng: random.Random) -> torch.Tensor:
        return crop_resize(img, center_box(*img.size), self.size)


# ---------------------------------------------------------------- streaming

SHARDS_PER_GROUP = 8  # resampled streams draw shards in groups; a resume replays at most one group, undecoded


@dataclass(frozen=True)
class StreamPosition:
    """Where one worker's stream stands: `consumed` samples read in shard group `group`."""

    group: int = 0
    consumed: int = 0


@dataclass
class StreamState:
    """What a rank has consumed of its stream: enough to restart it exactly where it stopped."""

    batches: int = 0
    positions: dict[int, StreamPosition] = field(default_factory=dict)

    def advance(self, batch: Batch) -> None:
        self.batches += 1
        self.positions[batch.worker] = batch.position

    def state_dict(self) -> dict:
        return {"batches": self.batches, "positions": {w: (p.group, p.consumed) for w, p in self.positions.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]
        self.positions = {int(w): StreamPosition(*p) for w, p in state["positions"].items()}


class ShardStream(IterableDataset):
    """Batches from shards, split across ranks and dataloader workers.

    resampled: each (rank, worker) draws groups of shards with replacement forever, so no rank runs dry.
    otherwise: rank r takes shards r, r + world, ...; its worker w every num_workers-th of those; one group is
    one pass, which visits each sample of the shard set once across all ranks and workers. `loop` repeats passes.

    Randomness is keyed by (seed, rank, worker, group, sample index) and the shuffle buffer is emptied at group
    ends, so the stream is a pure function of those and can restart at any `StreamPosition` by reading, not
    decoding, the samples of the current group already consumed. `worker_offset` rotates which logical worker
    a DataLoader worker plays, so a resumed DataLoader (which always starts at worker 0) keeps the batch order.
    """

    def __init__(self, urls: list[str], transform: Callable, batch_size: int, *, rank: int = 0, world: int = 1,
                 seed: int = 0, resampled: bool = True, shuffle_buffer: int = 0, loop: bool = True,
                 start: dict[int, StreamPosition] | None = None, worker_offset: int = 0):
        super().__init__()
        self.urls, self.transform, self.batch_size = urls, transform, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.resampled, self.shuffle_buffer, self.loop = resampled, shuffle_buffer, loop
        self.start, self.worker_offset = start or {}, worker_offset

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers = info.num_workers if info else 1
        worker = ((info.id if info else 0) + self.worker_offset) % workers
        start = self.start.get(worker, StreamPosition())
        skipped: Counter = Counter()
        warned: set[str] = set()

        def skip(reason: str, detail: str) -> None:
            skipped[reason] += 1
            if reason not in warned:
                warned.add(reason)
                warnings.warn(f"skipping samples with {reason} (first: {detail}); counts are logged as data/skipped_*", stacklevel=2)

        def on_tar_error(exc: Exception) -> bool:
            skip("unreadable_shard", str(exc)[:200])
            return True

        images, labels = [], []
        last_group = 10**12 if self.loop or self.resampled else 1
        for group in range(start.group, last_group):
            key = f"{self.seed}-{self.rank}-{worker}-{group}"
            shards = self._group_shards(worker, workers, random.Random(key))
            if not shards:
                return
            samples = tarfile_samples(({"url": url} for url in shards), handler=on_tar_error)
            if self.shuffle_buffer:
                samples = wds.shuffle(self.shuffle_buffer, min(self.shuffle_buffer, 100), rng=random.Random(key))(samples)
            resume_at = start.consumed if group == start.group else 0
            for index, sample in enumerate(samples, start=1):
                if index <= resume_at:
                    continue
                try:
                    image = self.transform(open_image(sample), random.Random(f"{key}-{index}"))
                except KeyError:
                    skip("missing_image", sample.get("__key__", "?"))
                    continue
                except Exception as exc:
                    skip("undecodable_image", f"{sample.get('__key__', '?')}: {exc}")
                    continue
                images.append(image)
                labels.append(int(sample["cls"]) if "cls" in sample else -1)
                if len(images) == self.batch_size:
                    yield Batch(torch.stack(images), torch.tensor(labels), skipped.copy(), worker, StreamPosition(group, index))
                    images, labels = [], []
                    skipped.clear()
        if images:
            yield Batch(torch.stack(images), torch.tensor(labels), skipped.copy(), worker, StreamPosition(last_group, 0))

    def _group_shards(self, worker: int, workers: int, rng: random.Random) -> list[str]:
        if self.resampled:
            return [rng.choice(self.urls) for _ in range(SHARDS_PER_GROUP)]
        mine = self.urls[self.rank :: self.world][worker::workers]
        if self.shuffle_buffer:
            rng.shuffle(mine)
        return mine


def make_loader(urls: list[str], transform: Callable, batch_size: int, *, num_workers: int, rank: int = 0,
                world: int = 1, seed: int = 0, resampled: bool = True, shuffle_buffer: int = 0,
                loop: bool = True, pin_memory: bool = False, state: StreamState | None = None) -> DataLoader:
    """A DataLoader over a ShardStream; `state` (from a checkpoint) continues a stream where it stopped."""
    if loop and not resampled:
        if len(urls) < world:
            raise DataError(f"{len(urls)} shards cannot give each of {world} processes one; write more shards or set data.resampled=true")
        # A looping worker without a shard would end the stream at once; cap workers so each gets one.
        num_workers = min(num_workers, len(urls) // world)
    state = state or StreamState()
    stream = ShardStream(urls, transform, batch_size, rank=rank, world=world, seed=seed,
                         resampled=resampled, shuffle_buffer=shuffle_buffer, loop=loop, start=state.positions,
                         worker_offset=state.batches % max(num_workers, 1))
    # Its own generator: starting workers must not draw from the global RNG that drives corruption,
    # or a resumed run (which starts its loader after restoring RNG state) would diverge.
    return DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers else None,
                      generator=torch.Generator())
