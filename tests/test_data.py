import io
import itertools
import json
import random

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mpp.data.synthetic import synthetic_image
from mpp.config import DataConfig
from mpp.data.stream import DataError, EvalTransform, StreamState, TrainTransform, make_loader
from mpp.data.readers import expand_shards
from mpp.data.randaugment import OPERATIONS, RandAugment

NO_WORKERS = DataConfig(num_workers=0, shuffle_buffer=0)


def stream(urls, world, workers, rank, shuffle_buffer=0):
    loader = make_loader(urls, DataConfig(num_workers=workers, shuffle_buffer=shuffle_buffer), EvalTransform(8), 5,
                         rank=rank, world=world, one_pass=True)
    return [b.images for b in loader]


def sample_ids(batches):
    # Pixel content identifies the sample: use the flattened bytes of each image as its id.
    return [bytes(img.flatten().tolist()) for b in batches for img in b]


def test_each_sample_once_per_pass_across_ranks_and_workers(make_shards):
    urls = make_shards([7, 5, 6, 4, 7, 3, 5, 6])  # 43 samples, uneven shards
    everything = sample_ids(stream(urls, world=1, workers=0, rank=0))
    assert len(everything) == 43 and len(set(everything)) == 43
    seen = []
    for rank in range(2):
        seen += sample_ids(stream(urls, world=2, workers=2, rank=rank, shuffle_buffer=10))
    assert sorted(seen) == sorted(everything)


def test_labels_stream_with_images(make_shards):
    urls = make_shards([6], labels=True)
    batch = next(iter(make_loader(urls, NO_WORKERS, EvalTransform(8), 6, one_pass=True)))
    assert batch.images.shape == (6, 3, 8, 8) and batch.images.dtype == torch.uint8
    assert batch.labels.tolist() == [synthetic_image(i, 24)[1] for i in range(6)]
    unlabelled = make_shards([3], labels=False)
    assert next(iter(make_loader(unlabelled, NO_WORKERS, EvalTransform(8), 3, one_pass=True))).labels.tolist() == [-1] * 3


@pytest.mark.parametrize("resampled", [True, False])
def test_uneven_shards_never_run_dry(make_shards, resampled):
    """3 shards over 2 ranks of 2 workers: each rank keeps producing batches for as many steps as asked. The ranks'
    streams share nothing (each reads its own shards), so they are taken one after the other here; a stream that ran
    dry would end (StopIteration), not hang. Two processes end to end: test_distributed.py's uneven-shard runs."""
    urls = make_shards([9, 2, 5])
    for rank in range(2):
        loader = make_loader(urls, DataConfig(num_workers=2, resampled=resampled, shuffle_buffer=0), TrainTransform(8), 4,
                             rank=rank, world=2)
        batches = iter(loader)
        assert len(list(itertools.islice(batches, 30))) == 30, f"rank {rank} ran dry"
        del batches  # its workers stop here


@pytest.mark.parametrize("resampled", [True, False])
def test_stream_restarts_exactly_where_it_stopped(make_shards, resampled):
    urls = make_shards([9, 8, 7, 10])
    data = DataConfig(num_workers=2, resampled=resampled, shuffle_buffer=6)
    full = [b.images for b in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3), 15)]
    state = StreamState()
    for batch in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3), 7):
        state.advance(batch)
    restored = StreamState()
    restored.load_state_dict(state.state_dict())
    rest = [b.images for b in itertools.islice(make_loader(urls, data, TrainTransform(8), 4, seed=3, state=restored), 8)]
    assert all(torch.equal(a, b) for a, b in zip(full[7:], rest))


def test_a_stream_begun_afresh_at_a_step_is_another_draw_and_restarts_exactly(make_shards):
    # A resume on another process count begins every rank's stream at the resumed step (StreamState.drawn_from): not
    # the run's own draw, and a checkpoint of it (its state through JSON, as a rank writes it) restarts it exactly.
    urls = make_shards([9, 8])
    data = DataConfig(num_workers=0, shuffle_buffer=6)
    loader = lambda state: make_loader(urls, data, TrainTransform(8), 4, seed=3, state=state)
    own = [b.images for b in itertools.islice(loader(StreamState()), 6)]
    afresh = [b.images for b in itertools.islice(loader(StreamState(drawn_from=5)), 6)]
    assert not torch.equal(torch.stack(own), torch.stack(afresh))
    state = StreamState(drawn_from=5)
    for batch in itertools.islice(loader(StreamState(drawn_from=5)), 3):
        state.advance(batch)
    restored = StreamState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert all(torch.equal(a, b.images) for a, b in zip(afresh[3:], itertools.islice(loader(restored), 3), strict=True))


def test_train_transform_is_random_but_seeded(make_shards):
    urls = make_shards([8])
    a = next(iter(make_loader(urls, NO_WORKERS, TrainTransform(16), 8, seed=1))).images
    b = next(iter(make_loader(urls, NO_WORKERS, TrainTransform(16), 8, seed=1))).images
    c = next(iter(make_loader(urls, NO_WORKERS, TrainTransform(16), 8, seed=2))).images
    assert torch.equal(a, b) and not torch.equal(a, c)


def textured(size=32, seed=0):
    """A (3, size, size) uint8 image with edges, gradients and colour, its values away from 0 and 255."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    channels = [40 + (x * 5) % 160, 60 + (y * 3) % 130, 50 + ((x // 4 + y // 4) % 2) * 120]
    noise = rng.integers(0, 20, (3, size, size))
    return torch.from_numpy((np.stack(channels) + noise).astype(np.uint8))


def test_randaugment_keeps_uint8_crops_of_their_size_and_is_fixed_by_the_rng():
    image = textured(24)
    augment = RandAugment(ops=2, magnitude=9, magnitude_std=0.5)
    outputs = [augment(image, random.Random(seed)) for seed in (0, 0, 1)]
    assert all(out.dtype == torch.uint8 and out.shape == (3, 24, 24) for out in outputs)
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])
    assert torch.equal(image, textured(24))  # the input is left as it was
    # In the training transform, after the crop and flip, from the stream's seeded rng.
    transform = TrainTransform(16, randaugment=augment)
    img = Image.fromarray(textured(40).permute(1, 2, 0).numpy())
    a, b = transform(img, random.Random(3)), transform(img, random.Random(3))
    assert torch.equal(a, b) and a.shape == (3, 16, 16) and a.dtype == torch.uint8
    assert not torch.equal(a, TrainTransform(16)(img, random.Random(3)))


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_each_randaugment_operation_changes_an_image_and_a_two_way_one_is_the_identity_at_0(name):
    augment = RandAugment()
    img = Image.fromarray(textured().permute(1, 2, 0).numpy())
    before = np.asarray(img)
    changed = [np.asarray(augment.apply(img, name, 9, sign)) for sign in (1, -1)]
    assert all(out.shape == before.shape and out.dtype == np.uint8 for out in changed)
    assert all(not np.array_equal(out, before) for out in changed), f"{name} at magnitude 9 left the image as it was"
    if OPERATIONS[name][1]:  # signed: the two directions differ
        assert not np.array_equal(*changed)
        assert np.abs(np.asarray(augment.apply(img, name, 0)).astype(int) - before).max() <= 1  # identity at 0


def test_shard_specs(make_shards, tmp_path):
    urls = make_shards([2, 2, 2])
    directory = str(tmp_path / "shards")
    assert expand_shards(directory) == urls
    assert expand_shards(f"{directory}/shard-{{000000..000002}}.tar") == urls
    assert expand_shards("pipe:cat a.tar::https://host/b-{0..1}.tar") == ["pipe:cat a.tar", "https://host/b-0.tar", "https://host/b-1.tar"]
    with pytest.raises(DataError, match="shard-000003.tar does not exist"):
        expand_shards(f"{directory}/shard-{{000000..000003}}.tar")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .tar, .tar.gz, .tgz files"):
        expand_shards(str(tmp_path / "empty"))
    # a directory inside a '::' list, as docs/data.md promises (it was refused as "a directory, not a tar file")
    assert expand_shards(f"{directory}::pipe:cat a.tar::{directory}/shard-000000.tar") == [*urls, "pipe:cat a.tar", urls[0]]


def test_train_epochs_count_only_the_shards_data_shards_names(tmp_path):
    """summary.json counts its whole set: a brace pattern over half of it was taken for all of it (round 4, row 14:
    train.epochs=1 over 2 of 4 shards trained 2 epochs)."""
    from mpp.config import load_config
    from mpp.data.prepare_inputs import synthetic_samples
    from mpp.data.shardwriter import write_shards
    from pipelines.run.loaders import training_samples

    a, b = tmp_path / "a", tmp_path / "b"
    write_shards(synthetic_samples(70, 8), a, samples_per_shard=20)  # 20, 20, 20, 10
    write_shards(synthetic_samples(30, 8), b, samples_per_shard=20)
    count = lambda spec: training_samples(load_config(None, [f"data.shards={spec}", "train.epochs=1"]))
    assert count(a) == count(f"{a}/shard-00000{{0..3}}.tar") == 70  # the whole set: summary.json's count
    assert count(f"{a}/shard-00000{{2..3}}.tar") == 30  # part of it: counted from the tar headers
    assert count(f"{a}::{b}") == 100 and count(f"{a}/shard-000003.tar::{b}") == 40
    assert count(f"{b}::{b}/shard-000000.tar") == 50  # read twice, counted twice


def test_pipe_urls_stream(make_shards):
    urls = make_shards([4])
    batch = next(iter(make_loader([f"pipe:cat {urls[0]}"], NO_WORKERS, EvalTransform(8), 4, one_pass=True)))
    assert batch.images.shape[0] == 4


# ---------------------------------------------------------------- image modes and orientation

def one_image_batch(directory, name, image_bytes, ext, size=8):
    """The stream's (3, size, size) uint8 image of one sample written as `name.ext`."""
    directory.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(directory / "s.tar")) as sink:
        sink.write({"__key__": name, ext: image_bytes})
    batch = next(iter(make_loader([str(directory / "s.tar")], NO_WORKERS, EvalTransform(size), 1, one_pass=True,
                                  labels=False)))
    return batch.images[0]


def test_16_bit_greys_are_scaled_not_clipped(tmp_path):
    for level in (0, 16384, 32768, 65535):
        image = Image.fromarray(np.full((6, 6), level, np.uint16))  # mode I;16: a 16-bit greyscale PNG
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        assert Image.open(io.BytesIO(buffer.getvalue())).mode in ("I;16", "I")
        pixels = one_image_batch(tmp_path / str(level), "k", buffer.getvalue(), "png")
        assert pixels.unique().tolist() == [round(level * 255 / 65535)]


def exif_rotated_jpeg(orientation):
    """A JPEG stored 20 wide x 10 high, left half black and right half white, tagged with `orientation`."""
    pixels = np.zeros((10, 20, 3), np.uint8)
    pixels[:, 10:] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95, exif=exif)
    return buffer.getvalue()


@pytest.mark.parametrize("orientation, white_at", [(6, "bottom"), (8, "top")])
def test_exif_orientation_is_applied(tmp_path, orientation, white_at):
    """Orientation 6 is shown turned 90 degrees clockwise, 8 counter-clockwise: the white right half ends up below / above."""
    pixels = one_image_batch(tmp_path, "k", exif_rotated_jpeg(orientation), "jpg", size=10).float().mean(0)  # (10, 10)
    top, bottom = pixels[:3].mean().item(), pixels[-3:].mean().item()
    assert (bottom > 200 and top < 50) if white_at == "bottom" else (top > 200 and bottom < 50), (top, bottom)
