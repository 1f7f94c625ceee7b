"""Prepare stage: turn images from anywhere into WebDataset shards plus summary.json."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mpp.errors import command
from mpp.data.readers import READERS
from mpp.data.prepare_inputs import (Source, SourceError, SourceNotFoundError, bound_short_side, archive_samples, cifar_samples,
                                     folder_samples, hf_samples, idx_samples, is_cifar, is_image_archive, is_saved_dataset,
                                     name_classes, select_classes, synthetic_samples, warn_of_partial_imagenet)
from mpp.data.shardwriter import check_writable_dir, default_workers, write_shards

_IDX_IMAGES = re.compile(r"images([.-])idx3-ubyte(\.gz)?$")  # train-images-idx3-ubyte.gz, also MNIST's train-images.idx3-ubyte
_CIFAR_NAMES = re.compile(r"cifar-10-batches-py|cifar-100?-python")  # the names CIFAR's archives and folders come with
# IDX files store no class names, and MNIST's and Fashion-MNIST's files have the same names: the folders they are
# kept in tell them apart (Debian's /usr/share/datasets/fashion-mnist/, torchvision's FashionMNIST/raw/ and MNIST/raw/).
# A path part naming Fashion-MNIST (fashion and mnist, in any case and spelling) gives its ten names; else one naming
# mnist on its own (not KMNIST, EMNIST or QMNIST, whose classes differ) the digits.
_FASHION_MNIST_PATH = re.compile(r"fashion.?mnist", re.IGNORECASE)
_MNIST_PATH = re.compile(r"(?<![a-z])mnist", re.IGNORECASE)
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt", "Sandal", "Sneaker", "Bag", "Ankle boot"]
MNIST_CLASSES = [str(digit) for digit in range(10)]


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
    classes: list[int] | None = None,
    class_names: list[str] | None = None,
    workers: int | None = None,
) -> dict:
    """Write `source` as shards into `out`, print a one-line summary and return summary.json's content.

    source: 'synthetic' (count images of size px), CIFAR-10/100's python-version archive or folder, a save_to_disk
    directory, a folder of images, a tar of images (ImageNet's training archive of per-class tars), an MNIST-style *-images-idx3-ubyte(.gz) file (labels beside it), or a Hugging Face
    dataset name.
    short_side: store images whose short side exceeds it downsized to it, as JPEG at `quality`.
    classes: keep only the samples of these class ids, relabelled 0..k-1 in this order (a class split for transfer).
    class_names: the names of the source's class ids (id i: class_names[i]), instead of its own; `classes` keeps those
    of the classes it keeps.
    workers: processes encoding and writing shards (default: the cores this process may use); the shards are the
    same whatever the number.
    """
    if not 1 <= quality <= 100:
        raise SourceError(f"the JPEG quality must be 1-100, got {quality} (--quality)")
    check_writable_dir(Path(out))
    samples = open_source(source, size=size, count=count, split=split)
    if class_names is not None:
        samples = name_classes(samples, class_names)
    else:
        warn_of_partial_imagenet(samples)
    if classes is not None:
        samples = select_classes(samples, classes)
    if short_side is not None:
        samples = bound_short_side(samples, short_side, quality)
    summary = write_shards(samples, out, samples_per_shard=samples_per_shard, overwrite=overwrite, progress=True,
                           workers=default_workers() if workers is None else workers)
    skipped = f", skipped {summary['skipped']} unreadable" if summary["skipped"] else ""
    print(f"wrote {summary['samples']} samples ({summary['classes']} classes{skipped}) in {summary['shards']} shards, "
          f"{summary['bytes'] / 1e6:.1f} MB, to {out}")
    return summary


def fashion_mnist_fix() -> str:
    return ("on Debian or Ubuntu `apt-get install dataset-fashion-mnist` puts its IDX files in "
            "/usr/share/datasets/fashion-mnist/; online, "
            f"`{command('prepare zalando-datasets/fashion_mnist --split train')}` (or `--split test`) reads the same "
            "images from the Hugging Face hub")


def cifar_fix() -> str:
    return ("CIFAR-10 and CIFAR-100 come in no Debian or PyPI package: download the python version "
            "(cifar-10-python.tar.gz or cifar-100-python.tar.gz) from https://www.cs.toronto.edu/~kriz/cifar.html and "
            f"pass the archive or the folder it unpacks to; online, `{command('prepare uoft-cs/cifar10 --split train')}` "
            "(or `--split test`) reads CIFAR-10 from the Hugging Face hub")


@dataclass(frozen=True)
class SourceRequest:
    """What `mpp prepare` was asked to read: the source argument and the options a source may use."""

    source: str
    size: int = 64  # side of generated 'synthetic' images
    count: int = 20000  # images generated for 'synthetic'
    split: str = "train"  # split of a Hugging Face dataset or of CIFAR

    @property
    def path(self) -> Path:
        return Path(self.source).expanduser()


def idx_pair(request: SourceRequest) -> Source:
    path = request.path
    labels = path.with_name(_IDX_IMAGES.sub(r"labels\g<1>idx1-ubyte\g<2>", path.name))
    return idx_samples(path, labels, *idx_dataset(path))


def idx_dataset(path: Path) -> tuple[list[str] | None, str]:
    """(class names, dataset) of the IDX files at `path`, recognised by the folders and name in it: Fashion-MNIST,
    MNIST, or (None, "") for files of another dataset."""
    parts = path.absolute().parts
    if any(_FASHION_MNIST_PATH.search(part) for part in parts):
        return FASHION_MNIST_CLASSES, "Fashion-MNIST"
    if any(_MNIST_PATH.search(part) for part in parts):
        return MNIST_CLASSES, "MNIST"
    return None, ""


def image_folder(request: SourceRequest) -> Source:
    """The images of a folder; one of Parquet files (as the Hugging Face Hub stores image data sets) is refused with
    a line saying that a run reads it as it is. Looked for only once the folder turns out to hold no images: the
    search follows links, and a folder of images may hold a link loop."""
    try:
        return folder_samples(request.path)
    except SourceError:
        spec = str(request.path)
        if READERS["parquet"].claims(spec) and not READERS["images"].claims(spec):
            raise SourceError(f"{request.source} holds Parquet files, which a run reads as they are (data.shards="
                              f"{request.source}), so it needs no prepare; point prepare at a folder of images "
                              f"instead") from None
        raise


# The kinds of source `prepare` reads, tried in order: (recognises the request, opens it as a Source). A new kind is
# a function returning a Source (mpp/data/prepare_inputs.py) and one line here, before the hub name that takes whatever is left.
SOURCES: list[tuple[Callable[[SourceRequest], bool], Callable[[SourceRequest], Source]]] = [
    (lambda r: r.source == "synthetic", lambda r: synthetic_samples(r.count, r.size)),
    (lambda r: is_cifar(r.path), lambda r: cifar_samples(r.path, r.split)),
    (lambda r: r.path.is_dir() and is_saved_dataset(r.path), lambda r: hf_samples(r.path, r.split)),
    (lambda r: r.path.is_dir(), image_folder),
    (lambda r: is_image_archive(r.path), lambda r: archive_samples(r.path)),  # ImageNet's ILSVRC2012_img_train.tar
    (lambda r: bool(_IDX_IMAGES.search(r.path.name)), idx_pair),
    (lambda r: True, lambda r: hf_samples(r.source, r.split)),  # a dataset name on the Hugging Face hub
]


def open_source(source: str, *, size: int = 64, count: int = 20000, split: str = "train") -> Source:
    request = SourceRequest(source, size, count, split)
    if not request.path.exists() and "fashion-mnist" in source.lower():
        raise SourceNotFoundError(f"{source} does not exist; {fashion_mnist_fix()}")
    if not request.path.exists() and _CIFAR_NAMES.search(source):
        raise SourceNotFoundError(f"{source} does not exist; {cifar_fix()}")
    return next(open_ for recognises, open_ in SOURCES if recognises(request))(request)
