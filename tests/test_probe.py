"""The linear probe: SGD on frozen features behind a BatchNorm without affine parameters, as MAE evaluates."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import launch
from mpp.errors import UserError
from mpp.evaluation.linear_probe import linear_probe_accuracy, train_linear_probe
from pipelines.stages import pretrain

from conftest import reset_accelerator, where_metrics_show
from test_fewshot import tiny


def separable(n_per_class, classes=4, width=32, seed=0):
    """Gaussian clusters around far-apart class means, features on wildly different scales (the BatchNorm's job)."""
    generator = torch.Generator().manual_seed(seed)
    means = 6 * torch.randn(classes, width, generator=torch.Generator().manual_seed(99))
    labels = torch.arange(classes).repeat_interleave(n_per_class)
    features = means[labels] + torch.randn(len(labels), width, generator=generator)
    return features * torch.logspace(-3, 3, width), labels


def test_a_probe_on_separable_features_is_right_almost_always_and_the_same_every_time():
    train_x, train_y = separable(100)
    eval_x, eval_y = separable(50, seed=1)
    rng = torch.random.get_rng_state()
    accuracy = linear_probe_accuracy(train_x, train_y, eval_x, eval_y, epochs=10, lr=0.1, batch_size=64)
    assert accuracy >= 0.99
    assert torch.equal(torch.random.get_rng_state(), rng)  # a private generator: the run's RNG is untouched
    first, again = (train_linear_probe(train_x, train_y, 4, epochs=3, lr=0.1, batch_size=64, seed=5) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    other = train_linear_probe(train_x, train_y, 4, epochs=3, lr=0.1, batch_size=64, seed=6)
    assert not torch.equal(first[1].weight, other[1].weight)
    # Without training (a tiny lr), the same features score at chance: the accuracy above is the probe's doing.
    assert linear_probe_accuracy(train_x, train_y, eval_x, eval_y, epochs=1, lr=1e-9, batch_size=64) < 0.6


def test_a_probe_needs_two_training_features():
    with pytest.raises(UserError, match="at least 2 training images, got 1; raise probe.train_images"):
        train_linear_probe(torch.randn(1, 8), torch.tensor([0]), 2, epochs=1, lr=0.1, batch_size=4)


def test_the_probe_runs_inside_pretraining_shows_in_the_results_and_runs_as_a_command(tmp_path, make_shards, capsys):
    make_shards([40] * 3, size=32)
    probe = ["probe.every=3", "probe.train_images=80", "probe.eval_images=40", "probe.epochs=5"]
    pretrain.run(tiny(tmp_path, *probe))
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    assert [e.step for e in EventAccumulator(str(events.parent)).Reload().Scalars("probe/top1")] == [3, 6]
    shows = where_metrics_show(tmp_path / "run", "pretrain")
    assert 0 < shows["results"]["final"]["probe/top1"] <= 1
    assert shows["charts"]["linear probe"] == ["probe/top1"] and "probe/top1" in shows["hparams"]
    reset_accelerator()
    capsys.readouterr()
    assert launch.main(["probe", "--ckpt", str(tmp_path / "run"), f"output_dir={tmp_path / 'eval'}", "probe.features=mean"]) == 0
    assert "linear probe top-1" in capsys.readouterr().out
    written = json.loads((tmp_path / "eval" / "probe.json").read_text())
    assert written["features"] == "mean" and written["epochs"] == 5 and written["train_images"] == 80  # from config.yaml
    assert written["eval_images"] == 40 and 0 < written["top1"] <= 1


def test_a_probe_pool_without_most_classes_is_scored_with_a_warning_giving_the_ceiling(tmp_path, make_shards):
    """As kNN's pool (not refused as few-shot's): a probe trained on 2 of 10 classes scored with no word before."""
    from mpp.model.checkpoint import save_weights
    from mpp.model.objectives import MaskedPatchPrediction
    from mpp.model.vit import VisionTransformer
    from pipelines.evaluations import probe

    from test_fewshot import write_two_class_shards

    make_shards([40], size=32)  # 10 classes, 4 images each
    write_two_class_shards(tmp_path / "two")
    save_weights(MaskedPatchPrediction(VisionTransformer(16, 4, 64, 2, 2)), tmp_path / "backbone.safetensors")
    with pytest.warns(UserWarning) as warned:
        result = probe.run(tiny(tmp_path, f"probe.shards={tmp_path / 'two'}", "probe.epochs=2"),
                           ckpt=str(tmp_path / "backbone.safetensors"))
    assert [str(w.message) for w in warned if w.category is UserWarning] == [
        f"the linear probe training pool ({tmp_path / 'two'}, first 20 images) holds no image of 8 of the 10 classes "
        f"of the evaluation images (class 2, 3, 4, 5, 6, ...); the 80% of them in those classes can never be classified "
        f"right, so linear probe top-1 is at most 20.0%; raise probe.train_images or use shards that mix classes "
        f"(`mpp prepare` shuffles them)"]
    assert result["top1"] <= 0.2
