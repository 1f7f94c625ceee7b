"""State that belongs to the checkpoint: a run never loses more than the work since its last checkpoint, and what it
reports (log.txt, the log lines' averages, results.json's best and timing) is true across kills and resumes."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpp.config import load_config
from mpp.metrics import TOP1
from mpp.rundir import complete_checkpoints, checkpoint_step
from mpp.training.meters import TrainingDiverged
from mpp.training.runtime import make_accelerator
from pipelines.evaluations.evaluators import Stage, TopK
from pipelines.stages import finetune, predict, pretrain

from conftest import ROOT, TINY, cpu_env, reset_accelerator, slow_first_steps, write_test_shards


def log_lines(run):
    return [json.loads(line) for line in (run / "log.txt").read_text().splitlines()]


def finetune_args(tmp_path, *overrides):
    return [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'val'}", f"output_dir={tmp_path / 'ft'}",
            *TINY, "model.num_classes=10", "train.batch_size=8", "train.warmup_steps=1", "train.optimizer=sgd",
            "train.lr=0.1", "log.every=1", "finetune.eval_every=1", "finetune.keep_best=true",
            "train.checkpoint_every=10", "train.keep_checkpoints=2", *overrides]


def new_best_past_the_checkpoint(run):
    """(checkpoint step, step of a best evaluation after it, last step in log.txt) once log.txt shows an evaluation
    past the newest checkpoint that beats every earlier one; None before."""
    checkpoints = complete_checkpoints(run)
    if not checkpoints or not (run / "log.txt").is_file():
        return None
    saved = checkpoint_step(checkpoints[-1])
    try:  # read while the run writes it: a line caught mid-write is read again at the next look
        lines = [json.loads(line) for line in (run / "log.txt").read_text().splitlines(keepends=True) if line.endswith("\n")]
    except ValueError:
        return None
    scores = [(line["step"], line[TOP1]) for line in lines if TOP1 in line]
    for index, (step, top1) in enumerate(scores):
        if step > saved and all(top1 > earlier for _, earlier in scores[:index]):
            return saved, step, lines[-1]["step"]
    return None


def test_a_finetuning_killed_after_a_best_past_its_checkpoint_resumes_to_the_checkpoints_best_and_log(tmp_path):
    # Red team row 67 (the worst of round 5) and rows 41, 62-67: each new best was saved at once, but which step is
    # best was checkpointed only with the run, so a kill left best.safetensors holding a dead run's weights beside a
    # results.json naming another step; log.txt kept the dead run's steps past the checkpoint beside the resumed ones.
    write_test_shards(tmp_path / "shards", [60, 60], size=24)
    write_test_shards(tmp_path / "val", [40], size=24)
    run = tmp_path / "ft"
    child = subprocess.Popen([sys.executable, "launch.py", "finetune", *finetune_args(tmp_path, "train.steps=400")],
                             cwd=ROOT, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Killed at once after such a best, well before the next checkpoint (every 10 steps) could cover it.
        while (seen := new_best_past_the_checkpoint(run)) is None or seen[2] >= seen[0] + 8:
            assert child.poll() is None, f"the run ended before a best past a checkpoint: {child.stderr.read()[-2000:]}"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    saved, best_step, _ = seen
    assert checkpoint_step(complete_checkpoints(run)[-1]) == saved

    # Resumed to the checkpoint's step: a finished run, whose best is the best it knows up to there.
    resumed = subprocess.run([sys.executable, "launch.py", "finetune", "--resume",
                              *finetune_args(tmp_path, f"train.steps={saved}")],
                             cwd=ROOT, env=cpu_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    best = json.loads((run / "results.json").read_text())["best"]
    assert best["step"] <= saved < best_step

    # best.safetensors holds the weights of that step: they score what results.json says.
    cfg = load_config(ROOT / "configs" / "finetune" / "default.yaml", finetune_args(tmp_path, f"train.steps={saved}"))
    accelerator = make_accelerator(cfg.train, cfg.output_dir)
    scored = TopK(cfg, accelerator, Stage("finetune", classes=10))(predict.classifier(cfg, best["weights"]), 0)
    assert scored[TOP1] == best[TOP1], (scored, best, saved, best_step)

    # log.txt: every step up to the checkpoint once, that step's row with its (re-run) evaluation, none past it.
    lines = log_lines(run)
    assert [line["step"] for line in lines] == list(range(1, saved + 1))
    assert TOP1 in lines[-1] and "train/loss" in lines[-1]


def pretrain_config(tmp_path, *overrides):
    return load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                              "train.steps=6", "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=2",
                              "train.keep_checkpoints=5", *overrides])


def as_if_killed_after_the_first_checkpoint(run):
    """What a kill after the first checkpoint leaves: its later checkpoints and the files written at the end gone."""
    for later in complete_checkpoints(run)[1:]:
        shutil.rmtree(later)
    for written_at_the_end in ("results.json", "model.safetensors"):
        (run / written_at_the_end).unlink()


def training_scalars(values):
    """Every scalar but the speed, which no two runs share."""
    return {tag: value for tag, value in values.items() if not tag.startswith("train/perf/")}


def test_the_log_line_after_a_resume_averages_the_steps_an_uninterrupted_run_does(tmp_path, make_shards):
    # F1: the log window was not in the checkpoint, so the first line after a resume (and results.json's final when
    # the last start trained fewer than log.every steps) averaged only the steps since the resume.
    make_shards([40] * 2, size=32)
    run = tmp_path / "run"
    first = pretrain.run(pretrain_config(tmp_path, "log.every=3"))  # lines at 3 and 6; checkpoints at 2, 4, 6
    uninterrupted = log_lines(run)
    as_if_killed_after_the_first_checkpoint(run)  # its window holds steps 1-2 of the line at 3
    reset_accelerator()
    resumed = pretrain.run(pretrain_config(tmp_path, "log.every=3"), resume=True)
    assert [line["step"] for line in log_lines(run)] == [3, 6]
    assert [training_scalars(line) for line in log_lines(run)] == [training_scalars(line) for line in uninterrupted]
    assert training_scalars(resumed["final"]) == training_scalars(first["final"])


def test_a_resumed_runs_speed_and_done_line_count_every_start_as_its_wall_time_does(tmp_path, make_shards, monkeypatch, capsys):
    # F2: images_per_sec and "done in" described the last start alone while wall_time_s summed them all.
    make_shards([40], size=32)
    slow_seconds = 2.0
    slow_first_steps(monkeypatch, slow_seconds)
    run = tmp_path / "run"
    pretrain.run(pretrain_config(tmp_path, "train.steps=4", "log.every=1"))
    as_if_killed_after_the_first_checkpoint(run)
    reset_accelerator()
    capsys.readouterr()
    results = pretrain.run(pretrain_config(tmp_path, "train.steps=4", "log.every=1"), resume=True)
    assert results["wall_time_s"] >= 2 * slow_seconds
    assert results["images_per_sec"] <= results["images_seen"] / (2 * slow_seconds)
    done = re.search(r"pretrain done in (\d+)s over every start \((\d+)s in this one\)", capsys.readouterr().out)
    assert done and int(done[1]) == round(results["wall_time_s"]) and int(done[2]) < int(done[1]), done


def test_a_run_stopped_by_non_finite_steps_before_any_checkpoint_logs_its_last_step_and_says_to_start_again(tmp_path, make_shards):
    # Rows 76 and 77: the line said "--resume from the last checkpoint" where there was none, and log.txt lacked the
    # steps before the error (held for a later step that never came).
    make_shards([40], size=32)
    cfg = pretrain_config(tmp_path, "train.steps=40", "train.lr=1e30", "train.max_nonfinite_steps=2",
                          "train.checkpoint_every=100", "log.every=1")
    with pytest.raises(TrainingDiverged) as stopped:
        pretrain.run(cfg)
    message = str(stopped.value)
    assert message.endswith("then start the run again with --overwrite: it saved no checkpoint to continue from (the "
                            "first was due at step 100, train.checkpoint_every)") and "--resume" not in message, message
    last = int(re.search(r"the last at step (\d+)", message)[1])
    lines = log_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == list(range(1, last + 1))
    assert lines[-1]["train/nonfinite_steps"] == 2


def test_an_emptied_newest_checkpoint_is_named_as_empty_and_skipped(tmp_path, make_shards, capsys):
    # Row 40: an empty folder (a save or copy cut off before any file) was blamed on an older mpp.
    make_shards([40], size=32)
    run = tmp_path / "run"
    pretrain.run(pretrain_config(tmp_path, "train.steps=4", "log.every=1"))
    newest = complete_checkpoints(run)[-1]
    shutil.rmtree(newest)
    newest.mkdir()
    (run / "model.safetensors").unlink()
    reset_accelerator()
    capsys.readouterr()
    pretrain.run(pretrain_config(tmp_path, "train.steps=4", "log.every=1"), resume=True)
    out, err = capsys.readouterr()
    assert (f"skipping checkpoint {newest}: it is empty (a save or a copy cut off before any file was written)" in err
            and "step_00000002 at step 2" in out), err


def test_keep_best_set_for_a_pretraining_is_one_warning(tmp_path, make_shards):
    # Row 65: ignored without a word, so a user expecting best.safetensors found none.
    make_shards([40], size=32)
    with pytest.warns(UserWarning, match=r"^finetune.keep_best is set, but a pretraining keeps no best .*; set keep_best "
                                         r"for the fine-tuning$"):
        pretrain.run(pretrain_config(tmp_path, "train.steps=2", "finetune.keep_best=true"))
    assert not (tmp_path / "run" / "best.safetensors").exists()


def test_keep_best_turned_on_by_a_resume_says_the_earlier_evaluations_are_not_candidates(tmp_path, capsys):
    # Row 66: the earlier evaluations' weights are gone; the resume says its best starts with it.
    write_test_shards(tmp_path / "shards", [30, 30], size=24)
    write_test_shards(tmp_path / "val", [12], size=24)
    args = finetune_args(tmp_path, "finetune.keep_best=false", "finetune.eval_every=2", "train.checkpoint_every=4")
    cfg = load_config(ROOT / "configs" / "finetune" / "default.yaml", [*args, "train.steps=4"])
    finetune.run(cfg, ckpt=None)
    reset_accelerator()
    capsys.readouterr()
    cfg = load_config(ROOT / "configs" / "finetune" / "default.yaml", [*args, "train.steps=6", "finetune.keep_best=true"])
    results = finetune.run(cfg, ckpt=None, resume=True)
    assert ("finetune.keep_best: the run kept no best before this resume, so best.safetensors will hold the best of the "
            "evaluations from here on; its earlier ones (up to step 2) were scored, but their weights were not kept"
            in capsys.readouterr().out)
    assert results["best"]["step"] in (4, 6)
