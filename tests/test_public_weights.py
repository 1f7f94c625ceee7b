"""Public weights as a starting point: `finetune --ckpt` on a Hugging Face ViT directory and on a timm ViT's
model.safetensors, each loaded into this project's ViT with the outputs transformers gives for the same weights.

The weights are made here, offline: a small transformers ViT (a classifier over 10 classes, as an ImageNet one is over
1000) saved with save_pretrained, and the same tensors under timm's names (timm itself is not imported)."""

import pytest
import torch
from safetensors.torch import save_file

from mpp.config import load_config
from mpp.errors import UserError
from mpp.model.checkpoint import load_backbone
from mpp.model.vit import normalize
from pipelines.stages import finetune, prepare

from conftest import TINY
from test_user_folder import colour_folder

transformers = pytest.importorskip("transformers")

WIDTH, HEADS, PATCH, SIZE = 64, 4, 8, 32


@pytest.fixture(scope="module")
def public_vit(tmp_path_factory):
    """A transformers ViTForImageClassification with random weights, saved as the Hub holds one: (its directory, the
    model)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
                                    intermediate_size=4 * WIDTH, image_size=SIZE, patch_size=PATCH, num_labels=10)
    model = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # the class token and position embeddings start at zero-ish: make them matter
        model.vit.embeddings.cls_token.normal_()
        model.vit.embeddings.position_embeddings.normal_()
    directory = tmp_path_factory.mktemp("hub") / "vit-tiny-public"
    model.save_pretrained(directory)
    return directory, model


def timm_names(directory) -> dict[str, torch.Tensor]:
    """The saved transformers ViT's tensors as timm's vision_transformer names them (save_pretrained's on-disk names
    in, timm's out)."""
    from safetensors.torch import load_file

    hf = {k.removeprefix("vit."): v for k, v in load_file(directory / "model.safetensors").items()}
    timm = {"cls_token": hf["embeddings.cls_token"], "pos_embed": hf["embeddings.position_embeddings"],
            "patch_embed.proj.weight": hf["embeddings.patch_embeddings.projection.weight"],
            "patch_embed.proj.bias": hf["embeddings.patch_embeddings.projection.bias"],
            "norm.weight": hf["layernorm.weight"], "norm.bias": hf["layernorm.bias"],
            "head.weight": hf["classifier.weight"], "head.bias": hf["classifier.bias"]}
    for i in range(2):
        layer = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            timm[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([hf[f"{layer}attention.attention.{x}.{kind}"] for x in ("query", "key", "value")])
            timm.update({f"blocks.{i}.{mine}.{kind}": hf[f"{layer}{theirs}.{kind}"] for theirs, mine in (
                ("attention.output.dense", "attn.proj"), ("layernorm_before", "norm1"), ("layernorm_after", "norm2"),
                ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2"))})
    return timm


def images(count=4):
    return torch.randint(0, 256, (count, 3, SIZE, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def model_section(*overrides):
    return load_config(None, [f"model.patch_size={PATCH}", f"model.image_size={SIZE}", *overrides]).model


def test_a_hugging_face_vit_loads_with_transformers_outputs(public_vit):
    directory, model = public_vit
    backbone = load_backbone(directory, model_section()).eval()
    with torch.no_grad():
        expected = model.vit(pixel_values=normalize(images())).last_hidden_state
        ours = backbone(normalize(images()))
    assert (backbone.width, backbone.depth, backbone.heads) == (WIDTH, 2, HEADS)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("without_class_position", [False, True])
def test_a_timm_vit_loads_with_the_same_outputs(public_vit, tmp_path, without_class_position):
    directory, model = public_vit
    tensors = timm_names(directory)
    position_of_class = tensors["pos_embed"][:, :1]
    if without_class_position:  # timm's no_embed_class: the table has no [class] row, [class] gets no position
        with torch.no_grad():
            model.vit.embeddings.position_embeddings[:, :1] = 0
        tensors["pos_embed"] = tensors["pos_embed"][:, 1:].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    try:
        backbone = load_backbone(tmp_path, model_section(f"model.heads={HEADS}")).eval()
        with torch.no_grad():
            expected = model.vit(pixel_values=normalize(images())).last_hidden_state
            ours = backbone(normalize(images()))
    finally:
        with torch.no_grad():
            model.vit.embeddings.position_embeddings[:, :1] = position_of_class
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_a_timm_vit_with_parts_the_paper_has_not_is_refused_by_name(public_vit, tmp_path):
    directory, _ = public_vit
    save_file({**timm_names(directory), "fc_norm.weight": torch.ones(WIDTH), "fc_norm.bias": torch.zeros(WIDTH)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"holds a timm ViT with a LayerNorm after mean pooling \(global_pool='avg'\), "
                                        r"which this project's ViT \(the paper's\) has not"):
        load_backbone(tmp_path, model_section(f"model.heads={HEADS}"))


@pytest.mark.parametrize("layout", ["hf", "timm"])
def test_finetune_from_public_weights_at_another_resolution(public_vit, tmp_path, layout):
    directory, _ = public_vit
    if layout == "timm":
        directory = tmp_path / "timm"
        directory.mkdir()
        save_file(timm_names(public_vit[0]), str(directory / "model.safetensors"))
    prepare.run(str(colour_folder(tmp_path / "photos", [6, 6, 6])), str(tmp_path / "train"))
    cfg = load_config(None, [*TINY, f"data.shards={tmp_path / 'train'}", "finetune.val_split=0.25",
                             f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.warmup_steps=1",
                             "train.batch_size=6", "finetune.eval_every=2", "train.checkpoint_every=2",
                             "model.image_size=16", f"model.patch_size={PATCH}", f"model.heads={HEADS}",
                             "model.width=null", "model.depth=null"])

    results = finetune.run(cfg, ckpt=str(directory))

    assert results["ckpt"] == str(directory) and results["num_classes"] == 3
    fine_tuned = load_backbone(tmp_path / "run", cfg.model)
    assert (fine_tuned.width, fine_tuned.depth, fine_tuned.grid) == (WIDTH, 2, 16 // PATCH)
