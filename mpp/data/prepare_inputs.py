"""What `prepare` reads: its sources, each a `Source` of `Sample`s (a folder of images, a tar of images or of
per-class tars, a Hugging Face dataset, MNIST-style IDX files, CIFAR-10/100, the synthetic corpus), and the checks
and re-encoding a sample passes through before it is stored. Folder, archive and Hugging Face sources come out in a
fixed shuffled order, so every shard mixes classes. `mpp.data.shardwriter` packs a source into shards; the training
stream reads neither module (it reads through `mpp.data.readers`).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import tarfile
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image

from mpp.data.readers import class_folder_name, image_files
from mpp.data.images import SIXTEEN_BIT_MODES, to_rgb, upright
from mpp.errors import UserError
from mpp.data.synthetic import CLASS_NAMES, synthetic_image


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
    ext: str  # one of IMAGE_EXTS, or AS_FOUND: a file as found, checked (and re-encoded where need be) when stored
    label: int | None = None
    origin: str = ""  # where the input lies (a path), for messages; the key stands for it where empty


AS_FOUND = ""  # Sample.ext of a file as found in a folder, an archive or a dataset


@dataclass
class Source:
    """Samples from one place, plus what summary.json should say about them.

    `read()` yields every input in order, None for one that turned out unreadable. An `indexed` source's `read` also
    takes a range, `read(start, stop)`, and pickles: write_shards then hands shard-sized ranges of it to worker
    processes. Files as found are checked as they are stored, and re-encoded as JPEG unless `keep` lists their format;
    `steps` (label checks, class filters) run before that, so an image they leave out is never decoded.
    """

    name: str
    length: int  # inputs, readable or not
    read: Callable[..., Iterator[Sample | None]]
    class_names: list[str] | None = None
    indexed: bool = False
    keep: tuple[str, ...] = tuple(_FORMAT_EXTS)  # PIL formats of files as found that are stored byte for byte
    steps: tuple[Callable[[Sample], Sample | None], ...] = ()  # each returns the sample, or None to leave it out
    short_side: int | None = None  # images with a longer short side are stored downsized to it, as JPEG at quality
    quality: int = 90
    nothing_kept: str = ""  # the error when samples were read but the steps kept none
    empty_classes: tuple[str, ...] = ()  # classes listed with no image (an empty per-class tar), given no id

    def __len__(self) -> int:
        return self.length

    def stored(self, tally: Tally, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        """The samples of inputs start..stop-1 (all, for a source that is not indexed) as they are stored, each input
        counted in `tally`, unreadable ones as skipped."""
        for found in self.read(start, stop) if self.indexed else self.read():
            tally.next_input(found)
            sample = found
            for step in self.steps:
                if sample is None:
                    break
                sample = step(sample)
            stored = None if sample is None else self._encoded(sample)
            if stored is not None:
                yield stored
            elif found is None or sample is not None:  # unreadable (not merely left out by a step)
                tally.unreadable.append(found.origin or found.key if found else f"input {tally.start + tally.inputs - 1}")
            tally.current = ""

    def _encoded(self, sample: Sample) -> Sample | None:
        if sample.ext == AS_FOUND:
            encoded = _encoded(sample.image, self.keep, self.short_side, self.quality)
            return None if encoded is None else replace(sample, image=encoded[0], ext=encoded[1])
        if self.short_side is not None:
            image = bound_short_side_bytes(sample.image, self.short_side, self.quality)
            if image is not sample.image:
                return replace(sample, image=image, ext="jpg")
        return sample


@dataclass
class Tally:
    """What reading a range of a source came to: its inputs, the unreadable ones, the input being prepared (empty
    while the next is read)."""

    start: int = 0
    inputs: int = 0
    unreadable: list[str] = field(default_factory=list)  # where each unreadable input lies (its path), in order
    current: str = ""
    on_input: Callable[[], None] | None = None

    def next_input(self, found: Sample | None) -> None:
        self.inputs += 1
        self.current = f"input {self.start + self.inputs - 1}" + (f" ({found.origin or found.key})" if found else "")
        if self.on_input is not None:
            self.on_input()



def is_saved_dataset(path: str | os.PathLike) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())


def _jpeg(image: Image.Image, quality: int) -> bytes:
    """`image` as an RGB JPEG, upright (EXIF orientation applied, since the tag is not carried over), with 16-bit
    and floating-point greys scaled rather than clipped and transparency over mpp.data.images.BACKGROUND."""
    buffer = io.BytesIO()
    to_rgb(upright(image)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    upright(image).save(buffer, "PNG")
    return buffer.getvalue()


def _encoded(data: bytes, keep: Collection[str], short_side: int | None = None, quality: int = 90) -> tuple[bytes, str] | None:
    """(bytes, ext) to store a file as found: downsized to `short_side` as JPEG at `quality` where its short side is
    longer, else as it is if `keep` lists its format, else re-encoded as JPEG.

    16-bit images become 8-bit PNGs (scaled, lossless otherwise), so any reader of the shards sees the right greys;
    JPEGs keep their EXIF orientation tag, which the stream applies. None if PIL cannot decode the data.
    Everything is decoded once here, so a truncated file is dropped now rather than failing a training run;
    JPEGs decode at a reduced scale (1/8 to check one that is kept, which still reads every byte).
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            if short_side is not None and min(image.size) > short_side:
                return _bounded(image, short_side, quality), "jpg"
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
    return replace(source, name=f"{source.name}, short side <= {short_side} px", short_side=short_side, quality=quality)


@dataclass(frozen=True)
class _KeepClasses:
    """select_classes' step: a sample of a kept class relabelled by its position, others left out."""

    position: dict[int, int]
    source: str

    def __call__(self, sample: Sample) -> Sample | None:
        if sample.label is None:
            raise SourceError(f"--classes keeps labelled samples, but sample {sample.key} of {self.source} has no label; drop --classes for an unlabelled source")
        return replace(sample, label=self.position[sample.label]) if sample.label in self.position else None


def select_classes(source: Source, classes: list[int]) -> Source:
    """`source` with only the samples labelled one of `classes`, relabelled by position (classes[i] -> i), so a
    class split for transfer (upstream classes, downstream classes) gives each side a 0..k-1 label space."""
    if not classes or len(set(classes)) != len(classes) or min(classes) < 0:
        raise SourceError(f"--classes must list distinct non-negative class ids, got {classes}")
    names = source.class_names
    if names is not None and max(classes) >= len(names):
        raise SourceError(f"--classes names class {max(classes)}, but {source.name} has {len(names)} classes (0 to {len(names) - 1})")
    return replace(source, name=f"{source.name}, classes {','.join(map(str, classes))} as 0..{len(classes) - 1}",
                   class_names=None if names is None else [names[c] for c in classes],
                   steps=(*source.steps, _KeepClasses({label: i for i, label in enumerate(classes)}, source.name)),
                   nothing_kept=f"no sample of {source.name} is labelled with one of classes {classes}; list class ids the source has")


def bound_short_side_bytes(data: bytes, short_side: int, quality: int) -> bytes:
    """An encoded image -> itself if its short side is within `short_side`, else a downsized JPEG of it."""
    with Image.open(io.BytesIO(data)) as image:
        return data if min(image.size) <= short_side else _bounded(image, short_side, quality)


def _bounded(image: Image.Image, short_side: int, quality: int) -> bytes:
    """`image` (not yet loaded) downsized to `short_side`, upright, as a JPEG; a JPEG is decoded at the smallest
    DCT scale (1/2, 1/4, 1/8) that still leaves its short side at least `short_side`, not in full."""
    width, height = image.size
    scale = short_side / min(width, height)
    image.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
    image = upright(image)  # the re-encoded JPEG carries no EXIF orientation, so apply it to the pixels
    scale = short_side / min(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return _jpeg(to_rgb(image).resize(size, Image.LANCZOS), quality)


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
    """Images under root: class = first-level sub-folder, for the images at any depth under it (sorted names ->
    0..K-1), or unlabelled if all images sit directly in root. Hidden and non-image files are ignored; unreadable
    images are skipped and counted."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise SourceNotFoundError(f"image folder {root} does not exist; pass an existing directory of images")
    files = image_files(root, _IMAGE_SUFFIXES)
    if not files:
        raise SourceError(f"image folder {root} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))}); point it at a folder of images")
    classes = sorted({class_folder_name(f.parts[0], root) for f in files if len(f.parts) > 1})
    if classes and any(len(f.parts) == 1 for f in files):
        raise SourceError(f"image folder {root} has images both directly inside and in class sub-folders; move the loose images into a class folder or elsewhere")
    ids = {name: i for i, name in enumerate(classes)}
    keys = _safe_keys([f.with_suffix("").as_posix() for f in files])
    entries = _shuffled([(root / f, key, ids[f.parts[0]] if classes else None) for f, key in zip(files, keys)])
    return Source(f"folder {root}", len(entries), _Files(entries), class_names=classes or None, indexed=True)


@dataclass(frozen=True)
class _Files:
    """A folder source's reader: (path, key, label) entries, read by index range."""

    entries: list[tuple[Path, str, int | None]]

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample | None]:
        for path, key, label in self.entries[start:stop]:
            try:
                data = path.read_bytes()
            except OSError:  # a dangling link, no permission: unreadable like a corrupt file, so skipped and named
                data = b""
            yield Sample(key, data, AS_FOUND, label, str(path))


def synthetic_samples(n: int, size: int = 64) -> Source:
    """The first n images of the embedded synthetic corpus, as JPEG (quality 90)."""
    if n < 1 or size < 1:
        raise SourceError(f"the synthetic corpus needs a positive count and size, got {n} images of {size} px")

    return Source(f"synthetic ({n} images, {size} px)", n, _Synthetic(n, size), class_names=list(CLASS_NAMES), indexed=True)


@dataclass(frozen=True)
class _Synthetic:
    """The synthetic source's reader: images start..stop-1 of the corpus, as JPEG (quality 90)."""

    count: int
    size: int

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        for i in range(*slice(start, stop).indices(self.count)):
            image, label = synthetic_image(i, self.size)
            yield Sample(f"{i:08d}", _jpeg(image, 90), "jpg", label)


@dataclass(frozen=True)
class _Pixels:
    """An array source's reader (IDX, CIFAR): uint8 images (N, H, W) or (N, H, W, 3) as PNGs keyed by index."""

    pixels: np.ndarray
    labels: list[int]

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        for i in range(*slice(start, stop).indices(len(self.labels))):
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(self.pixels[i])).save(buffer, "PNG")
            yield Sample(f"{i:08d}", buffer.getvalue(), "png", self.labels[i])


_ARCHIVE_NAME = re.compile(r"\.(tar|tar\.gz|tgz|tar\.bz2|tar\.xz)$", re.IGNORECASE)
_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")


def is_image_archive(path: str | os.PathLike) -> bool:
    """A tar file (ImageNet's ILSVRC2012_img_train.tar: a tar of per-class tars; or a tar of class folders)."""
    path = Path(path)
    return path.is_file() and bool(_ARCHIVE_NAME.search(path.name))


def archive_samples(path: str | os.PathLike) -> Source:
    """The images in a tar, read in place: in tars inside it (class = the inner tar's name without .tar, as
    ImageNet's training archive holds n01440764.tar and so on; an inner tar without images is no class, and is listed
    in `empty_classes`) or in folders (class = the shallowest folder holding images that an image lies under), or
    all at its top level (unlabelled); hidden members (macOS's ._n01440764.tar) are left out. Only the headers are
    read to list them; the images are then read by position, in the fixed shuffled order folders get, so every shard
    mixes classes. A damaged inner tar keeps the images
    listed before the damage and counts as one unreadable input, with a warning naming it."""
    path = Path(path).expanduser()
    with open(path, "rb") as file:
        compressed = file.read(6).startswith(_COMPRESSED_MAGIC)
    if compressed:
        raise SourceError(f"{path} is compressed; prepare reads the images of an archive in place, in shuffled order, "
                          f"so decompress it first (gunzip, bunzip2 or unxz) and pass the .tar")
    if not tarfile.is_tarfile(path):
        raise SourceError(f"{path} is not a tar archive; pass a tar of images, of class folders or of per-class tars")
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(0)
        in_tars, in_folders, damaged, empty = [], [], [], []  # (offset, size, name for its key, class, where in the archive)
        for member, offset in _tar_files(file, size, str(path), damaged):
            if any(part.startswith(".") for part in Path(member.name).parts):  # ._n01440764.tar (macOS), .ipynb_checkpoints
                continue
            if member.name.lower().endswith(".tar"):
                where, label = f"{path}:{member.name}", Path(member.name).name[:-4]
                images = [(offset + image_offset, image.size, f"{label}/{image.name}", label, f"{member.name}/{image.name}")
                          for image, image_offset in _tar_files(_Window(file, offset, member.size), member.size, where, damaged)
                          if Path(image.name).suffix.lower() in _IMAGE_SUFFIXES]
                in_tars += images
                empty += [] if images else [label]
            elif Path(member.name).suffix.lower() in _IMAGE_SUFFIXES:
                in_folders.append((offset, member.size, member.name, Path(member.name).parent.parts, member.name))
    # An image in a folder is of the class of the shallowest folders that hold images, however deep under it it lies
    # (as torchvision's ImageFolder reads val/n01440764/extra/deep.JPEG: an n01440764), so a sub-folder is no class.
    depth = min((len(folders) for *_, folders, _ in in_folders if folders), default=0)
    found = in_tars + [(offset, length, name, folders[depth - 1] if folders else None, member)
                       for offset, length, name, folders, member in in_folders]
    if not found:
        raise SourceError(f"archive {path} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) in it or in tars in it; "
                          f"pass a tar of images, of class folders or of per-class tars")
    classes = sorted({class_folder_name(label, path) for *_, label, _ in found if label is not None})
    if classes and any(label is None for *_, label, _ in found):
        raise SourceError(f"archive {path} has images both at its top level and in class folders or tars; pass an "
                          f"archive with every image in a class, or none")
    ids = {name: i for i, name in enumerate(classes)}
    keys = _safe_keys([name.rsplit(".", 1)[0] for _, _, name, _, _ in found])
    entries = [(offset, length, key, ids.get(label), member) for (offset, length, _, label, member), key in zip(found, keys)]
    return Source(f"archive {path}", len(entries) + len(damaged), _Members(path, _shuffled(entries + [None] * len(damaged))),
                  class_names=classes or None, indexed=True, empty_classes=tuple(empty))


class _Window(io.RawIOBase):
    """Bytes start..start+length of a seekable file, as a file: an inner tar read where it lies."""

    def __init__(self, file, start: int, length: int):
        super().__init__()
        self.file, self.start, self.length, self.position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.position = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        wanted = max(0, min(len(buffer), self.length - self.position))
        self.file.seek(self.start + self.position)
        data = self.file.read(wanted)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def _tar_files(file, size: int, where: str, damaged: list[str]) -> Iterator[tuple[tarfile.TarInfo, int]]:
    """(member, offset of its data in `file`) for each regular file of the tar in `file` (size bytes), from its
    headers alone. A damaged header or a member cut short ends the listing: it is warned about and noted in `damaged`.
    Not listed, as not data: macOS's AppleDouble files (`._NAME`, the metadata its tar adds beside each file); an
    empty file (a placeholder .tar) holds none."""
    listed, reason = 0, None
    if size == 0:
        return
    try:
        tar = tarfile.open(fileobj=file, mode="r:")
        while (member := tar.next()) is not None:
            if member.offset_data + member.size > size:
                reason = f"{member.name} is cut short"
                break
            if member.isfile() and not Path(member.name).name.startswith("._"):
                listed += 1
                yield member, member.offset_data
        else:
            file.seek(tar.offset)
            if any(file.read(tarfile.BLOCKSIZE)):  # tarfile ends its listing quietly at a header it cannot read
                reason = f"a damaged header at byte {tar.offset}"
    except tarfile.TarError as exc:
        reason = f"a damaged header ({exc})"
    if reason is not None:
        warnings.warn(f"reading {where} stopped at {reason}; keeping the {listed} files listed before it, and counting "
                      f"the rest as one unreadable input", stacklevel=3)
        damaged.append(where)


@dataclass(frozen=True)
class _Members:
    """An archive source's reader: images at (offset, size) in an uncompressed tar; None marks a damaged inner tar."""

    path: Path
    entries: list[tuple[int, int, str, int | None, str] | None]

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample | None]:
        with open(self.path, "rb") as file:
            for entry in self.entries[start:stop]:
                if entry is None:
                    yield None
                    continue
                offset, size, key, label, member = entry
                file.seek(offset)
                data = file.read(size)
                yield Sample(key, data, AS_FOUND, label, f"{self.path}:{member}") if len(data) == size else None


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

    return Source(f"idx {images_idx_path}", len(images), _Pixels(images, labels.tolist()), class_names, indexed=True)


def name_classes(source: Source, names: list[str]) -> Source:
    """`source` with its class ids named: for a source that stores no names (IDX files, shards of ids), or to rename
    the classes of one that does.

    Lines that begin with the source's class names (ImageNet's LOC_synset_mapping.txt: `n01440764 tench, Tinca
    tinca`, one line per synset in ImageNet's standard order) are matched by that first word, and the ids follow
    the lines: a class that no line begins with is refused, and classes the source has no image of keep their ids
    (a warning names them). Otherwise id i is names[i]; every label must have a name."""
    if not names or not all(names) or len(set(names)) != len(names):
        raise SourceError(f"--class-names must list distinct, non-empty class names, got {names}")
    own, keys = source.class_names or [], [name.split(maxsplit=1)[0] for name in names]
    if set(own) & set(keys) and len(set(keys)) == len(keys):
        unknown = [name for name in own if name not in keys]
        if unknown:
            raise SourceError(f"{source.name} has class{'es' if len(unknown) > 1 else ''} {_listed(unknown)} that no "
                              f"line of --class-names begins with, though its lines begin with the source's class "
                              f"names ({keys[0]!r}, ...); list every class of the source")
        absent = [key for key in keys if key not in own]
        if absent:
            warnings.warn(f"{source.name} has no images of {len(absent)} of the {len(keys)} classes --class-names "
                          f"lists ({_listed(absent)}): ids follow the lines of --class-names, so those ids are kept, "
                          f"without images", stacklevel=2)
        position = {key: i for i, key in enumerate(keys)}
        return replace(source, class_names=list(names), empty_classes=(),
                       steps=(*source.steps, _Relabelled(tuple(position[name] for name in own))))
    if source.class_names is not None and len(names) > len(own):
        warnings.warn(f"--class-names names {len(names)} classes and {source.name} has {len(own)}: ids {len(own)} to "
                      f"{len(names) - 1} are named but have no images, and a model trained on these shards gets a "
                      f"head of {len(names)} classes", stacklevel=2)
    return replace(source, class_names=list(names), steps=(*source.steps, _NamedClasses(len(names), source.name)))


@dataclass(frozen=True)
class _Relabelled:
    """name_classes' step where lines are matched by name: the source's id i becomes ids[i]."""

    ids: tuple[int, ...]

    def __call__(self, sample: Sample) -> Sample:
        return sample if sample.label is None else replace(sample, label=self.ids[sample.label])


IMAGENET_CLASSES = 1000
_SYNSET = re.compile(r"n\d{8}")  # a WordNet synset id, as ImageNet names its classes


def warn_of_partial_imagenet(source: Source) -> None:
    """One warning where the classes of `source` are ImageNet synsets but not all 1000 of them (an archive missing a
    class tar, or with an empty one): its ids then follow its own synsets, sorted, and no longer ImageNet's."""
    names = source.class_names or []
    if not names or len(names) >= IMAGENET_CLASSES or not all(_SYNSET.fullmatch(name) for name in names):
        return
    empty = [name for name in source.empty_classes if _SYNSET.fullmatch(name)]
    held = f"; {_listed(empty)} hold{'s' if len(empty) == 1 else ''} no images" if empty else ""
    warnings.warn(f"{source.name} holds images of {len(names)} ImageNet synsets, not {IMAGENET_CLASSES}{held}: its "
                  f"class ids follow these {len(names)} in sorted order, not ImageNet's standard ids; to keep those, "
                  f"pass --class-names @LOC_synset_mapping.txt (ImageNet's list of synsets, in its order)", stacklevel=2)


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@dataclass(frozen=True)
class _NamedClasses:
    """name_classes' step: every label must have a name."""

    classes: int
    source: str

    def __call__(self, sample: Sample) -> Sample:
        if sample.label is not None and sample.label >= self.classes:
            raise SourceError(f"sample {sample.key} of {self.source} has label {sample.label}, but --class-names "
                              f"names {self.classes} classes (ids 0 to {self.classes - 1}); name every class")
        return sample


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

    return Source(f"{layout.corpus} {path} ({split})", len(labels), _Pixels(pixels, labels), class_names, indexed=True)


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
    ds = _load_hf(str(name_or_path), split)
    import datasets  # slow to import; only this source needs it, and a mistyped path is refused before it
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
    names = label_feature.names if isinstance(label_feature, datasets.ClassLabel) else None
    return Source(f"hf {name_or_path} ({split})", len(ds), _Rows(ds, _shuffled(list(range(len(ds)))), image_key, label_key),
                  class_names=names, indexed=True, keep=("JPEG",))


@dataclass(frozen=True)
class _Rows:
    """A Hugging Face source's reader: the rows at positions start..stop-1 of `order`, in batches."""

    ds: object  # a datasets.Dataset with undecoded images; it pickles as a reference to its Arrow files on disk
    order: list[int]
    image_key: str
    label_key: str | None

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        order = self.order[start:stop]
        for first in range(0, len(order), 256):  # batched reads: far faster than row by row on Arrow tables
            rows = order[first:first + 256]
            batch = self.ds[rows]
            labels = batch[self.label_key] if self.label_key else [None] * len(rows)
            for row, image, label in zip(rows, batch[self.image_key], labels):
                known = label if label is not None and label >= 0 else None  # ClassLabel marks a missing label -1
                yield Sample(f"{row:08d}", image["bytes"] or Path(image["path"]).read_bytes(), AS_FOUND, known)


def _load_hf(name: str, split: str):
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1):
        raise SourceNotFoundError(f"{name} does not exist; pass an existing path or a Hugging Face dataset name such as uoft-cs/cifar10")
    import datasets

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
