"""Any ViT of this project as an ONNX graph (model.onnx) that onnxruntime, or any ONNX runtime, runs without mpp.

The graph is traced by torch.onnx's exporter (torch.export, then onnxscript's translation) from mpp's own forward, so it
computes what mpp computes whatever the stem (a linear patch embedding, or a ResNet of any stem_layers and padding),
the position embeddings or the pooling: no other library's architecture has to match ours. Its input is the images as
mpp's evaluation prepares them (PREPROCESSING), with a dynamic batch axis at the trained resolution; its outputs are a
classifier's logits, or a backbone's token outputs and [class] token as transformers' ViTModel names them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import torch
from torch import nn

from mpp.model.hf import ExportError
from mpp.model.vit import PIXEL_MEAN, PIXEL_STD, VisionTransformer, pool

ONNX_FILE = "model.onnx"
ONNX_CONFIG = "config.json"  # beside it: inputs, outputs, class names and preprocessing
PIXELS = "pixel_values"  # the graph's input, named as transformers names a ViT's
LOGITS, TOKENS, CLASS_TOKEN = "logits", "last_hidden_state", "pooler_output"


class ExportedForward(nn.Module):
    """What the graph computes: the classifier's logits on the pooled encoder output, or, without a head, the
    encoder outputs and the [class] token among them (the paper's representation)."""

    def __init__(self, backbone: VisionTransformer, head: dict[str, torch.Tensor] | None, pooling: str):
        super().__init__()
        self.backbone, self.pooling = backbone, pooling
        self.head = None
        if head is not None:
            self.head = nn.Linear(backbone.width, head["weight"].shape[0])
            self.head.load_state_dict({k: v.detach().float() for k, v in head.items()})

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        encoded = self.backbone(pixel_values)
        if self.head is None:
            return encoded, encoded[:, 0]
        return self.head(pool(encoded, self.pooling))


def preprocessing(image_size: int, background: tuple[int, int, int]) -> dict:
    """How an image becomes the graph's input, as mpp predict prepares it (mpp.data.images, mpp.data.EvalTransform):
    `background` is the RGB colour that reading an image composites transparent pixels over."""
    return {
        "background": list(background),
        "crop": "the centre square of the short side",
        "size": [image_size, image_size],  # height, width
        "resample": "bilinear, antialiased",
        "rescale_factor": 1 / 255,
        "mean": [PIXEL_MEAN] * 3,
        "std": [PIXEL_STD] * 3,
        "layout": "float32 (batch, 3, height, width), RGB",
    }


def onnx_config(backbone: VisionTransformer, head: dict[str, torch.Tensor] | None, id2label: dict[int, str] | None,
                pooling: str, background: tuple[int, int, int]) -> dict:
    """config.json beside model.onnx: the input and outputs with their shapes, what a classifier pools and its class
    names (LABEL_i where none are known, as transformers numbers them), and the preprocessing."""
    size, tokens = backbone.image_size, backbone.num_patches + 1
    config: dict = {"input": {PIXELS: ["batch", 3, size, size]}}
    if head is None:
        config["outputs"] = {TOKENS: ["batch", tokens, backbone.width], CLASS_TOKEN: ["batch", backbone.width]}
    else:
        classes = head["weight"].shape[0]
        names = id2label or {i: f"LABEL_{i}" for i in range(classes)}
        config["outputs"] = {LOGITS: ["batch", classes]}
        config["pool"] = pooling
        config["id2label"] = {str(i): name for i, name in names.items()}
        config["label2id"] = {name: i for i, name in names.items()}
    config["preprocessing"] = preprocessing(size, background)
    return config


@contextlib.contextmanager
def exporter_quiet() -> Iterator[None]:
    """The exporter's own notices held back while it runs: that torchvision, whose operators a ViT never uses, is not
    installed (logged), and torch's deprecations of its own internals (FutureWarning), which the user cannot act on."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def export_onnx(backbone: VisionTransformer, out_dir: str | Path, background: tuple[int, int, int],
                head: dict[str, torch.Tensor] | None = None, id2label: dict[int, str] | None = None,
                pool: str = "cls") -> str:
    """Write model.onnx (float32, a dynamic batch axis) and config.json (its preprocessing with reading's `background`)
    to out_dir; returns what the graph is: "classifier" (with `head` on `pool`) or "backbone"."""
    if find_spec("onnx") is None or find_spec("onnxscript") is None:  # what torch.onnx writes and translates with
        raise ExportError("exporting to ONNX needs the onnx and onnxscript packages: pip install 'mpp[onnx]' "
                          "(in a checkout: pip install -e '.[onnx]')")
    model = ExportedForward(backbone, head, pool).float().cpu().eval()
    size = backbone.image_size
    example = torch.zeros(2, 3, size, size)  # a batch of 2: torch.export takes a batch of 1 for a fixed size
    outputs = [LOGITS] if head is not None else [TOKENS, CLASS_TOKEN]
    with exporter_quiet(), torch.no_grad():
        program = torch.onnx.export(model, (example,), input_names=[PIXELS], output_names=outputs,
                                    dynamic_shapes={PIXELS: {0: torch.export.Dim("batch")}}, dynamo=True,
                                    verbose=False)  # without its progress lines
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    program.save(out / ONNX_FILE)  # the weights in the file, or beside it in model.onnx.data past ONNX's 2 GB
    (out / ONNX_CONFIG).write_text(json.dumps(onnx_config(backbone, head, id2label, pool, background), indent=2) + "\n")
    return "backbone" if head is None else "classifier"
