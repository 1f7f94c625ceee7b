"""Data streams that can never deliver a batch: each must end with one line, never wait forever (issue 11)."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
import threading

import pytest
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset

from mpp.config import DataConfig, load_config
from mpp.data.stream import Batch, DataError, EvalTransform, StreamPosition, TrainTransform, make_loader
from mpp.data.readers import expand_shards
from mpp.model.objectives import MaskedPatchPrediction
import mpp.training.loop
from mpp.training.runtime import make_accelerator
from mpp.training.preemption import Preempted
from mpp.rundir import RunDir, complete_checkpoints
from mpp.training.loop import next_batch, train
from mpp.model.vit import build_backbone

from conftest import ROOT, TINY

STUCK_AFTER_S = 300  # far beyond what any case needs even on a loaded machine; only a real hang reaches it


@contextlib.contextmanager
def fails_if_stuck(seconds=STUCK_AFTER_S):
    """Fail this test (not the suite) if the block has not finished after `seconds`."""
    def stuck(signum, frame):
        raise AssertionError(f"still waiting after {seconds}s: the stream hangs")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def write_tar(path, samples):
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


def first_batch(urls, resampled=True, workers=1, **kw):
    batches = iter(make_loader(urls, DataConfig(num_workers=workers, resampled=resampled, shuffle_buffer=0), TrainTransform(8), 4, **kw))
    with fails_if_stuck():
        try:
            return next(batches)
        except DataError as err:
            # Raised without the loader's frames (and no name here holds the loader), so its worker stops here.
            # Held by the traceback, the loader is collected later in a cycle with its queues, and its worker, never
            # told to stop, is waited on 5 s (torch's MP_STATUS_CHECK_INTERVAL), in whichever test comes next.
            raise err.with_traceback(None)
        finally:
            del batches


CORRUPT = [{"__key__": f"k{i}", "jpg": b"\xff\xd8 not a jpeg " + bytes([i])} for i in range(6)]
NO_IMAGE = [{"__key__": f"k{i}", "cls": b"1", "txt": b"a caption"} for i in range(6)]


@pytest.mark.parametrize("resampled", [True, False])
@pytest.mark.parametrize("samples, reason", [(CORRUPT, "6 undecodable_image"), (NO_IMAGE, "6 missing_image")],
                         ids=["corrupt", "no-image"])
def test_shards_without_one_usable_image_stop_the_stream(tmp_path, samples, reason, resampled):
    urls = [write_tar(tmp_path / "s" / "a.tar", samples)]
    with pytest.raises(DataError) as err:
        first_batch(urls, resampled=resampled)
    message = str(err.value).strip().splitlines()[-1]  # from a worker it arrives under the worker's traceback
    assert "a.tar" in message and "not one usable image" in message
    # resampled: 4 groups of 8 draws of the one shard; otherwise one pass
    assert (f"{4 * 8 * 6} samples" if resampled else reason) in message


def test_a_pipe_that_fails_or_prints_nothing_stops_the_stream():
    with pytest.raises(DataError, match=r"pipe:false.*unreadable_shard"):
        first_batch(["pipe:false"])
    with pytest.raises(DataError, match=r"no samples at all: 1 unreadable_shard \(first: pipe:true: empty file\)"):
        first_batch(["pipe:true"], resampled=False)


def test_one_good_shard_among_bad_ones_keeps_the_stream_going(tmp_path, make_shards):
    """The check judges whole groups: a resampled stream that draws a bad shard now and then is not stopped."""
    good = make_shards([8])
    bad = [write_tar(tmp_path / "s" / f"bad{i}.tar", CORRUPT) for i in range(3)]
    loader = make_loader(good + bad, DataConfig(num_workers=0, shuffle_buffer=0), TrainTransform(8), 4)
    with fails_if_stuck(), pytest.warns(UserWarning, match="undecodable_image"):
        batches = [b for _, b in zip(range(20), loader)]
    assert len(batches) == 20 and sum(b.skipped["undecodable_image"] for b in batches) > 0


def test_a_shard_that_is_a_directory_or_a_link_loop_is_named(tmp_path):
    (tmp_path / "dir" / "x.tar").mkdir(parents=True)
    with pytest.raises(DataError, match=r"x.tar is a directory"):
        expand_shards(str(tmp_path / "dir"))
    (tmp_path / "loop").mkdir()
    os.symlink(tmp_path / "loop" / "x.tar", tmp_path / "loop" / "x.tar")
    with pytest.raises(DataError, match=r"x.tar is a symbolic link to nothing"):
        expand_shards(str(tmp_path / "loop"))
    with pytest.raises(DataError, match=r"x.tar is a symbolic link to nothing"):
        expand_shards(str(tmp_path / "loop" / "x.tar"))


def test_gzipped_shards_in_a_directory_are_read(tmp_path, make_shards):
    plain = make_shards([5])[0]
    gz = tmp_path / "shards" / "shard-000001.tar.gz"
    subprocess.run(["gzip", "-k", plain], check=True)
    os.rename(plain + ".gz", gz)
    urls = expand_shards(str(tmp_path / "shards"))
    assert urls == [plain, str(gz)]
    batches = list(make_loader(urls, DataConfig(num_workers=0, shuffle_buffer=0), EvalTransform(8), 10, one_pass=True))
    assert sum(len(b.images) for b in batches) == 10 and not any(b.skipped for b in batches)


def test_cli_stops_with_one_line_on_all_corrupt_shards(tmp_path):
    write_tar(tmp_path / "bad" / "a.tar", CORRUPT)
    proc = subprocess.run([sys.executable, "launch.py", "pretrain", f"data.shards={tmp_path / 'bad'}",
                           f"output_dir={tmp_path / 'run'}", *TINY, "data.num_workers=2", "train.steps=5",
                           "train.warmup_steps=1", "train.batch_size=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=STUCK_AFTER_S)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "a.tar" in errors[0] and "undecodable_image" in errors[0]


# ---------------------------------------------------------------- a signal while the loop waits for data


class StallsAfter(IterableDataset):
    """Yields `count` batches, then blocks forever, like a `pipe:` command or a network read that stalled."""

    def __init__(self, count):
        self.count = count

    def __iter__(self):
        for i in range(self.count):
            yield Batch(torch.full((4, 3, 16, 16), i, dtype=torch.uint8), torch.full((4,), -1), position=StreamPosition(0, 4 * i + 4))
        threading.Event().wait()


class SlowAfter(IterableDataset):
    """Yields `count` batches at once, then one more after `delay` seconds (a slow decode or remote read), then ends."""

    def __init__(self, count, delay):
        self.count, self.delay = count, delay

    def __iter__(self):
        for i in range(self.count + 1):
            if i == self.count:
                threading.Event().wait(self.delay)
            yield Batch(torch.full((4, 3, 16, 16), i, dtype=torch.uint8), torch.full((4,), -1), position=StreamPosition(0, 4 * i + 4))


@pytest.fixture
def signal_handlers_restored():
    """The loop leaves SIGTERM and SIGUSR1 ignored once it has stopped on one (its process is on its way out); this
    test process goes on to other tests, which get the handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def signal_during_the_fourth_wait(monkeypatch) -> None:
    """SIGTERM to this process 1 s into the loop's 4th wait for a batch (the first 3 batches are trained on)."""
    calls, fourth = [], threading.Event()

    def counted_next_batch(*args):
        calls.append(1)
        if len(calls) == 4:
            fourth.set()
        return next_batch(*args)

    monkeypatch.setattr(mpp.training.loop, "next_batch", counted_next_batch)

    def signal_while_waiting():
        if fourth.wait(STUCK_AFTER_S):
            threading.Event().wait(1)  # from the call into the wait takes microseconds
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_while_waiting, daemon=True).start()


def fifty_step_run(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=50", "train.warmup_steps=1",
                             "train.checkpoint_every=100"])
    return cfg, make_accelerator(cfg.train, cfg.output_dir)


def test_a_signal_while_a_batch_is_on_its_way_finishes_the_step_and_stops_at_its_boundary(tmp_path, monkeypatch,
                                                                                          signal_handlers_restored):
    # With several processes, a rank that gave up its wait at once left the others in the step's all-reduce; the batch
    # that comes within the grace period is trained on and the stop is agreed at the step's end, with its checkpoint.
    cfg, accelerator = fifty_step_run(tmp_path)
    signal_during_the_fourth_wait(monkeypatch)  # the 4th batch takes 2 s to come (the signal at 1 s), within the 10 s grace
    batches = lambda state: DataLoader(SlowAfter(3, delay=2), batch_size=None, num_workers=1)
    with fails_if_stuck(), pytest.raises(Preempted, match="stopped at step 4 of 50 on a signal; checkpoint saved"):
        train(accelerator, MaskedPatchPrediction(build_backbone(cfg.model)), batches, cfg.train, cfg.log, RunDir(Path(cfg.output_dir)))
    assert [p.name for p in complete_checkpoints(cfg.output_dir)] == ["step_00000004"]


def test_a_signal_while_waiting_for_data_saves_and_stops(tmp_path, monkeypatch, signal_handlers_restored):
    cfg, accelerator = fifty_step_run(tmp_path)
    signal_during_the_fourth_wait(monkeypatch)  # the 4th batch never comes
    cfg.train.stop_data_wait_s = 1.0  # the wait given up sooner than the default's 10 s of nothing
    batches = lambda state: DataLoader(StallsAfter(3), batch_size=None, num_workers=1)
    with fails_if_stuck(), pytest.raises(Preempted, match="stopped at step 3 of 50 on SIGTERM while waiting for data"):
        train(accelerator, MaskedPatchPrediction(build_backbone(cfg.model)), batches, cfg.train, cfg.log, RunDir(Path(cfg.output_dir)))
    assert [p.name for p in complete_checkpoints(cfg.output_dir)] == ["step_00000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the loop's handler is gone; a repeat does nothing
