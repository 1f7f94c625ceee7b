"""Two processes on CPU (gloo) through `accelerate launch`: no hangs, the same numbers as one process, exact resume."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import torch
import webdataset as wds
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.rundir import complete_checkpoints

from conftest import ROOT, TINY, TWO_PROCESSES, cpu_env, write_test_shards
from test_compare import TINY_RUNS

ENV = cpu_env()


def run(cmd, timeout=240):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_processes_match_one_process_with_twice_the_batch_or_accumulation(tmp_path):
    script = str(ROOT / "tests" / "distributed_equivalence.py")
    two = run([*TWO_PROCESSES, script, str(tmp_path / "two"), "4", "1"])
    assert "trained with 2 process(es)" in two.stdout
    run([sys.executable, script, str(tmp_path / "one_big"), "4", "1"])
    run([sys.executable, script, str(tmp_path / "one_accum"), "4", "2"])
    reference = load_file(tmp_path / "two" / "model.safetensors")
    for layout in ("one_big", "one_accum"):
        weights = load_file(tmp_path / layout / "model.safetensors")
        worst = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-5, (layout, worst)


def pretrain_two_processes(tmp_path, *overrides, resume=False):
    return run([*TWO_PROCESSES, "launch.py", "pretrain", f"data.shards={tmp_path / 'shards'}",
                f"output_dir={tmp_path / 'run'}", *TINY, *overrides, *(["--resume"] if resume else [])])


def test_two_processes_over_uneven_shards_with_workers_do_not_hang_and_resume_to_the_same_weights_and_log(tmp_path, make_shards):
    # Rank 0 streams shards 0 and 2 (60 samples a pass), rank 1 shards 1 and 3 (10): rank 1 ends its pass five times
    # while rank 0 is in its first, and neither waits for the other (a rank whose stream ran dry would hang the other
    # in the next all-reduce). Their stream positions differ, and each rank must resume from its own (they used to
    # resume both from rank 0's). The log window in the checkpoint holds every rank's sums (reduced at the
    # checkpoint): the line at step 3 spans the resume from the step-2 checkpoint, two ranks with a data worker each,
    # 2 micro-batches a step.
    make_shards([30, 5, 30, 5], size=32)
    out = tmp_path / "run"
    common = ["train.steps=6", "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=4",
              "train.checkpoint_every=2", "train.keep_checkpoints=5", "data.num_workers=1", "data.resampled=false", "log.every=3"]
    lines = lambda: [{k: v for k, v in json.loads(line).items() if not k.startswith("train/perf/")}
                     for line in (out / "log.txt").read_text().splitlines()]
    proc = pretrain_two_processes(tmp_path, *common)
    assert "with 2 process(es)" in proc.stdout and "global batch 16 = 2 process(es) x 4 images x 2 accumulation" in proc.stdout
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the machine's CPUs shared out between the two processes
    assert re.search(rf"on cpu(:0)? \({threads} thread\(s\) each\)", proc.stdout), proc.stdout[-2000:]
    uninterrupted, uninterrupted_lines = load_file(out / "model.safetensors"), lines()
    checkpoints = complete_checkpoints(out)
    assert [c.name for c in checkpoints] == ["step_00000002", "step_00000004", "step_00000006"]
    positions = [json.loads((checkpoints[0] / f"stream_state_{rank}.json").read_text()) for rank in (0, 1)]
    assert positions[0] != positions[1]
    for later in checkpoints[1:]:  # as if both processes had died after step 2's checkpoint
        shutil.rmtree(later)
    (out / "model.safetensors").unlink()

    proc = pretrain_two_processes(tmp_path, *common, resume=True)
    assert re.search(r"resumed from .*step_00000002 at step 2", proc.stdout), proc.stdout[-2000:]
    resumed = load_file(out / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    resumed_lines = lines()
    assert [line["step"] for line in resumed_lines] == [line["step"] for line in uninterrupted_lines] == [3, 6]
    for after, before in zip(resumed_lines, uninterrupted_lines):  # the ranks' sums are added in another order: the last digit
        assert after.keys() == before.keys() and all(math.isclose(after[k], before[k], rel_tol=1e-6) for k in before), (after, before)


def test_a_run_sized_by_its_global_batch_resumes_on_two_then_one_then_two_processes(tmp_path, make_shards):
    # Leg 1 runs all 6 steps on 2 processes (the uninterrupted run); leg 2 resumes its step-3 checkpoint on 1 process
    # (accumulating 2 micro-batches where 2 processes took one each), leg 3 the 1-process step-5 checkpoint on 2.
    make_shards([40, 40], size=32)
    common = ["launch.py", "pretrain", f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
              "train.steps=6", "train.warmup_steps=1", "train.global_batch_size=8", "train.micro_batch_size=4",
              "train.checkpoint_every=1", "train.keep_checkpoints=6", "train.ema_decay=0.9", "data.num_workers=1", "log.every=1"]
    events = lambda: EventAccumulator(str(tmp_path / "run" / "tensorboard" / "pretrain")).Reload()
    first = run([*TWO_PROCESSES, *common])
    assert "with 2 process(es)" in first.stdout and "global batch 8 = 2 process(es) x 4 images x 1 accumulation" in first.stdout
    uninterrupted_lrs = [(e.step, e.value) for e in events().Scalars("train/lr")]
    assert [step for step, _ in uninterrupted_lrs] == [1, 2, 3, 4, 5, 6]

    for leg, (launcher, at, split) in enumerate([([sys.executable], 3, "1 process(es) x 4 images x 2 accumulation"),
                                                 (TWO_PROCESSES, 5, "2 process(es) x 4 images x 1 accumulation")]):
        for later in complete_checkpoints(tmp_path / "run")[at:]:  # as if the processes had died after step `at`
            shutil.rmtree(later)
        (tmp_path / "run" / "model.safetensors").unlink()
        proc = run([*launcher, *common, "--resume"])
        processes, saved_by = (1, 2) if leg == 0 else (2, 1)
        assert f"with {processes} process(es)" in proc.stdout and f"global batch 8 = {split}" in proc.stdout, proc.stdout[-2000:]
        assert re.search(rf"resuming \S*step_0000000{at}, saved by {saved_by} process\(es\), with {processes}: exact in "
                         rf"weights, optimiser state, schedule and step, with the global batch of 8 split over {processes}, "
                         rf"but not in data order", proc.stdout), proc.stdout[-2000:]
        assert re.search(rf"resumed from \S*step_0000000{at} at step {at}\b", proc.stdout), proc.stdout[-2000:]
        manifest = json.loads((complete_checkpoints(tmp_path / "run")[-1] / "manifest.json").read_text())
        assert complete_checkpoints(tmp_path / "run")[-1].name == "step_00000006" and manifest["processes"] == processes

    # One curve over the three legs, each step once (the legs' steps after the checkpoints they resumed purged): each
    # step's lr is the uninterrupted run's, every loss finite, and results.json ends the same curve.
    curves = events()
    assert [(e.step, e.value) for e in curves.Scalars("train/lr")] == uninterrupted_lrs
    losses = [(e.step, e.value) for e in curves.Scalars("train/pretext_loss")]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for _, v in losses), losses
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 6 and results["images_seen"] == 6 * 8 and results["final"]["train/pretext_loss"] == losses[-1][1]


def test_two_processes_compiled_with_accumulation_panels_and_evaluations_match_eager(tmp_path, make_shards):
    # The image panel and the evaluations read the bare objective; they used to unwrap the compiled DDP model, which
    # left rank 0 without no_sync and crashed the next step with a collective mismatch. aot_eager compiles what
    # inductor would (dynamo and AOTAutograd over DDP) without its code generation, which takes minutes on 2 CPUs.
    make_shards([40, 40], size=32)
    write_test_shards(tmp_path / "val", [20], size=32)
    common = ["train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "train.grad_accum=2", "train.checkpoint_every=6",
              "log.every=2", "log.images_every=2", "eval.every=2", "eval.images=8", f"data.val_shards={tmp_path / 'val'}",
              "train.mixed_precision=no", "inspect.every=3", "inspect.images=20"]
    weights = {}
    for compile_model in ("false", "true"):
        out = f"output_dir={tmp_path / compile_model}"
        proc = pretrain_two_processes(tmp_path, *common, out, f"train.compile={compile_model}", "train.compile_backend=aot_eager")
        assert "with 2 process(es)" in proc.stdout and f"compile {'on (aot_eager)' if compile_model == 'true' else 'off'}" in proc.stdout
        weights[compile_model] = load_file(tmp_path / compile_model / "model.safetensors")
    worst = max((weights["true"][k] - weights["false"][k]).abs().max().item() for k in weights["false"])
    assert worst < 1e-4, worst

    # The inspection split its images over the two ranks and summed; one process over all 20 gets the same distances.
    run([sys.executable, "launch.py", "inspect", "--ckpt", str(tmp_path / "false"), f"output_dir={tmp_path / 'views'}"])
    alone = json.loads((tmp_path / "views" / "inspect" / "inspect.json").read_text())["attention_distance_mean_px"]
    final = json.loads((tmp_path / "false" / "results.json").read_text())["final"]
    assert abs(final["inspect/attention_distance_first"] - alone[0]) < 1e-2 and abs(final["inspect/attention_distance_last"] - alone[-1]) < 1e-2


def test_the_command_of_a_rank_names_its_launcher_and_process_count(monkeypatch):
    # What the launchers set in every rank (read from a rank of `accelerate launch --multi_gpu --num_processes 2`).
    from pipelines.run.invocation import command_line, resume_command

    monkeypatch.setattr(sys, "argv", ["launch.py", "pretrain", "train.steps=9"])
    for name in ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert command_line() == "python launch.py pretrain train.steps=9"
    assert resume_command(2) == "`accelerate launch --multi_gpu --num_processes 2 launch.py pretrain --resume train.steps=9`"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch, one process
    assert command_line() == "accelerate launch launch.py pretrain train.steps=9"
    for name, value in {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert resume_command() == "`accelerate launch --multi_gpu --num_processes 2 launch.py pretrain --resume train.steps=9`"
    assert resume_command(1) == "`accelerate launch launch.py pretrain --resume train.steps=9`"
    monkeypatch.setenv("WORLD_SIZE", "16")  # two machines of 8, this rank on the second
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert command_line() == ("accelerate launch --multi_gpu --num_machines 2 --machine_rank 1 --main_process_ip 127.0.0.1 "
                              "--main_process_port 29500 --num_processes 16 launch.py pretrain train.steps=9")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")  # torchrun
    assert command_line() == ("torchrun --nnodes 2 --node_rank 1 --master_addr 127.0.0.1 --master_port 29500 "
                              "--nproc_per_node 8 launch.py pretrain train.steps=9")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert command_line() == "torchrun --nproc_per_node 2 launch.py pretrain train.steps=9"


def test_compare_over_two_processes_runs_its_stages_one_after_another_in_each(tmp_path):
    # No Accelerate reset between stages: each stage's Accelerator joins the process's state and process group.
    write_test_shards(tmp_path / "up", [40, 40], size=32)
    write_test_shards(tmp_path / "down", [100, 100], size=32)
    write_test_shards(tmp_path / "val", [30], size=32)
    for directory in ("up", "down"):
        (tmp_path / directory / "summary.json").write_text(json.dumps({"labels": True, "classes": 10}))
    proc = run([*TWO_PROCESSES, "launch.py", "compare", "--config", "configs/compare/tiny.yaml", f"output_dir={tmp_path / 'cmp'}",
                f"pretrain.data.shards={tmp_path / 'up'}", f"finetune.data.shards={tmp_path / 'down'}",
                f"finetune.data.val_shards={tmp_path / 'val'}", f"common.data.val_shards={tmp_path / 'val'}", *TINY_RUNS,
                "arms=[mpp]", "grid=[]", "seeds=[]"])
    assert proc.stdout.count("frozen features (kNN, few-shot): running") == 2, proc.stdout[-3000:]  # once per rank
    mpp = json.loads((tmp_path / "cmp" / "results.json").read_text())["arms"]["mpp"]
    assert mpp["pretrain"]["images_seen"] == 3 * 8 * 2 and mpp["finetune"]["images_seen"] == 4 * 8 * 2  # 2 processes of 8


def test_a_rank_whose_data_fails_ends_the_other_rank_with_one_line_not_a_traceback(tmp_path, make_shards):
    # Red team round 4, row 118: one rank's stream ends in a clear error; the other, waiting for it in the gradient
    # all-reduce, used to die with gloo's "Connection closed by peer" traceback below it. (Rank 0 fails here: a
    # failing rank 1 waits RANK_ERROR_GRACE_S before it speaks, for rank 0 to say an error they share.)
    make_shards([8, 40], size=32)  # rank 0 streams shard 0, which holds no usable image, rank 1 shard 1
    with wds.TarWriter(str(tmp_path / "shards" / "shard-000000.tar")) as sink:
        for i in range(8):
            sink.write({"__key__": f"00-{i:04d}", "jpg": b"not a jpeg", "cls": b"0"})
    proc = subprocess.run([*TWO_PROCESSES, "launch.py", "pretrain", f"data.shards={tmp_path / 'shards'}",
                           f"output_dir={tmp_path / 'run'}", *TINY, "data.num_workers=1", "data.resampled=false",
                           "train.steps=50", "train.batch_size=4"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0
    assert "error: dataloader worker 0 of rank 0 read a whole pass over shard(s)" in proc.stderr
    assert "(rank 1) stopped: another process of this run has ended (Connection closed by peer)" in proc.stderr
    # The launcher's own report of its failed children is torch's; no rank prints a traceback through mpp's code.
    assert not re.search(r'File ".*/(mpp|pipelines)/', proc.stderr), proc.stderr[-3000:]
    # mpp's warnings read as one line each, without the line of code that raised them.
    assert re.search(r"warning: skipping samples with undecodable_image \(first: 00-\d{4}: ", proc.stderr)
    assert "UserWarning" not in proc.stderr
