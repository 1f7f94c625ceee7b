import io
import sys
from pathlib import Path

import pytest
import webdataset as wds

from mpp.synthetic import synthetic_image

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))  # launch.py and pipelines/ for the stage tests


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
