"""kNN evaluation of frozen features (DINO's weighted vote) and the pretext validation of pretraining."""

import json
import math
import subprocess

import pytest
import torch
from accelerate import Accelerator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import launch
from mpp.evaluation.ridge import LabelledImages
from mpp.evaluation.neighbours import knn_accuracy, knn_predict
from mpp.model.vit import build_vit
from mpp.model.objectives import MaskedPatchPrediction
from mpp.evaluation.pretext import PretextValidation
from pipelines.stages import pretrain

from conftest import ROOT, TWO_PROCESSES, cpu_env, reset_accelerator
from test_fewshot import tiny, write_two_class_shards


def unit(degrees):
    return torch.tensor([math.cos(math.radians(degrees)), math.sin(math.radians(degrees))])


def test_weighted_vote_on_hand_made_neighbours_gives_the_known_accuracy():
    # Class 0 at 0 degrees; class 1 spread at 60 and 65 degrees; class 2 at 180. Lengths do not matter (cosine).
    train_x = torch.stack([3 * unit(0), unit(60), 2 * unit(65), unit(180)])
    train_y = torch.tensor([0, 1, 1, 2])
    queries = torch.stack([unit(5), unit(62), unit(175), unit(20)])
    # k=3: the query at 20 degrees has one class-0 neighbour (cos 0.94) and two class-1 ones (cos 0.64, 0.57):
    # the majority says 1, but exp(cos / 0.07) weighs the close neighbour e^13.4 against e^9.2 + e^8.1, so 0 wins.
    assert knn_predict(train_x, train_y, queries, 3, k=3, temperature=0.07).tolist() == [0, 1, 2, 0]
    # At a high temperature the weights flatten and the two class-1 neighbours outvote it.
    assert knn_predict(train_x, train_y, queries, 3, k=3, temperature=100.0).tolist()[3] == 1
    assert knn_accuracy(train_x, train_y, queries, torch.tensor([0, 1, 2, 1]), k=3) == 0.75
    # k larger than the pool is capped; k=1 is the nearest neighbour.
    assert knn_predict(train_x, train_y, queries, 3, k=50).shape == (4,)
    assert knn_predict(train_x, train_y, unit(64)[None], 3, k=1).tolist() == [1]


def test_knn_runs_inside_pretraining_and_as_a_command(tmp_path, make_shards, capsys):
    make_shards([40] * 3, size=32)
    results = pretrain.run(tiny(tmp_path, "knn.every=3", "knn.train_images=80", "knn.eval_images=40", "knn.k=5"))
    assert 0 <= results["final"]["knn/top1"] <= 1
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    assert [e.step for e in EventAccumulator(str(events.parent)).Reload().Scalars("knn/top1")] == [3, 6]
    reset_accelerator()
    assert launch.main(["knn", "--ckpt", str(tmp_path / "run"), f"output_dir={tmp_path / 'eval'}", "knn.features=mean",
                        "knn.train_images=80", "knn.eval_images=40"]) == 0
    assert "kNN top-1" in capsys.readouterr().out
    written = json.loads((tmp_path / "eval" / "knn.json").read_text())
    assert written["features"] == "mean" and written["k"] == 5 and written["train_images"] == 80  # k from the run's config.yaml
    assert written["eval_images"] == 40 and 0 < written["top1"] <= 1


def test_a_knn_pool_without_most_classes_is_scored_with_a_warning_giving_the_counts(tmp_path, make_shards):
    from mpp.model.checkpoint import save_weights
    from mpp.model.objectives import MaskedPatchPrediction
    from mpp.model.vit import VisionTransformer
    from pipelines.evaluations import knn

    make_shards([40], size=32)  # 10 classes, 4 images each
    write_two_class_shards(tmp_path / "two")
    save_weights(MaskedPatchPrediction(VisionTransformer(16, 4, 64, 2, 2)), tmp_path / "backbone.safetensors")
    with pytest.warns(UserWarning) as warned:
        result = knn.run(tiny(tmp_path, f"knn.shards={tmp_path / 'two'}", "knn.k=5"), ckpt=str(tmp_path / "backbone.safetensors"))
    assert [str(w.message) for w in warned if w.category is UserWarning] == [
        f"the kNN neighbour pool ({tmp_path / 'two'}, first 20 images) holds no image of 8 of the 10 classes of the "
        f"evaluation images (class 2, 3, 4, 5, 6, ...); the 80% of them in those classes can never be classified right, "
        f"so kNN top-1 is at most 20.0%; raise knn.train_images or use shards that mix classes (`mpp prepare` "
        f"shuffles them)"]
    assert result["top1"] <= 0.2 and json.loads((tmp_path / "run" / "knn.json").read_text())["top1"] == result["top1"]


def test_knn_command_over_two_processes_equals_one(tmp_path, make_shards):
    make_shards([25, 15, 20], size=32)  # uneven: rank 0 reads shards 0 and 2, rank 1 shard 1
    pretrain.run(tiny(tmp_path))
    reset_accelerator()
    # Every image in both sets: with a limit, the first N in rank order are other images than one process's first N.
    args = ["knn", "--ckpt", str(tmp_path / "run"), "knn.train_images=60", "knn.eval_images=60", "knn.k=7"]
    assert launch.main([*args, f"output_dir={tmp_path / 'one'}"]) == 0
    cmd = [*TWO_PROCESSES, "launch.py",
           *args, f"output_dir={tmp_path / 'two'}"]
    env = cpu_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout, proc.stdout[-2000:]
    one, two = (json.loads((tmp_path / d / "knn.json").read_text()) for d in ("one", "two"))
    assert (two["train_images"], two["eval_images"]) == (60, 60)
    assert two["top1"] == one["top1"]


def test_pretext_validation_is_deterministic_and_leaves_the_training_rng_alone(tmp_path, make_shards):
    make_shards([30], size=32)
    cfg = tiny(tmp_path)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    objective = MaskedPatchPrediction(build_vit("vit_ti", 16, 4, width=32, depth=1, heads=2), masking="block")
    from pipelines.run.loaders import eval_batches
    images = LabelledImages(accelerator, eval_batches(str(tmp_path / "shards"), cfg, accelerator, 8), 20, "test shards",
                            need_labels=False)
    validation = PretextValidation(accelerator, images, batch_size=8, seed=0)
    state = torch.random.get_rng_state()
    first = validation.scores(objective.train())
    assert objective.training  # put back as it was
    second = validation.scores(objective)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert first == second and set(first) == {"val/pretext_loss", "val/color_acc", "val/color_acc_prior"}
    with torch.no_grad():
        objective.head.weight.mul_(2.0)
    assert validation.scores(objective)["val/pretext_loss"] != first["val/pretext_loss"]  # other weights, other numbers


def test_pretext_validation_is_logged_during_pretraining(tmp_path, make_shards):
    make_shards([40] * 2, size=32, labels=False)  # pretext validation needs no labels
    results = pretrain.run(tiny(tmp_path, "eval.every=3", "eval.images=24", "eval.batch_size=16"))
    assert results["final"]["val/pretext_loss"] > 0 and 0 <= results["final"]["val/color_acc"] <= 1
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    acc = EventAccumulator(str(events.parent)).Reload()
    assert [e.step for e in acc.Scalars("val/pretext_loss")] == [3, 6] and [e.step for e in acc.Scalars("val/color_acc")] == [3, 6]


def test_knn_needs_evaluation_shards_and_labels(tmp_path, make_shards):
    from mpp.evaluation.ridge import FewShotError

    make_shards([20], size=32, labels=False)
    cfg = tiny(tmp_path, "knn.every=3")
    with pytest.raises(FewShotError, match="no class label"):
        pretrain.run(cfg)
    reset_accelerator()
    cfg.data.val_shards = None
    with pytest.raises(FewShotError, match="kNN evaluation needs evaluation images; set knn.val_shards or data.val_shards"):
        pretrain.run(cfg)


def test_knn_classifies_its_own_val_shards_not_the_pretext_validation_images(tmp_path, make_shards):
    # Pretraining validates on its own classes while kNN scores other ones: here kNN classifies its neighbour pool
    # itself, so with k=1 every image finds itself (cosine 1) and top-1 is exact; data.val_shards is not read by it.
    pool = make_shards([40], size=32)
    results = pretrain.run(tiny(tmp_path, "data.val_shards=null", "knn.every=6", f"knn.shards={pool[0]}",
                                f"knn.val_shards={pool[0]}", "knn.k=1", "knn.train_images=40", "knn.eval_images=40"))
    assert results["final"]["knn/top1"] == 1.0


def test_supervised_pretraining_validates_its_own_loss_and_accuracy(tmp_path, make_shards):
    make_shards([40], size=32)
    results = pretrain.run(tiny(tmp_path, "objective=supervised", "model.num_classes=10", "eval.every=3", "eval.images=16"))
    assert results["final"]["val/loss"] > 0 and 0 <= results["final"]["val/accuracy"] <= 1
    reset_accelerator()
    from mpp.data.stream import DataError

    with pytest.raises(DataError, match=r"data.val_shards \(.*\) holds label .* but the head has 2 classes"):
        pretrain.run(tiny(tmp_path, "objective=supervised", "model.num_classes=2", "eval.every=3",
                          f"output_dir={tmp_path / 'run2'}"))
