import json
import re
import logging
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.model.hf import ExportError, export_hf
from mpp.model.vit import VisionTransformer
from mpp.model.objectives import normalize

transformers = pytest.importorskip("transformers", minversion="5", reason="the export test needs transformers>=5 (pip install -e '.[test]')")


def random_vit(seed: int = 0) -> VisionTransformer:
    """Every parameter random (biases and norms included), so a mis-mapped tensor cannot go unnoticed."""
    torch.manual_seed(seed)
    model = VisionTransformer(image_size=16, patch_size=4, width=32, depth=2, heads=4)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model.eval()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_quietly(load, path):
    """`load(path)` with what it warns about collected: transformers' logged warnings (its load report: missing,
    unexpected, newly initialised weights) and Python warnings."""
    records = Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load(path)
    finally:
        logger.removeHandler(records)
    return model, records.messages + [str(w.message) for w in caught]


def test_exported_vit_model_gives_our_features_and_loads_silently(tmp_path):
    ours = random_vit()
    assert export_hf(ours, tmp_path / "hf") == "ViTModel"
    theirs, complaints = load_quietly(transformers.ViTModel.from_pretrained, tmp_path / "hf")
    assert complaints == []  # no "pooler ... newly initialized"
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))
        got = theirs.eval()(pixel_values=normalize(images))
    assert torch.allclose(got.last_hidden_state[:, 0], expected[:, 0], atol=1e-5)  # the [class]-token representation
    assert torch.allclose(got.last_hidden_state, expected, atol=1e-5)
    assert torch.allclose(got.pooler_output, expected[:, 0], atol=1e-5)  # the exported pooler is the identity
    preprocessing = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert preprocessing["image_mean"] == [0.5] * 3 and preprocessing["image_std"] == [0.5] * 3
    assert preprocessing["size"] == preprocessing["crop_size"] == {"height": 16, "width": 16}


def test_exported_classifier_gives_our_logits(tmp_path):
    ours = random_vit(1)
    head = {"weight": torch.randn(5, 32), "bias": torch.randn(5)}
    names = {i: f"class{i}" for i in range(5)}
    assert export_hf(ours, tmp_path / "hf", head, id2label=names) == "ViTForImageClassification"
    theirs, complaints = load_quietly(transformers.ViTForImageClassification.from_pretrained, tmp_path / "hf")
    assert complaints == []
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))[:, 0] @ head["weight"].T + head["bias"]
        got = theirs.eval()(pixel_values=normalize(images)).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert theirs.config.id2label[3] == "class3"


def test_a_mean_pooled_classifier_exports_as_dinov2_with_our_logits(tmp_path):
    """transformers' ViT classifies from [class] only: a head on the mean of the patch outputs (after the final
    LayerNorm) becomes Dinov2ForImageClassification, its [class] half zero and its LayerScales one."""
    ours = random_vit(2)
    head = {"weight": torch.randn(5, 32), "bias": torch.randn(5)}
    assert export_hf(ours, tmp_path / "hf", head, id2label={i: f"c{i}" for i in range(5)}, pool="mean") == "Dinov2ForImageClassification"
    theirs, complaints = load_quietly(transformers.AutoModelForImageClassification.from_pretrained, tmp_path / "hf")
    assert complaints == [] and type(theirs).__name__ == "Dinov2ForImageClassification"
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        encoded = ours(normalize(images))
        expected = encoded[:, 1:].mean(dim=1) @ head["weight"].T + head["bias"]
        got = theirs.eval()(pixel_values=normalize(images)).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, encoded[:, 0] @ head["weight"].T + head["bias"], atol=1e-2)  # not the [class] head
    assert theirs.config.id2label[4] == "c4"


def mean_pooled_file(path):
    """A mean-pooled classifier's model.safetensors as fine-tuning writes one (its pool and class names recorded),
    every weight random."""
    from mpp.model.checkpoint import save_weights
    from mpp.model.objectives import Classification, finetuning_head

    model = Classification(random_vit(3), finetuning_head(32, 4), export_head=True, pool="mean",
                           class_names=("red", "green", "blue", "grey"))
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
        model.head.bias.normal_(0, 1.0)
    save_weights(model, path)


def test_a_mean_pooled_classifier_loaded_by_transformers_predicts_what_mpp_predict_does_on_non_square_images(tmp_path):
    """End to end: a mean-pooled classifier's file, exported by the export command, loaded by transformers' Auto
    classes and pipeline with its processor (centre crop, resize), against `mpp predict` on wide and tall PNGs."""
    import launch
    from pipelines.stages.predict import classifier, read_batches
    from pipelines.run.start import checkpoint_config

    mean_pooled_file(tmp_path / "mean.safetensors")
    assert launch.main(["export", "--ckpt", str(tmp_path / "mean.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "linear head on the mean of the patch outputs" in card and "[class] half of its weights is zero" in card

    rng = np.random.default_rng(0)
    images = []
    # Wide and tall, cropped at even and odd offsets, resized by 1.5 and 2 or not at all: sizes at which PIL's resize
    # (the processor's) and torch's uint8 kernel (mpp's) give the same pixels; at others (30 -> 16) they can differ
    # by one grey level, which moves a logit by about 1e-3 (test_user_folder compares probabilities there).
    for i, (w, h) in enumerate([(40, 24), (24, 36), (16, 41), (41, 16), (64, 32)]):
        images.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images[-1])
    assert launch.main(["predict", "--ckpt", str(tmp_path / "mean.safetensors"), *map(str, images), "--top-k", "4",
                        "--out", str(tmp_path / "ours.json")]) == 0
    predicted = {r["image"]: r["top"] for r in json.loads((tmp_path / "ours.json").read_text())["predictions"]}

    cfg = checkpoint_config(str(tmp_path / "mean.safetensors"), None, [])  # the config `mpp predict` runs with
    _, pixels = next(read_batches(images, 16, len(images), {}))  # as `mpp predict` prepares them
    with torch.no_grad():
        expected = classifier(cfg, str(tmp_path / "mean.safetensors")).logits(pixels)
        loaded = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "hf").eval()
        processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
        prepared = processor([Image.open(path) for path in images], return_tensors="pt")["pixel_values"]
        assert torch.allclose(prepared, normalize(pixels), atol=1e-6)
        got = loaded(pixel_values=prepared).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    classify = transformers.pipeline("image-classification", model=str(tmp_path / "hf"), device="cpu")
    for path in images:
        theirs = classify(Image.open(path), top_k=4)
        assert [p["label"] for p in theirs] == [t["class"] for t in predicted[str(path)]], path
        assert [p["score"] for p in theirs] == pytest.approx([t["probability"] for t in predicted[str(path)]], abs=1e-5), path


def test_a_dinov2_export_reads_back_as_the_mean_pooled_classifier_and_public_dinov2_is_refused(tmp_path, capsys):
    import launch
    from safetensors.torch import load_file, save_file

    mean_pooled_file(tmp_path / "mean.safetensors")
    assert launch.main(["export", "--ckpt", str(tmp_path / "mean.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 0
    image = tmp_path / "wide.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(image)
    capsys.readouterr()
    said = []
    for ckpt in (tmp_path / "mean.safetensors", tmp_path / "hf"):
        assert launch.main(["predict", "--ckpt", str(ckpt), str(image), "--top-k", "4"]) == 0
        said.append(capsys.readouterr().out)
    assert said[0] == said[1] and "grey" in said[0]  # the same classes, names and probabilities as printed

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["dinov2.encoder.layer.0.layer_scale1.lambda1"] = torch.full((32,), 0.5)  # as DINOv2's own weights
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    assert launch.main(["predict", "--ckpt", str(tmp_path / "hf"), str(image)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a DINOv2 classifier with LayerScale (not one), which this project's ViT" in err and "\n" not in err


def test_export_without_transformers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` does when it is not installed
    with pytest.raises(ExportError, match=r"pip install 'mpp\[hf\]'"):
        export_hf(random_vit(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_stage_writes_a_fine_tuned_run_as_a_classifier(tmp_path, make_shards, capsys):
    from safetensors.torch import load_file

    import launch
    from mpp.model.checkpoint import load_backbone
    from mpp.config import load_config
    from pipelines.stages import finetune
    from conftest import TINY, reset_accelerator

    make_shards([30, 30], size=32)
    names = ["disc", "square", "triangle", "ring", "h-stripes", "v-stripes", "checkers", "cross", "blob", "star"]
    (tmp_path / "shards" / "summary.json").write_text(json.dumps({"samples": 60, "classes": 10, "labels": True, "class_names": names}))
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, "model.num_classes=10", "train.steps=3",
                             "train.warmup_steps=1", "train.batch_size=8", "train.checkpoint_every=3", "finetune.eval_every=3"])
    try:
        finetune.run(cfg, ckpt=None)
    finally:
        reset_accelerator()
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "ViTForImageClassification" in capsys.readouterr().out
    theirs, complaints = load_quietly(transformers.ViTForImageClassification.from_pretrained, tmp_path / "hf")
    assert complaints == [] and theirs.config.id2label == dict(enumerate(names))
    assert theirs.config.label2id == {name: i for i, name in enumerate(names)}
    classify = transformers.pipeline("image-classification", model=str(tmp_path / "hf"), device="cpu")
    predictions = classify(Image.new("RGB", (16, 16), (200, 30, 30)), top_k=3)
    assert len(predictions) == 3 and {p["label"] for p in predictions} <= set(names)  # real names, not LABEL_3

    card = (tmp_path / "hf" / "README.md").read_text()
    for fact in ("fine-tuned as a classifier", f"`{tmp_path / 'shards'}` (60 images, 10 classes)", "**Steps**: 3 of 3",
                 "16 x 16 px; **patch size** 4", "[class] token", "**Final metrics**: eval/top1 ", "eval/top5 ",
                 "pipeline('image-classification'"):
        assert fact in card, fact
    theirs.eval()
    ours = load_backbone(tmp_path / "run", cfg.model).eval()
    head = load_file(tmp_path / "run" / "model.safetensors")
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        expected = ours(normalize(images))[:, 0] @ head["head.weight"].T + head["head.bias"]
        got = theirs(pixel_values=normalize(images)).logits
    assert torch.allclose(got, expected, atol=1e-5)

    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "tflite", str(tmp_path / "x")]) == 2
    assert "unknown export format 'tflite'" in capsys.readouterr().err


def test_pretrained_backbone_export_has_a_model_card_and_loads_silently(tmp_path, make_shards, monkeypatch):
    import launch
    from mpp.config import load_config
    from pipelines.stages import pretrain
    from conftest import TINY, reset_accelerator

    make_shards([40], size=32)
    monkeypatch.setattr(sys, "argv", ["launch.py", "pretrain", "train.steps=2"])  # the command the card records
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                             "train.steps=2", "train.warmup_steps=1", "train.batch_size=8"])
    try:
        pretrain.run(cfg)
    finally:
        reset_accelerator()
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    _, complaints = load_quietly(transformers.ViTModel.from_pretrained, tmp_path / "hf")
    assert complaints == []
    card = (tmp_path / "hf" / "README.md").read_text()
    for fact in ("masked patch prediction", "64 wide, 2 blocks, 2 heads, patch 4, 16 px",
                 "**Steps**: 2 of 2", "**Final metrics**: train/pretext_loss ", "train/color_acc ", "train/color_acc_prior ",
                 "**Produced by**: `python launch.py pretrain train.steps=2`", "randomly initialised 2-class head"):
        assert fact in card, fact


def test_class_names_from_idx_files_and_from_class_names_reach_the_export(tmp_path, capsys):
    import gzip
    import struct

    import launch
    from mpp.config import load_config
    from pipelines.stages import finetune
    from conftest import TINY, reset_accelerator

    def write_idx(path, array):
        path.parent.mkdir(parents=True, exist_ok=True)
        header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        path.write_bytes(gzip.compress(header + array.tobytes()))

    rng = np.random.default_rng(0)
    for folder in ("fashion-mnist", "idx"):  # Fashion-MNIST's folder; files of a dataset mpp does not know
        write_idx(tmp_path / folder / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (30, 16, 16), dtype=np.uint8))
        write_idx(tmp_path / folder / "train-labels-idx1-ubyte.gz", np.arange(30, dtype=np.uint8) % 10)
    (tmp_path / "names.txt").write_text("".join(f"kind {i}\n" for i in range(10)))
    for folder, out, more in [("fashion-mnist", "fashion", []), ("idx", "named", ["--class-names", f"@{tmp_path / 'names.txt'}"]),
                              ("idx", "plain", [])]:
        assert launch.main(["prepare", str(tmp_path / folder / "train-images-idx3-ubyte.gz"), "--out", str(tmp_path / out),
                            "--classes", "0,2,4", *more]) == 0
    # Fine-tuned on shards that name no classes, so its weights record none and the shards named at export name them.
    cfg = load_config(None, [f"data.shards={tmp_path / 'plain'}", f"data.val_shards={tmp_path / 'plain'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=2", "train.warmup_steps=1",
                             "train.batch_size=4", "finetune.eval_every=2"])
    try:
        finetune.run(cfg, ckpt=None)
    finally:
        reset_accelerator()

    def exported_labels(shards):
        out = tmp_path / "hf" / shards
        assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(out), f"data.shards={tmp_path / shards}"]) == 0
        assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode  # not 0600 beside 0644
        return json.loads((out / "config.json").read_text())["id2label"]

    assert exported_labels("fashion") == {"0": "T-shirt/top", "1": "Pullover", "2": "Coat"}  # relabelled by --classes
    assert exported_labels("named") == {"0": "kind 0", "1": "kind 2", "2": "kind 4"}
    with pytest.warns(UserWarning) as warned:
        assert exported_labels("plain") == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    assert [str(w.message) for w in warned] == [
        f"the training shards ({tmp_path / 'plain'}) name no classes (no class_names in a summary.json beside them), so "
        f"the classifier's labels were exported as LABEL_0 to LABEL_2; prepare the shards with --class-names, or set "
        f"data.shards to shards whose summary.json names them"]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("image_size"), r"config.json lacks image_size, which a ViT's config.json gives"),
    (lambda c: c.update(image_size=[32, 64]), r"config.json gives image_size \[32, 64\], not square"),
    (lambda c: c.update(image_size=[32, 32]), None),  # (height, width) of a square: read
    (lambda c: c.update(num_attention_heads=3), r"config.json gives num_attention_heads 3, which does not divide hidden_size 64"),
    (lambda c: c.update(patch_size=4), r"config.json gives patch_size 4 but the weights beside it hold 8"),
    (lambda c: c.update(num_hidden_layers=5), r"config.json gives num_hidden_layers 5 but the weights beside it hold 2"),
    (lambda c: c.update(num_channels=1), r"config.json gives num_channels 1 but the weights beside it hold 3"),
    (lambda c: c.update(image_size=64), r"config.json gives image_size 64 \(64 positions of patch 8\) but the weights beside it hold 16 positions"),
    (lambda c: c.update(hidden_size="64"), r'config.json gives hidden_size as "64", not a positive whole number'),
    (lambda c: c.update(model_type="clip"), r"config.json describes no Hugging Face ViT \(model_type 'clip'"),
    ("truncated", r"config.json is not valid JSON"),
])
def test_a_hugging_face_config_that_does_not_describe_its_weights_is_named_with_what_is_wrong(tmp_path, edit, message):
    """Every such problem read `no ViT config.json lies beside it`, with the file there (round 4, rows 84-88), or
    went on to advise a model.* setting the user never made (num_attention_heads 3, patch_size 4)."""
    from mpp.model.checkpoint import read_weights
    from mpp.errors import UserError

    export_hf(VisionTransformer(32, 8, 64, 2, 2), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    if edit == "truncated":
        path.write_text(path.read_text()[:40])
    else:
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    if message is None:
        assert read_weights(tmp_path / "hf").about["image_size"] == 32
        return
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}"):
        try:
            read_weights(tmp_path / "hf")
        except UserError as err:
            assert re.search(message, str(err)), str(err)
            raise
