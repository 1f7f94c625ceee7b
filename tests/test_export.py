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
