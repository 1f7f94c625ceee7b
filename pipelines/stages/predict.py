"""Prediction stage: a fine-tuned classifier's top-k classes for image files and folders (`mpp predict --ckpt RUN
IMAGE_OR_FOLDER...`), with the preprocessing of evaluation, in batches, on the GPU when there is one."""

from __future__ import annotations

import csv
import errno
import json
import os
import random
import stat
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
from ..run.run_policy import check_writable
from .export import classifier_names

FORMATS = (".csv", ".json")


class PredictError(UserError):
    """Prediction cannot run as asked; the message names the cause and the fix."""


@dataclass
class Prediction:
    image: str
    top: list[tuple[int, str, float]]  # (class id, class name, probability), most probable first


def image_files(inputs: list[str]) -> tuple[list[Path], dict[str, str]]:
    """The files named, and the image files under the folders named (by extension, hidden ones left out), in order;
    and what in those folders was passed over, each with what it is: an entry with an image's extension that is no
    file (a FIFO, a link loop, a link to nothing), a sub-folder that cannot be listed."""
    suffixes = set(Image.registered_extensions())
    files, passed_over = [], {}
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found, skipped = folder_images(path, suffixes)
            if not found and not skipped:
                raise PredictError(f"folder {path} holds no image files; point predict at images or folders of them")
            files += found
            passed_over.update(skipped)
        elif path.is_file():
            files.append(path)
        else:
            raise PredictError(f"{path} {not_a_file(path)}; pass image files or folders holding them")
    return files, passed_over


def folder_images(folder: Path, suffixes: set[str]) -> tuple[list[Path], dict[str, str]]:
    """The image files under `folder`, sorted, not following links to folders; and what was passed over (image_files)."""
    found, skipped = [], {}

    def unlisted(error: OSError) -> None:
        skipped[error.filename] = f"a folder that cannot be listed: {error.strerror}"

    for root, folders, names in os.walk(folder, onerror=unlisted):
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in names:
            path = Path(root, name)
            if name.startswith(".") or path.suffix.lower() not in suffixes:
                continue
            if path.is_file():
                found.append(path)
            else:
                skipped[str(path)] = not_a_file(path).removeprefix("is ")
    return sorted(found), dict(sorted(skipped.items()))


def not_a_file(path: Path) -> str:
    """What `path`, which is neither a file nor a folder, is, as 'is ...' or 'does not exist'."""
    try:
        kind = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if path.is_symlink():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "does not exist" if exc.errno == errno.ENOENT else f"cannot be read ({exc.strerror})"
    if stat.S_ISFIFO(kind):
        return "is a FIFO (named pipe), not an image file"
    if stat.S_ISSOCK(kind):
        return "is a socket, not an image file"
    return "is a device, not an image file"


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


def check_out(out: Path) -> None:
    """Refuse, before any prediction is computed, an --out that is not a .csv or .json file that can be written."""
    if out.suffix.lower() not in FORMATS:
        raise PredictError(f"--out {out} must end in .csv or .json")
    if out.is_dir():
        raise PredictError(f"--out {out} is a folder; name a .csv or .json file to write")
    check_writable(out.parent, "the folder of --out", "write --out into")
    if out.exists():
        try:
            out.open("r+b").close()  # opened for writing, not truncated
        except OSError as exc:
            raise PredictError(f"--out {out} cannot be written ({exc.strerror}); choose a file that can be") from None


def run(cfg: Config, *, ckpt: str, inputs: list[str], top_k: int = 5, out: str | None = None, batch_size: int = 64) -> list[Prediction]:
    """Classify the images in `inputs` with the classifier in `ckpt`; print the top-`top_k` classes of each, or
    write them to `out` (.csv or .json). Unreadable files are named and counted, not fatal."""
    if out is not None:
        check_out(Path(out))
    if top_k < 1:
        raise PredictError(f"--top-k must be at least 1, got {top_k}")
    if batch_size < 1:
        raise PredictError(f"--batch-size must be at least 1, got {batch_size}")
    files, unreadable = image_files(inputs)
    if not files:
        path, reason = next(iter(unreadable.items()))
        raise PredictError(f"none of the inputs given holds an image file that can be read ({path}: {reason})")
    device = torch.device("cuda" if cuda_in_use() else "cpu")  # `accelerate launch --cpu` keeps it on the CPU
    model = classifier(cfg, ckpt).to(device)
    classes = model.head.out_features
    names, unnamed, naming = classifier_names(cfg, read_weights(ckpt), classes)
    if names is None:
        print(f"{unnamed}, so classes are shown by id; {naming}", file=sys.stderr)
    k = min(top_k, classes)
    predictions = []
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
        try:
            write(Path(out), predictions, unreadable)
        except OSError as exc:
            raise PredictError(f"--out {out} could not be written ({exc.strerror}); the predictions were not saved: "
                               f"free some space or choose another place") from None
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
