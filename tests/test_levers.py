"""Fine-tuning levers: layer-wise lr decay, stochastic depth, mean pooling, label smoothing, mixup and CutMix, the
weights' EMA."""

import json
import pickle
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import launch
from mpp.config import TrainConfig, load_config
from mpp.training import runtime
from mpp.training.ema import WeightAverage
from mpp.model.mixup import Mix, Mixing
from mpp.model.vit import DropPath, VisionTransformer
from mpp.model.objectives import Classification, MaskedPatchPrediction, normalize
from mpp.training.optim import build_optimizer, head_lr, param_groups, warmup_cosine
from pipelines.stages import finetune

from conftest import ROOT, TINY, reset_accelerator, write_test_shards
from test_downstream import finetune_config, recount

NO_DECAY = ("cls_token", "pos_embed", "mask_embedding")  # the input tokens, exempt from weight decay, by name


def optimizer_of(module, cfg):
    return build_optimizer(param_groups(module, cfg.layer_decay), cfg)


def classifier(depth=2, drop_path=0.0, pool="cls", seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(32, 5)  # not zero-initialised, so the backbone gets gradients from the first step
    return Classification(VisionTransformer(16, 4, 32, depth, 2, drop_path), head, export_head=True, pool=pool)


def test_layer_decay_scales_follow_the_beit_formula_through_warmup_and_cosine():
    model = classifier(depth=2)
    cfg = TrainConfig(optimizer="adamw", lr=1e-2, layer_decay=0.5, steps=10, warmup_steps=2)
    optimizer = optimizer_of(model, cfg)
    scale_of = {id(p): g["lr_scale"] for g in optimizer.param_groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    expected = {"backbone.patch_embed.proj.weight": 0.5 ** 3, "backbone.cls_token": 0.5 ** 3, "backbone.pos_embed": 0.5 ** 3,
                "backbone.blocks.0.attn.qkv.weight": 0.5 ** 2, "backbone.blocks.0.norm1.bias": 0.5 ** 2,
                "backbone.blocks.1.mlp.2.weight": 0.5, "backbone.norm.weight": 1.0, "head.weight": 1.0, "head.bias": 1.0}
    params = dict(model.named_parameters())
    assert {name: scale_of[id(params[name])] for name in expected} == expected
    assert len(scale_of) == len(params)  # every parameter in exactly one group
    for name, p in params.items():  # the weight-decay exclusions still hold in every layer
        exempt = p.ndim <= 1 or name.split(".")[-1] in NO_DECAY
        assert wd_of[id(p)] == (0.0 if exempt else 0.05), name

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
    factor = warmup_cosine(cfg.warmup_steps, cfg.steps)
    for step in range(6):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(cfg.lr * group["lr_scale"] * factor(step))
        assert head_lr(optimizer) == pytest.approx(cfg.lr * factor(step))  # what train/lr logs: the head's
        optimizer.step()
        scheduler.step()


def test_mask_embedding_is_an_input_token_for_layer_decay():
    torch.manual_seed(0)
    objective = MaskedPatchPrediction(VisionTransformer(16, 4, 32, 3, 2))
    optimizer = optimizer_of(objective, TrainConfig(layer_decay=0.8))
    scale_of = {id(p): g["lr_scale"] for g in optimizer.param_groups for p in g["params"]}
    assert scale_of[id(objective.mask_embedding)] == pytest.approx(0.8 ** 4)
    assert scale_of[id(objective.head.weight)] == 1.0


def test_no_weight_decay_names_the_input_tokens_of_backbone_and_objective():
    objective = MaskedPatchPrediction(VisionTransformer(16, 4, 32, 2, 2))
    assert objective.no_weight_decay() == {"backbone.cls_token", "backbone.pos_embed", "mask_embedding"}
    assert classifier().no_weight_decay() == {"backbone.cls_token", "backbone.pos_embed"}
    optimizer = optimizer_of(objective, TrainConfig(weight_decay=0.05))
    wd_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for name, p in objective.named_parameters():
        exempt = p.ndim <= 1 or name.split(".")[-1] in NO_DECAY
        assert wd_of[id(p)] == (0.0 if exempt else 0.05), name


def todays_optimizer(module, cfg):
    """The optimiser before layer decay existed: two groups, decayed and exempt."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        (no_decay if param.ndim <= 1 or name.split(".")[-1] in NO_DECAY else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_layer_decay_one_is_todays_optimizer_exactly(name):
    cfg = TrainConfig(optimizer=name, lr=0.05, layer_decay=1.0, steps=10, warmup_steps=2)
    ours, reference = classifier(seed=3), classifier(seed=3)
    opt_ours, opt_ref = optimizer_of(ours, cfg), todays_optimizer(reference, cfg)
    assert len(opt_ours.param_groups) == 2
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(6) % 5
    for model, optimizer in ((ours, opt_ours), (reference, opt_ref)):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
        for _ in range(4):
            model(images, labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    for (name_a, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name_a


def test_drop_path_is_identity_in_eval_and_drops_about_its_rate_in_training():
    torch.manual_seed(0)
    branch = torch.ones(20000, 1, 1)
    drop = DropPath(0.3).train()
    out = drop(branch)
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - 0.3) < 0.02
    assert torch.allclose(out[out != 0], torch.tensor(1 / 0.7))  # kept samples rescaled: same expectation
    assert torch.equal(drop.eval()(branch), branch)

    model = VisionTransformer(16, 4, 32, 3, 2, drop_path=0.2)
    assert [b.drop_path.rate for b in model.blocks] == pytest.approx([0.0, 0.1, 0.2])  # linear over the blocks
    reference = VisionTransformer(16, 4, 32, 3, 2)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 16, 16)
    model.eval(), reference.eval()
    assert torch.equal(model(x), reference(x))


def test_a_blocks_residual_branch_is_dropped_for_the_rate_of_samples():
    torch.manual_seed(1)
    model = VisionTransformer(16, 4, 32, 2, 2, drop_path=0.4).train()
    block = model.blocks[1]  # rate 0.4
    x = torch.randn(4000, 5, 32)
    with torch.no_grad():
        attn_branch = block.drop_path(block.attn(block.norm1(x)))
    dropped = (attn_branch.abs().sum(dim=(1, 2)) == 0).float().mean().item()
    assert abs(dropped - 0.4) < 0.03


def test_drop_path_zero_is_todays_model_and_draws_no_random_numbers():
    model = VisionTransformer(16, 4, 32, 2, 2, drop_path=0.0).train()
    x = torch.randn(3, 3, 16, 16)
    before = torch.random.get_rng_state()
    trained = model(x)
    assert torch.equal(torch.random.get_rng_state(), before)  # the training run's random stream is unchanged
    assert torch.equal(trained, model.eval()(x))


def test_label_smoothing_reaches_the_loss(tmp_path):
    cfg = load_config(None, [*TINY, "train.label_smoothing=0.1", "finetune.pool=mean", "model.drop_path=0.1"])
    model = finetune.build_classifier(cfg, None, 5)
    assert model.label_smoothing == 0.1 and model.pool == "mean" and model.backbone.blocks[-1].drop_path.rate == 0.1
    images, labels = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])
    model.eval()
    logits = model.logits(images).float()
    assert torch.equal(model(images, labels).loss, F.cross_entropy(logits, labels, label_smoothing=0.1))


def test_mean_pooled_classifier_reads_the_mean_patch_output():
    model = classifier(pool="mean").eval()
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        encoded = model.backbone(normalize(images))
        assert torch.allclose(model.logits(images), model.head(encoded[:, 1:].mean(dim=1)))
        assert not torch.allclose(model.logits(images), model.head(encoded[:, 0]))


def test_mean_pooled_fine_tuning_trains_and_exports_as_dinov2(tmp_path, make_shards, capsys):
    make_shards([30, 30], size=32)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, "model.num_classes=10", "train.steps=3",
                             "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=3",
                             "finetune.eval_every=3", "finetune.pool=mean", "train.layer_decay=0.75", "model.drop_path=0.1"])
    finetune.run(cfg, ckpt=None)
    reset_accelerator()
    capsys.readouterr()
    # transformers' ViT classifies from [class] only; DINOv2's classifier represents the mean exactly (test_export).
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "wrote a transformers Dinov2ForImageClassification" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Dinov2ForImageClassification"]


# ---------------------------------------------------------------- mixup and CutMix


def test_mixup_loss_is_the_weighted_loss_of_both_labels_and_accuracy_counts_the_dominant_one(monkeypatch):
    model = classifier()
    model.mixing, model.label_smoothing = Mixing(mixup=0.8, cutmix=0.0, switch_prob=0.5, classes=5), 0.1
    images, labels = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])
    monkeypatch.setattr(Mixing, "draw", lambda self, height, width: Mix(0.7))
    out = model.train()(images, labels)
    mixed = (0.7 * images.float() + 0.3 * images.flip(0).float()).round().to(torch.uint8)  # each with the mirrored one
    logits = model.logits(mixed).float()
    # Soft-target cross-entropy with smoothing = the same blend of the two labels' smoothed losses.
    expected = (0.7 * F.cross_entropy(logits, labels, label_smoothing=0.1)
                + 0.3 * F.cross_entropy(logits, labels.flip(0), label_smoothing=0.1))
    assert torch.allclose(out.loss, expected)
    # Accuracy against the dominant label: the batch's own at weight 0.7, the mirrored image's at 0.2.
    predicted = torch.tensor([0, 1, 0, 0])  # right for 2 of the own labels, for 1 of the mirrored ones
    monkeypatch.setattr(model, "logits", lambda images: F.one_hot(predicted, 5).float())
    assert model(images, labels).metrics["accuracy"] == 0.5
    monkeypatch.setattr(Mixing, "draw", lambda self, height, width: Mix(0.2))
    assert model(images, labels).metrics["accuracy"] == 0.25
    monkeypatch.undo()
    # Evaluation never mixes.
    model.eval()
    assert torch.equal(model(images, labels).loss, F.cross_entropy(model.logits(images).float(), labels, label_smoothing=0.1))


def test_mixing_inside_a_compiled_forward_gives_the_eager_loss_and_only_a_run_that_mixes_imports_the_compiler():
    # The mix runs eagerly inside a compiled forward (torch.compiler.disable), wrapped when a Mixing is made: as a
    # decorator it imported torch._dynamo for every command that imports the model (predict, export: about a second).
    models = [classifier(), classifier()]
    for model in models:
        model.mixing = Mixing(mixup=0.8, cutmix=1.0, switch_prob=0.5, classes=5)
        model.train()
    assert pickle.loads(pickle.dumps(models[0].mixing)) == models[0].mixing  # as a plain dataclass did
    eager, compiled = models[0], runtime.compiled(models[1], "inductor", "default")
    images, labels = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])
    for seed in (0, 1, 2):  # mixup and CutMix boxes of several sizes, the same draws for both
        random.seed(seed)
        expected = eager(images, labels).loss
        random.seed(seed)
        assert torch.allclose(compiled(images, labels).loss, expected, rtol=1e-4, atol=1e-5)
    imported = subprocess.run([sys.executable, "-c", "import sys, pipelines.stages.predict, pipelines.stages.export; "
                               "print('torch._dynamo' in sys.modules)"], cwd=ROOT, capture_output=True, text=True)
    assert imported.stdout.strip() == "False", imported.stderr


def test_cutmix_weight_is_the_share_of_pixels_each_image_keeps_clipped_boxes_included():
    mixing = Mixing(mixup=0.0, cutmix=1.0, switch_prob=0.5, classes=4)
    images = torch.arange(4, dtype=torch.uint8).mul(60).view(4, 1, 1, 1).expand(4, 3, 16, 12).contiguous()
    labels = torch.tensor([0, 1, 2, 3])
    clipped = 0
    for seed in range(30):
        mix = mixing.draw(16, 12, random.Random(seed))
        top, bottom, left, right = mix.box
        clipped += (bottom - top) % 2 or (right - left) % 2 or 0 in (top, left) or bottom == 16 or right == 12
        mixed, targets = mixing.apply(images, labels, mix)
        kept = (mixed == images).all(dim=1).float().mean(dim=(1, 2))  # per image: its own pixels' share
        assert torch.allclose(kept, torch.full((4,), mix.lam))
        assert torch.allclose(targets, mix.lam * F.one_hot(labels, 4) + (1 - mix.lam) * F.one_hot(labels.flip(0), 4))
    assert clipped  # some boxes met the border, and the weight still follows the pixels


def test_with_mixup_and_cutmix_on_the_switch_probability_picks_cutmix():
    draws = [Mixing(0.8, 1.0, 0.25, 10).draw(16, 16, random.Random(seed)) for seed in range(400)]
    assert 0.18 < sum(d.box is not None for d in draws) / len(draws) < 0.32
    assert all(Mixing(0.8, 0.0, 1.0, 10).draw(16, 16, random.Random(s)).box is None for s in range(20))  # cutmix off
    assert all(Mixing(0.0, 1.0, 0.0, 10).draw(16, 16, random.Random(s)).box is not None for s in range(20))  # mixup off


def test_mixed_batches_and_the_ema_update_neither_read_the_device_nor_build_tensors_from_host_values(monkeypatch):
    # As tests/test_speed.py checks of the whole step: on a GPU either would make the host wait every step.
    model = classifier().train()
    model.mixing = Mixing(mixup=0.8, cutmix=1.0, switch_prob=0.5, classes=5)
    average = WeightAverage(model, 0.99)
    images, labels = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for mix in (Mix(0.7), Mix(0.6, (2, 10, 3, 9))):  # mixup, then CutMix
            monkeypatch.setattr(Mixing, "draw", lambda self, height, width, mix=mix: mix)
            model(images, labels).loss.backward()
            average.update(model)
    ops = {event.name for event in profile.events()}
    assert "aten::_foreach_lerp_" in ops and "aten::scatter_" in ops  # both were profiled
    assert not ops & {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::lift_fresh"}, ops


# ---------------------------------------------------------------- the weights' EMA


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_the_weight_average_after_a_step_is_the_blend_of_the_weights_before_and_after_it(decay):
    model = classifier()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    average = WeightAverage(model, decay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])).loss.backward()
    optimizer.step()
    average.update(model)
    after = model.state_dict()
    assert sum(not torch.equal(before[name], after[name]) for name in after) > 5  # the step moved the weights
    for name, averaged in average.module.state_dict().items():
        if decay == 0:
            assert torch.equal(averaged, after[name]), name
        else:
            assert torch.allclose(averaged, decay * before[name] + (1 - decay) * after[name], rtol=1e-6, atol=1e-8), name
    assert not any(p.requires_grad for p in average.module.parameters())


def test_fine_tuning_with_mixup_cutmix_randaugment_and_an_ema_trains_end_to_end_and_scores_the_ema(tmp_path, make_shards):
    make_shards([30, 30], size=24)
    write_test_shards(tmp_path / "val", [7, 5, 3], size=24)
    finetune.run(finetune_config(tmp_path, "train.mixup=0.8", "train.cutmix=1.0", "train.label_smoothing=0.1",
                                 "data.randaugment_ops=2", "train.ema_decay=0.5", "train.lr=0.1"), ckpt=None)
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert "mixup 0.8 or CutMix 1" in results["description"]
    assert 0 <= results["final"]["train/accuracy"] <= 1 and results["final"]["train/loss"] > 0
    exported = load_file(tmp_path / "ft" / "model.safetensors")
    last = tmp_path / "ft" / "checkpoints" / "step_00000006"
    trained = load_file(last / "model.safetensors")  # the weights the optimiser moved
    saved_ema = next(state for state in (torch.load(p) for p in sorted(last.glob("custom_checkpoint_*.pkl")))
                     if "head.weight" in state)
    assert all(torch.equal(exported[name], saved_ema[name if name.startswith("head.") else f"backbone.{name}"]) for name in exported)
    assert not torch.equal(exported["head.weight"], trained["head.weight"])  # the average, not the last weights
    assert results["top1"] == pytest.approx(recount(tmp_path / "ft", tmp_path / "val")[0])  # scored: the exported EMA
