"""A colour transfer benchmark from the emoji of four vendors (npm's emoji-datasource-{apple,google,twitter,facebook}).

Arranges the packages' 64-px PNGs into image folders, one sub-folder per class, for `launch.py prepare`, split by
emoji category so that nothing downstream is seen upstream (as the Fashion-MNIST plan splits by class):

    up_train/, up_val/       the emoji of the UPSTREAM categories, every vendor, skin-tone variants included:
                             pretraining data (MPP ignores the labels, supervised pretraining learns them);
                             up_val holds one emoji in twenty (by a hash of its code), every rendition of it
    down_train/              the DOWNSTREAM categories: `--train-per-class` emoji per category (by hash), one
                             vendor's rendition (`--down-vendor`): the few labelled images a fine-tuning gets
    down_test/               the other emoji of those categories, the same vendor: the test images

Downstream images are split by emoji, not by image, and only one vendor is used there, so a test image never has a
sibling (another vendor's drawing of the same emoji, or a skin-tone variant) among the training images, and the
test images are not near-copies of each other (the paired intervals treat them as independent).
Transparent pixels are composited on white: the models read RGB.

Step by step (no network beyond the npm registry; data is never committed):

    mkdir -p data/emoji-npm && cd data/emoji-npm
    for v in apple google twitter facebook; do npm pack emoji-datasource-$v@16.0.0; done; cd ../..
    python benchmarks/emoji.py --packages data/emoji-npm --out data/emoji-images
    for p in up_train up_val down_train down_test; do
        python launch.py prepare data/emoji-images/$p --out data/emoji/$p
    done
    python launch.py compare --config configs/compare/emoji.yaml
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

from PIL import Image

VENDORS = ("apple", "google", "twitter", "facebook")
VERSION = "16.0.0"
# Four downstream classes that look unlike one another and unlike the upstream categories; "Component" (5 skin-tone
# swatches and hair pieces) is left out of both sides.
DOWNSTREAM = ("Animals & Nature", "Food & Drink", "Activities", "Symbols")
UPSTREAM = ("Smileys & Emotion", "People & Body", "Travel & Places", "Objects", "Flags")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", type=Path, required=True, help="the folder holding the four npm tarballs")
    parser.add_argument("--out", type=Path, required=True, help="where the image folders go (must not exist)")
    parser.add_argument("--train-per-class", type=int, default=40, help="labelled downstream emoji per class")
    parser.add_argument("--down-vendor", choices=VENDORS, default="facebook", help="the vendor whose drawings are classified")
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it or choose another --out")
    written = arrange(args.packages, args.out, args.train_per_class, args.down_vendor)
    for part in ("up_train", "up_val", "down_train", "down_test"):
        counts = {c: n for (p, c), n in sorted(written.items()) if p == part}
        print(f"{part}: {sum(counts.values())} images, " + ", ".join(f"{c} {n}" for c, n in counts.items()))


if __name__ == "__main__":
    main()
