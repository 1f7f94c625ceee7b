"""Images of unusual kinds (transparent, floating point) come out the same in every path that turns them into pixels:
prepare's stored shards, the training and evaluation stream, predict."""

import io
import random

import numpy as np
import pytest
from PIL import Image

from mpp.data.images import BACKGROUND
from mpp.data.stream import EvalTransform, open_image
from pipelines.stages import prepare
from pipelines.stages.predict import read_batches

from test_shards import read_shards

RED = (200, 30, 30)


def half_transparent(mode: str) -> Image.Image:
    """32x32, the left half opaque red, the right half fully transparent over black pixels, in `mode`."""
    rgba = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    rgba.paste(Image.new("RGBA", (16, 32), (*RED, 255)), (0, 0))
    if mode == "RGBA":
        return rgba
    if mode == "LA":
        return rgba.convert("LA")
    palette = Image.new("P", (32, 32), 0)  # index 0 black and transparent, index 1 red
    palette.putpalette([0, 0, 0, *RED])
    palette.paste(1, (0, 0, 16, 32))
    palette.info["transparency"] = 0
    return palette


def pixels_of(data: bytes) -> np.ndarray:
    """(3, 16, 16) uint8 of an encoded image, as the evaluation stream prepares it."""
    return EvalTransform(16)(open_image({"png": data}), random.Random(0)).numpy()


def right_half(pixels: np.ndarray) -> np.ndarray:
    return pixels[:, 2:-2, 11:-1].reshape(3, -1)  # away from the edge the resize blurs


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_come_out_grey_in_every_path(tmp_path, mode):
    image = half_transparent(mode)
    folder = tmp_path / "images"
    folder.mkdir()
    image.save(folder / "logo.png")  # kept byte for byte by prepare: the stream composites it
    image.save(folder / "logo.gif" if mode == "P" else folder / "logo.webp")  # re-encoded or kept
    (image if mode != "P" else image.convert("RGBA")).save(folder / "logo.tiff")  # re-encoded as JPEG by prepare
    prepare.run(str(folder), str(tmp_path / "shards"), workers=1)
    prepare.run(str(folder), str(tmp_path / "small"), short_side=20, workers=1)  # downsized as JPEG
    stored = [next(v for k, v in sample.items() if k in ("png", "jpg", "webp"))
              for out in ("shards", "small") for sample in read_shards(tmp_path / out).values()]
    assert len(stored) == 6
    unreadable = {}
    predicted = [images[0].numpy() for _, images in read_batches([folder / "logo.png"], 16, 1, unreadable)]
    for pixels in [pixels_of(data) for data in stored] + predicted:
        assert np.abs(right_half(pixels).astype(int) - np.array(BACKGROUND)[:, None]).max() <= 3
        left = pixels[:, 2:-2, 1:5].reshape(3, -1).mean(axis=1)
        expected = RED if mode != "LA" else (round(0.299 * RED[0] + 0.587 * RED[1] + 0.114 * RED[2]),) * 3
        assert np.abs(left - np.array(expected)).max() <= 6


def test_a_floating_point_tiff_keeps_its_greys(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    ramp = np.tile(np.linspace(0.0, 1.0, 32, dtype=np.float32), (32, 1))  # 0..1, as scientific TIFFs store it
    Image.fromarray(ramp, "F").save(folder / "float.tif")
    Image.fromarray(np.full((32, 32), 0.5, np.float32), "F").save(folder / "grey.tif")
    prepare.run(str(folder), str(tmp_path / "shards"), workers=1)
    stored = {key: np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("L"), dtype=int)
              for key, sample in read_shards(tmp_path / "shards").items()}
    assert np.abs(stored["grey"] - 128).max() <= 2  # was 0 everywhere: PIL clips 0..1 to black
    assert abs(stored["float"][:, 0].mean() - 0) <= 3 and abs(stored["float"][:, -1].mean() - 255) <= 3
    assert np.abs(pixels_of((folder / "grey.tif").read_bytes()).astype(int) - 128).max() <= 1  # the stream too
