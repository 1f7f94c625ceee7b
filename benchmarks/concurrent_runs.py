"""Training throughput of one run on every CPU thread against several runs side by side, one thread each.

A comparison plan is many small runs (folds, lengths, seeds), and `compare` runs its stages one after another. On
a CPU a small ViT does not keep two threads busy (part of each step is Python and one data worker), so the cores
may do more work as separate runs. This times the same stage both ways, alternating (one run at `--threads`
threads, then `--threads` runs at 1 thread each, then again) so drift on a shared machine hits both alike, and
prints the optimiser steps per second of each and their ratio. Each run is the stage as users run it
(`python launch.py STAGE --config CONFIG ...`), so its start-up is counted, as a plan pays it per run.

    python benchmarks/concurrent_runs.py --stage finetune --config runs/compare/emoji_semi/budget-10/ft/scratch/base-f0/config.yaml

Several `compare` processes over disjoint arms run a plan this way (docs/finetuning.md, "Running a plan faster").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["pretrain", "finetune"], default="finetune")
    parser.add_argument("--config", required=True, help="a run config YAML (a shipped one, or a plan's run's config.yaml)")
    parser.add_argument("--steps", type=int, default=300, help="train.steps of every run")
    parser.add_argument("--threads", type=int, default=2, help="the one run's threads, and how many runs side by side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the timings here")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run (data.shards=DIR, ...)")
    return parser


def start(args, output_dir: Path, threads: int) -> subprocess.Popen:
    """A run as `python launch.py` starts it here: paths in the config and the overrides are the caller's."""
    command = [sys.executable, str(ROOT / "launch.py"), args.stage, "--config", args.config, f"output_dir={output_dir}",
               f"train.steps={args.steps}", f"train.cpu_threads={threads}", "log.trackers=[]", *args.overrides]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps_per_second(args, work: Path, name: str, runs: int, threads: int) -> float:
    """Optimiser steps per second of `runs` runs started together at `threads` threads each, start to last exit."""
    began = time.perf_counter()
    procs = [start(args, work / f"{name}-{i}", threads) for i in range(runs)]
    for proc in procs:
        _, stderr = proc.communicate()
        if proc.returncode:
            sys.exit(f"error: a run failed (exit {proc.returncode}): {stderr.strip().splitlines()[-1:]}")
    return runs * args.steps / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    if args.threads < 2:
        sys.exit("error: --threads must be 2 or more: it is both the one run's threads and the number of runs")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpp-concurrent-") as work:
        for round_ in range(args.rounds):
            one = steps_per_second(args, Path(work), f"one{round_}", 1, args.threads)
            several = steps_per_second(args, Path(work), f"several{round_}", args.threads, 1)
            rows.append({"one_run_steps_per_s": one, "side_by_side_steps_per_s": several, "ratio": several / one})
            print(f"round {round_ + 1}: one run at {args.threads} threads {one:.2f} steps/s; {args.threads} runs at "
                  f"1 thread each {several:.2f} steps/s in all: {several / one:.2f}x", flush=True)
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"median over {args.rounds} round(s): {args.threads} runs side by side do {ratio:.2f}x the work of one")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "median_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
