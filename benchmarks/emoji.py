"""Two colour benchmarks from the emoji of four vendors (npm's emoji-datasource-{apple,google,twitter,facebook}).

`--mode transfer` (the default) arranges the packages' 64-px PNGs into image folders, one sub-folder per class, for
`launch.py prepare`, split by emoji category so that nothing downstream is seen upstream (as the Fashion-MNIST plan
splits by class):

    up_train/, up_val/       the emoji of the UPSTREAM categories, every vendor, skin-tone variants included:
                             pretraining data (MPP ignores the labels, supervised pretraining learns them);
                             up_val holds one emoji in twenty (by a hash of its code), every rendition of it
    down_train/              the DOWNSTREAM categories: `--train-per-class` emoji per category (by hash), one
                             vendor's rendition (`--down-vendor`): the few labelled images a fine-tuning gets
    down_test/               the other emoji of those categories, the same vendor: the test images

Downstream images are split by emoji, not by image, and only one vendor is used there, so a test image never has a
sibling (another vendor's drawing of the same emoji, or a skin-tone variant) among the training images, and the
test images are not near-copies of each other (the paired intervals treat them as independent).
Transparent pixels are composited on white, as when this benchmark's published results were measured.

`--mode semi` is the semi-supervised design (configs/compare/emoji_semi.yaml): every vendor pooled, the nine
categories but Component (5 swatches) as the classes, SPLIT BY EMOJI:

    train/                   the drawings of 1 - `--test-share` of each category's emoji, every vendor: MPP's
                             unlabelled pool, and the labelled images the plan's label budgets draw from
    test/                    every drawing of the other emoji: emoji no training image shows in any style

Emoji whose drawings are pixel-identical for some vendor (an obsoleted code and its successor, the flags of places
that share one) are one emoji for the split, so no test image has a copy among the training images. Skin-tone
variants are left out: they are one drawing recoloured five times or more, and would make People & Body most of the
images and the test set near-copies of itself. The four vendors' drawings of a test emoji are all test images, so
they are no four independent samples: each file is named `<vendor>-<code>_<emoji>.png`, `<emoji>` the first code of
the emoji's set (the split's unit; its own code for most), which the plan's `image_groups` reads from the key to
resample whole emoji (docs/statistics.md). Transparent pixels are composited over mpp's own background (mpp.data.images.to_rgb, mid grey), so the images
on disk are the pixels every mpp run reads.

`--shards DIR` then runs `prepare` on each folder, into DIR/<folder>: one command from the npm tarballs to shards.

Step by step (no network beyond the npm registry; data is never committed):

    mkdir -p data/emoji-npm && cd data/emoji-npm
    for v in apple google twitter facebook; do npm pack emoji-datasource-$v@16.0.0; done; cd ../..
    python benchmarks/emoji.py --packages data/emoji-npm --out data/emoji-images --shards data/emoji
    python launch.py compare --config configs/compare/emoji.yaml
    python benchmarks/emoji.py --mode semi --packages data/emoji-npm --out data/emoji-semi-images --shards data/emoji_semi
    python launch.py compare --config configs/compare/emoji_semi.yaml
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpp.data.images import to_rgb  # noqa: E402
from pipelines.stages import prepare  # noqa: E402

VENDORS = ("apple", "google", "twitter", "facebook")
VERSION = "16.0.0"
# Four downstream classes that look unlike one another and unlike the upstream categories; "Component" (5 skin-tone
# swatches and hair pieces) is left out of both sides.
DOWNSTREAM = ("Animals & Nature", "Food & Drink", "Activities", "Symbols")
UPSTREAM = ("Smileys & Emotion", "People & Body", "Travel & Places", "Objects", "Flags")
# The semi-supervised design's classes: every category but Component (5 emoji, too few to split).
SEMI_LEFT_OUT = ("Component",)
TRANSFER_PARTS = ("up_train", "up_val", "down_train", "down_test")
SEMI_PARTS = ("train", "test")


def package(directory: Path, vendor: str) -> tarfile.TarFile:
    path = directory / f"emoji-datasource-{vendor}-{VERSION}.tgz"
    if not path.is_file():
        sys.exit(f"error: {path} is missing; fetch it with `npm pack emoji-datasource-{vendor}@{VERSION}` in {directory}")
    return tarfile.open(path)


def renditions(entry: dict) -> list[str]:
    """The image file names of an emoji and of its skin-tone variants."""
    return [entry["image"], *(variant["image"] for variant in (entry.get("skin_variations") or {}).values())]


def in_share(code: str, numerator: int, denominator: int) -> bool:
    """A stable pseudo-random share of the emoji, by a hash of the emoji's code: the same on every machine."""
    return zlib.crc32(code.encode()) % denominator < numerator


def folder_name(category: str) -> str:
    return category.lower().replace(" & ", "-and-").replace(" ", "-")


def rgb_on_white(png: bytes) -> bytes:
    image = Image.open(io.BytesIO(png)).convert("RGBA")
    flat = Image.new("RGB", image.size, (255, 255, 255))
    flat.paste(image, mask=image.getchannel("A"))
    out = io.BytesIO()
    flat.save(out, format="PNG")
    return out.getvalue()


def arrange(packages: Path, out: Path, train_per_class: int, down_vendor: str) -> Counter:
    with package(packages, VENDORS[0]) as first:
        emoji = json.load(first.extractfile("package/emoji.json"))
    # Each downstream category's emoji ranked by hash: the first train_per_class train, the rest test.
    ranked = {c: sorted((e for e in emoji if e["category"] == c and e.get(f"has_img_{down_vendor}")),
                        key=lambda e: (zlib.crc32(e["unified"].encode()), e["unified"])) for c in DOWNSTREAM}
    down = {e["image"]: ("down_train" if rank < train_per_class else "down_test", c)
            for c, entries in ranked.items() for rank, e in enumerate(entries)}
    for c, entries in ranked.items():
        if len(entries) <= train_per_class:
            sys.exit(f"error: {c} has {len(entries)} {down_vendor} emoji, not more than --train-per-class "
                     f"{train_per_class}; lower it")
    up = {name: ("up_val" if in_share(e["unified"], 1, 20) else "up_train", e["category"])
          for e in emoji if e["category"] in UPSTREAM for name in renditions(e)}
    written: Counter = Counter()
    for vendor in VENDORS:
        with package(packages, vendor) as tar:
            prefix = f"package/img/{vendor}/64/"
            for member in tar:
                name = member.name.removeprefix(prefix)
                if not member.isfile() or name == member.name:
                    continue
                where = up.get(name) or (down.get(name) if vendor == down_vendor else None)
                if where is None:
                    continue
                part, category = where
                target = out / part / folder_name(category) / f"{vendor}-{name}"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(rgb_on_white(tar.extractfile(member).read()))
                written[part, category] += 1
    return written


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def pixels_digest(png: bytes) -> bytes:
    """What a drawing looks like, whatever its PNG encoding: a digest of its size and RGBA pixels."""
    image = Image.open(io.BytesIO(png)).convert("RGBA")
    return hashlib.sha256(f"{image.size}".encode() + image.tobytes()).digest()


class SameEmoji:
    """Union-find over emoji codes: the codes the split must keep on one side."""

    def __init__(self, codes):
        self.parent = {code: code for code in codes}

    def root(self, code: str) -> str:
        while self.parent[code] != code:
            self.parent[code] = self.parent[self.parent[code]]
            code = self.parent[code]
        return self.parent[code]

    def join(self, a: str, b: str) -> None:
        self.parent[self.root(a)] = self.root(b)

    def groups(self) -> list[list[str]]:
        members: dict[str, list[str]] = {}
        for code in self.parent:
            members.setdefault(self.root(code), []).append(code)
        return [sorted(codes) for codes in members.values()]


def arrange_semi(packages: Path, out: Path, test_share: float) -> Counter:
    """Every vendor's drawing of every emoji of the classes, in out/train or out/test by emoji (stratified: each
    category gives round(test_share x its emoji) to test, ranked by a hash of the code). Returns the images written
    per (part, category) and, under (part, "emoji"), the emoji per part."""
    with package(packages, VENDORS[0]) as first:
        entries = {e["image"]: e for e in json.load(first.extractfile("package/emoji.json"))
                   if e["category"] not in SEMI_LEFT_OUT}
    drawings: dict[tuple[str, str], bytes] = {}
    for vendor in VENDORS:
        with package(packages, vendor) as tar:
            prefix = f"package/img/{vendor}/64/"
            for member in tar:
                entry = entries.get(member.name.removeprefix(prefix))
                if member.isfile() and member.name.startswith(prefix) and entry and entry.get(f"has_img_{vendor}"):
                    drawings[vendor, entry["image"]] = tar.extractfile(member).read()
    same = SameEmoji(e["unified"] for e in entries.values())
    first_with: dict[bytes, str] = {}
    for (_, name), png in sorted(drawings.items()):
        code = entries[name]["unified"]
        same.join(code, first_with.setdefault(pixels_digest(png), code))
    for e in entries.values():
        if e.get("obsoleted_by") in same.parent:
            same.join(e["unified"], e["obsoleted_by"])
    category = {e["unified"]: e["category"] for e in entries.values()}
    by_category: dict[str, list[list[str]]] = {}
    one_emoji = {code: codes[0].lower() for codes in same.groups() for code in codes}  # each code's split unit, named
    for codes in same.groups():
        by_category.setdefault(category[codes[0]], []).append(codes)
    test: set[str] = set()
    for name, groups in sorted(by_category.items()):
        ranked = sorted(groups, key=lambda codes: (zlib.crc32(codes[0].encode()), codes[0]))
        take = math.floor(test_share * len(ranked) + 0.5)
        if not 0 < take < len(ranked):
            sys.exit(f"error: {name} has {len(ranked)} emoji, so --test-share {test_share:g} leaves one side of the "
                     f"split without it; choose a share between {1 / len(ranked):.2f} and {1 - 1 / len(ranked):.2f}")
        test.update(code for codes in ranked[:take] for code in codes)
    written: Counter = Counter()
    seen: dict[str, set[str]] = {part: set() for part in SEMI_PARTS}
    for (vendor, name), png in sorted(drawings.items()):
        entry = entries[name]
        part = "test" if entry["unified"] in test else "train"
        # <vendor>-<code>_<emoji>.png: the emoji (the split's unit) last, so a plan's image_groups can read it from the key.
        target = out / part / folder_name(entry["category"]) / f"{vendor}-{Path(name).stem}_{one_emoji[entry['unified']]}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png_bytes(to_rgb(Image.open(io.BytesIO(png)))))
        written[part, entry["category"]] += 1
        seen[part].add(entry["unified"])
    for part, codes in seen.items():
        written[part, "emoji"] = len(codes)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("transfer", "semi"), default="transfer",
                        help="transfer: pretrain on some categories, classify others; semi: every category, split by emoji")
    parser.add_argument("--packages", type=Path, required=True, help="the folder holding the four npm tarballs")
    parser.add_argument("--out", type=Path, required=True, help="where the image folders go (must not exist)")
    parser.add_argument("--shards", type=Path, help="also prepare each image folder as shards in SHARDS/<folder>")
    parser.add_argument("--train-per-class", type=int, default=40, help="transfer: labelled downstream emoji per class")
    parser.add_argument("--down-vendor", choices=VENDORS, default="facebook", help="transfer: the vendor whose drawings are classified")
    parser.add_argument("--test-share", type=float, default=0.42,
                        help="semi: the share of each category's emoji whose drawings are all test images")
    args = parser.parse_args(argv)
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it or choose another --out")
    if args.mode == "semi":
        written, parts = arrange_semi(args.packages, args.out, args.test_share), SEMI_PARTS
    else:
        written, parts = arrange(args.packages, args.out, args.train_per_class, args.down_vendor), TRANSFER_PARTS
    for part in parts:
        counts = {c: n for (p, c), n in sorted(written.items()) if p == part and c != "emoji"}
        emoji = f" of {written[part, 'emoji']} emoji" if (part, "emoji") in written else ""
        print(f"{part}: {sum(counts.values())} images{emoji}, " + ", ".join(f"{c} {n}" for c, n in counts.items()))
    for part in parts if args.shards else ():
        prepare.run(str(args.out / part), str(args.shards / part))


if __name__ == "__main__":
    main()
