"""A data set as a run sees it (`data.shards` and its kin): the reader of its format, the units that ranks and data
workers split, and, where they can be known before streaming, its number of images and its class names.

One `DataSource` per spec, made by `open_source`; the format itself is the reader's (mpp.data.readers), the stream
(mpp.data.stream) reads the units.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mpp.data.readers import Reader, reader_for
from mpp.data.stream import label_names


@dataclass(frozen=True)
class DataSource:
    spec: str  # as data.shards (or data.val_shards, an evaluator's shards) gave it
    reader: Reader
    units: tuple[str, ...]  # what ranks and workers split, in the order a checkpoint's stream positions assume

    @functools.cached_property
    def images(self) -> int:
        """The images the units hold, counted without decoding them; raises readers.Uncounted where the reader
        cannot tell (tars without a summary.json, URLs, `pipe:` commands)."""
        return self.reader.images(list(self.units))

    @functools.cached_property
    def class_names(self) -> tuple[str, ...]:
        """The class names that labels map through (id = position): summary.json's, the class folders', the
        sorted names that labels give; () where labels are ids or absent."""
        return label_names(self.units)


def open_source(spec: str) -> DataSource:
    """The data set `spec` names: a directory of tars, Parquet files or images, a brace pattern, URLs or `pipe:`
    commands (several joined by '::'), or whatever a reader added to READERS claims."""
    reader = reader_for(spec)
    return DataSource(spec, reader, tuple(reader.expand(spec)))
