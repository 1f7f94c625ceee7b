import io
import json
import subprocess

import pytest
import torch
import webdataset as wds
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpp.config import load_config
from mpp.evaluation.ridge import FewShotError, few_shot_accuracy, fit_ridge
from mpp.data.synthetic import synthetic_image
import launch
from pipelines.stages import pretrain

from conftest import ROOT, TINY, TWO_PROCESSES, cpu_env, reset_accelerator


def separable_problem(per_class: int, classes: int = 4, dim: int = 16, noise_seed: int = 0):
    """Points close to well-separated class centres (the same centres for every noise seed)."""
    centres = 10 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(classes).repeat_interleave(per_class)
    noise = 0.1 * torch.randn(len(labels), dim, generator=torch.Generator().manual_seed(noise_seed + 1))
    return centres[labels] + noise, labels


def test_ridge_recovers_a_linearly_separable_problem_exactly():
    x, y = separable_problem(per_class=50)
    test_x, test_y = separable_problem(per_class=30, noise_seed=1)
    for n in (5, 50):  # dual form (n < D) and primal form (n >= D)
        chosen = torch.cat([torch.nonzero(y == c).squeeze(1)[:n] for c in range(4)])
        scores = fit_ridge(x[chosen], y[chosen], 4, l2=1e-3)
        assert torch.equal(scores(test_x).argmax(1), test_y)
        targets = 2.0 * torch.nn.functional.one_hot(y[chosen], 4) - 1.0
        assert torch.allclose(scores(x[chosen]), targets.double(), atol=0.05)  # fits +-1 almost exactly at low l2


def test_few_shot_accuracy_is_perfect_when_separable_and_chance_when_not():
    x, y = separable_problem(per_class=40)
    result = few_shot_accuracy(x, y, x, y, shots=[1, 5], draws=3, l2=1.0)
    assert result == {1: [1.0] * 3, 5: [1.0] * 3}
    noise = torch.randn(160, 16, generator=torch.Generator().manual_seed(3))
    chance = few_shot_accuracy(noise, y, noise.flip(0), y, shots=[5], draws=3, l2=1.0)[5]
    assert max(chance) < 0.5
    assert len(set(chance)) > 1  # the draws differ


def test_few_shot_accuracy_refuses_too_few_examples_per_class():
    x, y = separable_problem(per_class=3)
    with pytest.raises(FewShotError, match="fewer than 5 shots"):
        few_shot_accuracy(x, y, x, y, shots=[5], draws=1, l2=1.0)


def test_few_shot_accuracy_refuses_a_pool_that_lacks_classes_of_the_evaluation_images():
    x, y = separable_problem(per_class=10)
    two = y < 2  # the first images of shards sorted by class: 2 classes of 4
    with pytest.raises(FewShotError) as err:
        few_shot_accuracy(x[two], y[two], x, y, shots=[1], draws=1, l2=1.0)  # would score 50% with no word
    assert "holds examples of 2 of the 4 classes of the evaluation images (none of class 2, 3)" in str(err.value)


def write_two_class_shards(directory, count: int = 20):
    """One shard of synthetic images of classes 0 and 1 only."""
    directory.mkdir(parents=True)
    with wds.TarWriter(str(directory / "shard-000000.tar")) as sink:
        index = written = 0
        while written < count:
            image, label = synthetic_image(index, 24)
            index += 1
            if label < 2:
                buffer = io.BytesIO()
                image.save(buffer, "JPEG")
                sink.write({"__key__": f"{written:04d}", "jpg": buffer.getvalue(), "cls": str(label).encode()})
                written += 1


def test_pretraining_refuses_a_few_shot_pool_without_most_classes_before_training(tmp_path, make_shards):
    make_shards([40], size=32)
    write_two_class_shards(tmp_path / "two")
    with pytest.raises(FewShotError, match="holds examples of 2 of the 10 classes of the evaluation images"):
        pretrain.run(tiny(tmp_path, "fewshot.every=3", f"fewshot.shards={tmp_path / 'two'}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def tiny(tmp_path, *overrides):
    return load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                              f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=6", "train.warmup_steps=2",
                              "train.batch_size=8", "train.checkpoint_every=6", "fewshot.shots=[1,2]",
                              "fewshot.draws=2", "fewshot.train_images=60", "fewshot.eval_images=40", *overrides])


def test_evaluator_runs_inside_pretraining_logs_and_leaves_training_unchanged(tmp_path, make_shards):
    make_shards([40] * 3, size=32)
    pretrain.run(tiny(tmp_path))
    plain = load_file(tmp_path / "run" / "model.safetensors")
    reset_accelerator()
    (tmp_path / "run").rename(tmp_path / "plain")
    results = pretrain.run(tiny(tmp_path, "fewshot.every=3"))
    evaluated = load_file(tmp_path / "run" / "model.safetensors")
    # Same weights: the evaluator drew nothing from the training RNG and read nothing of the training stream.
    assert all(torch.equal(plain[k], evaluated[k]) for k in plain)
    assert 0 <= results["final"]["fewshot/1shot"] <= 1 and 0 <= results["final"]["fewshot/2shot"] <= 1
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    acc = EventAccumulator(str(events.parent)).Reload()
    assert [e.step for e in acc.Scalars("fewshot/2shot")] == [3, 6]


def test_fewshot_command_scores_a_saved_backbone(tmp_path, make_shards, capsys):
    make_shards([40] * 3, size=32)
    pretrain.run(tiny(tmp_path))
    reset_accelerator()
    # The run's own config.yaml supplies the model and the shards; the command line changes the rest.
    assert launch.main(["fewshot", "--ckpt", str(tmp_path / "run"), f"output_dir={tmp_path / 'eval'}", "fewshot.features=mean"]) == 0
    assert "1-shot" in capsys.readouterr().out
    written = json.loads((tmp_path / "eval" / "fewshot.json").read_text())
    assert written["features"] == "mean" and written["ckpt"] == str(tmp_path / "run")
    assert set(written["accuracy"]) == {"1", "2"} and written["eval_images"] == 40 and written["train_images"] == 60
    assert all(0 < a <= 1 for a in written["accuracy"].values())


def test_fewshot_needs_evaluation_shards(tmp_path, make_shards):
    make_shards([10], size=32)
    cfg = tiny(tmp_path, "fewshot.every=3")
    cfg.data.val_shards = None
    with pytest.raises(FewShotError, match="data.val_shards"):
        pretrain.run(cfg)


def test_fewshot_refuses_unlabelled_shards(tmp_path, make_shards):
    make_shards([20], size=32, labels=False)
    with pytest.raises(FewShotError, match="no class label"):
        pretrain.run(tiny(tmp_path, "fewshot.every=3"))


def test_fewshot_command_with_two_processes_gathers_every_image(tmp_path, make_shards):
    make_shards([25, 15, 20], size=32)  # uneven: rank 0 reads shards 0 and 2, rank 1 shard 1
    pretrain.run(tiny(tmp_path))
    cmd = [*TWO_PROCESSES, "launch.py", "fewshot",
           "--ckpt", str(tmp_path / "run"), f"output_dir={tmp_path / 'eval'}", "fewshot.train_images=50", "fewshot.eval_images=60"]
    env = cpu_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((tmp_path / "eval" / "fewshot.json").read_text())
    assert written["train_images"] == 50 and written["eval_images"] == 60  # 50 of the 60, in rank order; all 60
    assert proc.stdout.count("few-shot linear accuracy") == 1 and "2 process(es)" in proc.stdout, proc.stdout[-2000:]
