import json

import pytest
import torch

from mpp.hf import export_hf
from mpp.model import VisionTransformer
from mpp.objectives import normalize

transformers = pytest.importorskip("transformers", minversion="5", reason="the export test needs transformers>=5 (pip install -e '.[test]')")


def random_vit(seed: int = 0) -> VisionTransformer:
    """Every parameter random (biases and norms included), so a mis-mapped tensor cannot go unnoticed."""
    torch.manual_seed(seed)
    model = VisionTransformer(image_size=16, patch_size=4, width=32, depth=2, heads=4)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model.eval()


def test_exported_vit_model_gives_our_features(tmp_path):
    ours = random_vit()
    assert export_hf(ours, tmp_path / "hf") == "ViTModel"
    theirs = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))
        got = theirs(pixel_values=normalize(images)).last_hidden_state
    assert torch.allclose(got[:, 0], expected[:, 0], atol=1e-5)  # the [class]-token representation
    assert torch.allclose(got, expected, atol=1e-5)
    preprocessing = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert preprocessing["image_mean"] == [0.5] * 3 and preprocessing["image_std"] == [0.5] * 3
    assert preprocessing["size"] == {"height": 16, "width": 16}


def test_exported_classifier_gives_our_logits(tmp_path):
    ours = random_vit(1)
    head = {"weight": torch.randn(5, 32), "bias": torch.randn(5)}
    names = {i: f"class{i}" for i in range(5)}
    assert export_hf(ours, tmp_path / "hf", head, id2label=names) == "ViTForImageClassification"
    theirs = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))[:, 0] @ head["weight"].T + head["bias"]
        got = theirs(pixel_values=normalize(images)).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert theirs.config.id2label[3] == "class3"


def test_export_stage_writes_a_fine_tuned_run_as_a_classifier(tmp_path, make_shards, capsys):
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    import launch
    from mpp.checkpoint import load_backbone
    from mpp.config import load_config
    from pipelines import finetune
    from test_pretrain import TINY

    make_shards([30, 30], size=32)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, "model.num_classes=10", "train.steps=3",
                             "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=3", "finetune.eval_every=3"])
    try:
        finetune.run(cfg, ckpt=None)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "ViTForImageClassification" in capsys.readouterr().out
    theirs = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    ours = load_backbone(tmp_path / "run", cfg.model).eval()
    head = load_file(tmp_path / "run" / "model.safetensors")
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))[:, 0] @ head["head.weight"].T + head["head.bias"]
        got = theirs(pixel_values=normalize(images)).logits
    assert torch.allclose(got, expected, atol=1e-5)

    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "onnx", str(tmp_path / "x")]) == 2
    assert "unknown export format 'onnx'" in capsys.readouterr().err
