"""Per-core throughput of decode + random-resized crop to 224 px: a naive baseline against mpp's paths.

    python benchmarks/data.py                      # 500x375 quality-90 JPEGs, 224-px crops, ImageNet crop scale
    python benchmarks/data.py --width 1600 --height 1200

One process, one thread, so the rates are per core. The images are made here: photo-like (smooth colour fields
at several scales plus grain), JPEG at --quality. Each path turns the same encoded bytes and the same crop boxes
into a (3, 224, 224) uint8 tensor:

  naive          PIL full decode, crop, PIL resize (bilinear)
  mpp            mpp.data.TrainTransform: JPEG draft at a reduced DCT scale where the crop allows, then torch's
                 uint8 antialiased bilinear resize of the crop
  mpp, shard<=S  the same transform on the image as `launch.py prepare --short-side S` stores it
  simplejpeg     libjpeg-turbo through simplejpeg (fast DCT and upsampling, reduced scale), then mpp's resize;
                 timed when installed, as a candidate: mpp does not use it

Rounds alternate between the paths so background load hits all alike; the table gives medians over rounds.
"""

from __future__ import annotations

import argparse
import io
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mpp.data.stream import TrainTransform, random_resized_box  # noqa: E402
from mpp.data.prepare_inputs import bound_short_side_bytes  # noqa: E402


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour variation at several scales plus per-pixel grain: compresses like a photograph."""
    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), np.float32)
    for cells, amplitude in ((4, 90.0), (16, 40.0), (64, 20.0)):
        field = rng.uniform(-1, 1, (max(2, cells * height // width), cells, 3)).astype(np.float32)
        layer = np.stack([np.asarray(Image.fromarray(field[..., c]).resize((width, height), Image.BICUBIC)) for c in range(3)], -1)
        image += amplitude * layer
    image += 128 + rng.normal(0, 9, image.shape).astype(np.float32)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def to_uint8_chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def naive(data: bytes, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return to_uint8_chw(img.crop(box).resize((size, size), Image.BILINEAR))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--size", type=int, default=224, help="crop side in pixels")
    parser.add_argument("--crop-scale", type=float, nargs=2, default=(0.08, 1.0), help="area fraction range of the crop")
    parser.add_argument("--short-side", type=int, nargs="*", default=[256, 320], help="shard short-side bounds to time")
    parser.add_argument("--images", type=int, default=32, help="distinct images (cycled)")
    parser.add_argument("--per-round", type=int, default=64, help="crops per path per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    originals = [jpeg(photo_like(args.width, args.height, seed), args.quality) for seed in range(args.images)]
    transform = TrainTransform(args.size, tuple(args.crop_scale), hflip=False)
    paths = {"naive (PIL full decode)": (originals, lambda d, rng: naive(d, random_resized_box(*Image.open(io.BytesIO(d)).size, transform.crop_scale, rng), args.size))}
    paths["mpp (draft + box resize)"] = (originals, lambda d, rng: transform(Image.open(io.BytesIO(d)), rng))
    stored_sizes = {}
    for side in args.short_side:
        stored = [bound_short_side_bytes(d, side, args.quality) for d in originals]
        stored_sizes[side] = stored
        paths[f"mpp, shard<={side}"] = (stored, lambda d, rng: transform(Image.open(io.BytesIO(d)), rng))
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    if simplejpeg is not None:
        def turbo(data: bytes, rng: random.Random) -> torch.Tensor:
            width, height, _, _ = simplejpeg.decode_jpeg_header(data)
            box = random_resized_box(width, height, transform.crop_scale, rng)
            shrink = min((box[2] - box[0]) / args.size, (box[3] - box[1]) / args.size)
            pixels = simplejpeg.decode_jpeg(data, fastdct=True, fastupsample=True, min_width=math.ceil(width / shrink),
                                            min_height=math.ceil(height / shrink))  # reduced DCT scale, as draft
            fx, fy = pixels.shape[1] / width, pixels.shape[0] / height
            box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
            crop = torch.from_numpy(pixels)[round(box[1]):round(box[3]), round(box[0]):round(box[2])].permute(2, 0, 1)[None]
            return F.interpolate(crop, size=(args.size, args.size), mode="bilinear", antialias=True)[0]  # as mpp's resize

        paths["simplejpeg (fast DCT)"] = (originals, turbo)

    rates: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, (datas, decode) in paths.items():
            started = time.perf_counter()
            for i in range(args.per_round):
                out = decode(datas[i % len(datas)], random.Random(f"{round_index}-{i}"))
            elapsed = time.perf_counter() - started
            assert out.shape == (3, args.size, args.size) and out.dtype == torch.uint8
            if round_index:
                rates[name].append(args.per_round / elapsed)

    kb = lambda datas: sum(len(d) for d in datas) / len(datas) / 1e3  # noqa: E731
    print(f"{args.width}x{args.height} JPEG quality {args.quality} ({kb(originals):.0f} KB/image) -> random-resized crop "
          f"{args.size}x{args.size}, crop scale {tuple(args.crop_scale)}; one core; {args.rounds} rounds x {args.per_round} "
          f"images, medians")
    print(f"{'':28s} {'images/s':>9s} {'vs naive':>9s} {'KB/image':>9s}")
    base = statistics.median(rates["naive (PIL full decode)"])
    for name, (datas, _) in paths.items():
        rate = statistics.median(rates[name])
        print(f"{name:28s} {rate:9.0f} {rate / base:8.2f}x {kb(datas):9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
