import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Before torch loads OpenMP, which reads it once, as the command line does (pipelines/cli.py): the tests that train in
# this process would otherwise leave OpenMP threads spinning between operations, burning the CPU the other test
# process and the children of both need (test_reliability's bad-data run took 0.6 CPU s with it and 12.6 without,
# side by side).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the OpenMP setting above)
import webdataset as wds
from accelerate.state import AcceleratorState, GradientState

from mpp.data.synthetic import synthetic_image

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))  # launch.py and pipelines/ for the stage tests
import pipelines.parts  # noqa: E402,F401 (every built-in part's config section, as the command line has them)

# A small, fast run: overrides that every stage test starts from.
TINY = ["model.name=vit_ti", "model.width=64", "model.depth=2", "model.heads=2", "model.image_size=16",
        "model.patch_size=4", "data.num_workers=0", "data.shuffle_buffer=50", "log.every=5", "log.images_every=50"]


# A child process that trains on the CPU: no GPU visible (`--multi_gpu --num_processes 2` then starts two gloo
# processes instead of asking a one-GPU machine for a second GPU), and Accelerate and mpp told to use the CPU
# (`accelerate launch --cpu` sets ACCELERATE_USE_CPU; mpp.runtime.cuda_in_use reads it).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}
GPU = torch.cuda.is_available()
ENVIRONMENT_BEFORE_THE_PIN = {name: os.environ.get(name) for name in CPU_ONLY}  # what a `gpu` test runs with

# `accelerate launch` as this interpreter's module, on a free port: the suite's files run in two test processes
# (pyproject's addopts), whose two-process runs would otherwise both take Accelerate's default port 29500.
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0"]
TWO_PROCESSES = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2"]


# The suite's longest files, longest first (their time in a full run, from the durations it prints): the two test
# processes take a whole file at a time, in collection order, and a long file begun last leaves the other process
# with nothing to do while it runs (xdist's own order, by number of tests, began the two longest last). A file not
# named runs after these, in collection order; a list gone stale costs time, never a test.
LONGEST_FIRST = ("test_distributed.py", "test_signals.py", "test_gpu_report.py", "test_reliability.py", "test_compare.py",
                 "test_prepare_workers.py", "test_hybrid.py", "test_resume.py", "test_compare_lengths.py",
                 "test_pretrain.py", "test_shard_damage.py", "test_speed.py", "test_packaging.py", "test_downstream.py",
                 "test_stream_faults.py", "test_checkpointed_state.py")


def pytest_collection_modifyitems(items):
    order = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's tests keep their order


def cpu_env(threads: int | None = 1, **extra: str) -> dict[str, str]:
    """The environment for a child process of a CPU test: CPU_ONLY, `threads` OpenMP threads (None: as inherited)."""
    env = {**os.environ, **CPU_ONLY, **extra}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@pytest.fixture(scope="module", autouse=True)
def cpu_for_the_files_shared_runs(request):
    """The runs a file's module-scoped fixtures train once for its tests train on the CPU too: pytest builds them
    before any test's own fixtures, so `device_of_the_test` alone would leave them on a machine's GPU. A file of
    `gpu` tests (its `pytestmark`) is left as it is."""
    if request.node.get_closest_marker("gpu") is not None:  # the module node carries its pytestmark
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CPU_ONLY.items():  # the CUDA runtime read CUDA_VISIBLE_DEVICES when GPU was computed
            patch.setenv(name, value)
        yield


@pytest.fixture(autouse=True)
def device_of_the_test(request, monkeypatch):
    """The device a test means. A test marked `gpu` trains on the GPU (and is skipped without one); every other test
    tests CPU semantics (exact equality after training, thread counts, fp32 or CPU bf16 tolerances) and trains on
    the CPU, in this process and in the processes it starts, also on a machine with a GPU (the module's pin above)."""
    if request.node.get_closest_marker("gpu") is not None:
        if not GPU:
            pytest.skip("needs a CUDA GPU")
        for name, value in ENVIRONMENT_BEFORE_THE_PIN.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    yield


def reset_accelerator() -> None:
    """Forget this process's Accelerate state, so the next Accelerator starts as in a new process.

    A private Accelerate API, for tests alone and kept here, in one place: the product runs stages one after another
    on the process's state (pipelines/compare.py says how).
    """
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerator():
    """Each test starts with no Accelerate state, whatever the test before it left."""
    yield
    reset_accelerator()


def write_test_shards(directory: Path, counts: list[int], size: int = 24, labels: bool = True) -> list[str]:
    """Shards of synthetic JPEGs; shard s holds counts[s] samples keyed f"{s:02d}-{i:04d}"."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, count in enumerate(counts):
        path = directory / f"shard-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(count):
                image, label = synthetic_image(s * 1000 + i, size)
                buf = io.BytesIO()
                image.save(buf, format="JPEG", quality=90)
                sample = {"__key__": f"{s:02d}-{i:04d}", "jpg": buf.getvalue()}
                if labels:
                    sample["cls"] = str(label).encode()
                sink.write(sample)
        paths.append(str(path))
    return paths


@pytest.fixture
def make_shards(tmp_path):
    return lambda counts, **kw: write_test_shards(tmp_path / "shards", counts, **kw)


def slow_first_steps(monkeypatch, seconds: float) -> None:
    """The loop's first two optimiser steps of this process take `seconds` more each (a sleep in train_step), so a
    test can tell the training time of a start killed after its first checkpoint from the time of its resume."""
    from mpp.training import loop

    quick_step, calls = loop.train_step, []

    def first_two_steps_slow(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            time.sleep(seconds)
        return quick_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", first_two_steps_slow)


def writes_cut_short(monkeypatch, names: tuple[str, ...]) -> None:
    """Path.write_text of a file whose name ends with one of `names` writes half its text, then fails as a full disk
    does: a test of what a write killed or failed half way leaves behind. monkeypatch.undo() ends it."""
    write_text = Path.write_text

    def half_then_full(path, text, *args, **kwargs):
        if path.name.endswith(names):
            write_text(path, text[: len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half_then_full)


def read_only(directory):
    """chmod for a normal user; root ignores modes, so the immutable attribute there (skipped where it is refused)."""
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("running as root without the right to make a directory immutable: no read-only directory to test")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


def where_metrics_show(run_dir: Path, stage: str) -> dict:
    """Where a finished run's metrics reach the user: the tags of its TensorBoard Custom Scalars charts (by
    category), its HParams metric columns, and results.json's final metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir / "tensorboard" / stage), size_guidance={"tensors": 0}).Reload()
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        events.SummaryMetadata("_hparams_/experiment").plugin_data.content).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.SummaryMetadata("_hparams_/session_start_info").plugin_data.content).session_start_info
    return {"charts": {c.title: [t.strip("^$") for chart in c.chart for t in chart.multiline.tag] for c in layout.category},
            "hparams": [m.name.tag for m in experiment.metric_infos],
            "columns": [h.name for h in experiment.hparam_infos],  # the settings' columns, and this run's values
            "values": {name: getattr(v, v.WhichOneof("kind")) for name, v in start.hparams.items()},
            "results": json.loads((run_dir / "results.json").read_text())}


def exported_card(run_dir: Path, out: Path) -> str:
    """The model card `export --to hf` writes for run_dir."""
    import launch

    assert launch.main(["export", "--ckpt", str(run_dir), "--to", "hf", str(out)]) == 0
    return (out / "README.md").read_text()
