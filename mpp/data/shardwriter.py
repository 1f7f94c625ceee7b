"""Write WebDataset shards: plain tars of `KEY.jpg|png|webp` plus optional `KEY.cls` (ASCII digits).

`write_shards` packs a `Source`'s samples (mpp.data.prepare_inputs) into `out_dir/{prefix}-000000.tar, ...` (in worker
processes, each writing whole shard-sized ranges of a source read by index) and records `summary.json` (which lists
the shard files) last, so a directory with a summary holds a complete shard set.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
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
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import webdataset as wds
from PIL import Image
from tqdm import tqdm

from mpp.data.prepare_inputs import Sample, Source, SourceError, Tally
from mpp.errors import Terminated, UserError
from mpp.data.shardformat import IMAGE_EXTS, SUMMARY
from mpp.rundir import too_long

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
    tally = Tally(on_input=lambda: bar.update(1))
    count, labels, files = _write_tars(_named_errors(source, tally, source.stored(tally)), pattern, per_shard)
    _warn_skipped(source, tally.unreadable)
    return count, labels, files, tally.unreadable


def _warn_skipped(source: Source, unreadable: list[str]) -> None:
    """One warning naming the first unreadable inputs, so they can be found in a big folder."""
    if unreadable:
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        warnings.warn(f"skipped {len(unreadable)} unreadable image(s) in {source.name}: {', '.join(unreadable[:3])}"
                      f"{more}; summary.json lists them all (unreadable)", stacklevel=4)


def _named_errors(source: Source, tally: Tally, samples: Iterator[Sample]) -> Iterator[Sample]:
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


def _write_range(source: Source, index: int, per_shard: int, staging: Path, tally: Tally) -> _Range:
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
            results.put(_write_range(source, index, per_shard, staging, Tally(start=index * per_shard, on_input=counted)))
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

