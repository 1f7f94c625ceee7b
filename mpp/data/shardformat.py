"""The shard format: what a shard of this project holds and what stands beside it.

A shard is a tar file (gzipped or not) of samples, each a run of adjacent members sharing a key (WebDataset's
convention): an image under one of IMAGE_KEYS and optionally a label under one of LABEL_KEYS. A summary.json beside
the shards, written last by `prepare`, says what the set holds: its samples, shard files and classes, and the class
names a named label maps through. Every module that reads or writes these names takes them from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpp.errors import DataError, command

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # the members a sample's image is read from, in this order
IMAGE_EXTS = ("jpg", "png", "webp")  # what `prepare` writes; the reader converts every image to RGB
LABEL_KEYS = ("cls", "json", "txt")  # where a sample's label is read from, in this order
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
SUMMARY = "summary.json"


def is_remote(url: str) -> bool:
    """A shard streamed from a command (`pipe:`) or a URL, rather than a local file."""
    return url.startswith("pipe:") or "://" in url


def summary_beside(url: str) -> str:
    """The path of the summary.json that belongs with the shard at `url` (in its directory)."""
    return os.path.join(os.path.dirname(url), SUMMARY)


class ShardSummary(BaseModel):
    """What reading shards takes from the summary.json that `mpp prepare` writes beside them (other fields are
    left alone); strict, so that `"class_names": "abc"` is refused rather than read as three names."""

    model_config = ConfigDict(strict=True, extra="allow")

    samples: int | None = Field(None, ge=0, description="Samples in the shard set.")
    shards: int | None = Field(None, ge=0, description="Shard files in the set.")
    labels: bool = Field(False, description="Whether the samples carry labels.")
    classes: int = Field(0, ge=0, description="Distinct labels.")
    class_names: list[str] | None = Field(None, description="Class names; a named label's id is its position.")
    image_short_side: dict[str, int] | None = Field(None, description="The images' short sides in pixels: min, median, max.")
    class_counts: list[int] | None = Field(None, description="Images per class id.")


def shard_summary(urls: Sequence[str]) -> ShardSummary | None:
    """The summary.json beside the first shard, checked; None where there is none."""
    path = summary_beside(urls[0])
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as file:
            return ShardSummary.model_validate_json(file.read())
    except ValidationError as exc:
        error = exc.errors()[0]
        what = (f"it is not JSON ({error['msg']})" if error["type"] == "json_invalid"
                else f"{'.'.join(map(str, error['loc'])) or 'the whole file'}: {error['msg'].lower()}")
        raise DataError(f"{path} cannot be read: {what}; correct it, or delete it to have the shards' labels scanned "
                        f"instead (`{command('prepare')}` writes it)") from None
