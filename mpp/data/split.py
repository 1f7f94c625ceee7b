"""One labelled shard set as training and evaluation images: `finetune.val_split` holds out a fraction of each class
(stratified, drawn by the run's seed), which the training stream never yields and the evaluation reads alone.

The split is by sample key (the stream's: shard file / key within it), chosen from the labels of the local shards,
read without their images, identically on every process; both streams then filter on the key before decoding."""

from __future__ import annotations

import random
from dataclasses import dataclass

from mpp.data.shardformat import is_remote
from mpp.data.stream import BadLabel, DataError, LabelReader, label_members, sample_key


@dataclass(frozen=True)
class HeldOut:
    """The sample keys held out of training, and the images per class on each side."""

    keys: frozenset[str]
    fraction: float
    trained_counts: tuple[int, ...]  # training images per class, the held-out ones excluded
    held_counts: tuple[int, ...]  # held-out images per class

    def trained(self, key: str) -> bool:
        return key not in self.keys

    def evaluated(self, key: str) -> bool:
        return key in self.keys


def hold_out(urls: list[str], names: tuple[str, ...], classes: int, fraction: float, seed: int, spec: str) -> HeldOut:
    """`fraction` of each class's images of the shards `urls` (data.shards: `spec`), rounded, and at least one of
    every class with two or more, so each is both trained on and scored."""
    by_class: dict[int, list[str]] = {}
    reader = LabelReader(names)
    for url in urls:
        if is_remote(url):
            raise DataError(f"finetune.val_split reads the labels of data.shards ({spec}) before training to hold out "
                            f"part of each class, but {url} is streamed; set data.val_shards to labelled evaluation "
                            f"shards instead (and finetune.val_split=0), or copy the shards to local disk")
        for sample in label_members(url):
            try:
                label = reader(sample)
            except BadLabel:
                continue  # the stream skips and counts it
            by_class.setdefault(label, []).append(sample_key(url, sample["__key__"]))
    rng = random.Random(f"val_split-{seed}")
    held: list[str] = []
    trained_counts, held_counts = [0] * classes, [0] * classes
    for label in sorted(by_class):
        keys = sorted(by_class[label])
        rng.shuffle(keys)
        count = max(round(fraction * len(keys)), 1) if len(keys) > 1 else 0
        held.extend(keys[:count])
        if 0 <= label < classes:
            trained_counts[label], held_counts[label] = len(keys) - count, count
    return HeldOut(frozenset(held), fraction, tuple(trained_counts), tuple(held_counts))
