"""Shard tars read sample by sample: a damaged or cut-short archive told from one that ended, and a `pipe:` shard's
command ended with its stream.

webdataset's own tar iterator is not used here, for three things it does that a training run cannot afford: it takes
a damaged member header (tarfile's rule) or a compressed stream cut short for the end of the archive, so a shard
silently yields fewer samples; it hands every exception to one handler, a stop signal's included; and it groups
members that are not next to each other into separate, broken samples without a word. A shard read here ends one of
three ways: at its end-of-archive blocks (compressed, at a trailer that verifies), with `ShardEnd.damage` saying why
not and how many bytes it could not read, or, laid out so that no sample can be read whole, with a DataError.
"""

from __future__ import annotations

import bz2
import collections
import contextlib
import gzip
import lzma
import math
import os
import re
import signal
import subprocess
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from webdataset.gopen import Pipe, gopen
from webdataset.tariterators import base_plus_ext

from mpp.errors import DataError, command

BLOCK = tarfile.BLOCKSIZE  # 512: tar headers and member data start on block boundaries
# What an unreadable, damaged or cut-short shard raises; anything else (a bug, a signal) is not the shard's.
READ_ERRORS = (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError)
COMPRESSED = {b"\x1f\x8b": gzip.open, b"BZh": bz2.open, b"\xfd7zXZ\x00": lzma.open}  # magic bytes -> reader
METADATA = re.compile(r"__[^/]*__($|/)")  # webdataset's own members (__key__ and the like), skipped as it skips them
DRAIN_CHUNK = 1 << 16  # small: a read that fails at a garbled stream's end (its check) takes the data it read with it
READ_SIZE = 16 * BLOCK  # what tarfile asks of the stream at a time
COMMAND_GRACE_S = 5  # a `pipe:` command told to stop gets this long before it is killed


@dataclass
class ShardEnd:
    """How reading one shard ended: `damage` is None for a shard read to its end, else what stopped it."""

    url: str
    samples: int = 0  # samples yielded
    good_bytes: int = 0  # tar bytes read before the damage
    damage: str | None = None
    lost_bytes: int | None = None  # tar bytes holding data after the damage, where the rest of the stream was read
    unread_fraction: float | None = None  # of a local file's bytes, where the damage stopped reading before its end


def shard_samples(urls: Iterable[str], on_end: Callable[[ShardEnd], None]) -> Iterator[dict]:
    """Each shard's samples ({"__key__", "__url__", extension: bytes}) in turn, telling `on_end` how each shard ended.

    Only what an unreadable or damaged shard raises ends a shard early; any other exception goes on up.
    """
    for url in urls:
        end = ShardEnd(url)
        try:
            with open_shard(url) as stream:
                try:
                    yield from tar_samples(stream, end)
                except READ_ERRORS:
                    end.unread_fraction = unread_fraction(stream)
                    raise
        except READ_ERRORS as exc:
            end.damage = str(exc) or type(exc).__name__
        on_end(end)


def unread_fraction(stream) -> float | None:
    """The part of a local file not yet read (a compressed shard's bytes, where the reader read them up to its
    damage); None for a stream of unknown size (a `pipe:` command, a URL) or one read to its end."""
    try:
        size, position = os.fstat(stream.fileno()).st_size, stream.tell()
    except (AttributeError, OSError, ValueError):
        return None
    return (size - position) / size if 0 < position < size else None


def tar_samples(stream, end: ShardEnd) -> Iterator[dict]:
    """The samples of one tar stream, members grouped by key (what precedes the first dot of the name) as webdataset
    groups them, then a check that the archive ended at its end-of-archive blocks."""
    tar_bytes = TarBytes(decompressed(stream))
    tar = tarfile.open(fileobj=tar_bytes, mode="r|", bufsize=READ_SIZE)
    sample: dict = {}
    seen: set[str] = set()
    stop = 0  # where the next header starts: the end of the last member's data
    for member in tar:
        data_blocks = member.isreg() or member.type not in tarfile.SUPPORTED_TYPES  # as tarfile itself skips them
        stop = member.offset_data + (math.ceil(member.size / BLOCK) * BLOCK if data_blocks else 0)
        key, ext = base_plus_ext(member.name)
        if not member.isreg() or key is None or METADATA.match(member.name):
            continue
        if sample and key != sample["__key__"]:  # the previous sample is whole: out before this member is read
            end.good_bytes = member.offset
            yield sample
            end.samples += 1
            sample = {}
        if not sample:
            if key in seen:
                raise DataError(members_apart(end.url, key, f"{member.name} comes after other samples' members"))
            seen.add(key)
            sample = {"__key__": key, "__url__": end.url}
        ext = ext.lower()
        if ext in sample:
            raise DataError(f"shard {end.url} holds two members for {ext!r} of sample {key} ({member.name}), as a tar "
                            f"appended to with `tar rf` does; rewrite it with each member once (`{command('prepare')}`)")
        sample[ext] = tar.extractfile(member).read()
    end.good_bytes = stop
    if sample:
        yield sample
        end.samples += 1
    end.damage, end.lost_bytes = archive_end(tar_bytes, stop)


def members_apart(url: str, key: str, detail: str) -> str:
    """The message for a sample whose members are not next to each other in its shard."""
    return (f"shard {url} holds the members of sample {key} apart ({detail}): a sample is read from consecutive "
            f"members of one tar, so a tar made with `tar cf x.tar *.png *.cls` (every image, then every label) or a "
            f"sample split over two shards cannot be read; write each sample's files next to each other, e.g. "
            f"`tar cf x.tar --sort=name -C DIR .` with GNU tar, or write the shards with `{command('prepare')}`")


def archive_end(tar_bytes: TarBytes, stop: int) -> tuple[str | None, int | None]:
    """(damage, lost bytes) of a tar that tarfile stopped reading at `stop`; (None, None) for an archive that ended.

    tarfile stops at the first block that is not a valid header, and takes an empty one (the end-of-archive blocks)
    and a damaged one alike for the end. The rest of the stream tells them apart: after the end it holds only zeros
    (the second end block, padding); after damage it holds data. Reading it to the end also has a compressed shard's
    trailer checked (a damaged or cut-short one raises) and a `pipe:` command's exit status.
    """
    first = last = None  # first and last data (non-zero) byte from `stop` on
    length = stop
    try:
        for offset, chunk in tar_bytes.rest(stop):
            length = offset + len(chunk)
            data = chunk.rstrip(b"\0")
            if data:
                last = offset + len(data)
                if first is None:
                    first = offset + len(chunk) - len(chunk.lstrip(b"\0"))
    except READ_ERRORS as exc:  # a compressed stream whose check fails after the rest was read (garbled), a failed command
        lost = last - stop if last is not None else (0 if length >= stop + BLOCK else None)  # 0: its end blocks came whole
        return str(exc) or type(exc).__name__, lost
    if length < stop + BLOCK:  # not one whole block after the last member: what followed is gone
        return f"no end-of-archive blocks: it ends at tar byte {length}, cut short", None
    if first is not None and first < stop + BLOCK:
        return f"a damaged member header at tar byte {stop}", last - stop
    if first is not None:
        return f"data after its end-of-archive blocks, at tar byte {first} (two tars joined, or a damaged header)", last - first
    return None, None


class TarBytes:
    """The tar byte stream tarfile reads: it counts the bytes handed over and keeps the last chunks (at least KEEP
    bytes), so that the block tarfile stopped at, and everything after it, can still be read (`rest`)."""

    KEEP = 2 * READ_SIZE + BLOCK  # tarfile reads at most one READ_SIZE past the block it parses

    def __init__(self, stream) -> None:
        self.stream, self.position = stream, 0
        self.kept: collections.deque[bytes] = collections.deque()
        self.kept_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.position += len(data)
        self.kept.append(data)
        self.kept_bytes += len(data)
        while self.kept_bytes - len(self.kept[0]) >= self.KEEP:
            self.kept_bytes -= len(self.kept.popleft())
        return data

    def rest(self, offset: int) -> Iterator[tuple[int, bytes]]:
        """(offset, chunk) from `offset` (at most KEEP bytes back) to the end of the stream."""
        kept_from = self.position - self.kept_bytes
        if offset < kept_from:
            raise ValueError(f"tar byte {offset} is no longer held (from {kept_from} on)")
        yield offset, b"".join(self.kept)[offset - kept_from:]
        while chunk := self.stream.read(DRAIN_CHUNK):
            yield self.position, chunk
            self.position += len(chunk)


def decompressed(stream):
    """`stream` as tar bytes: gzip, bzip2 and xz streams (told by their magic bytes) are decompressed."""
    head = stream.read(6)
    stream = Replayed(stream, head)
    opener = next((open_ for magic, open_ in COMPRESSED.items() if head.startswith(magic)), None)
    return opener(stream) if opener else stream


class Replayed:
    """A stream whose first bytes were read to tell its format, served again first."""

    def __init__(self, stream, head: bytes) -> None:
        self.stream, self.head = stream, head

    def read(self, size: int = -1) -> bytes:
        if 0 <= size <= len(self.head):
            data, self.head = self.head[:size], self.head[size:]
            return data
        data, self.head = self.head, b""
        return data + self.stream.read(-1 if size < 0 else size - len(data))


# ---------------------------------------------------------------- opening a shard


@contextlib.contextmanager
def open_shard(url: str) -> Iterator:
    """A shard's bytes: a local file, a `pipe:` command's output, or a URL as webdataset opens it (curl and the like).

    The commands behind a stream end with it: a `pipe:` command runs in a process group of its own, which is ended
    whole (the shell and whatever it started, a `sleep` as much as a `curl | ...`) when the stream closes, however it
    closes: read to the end, dropped early, or unwound by a signal.
    """
    if url.startswith("pipe:"):
        command = CommandOutput(url[len("pipe:"):])
        try:
            yield command
        finally:
            command.end()
        return
    stream = gopen(url)
    try:
        yield stream
    finally:
        if isinstance(stream, Pipe) and stream.proc.poll() is None:
            stream.proc.kill()
        with contextlib.suppress(OSError):  # a Pipe's close reports the status of the command just killed
            stream.close()


class CommandOutput:
    """The stdout of a `pipe:` shard's command; its end raises OSError when the command failed.

    Only the process that started the command (`owner`) signals or reaps it. A forked dataloader worker holds a copy
    of every stream its parent had open, and its copy ended (collected, closed) must leave the command to the parent,
    who may still be reading it, and whose ended command's group id may be another's by then (pids wrap at 32768 on
    many machines): it only closes its own end of the pipe.
    """

    running: set[CommandOutput] = set()  # of this process, for a worker told to stop (`end_commands_and_exit`)

    def __init__(self, command: str) -> None:
        self.command = command
        self.owner = os.getpid()
        # A command starts with the signal mask of the thread starting it: a dataloader worker blocks SIGTERM (to
        # learn who sent it, mpp.data.worker_signals), and a command that kept it blocked would outlive its end().
        unblocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        try:
            self.process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, start_new_session=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        self.running.add(self)

    def read(self, size: int = -1) -> bytes:
        data = self.process.stdout.read(size)
        if not data and size:
            status = self.process.wait()
            if status:
                raise OSError(f"`{self.command}` exited with status {status}")
        return data

    def signal(self, signum: int) -> None:
        """Send `signum` to the command's process group: the shell and whatever it started. Not once its output was
        read to the end and its shell reaped: nothing of it writes any more, and the group's id may already be
        another's (pids wrap at 32768 on many machines), so a stream dropped after its last sample and ended by the
        garbage collector long after could kill the `pipe:` command of a stream started since. Nor from a process
        that did not start it (see the class)."""
        if self.process.returncode is not None or os.getpid() != self.owner:
            return
        with contextlib.suppress(ProcessLookupError):  # every process of the group has exited already
            os.killpg(self.process.pid, signum)

    def end(self) -> None:
        """Stop the command's process group (SIGTERM, then SIGKILL after COMMAND_GRACE_S) and reap it; in another
        process than its owner, close that process's end of its output and no more."""
        if os.getpid() != self.owner:
            self.process.stdout.close()
            return
        self.signal(signal.SIGTERM)
        self.process.stdout.close()
        try:
            self.process.wait(COMMAND_GRACE_S)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait()
        self.running.discard(self)


def forget_inherited_commands() -> None:
    """In a forked dataloader worker: its copy of its parent's commands, which are not its own to end."""
    CommandOutput.running.clear()


def end_commands_and_exit(signum: int = signal.SIGTERM, frame=None) -> None:
    """What a dataloader worker does when its loader stops it with SIGTERM (a worker that does not stop when asked,
    one blocked on a stalled `pipe:` command, and every worker at exit; mpp.data.worker_signals): it ends its
    commands' process groups, which would otherwise go on running without a parent, then exits 0, as torch's own
    worker exits on its loader's SIGTERM: the loader takes any other end for a worker that failed."""
    for running in list(CommandOutput.running):
        running.signal(signal.SIGTERM)
    os._exit(0)


# ---------------------------------------------------------------- what a damaged shard lost


@dataclass
class LossEstimate:
    """How many samples a shard that could not be read to its end lost, at least one, from the best of:
    the bytes it could not read at the bytes per sample of what was read (this shard's, else the stream's so far);
    summary.json's samples per shard (`per_shard`); the mean of the shards read whole so far; the part of a local
    file left unread, at the samples per byte read before it; else as many samples as the shard yielded. Each shard's
    end is `record`ed after it is estimated."""

    per_shard: float | None = None
    samples: int = 0
    good_bytes: int = 0
    whole_shards: int = 0
    whole_samples: int = 0

    def lost(self, end: ShardEnd) -> int:
        samples, good_bytes = (end.samples, end.good_bytes) if end.samples else (self.samples, self.good_bytes)
        if end.lost_bytes is not None and samples:
            return max(1, round(end.lost_bytes * samples / good_bytes))
        expected = self.per_shard or (self.whole_samples / self.whole_shards if self.whole_shards else 0)
        if expected:
            return max(1, round(expected) - end.samples)
        if end.unread_fraction and end.samples:  # the file's unread bytes, at the samples per byte read before them
            return max(1, round(end.samples * end.unread_fraction / (1 - end.unread_fraction)))
        # Nothing to go by (no summary.json, no shard read whole yet, a stream of unknown size, e.g. a `pipe:` cut
        # short): a cut that falls anywhere in a shard with equal chance falls half way on average, so the shard lost
        # about as many samples as it yielded.
        return max(1, end.samples)

    def record(self, end: ShardEnd) -> None:
        self.samples += end.samples
        self.good_bytes += end.good_bytes
        if end.damage is None:
            self.whole_shards += 1
            self.whole_samples += end.samples
