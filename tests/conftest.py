import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset as wds
from accelerate.state import AcceleratorState, GradientState

from mpp.synthetic import synthetic_image

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))  # launch.py and pipelines/ for the stage tests

# A small, fast run: overrides that every stage test starts from.
TINY = ["model.name=vit_ti", "model.width=64", "model.depth=2", "model.heads=2", "model.image_size=16",
        "model.patch_size=4", "data.num_workers=0", "data.shuffle_buffer=50", "log.every=5", "log.images_every=50"]


def reset_accelerator() -> None:
    """Forget this process's Accelerate state, so the next Accelerator starts as in a new process.

    A private Accelerate API, for tests alone and kept here, in one place: the product runs stages one after another
    on the process's state (pipelines/compare.py says how).
    """
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerator():
    """Each test starts with no Accelerate state, whatever the test before it left."""
    yield
    reset_accelerator()


def write_test_shards(directory: Path, counts: list[int], size: int = 24, labels: bool = True) -> list[str]:
    """Shards of synthetic JPEGs; shard s holds counts[s] samples keyed f"{s:02d}-{i:04d}"."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, count in enumerate(counts):
        path = directory / f"shard-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(count):
                image, label = synthetic_image(s * 1000 + i, size)
                buf = io.BytesIO()
                image.save(buf, format="JPEG", quality=90)
                sample = {"__key__": f"{s:02d}-{i:04d}", "jpg": buf.getvalue()}
                if labels:
                    sample["cls"] = str(label).encode()
                sink.write(sample)
        paths.append(str(path))
    return paths


@pytest.fixture
def make_shards(tmp_path):
    return lambda counts, **kw: write_test_shards(tmp_path / "shards", counts, **kw)


def read_only(directory):
    """chmod for a normal user; root ignores modes, so the immutable attribute there (skipped where it is refused)."""
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("running as root without the right to make a directory immutable: no read-only directory to test")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)
