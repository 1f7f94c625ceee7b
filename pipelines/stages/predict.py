"""Prediction stage: a fine-tuned classifier's top-k classes for image files and folders (`mpp predict --ckpt RUN
IMAGE_OR_FOLDER...`), with the preprocessing of evaluation, in batches, on the GPU when there is one."""

from __future__ import annotations

import csv
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from mpp.model.checkpoint import classifier_head, classifier_pool, load_backbone, read_weights
from mpp.config import Config
from mpp.data.stream import EvalTransform, upright
from mpp.errors import UserError
from mpp.model.objectives import Classification, finetuning_head
from mpp.training.runtime import cuda_in_use
from .export import classifier_names

FORMATS = (".csv", ".json")


class PredictError(UserError):
    """Prediction cannot run as asked; the message names the cause and the fix."""


@dataclass
class Prediction:
    image: str
    top: list[tuple[int, str, float]]  # (class id, class name, probability), most probable first


def image_files(inputs: list[str]) -> list[Path]:
    """The files named, and the image files under the folders named (by extension, hidden ones left out), in order."""
    suffixes = set(Image.registered_extensions())
    files = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise PredictError(f"folder {path} holds no image files; point predict at images or folders of them")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise PredictError(f"{path} does not exist; pass image files or folders holding them")
    return files


def read_batches(files: list[Path], size: int, batch_size: int, unreadable: dict[str, str]) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, (B, 3, size, size) uint8) batches of the files that read as images, prepared as evaluation prepares
    them (mpp.data.EvalTransform); each file that does not is recorded in `unreadable` with the reason."""
    transform, names, images = EvalTransform(size), [], []
    for path in files:
        try:
            with Image.open(path) as img:
                images.append(transform(upright(img), random.Random(0)))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            unreadable[str(path)] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        names.append(str(path))
        if len(names) == batch_size:
            yield names, torch.stack(images)
            names, images = [], []
    if names:
        yield names, torch.stack(images)


def classifier(cfg: Config, ckpt: str) -> Classification:
    head = classifier_head(ckpt)
    if head is None:
        raise PredictError(f"{ckpt} holds a backbone without a classifier; fine-tune it first (`mpp finetune --ckpt "
                           f"{ckpt}`) and predict with that run")
    backbone = load_backbone(ckpt, cfg.model)
    pool = classifier_pool(read_weights(ckpt), cfg.finetune)
    model = Classification(backbone, finetuning_head(backbone.width, head["weight"].shape[0]), export_head=True, pool=pool)
    model.head.load_state_dict(head)
    return model.eval()


def run(cfg: Config, *, ckpt: str, inputs: list[str], top_k: int = 5, out: str | None = None, batch_size: int = 64) -> list[Prediction]:
    """Classify the images in `inputs` with the classifier in `ckpt`; print the top-`top_k` classes of each, or
    write them to `out` (.csv or .json). Unreadable files are named and counted, not fatal."""
    if out is not None and Path(out).suffix.lower() not in FORMATS:
        raise PredictError(f"--out {out} must end in .csv or .json")
    if top_k < 1:
        raise PredictError(f"--top-k must be at least 1, got {top_k}")
    files = image_files(inputs)
    device = torch.device("cuda" if cuda_in_use() else "cpu")  # `accelerate launch --cpu` keeps it on the CPU
    model = classifier(cfg, ckpt).to(device)
    classes = model.head.out_features
    names, unnamed, naming = classifier_names(cfg, read_weights(ckpt), classes)
    if names is None:
        print(f"{unnamed}, so classes are shown by id; {naming}", file=sys.stderr)
    k = min(top_k, classes)
    predictions, unreadable = [], {}
    with torch.no_grad():
        for paths, images in read_batches(files, model.backbone.image_size, batch_size, unreadable):
            probabilities = model.logits(images.to(device)).float().softmax(dim=-1)
            top = probabilities.topk(k, dim=-1)
            for path, p, ids in zip(paths, top.values.tolist(), top.indices.tolist()):
                predictions.append(Prediction(path, [(i, (names or {}).get(i, str(i)), q) for i, q in zip(ids, p)]))
    if not predictions:
        raise PredictError(f"none of the {len(files)} file(s) given could be read as an image "
                           f"({next(iter(unreadable.items()))[0]}: {next(iter(unreadable.values()))})")
    if out is None:
        for prediction in predictions:
            print(f"{prediction.image}\t" + ", ".join(f"{name} {p:.1%}" for _, name, p in prediction.top))
    else:
        write(Path(out), predictions, unreadable)
    where = f"; written to {out}" if out else ""
    print(f"predicted the top {k} of {classes} classes for {len(predictions)} image(s) on {device}{where}", file=sys.stderr)
    if unreadable:
        listed = "; ".join(f"{path} ({reason})" for path, reason in list(unreadable.items())[:5])
        more = f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        print(f"{len(unreadable)} file(s) could not be read as images and were skipped: {listed}{more}", file=sys.stderr)
    return predictions


def write(out: Path, predictions: list[Prediction], unreadable: dict[str, str]) -> None:
    """.json: {"predictions": [{"image", "top": [{"class", "id", "probability"}]}], "unreadable": {path: reason}};
    .csv: one row per image and rank (image, rank, class, id, probability)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".json":
        records = [{"image": p.image, "top": [{"class": name, "id": i, "probability": q} for i, name, q in p.top]} for p in predictions]
        out.write_text(json.dumps({"predictions": records, "unreadable": unreadable}, indent=2) + "\n")
        return
    with out.open("w", newline="") as file:
        rows = csv.writer(file)
        rows.writerow(["image", "rank", "class", "id", "probability"])
        for p in predictions:
            rows.writerows([p.image, rank, name, i, f"{q:.6f}"] for rank, (i, name, q) in enumerate(p.top, start=1))
