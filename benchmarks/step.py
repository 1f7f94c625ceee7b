"""Time one MPP training step: ours against lucidrains' vit-pytorch MPP, side by side in one process.

    python benchmarks/step.py --device cpu --model vit_ti --depth 6 --patch-size 4 --image-size 32 --batch-size 64
    python benchmarks/step.py --device cuda --model vit_b16 --image-size 224 --batch-size 256 --peak-tflops 989

Both take uint8 images already on the device and run forward, backward, gradient clipping at norm 1 and a fused
AdamW step, at the paper's rates (50% of patches corrupted, 80/10/10). Ours is the training loop's own step
(`mpp.training.loop.train_step` under Accelerate, with the precision and torch.compile settings of `train.*`, auto by default). The peer
has no mixed precision of its own, so it runs twice: in fp32, as it ships, and in eager mode under the same bf16
autocast as ours (when ours is bf16), which leaves precision out of the comparison. Rounds alternate between the
runs, so background load hits all alike; the table gives medians over rounds and, for each row, ours' images/s
over that row's. MFU counts 3x the forward FLOPs of our model (backbone plus the head at corrupted positions) for
every row, so MFU ratios equal throughput ratios.

`--stem resnet` times the paper's hybrid (the ResNet stem's convolutions counted in its FLOPs) with the plain ViT
of the same size and patch as the row beside it, each row's MFU from its own FLOPs; vit-pytorch has no hybrid.

The peer is a benchmark-only install: `pip install --no-deps vit-pytorch`. Its package __init__ imports
torchvision, so `vit.py` and `mpp.py` are loaded from the installed package directly; nothing of it is copied here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpp.config import TrainConfig  # noqa: E402
from mpp.model.vit import VisionTransformer, build_vit  # noqa: E402
from mpp.model.objectives import MaskedPatchPrediction, num_corrupted  # noqa: E402
from mpp.data.stream import Batch  # noqa: E402
from mpp.training.runtime import Device, make_accelerator, precision_label, resolve_compile, resolve_precision  # noqa: E402
from mpp.training.loop import prepare_to_train, train_step  # noqa: E402

PEER_INSTALL = "pip install --no-deps vit-pytorch"
RATE, MASK_PROB, RANDOM_PROB = 0.5, 0.8, 0.1
COLORS = 512


def conv_flops(vit: VisionTransformer) -> int:
    """Convolution FLOPs (2 per multiply-add) of a hybrid's ResNet stem on one image, counted from its layers' output
    shapes by a forward hook; 0 for a plain ViT."""
    if vit.stem != "resnet":
        return 0
    total = 0

    def count(module: nn.Conv2d, _, output: torch.Tensor) -> None:
        nonlocal total
        total += 2 * output[0].numel() * module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]

    hooks = [m.register_forward_hook(count) for m in vit.patch_embed.stem.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        vit.patch_embed.stem(torch.zeros(1, 3, vit.image_size, vit.image_size, device=vit.cls_token.device))
    for hook in hooks:
        hook.remove()
    return total


def forward_flops(vit: VisionTransformer, head_positions: int, head_out: int = COLORS) -> int:
    """Matmul FLOPs (2 per multiply-add) of one image's forward pass: the ResNet stem (a hybrid's), the patch
    projection, blocks, head."""
    n, d = vit.num_patches, vit.width
    t = n + 1
    block = 2 * t * d * 3 * d + 2 * 2 * t * t * d + 2 * t * d * d + 2 * 2 * t * d * 4 * d  # qkv, QK^T and AV, proj, MLP
    projection = 2 * n * vit.patch_embed.proj.in_features * d  # P*P*3 inputs per patch, or the ResNet's channels
    return conv_flops(vit) + projection + vit.depth * block + 2 * head_positions * d * head_out


def load_peer():
    """(ViT, MPP) classes from the installed vit-pytorch, or None when it is not installed."""
    spec = importlib.util.find_spec("vit_pytorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    modules = {}
    for name in ("vit", "mpp"):
        file_spec = importlib.util.spec_from_file_location(f"peer_vit_pytorch_{name}", root / f"{name}.py")
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        modules[name] = module
    return modules["vit"].ViT, modules["mpp"].MPP


def build_peer(classes, vit: VisionTransformer) -> nn.Module:
    """The peer's MPP around its own ViT of the same size, configured to the paper's rates."""
    peer_vit_cls, peer_mpp_cls = classes
    d = vit.width
    peer_vit = peer_vit_cls(image_size=vit.image_size, patch_size=vit.patch_size, num_classes=0, dim=d, depth=vit.depth,
                            heads=vit.heads, mlp_dim=4 * d, dim_head=d // vit.heads)
    # Its MPP indexes these two with a leading batch axis that its current ViT no longer has.
    peer_vit.cls_token = nn.Parameter(peer_vit.cls_token.detach().reshape(1, 1, d))
    peer_vit.pos_embedding = nn.Parameter(peer_vit.pos_embedding.detach().reshape(1, -1, d))
    return peer_mpp_cls(transformer=peer_vit, patch_size=vit.patch_size, dim=d, mask_prob=RATE,
                        replace_prob=MASK_PROB, random_patch_prob=RANDOM_PROB)


def peer_step(classes, vit: VisionTransformer, device: torch.device, precision: str):
    """One training step of a fresh peer model, under bf16 autocast or in fp32."""
    peer = build_peer(classes, vit).to(device).train()
    optimizer = torch.optim.AdamW(peer.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(images: torch.Tensor) -> None:
        with autocast:
            loss = peer(images.float() / 255)  # the peer takes floats in [0, 1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def positive(text: str) -> int:
    """A whole number of at least 1 (sizes, counts), or argparse's one-line error naming the argument."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="vit_b16", help="ViT variant, as model.name (vit_b16, vit_ti, ...)")
    parser.add_argument("--image-size", type=positive, default=224)
    parser.add_argument("--patch-size", type=positive, default=None)
    parser.add_argument("--width", type=positive, default=None)
    parser.add_argument("--depth", type=positive, default=None)
    parser.add_argument("--heads", type=positive, default=None)
    parser.add_argument("--stem", choices=("patch", "resnet"), default="patch", help="as model.stem: resnet times the hybrid (no peer: vit-pytorch has none)")
    parser.add_argument("--stem-layers", type=int, nargs="+", default=[3, 4, 9], help="as model.stem_layers (the paper's R50: 3 4 9)")
    parser.add_argument("--stem-width", type=int, default=64, help="as model.stem_width")
    parser.add_argument("--batch-size", type=positive, default=64)
    parser.add_argument("--precision", choices=("auto", "no", "bf16"), default="auto", help="ours (auto: as train.mixed_precision auto)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="torch.compile ours (auto: on cuda only, as train.compile)")
    parser.add_argument("--compile-mode", choices=("default", "max-autotune-no-cudagraphs"), default="default", help="as train.compile_mode")
    parser.add_argument("--compare-compile-mode", choices=("default", "max-autotune-no-cudagraphs"), default=None,
                        help="also time ours compiled in this mode, side by side (when compiling)")
    parser.add_argument("--rounds", type=positive, default=7, help="timed rounds per implementation, interleaved")
    parser.add_argument("--steps", type=positive, default=5, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps each before the first round (compilation happens here)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak at this precision, for MFU (H100 SXM bf16: 989)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as train.cpu_threads auto)")
    parser.add_argument("--no-peer", action="store_true", help="time ours only")
    parser.add_argument("--json", type=Path, default=None, help="also write the table to this file (benchmarks/gpu_report.py reads it)")
    return parser


def model_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> VisionTransformer:
    """The ViT the arguments describe, or argparse's one-line error naming the sizes that do not fit together."""
    try:
        vit = build_vit(args.model, args.image_size, args.patch_size, width=args.width, depth=args.depth, heads=args.heads,
                        stem=args.stem, stem_layers=args.stem_layers, stem_width=args.stem_width)
    except ValueError as exc:  # the model's own check of the sizes given, e.g. an image size not a multiple of the patch
        parser.error(f"{exc}; pick --model, --image-size, --patch-size, --width and --heads that fit together")
    if vit.width % vit.heads:  # checked by a run's config, not by the model
        parser.error(f"width {vit.width} does not split over {vit.heads} attention heads; pick --width a multiple of --heads")
    return vit


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    torch.manual_seed(0)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    precision = resolve_precision(args.precision, Device.this_process())
    compile_ours = {"auto": "auto", "on": True, "off": False}[args.compile]
    cfg = TrainConfig(lr=1e-4, warmup_steps=0, clip_grad_norm=1.0, mixed_precision=precision, compile=compile_ours,
                      optimizer="adamw", batch_size=args.batch_size, cpu_threads=args.threads or "auto",
                      compile_mode=args.compile_mode)
    accelerator = make_accelerator(cfg, tempfile.mkdtemp(prefix="mpp-bench-"))
    if accelerator.device.type != args.device:
        parser.error(f"Accelerate picked {accelerator.device}, not {args.device}")
    device = accelerator.device

    vit = model_of(parser, args)
    compile_ours = resolve_compile(cfg.compile, Device.this_process())
    unlabelled = torch.full((args.batch_size,), -1, device=device)

    def our_step_of(vit: VisionTransformer, compile_mode: str):
        """The training loop's step of MPP over `vit`, as train() runs it (compiled in `compile_mode` when compiling)."""
        objective = MaskedPatchPrediction(vit, corrupt_rate=RATE, mask_prob=MASK_PROB, random_prob=RANDOM_PROB)
        ours, forward, optimizer, schedule, _ = prepare_to_train(accelerator, objective,
                                                                 cfg.model_copy(update={"compile_mode": compile_mode}))
        ours.train()

        def step(images: torch.Tensor) -> None:
            train_step(accelerator, ours, forward, optimizer, schedule, [Batch(images, unlabelled)], cfg.clip_grad_norm)

        return step

    # Every compiled model is made before the first is called: making one resets dynamo, which would discard the
    # code of any compiled before.
    first = f"ours ({'hybrid, ' if args.stem == 'resnet' else ''}mpp, {precision_label(precision)})"
    steps = {first: our_step_of(vit, cfg.compile_mode)}
    flops = {first: 3 * forward_flops(vit, num_corrupted(vit.num_patches, RATE))}
    if args.compare_compile_mode and compile_ours:
        name = f"{first[:-1]}, {args.compare_compile_mode})"
        torch.manual_seed(0)
        twin = build_vit(args.model, args.image_size, args.patch_size, width=args.width, depth=args.depth, heads=args.heads,
                         stem=args.stem, stem_layers=args.stem_layers, stem_width=args.stem_width)
        steps[name], flops[name] = our_step_of(twin, args.compare_compile_mode), flops[first]
    if args.stem == "resnet":  # the plain ViT of the same size and patch, as the baseline beside it
        plain = build_vit(args.model, args.image_size, vit.patch_size, width=args.width, depth=args.depth, heads=args.heads)
        name = f"ours (plain ViT, patch {plain.patch_size}, {precision_label(precision)})"
        steps[name] = our_step_of(plain, cfg.compile_mode)
        flops[name] = 3 * forward_flops(plain, num_corrupted(plain.num_patches, RATE))
    classes = None if args.no_peer or args.stem == "resnet" else load_peer()
    if classes is not None:
        for peer_precision in ("no", "bf16") if precision == "bf16" else ("no",):
            label = "as shipped" if peer_precision == "no" else "our autocast"
            name = f"peer ({precision_label(peer_precision)}, {label})"
            steps[name], flops[name] = peer_step(classes, vit, device, peer_precision), flops[first]

    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8, device=device)
    setup, rates = time_steps(steps, images, args)
    print_rates(args, vit, device, precision, compile_ours, flops, setup, rates)
    if classes is None and not args.no_peer and args.stem == "patch":
        print(f"peer not timed: vit-pytorch is not installed; `{PEER_INSTALL}` adds it (benchmark only, needs torch and einops)")
    return 0


def time_steps(steps: dict, images: torch.Tensor, args) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(seconds of each step's warmup, its images/s in each round), the rounds interleaving the steps."""
    device = images.device
    setup = {}
    for name, step in steps.items():
        started = time.perf_counter()
        for _ in range(args.warmup):
            step(images)
        sync(device)
        setup[name] = time.perf_counter() - started
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                step(images)
            sync(device)
            rates[name].append(args.steps * args.batch_size / (time.perf_counter() - started))
    return setup, rates


def print_rates(args, vit: VisionTransformer, device: torch.device, precision: str, compile_ours: bool,
                flops: dict[str, float], setup: dict[str, float], rates: dict[str, list[float]]) -> None:
    """The table: each step's median images/s, spread, ratio to ours, MFU (by its own model's FLOPs) and warmup
    time; with --json, the same as JSON."""
    first = next(iter(rates))
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else f", {torch.cuda.get_device_name()}"
    stem = f"hybrid (ResNet {args.stem_layers} x {args.stem_width}, {conv_flops(vit) / 1e9:.3g} GFLOP forward) " if args.stem == "resnet" else ""
    print(f"{stem}{args.model} width {vit.width} depth {vit.depth} heads {vit.heads} patch {vit.patch_size} at {args.image_size} px, "
          f"batch {args.batch_size}, {device.type}{threads}, precision {precision}, compile ours "
          f"{compile_ours}{f' ({args.compile_mode})' if compile_ours else ''}; {args.rounds} rounds x {args.steps} steps, medians; "
          f"model FLOPs per image {flops[first] / 1e9:.3g} GFLOP (3x forward)")
    width = max(map(len, rates))
    print(f"{'':{width}s} {'images/s':>10s} {'min':>9s} {'max':>9s} {'ours/this':>9s} {'MFU':>7s} {'warmup s':>9s}")
    medians = {name: statistics.median(r) for name, r in rates.items()}
    mfu = {name: medians[name] * flops[name] / (args.peak_tflops * 1e12) if args.peak_tflops else None for name in rates}
    for name, r in rates.items():
        shown = f"{mfu[name]:.1%}" if mfu[name] is not None else "-"
        print(f"{name:{width}s} {medians[name]:10.1f} {min(r):9.1f} {max(r):9.1f} {medians[first] / medians[name]:8.2f}x "
              f"{shown:>7s} {setup[name]:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "image_size": args.image_size, "batch_size": args.batch_size, "precision": precision,
            "compile": compile_ours, "compile_mode": args.compile_mode, "device": device.type, "stem": args.stem,
            "gflop_per_image": flops[first] / 1e9, "peak_tflops": args.peak_tflops,
            "rows": {name: {"images_per_s": medians[name], "min": min(r), "max": max(r), "warmup_s": setup[name],
                            "gflop_per_image": flops[name] / 1e9, "mfu": mfu[name]}
                     for name, r in rates.items()}}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
