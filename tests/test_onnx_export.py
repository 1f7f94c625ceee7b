"""`mpp export --to onnx DIR`: classifiers and backbones, plain and hybrid, loaded by onnxruntime and run on images
prepared as `mpp predict` prepares them, against mpp's own outputs; and the model card's snippet run as written."""

import json
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import launch
from mpp.model.checkpoint import save_weights
from mpp.model.objectives import Classification, finetuning_head, masked_patch_prediction
from mpp.model.vit import VisionTransformer, normalize
from pipelines.run.start import checkpoint_config
from pipelines.stages.predict import classifier, read_batches

onnxruntime = pytest.importorskip("onnxruntime", reason="the ONNX export test needs onnxruntime (pip install -e '.[test]')")
pytest.importorskip("onnxscript", reason="the ONNX export needs onnxscript (pip install -e '.[test]')")

SIZE, WIDTH = 16, 32
# mpp's own stems at SIZE px: the paper's linear patch embedding, and configs/compare/hybrid.yaml's one-stage ResNet.
PLAIN = {"patch_size": 4}
HYBRID = {"patch_size": 4, "stem": "resnet", "stem_layers": (1,), "stem_width": 8}


def random_vit(seed: int, **architecture) -> VisionTransformer:
    """Every parameter random (biases and norms included), so a mis-traced part cannot go unnoticed."""
    torch.manual_seed(seed)
    model = VisionTransformer(image_size=SIZE, width=WIDTH, depth=2, heads=4, **architecture)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model.eval()


def images_in(folder) -> list:
    """Non-square PNGs: wide and tall, cropped at even and odd offsets, resized by 1.5 and 2 or not at all (sizes at
    which PIL's resize, the card's, and mpp's uint8 kernel give the same pixels), one of them half transparent."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(40, 24), (24, 36), (16, 41), (41, 16), (64, 32)]):
        pixels = rng.integers(0, 256, (h, w, 4 if i == 1 else 3), dtype=np.uint8)
        paths.append(folder / f"{i}.png")
        Image.fromarray(pixels, "RGBA" if i == 1 else "RGB").save(paths[-1])
    return paths


def card_snippet(export_dir, image) -> dict:
    """Run the model card's Python as written, on `image`; returns its names (its `pixels`, its outputs)."""
    card = (export_dir / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace("'image.jpg'", repr(str(image)))
    names: dict = {}
    exec(compile(code, "README.md", "exec"), names)
    return names


@pytest.mark.parametrize("architecture, pool", [(PLAIN, "mean"), (PLAIN, "cls"), (HYBRID, "cls")],
                         ids=["plain-mean", "plain-cls", "hybrid-stem1-cls"])
def test_onnxruntime_gives_mpp_predicts_logits_and_classes_on_non_square_images(tmp_path, capsys, architecture, pool):
    model = Classification(random_vit(1, **architecture), finetuning_head(WIDTH, 4), export_head=True, pool=pool,
                           class_names=("red", "green", "blue", "grey"))
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0), model.head.bias.normal_(0, 1.0)
    ckpt = str(tmp_path / "model.safetensors")
    save_weights(model, ckpt)
    assert launch.main(["export", "--ckpt", ckpt, "--to", "onnx", str(tmp_path / "onnx")]) == 0
    assert "wrote an ONNX classifier" in capsys.readouterr().out
    images = images_in(tmp_path)
    assert launch.main(["predict", "--ckpt", ckpt, *map(str, images), "--top-k", "4", "--out", str(tmp_path / "ours.json")]) == 0
    predicted = {r["image"]: r["top"] for r in json.loads((tmp_path / "ours.json").read_text())["predictions"]}

    _, pixels = next(read_batches(images, SIZE, len(images), {}))  # as `mpp predict` prepares them
    with torch.no_grad():
        expected = classifier(checkpoint_config(ckpt, None, []), ckpt).logits(pixels).numpy()
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    batch = normalize(pixels).numpy()
    logits = session.run(["logits"], {"pixel_values": batch})[0]  # 5 images, where the export traced 2
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(session.run(["logits"], {"pixel_values": batch[:1]})[0], expected[:1], atol=1e-4, rtol=0)

    config = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert config["id2label"] == {"0": "red", "1": "green", "2": "blue", "3": "grey"} and config["pool"] == pool
    assert config["preprocessing"]["size"] == [SIZE, SIZE] and config["preprocessing"]["background"] == [128] * 3
    probabilities = torch.from_numpy(logits).softmax(-1)
    for path, p in zip(images, probabilities):
        top = predicted[str(path)]
        assert [config["id2label"][str(i)] for i in p.argsort(descending=True).tolist()] == [t["class"] for t in top]
        assert sorted(p.tolist(), reverse=True) == pytest.approx([t["probability"] for t in top], abs=1e-5)

    snippet = card_snippet(tmp_path / "onnx", images[0])
    assert capsys.readouterr().out.strip() == str([predicted[str(images[0])][0]["class"]])  # the card's print
    prepared = np.stack([snippet["pixels"](path) for path in images])  # transparency over grey, crop, resize
    np.testing.assert_allclose(prepared, batch, atol=1e-6, rtol=0)
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "library_name: onnx" in card and ("masked-patch-prediction, hybrid]" in card) == (architecture is HYBRID)


def test_a_pretraining_checkpoint_exports_as_a_backbone_with_mpps_features(tmp_path):
    from mpp.config import load_config

    from conftest import TINY

    cfg = load_config(None, [*TINY, "model.pos_embed=sincos_2d"])
    objective = masked_patch_prediction(random_vit(2, patch_size=4, pos_embed="sincos_2d"), cfg, None)
    ckpt = str(tmp_path / "model.safetensors")
    save_weights(objective, ckpt)  # the backbone alone: the pretraining head is never exported
    assert launch.main(["export", "--ckpt", ckpt, "--to", "onnx", str(tmp_path / "onnx")]) == 0
    images = images_in(tmp_path)
    _, pixels = next(read_batches(images, SIZE, len(images), {}))
    with torch.no_grad():
        expected = objective.backbone(normalize(pixels)).numpy()
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    tokens, features = session.run(["last_hidden_state", "pooler_output"], {"pixel_values": normalize(pixels).numpy()})
    np.testing.assert_allclose(tokens, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(features, expected[:, 0], atol=1e-4, rtol=0)
    config = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert "id2label" not in config and config["outputs"]["last_hidden_state"] == ["batch", 17, WIDTH]
    snippet = card_snippet(tmp_path / "onnx", images[3])
    np.testing.assert_allclose(snippet["features"], expected[3:4, 0], atol=1e-4, rtol=0)


def test_export_without_the_onnx_extra_names_it_in_one_line(tmp_path, capsys, monkeypatch):
    save_weights(Classification(random_vit(0, **PLAIN), finetuning_head(WIDTH, 2), export_head=True),
                 tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # what `import onnxscript` does when it is not installed
    assert launch.main(["export", "--ckpt", str(tmp_path / "model.safetensors"), "--to", "onnx", str(tmp_path / "onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'mpp[onnx]'" in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "onnx").exists()
