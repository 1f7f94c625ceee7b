"""Time attention forward + backward: each `F.scaled_dot_product_attention` backend against plain softmax(QK^T)V.

Why it exists: on CPU, torch's flash-attention kernel is much slower in bf16 than in fp32, which decides whether
`train.mixed_precision=bf16` pays on a CPU (docs/benchmarks.md). The default shape is the CPU benchmark model's
attention: batch 64, 3 heads, 65 tokens (64 patches + [class]), head width 64.

    python benchmarks/attention.py [--device cpu] [--batch 64 --heads 3 --tokens 65 --head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa math": SDPBackend.MATH, "plain softmax(QK^T)V": None}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None) -> torch.Tensor:
    if backend is None:
        return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v)


def time_ms(shape: tuple[int, ...], dtype: torch.dtype, device: str, backend: SDPBackend | None, reps: int) -> float:
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype, device=device)
    times = []
    for i in range(reps + 3):  # 3 untimed warm-up repetitions
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        attention(q, k, v, backend).backward(grad)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=65)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    print(f"attention forward + backward, shape {shape}, {args.device}, median of {args.reps} (ms)")
    print(f"{'':24s} {'fp32':>8s} {'bf16':>8s}")
    for name, backend in BACKENDS.items():
        cells = [time_ms(shape, dtype, args.device, backend, args.reps) for dtype in (torch.float32, torch.bfloat16)]
        print(f"{name:24s} {cells[0]:8.2f} {cells[1]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
