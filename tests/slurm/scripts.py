"""The documented SLURM scripts as tests/slurm/check.sh runs them on one host, and its weights check.

`python tests/slurm/scripts.py write GUIDE WORK` writes WORK/NAME_{reference,stopped}.sbatch for GUIDE's two scripts
(NAME one_node, several_nodes) and docs/clusters.md's torchrun script (torchrun), with only what this host lacks
rewritten (GPUs, four nodes, 64 CPUs, the paper's config and data) and every other line as documented. Each rewrite
must find its text exactly once, so a script changed where it matters fails here, not silently later.
`python tests/slurm/scripts.py same-weights A B` exits 0 when two model.safetensors hold identical tensors, bit for bit.
"""

import re
import sys
from pathlib import Path

SECTION = "### Jobs under SLURM"
CLUSTERS = Path(__file__).resolve().parents[2] / "docs" / "clusters.md"
TORCHRUN_SECTION = "## The several-nodes script with torchrun"
TINY_CONFIG = """\
model: {name: vit_ti, width: 32, depth: 1, heads: 2, image_size: 16, patch_size: 4}
data: {num_workers: 1, shuffle_buffer: 50}
train: {steps: 200, warmup_steps: 5, global_batch_size: 8, checkpoint_every: 20}
log: {every: 20, images_every: 1000}
"""


def section_scripts(path: Path, heading: str) -> list[str]:
    text = path.read_text()
    section = text[text.index(heading) + len(heading):]
    section = section.split("\n## ", 1)[0]  # to the next section, or the file's end
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def documented_scripts(readme: Path) -> dict[str, str]:
    """The two job scripts of docs/preemption.md (or an older README: one node, then several) and docs/clusters.md's
    torchrun script."""
    scripts = section_scripts(readme, SECTION)
    if len(scripts) != 2:
        sys.exit(f"{readme}: expected the one-node and the several-nodes script in {SECTION!r}, found {len(scripts)}")
    torchrun = section_scripts(CLUSTERS, TORCHRUN_SECTION)
    if len(torchrun) != 1:
        sys.exit(f"{CLUSTERS}: expected one script in {TORCHRUN_SECTION!r}, found {len(torchrun)}")
    return {"one_node": scripts[0], "several_nodes": scripts[1], "torchrun": torchrun[0]}


def host_rewrites(work: Path, name: str, run: str) -> list[tuple[str, str]]:
    """What each script needs on this host: each node daemon has 2 CPUs and no GPU; a CPU process (gloo) stands for
    each GPU; `--multi_gpu` needs two processes, so the one-node job runs two and the others one on each of two nodes."""
    data = [("--config configs/pretrain/vit_b16_paper.yaml", f"--config {work}/tiny.yaml"),
            ("data.shards=/data/shards", f"data.shards={work}/shards")]
    if name == "one_node":
        return [("--gpus-per-node=8 --cpus-per-task=64", "--cpus-per-task=2"),
                ("--num_processes 8", "--num_processes 2"),
                *data, ("output_dir=runs/vit_b16", f"output_dir={work}/{name}_{run}")]
    per_node = ("--nproc_per_node 8", "--nproc_per_node 1") if name == "torchrun" else ("SLURM_NNODES * 8", "SLURM_NNODES * 1")
    return [("--nodes=4", "--nodes=2"),
            ("--gpus-per-node=8 --cpus-per-task=64", "--cpus-per-task=1"),
            per_node, *data, ("output_dir=/shared/runs/vit_b16", f"output_dir={work}/{name}_{run}")]


def write(readme: Path, work: Path) -> None:
    (work / "tiny.yaml").write_text(TINY_CONFIG)
    for name, script in documented_scripts(readme).items():
        for run in ("reference", "stopped"):
            text = script
            for old, new in host_rewrites(work, name, run):
                if text.count(old) != 1:
                    sys.exit(f"{readme}: the {name} script holds `{old}` {text.count(old)} times, not once")
                text = text.replace(old, new)
            (work / f"{name}_{run}.sbatch").write_text(text)


def same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    first, second = load_file(a), load_file(b)
    differ = sorted(k for k in first.keys() | second.keys()
                    if k not in first or k not in second or not first[k].equal(second[k]))
    if differ:
        sys.exit(f"{a} and {b} differ in {len(differ)} of {len(first)} tensors: {', '.join(differ[:5])}")
    print(f"{a} and {b}: the same {len(first)} tensors, bit for bit")


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"write": write, "same-weights": same_weights}[command](*map(Path, paths))
