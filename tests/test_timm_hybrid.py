"""The hybrid's stem as timm's hybrids compute it (model.stem_padding=same), hybrids saved before that setting
(symmetric, kept exact), and the export of a hybrid to timm's layout."""

import json
import math

import pytest
import torch
import yaml
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mpp.config import load_config
from mpp.model.checkpoint import load_backbone, save_weights
from mpp.model.objectives import Classification, finetuning_head, masked_patch_prediction
from mpp.model.vit import ResNetStem, build_backbone
from mpp.rundir import MANIFEST, complete_checkpoints, write_manifest
from pipelines import cli
from pipelines.stages import compare
from pipelines.run.start import checkpoint_config

from conftest import TINY

HYBRID = ["model.stem=resnet", "model.stem_layers=[1]", "model.stem_width=8"]  # stride 4, TINY's patch size


def tiny(*overrides):
    return load_config(None, [*TINY, *overrides])


def timm_same_padding(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """timm 1.0.31's layers/padding.py pad_same: get_same_padding per axis, the smaller half before."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):  # F.pad's order: width first
        total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value)


def reference_stem(stem: ResNetStem, x: torch.Tensor, same: bool) -> torch.Tensor:
    """The stem's weights applied with torch's functional ops: timm's StdConv2dSame (F.batch_norm over each filter,
    epsilon 1e-8), GroupNormAct (epsilon 1e-5) and MaxPool2dSame (-inf padding) where `same`, else PyTorch's
    symmetric padding with epsilon 1e-6 (mpp's first stem)."""
    eps = 1e-5 if same else 1e-6

    def conv(module, x, stride, kernel):
        w = F.batch_norm(module.weight.reshape(1, module.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-8).reshape_as(module.weight)
        if same:
            return F.conv2d(timm_same_padding(x, kernel, stride), w, None, stride)
        return F.conv2d(x, w, None, stride, kernel // 2)

    def norm(module, x):
        return F.group_norm(x, module.num_groups, module.weight, module.bias, eps)

    x = F.relu(norm(stem.root[1], conv(stem.root[0], x, 2, 7)))
    x = F.max_pool2d(timm_same_padding(x, 3, 2, -math.inf), 3, 2) if same else F.max_pool2d(x, 3, 2, 1)
    for stage in stem.stages:
        for unit in stage:
            stride = unit.conv2.stride[0]
            shortcut = x if unit.downsample is None else norm(unit.downsample[1], conv(unit.downsample[0], x, stride, 1))
            y = F.relu(norm(unit.norm1, conv(unit.conv1, x, 1, 1)))
            y = F.relu(norm(unit.norm2, conv(unit.conv2, y, stride, 3)))
            x = F.relu(norm(unit.norm3, conv(unit.conv3, y, 1, 1)) + shortcut)
    return x


@pytest.mark.parametrize("padding", ["same", "symmetric"])
def test_the_stem_computes_timms_same_padded_resnet_or_the_symmetric_one_it_had(padding):
    torch.manual_seed(0)
    stem = ResNetStem((1, 2), 32, padding).double().eval()  # float64: both sides' rounding far below the tolerance
    with torch.no_grad():
        for module in stem.modules():
            if isinstance(module, torch.nn.GroupNorm):  # not the identity they start as
                module.weight.normal_(1.0, 0.3), module.bias.normal_(0.0, 0.3)
    for height, width in ((32, 32), (30, 37), (17, 24)):  # even, odd and mixed sides: 'SAME' differs from symmetric
        images = torch.randn(2, 3, height, width, dtype=torch.float64)
        with torch.no_grad():
            got = stem(images)
            assert torch.allclose(got, reference_stem(stem, images, padding == "same"), atol=1e-6), (height, width)
            assert not torch.allclose(got, reference_stem(stem, images, padding != "same"), atol=1e-3)
    assert tiny(*HYBRID).model.stem_padding == "same"  # a new run gets timm's stem


def strip_stem_padding(path):
    """`path` as a hybrid's weights file written before model.stem_padding: its metadata without the key."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    about = json.loads(metadata["mpp"])
    del about["stem_padding"]
    save_file(load_file(path), str(path), metadata={"mpp": json.dumps(about)})


def test_a_hybrid_saved_before_stem_padding_loads_and_predicts_as_it_did(tmp_path):
    cfg = tiny(*HYBRID, "model.stem_padding=symmetric")
    objective = Classification(build_backbone(cfg.model), finetuning_head(64, 3), export_head=True)
    with torch.no_grad():
        objective.head.weight.normal_()
    save_weights(objective, tmp_path / "model.safetensors")
    strip_stem_padding(tmp_path / "model.safetensors")
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        expected = objective.eval().backbone(images)
    # Outside a run: the configuration predict and export build from the file, with the defaults' stem_padding=same.
    outside = checkpoint_config(str(tmp_path / "model.safetensors"), None, [])
    backbone = load_backbone(tmp_path / "model.safetensors", outside.model).eval()
    assert backbone.stem_padding == "symmetric"
    with torch.no_grad():
        assert torch.allclose(backbone(images), expected, atol=1e-6)
    # Inside its run: a config.yaml written before the setting (no model.stem_padding) says the same.
    saved = cfg.model_dump(mode="json")
    del saved["model"]["stem_padding"]
    (tmp_path / "config.yaml").write_text(json.dumps(saved))
    assert checkpoint_config(str(tmp_path / "model.safetensors"), None, []).model.stem_padding == "symmetric"
    # Fine-tuning from it keeps its stem (the config it records says so); saying otherwise is one line.
    args = cli.parse_args(["finetune", "--ckpt", str(tmp_path / "model.safetensors"), *TINY, *HYBRID])
    assert cli.run_config(args).model.stem_padding == "symmetric"
    finetune = tiny(*HYBRID, "model.stem_padding=same").model
    with pytest.raises(Exception, match="trained with model.stem_padding=symmetric but the config says model.stem_padding=same"):
        load_backbone(tmp_path / "model.safetensors", finetune)


def test_a_run_saved_before_stem_padding_resumes_with_its_symmetric_stem(tmp_path, make_shards):
    make_shards([24], size=16)
    run = tmp_path / "run"
    common = [f"data.shards={tmp_path / 'shards'}", f"output_dir={run}", *TINY, *HYBRID, "train.warmup_steps=1",
              "train.batch_size=4", "train.checkpoint_every=2"]
    assert cli.main(["pretrain", *common, "model.stem_padding=symmetric", "train.steps=2"]) == 0
    # As an older mpp left it: no model.stem_padding in config.yaml, run.json or the checkpoint's config.yaml.
    for path in (run / "config.yaml", complete_checkpoints(run)[-1] / "config.yaml"):
        tree = yaml.safe_load(path.read_text())
        del tree["model"]["stem_padding"]
        path.write_text(yaml.safe_dump(tree))
    manifest = json.loads((run / "run.json").read_text())
    del manifest["config"]["model"]["stem_padding"]
    (run / "run.json").write_text(json.dumps(manifest))
    (complete_checkpoints(run)[-1] / MANIFEST).unlink()  # written again over the edited files, as that mpp wrote it
    write_manifest(complete_checkpoints(run)[-1], 1)
    assert cli.main(["pretrain", "--resume", f"output_dir={run}", "train.steps=4"]) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["stem_padding"] == "symmetric"
    with safe_open(str(run / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["mpp"])["stem_padding"] == "symmetric"


def timm_hybrid_layout(layers, width, depth, grid, classes):
    """{name: shape} of timm 1.0.31's hybrid with this ResNet, as its source builds it (timm cannot be imported here,
    its torchvision does not load with this CPU torch): vision_transformer_hybrid._resnetv2 makes
    ResNetV2(layers, stem_chs=64, preact=False, stem_type='same') -> stem.conv (7x7) and stem.norm (GroupNormAct);
    stages.S.blocks.U: Bottleneck conv1/norm1 (1x1), conv2/norm2 (3x3), conv3/norm3 (1x1), out 256 x 2^S, mid a
    quarter of it, the first unit's downsample DownsampleConv conv/norm; HybridEmbed's proj a 1x1 Conv2d with bias;
    VisionTransformer's cls_token, pos_embed (1, 1 + cells, D), blocks.i norm1, attn.qkv, attn.proj, norm2,
    mlp.fc1, mlp.fc2, norm, head."""
    shapes = {"patch_embed.backbone.stem.conv.weight": (64, 3, 7, 7),
              "patch_embed.backbone.stem.norm.weight": (64,), "patch_embed.backbone.stem.norm.bias": (64,)}
    channels_in = 64
    for s, units in enumerate(layers):
        out = 256 * 2 ** s
        mid = out // 4
        for u in range(units):
            unit = f"patch_embed.backbone.stages.{s}.blocks.{u}."
            c_in = channels_in if u == 0 else out
            shapes.update({unit + "conv1.weight": (mid, c_in, 1, 1), unit + "conv2.weight": (mid, mid, 3, 3),
                           unit + "conv3.weight": (out, mid, 1, 1)})
            for norm, channels in (("norm1", mid), ("norm2", mid), ("norm3", out)):
                shapes.update({unit + f"{norm}.weight": (channels,), unit + f"{norm}.bias": (channels,)})
            if u == 0:
                shapes.update({unit + "downsample.conv.weight": (out, c_in, 1, 1),
                               unit + "downsample.norm.weight": (out,), unit + "downsample.norm.bias": (out,)})
        channels_in = out
    shapes.update({"patch_embed.proj.weight": (width, channels_in, 1, 1), "patch_embed.proj.bias": (width,),
                   "cls_token": (1, 1, width), "pos_embed": (1, 1 + grid * grid, width),
                   "norm.weight": (width,), "norm.bias": (width,), "head.weight": (classes, width), "head.bias": (classes,)})
    for i in range(depth):
        block = f"blocks.{i}."
        for name, shape in (("norm1.weight", (width,)), ("norm1.bias", (width,)), ("attn.qkv.weight", (3 * width, width)),
                            ("attn.qkv.bias", (3 * width,)), ("attn.proj.weight", (width, width)), ("attn.proj.bias", (width,)),
                            ("norm2.weight", (width,)), ("norm2.bias", (width,)), ("mlp.fc1.weight", (4 * width, width)),
                            ("mlp.fc1.bias", (4 * width,)), ("mlp.fc2.weight", (width, 4 * width)), ("mlp.fc2.bias", (width,))):
            shapes[block + name] = shape
    return shapes


def test_an_r50_hybrid_classifier_exports_to_timms_layout_and_config(tmp_path):
    cfg = tiny("model.stem=resnet", "model.stem_layers=[3,4,9]", "model.stem_width=64", "model.image_size=32",
               "model.patch_size=null", "model.pos_embed=learned_2d")
    objective = Classification(build_backbone(cfg.model), finetuning_head(64, 3), export_head=True, pool="mean",
                               class_names=("cat", "dog", "cow"))
    save_weights(objective, tmp_path / "model.safetensors")
    assert cli.main(["export", "--ckpt", str(tmp_path / "model.safetensors"), "--to", "timm", str(tmp_path / "timm")]) == 0
    tensors = load_file(tmp_path / "timm" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == timm_hybrid_layout((3, 4, 9), 64, 2, 2, 3)
    backbone = objective.backbone
    assert torch.equal(tensors["pos_embed"], backbone.position_embeddings())  # the table learned_2d adds
    assert torch.equal(tensors["patch_embed.backbone.stages.2.blocks.8.norm3.weight"],
                       backbone.patch_embed.stem.stages[2][8].norm3.weight)
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["architecture"] == "vit_base_r50_s16_224" and config["num_classes"] == 3
    assert config["model_args"] == {"img_size": 32, "embed_dim": 64, "depth": 2, "num_heads": 2, "global_pool": "avg",
                                    "fc_norm": False}
    assert config["label_names"] == ["cat", "dog", "cow"]
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32] and config["pretrained_cfg"]["mean"] == [0.5] * 3
    card = (tmp_path / "timm" / "README.md").read_text()
    assert "library_name: timm" in card and "timm.create_model('local-dir:" in card and "not loaded by timm" in card


@pytest.mark.parametrize("overrides, message", [
    (HYBRID, "timm has no hybrid with its ResNet (model.stem_layers=[1], model.stem_width=8)"),
    (["model.stem=resnet", "model.stem_layers=[3,4,9]", "model.image_size=32", "model.patch_size=null",
      "model.stem_padding=symmetric"], "its ResNet stem pads symmetrically (model.stem_padding=symmetric"),
    ([], "it is a plain ViT (model.stem=patch)"),
])
def test_what_timm_has_no_hybrid_for_is_refused_in_one_line(tmp_path, capsys, overrides, message):
    cfg = tiny(*overrides)
    save_weights(masked_patch_prediction(build_backbone(cfg.model), cfg, None), tmp_path / "model.safetensors")
    assert cli.main(["export", "--ckpt", str(tmp_path / "model.safetensors"), "--to", "timm", str(tmp_path / "timm")]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot export to timm's layout: " + message in err and "\n" not in err
    assert not (tmp_path / "timm").exists()


@pytest.mark.parametrize("stem, reused", [([], True), (HYBRID, False)])
def test_a_comparison_stage_finished_before_stem_padding_is_reused_where_the_stem_pads_nothing(tmp_path, stem, reused):
    # A plan's finished fine-tuning, as an older mpp recorded it: its model settings without model.stem_padding.
    model = tiny(*stem).model.model_dump()
    old = {key: value for key, value in model.items() if key != "stem_padding"}
    (tmp_path / "stage.json").write_text(json.dumps({"inputs": {"model": old}, "top1": 0.5}))
    reran = []
    if reused:  # a patch stem pads nothing: the same run, not redone
        assert compare.stage(tmp_path, "fine-tuning", {"model": model}, lambda: reran.append(1) or {})["top1"] == 0.5
        assert not reran
    else:  # that hybrid's stem padded symmetrically; the plan's new one pads 'same': another run, said in one line
        with pytest.raises(compare.CompareError, match=r"finished with other settings \(model\)"):
            compare.stage(tmp_path, "fine-tuning", {"model": model}, lambda: reran.append(1) or {})
