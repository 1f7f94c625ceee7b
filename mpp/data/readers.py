"""How samples come off the disk: one `Reader` per on-disk format, chosen from `data.shards` (READERS).

The training stream (`mpp.data.ShardStream`) splits a data set into units, which it calls shards: the files a tar
set has, the images of an image folder, the files of a Parquet set. It hands the units of each rank and worker
to `read_samples`, which reads each through its reader; everything else (the split over ranks and workers, the
shuffle, the resume position, skip counting, the loss estimate of a unit that could not be read to its end) is the
stream's, the same for every format.

The contract of a reader (a `Reader` subclass and one line in READERS, `READERS["csv"] = CsvImageListReader()`; the
`fallback` reader, tar, is asked last and takes whatever is left: brace patterns, URLs, `pipe:` commands):

- `claims(spec)`: whether `data.shards=spec` is its kind of data set; `expand(spec)` -> its units (paths or any
  text its `reads` knows again: units are named in checkpoints' stream positions only by their order, and in
  sample keys by their base name);
- `images(units)`: how many images the units hold, without decoding them (train.epochs turns it into steps), or
  raise `Uncounted` saying why it cannot tell;
- `reads(url)`: whether a unit is its kind (a stream reads each unit through the reader that reads it);
- `samples(url, end)`: the unit's samples, each {"__key__": a key unique in the unit, "__url__": url, the image
  under one of IMAGE_KEYS as bytes, optionally the label under "cls" (an integer id or a class name, as text)},
  counting `end.samples` (and `end.good_bytes` where it can); what a damaged or unreadable unit raises is one of its
  `errors`, which end the unit with `ShardEnd.damage` (counted as unreadable_shard samples); a sample whose image
  does not decode is left to the stream, which skips it as undecodable_image;
- `label_members(url)`: {"__key__", "cls"} of each labelled sample, without reading images (label scans);
- `misplaced_label(url, key, neighbours)`: why an image without a label has none when its label is elsewhere.

Shards stay the better choice for large sets and for object stores: a tar is read in one sequential stream (a
folder costs an open per image), over any URL or `pipe:` command (the folder and Parquet readers read local paths),
with summary.json's counts beside it (the loss estimate of a damaged shard) and no metadata scan at start.
"""

from __future__ import annotations

import functools
import os
import tarfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from glob import glob
from pathlib import Path

from braceexpand import braceexpand
from webdataset.tariterators import base_plus_ext

from mpp.errors import DataError, command
from mpp.data.shardformat import IMAGE_KEYS, LABEL_KEYS, SHARD_SUFFIXES, is_remote, shard_summary
from mpp.data.tars import METADATA, READ_ERRORS, ShardEnd, members_apart, open_shard, tar_samples


class Reader(ABC):
    """One on-disk format of a data set (the module's docstring gives the contract)."""

    errors: tuple[type[BaseException], ...] = READ_ERRORS
    units: str = "shards"  # what its units are, for a run's start line ("on 12 shards", "on 1500 images")
    fallback: bool = False  # asked after every other reader, whatever READERS' order: it claims any spec

    @abstractmethod
    def claims(self, spec: str) -> bool: ...

    @abstractmethod
    def expand(self, spec: str) -> list[str]: ...

    @abstractmethod
    def reads(self, url: str) -> bool: ...

    @abstractmethod
    def samples(self, url: str, end: ShardEnd) -> Iterator[dict]: ...

    @abstractmethod
    def label_members(self, url: str) -> Iterator[dict]: ...

    def images(self, units: list[str]) -> int:
        raise Uncounted(f"holds {self.units} that cannot be counted without reading every image")

    def misplaced_label(self, url: str, key: str, neighbours: list[str]) -> str | None:
        return None


class Uncounted(DataError):
    """A data set whose images a reader cannot count before reading them; `remedy` adds a fix to the length in
    train.steps (the message says what is missing, after "data.shards (SPEC)")."""

    def __init__(self, reason: str, remedy: str = ""):
        super().__init__(reason)
        self.remedy = remedy


class TarReader(Reader):
    """WebDataset tars (mpp.data.shardformat), local or streamed (mpp.data.tars): a directory of them, a brace pattern, URLs or
    `pipe:` commands, several joined by '::'."""

    fallback = True

    def claims(self, spec: str) -> bool:
        return True

    def reads(self, url: str) -> bool:
        return True

    def expand(self, spec: str) -> list[str]:
        if os.path.isdir(spec):  # whole, first: a directory's name may hold braces or '::'
            shards = sorted(p for suffix in SHARD_SUFFIXES for p in glob(os.path.join(spec, f"*{suffix}")))
            if not shards:
                raise DataError(f"shard directory {spec} holds no {', '.join(SHARD_SUFFIXES)} files, no .parquet files "
                                f"and no images; write shards into it with `{command(f'prepare SOURCE --out {spec}')}`")
            check_local_shards(shards)
            return shards
        shards = []
        for part in map(str.strip, spec.split("::")):
            shards += self.expand(part) if os.path.isdir(part) else [url for url in braceexpand(part) if url]
        if not shards:
            raise DataError(f"shard spec '{spec}' names no shards; pass a directory, a brace pattern or URLs")
        check_local_shards([s for s in shards if not is_remote(s)])
        return shards

    def samples(self, url: str, end: ShardEnd) -> Iterator[dict]:
        with open_shard(url) as stream:
            yield from tar_samples(stream, end)

    def images(self, units: list[str]) -> int:
        """By the summary.json beside each directory's shards (`prepare` writes it). A summary counts the shards it
        lists (or, from an older mpp, its directory's) together, so where the units are only some of them (a brace
        pattern over part of a directory), or name some twice, those are counted from their tar headers."""
        by_directory: dict[str, list[str]] = {}
        for url in units:
            by_directory.setdefault(os.path.dirname(url), []).append(url)
        samples = 0
        for named in by_directory.values():
            summary = shard_summary(named)
            if summary is None or summary.samples is None:
                raise Uncounted(f"has no summary.json giving its samples beside {named[0]}",
                                f"or write the shards with `{command('prepare')}`, which writes one")
            listed = (summary.model_extra or {}).get("files") or [
                os.path.basename(url) for url in self.expand(os.path.dirname(named[0]) or ".")]
            whole = sorted(os.path.basename(url) for url in named) == sorted(listed)
            samples += summary.samples if whole else sum(map(samples_in, named))
        return samples

    def label_members(self, url: str) -> Iterator[dict]:
        """{"__key__": key, "cls"|"json"|"txt": bytes} per labelled sample of a local tar, skipping the image members."""
        sample: dict = {"__key__": None}
        try:
            with tarfile.open(url) as tar:
                for member in tar:
                    key, ext = base_plus_ext(member.name)  # as webdataset splits it: the key ends at the first dot
                    if key != sample["__key__"]:
                        if len(sample) > 1:
                            yield sample
                        sample = {"__key__": key}
                    if member.isreg() and ext and ext.lower() in LABEL_KEYS:
                        sample[ext.lower()] = tar.extractfile(member).read()
        except READ_ERRORS:
            pass  # an unreadable shard is the stream's to count
        if len(sample) > 1:
            yield sample

    def misplaced_label(self, url: str, key: str, neighbours: list[str]) -> str | None:
        """Where sample `key` of shard `url`, an image without a label, has its label in the wrong place: a member of
        the same shard not next to the image, or of a `neighbours` shard (local shards only); else None."""
        if is_remote(url):
            return None
        if key in labelled_keys(url):
            return members_apart(url, key, "its label is not next to its image")
        holder = next((other for other in neighbours if not is_remote(other) and key in labelled_keys(other)), None)
        return members_apart(url, key, f"its image is here and its label in {holder}") if holder else None


@functools.lru_cache(maxsize=16)
def labelled_keys(url: str) -> frozenset[str]:
    """The keys of a local shard's members that hold a label, from the tar headers alone."""
    keys = set()
    try:
        with tarfile.open(url) as tar:
            for member in tar:
                key, ext = base_plus_ext(member.name)
                if key is not None and ext.lower() in LABEL_KEYS:
                    keys.add(key)
    except READ_ERRORS:
        pass  # an unreadable shard is the stream's to count
    return frozenset(keys)


def check_local_shards(paths: list[str]) -> None:
    """Each path is a readable file: a directory, a dangling or looping link or a missing file is named, not streamed."""
    problems = {
        "does not exist": [p for p in paths if not os.path.lexists(p)],
        "is a symbolic link to nothing (dangling, or a loop)": [p for p in paths if os.path.islink(p) and not os.path.exists(p)],
        "is a directory, not a tar file": [p for p in paths if os.path.isdir(p)],
        "cannot be read (permissions)": [p for p in paths if os.path.isfile(p) and not os.access(p, os.R_OK)],
    }
    for problem, found in problems.items():
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise DataError(f"shard {found[0]}{more} {problem}; check data.shards or create the shards with `{command('prepare')}`")


IMAGE_SUFFIXES = tuple(f".{ext}" for ext in IMAGE_KEYS)


class ImageFolderReader(Reader):
    """A directory of images read as they are, as torchvision's ImageFolder reads it: the class of an image is the
    sub-folder of the directory it lies under, however deep (dog/puppies/1.jpg is a dog); hidden files and folders
    (.ipynb_checkpoints) are left out, as `prepare` leaves them out. Each image is a unit of one sample, so ranks and
    workers split the images themselves; its key is its path under the directory without the suffix.

    A unit is named `<directory>//<path under it>`: the doubled separator, which a walked path never holds, marks where
    the directory ends, so a unit alone (in a data worker, in a checkpoint's stream position) tells its class."""

    units = "images"

    def claims(self, spec: str) -> bool:
        return os.path.isdir(spec) and not _holds_shards(spec) and bool(self._images(spec))

    def reads(self, url: str) -> bool:
        return url.lower().endswith(IMAGE_SUFFIXES) and not is_remote(url)

    def expand(self, spec: str) -> list[str]:
        return self._images(spec)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _images(spec: str) -> list[str]:
        root = os.path.normpath(spec)
        return [f"{root}{FOLDER_MARK}{path.as_posix()}" for path in image_files(Path(root), IMAGE_SUFFIXES)]

    def images(self, units: list[str]) -> int:
        return len(units)

    def samples(self, url: str, end: ShardEnd) -> Iterator[dict]:
        with open(url, "rb") as file:
            data = file.read()
        end.good_bytes = len(data)
        yield {**self._labelled(url, named=False), "__url__": url, os.path.splitext(url)[1][1:].lower(): data}
        end.samples = 1

    def label_members(self, url: str) -> Iterator[dict]:
        sample = self._labelled(url, named=True)
        if "cls" in sample:
            yield sample

    @staticmethod
    def _labelled(url: str, named: bool) -> dict:
        """The unit's key and class. Only a label scan (`named`) refuses a class folder whose name is not text: a
        stream that reads no labels (MPP pretraining) must not stop on it, and one that does met the scan first."""
        root, _, path = url.rpartition(FOLDER_MARK)
        folder, _, _ = path.partition("/")
        key = os.path.splitext(path)[0]
        if folder == path:  # an image directly in the directory: in no class
            return {"__key__": key}
        if named:
            class_folder_name(folder, root)
        return {"__key__": key, "cls": folder.encode("utf-8", "surrogateescape")}


FOLDER_MARK = "//"


def class_folder_name(name: str, root: str | os.PathLike) -> str:
    """A class folder's name as a class name. It must be text (UTF-8), since names go into summary.json,
    predictions and exported models: a name in another encoding (os.fsdecode keeps its bytes as lone surrogates) is
    refused with one line naming the folder, rather than carried as a name no file can hold."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(os.path.join(root, name)).decode("utf-8", "backslashreplace")
        raise DataError(f"class folder {shown} has a name that is not UTF-8 text, which a class name must be; rename "
                        f"it in UTF-8 (`convmv -f latin1 -t utf8 -r --notest {os.fsencode(root).decode('utf-8', 'backslashreplace')}` "
                        f"renames every such name written in Latin-1)") from None
    return name


def image_files(root: Path, suffixes: Iterable[str]) -> list[Path]:
    """Image files (by suffix) under root as sorted relative paths, ignoring hidden files and folders
    (.ipynb_checkpoints): the images of a folder, alike for `prepare` and for reading the folder directly.

    Links to files are followed; links to folders once per folder, and never to a folder the walk reads anyway, to
    root or above it: those would read the same images again under another class, or forever (`ln -s .. loop`).
    """
    suffixes = {suffix.lower() for suffix in suffixes}

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
        found += [rel / n for n in names if not n.startswith(".") and Path(n).suffix.lower() in suffixes]
    if unfollowed:
        warnings.warn(f"not following {len(unfollowed)} folder link(s) under {root} to folders read already, to it or "
                      f"above it (first: {unfollowed[0]}); each image is read once, where it lies", stacklevel=3)
    return sorted(found)


def _holds_shards(directory: str) -> bool:
    return any(glob(os.path.join(directory, f"*{suffix}")) for suffix in SHARD_SUFFIXES)


PARQUET_IMAGE_COLUMNS = ("image", "img")  # where a Parquet set's image is, in this order (else its one binary column)
PARQUET_LABEL_COLUMNS = ("label", "labels", "fine_label", "cls")  # and its label, if it has one


class ParquetReader(Reader):
    """A directory of Parquet files (searched recursively) or one file, as the Hugging Face Hub stores image data
    sets: an image column (`image` or `img`, else the only binary one) holding the encoded image as bytes or as a
    {bytes, path} struct, and optionally a label column (`label`, `labels`, `fine_label` or `cls`) of class ids or
    names. Each file is a unit; its samples are its rows, keyed by their index in the file."""

    units = "Parquet files"

    BATCH_ROWS = 256  # rows decoded from Parquet at a time

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        import pyarrow

        return (*READ_ERRORS, pyarrow.ArrowException)

    def claims(self, spec: str) -> bool:
        return spec.endswith(".parquet") and os.path.isfile(spec) or (os.path.isdir(spec) and not _holds_shards(spec)
                                                                       and bool(self._files(spec)))

    def reads(self, url: str) -> bool:
        return url.endswith(".parquet") and not is_remote(url)

    def expand(self, spec: str) -> list[str]:
        return [spec] if os.path.isfile(spec) else self._files(spec)

    @staticmethod
    def _files(spec: str) -> list[str]:
        return sorted(glob(os.path.join(spec, "**", "*.parquet"), recursive=True))

    def images(self, units: list[str]) -> int:
        """The rows the files' footers give; a file that cannot be read counts none (the stream counts it as an
        unreadable shard)."""
        import pyarrow.parquet as pq

        rows = 0
        for url in units:
            try:
                rows += pq.ParquetFile(url).metadata.num_rows
            except self.errors:
                pass
        return rows

    def samples(self, url: str, end: ShardEnd) -> Iterator[dict]:
        for index, (image, label) in enumerate(self._rows(url, images=True)):
            sample = {"__key__": f"{index:08d}", "__url__": url, "jpg": image}  # PIL tells the format from the bytes
            yield sample if label is None else {**sample, "cls": str(label).encode()}
            end.samples += 1

    def label_members(self, url: str) -> Iterator[dict]:
        try:
            for index, (_, label) in enumerate(self._rows(url, images=False)):
                if label is not None:
                    yield {"__key__": f"{index:08d}", "cls": str(label).encode()}
        except self.errors:
            pass  # an unreadable file is the stream's to count

    def _rows(self, url: str, images: bool) -> Iterator[tuple[bytes | None, int | str | None]]:
        import pyarrow.parquet as pq

        file = pq.ParquetFile(url)
        image, label = parquet_columns(file.schema_arrow, url)
        columns = [c for c in ((image if images else None), label) if c]
        for batch in file.iter_batches(batch_size=self.BATCH_ROWS, columns=columns):
            rows = batch.to_pydict()
            labels = rows[label] if label else [None] * batch.num_rows
            pictures = rows[image] if images else [None] * batch.num_rows
            for picture, value in zip(pictures, labels):
                if isinstance(value, float) and value.is_integer():  # ids stored as floats (by pandas, beside a null)
                    value = int(value)
                yield (picture.get("bytes") if isinstance(picture, dict) else picture), value


def parquet_columns(schema, url: str) -> tuple[str, str | None]:
    """(image column, label column or None) of a Parquet file's `schema`."""
    import pyarrow as pa

    names = schema.names
    binary = [f.name for f in schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
              or (pa.types.is_struct(f.type) and f.type.get_field_index("bytes") >= 0)]
    image = next((n for n in PARQUET_IMAGE_COLUMNS if n in names), binary[0] if len(binary) == 1 else None)
    if image is None:
        raise DataError(f"Parquet file {url} has no image column: none is called {' or '.join(PARQUET_IMAGE_COLUMNS)} "
                        f"and {len(binary)} hold bytes ({', '.join(binary) or 'none'}); name the image column 'image'")
    if image not in binary:
        raise DataError(f"Parquet file {url} has a column '{image}' of {schema.field(image).type} values, not encoded "
                        f"images (bytes, or a {{bytes, path}} struct); rename it, and name the column of encoded "
                        f"images 'image'")
    return image, next((n for n in PARQUET_LABEL_COLUMNS if n in names), None)


# The readers, by name, in the order they are asked whether a data set is theirs (the fallback, tar, last).
READERS: dict[str, Reader] = {"parquet": ParquetReader(), "images": ImageFolderReader(), "tar": TarReader()}


def _asked() -> list[Reader]:
    return sorted(READERS.values(), key=lambda reader: reader.fallback)  # stable: READERS' order otherwise


def reader_for(spec: str) -> Reader:
    """The reader of `data.shards=spec`."""
    return next(reader for reader in _asked() if reader.claims(spec))


def reader_of(url: str) -> Reader:
    """The reader of one unit."""
    return next(reader for reader in _asked() if reader.reads(url))


def counted(urls: list[str]) -> str:
    """What a data set's units are, counted: "12 shards", "1500 images", "3 Parquet files"."""
    return f"{len(urls)} {reader_of(urls[0]).units if urls else Reader.units}"


def expand_shards(spec: str) -> list[str]:
    """A data set's units: a directory (of tars, Parquet files or images), a brace pattern, URLs or `pipe:` commands
    (several joined by '::')."""
    return reader_for(spec).expand(spec)


def read_samples(urls: Iterable[str], on_end: Callable[[ShardEnd], None]) -> Iterator[dict]:
    """Each unit's samples in turn, each through its reader, telling `on_end` how each unit ended.

    Only what its reader names as a damaged or unreadable unit's errors ends a unit early; any other exception goes on up.
    """
    for url in urls:
        reader, end = reader_of(url), ShardEnd(url)
        try:
            yield from reader.samples(url, end)
        except reader.errors as exc:
            end.damage = str(exc) or type(exc).__name__
        on_end(end)


def samples_in(url: str) -> int:
    """The samples of a local tar shard, counted from its tar headers (runs of members sharing a key); those before
    any damage, which the stream counts as it meets it."""
    samples, key = 0, None
    try:
        with tarfile.open(url) as tar:
            for member in tar:
                name = base_plus_ext(member.name)[0]
                if member.isreg() and name is not None and not METADATA.match(member.name) and name != key:
                    samples, key = samples + 1, name
    except READ_ERRORS:
        pass
    return samples
