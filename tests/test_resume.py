"""Checkpoints that are damaged, runs resumed with other settings or after they finished, and run directories
that cannot be used (docs/reliability.md lists them)."""

import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.config import load_config
from mpp.data.stream import DataError
from mpp.errors import UserError
from mpp.training.optim import warmup_cosine
from mpp.training.runtime import make_accelerator
from mpp.training.trackers import start_trackers
from mpp.rundir import RunDir, complete_checkpoints
from mpp.training.loop import Evaluator, train
from pipelines.stages import finetune, pretrain
from mpp.model.vit import build_backbone
from pipelines.run.loaders import train_loader
from pipelines.run.plan import plan_run
from pipelines.run.tracking import start_tracking
from mpp.model.objectives import MaskedPatchPrediction

from conftest import ROOT, TINY, exported_card, read_only, reset_accelerator, slow_first_steps, write_test_shards, writes_cut_short
from test_reliability import Watched


def pretrain_config(tmp_path, *overrides):
    return load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                              "train.steps=4", "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=2",
                              "train.keep_checkpoints=5", "log.every=1", *overrides])


@pytest.fixture
def finished_run(tmp_path, make_shards):
    """A 4-step pretraining run with checkpoints at steps 2 and 4; returns its final weights."""
    make_shards([40] * 2, size=32)
    pretrain.run(pretrain_config(tmp_path))
    reset_accelerator()
    return load_file(tmp_path / "run" / "model.safetensors")


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize("damage, reason", [
    (lambda c: truncate(c / "model.safetensors"), r"model.safetensors has \d+ bytes where \d+ were written"),
    (lambda c: truncate(c / "optimizer.bin"), r"optimizer.bin has \d+ bytes where \d+ were written"),
    (lambda c: (c / "custom_checkpoint_0.pkl").unlink(), r"custom_checkpoint_0.pkl is missing"),
    (lambda c: (c / "random_states_0.pkl").unlink(), r"random_states_0.pkl is missing"),
    (lambda c: (c / "optimizer.bin").write_bytes(bytes(len((c / "optimizer.bin").read_bytes()))),
     r"optimizer.bin does not match the sha256 written with it"),
], ids=["truncated-model", "truncated-optimizer", "deleted-custom-checkpoint", "deleted-random-states", "zeroed-optimizer"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, finished_run, capsys, damage, reason):
    damage(complete_checkpoints(tmp_path / "run")[-1])
    (tmp_path / "run" / "model.safetensors").unlink()
    capsys.readouterr()
    pretrain.run(pretrain_config(tmp_path), resume=True)
    out, err = capsys.readouterr()
    assert re.search(rf"skipping checkpoint .*step_00000004: {reason}", err), err
    assert "resumed from" in out and "step_00000002 at step 2" in out, out
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(finished_run[k], resumed[k]) for k in finished_run)  # RNG and stream restored too


def test_no_checkpoint_that_verifies_is_one_line_naming_the_newest_fault(tmp_path, finished_run):
    for checkpoint in complete_checkpoints(tmp_path / "run"):
        (checkpoint / "random_states_0.pkl").unlink()
    with pytest.raises(UserError, match=r"none of the 2 checkpoint\(s\) in .* verifies \(newest, step_00000004: "
                                        r"random_states_0.pkl is missing\); move them aside to start afresh"):
        pretrain.run(pretrain_config(tmp_path), resume=True)


def test_resume_auto_starts_a_run_where_there_is_none_and_continues_it_where_there_is(tmp_path, make_shards, monkeypatch, capsys):
    # One command for a cluster job's first submission and every requeue; a plain --resume means a run is there.
    import launch as cli

    make_shards([40], size=32)
    (tmp_path / "defaults.yaml").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "slurm-7.out").write_text("the scheduler's log\n")  # not a run's file: kept, and no reason to refuse
    command = ["pretrain", "--config", str(tmp_path / "defaults.yaml"), "--resume", "auto", *pretrain_args(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["launch.py", *command])

    assert cli.main([word for word in command if word != "auto"]) == 2
    assert capsys.readouterr().err == (f"error: --resume: output_dir {tmp_path / 'run'} holds no run to continue; check "
                                       f"output_dir, drop --resume to start a run there, or pass --resume auto, which "
                                       f"starts a run where there is none and continues it where there is\n")
    assert not (tmp_path / "run" / "checkpoints").exists()

    assert cli.main(command) == 0  # the first submission
    assert f"--resume auto: {tmp_path / 'run'} holds no checkpoint, so this run starts afresh" in capsys.readouterr().out
    uninterrupted = load_file(tmp_path / "run" / "model.safetensors")
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])  # as if it had been stopped after step 2's checkpoint
    (tmp_path / "run" / "model.safetensors").unlink()

    reset_accelerator()
    assert cli.main(command) == 0  # the requeue
    assert re.search(r"resumed from \S*step_00000002 at step 2\n", capsys.readouterr().out)
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)

    reset_accelerator()
    assert cli.main(command) == 0  # a requeue of the finished run: nothing trained, its final metrics kept
    assert "at step 4: the run is finished (train.steps=4), nothing to train" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "results.json").read_text())["final"] == first["final"]
    assert (tmp_path / "run" / "slurm-7.out").read_text() == "the scheduler's log\n"

    reset_accelerator()
    assert cli.main([*command, "train.seed=3"]) == 2  # another run's config: refused as --resume refuses it
    refusal = capsys.readouterr().err
    assert "holds a run with a different 'train' config (train.seed: 0 in " in refusal and ", 3 now)" in refusal


def test_an_interrupted_runs_wall_time_counts_its_training_before_the_checkpoint_it_resumed_from(tmp_path, make_shards, monkeypatch):
    # Killed after step 2's checkpoint, before it ever wrote results.json: the resume's wall_time_s used to hold the
    # resume's own seconds alone.
    make_shards([40], size=32)
    slow_seconds = 1.5
    slow_first_steps(monkeypatch, slow_seconds)
    pretrain.run(pretrain_config(tmp_path))
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])
    for written_after_the_checkpoint in ("results.json", "model.safetensors"):
        (tmp_path / "run" / written_after_the_checkpoint).unlink()
    reset_accelerator()
    started = time.perf_counter()
    pretrain.run(pretrain_config(tmp_path), resume=True)
    resume_seconds = time.perf_counter() - started
    wall = json.loads((tmp_path / "run" / "results.json").read_text())["wall_time_s"]
    assert wall >= 2 * slow_seconds and wall > resume_seconds, (wall, resume_seconds)


def fill_the_disk_at(monkeypatch, tmp_path, written_file, directory=".partial-step_00000004"):
    """Writing `written_file` into `directory` (by default the save of step 4) fails as it does on a full disk, raised
    the way the library that writes it raises it, and from then on the file system reports no space left under tmp_path."""
    real_statvfs = os.statvfs

    def fill():
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*real_statvfs(path)[:3], 0, 0, *real_statvfs(path)[5:]))
                            if str(tmp_path) in str(path) else real_statvfs(path))

    filling = lambda path: Path(path).parent.name == directory and Path(path).name == written_file
    if written_file == "model.safetensors":  # safetensors' serializer, whatever imported save_file
        real = safetensors.torch.serialize_file

        def serialize_file(tensors, filename, *args, **kwargs):
            if filling(filename):
                fill()
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)
    elif written_file == "optimizer.bin":  # torch.save names no cause: the file system says it is full
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if filling(f):
                fill()
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    else:  # a rank's stream position, written by mpp itself
        real_write = Path.write_text

        def write_text(path, *args, **kwargs):
            if filling(path):
                fill()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)


@pytest.mark.parametrize("written_file", ["model.safetensors", "optimizer.bin", "stream_state_0.json"])
def test_a_full_disk_during_a_checkpoint_save_keeps_the_earlier_one_and_says_how_to_continue(
        tmp_path, finished_run, monkeypatch, capsys, written_file):
    import launch as cli

    args = [arg for arg in pretrain_args(tmp_path) if not arg.startswith("output_dir=")] + [f"output_dir={tmp_path / 'full'}"]
    (tmp_path / "defaults.yaml").write_text("")  # the fixture's run used the defaults, not configs/pretrain/default.yaml
    with monkeypatch.context() as patched:
        fill_the_disk_at(patched, tmp_path, written_file)
        capsys.readouterr()
        command = ["pretrain", "--config", str(tmp_path / "defaults.yaml"), *args]
        patched.setattr(sys, "argv", ["launch.py", *command])
        assert cli.main(command) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and [line for line in error.splitlines() if "error: " in line] == [error.strip().splitlines()[-1]]
    checkpoints = tmp_path / "full" / "checkpoints"
    assert re.fullmatch(
        rf"error: cannot save the checkpoint of step 4: the disk holding {checkpoints} is full \(0\.0 MB left, a checkpoint of "
        rf"this run takes 1\.7 MB; the write failed with: .*\); the partial checkpoint was removed and the newest "
        rf"checkpoint that survives is {checkpoints / 'step_00000002'}; free some space, then continue with "
        rf"`python launch.py pretrain --resume --config {tmp_path / 'defaults.yaml'} .*`", error.strip().splitlines()[-1]), error
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002"]  # the partial one removed, the earlier intact
    assert not (tmp_path / "full" / "results.json").exists()

    reset_accelerator()
    pretrain.run(pretrain_config(tmp_path, f"output_dir={tmp_path / 'full'}"), resume=True)  # space freed
    resumed = load_file(tmp_path / "full" / "model.safetensors")
    assert all(torch.equal(finished_run[k], resumed[k]) for k in finished_run)  # nothing lost


def test_a_full_disk_at_the_final_weights_names_the_checkpoint_that_holds_them_and_a_resume_writes_them(
        tmp_path, finished_run, monkeypatch, capsys):
    import launch as cli

    full = tmp_path / "full"
    command = ["pretrain", "--config", str(tmp_path / "defaults.yaml"),
               *[arg for arg in pretrain_args(tmp_path) if not arg.startswith("output_dir=")], f"output_dir={full}"]
    (tmp_path / "defaults.yaml").write_text("")  # the fixture's run used the defaults, not configs/pretrain/default.yaml
    with monkeypatch.context() as patched:
        fill_the_disk_at(patched, tmp_path, "model.safetensors", directory="full")
        patched.setattr(sys, "argv", ["launch.py", *command])
        capsys.readouterr()
        assert cli.main(command) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and error.strip().splitlines()[-1] == (
        f"error: cannot write the run's weights {full / 'model.safetensors'}: the disk holding it is full (Error while "
        f"serializing: I/O error: No space left on device (os error 28)); its last checkpoint {full / 'checkpoints' / 'step_00000004'} "
        f"holds them: free some space, then continue with `python launch.py {shlex.join(command).replace('pretrain', 'pretrain --resume', 1)}`, "
        f"which writes them from it")
    assert not (full / "model.safetensors").exists() and not (full / "results.json").exists()

    reset_accelerator()
    pretrain.run(pretrain_config(tmp_path, f"output_dir={full}"), resume=True)  # space freed
    resumed = load_file(full / "model.safetensors")
    assert all(torch.equal(finished_run[k], resumed[k]) for k in finished_run)
    # The finished run resumed trained nothing and logged nothing: its final metrics come from its last checkpoint.
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert json.loads((full / "results.json").read_text())["final"] == first["final"]


# ---------------------------------------------------------------- what a resume may change


def test_a_resume_applies_a_new_lr_and_length_and_records_them(tmp_path, finished_run, capsys):
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])
    capsys.readouterr()
    pretrain.run(pretrain_config(tmp_path, "train.lr=5e-4", "train.steps=6", "train.weight_decay=0.1"), resume=True)
    out = capsys.readouterr().out
    assert ("resuming with changed settings, applied from step_00000002 on: train.lr 0.001 -> 0.0005, "
            "train.steps 4 -> 6, train.weight_decay 0.05 -> 0.1") in out, out

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "pretrain")).Reload()
    lrs = {e.step: e.value for e in events.Scalars("train/lr")}
    schedule = warmup_cosine(1, 6)  # the new schedule, from the resumed step on
    assert lrs[3] == pytest.approx(5e-4 * schedule(3)) and lrs[6] == pytest.approx(0.0)
    assert lrs[2] == pytest.approx(1e-3 * warmup_cosine(1, 4)(2))  # the steps before it, as they ran

    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "lr: 0.0005" in saved and "steps: 6" in saved
    assert saved.startswith("# resumed from step_00000002 with train.lr 0.001 -> 0.0005, train.steps 4 -> 6, "
                            "train.weight_decay 0.05 -> 0.1; the steps before it ran with the earlier values\n")


@pytest.mark.parametrize("override, key", [("train.batch_size=4", "train.batch_size"), ("train.optimizer=sgd", "train.optimizer"),
                                           ("train.seed=3", "train.seed")])
def test_a_resume_refuses_what_it_cannot_apply(tmp_path, finished_run, override, key):
    with pytest.raises(UserError, match=rf"holds a run with a different 'train' config \({key}: "):
        pretrain.run(pretrain_config(tmp_path, override), resume=True)


def test_a_run_sized_by_its_global_batch_resumes(tmp_path, make_shards, capsys):
    # config.yaml records the per-process batch derived from train.global_batch_size, not the batch_size given.
    make_shards([40], size=32)
    pretrain.run(pretrain_config(tmp_path, "train.global_batch_size=4", "train.steps=2"))
    reset_accelerator()
    capsys.readouterr()
    pretrain.run(pretrain_config(tmp_path, "train.global_batch_size=4"), resume=True)
    assert "applied from step_00000002 on: train.steps 2 -> 4" in capsys.readouterr().out


def test_a_resume_that_splits_the_global_batch_into_more_micro_batches_steps_on_whole_batches(tmp_path, make_shards):
    # Accelerate counts micro-batches to decide when accumulation syncs and restores the count with a checkpoint: 3
    # steps of one micro-batch left it at 3, and two micro-batches a step then stepped the optimiser after the first
    # of each. Supervised pretraining in fp32 draws no randomness per batch, so 2 x 4 images trains as 1 x 8.
    make_shards([40, 40], size=32)
    assert resumed_with_another_split(tmp_path, 8, [], ["train.grad_accum=2"]) < 1e-5


def resumed_with_another_split(tmp_path, global_batch: int, first: list[str], then: list[str]) -> float:
    """Supervised pretraining in fp32 (no randomness per batch) of `global_batch` images a step, checkpointed every 3
    steps, run through with `first`, then resumed from its step-3 checkpoint with `then` instead: the largest
    difference of any weight between the two ends."""
    split = ["objective=supervised", "model.num_classes=10", f"train.global_batch_size={global_batch}",
             "train.mixed_precision=no", "train.checkpoint_every=3"]
    pretrain.run(pretrain_config(tmp_path, *split, *first))
    uninterrupted = load_file(tmp_path / "run" / "model.safetensors")
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])  # as if it had died after step 3's checkpoint
    reset_accelerator()
    pretrain.run(pretrain_config(tmp_path, *split, *then), resume=True)
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    return max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)


def test_a_run_sized_by_its_global_batch_may_split_it_into_other_micro_batches_on_resume(tmp_path, make_shards):
    # A global batch of 12 in micro-batches of 4 cannot move to 2 processes (6 each); the advice is another
    # micro_batch_size, which a resume used to refuse as a changed 'train' config (red team round 5, rows 32-33).
    make_shards([40, 40], size=32)
    assert resumed_with_another_split(tmp_path, 12, ["train.micro_batch_size=4"], ["train.micro_batch_size=2"]) < 1e-5


def test_a_resume_shorter_than_its_checkpoint_is_refused(tmp_path, finished_run):
    with pytest.raises(UserError, match=r"step_00000004 is at step 4, past train.steps=3; set train.steps to at least 4"):
        pretrain.run(pretrain_config(tmp_path, "train.steps=3"), resume=True)


@contextlib.contextmanager
def recorded_steps():
    """The param groups of every optimiser step taken inside (torch's global step hook: the loop's optimiser, as it
    stepped), each as [(lr, weight_decay, betas, lr_scale, apply_weight_decay)] per group."""
    steps = []

    def record(optimizer, args, kwargs):
        steps.append([(g["lr"], g["weight_decay"], g.get("betas"), g["lr_scale"], g["apply_weight_decay"])
                      for g in optimizer.param_groups])

    handle = register_optimizer_step_post_hook(record)
    try:
        yield steps
    finally:
        handle.remove()


def test_a_resumed_optimizer_takes_the_new_hyperparameters(tmp_path, finished_run):
    # The checkpoint's optimiser state carries the old lr, weight decay and betas; the new ones must replace them,
    # each group keeping its own weight-decay exemption.
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])
    cfg = pretrain_config(tmp_path, "train.lr=5e-4", "train.steps=6", "train.weight_decay=0.1", "train.betas=[0.8,0.99]")
    with recorded_steps() as steps:
        pretrain.run(cfg, resume=True)
    assert len(steps) == 4  # steps 3 to 6
    factor = warmup_cosine(1, 6)(2)  # the first resumed step's schedule
    for lr, weight_decay, betas, scale, decayed in steps[0]:
        assert (weight_decay, betas) == (0.1 if decayed else 0.0, (0.8, 0.99))
        assert lr == pytest.approx(5e-4 * scale * factor)


def test_a_layer_decay_finetuning_resumed_has_the_uninterrupted_runs_group_lrs_at_every_step(tmp_path, make_shards):
    # Each layer keeps its own lr through a resume (it used to get the head's), so the weights come out the same.
    make_shards([30, 30], size=24)
    write_test_shards(tmp_path / "val", [7, 5], size=24)
    cfg = finetune_config(tmp_path, "train.layer_decay=0.5", "train.optimizer=adamw", "train.lr=0.01",
                          "train.weight_decay=0.05", "finetune.eval_every=100")
    with recorded_steps() as uninterrupted:
        finetune.run(cfg, ckpt=None)
    weights = load_file(tmp_path / "ft" / "model.safetensors")
    scales = sorted({scale for *_, scale, _ in uninterrupted[0]})
    assert scales == [0.5 ** 3, 0.5 ** 2, 0.5, 1.0]  # depth 2: embeddings, two blocks, norm and head
    shutil.rmtree(complete_checkpoints(tmp_path / "ft")[-1])  # as if stopped after step 3's checkpoint
    reset_accelerator()
    with recorded_steps() as resumed:
        finetune.run(cfg, ckpt=None, resume=True)
    assert resumed == uninterrupted[3:]
    again = load_file(tmp_path / "ft" / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_finetuning_with_an_ema_and_mixed_batches_resumes_to_the_same_average_weights_and_history(tmp_path, make_shards):
    # The EMA is checkpointed beside the weights, and the mixup/CutMix draws come from an RNG the checkpoint restores.
    make_shards([30, 30], size=24)
    write_test_shards(tmp_path / "val", [7, 5], size=24)
    cfg = finetune_config(tmp_path, "train.ema_decay=0.6", "train.mixup=0.8", "train.cutmix=1.0",
                          "data.randaugment_ops=2", "train.lr=0.1")
    finetune.run(cfg, ckpt=None)
    run = tmp_path / "ft"
    average, weights = load_file(run / "model.safetensors"), load_file(complete_checkpoints(run)[-1] / "model.safetensors")
    history = json.loads((run / "results.json").read_text())["history"]
    shutil.rmtree(complete_checkpoints(run)[-1])  # as if stopped after step 3's checkpoint
    (run / "model.safetensors").unlink()
    reset_accelerator()
    finetune.run(cfg, ckpt=None, resume=True)
    again = load_file(run / "model.safetensors")
    assert average.keys() == again.keys() and all(torch.equal(average[k], again[k]) for k in average)
    resumed = load_file(complete_checkpoints(run)[-1] / "model.safetensors")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    assert not torch.equal(average["head.weight"], weights["head.weight"])  # the export is the average, not the weights
    assert json.loads((run / "results.json").read_text())["history"] == history


# ---------------------------------------------------------------- finished runs and evaluations


def finetune_config(tmp_path, *overrides):
    return load_config(ROOT / "configs" / "finetune" / "default.yaml", [
        f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'val'}", f"output_dir={tmp_path / 'ft'}",
        *TINY, "model.num_classes=10", "train.steps=6", "train.warmup_steps=1", "train.batch_size=8",
        "train.checkpoint_every=3", "finetune.eval_every=3", *overrides])


def test_a_finished_finetuning_resumed_rewrites_its_results(tmp_path, make_shards, capsys):
    # As when compare was killed between the last checkpoint and results.json: every rerun used to fail.
    make_shards([30, 30], size=24)
    write_test_shards(tmp_path / "val", [7, 5], size=24)
    finetune.run(finetune_config(tmp_path), ckpt=None)
    before = json.loads((tmp_path / "ft" / "results.json").read_text())
    (tmp_path / "ft" / "results.json").unlink()
    reset_accelerator()
    capsys.readouterr()
    finetune.run(finetune_config(tmp_path), ckpt=None, resume=True)
    assert "at step 6: the run is finished (train.steps=6), nothing to train" in capsys.readouterr().out
    after = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert after["top1"] == before["top1"] and after["history"] == before["history"] == [[3, before["history"][0][1]], [6, before["top1"]]]


def run_files(directory):
    """Every file under `directory` with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_finetuning_resumes_only_from_the_weights_it_started_from(tmp_path, finished_run, capsys):
    # The checkpoint's weights came from the first --ckpt; a resume naming another used to continue them and write
    # the other one into results.json as the backbone.
    other = tmp_path / "other"
    pretrain.run(pretrain_config(tmp_path, f"output_dir={other}", "train.steps=2", "train.seed=1"))
    reset_accelerator()
    write_test_shards(tmp_path / "val", [7, 5], size=32)
    finetune.run(finetune_config(tmp_path, "train.keep_checkpoints=5"), ckpt=str(tmp_path / "run"))
    started = json.loads((tmp_path / "ft" / "started_from.json").read_text())
    assert started["ckpt"] == str(tmp_path / "run") and len(started["sha256"]) == 64
    shutil.rmtree(complete_checkpoints(tmp_path / "ft")[-1])  # as if it had died after step 3's checkpoint
    for written_at_the_end in ("model.safetensors", "results.json"):
        (tmp_path / "ft" / written_at_the_end).unlink()
    before = run_files(tmp_path / "ft")

    args = ["finetune", "--resume", *finetune_args(tmp_path)]
    refused = launch(*args, "--ckpt", str(other))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr[-2000:]
    assert refused.stderr.strip() == (
        f"error: output_dir {tmp_path / 'ft'} holds a fine-tuning that started from {tmp_path / 'run'}, and this resume "
        f"names {other}; its checkpoints continue the weights it started from, so pass --ckpt {tmp_path / 'run'} to "
        f"resume it, or set output_dir to a new directory to fine-tune from {other}")
    reset_accelerator()
    with pytest.raises(UserError, match=rf"started from {tmp_path / 'run'}, and this resume names a fresh backbone "
                                        rf"\(no --ckpt\); .* so pass --ckpt {tmp_path / 'run'} to resume it"):
        finetune.run(finetune_config(tmp_path), ckpt=None, resume=True)
    assert run_files(tmp_path / "ft") == before  # nothing written

    # The same weights named another way are the same start.
    capsys.readouterr()
    finetune.run(finetune_config(tmp_path, "train.keep_checkpoints=5"), ckpt=str(tmp_path / "run" / "model.safetensors"), resume=True)
    assert "step_00000003 at step 3" in capsys.readouterr().out
    assert (tmp_path / "ft" / "started_from.json").read_bytes() == before["started_from.json"]

    # A fine-tuning from scratch is a starting point too; so are weights rewritten in place since it started.
    for start, out in ((None, "scratch"), (str(other), "from_other")):
        reset_accelerator()
        finetune.run(finetune_config(tmp_path, f"output_dir={tmp_path / out}", "train.steps=3"), ckpt=start)
    reset_accelerator()
    with pytest.raises(UserError, match=rf"started from a fresh backbone \(no --ckpt\), and this resume names "
                                        rf"{tmp_path / 'run'}; .* so drop --ckpt to resume it"):
        finetune.run(finetune_config(tmp_path, f"output_dir={tmp_path / 'scratch'}", "train.steps=3"), ckpt=str(tmp_path / "run"), resume=True)
    reset_accelerator()
    pretrain.run(pretrain_config(tmp_path, f"output_dir={other}", "train.steps=4", "train.seed=1"), resume=True)  # rewrites its weights
    reset_accelerator()
    with pytest.raises(UserError, match=rf"started from {other}, whose weights have changed since \({other / 'model.safetensors'} "
                                        r"no longer has the sha256 recorded in .*started_from.json\); .* set output_dir to a new directory"):
        finetune.run(finetune_config(tmp_path, f"output_dir={tmp_path / 'from_other'}", "train.steps=3"), ckpt=str(other), resume=True)


def finetune_args(tmp_path):
    return [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'val'}", f"output_dir={tmp_path / 'ft'}",
            *TINY, "model.num_classes=10", "train.steps=6", "train.warmup_steps=1", "train.batch_size=8",
            "train.checkpoint_every=3", "finetune.eval_every=3", "train.keep_checkpoints=5"]


def test_a_comparison_killed_before_a_finetuning_wrote_its_results_completes_on_the_rerun(tmp_path):
    from pipelines.stages import compare
    from test_compare import tiny

    cc = tiny(tmp_path, "arms=[scratch]", "grid=[]", "lrs=[0.01]", "seeds=[0]")
    first = compare.run(cc)["arms"]["scratch"]["test"]["top1"]
    stage = tmp_path / "cmp" / "ft" / "scratch" / "0.01"
    for written_after_the_last_checkpoint in ("results.json", "stage.json", "model.safetensors"):
        (stage / written_after_the_last_checkpoint).unlink()
    reset_accelerator()
    assert compare.run(cc)["arms"]["scratch"]["test"]["top1"] == first


def test_a_finished_pretraining_resumed_exits_0_saying_so_and_keeps_its_final_metrics(tmp_path, finished_run):
    # Scripts that always pass --resume: the rerun trains nothing and logs no training metric, and it used to rewrite
    # results.json with "final": {}, so a later export's card said the metrics were "not recorded".
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {"train/pretext_loss", "train/color_acc"} <= first["final"].keys()
    (tmp_path / "defaults.yaml").write_text("")  # the fixture's run used the defaults, not configs/pretrain/default.yaml
    result = launch("pretrain", "--resume", "--config", str(tmp_path / "defaults.yaml"), *pretrain_args(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "at step 4: the run is finished (train.steps=4), nothing to train" in result.stdout
    again = json.loads((tmp_path / "run" / "results.json").read_text())
    assert again["final"] == first["final"] and again["final_shown"] == first["final_shown"]
    assert again["wall_time_s"] == first["wall_time_s"] and again["images_per_sec"] == first["images_per_sec"]
    card = exported_card(tmp_path / "run", tmp_path / "hf")
    assert f"- **Final metrics**: train/pretext_loss {first['final_shown']['train/pretext_loss']}, train/color_acc " in card


def pretrain_args(tmp_path):
    return [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=4",
            "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=2", "train.keep_checkpoints=5", "log.every=1"]


def test_evaluation_labels_out_of_range_stop_the_run_before_training(tmp_path, make_shards):
    make_shards([30], size=24)
    write_test_shards(tmp_path / "val", [7, 5], size=24)  # synthetic labels run 0..9
    with pytest.raises(DataError, match=r"data.val_shards \(.*\) holds label \d+ \(.*\) but the head has 3 classes \(0 to 2\)"):
        finetune.run(finetune_config(tmp_path, "model.num_classes=3"), ckpt=None)
    assert not (tmp_path / "ft").exists()  # nothing written


def test_a_failing_evaluation_finds_the_checkpoint_of_its_step_saved(tmp_path, make_shards):
    make_shards([40], size=32)
    cfg = pretrain_config(tmp_path, "train.checkpoint_every=3", "train.steps=6")
    accelerator = make_accelerator(cfg.train, cfg.output_dir)
    objective = MaskedPatchPrediction(build_backbone(cfg.model))
    plan = plan_run(cfg, False, None, False)
    start_trackers(accelerator, "pretrain", cfg.log.trackers, cfg.output_dir, plan.settings, None)
    start_tracking(accelerator, plan, "pretrain", objective.metrics("train"))

    def broken(module, step):
        raise DataError("the evaluation shards went away")

    with pytest.raises(DataError, match="went away"):
        train(accelerator, objective,
              lambda state: train_loader([str(p) for p in (tmp_path / "shards").glob("*.tar")], cfg, accelerator, state),
              cfg.train, cfg.log, RunDir(Path(cfg.output_dir)), evaluators=(Evaluator(3, broken),))
    assert [c.name for c in complete_checkpoints(tmp_path / "run")] == ["step_00000003"]


# ---------------------------------------------------------------- run directories that cannot be used


def launch(*args, timeout=600):
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    (tmp_path / "file").write_text("a regular file")
    result = launch("pretrain", f"output_dir={tmp_path / 'file' / 'run'}", "train.steps=2")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert f"error: output_dir {tmp_path / 'file' / 'run'} cannot be written (Not a directory)" in result.stderr

    restore = read_only(tmp_path / "ro")
    try:
        result = launch("pretrain", f"output_dir={tmp_path / 'ro' / 'run'}", "train.steps=2")
    finally:
        restore()
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert re.search(rf"error: output_dir {tmp_path / 'ro' / 'run'} cannot be written \((Permission denied|Operation not permitted)\)",
                     result.stderr)


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(tmp_path, make_shards):
    make_shards([40], size=32)
    args = ["pretrain", f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
            "train.steps=100000", "train.batch_size=8", "train.checkpoint_every=100000"]
    first = Watched(args)
    try:
        # The start-up line comes after the lock is taken.
        first.wait_until(lambda: "pretraining of" in first.stdout or first.proc.poll() is not None)
        assert first.proc.poll() is None, first.stderr[-2000:]
        first.proc.send_signal(signal.SIGSTOP)  # it holds the lock, paused: its training would only slow the second
        second = launch(*args[:-3], "train.steps=2", "train.warmup_steps=1", "train.batch_size=8")  # short, in case it ran
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another run (pid {first.proc.pid})" in second.stderr and "Traceback" not in second.stderr
        assert first.proc.poll() is None  # the first run goes on
    finally:
        first.proc.kill()  # SIGKILL: no clean-up, the lock file stays behind with its pid
        first.finish()
    assert (tmp_path / "run" / ".lock").read_text().strip() == str(first.proc.pid)
    third = launch(*args[:-3], "train.steps=2", "train.warmup_steps=1", "train.batch_size=8", "--resume")
    assert third.returncode == 0, third.stderr[-2000:]  # a dead process's lock does not block


def test_a_resume_killed_while_rewriting_config_yaml_leaves_the_earlier_one_for_the_next_resume(tmp_path, finished_run,
                                                                                                monkeypatch):
    # A resume rewrites config.yaml (the note of what it changed) as it starts; written in place, a kill or a full
    # disk mid-write left it cut short, and the next `--resume` was refused until the user restored it by hand.
    saved = tmp_path / "run" / "config.yaml"
    earlier = saved.read_text()
    writes_cut_short(monkeypatch, ("config.yaml",))
    with pytest.raises(OSError, match="No space left"):
        pretrain.run(pretrain_config(tmp_path, "train.steps=6"), resume=True)
    monkeypatch.undo()
    assert saved.read_text() == earlier


def test_results_json_is_replaced_whole_so_a_resumed_runs_other_processes_never_read_it_cut_short(tmp_path, finished_run,
                                                                                                  monkeypatch):
    # Every process of a resumed run reads the earlier results.json while the main one writes the new: written in
    # place, a second rank once read it empty and the two-process resume failed at its end (JSONDecodeError). Here
    # the write stops half way, as on a full disk: the file in place must still be the earlier one, whole.
    results = tmp_path / "run" / "results.json"
    earlier = json.loads(results.read_text())
    writes_cut_short(monkeypatch, ("results.json",))
    with pytest.raises(OSError, match="No space left"):
        pretrain.run(pretrain_config(tmp_path, "train.steps=6"), resume=True)
    monkeypatch.undo()
    assert json.loads(results.read_text()) == earlier
