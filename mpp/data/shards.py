"""Write WebDataset shards: plain tars of `KEY.jpg|png|webp` plus optional `KEY.cls` (ASCII digits).

Sources (a folder of images, a tar of images or of per-class tars, a Hugging Face dataset, MNIST-style IDX files,
CIFAR-10/100, the synthetic corpus) yield `Sample`s; `write_shards` packs them into `out_dir/{prefix}-000000.tar, ...`
(in worker processes, each writing whole shard-sized ranges of a source read by index) and records `summary.json`
(which lists the shard files) last, so a directory with a summary holds a complete shard set. Folder, archive and
Hugging Face sources come out in a fixed shuffled order, so every shard mixes classes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gzip
import io
import json
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Sized
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from mpp.data.readers import class_folder_name, image_files
from mpp.data.images import SIXTEEN_BIT_MODES, to_rgb, upright
from mpp.errors import Terminated, UserError
from mpp.data.shardformat import IMAGE_EXTS, SUMMARY
from mpp.rundir import too_long
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

    def stored(self, tally: _Tally, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
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
class _Tally:
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


def default_workers() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_shards(
    samples: Iterable[Sample],
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    prefix: str = "shard",
    overwrite: bool = False,
    progress: bool = False,
    workers: int = 1,
) -> dict:
    """Pack samples into tar shards under out_dir and write out_dir/summary.json (listing them); returns the summary.

    Sample i lands in shard i // samples_per_shard, in order, whatever `workers` is. With several workers an indexed
    source is split into shard-sized ranges of inputs, each read, encoded and written as a whole by one of `workers`
    processes (at most one per INPUTS_PER_WORKER inputs: a small source is written in this process). The shards are written into a hidden folder inside out_dir and moved into place only once all are
    complete, so a failure on the way (a full disk, a bad sample, Ctrl-C, SIGTERM) leaves out_dir as it was. One
    prepare at a time may write into out_dir: a second is refused, and the first to hold it removes the hidden folders
    a killed prepare left. overwrite=True replaces the shards an earlier write recorded in summary.json, and
    summary.json; other files in out_dir stay.
    """
    if samples_per_shard < 1:
        raise SourceError(f"the number of samples per shard must be at least 1, got {samples_per_shard} (--samples-per-shard)")
    if workers < 1:
        raise SourceError(f"the number of worker processes must be at least 1, got {workers} (--workers)")
    out = Path(out_dir)
    check_writable_dir(out)
    source = samples if isinstance(samples, Source) else Source("samples", len(samples) if isinstance(samples, Sized) else 0,
                                                                lambda: iter(samples))
    with _sigterm_raises():
        return _staged_write(source, out, samples_per_shard, prefix, overwrite, progress, workers)


def _staged_write(source: Source, out: Path, samples_per_shard: int, prefix: str, overwrite: bool, progress: bool,
                  workers: int) -> dict:
    """write_shards' work, once its arguments hold: staged in a hidden folder of out, then moved into place."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock, staging = _OutputLock(out), None
    bar = tqdm(total=len(source) or None, disable=not progress, unit="img", desc="writing shards")
    try:
        lock.acquire()
        _remove_left_staging(out)
        stale = _stale_outputs(out, prefix, overwrite)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=out))
        summary = _summary(source, staging, *_write_all(source, staging, prefix, samples_per_shard, workers, bar))
        (staging / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        files = summary["files"]
    except BaseException as exc:
        bar.close()  # ends its line, so an error message gets one of its own
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        lock.release()
        if created:
            with contextlib.suppress(OSError):  # only if nothing else came to be in it
                out.rmdir()
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise SourceError(f"cannot write the shards in {out} ({exc.strerror}); the partial shards were removed and "
                              f"{out} is as it was: free some space or choose another output directory (--out)") from None
        if isinstance(exc, Terminated):
            raise Terminated(f"stopped by SIGTERM; the partial shards were removed and {out} is as it was (prepare "
                             f"does not resume: run it again to write the shards)") from None
        raise
    bar.close()
    # Renames only from here on, which need no space. The old summary goes first and the new one comes last:
    # a directory caught half way must not look complete. A SIGTERM now is ignored: the moves take milliseconds,
    # and a finished set is worth more than a stop half way through them.
    with _ignoring_sigterm():
        try:
            for path in stale:
                path.unlink(missing_ok=True)
            for file in [*files, SUMMARY]:
                os.replace(staging / file, out / file)
            shutil.rmtree(staging)  # holds only the range files the shards were packed from, if any
        finally:
            lock.release()
    return summary


_STAGING = ".partial-shards-"  # the hidden folder of out_dir a write stages its shards in


def _remove_left_staging(out: Path) -> None:
    """Remove the staging folders a killed prepare left in out (its lock is held here, so no live prepare owns one),
    saying so."""
    left = sorted(out.glob(f"{_STAGING}*"))
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
    if left:
        warnings.warn(f"removed {len(left)} folder(s) of partial shards ({left[0].name}, ...) that a prepare killed "
                      f"before it finished left in {out}", stacklevel=3)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raised as Terminated wherever this (the main) thread is, so the cleanup a Ctrl-C gets (workers ended,
    staging folder and lock removed) runs for `timeout`, systemd or a scheduler too; by default the process would
    die at once and leave its workers writing. Elsewhere than the main thread nothing changes (Python delivers
    signals only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated("stopped by SIGTERM")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _ignoring_sigterm() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary(source: Source, staging: Path, count: int, labels: set[int], files: list[str], unreadable: list[str]) -> dict:
    """summary.json of the shards written into staging; a source that gave no image is refused."""
    if not count:
        raise SourceError(source.nothing_kept if source.nothing_kept and count + len(unreadable) < len(source) else
                          f"{source.name} holds no readable images; point the source at images or a non-empty dataset")
    summary = {
        "samples": count,
        "classes": len(labels),
        "labels": bool(labels),
        "shards": len(files),
        "bytes": sum((staging / file).stat().st_size for file in files),
        "source": source.name,
        "skipped": len(unreadable),
        "unreadable": unreadable,
        "files": files,
    }
    if source.class_names is not None:
        summary["class_names"] = source.class_names
    return {**summary, **_tally(staging / file for file in files)}


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # write errors that say the disk (or a quota) is full


class _OutputLock:
    """An exclusive flock on out/.prepare.lock holding the writer's pid, so two prepares never mix their shards in
    one directory: the second is refused. The kernel drops the lock when its process dies; the file goes when the
    lock is released."""

    NAME = ".prepare.lock"

    def __init__(self, out: Path):
        self.out, self.path, self.fd = out, out / self.NAME, None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise SourceError(f"another prepare (pid {holder}) is writing shards into {self.out}; wait for it to "
                                  f"end, stop it, or choose another output directory (--out)") from None
            try:  # opened as the last holder released it, the file may be gone: then lock the one now there
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before the lock goes, so a waiting prepare locks a file that stays
            os.close(self.fd)
            self.fd = None


# Inputs that pay for starting a worker process: the worker server loads webdataset (and with it torch), 1.1 s idle and
# several times that on a busy machine, and each worker unpickles the source, where one process checks a small JPEG in
# about a millisecond and downsizes a photo in 4-9 (docs/benchmarks.md, `prepare`: 150 small JPEGs, 5.3 s with two
# workers, 3.8 s without).
INPUTS_PER_WORKER = 1000


def _write_all(source: Source, staging: Path, prefix: str, per_shard: int, workers: int,
               bar: tqdm) -> tuple[int, set[int], list[str], list[str]]:
    """Write the shards into staging; returns the sample count, the distinct labels, the shard files and where the
    unreadable inputs lie."""
    pattern = staging / f"{prefix}-%06d.tar"
    ranges = -(-len(source) // per_shard)
    workers = min(workers, ranges, len(source) // INPUTS_PER_WORKER)
    if workers > 1 and source.indexed:
        payload = _picklable(source)
        if payload is not None:
            parts = _RangeWorkers(source.name, payload, staging, per_shard, workers, bar).write(ranges)
            if all(part.samples == per_shard for part in parts[:-1]):  # nothing dropped: range i is shard i already
                files = []
                for i, part in enumerate(parts):
                    if part.samples:
                        os.replace(staging / part.file, Path(str(pattern) % i))
                        files.append(Path(str(pattern) % i).name)
                count, labels = sum(p.samples for p in parts), set().union(*(p.labels for p in parts))
            else:  # some inputs were unreadable or left out: pack the ranges' samples into full shards
                count, labels, files = _write_tars(chain.from_iterable(_tar_samples(staging / p.file) for p in parts),
                                                   pattern, per_shard)
            unreadable = [name for part in parts for name in part.unreadable]
            _warn_skipped(source, unreadable)
            return count, labels, files, unreadable
    tally = _Tally(on_input=lambda: bar.update(1))
    count, labels, files = _write_tars(_named_errors(source, tally, source.stored(tally)), pattern, per_shard)
    _warn_skipped(source, tally.unreadable)
    return count, labels, files, tally.unreadable


def _warn_skipped(source: Source, unreadable: list[str]) -> None:
    """One warning naming the first unreadable inputs, so they can be found in a big folder."""
    if unreadable:
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        warnings.warn(f"skipped {len(unreadable)} unreadable image(s) in {source.name}: {', '.join(unreadable[:3])}"
                      f"{more}; summary.json lists them all (unreadable)", stacklevel=4)


def _named_errors(source: Source, tally: _Tally, samples: Iterator[Sample]) -> Iterator[Sample]:
    """`samples`, with an unexpected error made one line naming the input it met (a user's mistake, a full disk and
    an interrupt go on as they are)."""
    try:
        yield from samples
    except (UserError, OSError):
        raise
    except Exception as exc:
        raise SourceError(f"cannot prepare {tally.current or f'input {tally.start + tally.inputs}'} of {source.name} "
                          f"({type(exc).__name__}: {exc}); fix or remove that input") from exc


def _picklable(source: Source) -> bytes | None:
    """The source pickled for the worker processes, or None (with a warning) if it cannot be."""
    try:
        return pickle.dumps(source, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # a closure or a lambda: pickle raises AttributeError, TypeError or PicklingError
        warnings.warn(f"writing {source.name} in one process: its reader cannot be handed to worker processes "
                      f"({exc})", stacklevel=4)
        return None


@dataclass
class _Range:
    """A range of inputs written by a worker: its tar file in the staging folder and what it holds."""

    index: int
    file: str
    samples: int
    labels: set[int]
    unreadable: list[str]


def _write_range(source: Source, index: int, per_shard: int, staging: Path, tally: _Tally) -> _Range:
    """Inputs index * per_shard onwards, per_shard of them, as one tar written as a shard is."""
    file = f"inputs-{index:06d}.part"  # a tar, named apart from the shards whatever their prefix
    count, labels = 0, set()
    with wds.TarWriter(str(staging / file), encoder=False, mtime=0) as sink:
        for sample in _named_errors(source, tally, source.stored(tally, index * per_shard, (index + 1) * per_shard)):
            sink.write(_record(sample))
            count += 1
            if sample.label is not None:
                labels.add(sample.label)
    return _Range(index, file, count, labels, tally.unreadable)


def _tar_samples(path: Path) -> Iterator[Sample]:
    """The samples of a tar that _write_range wrote (each sample's members next to each other)."""
    with tarfile.open(path) as tar:
        key, members = None, {}
        for member in chain(tar, [None]):
            name = member.name.split(".", 1) if member is not None else None
            if key is not None and (name is None or name[0] != key):
                ext = next(ext for ext in IMAGE_EXTS if ext in members)
                label = int(members["cls"]) if "cls" in members else None
                yield Sample(key, members[ext], ext, label)
                members = {}
            if name is not None:
                key = name[0]
                members[name[1]] = tar.extractfile(member).read()


def _tally(tars: Iterable[Path]) -> dict:
    """What summary.json says of the written images besides their count: their short sides (min, median, max: a run
    compares its training resolution with them) and the images per class (a run's majority-class baseline). Reads
    each image's header only."""
    sides, per_class = [], {}
    for sample in chain.from_iterable(map(_tar_samples, tars)):
        with contextlib.suppress(OSError, ValueError):  # the training reader decides what an unreadable image is
            sides.append(min(Image.open(io.BytesIO(sample.image)).size))
        if sample.label is not None:
            per_class[sample.label] = per_class.get(sample.label, 0) + 1
    sides.sort()
    sizes = {"image_short_side": {"min": sides[0], "median": sides[len(sides) // 2], "max": sides[-1]}} if sides else {}
    counts = [per_class.get(label, 0) for label in range(max(per_class) + 1)] if per_class else None
    return {**sizes, **({"class_counts": counts} if counts else {})}


class _RangeWorkers:
    """Worker processes writing ranges of a source, each range as a whole, with one progress bar here.

    Workers ignore SIGINT and SIGTERM: Ctrl-C (sent to the whole process group) and a SIGTERM (to this process or
    its group) reach this process, which ends them all; if it is killed outright, they end themselves
    (_end_with_parent). An error in one ends them all too, and comes back here as one line.
    """

    POLL_S = 0.2

    def __init__(self, name: str, payload: bytes, staging: Path, per_shard: int, workers: int, bar: tqdm):
        # forkserver: workers start from a clean process (no threads of this one), with the modules loaded once
        methods = mp.get_all_start_methods()
        self.context = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self.context.set_forkserver_preload([__name__])
        self.name, self.payload, self.staging, self.per_shard, self.workers, self.bar = name, payload, staging, per_shard, workers, bar

    def write(self, ranges: int) -> list[_Range]:
        tasks, results, inputs = self.context.Queue(), self.context.Queue(), self.context.Value("q", 0)
        processes = [self.context.Process(target=_range_worker, daemon=True, name=f"prepare worker {i}",
                                          args=(self.payload, self.staging, self.per_shard, tasks, results, inputs))
                     for i in range(self.workers)]
        done: dict[int, _Range] = {}
        try:
            with _signals_held(signal.SIGINT, signal.SIGTERM):
                for process in processes:
                    process.start()
            for index in range(ranges):  # only now: the queue's feeder thread starts with the first put
                tasks.put(index)
            for _ in range(self.workers):
                tasks.put(None)
            while len(done) < ranges:
                try:
                    outcome = results.get(timeout=self.POLL_S)
                except queue.Empty:
                    outcome = None
                self.bar.update(inputs.get_obj().value - self.bar.n)  # unlocked: a killed worker may hold the lock
                if outcome is None:
                    ended = next((p for p in processes if p.exitcode not in (None, 0)), None)
                    if ended is not None:
                        how = (f"was killed by signal {-ended.exitcode} (out of memory, if it was SIGKILL)" if ended.exitcode < 0
                               else f"exited with code {ended.exitcode}")
                        raise SourceError(f"a prepare worker process {how} while writing {self.name}; no shard was "
                                          f"kept: run prepare again (with fewer --workers if memory was short)") from None
                    continue
                if isinstance(outcome, _Range):
                    done[outcome.index] = outcome
                else:
                    raise _worker_error(*outcome)
        finally:
            for process in processes:
                if process.is_alive() and len(done) < ranges:
                    process.kill()
            for process in processes:
                if process.pid is not None:  # started (an interrupt may come while they start)
                    process.join()
            tasks.cancel_join_thread()
            results.cancel_join_thread()
        return [done[index] for index in range(ranges)]


@contextlib.contextmanager
def _signals_held(*signals: signal.Signals) -> Iterator[None]:
    """`signals` noted and raised only at the end (by their handlers as they were), for starting workers: an
    exception raised inside Process.start() can leave a forked worker this process has no pid of, which no cleanup
    can end and which writes on (and prints a traceback once its queues are gone). Python runs a handler in the main
    thread whichever thread the signal reached (tqdm's monitor is one), so a handler notes them; the main thread
    blocks them too, so the worker server spawned now starts with them blocked, and with it every worker: a Ctrl-C
    to the group cannot end the server while it imports, and this process alone ends the workers. A signal this
    process ignores (a prepare started in the background) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {number: signal.signal(number, lambda number, frame: came.append(number))
                for number in signals if signal.getsignal(number) is not signal.SIG_IGN}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for number, handler in previous.items():
            signal.signal(number, handler)
        if came:
            signal.raise_signal(came[0])


def _worker_error(kind: str, message: str, number: int | None, reason: str | None) -> BaseException:
    """An error a worker reported, raised here as it was raised there (a full disk as an OSError)."""
    if kind == "os" and number in _DISK_FULL:
        return OSError(number, reason)
    return SourceError(message)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the next image instead of handing it back to the kernel (Linux;
    elsewhere nothing). A worker fresh from the server starts at malloc's small defaults and returns each image's
    buffers only to fault them in again for the next one: measured, 12% more CPU per image than in the process that
    has run for a while (benchmarks/prepare.py)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no mallopt): go on as before
        libc = ctypes.CDLL(None)
        libc.mallopt(M_TRIM_THRESHOLD, 128 << 20)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


def _end_with_parent() -> None:
    """End this worker as soon as the prepare that started it is gone, killed outright (SIGKILL, out of memory):
    else it writes on, unseen, into a folder nobody will move into place. A thread waits on the sentinel
    multiprocessing gives a child of its parent; the forkserver, this process's parent in the kernel's eyes, stays
    alive while its children hold its pipe, so the kernel's parent-death signal would never come."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), name="end with parent", daemon=True).start()


def _range_worker(payload: bytes, staging: Path, per_shard: int, tasks, results, inputs) -> None:
    # This process's parent handles Ctrl-C and SIGTERM (sent to the group, or to it alone) and ends the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent()
    _keep_freed_memory()
    source = pickle.loads(payload)

    def counted() -> None:
        with inputs.get_lock():
            inputs.value += 1

    while (index := tasks.get()) is not None:
        try:
            results.put(_write_range(source, index, per_shard, staging, _Tally(start=index * per_shard, on_input=counted)))
        except OSError as exc:
            results.put(("os", one_line_error(exc), exc.errno, exc.strerror))
            return
        except Exception as exc:
            results.put(("user", one_line_error(exc), None, None))
            return


def one_line_error(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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
    if tars and not overwrite:
        if any(path in tars for path in ours):
            kept = f" (the {len(foreign)} other .tar file(s) stay)" if foreign else ""
            raise SourceError(f"{out} already holds {len(tars)} .tar files; choose an empty output directory or pass "
                              f"overwrite (--overwrite) to replace the shards an earlier prepare wrote there{kept}")
        raise SourceError(f"{out} already holds {len(tars)} .tar files that prepare did not write, and a run on {out} "
                          f"would read them with the new shards; choose an empty output directory (--out)")
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
