"""Stopping on a signal (SIGTERM, SIGUSR1, SIGUSR2, SIGINT): at a step boundary, every rank at the same step, with a
checkpoint.

A preemptible job gets SIGTERM (or, asked for, SIGUSR1: SLURM's `--signal=USR1@120`; SIGUSR2: submitit's default
warning signal) some time before it is killed; the loop saves and the process exits with EXIT_STATUS, naming the command that continues the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator

from mpp.rundir import RunDir, complete_checkpoints


# The exit status of a run stopped by a signal: sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to
# retry"), what a job script requeues on. Apart from 0 (finished), 1 (a crash: Python's status for an uncaught
# exception) and 2 (a mistake to fix), and below 128, where a shell reports a process killed by signal n as 128 + n
# (a run killed outright, with no checkpoint at its stop, is not this).
EXIT_STATUS = 75


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint; the message says how to resume."""


class SignalWhileWaiting(BaseException):
    """A stop signal arrived while the loop was blocked waiting for the data stream; its text is the signal's name.

    A BaseException, as KeyboardInterrupt is: raised wherever the wait happens to be (reading a shard, decoding an
    image), it must not be caught as one more unreadable shard or undecodable image by code that catches Exception.
    """

    at_step_boundary = True  # whether the step it interrupted had consumed no micro-batch yet (set by the loop's feed)


class StopOnSignal:
    """The first SIGTERM, SIGUSR1, SIGUSR2 or SIGINT asks for a stop at the next step boundary; a second SIGINT (Ctrl-C)
    exits at once. A repeated SIGTERM, SIGUSR1 or SIGUSR2 changes nothing: schedulers and launchers send them more than
    once (SLURM signals every process of a job step, and torch's elastic agent, when signalled itself, signals each
    rank's process group again; a data worker that gets one passes it on, see mpp.data.worker_signals), and the checkpoint must land
    before the kill that follows. After a stop they change nothing until the process exits.

    A signal that arrives while the loop waits for data usually finds the batch moments away (being decoded): the
    step finishes and every rank stops at its boundary together. A stream that has not delivered `data_wait_s`
    (train.stop_data_wait_s) after the signal (a `pipe:` command that hangs, a stalled network read) is given up:
    SignalWhileWaiting is raised out of the wait, so it cannot keep the process alive.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    REPEATED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # the ones schedulers and launchers send again

    def __init__(self, data_wait_s: float) -> None:
        self.data_wait_s = data_wait_s
        self.requested = False
        self.waiting = False
        self.signal_name = ""
        self.previous: dict[int, object] = {}
        self.pending: tuple | None = None  # the last step's all-reduce of the flag and its result (several processes)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
            self.previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._give_up_waiting)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        # Stopped on a signal (this process's, or another rank's), or finished after one: the process is on its way
        # out, and a signal that comes after the loop (the kernel's SIGTERM when a one-process launcher has died of
        # the first; the elastic agent's to the other ranks when one exits) must not kill it before it has said how
        # to continue and exited with its own status. SIG_IGN, not a handler that does nothing: Python puts the
        # default back in place of its own handlers as the interpreter shuts down, and a SIGTERM then (a rank's
        # teardown takes a moment) turned its 75 into death by the signal.
        stopped = self.requested or exc_type is Preempted
        for sig, handler in self.previous.items():
            ignored = stopped and sig in self.REPEATED
            signal.signal(sig, signal.SIG_IGN if ignored else handler)
        if self.pending is not None and exc_type is None:
            # Every rank posted the last step's all-reduce, so it completes; a process that destroyed its process
            # groups with it still in flight aborted in gloo ("terminate called without an active exception"), seen
            # once in a two-process test. After an error on one rank the others may never post theirs: no wait then.
            self.settle()

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            return  # a repeat of SIGTERM, SIGUSR1 or SIGUSR2 (a second SIGINT meets the default handler)
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, self.data_wait_s)  # a wait for data still going on then is given up
        print(f"\nreceived {self.signal_name}: saving a checkpoint at the end of this step "
              "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    def _give_up_waiting(self, signum: int, frame) -> None:
        if not self.waiting:
            signal.setitimer(signal.ITIMER_REAL, 1.0)  # the step is on its way to its boundary; look again in a second
            return
        self.waiting = False
        print(f"\nno data came within {self.data_wait_s:g} s of {self.signal_name}: stopping without it",
              file=sys.stderr, flush=True)
        raise SignalWhileWaiting(self.signal_name)

    def agreed(self, accelerator: Accelerator) -> bool:
        """Every rank stops at the same step, even if only one of them got the signal.

        With several processes the flag is summed over ranks every step by an asynchronous all-reduce of a host
        tensor over a gloo group of its own, and read one step later: the device is never involved (no copy, no
        sync), and the wait is for a reduction that finished during the step. The ranks stop one step after the signal.
        """
        if accelerator.num_processes == 1:
            return self.requested
        previous = self.pending
        flag = torch.tensor([float(self.requested)])  # in host memory
        self.pending = (torch.distributed.all_reduce(flag, group=host_group(), async_op=True), flag)
        if previous is None:
            return False
        work, total = previous
        work.wait()
        if total.item() > 0:
            self.settle()  # the ranks stop here: nothing of theirs is left in flight when they tear down
            return True
        return False

    def settle(self) -> None:
        """Wait for the all-reduce posted at the last step."""
        self.pending[0].wait()
        self.pending = None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_when_parent_dies() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux; elsewhere nothing): for a process a
    launcher started, whose death must stop it. `accelerate launch` with one process dies at once of a SIGTERM and
    leaves its trainer running without it (holding the run's lock until the scheduler's SIGKILL loses everything since
    the last checkpoint); torch's elastic agent killed outright leaves its ranks so. The SIGTERM then stops the run at
    the step boundary with a checkpoint, as a SIGTERM sent to the trainer does. Not for a process a shell started: a
    run under `nohup` must outlive the shell.

    The setting holds from the call on: a parent that dies during the call is seen (this process has another parent
    after it); one already gone before it is not (pid 1 may be the launcher itself, in a container)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not permitted here (a seccomp profile): the run goes on as before
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


@functools.cache
def host_group():
    """A gloo process group of every rank for small host-side agreements, made once per process (every rank makes
    it at the same point: as its first stage starts, where pipelines.run.start compares the ranks' configs over it)."""
    return torch.distributed.new_group(backend="gloo")


def stopped_waiting(accelerator: Accelerator, run_dir: RunDir, step: int, steps: int, signalled: SignalWhileWaiting,
                    resume_hint: str, checkpoint: Callable[[], Path]) -> Preempted:
    """The stop at `step` of `steps` (train.steps) for a signal that came while the loop waited for data, after
    saving what can be saved (`checkpoint()` saves the step reached, as at any step end).

    Between steps of a single process everything up to `step` is consistent, so it is checkpointed as at any step
    end. Several processes cannot save together (the others are not at the barrier), nor can a half-accumulated
    step: then the newest checkpoint is what a resume starts from.

    The data workers are ended first: a worker blocked on the stalled stream never reads its loader's request to
    stop, and the loader waits 5 s (torch's join timeout) before ending it, time a preemption notice does not spare.
    A process's multiprocessing children are its loaders' workers; each ends its `pipe:` commands as it goes
    (mpp.data.stream.worker_signals).
    """
    for worker in multiprocessing.active_children():
        worker.terminate()
    newest = complete_checkpoints(run_dir.root)
    if signalled.at_step_boundary and accelerator.num_processes == 1 and step > 0:
        if not newest or newest[-1].name != run_dir.checkpoint(step).name:
            newest = [checkpoint()]
        accelerator.end_training()
        return Preempted(f"stopped at step {step} of {steps} on {signalled} while waiting for data; checkpoint "
                         f"saved in {newest[-1]}; continue with {resume_hint}")
    accelerator.end_training()
    kept = f"the newest checkpoint is {newest[-1]}; continue with {resume_hint}" if newest else "no checkpoint was written yet"
    return Preempted(f"stopped at step {step} of {steps} on {signalled} while waiting for data, without saving "
                     f"this step; {kept}")
