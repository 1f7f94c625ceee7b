"""The run directory's layout: checkpoint names, the run that wrote a file, the manifest, sealing a checkpoint, file
modes."""

import os
import stat

import yaml

from mpp import rundir
from mpp.config import load_config
from pipelines.stages import pretrain

from conftest import TINY


def test_checkpoints_sort_by_step_and_a_partial_save_is_not_listed(tmp_path):
    for step in (10, 2, 100):
        rundir.RunDir(tmp_path).checkpoint(step).mkdir(parents=True)
    rundir.RunDir(tmp_path).checkpoint(200, partial=True).mkdir()
    assert [c.name for c in rundir.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000010", "step_00000100"]
    assert rundir.checkpoint_step(rundir.complete_checkpoints(tmp_path)[-1]) == 100


def test_the_run_that_wrote_a_file_is_found_from_its_export_or_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    checkpoint = rundir.RunDir(run).checkpoint(4)
    checkpoint.mkdir(parents=True)
    assert rundir.run_dir_of(run / rundir.WEIGHTS) == run
    assert rundir.run_dir_of(checkpoint / rundir.WEIGHTS) == run
    assert rundir.run_config_of(checkpoint / rundir.WEIGHTS) is None
    (run / rundir.CONFIG).write_text("objective: mpp\n")
    assert rundir.run_config_of(checkpoint / rundir.WEIGHTS) == run / "config.yaml"
    assert rundir.run_dir_of(tmp_path / "elsewhere" / "step_00000004" / "w.safetensors") == tmp_path / "elsewhere" / "step_00000004"


def test_a_sealed_checkpoint_verifies_carries_the_run_config_and_only_the_newest_stay(tmp_path):
    run = rundir.RunDir(tmp_path / "run")
    run.root.mkdir()
    rundir.record_run(run.root, rundir.PRETRAIN_OUTPUTS, {"train": {"lr": 0.1}}, "mpp pretrain", started=True)
    for step in (1, 2, 3):
        partial = run.checkpoint(step, partial=True)
        partial.mkdir(parents=True)
        (partial / rundir.WEIGHTS).write_bytes(b"weights")
        assert run.seal_checkpoint(step, processes=1, keep=2) == run.checkpoint(step) and not partial.exists()
    assert rundir.complete_checkpoints(run.root) == [run.checkpoint(2), run.checkpoint(3)]
    assert rundir.checkpoint_fault(run.checkpoint(3)) is None and rundir.saved_processes(run.checkpoint(3)) == 1
    assert yaml.safe_load((run.checkpoint(3) / rundir.CONFIG).read_text()) == {"train": {"lr": 0.1}}


def test_the_manifest_finds_damage_and_the_newest_verified_checkpoint_skips_it(tmp_path):
    old, new = rundir.RunDir(tmp_path).checkpoint(1), rundir.RunDir(tmp_path).checkpoint(2)
    for checkpoint in (old, new):
        checkpoint.mkdir(parents=True)
        (checkpoint / rundir.WEIGHTS).write_bytes(b"weights")
        rundir.write_manifest(checkpoint, processes=1)
    assert rundir.checkpoint_fault(new) is None and rundir.newest_verified(tmp_path) == new
    assert rundir.saved_processes(new) == 1
    (new / rundir.WEIGHTS).write_bytes(b"weightz")
    assert rundir.checkpoint_fault(new) == "model.safetensors does not match the sha256 written with it (damaged)"
    assert rundir.newest_verified(tmp_path) == old


def test_every_file_a_run_writes_has_the_mode_of_the_umask(tmp_path, make_shards):
    # model.safetensors was 0600 (safetensors writes through a private temporary file) beside 0644 files.
    make_shards([20], size=32)
    umask = os.umask(0o022)
    try:
        pretrain.run(load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                                        "train.steps=2", "train.warmup_steps=1", "train.batch_size=4"]))
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(tmp_path / "run")): oct(stat.S_IMODE(p.stat().st_mode))
             for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert {"model.safetensors", "checkpoints/step_00000002/model.safetensors", "results.json"} <= set(modes)
    assert {name: mode for name, mode in modes.items() if mode != "0o644"} == {}


def test_one_file_written_whole_by_several_writers_at_once_ends_as_one_of_them_with_the_umasks_mode(tmp_path):
    # Two compare processes over disjoint arms publish the same budget report (docs/finetuning.md): with one
    # temporary name for every writer, one renamed the other's away and the second died of FileNotFoundError at
    # the end of its budget (seen on the Fashion-MNIST plan). Threads here stand in for the processes.
    import threading

    path = tmp_path / "report.md"
    texts = [f"{writer}\n" * 100_000 for writer in range(6)]
    failures = []

    def write(text):
        for _ in range(15):
            try:
                rundir.write_whole(path, text)
            except OSError as failure:
                failures.append(failure)

    threads = [threading.Thread(target=write, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    assert path.read_text() in texts and [p.name for p in tmp_path.iterdir()] == ["report.md"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as Path.write_text leaves a new file
