"""Throughput of `prepare --short-side`: one worker process against one per core, and reduced-scale JPEG decode
against full decode.

    python benchmarks/prepare.py                      # 96 images: half 500x375, half 1600x1200, quality 90
    python benchmarks/prepare.py --images 200 --rounds 5

The images are photo-like JPEGs made here (as benchmarks/data.py makes them), written once as a folder of two
classes. Each round runs `prepare FOLDER --short-side S` into a fresh directory with --workers 1 and then with
--workers <cores> (the default), in this one process, so background load hits both alike; the medians over rounds
and their ratio are printed. The worker processes' start is included; their server is started by the first prepare,
as every `launch.py prepare` process starts it once, and that first prepare is printed apart. Beside the wall clock,
the CPU time each run took (this process, plus the workers, reaped by their server) gives images per CPU-second: the
parallel path's overhead, whatever the load. On a machine shared by several login sessions, Linux's autogroup
scheduling gives a session one share of the CPUs however many processes it runs, so there the wall-clock ratio shows
the share, not the cores.
Then, in this process, the downsizing prepare does per image (`_bounded`: JPEG draft at the smallest DCT scale that
keeps the short side, upright, LANCZOS resize, JPEG encode) against the same with a full decode, for each image size,
in images per CPU-second of one core.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import jpeg, photo_like  # noqa: E402
from mpp.data import prepare_inputs, shardwriter  # noqa: E402
from mpp.data.shardwriter import default_workers  # noqa: E402
from pipelines.stages import prepare  # noqa: E402

SIZES = ((500, 375), (1600, 1200))


def full_decode_bounded(image: Image.Image, short_side: int, quality: int) -> bytes:
    """`prepare_inputs._bounded` without the reduced-scale decode: the baseline draft mode is measured against."""
    image.load()
    return prepare_inputs._bounded(image, short_side, quality)


def per_image_rate(datas: list[bytes], downsize, short_side: int, quality: int, repeats: int) -> float:
    """Images per CPU-second of this (single-threaded) process."""
    started = time.process_time()
    for _ in range(repeats):
        for data in datas:
            with Image.open(io.BytesIO(data)) as image:
                downsize(image, short_side, quality)
    return repeats * len(datas) / (time.process_time() - started)


def workers_cpu_s() -> float:
    """CPU seconds of the processes the worker server (a child of this process) has started and reaped."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and b"forkserver" in (stat.parent / "cmdline").read_bytes():
                return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime + cstime
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=96, help="images in the folder, half of each size")
    parser.add_argument("--distinct", type=int, default=8, help="distinct images of each size (cycled over the files)")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--short-side", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cores = default_workers()
    # The workers' throughput at this size, which prepare itself writes in one process below INPUTS_PER_WORKER per worker.
    shardwriter.INPUTS_PER_WORKER = 1
    work = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    try:
        originals = {size: [jpeg(photo_like(*size, seed), args.quality) for seed in range(args.distinct)] for size in SIZES}
        for i in range(args.images):
            size = SIZES[i % 2]
            folder = work / "images" / f"{size[0]}x{size[1]}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:06d}.jpg").write_bytes(originals[size][i % args.distinct])

        def run(workers: int, name: str) -> tuple[float, float]:
            """(images/s, images per CPU-second) of one prepare."""
            started, cpu, workers_cpu = time.perf_counter(), time.process_time(), workers_cpu_s()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prepare.run(str(work / "images"), str(work / name), short_side=args.short_side, quality=args.quality,
                            samples_per_shard=max(1, args.images // (4 * cores)), workers=workers)
            elapsed = time.perf_counter() - started
            used = time.process_time() - cpu + workers_cpu_s() - workers_cpu
            shutil.rmtree(work / name)
            return args.images / elapsed, args.images / used

        first = run(cores, "first")  # starts the worker server, as every `launch.py prepare` process does once
        rates = {1: [], cores: []}
        for round_index in range(args.rounds):
            for workers in rates:
                rates[workers].append(run(workers, f"out-{round_index}-{workers}"))
        load = os.getloadavg()

        decode = {}
        for size in SIZES:
            datas = originals[size]
            repeats = max(1, 24 // len(datas))
            pairs = [(per_image_rate(datas, prepare_inputs._bounded, args.short_side, args.quality, repeats),
                      per_image_rate(datas, full_decode_bounded, args.short_side, args.quality, repeats))
                     for _ in range(args.rounds)]
            decode[size] = [statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"prepare FOLDER --short-side {args.short_side} --quality {args.quality}: {args.images} JPEGs (half 500x375, "
          f"half 1600x1200, quality {args.quality}); {args.rounds} rounds, medians; {cores} cores; load average "
          f"{load[0]:.1f} at the end")
    one, many = (statistics.median(r[0] for r in rates[w]) for w in (1, cores))
    one_cpu, many_cpu = (statistics.median(r[1] for r in rates[w]) for w in (1, cores))
    print(f"  --workers 1: {one:7.1f} images/s, {one_cpu:6.1f} images per CPU-second")
    print(f"  --workers {cores}: {many:7.1f} images/s ({many / one:.2f}x), {many_cpu:6.1f} images per CPU-second "
          f"({many_cpu / one_cpu:.2f}x: on {cores} idle cores, {cores * many_cpu / one_cpu:.2f}x is the most to expect)")
    server_s = args.images / first[0] - args.images / many
    print(f"  the first --workers {cores} prepare of a process: {first[0]:7.1f} images/s ({first[0] / one:.2f}x); starting the "
          f"worker server (it imports mpp.data.shardwriter once) cost {server_s:.1f} s of wall clock")
    print(f"downsizing one image to a {args.short_side}-px short side, images per CPU-second of one core (median of "
          f"{args.rounds}):")
    for (width, height), (draft, full) in decode.items():
        print(f"  {width}x{height}: reduced-scale decode {draft:7.1f}, full decode {full:7.1f}  ({draft / full:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
