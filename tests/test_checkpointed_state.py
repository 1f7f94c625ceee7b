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

from conftest import ROOT, TINY, cpu_env, reset_accelerator, write_test_shards


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
    lines = [json.loads(line) for line in (run / "log.txt").read_text().splitlines(keepends=True) if line.endswith("\n")]
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
