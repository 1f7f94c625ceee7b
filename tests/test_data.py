import itertools
import multiprocessing

import pytest
import torch

from mpp.synthetic import synthetic_image
from mpp.data import DataError, EvalTransform, ShardStream, StreamState, TrainTransform, expand_shards, make_loader


def stream(urls, world, workers, rank, **kw):
    loader = make_loader(urls, EvalTransform(8), 5, num_workers=workers, rank=rank, world=world,
                         resampled=False, loop=False, **kw)
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
    batch = next(iter(make_loader(urls, EvalTransform(8), 6, num_workers=0, resampled=False, loop=False)))
    assert batch.images.shape == (6, 3, 8, 8) and batch.images.dtype == torch.uint8
    assert batch.labels.tolist() == [synthetic_image(i, 24)[1] for i in range(6)]
    unlabelled = make_shards([3], labels=False)
    assert next(iter(make_loader(unlabelled, EvalTransform(8), 3, num_workers=0, resampled=False, loop=False))).labels.tolist() == [-1] * 3


def _take(urls, rank, world, resampled, n, queue):
    loader = make_loader(urls, TrainTransform(8), 4, num_workers=2, rank=rank, world=world, resampled=resampled)
    queue.put(sum(1 for _ in itertools.islice(loader, n)))


@pytest.mark.parametrize("resampled", [True, False])
def test_uneven_shards_never_run_dry(make_shards, resampled):
    """3 shards over 2 ranks of 2 workers: each rank keeps producing batches for as many steps as asked."""
    urls = make_shards([9, 2, 5])
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_take, args=(urls, rank, 2, resampled, 30, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank's stream stopped producing batches"
    assert [queue.get(timeout=1) for _ in procs] == [30, 30]


@pytest.mark.parametrize("resampled", [True, False])
def test_stream_restarts_exactly_where_it_stopped(make_shards, resampled):
    urls = make_shards([9, 8, 7, 10])
    kw = dict(num_workers=2, seed=3, resampled=resampled, shuffle_buffer=6)
    full = [b.images for b in itertools.islice(make_loader(urls, TrainTransform(8), 4, **kw), 15)]
    state = StreamState()
    for batch in itertools.islice(make_loader(urls, TrainTransform(8), 4, **kw), 7):
        state.advance(batch)
    restored = StreamState()
    restored.load_state_dict(state.state_dict())
    rest = [b.images for b in itertools.islice(make_loader(urls, TrainTransform(8), 4, state=restored, **kw), 8)]
    assert all(torch.equal(a, b) for a, b in zip(full[7:], rest))


def test_train_transform_is_random_but_seeded(make_shards):
    urls = make_shards([8])
    a = next(iter(make_loader(urls, TrainTransform(16), 8, num_workers=0, seed=1))).images
    b = next(iter(make_loader(urls, TrainTransform(16), 8, num_workers=0, seed=1))).images
    c = next(iter(make_loader(urls, TrainTransform(16), 8, num_workers=0, seed=2))).images
    assert torch.equal(a, b) and not torch.equal(a, c)


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


def test_pipe_urls_stream(make_shards):
    urls = make_shards([4])
    batch = next(iter(make_loader([f"pipe:cat {urls[0]}"], EvalTransform(8), 4, num_workers=0, resampled=False, loop=False)))
    assert batch.images.shape[0] == 4
