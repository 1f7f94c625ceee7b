"""Imbalanced labels: what fine-tuning reports beside top-1 (balanced accuracy, each class's top-1, the evaluation
images' own majority class), class-weighted loss, and one labelled folder split into training and evaluation images."""

import json

import pytest
import torch
import torch.nn.functional as F

from mpp.config import ConfigError, load_config
from mpp.data.split import hold_out
from mpp.data.stream import StreamState
from mpp.model.objectives import Classification, balancing_weights
from mpp.model.vit import VisionTransformer
from pipelines.run.loaders import eval_batches, resolve_shards, train_loader
from pipelines.stages import finetune, prepare

from conftest import TINY, where_metrics_show
from test_user_folder import colour_folder


def config(tmp_path, *overrides):
    return load_config(None, [*TINY, f"data.shards={tmp_path / 'train'}", f"output_dir={tmp_path / 'run'}",
                              "train.steps=4", "train.warmup_steps=1", "train.batch_size=8", "finetune.eval_every=4",
                              "train.checkpoint_every=4", *overrides])


def test_an_imbalanced_evaluation_set_reports_balanced_and_per_class_accuracy(tmp_path, capsys):
    # Training mostly cats; evaluation mostly owls: the baseline a constant answer reaches on the evaluation images
    # is answering owl (8 of 12), not the training labels' majority, cat (2 of 12).
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [10, 4, 2])), str(tmp_path / "train"))
    prepare.run(str(colour_folder(tmp_path / "photos" / "val", [2, 2, 8], seed=1)), str(tmp_path / "val"))

    results = finetune.run(config(tmp_path, f"data.val_shards={tmp_path / 'val'}"), ckpt=None)

    records = json.loads((tmp_path / "run" / "predictions.json").read_text()).values()
    recalls = {c: sum(r["correct"] for r in records if r["label"] == c) / sum(r["label"] == c for r in records) for c in range(3)}
    assert results["per_class"] == {name: {"id": c, "images": (2, 2, 8)[c], "top1": pytest.approx(recalls[c])}
                                    for c, name in enumerate(("cat", "dog", "owl"))}
    assert results["balanced_acc"] == pytest.approx(sum(recalls.values()) / 3)
    assert results["final"]["eval/balanced_acc"] == results["balanced_acc"]
    assert [results["final"][f"eval/class_top1/{c}"] for c in range(3)] == pytest.approx(list(recalls.values()))
    assert results["baselines"]["eval/top1"] == {"majority": pytest.approx(8 / 12), "chance": pytest.approx(1 / 3)}
    assert results["baselines"]["eval/balanced_acc"] == {"majority": pytest.approx(1 / 3), "chance": pytest.approx(1 / 3)}
    shows = where_metrics_show(tmp_path / "run", "finetune")
    assert "eval/balanced_acc" in shows["hparams"] and "eval/balanced_acc" in shows["charts"]["evaluation"]
    assert {f"eval/class_top1/{c}" for c in range(3)} <= set(shows["charts"]["evaluation"])
    end = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("finetune done"))
    assert f"eval/top1 {results['top1']:.1%} (majority class 66.7%, chance 33.3%)" in end
    assert f"eval/balanced_acc {results['balanced_acc']:.1%} (majority class 33.3%, chance 33.3%)" in end


def test_loss_weights_make_every_class_count_the_same():
    # 6 images of class 0, 2 of class 1, as in training: the weighted loss is the mean of the two classes' mean
    # losses, where the unweighted one is dominated by class 0.
    assert balancing_weights([6, 2, 0]).tolist() == pytest.approx([8 / (2 * 6), 8 / (2 * 2), 1.0])
    torch.manual_seed(0)
    backbone = VisionTransformer(16, 4, 32, 1, 2)
    head = torch.nn.Linear(32, 3)
    torch.nn.init.normal_(head.weight)
    weighted = Classification(backbone, head, export_head=True, class_weights=balancing_weights([6, 2, 0]))
    plain = Classification(backbone, head, export_head=True)
    images, labels = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8), torch.tensor([0] * 6 + [1] * 2)
    losses = F.cross_entropy(plain.logits(images), labels, reduction="none")
    balanced = (losses[:6].mean() + losses[6:].mean()) / 2
    assert weighted(images, labels).loss.item() == pytest.approx(balanced.item(), rel=1e-5)
    assert plain(images, labels).loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    assert "weighted by its inverse frequency" in weighted.description
    assert "class_weights" not in weighted.state_dict()  # the run's data, not a weight of the model


def test_finetune_trains_with_class_weights_from_the_training_counts(tmp_path):
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [10, 4, 2])), str(tmp_path / "train"))
    built = []
    real = finetune.build_classifier

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    finetune.build_classifier = spy
    try:
        results = finetune.run(config(tmp_path, "finetune.class_balance=loss_weights", "finetune.val_split=0.25"), ckpt=None)
    finally:
        finetune.build_classifier = real
    # Held out: 2 cats, 1 dog, 1 owl (0.25 of each class, rounded, at least one); trained on 8, 3 and 1.
    assert built[0].class_weights.tolist() == pytest.approx([12 / (3 * 8), 12 / (3 * 3), 12 / (3 * 1)])
    assert "each class's loss weighted by its inverse frequency" in results["description"]


def test_val_split_holds_out_a_stratified_reproducible_part_of_one_folder(tmp_path):
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [20, 10, 2])), str(tmp_path / "train"))
    cfg = config(tmp_path)
    urls = resolve_shards(cfg.data.shards, cfg, None)
    names = ("cat", "dog", "owl")
    split = hold_out(urls, names, 3, 0.1, 0, cfg.data.shards)
    assert split.held_counts == (2, 1, 1) and split.trained_counts == (18, 9, 1)
    assert hold_out(urls, names, 3, 0.1, 0, cfg.data.shards) == split
    assert hold_out(urls, names, 3, 0.1, 1, cfg.data.shards).keys != split.keys

    class Single:
        process_index, num_processes, device = 0, 1, torch.device("cpu")

    one_pass = cfg.model_copy(update={"data": cfg.data.model_copy(update={"resampled": False})})
    evaluated = [k for b in eval_batches(cfg.data.shards, cfg, Single(), 8, keep=split.evaluated) for k in b.keys]
    trained = [k for b, _ in zip(train_loader(urls, one_pass, Single(), StreamState(), keep=split.trained), range(4))
               for k in b.keys]
    assert sorted(evaluated) == sorted(split.keys)
    assert len(set(trained)) == 28 and not set(trained) & split.keys  # a pass: every training image, none held out


def test_finetune_on_one_folder_evaluates_on_the_images_it_holds_out(tmp_path, capsys):
    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [8, 8, 4])), str(tmp_path / "train"))

    results = finetune.run(config(tmp_path, "finetune.val_split=0.25"), ckpt=None)

    records = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert [sum(r["label"] == c for r in records.values()) for c in range(3)] == [2, 2, 1]
    assert results["val_split"] == {"fraction": 0.25, "seed": 0, "held_out": 5, "trained_on": 15}
    assert "finetune.val_split=0.25: 5 of the 20 images of data.shards held out to evaluate on (1-2 of each class), " \
           "never trained on\n" in capsys.readouterr().out
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_val_split_replaces_the_evaluation_shards_a_config_names(tmp_path, capsys):
    import launch

    prepare.run(str(colour_folder(tmp_path / "photos" / "train", [4, 4, 4])), str(tmp_path / "train"))
    # configs/finetune/default.yaml names data.val_shards (Fashion-MNIST's test set, absent here).
    assert launch.main(["finetune", *TINY, f"data.shards={tmp_path / 'train'}", "finetune.val_split=0.25",
                        f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.batch_size=6"]) == 0
    assert "held out to evaluate on (1 of each class), never trained on; data.val_shards (data/fmnist/test) is not read" \
        in capsys.readouterr().out
    with pytest.raises(ConfigError, match="set data.val_shards, or finetune.val_split=0.1"):
        finetune.run(config(tmp_path), ckpt=None)


@pytest.mark.parametrize("setting, said", [
    ("finetune.val_split=0.25", "finetune.val_split reads the labels of data.shards (pipe:cat {shard}) before training to "
                                "hold out part of each class, but pipe:cat {shard} is streamed; set data.val_shards"),
    ("finetune.class_balance=loss_weights", "finetune.class_balance=loss_weights needs the training images per class, "
                                            "which data.shards (pipe:cat {shard}) does not give"),
])
def test_streamed_shards_that_cannot_give_what_a_setting_needs_are_one_line(tmp_path, capsys, setting, said):
    import launch

    prepare.run(str(colour_folder(tmp_path / "photos", [4, 4, 4])), str(tmp_path / "train"))
    shard = next((tmp_path / "train").glob("*.tar"))
    val = [] if "val_split" in setting else [f"data.val_shards={tmp_path / 'train'}"]
    assert launch.main(["finetune", *TINY, f"data.shards=pipe:cat {shard}", *val, "model.num_classes=3", setting,
                        f"output_dir={tmp_path / 'run'}", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert said.format(shard=shard) in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
