"""The objectives and targets as the run config knows them, without loading torch.

OBJECTIVES maps the config's `objective` to its kind and TARGETS maps `mpp.target` to its target: each entry holds
what validating and describing a config needs (choices, meanings, settings sections, a target's head size) and names
its implementation as "module:name", imported when a run builds it (as Python's entry points do). So the command
line's --help, --print-config and every error about a config answer in well under a second, while the objectives
and targets themselves (mpp.model.objectives, mpp.model.targets) load torch. Registering a part is its class and
one entry here; an entry may also hold the class or builder itself (a part defined in a user's own code).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, create_model, field_validator, model_validator

from mpp.config import SECTION_SOURCES, Section, listed, one_of, section_field


def implementation(reference: str | Any) -> Any:
    """An entry's implementation: "module:name" imported now, or the object itself."""
    if not isinstance(reference, str):
        return reference
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- targets

def color_classes(bits: int) -> int:
    """Colour classes at `bits` per RGB channel (3 bits: 512, the paper's)."""
    return 1 << (3 * bits)


def cells_4x4(patch_size: int) -> int:
    """Cells of a patch downsized to 4 x 4, for a patch size that allows it (else the one-line error)."""
    if patch_size % 4:
        raise ValueError(f"mpp.target=color4x4 predicts a 4x4 downsized patch, so model.patch_size must be divisible by 4, "
                         f"got {patch_size}; pick such a patch size or mpp.target=color")
    return 16


class ColorBits(Section):
    """The settings of the colour targets, in the `mpp` section."""

    color_bits: int = Field(3, ge=1, le=8, description="Bits per RGB channel of the colour targets (3 gives 512 classes).")


@dataclass(frozen=True)
class TargetEntry:
    """One `mpp.target` choice: its implementation (a mpp.model.targets.Target subclass), what it means in the config
    reference, its own settings (a Section whose fields join `mpp`; those it names in `hparams` are HParams columns),
    and its head's outputs per patch as outputs(patch_size, the run's mpp section), raising ValueError that names the
    config keys for a patch size it cannot use."""

    implementation: str | type
    meaning: str
    outputs: Callable[[int, Any], int]
    settings: type[Section] | None = None

    def build(self, patch_size: int, settings) -> Any:
        """The target for patches of `patch_size` pixels, reading its keys of `settings` (the run's mpp section)."""
        return implementation(self.implementation).from_settings(patch_size, settings)


# mpp.target -> its entry.
TARGETS: dict[str, TargetEntry] = {
    "color": TargetEntry("mpp.model.targets:MeanColor", "its mean colour at mpp.color_bits per channel (512 classes at 3 bits, the paper)",
                         lambda patch_size, mpp: color_classes(mpp.color_bits), ColorBits),
    "color4x4": TargetEntry("mpp.model.targets:Color4x4", "the colours of its 4x4 downsizing (16 x 512)",
                            lambda patch_size, mpp: cells_4x4(patch_size) * color_classes(mpp.color_bits), ColorBits),
    "pixels": TargetEntry("mpp.model.targets:Pixels", "its pixel values (L2 loss)", lambda patch_size, mpp: 3 * patch_size ** 2),
}


# ---------------------------------------------------------------- objectives

MAX_HEAD_BYTES = 10**9  # a larger MPP head (e.g. color4x4 at 8 bits: 268M outputs) only exhausts memory


class MPPConfig(Section):
    """The `mpp` section: masked patch prediction's settings; each target's own (`TargetEntry.settings`) join it."""

    hparams = ("target", "masking", "corrupt_rate", "corrupt_in")

    target: str = Field("color", description="What a corrupted patch predicts (the targets register the choices).")
    corrupt_rate: float = Field(0.5, gt=0, lt=1, description="Fraction of patch positions corrupted per image (paper: 0.5; 0.15 also tried).")
    mask_prob: float = Field(0.8, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by the learnable [mask] embedding.")
    random_prob: float = Field(0.1, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by a random other patch's embedding (the rest keep their own).")
    masking: Literal["random", "block"] = Field("random", description="Which positions are corrupted: random, uniformly at random (the paper), or block, in rectangles of patches (BEiT's blockwise masking); the count per image is the same.")
    corrupt_in: Literal["auto", "embeddings", "pixels"] = Field("auto", description="Where a corrupted patch is replaced: embeddings, its token after the patch embedding (the paper); pixels, its pixels before the stem (a learnable mask patch, another patch's pixels, or its own), as SimMIM does for convolutional stems; auto: embeddings for model.stem=patch, pixels for model.stem=resnet. A hybrid corrupted in embeddings leaks: its convolutions show a masked patch's pixels to its neighbours' tokens (kept to measure that).")

    @field_validator("target")
    @classmethod
    def _known_target(cls, target: str) -> str:
        return one_of("mpp.target", target, TARGETS)

    @model_validator(mode="after")
    def _check(self) -> MPPConfig:
        if self.mask_prob + self.random_prob > 1:
            raise ValueError(f"mpp.mask_prob + mpp.random_prob must be at most 1, got {self.mask_prob} + {self.random_prob}")
        return self

    def check(self, cfg) -> None:
        """The target fits the model: a patch size it can use (its `outputs` raises), a head of at most 1 GB."""
        if OBJECTIVES[cfg.objective].section is not OBJECTIVES["mpp"].section:
            return
        target = TARGETS[self.target]
        outputs = target.outputs(cfg.model.patch_size, self)
        width = cfg.model.variant.width
        head_bytes = 4 * (width + 1) * outputs  # fp32 weights and biases
        if head_bytes > MAX_HEAD_BYTES:
            own = [f"mpp.{key}" for key in (target.settings.model_fields if target.settings else ())]
            values = "".join(f" with {key}={getattr(self, key.removeprefix('mpp.'))}" for key in own)
            raise ValueError(f"mpp.target={self.target}{values} needs a {outputs:,}-way prediction head of "
                             f"{head_bytes / 1e9:.1f} GB (width {width}); heads over {MAX_HEAD_BYTES / 1e9:.1f} GB are refused, "
                             f"{f'lower {listed(own)} or ' if own else ''}pick a target with fewer outputs per patch")


@functools.lru_cache(maxsize=32)
def mpp_section(targets: tuple[tuple[str, TargetEntry], ...]) -> type[MPPConfig]:
    """The `mpp` section with `targets`' own settings as fields and the choices of mpp.target described."""
    choices = [f"{name}, {target.meaning}" for name, target in targets]
    meanings = "; ".join(choices[:-1]) + f"; or {choices[-1]}" if len(choices) > 1 else choices[0]
    described = Field("color", description=f"What a corrupted patch predicts: {meanings}.")
    own = tuple(dict.fromkeys(target.settings for _, target in targets if target.settings))
    section = create_model("MPPConfig", __base__=(*own, MPPConfig), target=(str, described))  # MPPConfig's fields first
    section.hparams = (*MPPConfig.hparams, *(key for settings in own for key in settings.hparams))
    return section


@dataclass(frozen=True)
class ObjectiveKind:
    """What a stage needs to know of an objective before it exists."""

    build: str | Callable  # (fresh backbone, the run's Config, classes) -> the objective; "module:name" or the builder
    reads_labels: bool  # the stage reads the shards' labels and passes their class count to `build` (else None)
    summary: str  # a few words for tables (compare's report)
    meaning: str = ""  # what `objective=<name>` trains, for the config reference (default: the summary)
    section: Callable[[], tuple[str, type[Section]]] | None = None  # its own config section: () -> (key, Section)
    reads: tuple[str, ...] = ()  # settings of other sections that only objectives declaring them read (HParams)

    def settings(self) -> tuple[str, ...]:
        """The config keys (a section as its prefix, "mpp.") that apply to this objective alone."""
        return (*((f"{self.section()[0]}.",) if self.section else ()), *self.reads)

    def objective(self, backbone, cfg, classes: int | None):
        """The objective over `backbone` for the run config `cfg` (its builder imported now)."""
        return implementation(self.build)(backbone, cfg, classes)


CLASSIFICATION_SETTINGS = ("train.label_smoothing",)  # what supervised pretraining and fine-tuning read alone

# The config's `objective` -> its kind.
OBJECTIVES: dict[str, ObjectiveKind] = {
    "mpp": ObjectiveKind("mpp.model.objectives:masked_patch_prediction", reads_labels=False, summary="masked patch prediction",
                         section=lambda: ("mpp", mpp_section(tuple(TARGETS.items())))),
    "supervised": ObjectiveKind("mpp.model.objectives:supervised", reads_labels=True, summary="supervised (upstream labels)",
                                meaning="classification of the shards' cls labels", reads=CLASSIFICATION_SETTINGS),
}


def objective_fields() -> dict[str, tuple]:
    """The run config's `objective` (its choices and their meanings from OBJECTIVES) and the objectives' sections."""
    sections = dict(kind.section() for kind in OBJECTIVES.values() if kind.section)
    return _objective_fields(tuple((name, kind.meaning or kind.summary) for name, kind in OBJECTIVES.items()),
                             tuple(sections.items()))


@functools.lru_cache(maxsize=32)
def _objective_fields(meanings: tuple[tuple[str, str], ...], sections: tuple) -> dict[str, tuple]:
    known = Annotated[str, AfterValidator(lambda name: one_of("objective", name, OBJECTIVES))]
    described = listed([f"{name} ({meaning})" for name, meaning in meanings])
    return {"objective": (known, Field("mpp", description=f"Pretraining objective: {described}.")),
            **{key: section_field(section) for key, section in sections}}


SECTION_SOURCES.append(objective_fields)
