"""Write WebDataset shards: plain tars of `KEY.jpg|png|webp` plus optional `KEY.cls` (ASCII digits).

Sources (a folder of images, a Hugging Face dataset, MNIST-style IDX files, CIFAR-10/100, the synthetic corpus)
yield `Sample`s; `write_shards` packs them into `out_dir/{prefix}-000000.tar, ...` and records
`summary.json` (which lists the shard files) last, so a directory with a summary holds a complete shard set.
Folder and Hugging Face sources come out in a fixed shuffled order, so every shard mixes classes.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import os
import pickle
import re
import shutil
import tarfile
import tempfile
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Sized
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from mpp.data import SIXTEEN_BIT_MODES, upright
from mpp.errors import UserError
from mpp.shardformat import IMAGE_EXTS, SUMMARY
from mpp.rundir import too_long
from mpp.synthetic import CLASS_NAMES, synthetic_image

_FORMAT_EXTS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
_ORDER_SEED = 0  # fixed, so preparing the same source twice gives identical shards


class SourceError(UserError, ValueError):
    """A source or output that cannot be used as given; the message names it and the fix."""


class SourceNotFoundError(UserError, FileNotFoundError):
    """A source path that does not exist; the message names it and the fix."""


@dataclass(frozen=True)
class Sample:
    key: str  # unique within a shard set, without dots (webdataset splits member names at the first dot)
    image: bytes  # an encoded image file
    ext: str  # one of IMAGE_EXTS
    label: int | None = None


@dataclass
class Source:
    """Samples from one place, plus what summary.json should say about them.

    `read` yields None for an input that turned out unreadable; iterating counts those in `skipped`.
    """

    name: str
    length: int  # inputs, readable or not
    read: Callable[[], Iterator[Sample | None]]
    class_names: list[str] | None = None
    skipped: int = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Sample]:
        self.skipped = 0
        for sample in self.read():
            if sample is None:
                if not self.skipped:
                    warnings.warn(f"skipping unreadable images in {self.name}; the count is in summary.json", stacklevel=2)
                self.skipped += 1
            else:
                yield sample


def write_shards(
    samples: Iterable[Sample],
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    prefix: str = "shard",
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Pack samples into tar shards under out_dir and write out_dir/summary.json (listing them); returns the summary.

    The shards are written into a hidden folder inside out_dir and moved into place only once all are complete, so a
    failure on the way (a full disk, a bad sample, Ctrl-C) leaves out_dir as it was. overwrite=True replaces the
    shards an earlier write recorded in summary.json, and summary.json; other files in out_dir stay.
    """
    if samples_per_shard < 1:
        raise SourceError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    out = Path(out_dir)
    check_writable_dir(out)
    stale = _stale_outputs(out, prefix, overwrite)
    name = samples.name if isinstance(samples, Source) else "samples"
    bar = tqdm(samples, total=len(samples) if isinstance(samples, Sized) else None, disable=not progress, unit="img",
               desc="writing shards")
    stream = iter(bar)
    first = next(stream, None)  # before touching out_dir, so an empty source leaves it as it was
    if first is None:
        raise SourceError(f"{name} holds no readable images; point the source at images or a non-empty dataset")
    staging, created = None, not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-shards-", dir=out))
        tally = Tally()
        count, labels, files = _write_tars(tally.counted(chain([first], stream)), staging / f"{prefix}-%06d.tar", samples_per_shard)
        summary = {
            "samples": count,
            "classes": len(labels),
            "labels": bool(labels),
            "shards": len(files),
            "bytes": sum((staging / file).stat().st_size for file in files),
            "source": name,
            "skipped": samples.skipped if isinstance(samples, Source) else 0,
            "files": files,
        }
        if isinstance(samples, Source) and samples.class_names is not None:
            summary["class_names"] = samples.class_names
        summary.update(tally.summary())
        (staging / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    except BaseException as exc:
        bar.close()  # ends its line, so an error message gets one of its own
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):  # only if nothing else came to be in it
                out.rmdir()
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise SourceError(f"cannot write the shards in {out} ({exc.strerror}); the partial shards were removed and "
                              f"{out} is as it was: free some space or choose another output directory (--out)") from None
        raise
    # Renames only from here on, which need no space. The old summary goes first and the new one comes last:
    # a directory caught half way must not look complete.
    for path in stale:
        path.unlink(missing_ok=True)
    for file in [*files, SUMMARY]:
        os.replace(staging / file, out / file)
    staging.rmdir()
    return summary


class Tally:
    """What summary.json says of the images and labels written, besides their count: the images' short sides (min,
    median, max: a run compares its training resolution with them) and the images per class (a run's majority-class
    baseline). Reads each image's header only."""

    def __init__(self) -> None:
        self.short_sides: list[int] = []
        self.per_class: dict[int, int] = {}

    def counted(self, samples: Iterable[Sample]) -> Iterator[Sample]:
        for sample in samples:
            with contextlib.suppress(OSError, ValueError):  # the reader decides what an unreadable image is
                self.short_sides.append(min(Image.open(io.BytesIO(sample.image)).size))
            if sample.label is not None:
                self.per_class[sample.label] = self.per_class.get(sample.label, 0) + 1
            yield sample

    def summary(self) -> dict:
        sides = sorted(self.short_sides)
        sizes = {"image_short_side": {"min": sides[0], "median": sides[len(sides) // 2], "max": sides[-1]}} if sides else {}
        counts = [self.per_class.get(label, 0) for label in range(max(self.per_class) + 1)] if self.per_class else None
        return {**sizes, **({"class_counts": counts} if counts else {})}


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # write errors that say the disk (or a quota) is full


def check_writable_dir(out: Path) -> None:
    """Refuse, before any work, an output directory that cannot be created or written in."""
    reason = too_long(out)
    if reason:
        raise SourceError(f"output directory {out} cannot be created: {reason}; choose a shorter path (--out)")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == out else f"lies under {existing}, which is a file"
        raise SourceError(f"output directory {out} {where}; choose a directory path (--out)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise SourceError(f"cannot write in {existing} ({exc.strerror}) to create the shards in {out}; choose a "
                          f"writable output directory (--out)") from None


def _write_tars(samples: Iterable[Sample], pattern: Path, samples_per_shard: int) -> tuple[int, set[int], list[str]]:
    """Write the shards; returns the sample count, the distinct labels and the shard file names."""
    count, labels, files = 0, set(), []
    # A fixed mtime makes the tars byte-identical across runs; encoder=False because records are bytes already.
    with wds.ShardWriter(str(pattern), maxcount=samples_per_shard, verbose=0, encoder=False, mtime=0,
                         post=lambda path: files.append(Path(path).name)) as sink:
        for sample in samples:
            sink.write(_record(sample))
            count += 1
            if sample.label is not None:
                labels.add(sample.label)
    return count, labels, files


def _stale_outputs(out: Path, prefix: str, overwrite: bool) -> list[Path]:
    """What a rewrite of out replaces: summary.json and the shards it lists (a summary of an older mpp lists none:
    then the files named as write_shards names them). Refuses if out holds .tar files and overwrite is off, and
    keeps, saying so, the .tar files no write recorded."""
    tars = sorted(out.glob("*.tar"))
    if tars and not overwrite:
        raise SourceError(f"{out} already holds {len(tars)} .tar files; choose an empty output directory or pass overwrite (--overwrite) to replace them")
    summary = out / SUMMARY
    try:
        listed = json.loads(summary.read_text()).get("files") if summary.is_file() else None
    except (ValueError, AttributeError):  # not JSON, or not an object: no record of what was written
        listed = None
    shard_name = re.compile(rf"{re.escape(prefix)}-\d{{6}}\.tar")  # as _write_tars names them
    if isinstance(listed, list):
        ours = [out / name for name in listed if isinstance(name, str) and Path(name).name == name]
    else:
        ours = [path for path in tars if shard_name.fullmatch(path.name)]
    foreign = [path for path in tars if path not in ours]
    clashing = [path.name for path in foreign if shard_name.fullmatch(path.name)]
    if clashing:
        raise SourceError(f"{out} holds {clashing[0]}, named like the shards being written but not listed in its "
                          f"summary.json, so it may not be replaced; move it elsewhere or choose another output directory (--out)")
    if foreign:
        names = ", ".join(path.name for path in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        warnings.warn(f"keeping {names} in {out}: not written by prepare, so not replaced; a run on {out} reads every "
                      f".tar in it", stacklevel=3)
    return [summary, *ours]


def _record(sample: Sample) -> dict:
    if not sample.key or "." in sample.key:
        raise SourceError(f"sample key '{sample.key}' is empty or has a dot; webdataset keys must be non-empty and dot-free")
    if sample.ext not in IMAGE_EXTS:
        raise SourceError(f"sample {sample.key} has image type '{sample.ext}'; use one of {', '.join(IMAGE_EXTS)}")
    record = {"__key__": sample.key, sample.ext: sample.image}
    if sample.label is not None:
        if sample.label < 0:
            raise SourceError(f"sample {sample.key} has label {sample.label}; labels must be non-negative (None for none)")
        record["cls"] = str(sample.label).encode("ascii")
    return record


def is_saved_dataset(path: str | os.PathLike) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())


def _jpeg(image: Image.Image, quality: int) -> bytes:
    """`image` as an RGB JPEG, upright (EXIF orientation applied, since the tag is not carried over) and with
    16-bit greys scaled rather than clipped."""
    buffer = io.BytesIO()
    upright(image).convert("RGB").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    upright(image).save(buffer, "PNG")
    return buffer.getvalue()


def _encoded(data: bytes, keep: Collection[str]) -> tuple[bytes, str] | None:
    """(bytes, ext) to store: files in a `keep` format as they are, others re-encoded as JPEG.

    16-bit images become 8-bit PNGs (scaled, lossless otherwise), so any reader of the shards sees the right greys;
    JPEGs keep their EXIF orientation tag, which the stream applies. None if PIL cannot decode the data.
    Everything is decoded once here, so a truncated file is dropped now rather than failing a training run;
    JPEGs decode at 1/8 scale, which still reads every byte.
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.mode in SIXTEEN_BIT_MODES:
                return _png(image), "png"
            if image.format in keep:
                image.draft(image.mode, (1, 1))
                image.load()
                return data, _FORMAT_EXTS[image.format]
            return _jpeg(image, 95), "jpg"
    except Exception:  # PIL's plugins raise many types (OSError, SyntaxError, ValueError, ...) for broken files
        return None


def bound_short_side(source: Source, short_side: int, quality: int = 90) -> Source:
    """`source` with every image's short side at most `short_side` px: larger images are downsized (aspect kept)
    and stored as JPEG at `quality`; the rest pass unchanged. Training crops then decode a fraction of the pixels."""
    if short_side < 1 or not 1 <= quality <= 100:
        raise SourceError(f"the short-side bound must be a positive number of pixels and the JPEG quality 1-100, got {short_side} and {quality}")

    def read() -> Iterator[Sample | None]:
        for sample in source.read():
            if sample is None:
                yield None
                continue
            image = bound_short_side_bytes(sample.image, short_side, quality)
            yield sample if image is sample.image else Sample(sample.key, image, "jpg", sample.label)

    return Source(f"{source.name}, short side <= {short_side} px", source.length, read, source.class_names)


def select_classes(source: Source, classes: list[int]) -> Source:
    """`source` with only the samples labelled one of `classes`, relabelled by position (classes[i] -> i), so a
    class split for transfer (upstream classes, downstream classes) gives each side a 0..k-1 label space."""
    if not classes or len(set(classes)) != len(classes) or min(classes) < 0:
        raise SourceError(f"--classes must list distinct non-negative class ids, got {classes}")
    position = {label: i for i, label in enumerate(classes)}
    names = source.class_names
    if names is not None and max(classes) >= len(names):
        raise SourceError(f"--classes names class {max(classes)}, but {source.name} has {len(names)} classes (0 to {len(names) - 1})")

    def read() -> Iterator[Sample | None]:
        kept = 0
        for sample in source.read():
            if sample is None:
                yield None
            elif sample.label is None:
                raise SourceError(f"--classes keeps labelled samples, but sample {sample.key} of {source.name} has no label; drop --classes for an unlabelled source")
            elif sample.label in position:
                kept += 1
                yield Sample(sample.key, sample.image, sample.ext, position[sample.label])
        if not kept:
            raise SourceError(f"no sample of {source.name} is labelled with one of classes {classes}; list class ids the source has")

    return Source(f"{source.name}, classes {','.join(map(str, classes))} as 0..{len(classes) - 1}", source.length, read,
                  None if names is None else [names[c] for c in classes])


def bound_short_side_bytes(data: bytes, short_side: int, quality: int) -> bytes:
    """An encoded image -> itself if its short side is within `short_side`, else a downsized JPEG of it."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        if min(width, height) <= short_side:
            return data
        scale = short_side / min(width, height)
        image.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))  # JPEG: the smallest DCT scale still at least that
        image = upright(image)  # the re-encoded JPEG carries no EXIF orientation, so apply it to the pixels
        scale = short_side / min(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return _jpeg(image.convert("RGB").resize(size, Image.LANCZOS), quality)


def _safe_keys(names: list[str]) -> list[str]:
    """Dot-free, slash-free keys from relative paths, made unique with a numeric suffix where they collide."""
    keys, seen = [], set()
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        key, n = base, 1
        while key in seen:
            key, n = f"{base}_{n}", n + 1
        seen.add(key)
        keys.append(key)
    return keys


def _shuffled(items: list, seed: int = _ORDER_SEED) -> list:
    """Sources are often sorted by class; shards must mix classes for a shuffle buffer to do its job."""
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def folder_samples(root: str | os.PathLike) -> Source:
    """Images under root: class = first-level sub-folder (sorted names -> 0..K-1), or unlabelled if all
    images sit directly in root. Non-image files are ignored; unreadable images are skipped and counted."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise SourceNotFoundError(f"image folder {root} does not exist; pass an existing directory of images")
    files = _image_files(root)
    if not files:
        raise SourceError(f"image folder {root} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))}); point it at a folder of images")
    classes = sorted({f.parts[0] for f in files if len(f.parts) > 1})
    if classes and any(len(f.parts) == 1 for f in files):
        raise SourceError(f"image folder {root} has images both directly inside and in class sub-folders; move the loose images into a class folder or elsewhere")
    ids = {name: i for i, name in enumerate(classes)}
    keys = _safe_keys([f.with_suffix("").as_posix() for f in files])
    entries = _shuffled([(root / f, key, ids[f.parts[0]] if classes else None) for f, key in zip(files, keys)])

    def read() -> Iterator[Sample | None]:
        for path, key, label in entries:
            try:
                data = path.read_bytes()
            except OSError:  # a dangling link, no permission: unreadable like a corrupt file, so skipped and counted
                yield None
                continue
            encoded = _encoded(data, keep=_FORMAT_EXTS)
            yield None if encoded is None else Sample(key, *encoded, label)

    return Source(f"folder {root}", len(entries), read, class_names=classes or None)


def _image_files(root: Path) -> list[Path]:
    """Image files under root as sorted relative paths, ignoring hidden files and folders (.ipynb_checkpoints).

    Links to files are followed; links to folders once per folder, and never to a folder the walk reads anyway, to
    root or above it: those would read the same images again under another class, or forever (`ln -s .. loop`).
    """
    def visible(dirs: list[str]) -> list[str]:
        return sorted(d for d in dirs if not d.startswith("."))

    reached = set()  # the folders read without following any link
    for folder, dirs, _ in os.walk(root):
        dirs[:] = visible(dirs)
        reached.add(Path(folder).resolve())
    real_root, seen, found, unfollowed = root.resolve(), set(reached), [], []
    for folder, dirs, names in os.walk(root, followlinks=True):
        kept = []
        for name in visible(dirs):
            path = Path(folder) / name
            real = path.resolve()
            if not path.is_symlink() and real in reached:
                kept.append(name)
            elif real in seen or real_root.is_relative_to(real):
                unfollowed.append(path.relative_to(root))
            else:
                seen.add(real)
                kept.append(name)
        dirs[:] = kept
        rel = Path(folder).relative_to(root)
        found += [rel / n for n in names if not n.startswith(".") and Path(n).suffix.lower() in _IMAGE_SUFFIXES]
    if unfollowed:
        warnings.warn(f"not following {len(unfollowed)} folder link(s) under {root} to folders read already, to it or "
                      f"above it (first: {unfollowed[0]}); each image is read once, where it lies", stacklevel=3)
    return sorted(found)


def synthetic_samples(n: int, size: int = 64) -> Source:
    """The first n images of the embedded synthetic corpus, as JPEG (quality 90)."""
    if n < 1 or size < 1:
        raise SourceError(f"the synthetic corpus needs a positive count and size, got {n} images of {size} px")

    def read() -> Iterator[Sample]:
        for i in range(n):
            image, label = synthetic_image(i, size)
            yield Sample(f"{i:08d}", _jpeg(image, 90), "jpg", label)

    return Source(f"synthetic ({n} images, {size} px)", n, read, class_names=list(CLASS_NAMES))


def idx_samples(images_idx_path: str | os.PathLike, labels_idx_path: str | os.PathLike, class_names: list[str] | None = None,
                dataset: str = "") -> Source:
    """MNIST-style IDX files (raw or gzip), each image stored as a grayscale PNG. IDX files hold no class names:
    `class_names` are those of the `dataset` the files were recognised as (or None), checked against the labels."""
    images, labels = _read_idx(Path(images_idx_path), ndim=3), _read_idx(Path(labels_idx_path), ndim=1)
    if len(images) != len(labels):
        raise SourceError(f"{images_idx_path} holds {len(images)} images but {labels_idx_path} holds {len(labels)} labels; pass the matching pair")
    if not len(images):
        raise SourceError(f"{images_idx_path} holds no images; pass a non-empty IDX file")
    if class_names is not None and int(labels.max()) >= len(class_names):
        raise SourceError(f"{labels_idx_path} holds label {int(labels.max())}, but its path names it {dataset}, which has "
                          f"{len(class_names)} classes; pass the class names of its labels with --class-names")

    def read() -> Iterator[Sample]:
        for i, (pixels, label) in enumerate(zip(images, labels.tolist())):
            buffer = io.BytesIO()
            Image.fromarray(pixels, "L").save(buffer, "PNG")
            yield Sample(f"{i:08d}", buffer.getvalue(), "png", label)

    return Source(f"idx {images_idx_path}", len(images), read, class_names)


def name_classes(source: Source, names: list[str]) -> Source:
    """`source` with its class ids named (id i is names[i]): for a source that stores no names (IDX files, shards of
    ids), or to rename the classes of one that does. Every label must have a name."""
    if not names or not all(names) or len(set(names)) != len(names):
        raise SourceError(f"--class-names must list distinct, non-empty class names, got {names}")

    def read() -> Iterator[Sample | None]:
        for sample in source.read():
            if sample is not None and sample.label is not None and sample.label >= len(names):
                raise SourceError(f"sample {sample.key} of {source.name} has label {sample.label}, but --class-names "
                                  f"names {len(names)} classes (ids 0 to {len(names) - 1}); name every class")
            yield sample

    return Source(source.name, source.length, read, list(names))


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX array: two zero bytes, type 0x08, ndim, big-endian int32 sizes, then the data."""
    if not path.is_file():
        raise SourceNotFoundError(f"IDX file {path} does not exist; pass an existing *-idx{ndim}-ubyte(.gz) file")
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip magic: accept compressed files whatever their name
        data = gzip.decompress(data)
    if len(data) < 4 + 4 * ndim or data[:4] != bytes([0, 0, 0x08, ndim]):
        raise SourceError(f"{path} is not an unsigned-byte IDX file with {ndim} dimension(s); pass an MNIST-style idx{ndim}-ubyte file")
    shape = tuple(int(s) for s in np.frombuffer(data, ">i4", count=ndim, offset=4))
    values = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if values.size != np.prod(shape):
        raise SourceError(f"{path} declares shape {shape} but holds {values.size} values; the file is truncated or corrupt")
    return values.reshape(shape)


@dataclass(frozen=True)
class _CifarLayout:
    corpus: str
    meta: str  # the file that names the classes
    names_key: bytes
    labels_key: bytes
    splits: dict[str, tuple[str, ...]]


# The "python version" of CIFAR-10 and CIFAR-100 as its authors distribute it (https://www.cs.toronto.edu/~kriz/cifar.html):
# Python 2 pickles of dicts whose b"data" is an N x 3072 uint8 array, each row 1024 red, 1024 green then 1024 blue
# values over the 32 x 32 image, row by row. CIFAR-100's labels are its 100 fine classes.
_CIFAR = (
    _CifarLayout("CIFAR-10", "batches.meta", b"label_names", b"labels",
                 {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}),
    _CifarLayout("CIFAR-100", "meta", b"fine_label_names", b"fine_labels", {"train": ("train",), "test": ("test",)}),
)
_CIFAR_ARCHIVE = re.compile(r"cifar-100?-python\.tar\.gz$")


def is_cifar(path: str | os.PathLike) -> bool:
    """CIFAR-10's or CIFAR-100's python-version archive, or a folder holding its class list and one of its batches."""
    path = Path(path)
    if path.is_file():
        return bool(_CIFAR_ARCHIVE.search(path.name))
    return path.is_dir() and any((path / layout.meta).is_file() and any((path / name).is_file() for names in layout.splits.values() for name in names)
                                 for layout in _CIFAR)


def cifar_samples(path: str | os.PathLike, split: str = "train") -> Source:
    """CIFAR-10 or CIFAR-100, python version: the .tar.gz or the folder it unpacks to (cifar-10-batches-py,
    cifar-100-python). Images are stored as RGB PNGs in the files' order, keyed by their index in the split."""
    path = Path(path).expanduser()
    splits = sorted({name for layout in _CIFAR for name in layout.splits})
    if split not in splits:
        raise SourceError(f"CIFAR has no split '{split}'; pass one of {', '.join(splits)} (--split)")
    files = _cifar_files(path, {name for layout in _CIFAR for name in (layout.meta, *layout.splits[split])})
    layout = next((layout for layout in _CIFAR if layout.meta in files), None)
    if layout is None:
        raise SourceError(f"{path} holds neither batches.meta (CIFAR-10) nor meta (CIFAR-100); pass the python version's .tar.gz or the folder it unpacks to")
    missing = [name for name in layout.splits[split] if name not in files]
    if missing:
        raise SourceError(f"{path} lacks {', '.join(missing)} of the {layout.corpus} {split} split; unpack the whole archive again")
    names = _unpickle_cifar(files[layout.meta], layout.meta, path).get(layout.names_key)
    if not isinstance(names, list) or not names or not all(isinstance(name, bytes) for name in names):
        raise SourceError(f"{layout.meta} in {path} does not list the class names; download the python version again")
    class_names = [name.decode() for name in names]
    batches = [_cifar_batch(_unpickle_cifar(files[name], name, path), layout, len(class_names), f"{name} in {path}")
               for name in layout.splits[split]]
    pixels = np.concatenate([data for data, _ in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels = [label for _, batch_labels in batches for label in batch_labels]

    def read() -> Iterator[Sample]:
        for i, (image, label) in enumerate(zip(pixels, labels)):
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(image)).save(buffer, "PNG")
            yield Sample(f"{i:08d}", buffer.getvalue(), "png", label)

    return Source(f"{layout.corpus} {path} ({split})", len(labels), read, class_names)


def _cifar_files(path: Path, wanted: set[str]) -> dict[str, bytes]:
    """The wanted files of a CIFAR folder or archive, by base name; an archive is read in one pass."""
    if path.is_dir():
        return {name: (path / name).read_bytes() for name in wanted if (path / name).is_file()}
    try:
        with tarfile.open(path, "r|*") as archive:
            return {Path(member.name).name: archive.extractfile(member).read()
                    for member in archive if member.isfile() and Path(member.name).name in wanted}
    except (tarfile.TarError, OSError, EOFError) as exc:  # gzip reports a damaged stream as OSError or EOFError
        raise SourceError(f"cannot read {path} as a .tar.gz archive ({exc}); download it again") from None


class _CifarUnpickler(pickle.Unpickler):
    """Rebuilds the dicts, lists, numbers, byte strings and numpy arrays the CIFAR files hold, and nothing else: a pickle
    naming any other function could run code. The names are those numpy 1 (the files) and numpy 2 write."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"it calls {module}.{name}, which no CIFAR file does")
        return super().find_class(module, name)


def _unpickle_cifar(data: bytes, name: str, path: Path) -> dict:
    try:
        loaded = _CifarUnpickler(io.BytesIO(data), encoding="bytes").load()  # Python 2 strings come back as bytes
    except Exception as exc:  # pickle raises many types (UnpicklingError, EOFError, ValueError, ...) for a damaged file
        raise SourceError(f"{name} in {path} is not a CIFAR pickle ({exc}); download the python version again") from None
    if not isinstance(loaded, dict):
        raise SourceError(f"{name} in {path} is not a CIFAR pickle (it holds a {type(loaded).__name__}, not a dict); download the python version again")
    return loaded


def _cifar_batch(batch: dict, layout: _CifarLayout, classes: int, where: str) -> tuple[np.ndarray, list[int]]:
    """(N x 3072 uint8 pixels, N labels) of one batch, checked against the layout and the class count."""
    data, labels = batch.get(b"data"), batch.get(layout.labels_key)
    if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32
            or not isinstance(labels, list) or len(labels) != len(data)
            or not all(isinstance(label, int) and 0 <= label < classes for label in labels)):
        raise SourceError(f"{where} is not a {layout.corpus} batch (an N x 3072 uint8 'data' array and N labels below {classes}); download the python version again")
    return data, labels


def hf_samples(name_or_path: str | os.PathLike, split: str = "train", image_key: str | None = None, label_key: str | None = None) -> Source:
    """A Hugging Face dataset: a hub name, a local dataset directory, or a save_to_disk directory.

    The image column is the datasets.Image feature and the label the ClassLabel one, unless named.
    Stored JPEGs are kept as they are; other images are re-encoded as RGB JPEG (quality 95).
    """
    import datasets  # slow to import; only this source needs it

    ds = _load_hf(str(name_or_path), split)
    image_key = image_key or _pick_column(_columns_of(ds, datasets.Image), "image", name_or_path)
    if not isinstance(ds.features.get(image_key), datasets.Image):
        raise SourceError(f"column '{image_key}' of {name_or_path} is not an image column; pass one of {_columns_of(ds, datasets.Image)}")
    label_key = label_key or _default_label(ds, name_or_path)
    label_feature = ds.features.get(label_key)
    if label_key is not None and not _is_integer(label_feature):
        integers = [key for key, feature in ds.features.items() if _is_integer(feature)]
        raise SourceError(f"column '{label_key}' of {name_or_path} is not an integer label column; pass one of {integers} or none")
    # Undecoded images give the stored bytes: JPEGs need no re-encoding and every image is decoded once.
    ds = ds.select_columns([image_key] + ([label_key] if label_key else [])).cast_column(image_key, datasets.Image(decode=False))
    order = _shuffled(list(range(len(ds))))

    def read() -> Iterator[Sample | None]:
        for start in range(0, len(order), 256):  # batched reads: far faster than row by row on Arrow tables
            rows = order[start:start + 256]
            batch = ds[rows]
            labels = batch[label_key] if label_key else [None] * len(rows)
            for row, image, label in zip(rows, batch[image_key], labels):
                encoded = _encoded(image["bytes"] or Path(image["path"]).read_bytes(), keep=("JPEG",))
                known = label if label is not None and label >= 0 else None  # ClassLabel marks a missing label -1
                yield None if encoded is None else Sample(f"{row:08d}", *encoded, known)

    names = label_feature.names if isinstance(label_feature, datasets.ClassLabel) else None
    return Source(f"hf {name_or_path} ({split})", len(ds), read, class_names=names)


def _load_hf(name: str, split: str):
    import datasets

    path = Path(name).expanduser()
    if not path.exists() and (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1):
        raise SourceNotFoundError(f"{name} does not exist; pass an existing path or a Hugging Face dataset name such as uoft-cs/cifar10")
    if path.is_dir() and is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
    else:
        try:
            loaded = datasets.load_dataset(str(path) if path.exists() else name, split=split)
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"{name} is neither a local path nor a dataset on the Hugging Face hub ({exc}); check the name") from None
        except ConnectionError as exc:
            raise SourceError(f"cannot reach the Hugging Face hub for {name} ({exc}); check the network or pass a local path") from None
        except ValueError as exc:  # an unknown split, mostly
            raise SourceError(f"cannot load split '{split}' of {name}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SourceError(f"{name} has no split '{split}'; pass one of {list(loaded)}")
        loaded = loaded[split]
    if len(loaded) == 0:
        raise SourceError(f"split '{split}' of {name} is empty; pick a split that holds images")
    return loaded


def _is_integer(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.ClassLabel) or (isinstance(feature, datasets.Value) and "int" in feature.dtype)


def _columns_of(ds, kind: type) -> list[str]:
    return [key for key, feature in ds.features.items() if isinstance(feature, kind)]


def _default_label(ds, name) -> str | None:
    """The ClassLabel column, else an integer column called label(s), else None (unlabelled)."""
    import datasets

    candidates = _columns_of(ds, datasets.ClassLabel) or [k for k in ("label", "labels") if _is_integer(ds.features.get(k))]
    return _pick_column(candidates, "label", name) if candidates else None


def _pick_column(candidates: list[str], role: str, name) -> str:
    """The only candidate, or the one named after its role among several."""
    if len(candidates) == 1:
        return candidates[0]
    if role in candidates:
        return role
    found = ", ".join(candidates) or "none"
    raise SourceError(f"cannot tell which column of {name} holds the {role} (candidates: {found}); name it with {role}_key")
