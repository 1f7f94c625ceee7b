"""Stop signals sent as schedulers and people send them: to the launcher, to its process group, to every process of the
run, to one data worker; with data workers, under `accelerate launch` with one process and with two. Each run stops at
one step with a checkpoint there and the command it prints continues it to the same weights, bit for bit, as a run
never stopped. Also: the exit statuses a job script sees, and ranks given different configs."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file

from mpp.config import load_config
from mpp.training.preemption import EXIT_STATUS
from mpp.rundir import complete_checkpoints
from pipelines import cli

from conftest import ACCELERATE_LAUNCH, ROOT, TINY, TWO_PROCESSES, write_test_shards

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
LAUNCHER = {1: [*ACCELERATE_LAUNCH, "--num_processes", "1"], 2: TWO_PROCESSES}
STEPS = 60


def pretrain_args(shards, output_dir):
    return ["launch.py", "pretrain", f"data.shards={shards}", f"output_dir={output_dir}", *TINY, f"train.steps={STEPS}",
            "train.warmup_steps=1", "train.batch_size=4", "train.checkpoint_every=5", "data.num_workers=1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("signals") / "shards"
    write_test_shards(directory, [40] * 4, size=32)
    return directory


@pytest.fixture(scope="module")
def uninterrupted(shards):
    """The weights of the run never stopped, by process count (run once each, when a test first asks)."""
    weights = {}

    def of(processes):
        if processes not in weights:
            out = shards.parent / f"reference_{processes}"
            proc = subprocess.run([*LAUNCHER[processes], *pretrain_args(shards, out)], cwd=ROOT, env=ENV,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            weights[processes] = load_file(out / "model.safetensors")
        return weights[processes]

    return of


def signal_run(proc: subprocess.Popen, target: str, signum: int) -> None:
    """Send `signum` as a scheduler or a person would: to the launcher's pid, to its process group (the launcher
    started in a session of its own), to every process of the run (SLURM signals every process of a job step), or to
    one data worker of the last rank (as red-team row 124 did). With two processes the launcher's group holds the
    launcher alone (torch's agent starts each rank in a session of its own), so it is the launcher's case."""
    launcher = psutil.Process(proc.pid)
    trainers = launcher.children()
    workers = [worker for trainer in trainers for worker in trainer.children()]
    assert trainers and len(workers) == len(trainers), (trainers, workers)  # one data worker each
    if target == "launcher":
        launcher.send_signal(signum)
    elif target == "process group":
        os.killpg(proc.pid, signum)
    elif target == "every process":
        for process in (launcher, *trainers, *workers):
            process.send_signal(signum)
    elif target == "one worker":
        trainers[-1].children()[0].send_signal(signum)


def started_until_a_checkpoint(command: list[str], out) -> subprocess.Popen:
    """`command` started in its own session, returned once its first checkpoint is written (every rank is in the loop)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not complete_checkpoints(out):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(proc.communicate()[1][-3000:])
        time.sleep(0.1)
    return proc


def stopped_run(shards, out, processes, target, signum=signal.SIGTERM):
    """A run signalled once its first checkpoint is written (every rank is in the loop): its launcher's exit
    status, its stderr, and the step and command of its `stopped at` lines (one per rank)."""
    proc = started_until_a_checkpoint([*LAUNCHER[processes], *pretrain_args(shards, out)], out)
    try:
        trainers = psutil.Process(proc.pid).children()
        assert len(trainers) == processes
        signal_run(proc, target, signum)
        _, stderr = proc.communicate(timeout=300)  # until every process holding its output has ended: the trainers too
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not [t for t in trainers if t.is_running() and t.status() != psutil.STATUS_ZOMBIE], "a trainer runs on"
    stops = re.findall(rf"stopped at step (\d+) of {STEPS} on a signal; checkpoint saved in \S+; continue with `([^`]*)`", stderr)
    return proc.returncode, stderr, stops


def resumed_weights(command: str, cwd=ROOT):
    """Run a printed resume command (`accelerate launch ...` as the module of this interpreter) to its end."""
    words = shlex.split(command)
    assert words[:2] == ["accelerate", "launch"], command
    proc = subprocess.run([*ACCELERATE_LAUNCH, *words[2:]], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_stopped_together(out, stderr, stops, processes):
    assert len(stops) == processes and len(set(stops)) == 1, stderr[-3000:]  # every rank, one step, one command
    step = int(stops[0][0])
    assert 5 <= step < STEPS and complete_checkpoints(out)[-1].name == f"step_{step:08d}"
    assert "exited unexpectedly" not in stderr and "gloo" not in stderr and "[rank" not in stderr, stderr[-3000:]
    return step


# What the job script sees from the launcher (docs/preemption.md, "Preemption, resume and bad data"): accelerate's one-process
# launcher dies of the SIGTERM itself (its trainer goes on to the checkpoint); torch's elastic agent, signalled, passes
# the signal on, waits for its ranks and exits 1; not signalled, it exits 1 because its ranks exited EXIT_STATUS.
LAUNCHER_STATUS = {(1, "launcher"): -signal.SIGTERM, (1, "process group"): -signal.SIGTERM,
                   (2, "launcher"): 1, (2, "every process"): 1, (2, "one worker"): 1}


@pytest.mark.parametrize("processes, target", list(LAUNCHER_STATUS))
def test_a_stop_signal_with_data_workers_stops_every_rank_at_one_step_and_the_printed_command_continues_bit_exactly(
        shards, uninterrupted, tmp_path, processes, target):
    # Before: two processes died of `DataLoader worker (pid(s) ...) exited unexpectedly` and a gloo traceback, with no
    # checkpoint at the stop (red-team rows 124, 126, 127); the one-process launcher died at once and its trainer
    # trained on without it, holding the run's lock (row 128).
    out = tmp_path / "run"
    status, stderr, stops = stopped_run(shards, out, processes, target)
    assert status == LAUNCHER_STATUS[processes, target], stderr[-3000:]
    assert_stopped_together(out, stderr, stops, processes)
    if processes == 2 and target != "one worker":
        assert "SignalException" in stderr  # the launcher's own traceback, as docs/preemption.md says
    if target == "one worker":
        assert f"exitcode  : {EXIT_STATUS}" in stderr  # the launcher's report names the ranks' status

    # The command names the launcher and its process count, which a rank only learns from its environment: it used
    # to be `accelerate launch launch.py pretrain --resume ...` for two processes, which met "none of the checkpoint(s)
    # verifies". Without the launcher, a run sized per process is told in one line to relaunch with it.
    args, words = pretrain_args(shards, out), shlex.split(stops[0][1])
    assert words == ["accelerate", "launch", *(["--multi_gpu", "--num_processes", "2"] if processes == 2 else []),
                     *args[:2], "--resume", *args[2:]], words
    if (processes, target) == (2, "launcher"):
        one = subprocess.run([sys.executable, *words[5:]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert one.returncode == 2 and one.stderr.strip() == (
            f"error: checkpoint {complete_checkpoints(out)[-1]} was saved by 2 process(es) and this run has 1; the run "
            f"sets its batch per process (train.batch_size), so its global batch would change with the process count: "
            f"relaunch the run with 2: `{stops[0][1]}` (a run started with train.global_batch_size resumes on any "
            f"number of processes)"), one.stderr[-2000:]

    resumed_weights(stops[0][1])
    weights, reference = load_file(out / "model.safetensors"), uninterrupted(processes)
    assert weights.keys() == reference.keys() and all((weights[k] == reference[k]).all() for k in reference)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2], ids=lambda signum: signum.name)
def test_a_warning_signal_to_the_process_group_stops_with_a_checkpoint_and_the_documented_status(shards, tmp_path,
                                                                                                 signum):
    # SLURM's `--signal=USR1@120`; SIGUSR2 is submitit's default warning signal. Before: the default action, death,
    # for the trainer and its data worker (SIGUSR2 until it was handled as the other stop signals).
    out = tmp_path / "run"
    proc = started_until_a_checkpoint([sys.executable, *pretrain_args(shards, out)], out)
    try:
        os.killpg(proc.pid, signum)  # the trainer and its worker, which passes it on: a repeat, taken as one
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_STATUS == 75, stderr[-3000:]
    assert stderr.count(f"received {signum.name}: saving a checkpoint at the end of this step") == 1, stderr[-3000:]
    step = int(re.search(rf"stopped at step (\d+) of {STEPS} on a signal; checkpoint saved", stderr).group(1))
    assert complete_checkpoints(out)[-1].name == f"step_{step:08d}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_given_different_configs_stop_with_one_line_naming_the_keys_and_exit_2(shards, tmp_path):
    # Red-team rows 119-121: started as torchrun starts ranks, each with its own overrides. Before: another train.lr
    # trained silently; another train.steps hung at the end; another width was a DDP traceback.
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = pretrain_args(shards, tmp_path / "run")
    ranks = [subprocess.Popen([sys.executable, *args, f"train.lr={lr}"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank, lr in enumerate(("0.001", "0.5"))]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    stderr = "".join(err for _, err in outputs)
    assert [rank.returncode for rank in ranks] == [2, 2], stderr[-3000:]
    assert stderr.strip() == ("error: the 2 processes of this run were given different configs: train.lr is 0.001 on "
                              "rank 0 and 0.5 on rank 1; start them all with one command line (the same --config "
                              "file and key=value overrides)"), stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_readme_slurm_scripts_run_mpp_commands_that_parse(monkeypatch):
    text = (ROOT / "docs" / "preemption.md").read_text()  # the scripts moved from README to this guide (issue 50)
    section = text[text.index("### Jobs under SLURM"):]
    section = section.split("\n## ", 1)[0]  # to the next section, or the guide's end
    scripts = [script.replace("\\\n", " ") for script in re.findall(r"```bash\n(.*?)```", section, re.S)]
    assert len(scripts) == 2 and all("#SBATCH --signal=B:USR1@120" in s and "scontrol requeue" in s for s in scripts)
    commands = [command for script in scripts for command in re.findall(r"launch\.py (pretrain [^'&\n]*)", script)]
    assert len(commands) == 2, commands
    if cli.parse_args(["pretrain", "--resume", "auto"]).resume != "auto":
        pytest.skip("this command line has no `--resume auto`, which the scripts use")
    monkeypatch.chdir(ROOT)
    for command in commands:
        args = cli.parse_args(shlex.split(command))
        assert args.stage == "pretrain" and args.resume == "auto", command
        cfg = load_config(cli.config_file("pretrain", args.config), args.overrides)
        assert cfg.output_dir.endswith("runs/vit_b16") and cfg.data.shards == "/data/shards"
