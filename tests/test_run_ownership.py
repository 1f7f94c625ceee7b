"""A run owns what it writes: it never replaces or deletes a file it did not write (the user's, the weights it starts
from), the stages that score a checkpoint write beside it, their outputs are whole or absent, and a resume checks the
run's settings against the config its checkpoint carries (docs/reliability.md lists the rows)."""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
from matplotlib.figure import Figure
from safetensors import SafetensorError

from mpp import rundir
from mpp.config import load_config
from pipelines import cli

from pipelines.stages import pretrain

from conftest import TINY, read_only, reset_accelerator, write_test_shards

SHORT = ["train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=2", "log.every=1"]


@pytest.fixture
def run(tmp_path):
    """A finished 4-step MPP pretraining in tmp_path/run (checkpoints at steps 2 and 4) over labelled shards."""
    write_test_shards(tmp_path / "shards", [24, 24], size=16)
    pretrain.run(load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                                    *SHORT, "train.steps=4"]))
    reset_accelerator()
    return tmp_path / "run"


def files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def main(monkeypatch, capsys, *args):
    """`mpp ARGS` in this process, as typed (results.json records sys.argv): (exit status, its error lines)."""
    monkeypatch.setattr(sys, "argv", ["launch.py", *args])
    capsys.readouterr()
    status = cli.main(list(args))
    reset_accelerator()
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")]


def test_a_run_replaces_or_deletes_nothing_it_did_not_write(tmp_path, run, monkeypatch, capsys):
    shards, val = tmp_path / "shards", f"data.val_shards={tmp_path / 'shards'}"
    # The user's own project folder: a commented config, weights and results of theirs (red team row 28).
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.yaml").write_text("# my settings for the big run\nmodel:\n  width: 64\n")
    shutil.copy(run / "model.safetensors", proj / "model.safetensors")
    (proj / "results.json").write_text('{"mine": true}\n')
    (proj / "notes.txt").write_text("notes\n")
    before = files(proj)
    status, errors = main(monkeypatch, capsys, "pretrain", "--config", str(proj / "config.yaml"), f"output_dir={proj}",
                          f"data.shards={shards}", *TINY, *SHORT, "train.steps=2")
    assert (status, errors) == (2, [f"output_dir {proj} holds config.yaml, results.json, model.safetensors, which no run "
                                    f"of mpp wrote there, and a run writes those names; move them elsewhere, or set "
                                    f"output_dir to a new directory (nothing was written)"])
    assert files(proj) == before

    # Fine-tuning into the folder of the weights it starts from (rows 31, 29), or starting over there (row 30).
    ft = [f"data.shards={shards}", val, *TINY, "model.num_classes=10", *SHORT, "train.steps=2"]
    shutil.copy(run / "model.safetensors", tmp_path / "wdir.safetensors")
    (tmp_path / "wdir").mkdir()
    shutil.move(tmp_path / "wdir.safetensors", tmp_path / "wdir" / "model.safetensors")
    step = run / "checkpoints" / "step_00000002"
    for ckpt, weights, out, overwrite, verb in (
            (tmp_path / "wdir" / "model.safetensors", tmp_path / "wdir" / "model.safetensors", tmp_path / "wdir", [], "write over"),
            (run, run / "model.safetensors", run, ["--overwrite"], "delete"),
            (step, step / "model.safetensors", run, ["--overwrite"], "delete")):
        before = files(out)
        status, errors = main(monkeypatch, capsys, "finetune", "--ckpt", str(ckpt), *overwrite, f"output_dir={out}", *ft)
        assert (status, errors) == (2, [f"output_dir {out} holds the weights this fine-tuning starts from ({weights}), "
                                        f"and the run would {verb} them; set output_dir to another directory (e.g. "
                                        f"{out}-finetune)"])
        assert files(out) == before

    # A run directory of an mpp before run.json is still its own: --overwrite starts over there.
    (run / "notes.md").write_text("mine\n")
    (run / rundir.RUN_MANIFEST).unlink()
    assert rundir.run_written(run) == set(rundir.RUN_OUTPUTS)
    status, errors = main(monkeypatch, capsys, "pretrain", "--overwrite", f"output_dir={run}", f"data.shards={shards}",
                          *TINY, *SHORT, "train.steps=2")
    assert (status, errors) == (0, [])
    assert [c.name for c in rundir.complete_checkpoints(run)] == ["step_00000002"]
    assert (run / "notes.md").read_text() == "mine\n"
    assert json.loads((run / rundir.RUN_MANIFEST).read_text())["written"] == sorted(rundir.PRETRAIN_OUTPUTS)


def test_the_stages_that_score_a_checkpoint_write_beside_the_one_named(tmp_path, run, monkeypatch, capsys):
    from pipelines.evaluations.frozen import beside_checkpoint

    moved = tmp_path / "moved"  # a run copied or renamed: its config.yaml still names tmp_path/run (rows 34-36)
    shutil.copytree(run, moved)
    hf = tmp_path / "out" / "hf8"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    bare = tmp_path / "ck" / "bare.safetensors"
    bare.parent.mkdir()
    shutil.copy(run / "model.safetensors", bare)
    step = moved / "checkpoints" / "step_00000002"
    assert beside_checkpoint(moved) == moved
    assert beside_checkpoint(moved / "model.safetensors") == moved
    assert beside_checkpoint(step) == beside_checkpoint(step / "model.safetensors") == moved / "step_00000002-eval"
    assert beside_checkpoint(hf) == tmp_path / "out" / "hf8-eval"  # the export keeps only what the export wrote
    assert beside_checkpoint(bare) == tmp_path / "ck" / "bare-eval"

    knn = [f"data.val_shards={tmp_path / 'shards'}", "knn.train_images=24", "knn.eval_images=24"]
    status, errors = main(monkeypatch, capsys, "knn", "--ckpt", str(moved), *knn)
    assert (status, errors) == (0, [])
    assert json.loads((moved / "knn.json").read_text())["ckpt"] == str(moved)
    assert not (run / "knn.json").exists()
    status, _ = main(monkeypatch, capsys, "knn", "--ckpt", str(bare), *knn, f"output_dir={tmp_path / 'chosen'}")
    assert status == 0 and (tmp_path / "chosen" / "knn.json").is_file()  # an explicit output_dir still wins


def test_knn_inspect_and_export_that_cannot_write_say_so_in_one_line_and_leave_nothing(tmp_path, run, monkeypatch, capsys):
    knn = [f"data.val_shards={tmp_path / 'shards'}", "knn.train_images=24", "knn.eval_images=24"]
    restore = read_only(tmp_path / "ro")
    try:  # refused before the features are computed (row 42)
        status, errors = main(monkeypatch, capsys, "knn", "--ckpt", str(run), *knn, f"output_dir={tmp_path / 'ro' / 'knn'}")
        assert status == 2 and len(errors) == 1 and errors[0].startswith(f"output_dir {tmp_path / 'ro' / 'knn'} cannot be written")
        status, errors = main(monkeypatch, capsys, "export", "--ckpt", str(run), "--to", "hf", str(tmp_path / "ro" / "exp"))
        assert status == 2 and errors[0].startswith(f"export directory {tmp_path / 'ro' / 'exp'} cannot be written")
    finally:
        restore()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_write_text = Path.write_text

    def write_text(path, *args, **kwargs):  # the disk is full when knn.json is written (row 47)
        if path.name == "knn.json":
            full()
        return real_write_text(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", write_text)
        status, errors = main(monkeypatch, capsys, "knn", "--ckpt", str(run), *knn, f"output_dir={tmp_path / 'knn'}")
    assert (status, errors) == (2, [f"cannot write {tmp_path / 'knn' / 'knn.json'} (the disk is full: No space left on "
                                    f"device); nothing was written: free some space, or set output_dir to another directory"])
    assert not (tmp_path / "knn").exists()

    with monkeypatch.context() as patch:  # the third figure of inspect (row 46)
        real_savefig, saved = Figure.savefig, []

        def savefig(figure, path, *args, **kwargs):
            if len(saved) == 2:
                full()
            saved.append(path)
            return real_savefig(figure, path, *args, **kwargs)

        patch.setattr(Figure, "savefig", savefig)
        status, errors = main(monkeypatch, capsys, "inspect", "--ckpt", str(run), "inspect.images=8", "inspect.batch_size=8")
    assert (status, errors) == (2, [f"cannot write {run / 'inspect'} (the disk is full: No space left on device); nothing "
                                    f"was written: free some space, or set output_dir to another directory"])
    assert len(saved) == 2 and not (run / "inspect").exists() and not list(run.glob(".partial-*"))

    pytest.importorskip("transformers", minversion="5", reason="exporting needs transformers>=5")
    with monkeypatch.context() as patch:  # the export's weights, after its config.json (row 45)
        def serialize_file(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        patch.setattr(safetensors.torch, "serialize_file", serialize_file)
        status, errors = main(monkeypatch, capsys, "export", "--ckpt", str(run), "--to", "hf", str(tmp_path / "exp"))
    assert status == 2 and errors[0].startswith(f"cannot write {tmp_path / 'exp'} (the disk is full: ")
    assert errors[0].endswith("nothing was written: free some space, or choose another directory (--to hf DIR)")
    assert not (tmp_path / "exp").exists()


def test_a_resume_starts_from_the_saved_config_and_checks_it_against_the_checkpoint(tmp_path, run, monkeypatch, capsys):
    config, out = run / "config.yaml", f"output_dir={run}"
    started = json.loads((run / "results.json").read_text())["command"]
    # A resume names only what changes: the data and model come from the run's saved config (issue 36 item 2).
    status, errors = main(monkeypatch, capsys, "pretrain", "--resume", out, "train.steps=6")
    assert (status, errors) == (0, [])
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 6 and results["command"] == started
    assert results["resumed_with"] == [f"python launch.py pretrain --resume {out} train.steps=6"]
    # A resume that trains nothing keeps the command that trained the run (row 148).
    assert main(monkeypatch, capsys, "pretrain", "--resume", out) == (0, [])
    assert {k: v for k, v in json.loads((run / "results.json").read_text()).items() if k in ("command", "resumed_with")} == \
        {"command": started, "resumed_with": results["resumed_with"]}

    carried = run / "checkpoints" / "step_00000006" / "config.yaml"
    restore = f"restore it with `cp {carried} {config}`"
    saved = config.read_text()
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(saved)
    assert rundir.checkpoint_fault(carried.parent) is None and "width: 64" in carried.read_text()

    # A real conflict names the command that resumes the run as it was trained.
    status, errors = main(monkeypatch, capsys, "pretrain", "--resume", out, "model.width=32", "train.steps=8")
    assert (status, errors) == (2, [
        f"output_dir {run} holds a run with a different 'model' config (model.width: 64 in its checkpoint "
        f"step_00000006, 32 now); a resume may change only the length (train.steps, train.epochs), the learning-rate "
        f"schedule, the optimiser's hyperparameters and how the run logs, evaluates and saves; resume from its saved "
        f"config with `python launch.py pretrain --resume {out} train.steps=8`, or set output_dir to a new directory"])

    # config.yaml edited, unreadable or deleted (rows 50-54): one line naming it and the fix, nothing trained.
    for damage, message in (
            (lambda: config.write_text(saved.replace("width: 64", "width: 32")),
             f"{config} says model.width: 32, but the run was trained with 64 (its checkpoint step_00000006 says so): "
             f"config.yaml was edited, and a resume cannot change model.width; {restore}, or set output_dir to a new "
             f"directory to train with model.width=32"),
            (lambda: config.write_text(saved + "model: {width: [\n"), f"{config} cannot be read ("),
            (lambda: config.unlink(), f"{config} is missing, and a resume starts from it; {restore}, or set output_dir "
                                      f"to a new directory to start afresh")):
        damage()
        for args in ([], ["--config", str(elsewhere)]):  # from the saved config, and from a config given
            status, errors = main(monkeypatch, capsys, "pretrain", "--resume", out, "train.steps=8", "train.batch_size=4", *args)
            assert status == 2 and len(errors) == 1 and errors[0].startswith(message), errors
            assert rundir.complete_checkpoints(run)[-1].name == "step_00000006"
        shutil.copy(carried, config)  # the fix given
    status, errors = main(monkeypatch, capsys, "pretrain", "--resume", out, "train.batch_size=4")
    assert status == 2 and errors[0].startswith(f"output_dir {run} holds a run with a different 'train' config "
                                                f"(train.batch_size: 8 in its checkpoint step_00000006, 4 now)")
