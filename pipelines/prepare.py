"""Prepare stage: turn images from anywhere into WebDataset shards plus summary.json."""

from __future__ import annotations

import re
from pathlib import Path

from mpp.shards import Source, SourceNotFoundError, bound_short_side, check_writable_dir, folder_samples, hf_samples, idx_samples, is_saved_dataset, synthetic_samples, write_shards

_IDX_IMAGES = re.compile(r"images([.-])idx3-ubyte(\.gz)?$")  # train-images-idx3-ubyte.gz, also MNIST's train-images.idx3-ubyte


def run(
    source: str,
    out: str,
    *,
    samples_per_shard: int = 1000,
    size: int = 64,
    count: int = 20000,
    split: str = "train",
    overwrite: bool = False,
    short_side: int | None = None,
    quality: int = 90,
) -> dict:
    """Write `source` as shards into `out`, print a one-line summary and return summary.json's content.

    source: 'synthetic' (count images of size px), a save_to_disk directory, a folder of images,
    an MNIST-style *-images-idx3-ubyte(.gz) file (labels beside it), or a Hugging Face dataset name.
    short_side: store images whose short side exceeds it downsized to it, as JPEG at `quality`.
    """
    check_writable_dir(Path(out))
    samples = open_source(source, size=size, count=count, split=split)
    if short_side is not None:
        samples = bound_short_side(samples, short_side, quality)
    summary = write_shards(samples, out,
                           samples_per_shard=samples_per_shard, overwrite=overwrite, progress=True)
    skipped = f", skipped {summary['skipped']} unreadable" if summary["skipped"] else ""
    print(f"wrote {summary['samples']} samples ({summary['classes']} classes{skipped}) in {summary['shards']} shards, "
          f"{summary['bytes'] / 1e6:.1f} MB, to {out}")
    return summary


FASHION_MNIST_FIX = ("on Debian or Ubuntu `apt-get install dataset-fashion-mnist` puts its IDX files in "
                     "/usr/share/datasets/fashion-mnist/; online, `launch.py prepare zalando-datasets/fashion_mnist "
                     "--split train` (or `--split test`) reads the same images from the Hugging Face hub")


def open_source(source: str, *, size: int = 64, count: int = 20000, split: str = "train") -> Source:
    if source == "synthetic":
        return synthetic_samples(count, size)
    path = Path(source).expanduser()
    if not path.exists() and "fashion-mnist" in source.lower():
        raise SourceNotFoundError(f"{source} does not exist; {FASHION_MNIST_FIX}")
    if path.is_dir():
        return hf_samples(path, split) if is_saved_dataset(path) else folder_samples(path)
    if _IDX_IMAGES.search(path.name):
        labels = path.with_name(_IDX_IMAGES.sub(r"labels\g<1>idx1-ubyte\g<2>", path.name))
        return idx_samples(path, labels)
    return hf_samples(source, split)
