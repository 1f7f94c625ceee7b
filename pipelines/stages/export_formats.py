"""The formats `mpp export --to FORMAT DIR` writes: one class each (what writes its files, what it refuses, and what its
closing line and model card say of it) and one line in FORMATS."""

from __future__ import annotations

from pathlib import Path

import torch

from mpp.data.images import BACKGROUND
from mpp.model.hf import export_hf
from mpp.model.onnx_export import ONNX_CONFIG, ONNX_FILE, export_onnx
from mpp.model.timm_layout import export_timm, timm_refusal
from mpp.model.vit import VisionTransformer
from mpp.rundir import WEIGHTS


class ExportFormat:
    """One --to format. `library`: the model card's library_name; `into_run`: what the export would do to a run's
    directory, said where one is refused."""

    library = ""
    into_run = ""

    def refusal(self, backbone: VisionTransformer) -> str | None:
        """Why `backbone` cannot be written in this format (one line's reason), or None."""
        return None

    def write(self, backbone: VisionTransformer, out: Path, head: dict[str, torch.Tensor] | None,
              names: dict[int, str] | None, pool: str) -> str:
        """Write the export's files (the model card aside) to `out`; returns what was written, as the card names it."""
        raise NotImplementedError

    def unnamed(self, classes: int) -> str:
        """How a classifier's labels are written where no class names are known."""
        return f"as LABEL_0 to LABEL_{classes - 1}"

    def written(self, kind: str, backbone: VisionTransformer, out_dir: str) -> str:
        """The line printed once the export is written: what, and how to load it."""
        raise NotImplementedError

    def position_line(self, backbone: VisionTransformer, kind: str) -> str | None:
        """The card's line on 2-D or absent position embeddings; None for learned ones, or where the export computes
        them as trained."""
        if backbone.pos_embed_kind == "learned":
            return None
        return (f"- **Position embeddings**: trained as {backbone.pos_embed_kind}, written as the one table they add at "
                f"{backbone.image_size} px ({kind} has a learned table only); at another resolution {self.library} "
                f"interpolates that table.")

    def stem_line(self, backbone: VisionTransformer, kind: str) -> str:
        """The card's line on a hybrid's ResNet stem."""
        return (f"- **Stem**: a ResNet (stem_layers {list(backbone.stem_layers)}, {backbone.stem_width} root channels) "
                f"whose feature-map cells are the tokens, padded 'SAME' with GroupNorm epsilon 1e-5 as timm's {kind}.")

    def pooling_line(self, fine_tuned: bool, mean_pooled: bool) -> str:
        """The card's line on what the representation (and the classifier) reads."""
        raise NotImplementedError

    def usage(self, fine_tuned: bool, out_dir: str) -> list[str]:
        """The card's "Use" section: loading the export with its library, and how inputs are prepared."""
        raise NotImplementedError


class HuggingFace(ExportFormat):
    """transformers' ViTModel, ViTForImageClassification or (mean-pooled) Dinov2ForImageClassification: mpp.model.hf."""

    library = "transformers"
    into_run = f"replace its {WEIGHTS} with the transformers layout, which finetune, fewshot and knn cannot read"

    def write(self, backbone, out, head, names, pool):
        return export_hf(backbone, out, head, id2label=names, pool=pool)

    def written(self, kind, backbone, out_dir):
        return (f"wrote a transformers {kind} ({backbone.width} wide, {backbone.depth} blocks, patch {backbone.patch_size}, "
                f"{backbone.image_size} px) and its model card to {out_dir}; load it with {kind}.from_pretrained('{out_dir}')")

    def pooling_line(self, fine_tuned, mean_pooled):
        if mean_pooled:
            return ("- **Pooling**: the mean of the patch outputs after the final LayerNorm (finetune.pool=mean). "
                    "Dinov2ForImageClassification's classifier reads [class ; mean of the patch outputs]; the [class] half "
                    "of its weights is zero and every LayerScale is one, so it computes the trained model's logits exactly.")
        return ("- **Pooling**: the [class] token after the final LayerNorm (`last_hidden_state[:, 0]`); the exported pooler is "
                "the identity, so `pooler_output` is that same token" + (" and the classifier reads it." if fine_tuned else "."))

    def usage(self, fine_tuned, out_dir):
        lines = ["## Use", "", "```python"]
        if fine_tuned:
            lines += ["from transformers import pipeline", "",
                      f"classify = pipeline('image-classification', model='{out_dir}')", "print(classify('image.jpg'))"]
        else:
            lines += ["from transformers import ViTModel", "",
                      f"model = ViTModel.from_pretrained('{out_dir}')",
                      "features = model(pixel_values=pixels).pooler_output  # (B, D): the [class] token"]
        lines += ["```", ""]
        if not fine_tuned:
            lines += ["**This is a backbone without a classifier.** `pipeline('image-classification')` or "
                      "`ViTForImageClassification.from_pretrained` on it adds a randomly initialised 2-class head and prints "
                      "meaningless labels: fine-tune it first (`mpp finetune --ckpt RUN`, then export that run).", ""]
        lines += ["Inputs are prepared as mpp evaluates: the centre square of the short side, resized (bilinear) to the "
                  "model's size and scaled to (x / 255 - 0.5) / 0.5 per channel (preprocessor_config.json).", ""]
        return lines


class Timm(ExportFormat):
    """A hybrid as timm's vit_*_r*_s* (mpp.model.timm_layout), written by layout: timm cannot run here."""

    library = "timm"
    into_run = f"replace its {WEIGHTS} with timm layout, which finetune, fewshot and knn cannot read"

    def refusal(self, backbone):
        return timm_refusal(backbone)

    def write(self, backbone, out, head, names, pool):
        return export_timm(backbone, out, head, list(names.values()) if names else None, pool)

    def unnamed(self, classes):
        return "without names"

    def written(self, kind, backbone, out_dir):
        return (f"wrote timm's {kind} ({backbone.width} wide, {backbone.depth} blocks, {backbone.image_size} px; "
                f"config.json's model_args size it) and its model card to {out_dir}; load it with "
                f"timm.create_model('local-dir:{out_dir}', pretrained=True)")

    def pooling_line(self, fine_tuned, mean_pooled):
        if mean_pooled:
            return ("- **Pooling**: the mean of the patch outputs after the final LayerNorm (finetune.pool=mean): "
                    "global_pool='avg' with fc_norm=False, which keeps that LayerNorm on every token before the mean.")
        return "- **Pooling**: the [class] token after the final LayerNorm (global_pool='token')."

    def usage(self, fine_tuned, out_dir):
        return ["## Use", "", "```python", "import timm", "",
                f"model = timm.create_model('local-dir:{out_dir}', pretrained=True).eval()",
                "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))",
                "outputs = model(transform(image)[None])  # " + ("(1, classes) logits" if fine_tuned else
                                                                "(1, D): the [class] token (num_classes 0)"),
                "```", "",
                "Written to timm 1.0.31's layout (tensor names and shapes as its source builds this architecture) "
                "and not loaded by timm, which could not run where it was written. timm's evaluation transform "
                "resizes the short side, then crops the centre square; mpp crops the centre square, then resizes "
                "(bilinear, antialiased) to the model's size and scales to (x / 255 - 0.5) / 0.5 per channel: on "
                "non-square images the two can sample slightly different pixels.", ""]


class Onnx(ExportFormat):
    """Any ViT (plain or hybrid, either pooling) as an ONNX graph traced from mpp's forward: mpp.model.onnx_export."""

    library = "onnx"
    into_run = f"write its {ONNX_FILE}, {ONNX_CONFIG} and README.md among the run's files"

    def write(self, backbone, out, head, names, pool):
        return export_onnx(backbone, out, BACKGROUND, head, id2label=names, pool=pool)

    def written(self, kind, backbone, out_dir):
        return (f"wrote an ONNX {kind} ({backbone.width} wide, {backbone.depth} blocks, patch {backbone.patch_size}, "
                f"{backbone.image_size} px, any batch size) and its model card to {out_dir}; run it with "
                f"onnxruntime.InferenceSession('{Path(out_dir) / ONNX_FILE}')")

    def position_line(self, backbone, kind):
        return None  # the graph adds them as mpp does, at the one resolution it takes

    def stem_line(self, backbone, kind):
        return (f"- **Stem**: a ResNet (stem_layers {list(backbone.stem_layers)}, {backbone.stem_width} root channels, "
                f"padding {backbone.stem_padding}) whose feature-map cells are the tokens, in the graph as mpp computes it.")

    def pooling_line(self, fine_tuned, mean_pooled):
        if mean_pooled:
            return "- **Pooling**: the mean of the patch outputs after the final LayerNorm (finetune.pool=mean)."
        if fine_tuned:
            return "- **Pooling**: the [class] token after the final LayerNorm."
        return ("- **Outputs**: `last_hidden_state` (every token after the final LayerNorm, [class] first) and "
                "`pooler_output`, the [class] token among them (the paper's representation).")

    def usage(self, fine_tuned, out_dir):
        output = ("logits = session.run(['logits'], {'pixel_values': batch})[0]  # (B, classes)\n"
                  "print([config['id2label'][str(i)] for i in logits.argmax(axis=1)])" if fine_tuned else
                  "features = session.run(['pooler_output'], {'pixel_values': batch})[0]  # (B, D): the [class] token")
        return ["## Use", "", "```python", "import json", "", "import numpy as np", "import onnxruntime",
                "from PIL import Image, ImageOps", "",
                f"config = json.load(open('{Path(out_dir) / ONNX_CONFIG}'))",
                "prep = config['preprocessing']",
                f"session = onnxruntime.InferenceSession('{Path(out_dir) / ONNX_FILE}')", "", "",
                "def pixels(path):  # as mpp predict prepares an image",
                "    image = ImageOps.exif_transpose(Image.open(path)).convert('RGBA')",
                "    background = Image.new('RGBA', image.size, (*prep['background'], 255))",
                "    image = Image.alpha_composite(background, image).convert('RGB')  # transparency over mid grey",
                "    side = min(image.size)",
                "    left, top = (image.width - side) // 2, (image.height - side) // 2",
                "    image = image.crop((left, top, left + side, top + side)).resize(prep['size'][::-1], Image.BILINEAR)",
                "    x = np.asarray(image, dtype=np.float32) * prep['rescale_factor']",
                "    return ((x - prep['mean']) / prep['std']).astype(np.float32).transpose(2, 0, 1)", "", "",
                "batch = np.stack([pixels('image.jpg')])",
                *output.splitlines(), "```", "",
                "model.onnx takes float32 images of the trained size, any number at a time; config.json names its input "
                "and outputs, " + ("the classes (id2label) " if fine_tuned else "") + "and the preprocessing. mpp resizes "
                "with torch's antialiased bilinear kernel, which follows PIL's to within a grey level.", ""]


FORMATS: dict[str, ExportFormat] = {"hf": HuggingFace(), "timm": Timm(), "onnx": Onnx()}  # --to's names
