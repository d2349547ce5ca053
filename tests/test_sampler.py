"""Shuffling, sharding and resume: properties over many shapes (hypothesis), then the Loader itself."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gdsdata
from gdsdata.batch import PixelBatch, Staged
from gdsdata.sampler import ShardSpec, batches_per_epoch, consumed_after, epoch_order, rank_batches

shapes = st.fixed_dictionaries({
    "size": st.integers(1, 300), "world_size": st.integers(1, 8), "batch_size": st.integers(1, 32),
    "drop_last": st.booleans(), "shuffle": st.sampled_from(["full", "block", None]),
    "seed": st.integers(0, 2**40), "block_size": st.integers(1, 20), "window": st.integers(1, 6),
})


def all_ranks(spec, epoch=0, consumed=None):
    return [rank_batches(ShardSpec(**{**spec.__dict__, "rank": r}), epoch, consumed) for r in range(spec.world_size)]


@settings(max_examples=300, deadline=None)
@given(shape=shapes, epoch=st.integers(0, 5))
def test_every_sample_once_and_equal_batches(shape, epoch):
    spec = ShardSpec(**shape)
    ranks = all_ranks(spec, epoch)
    counts = {len(b) for b in ranks}
    assert len(counts) == 1 and counts.pop() == batches_per_epoch(spec)  # no rank waits on another
    seen = np.concatenate([np.concatenate(b) if b else np.zeros(0, np.int64) for b in ranks])
    hits = np.bincount(seen, minlength=spec.size)
    if spec.drop_last:
        assert hits.max(initial=0) <= 1
        assert spec.size - hits.sum() < spec.world_size * spec.batch_size
        assert all(len(x) == spec.batch_size for b in ranks for x in b)
    else:
        assert hits.min() >= 1  # every sample at least once ...
        assert hits.sum() - spec.size < spec.world_size  # ... and only the padding twice
    order = epoch_order(spec, epoch)
    assert sorted(order.tolist()) == list(range(spec.size))


class CountingDataset:
    """The slice of the GDSDataset protocol the Loader uses, in memory: sample i is one pixel of
    value i, so each yielded image names its sample. Lets hypothesis drive the real Loader (its
    prefetch threads and state) over thousands of shapes quickly."""

    def __init__(self, size):
        self.size = size
        self.device = torch.device("cpu")
        self.labels = np.arange(size, dtype=np.int64) % 7
        self.fingerprint = f"counting-{size}"

    def __len__(self):
        return self.size

    def read_staged(self, indices):
        return Staged(list(indices), None, None, None, {})

    def release_staged(self, staged):
        pass

    def decode_staged(self, staged, stream=None):
        n = len(staged.indices)
        values = torch.tensor([[i % 256, i // 256, 0] for i in staged.indices], dtype=torch.uint8).reshape(-1)
        ones = np.ones(n, np.int64)
        return PixelBatch(values, np.arange(n) * 3, ones, ones, ones * 3, {}, owned=True), staged.indices


def sample_ids(images):
    return [int(img[0, 0, 0]) + 256 * int(img[1, 0, 0]) for img in images]


@settings(max_examples=150, deadline=None)
@given(shape=shapes, data=st.data())
def test_loader_resume_equals_an_uninterrupted_run(shape, data):
    ds = CountingDataset(shape["size"])
    options = dict(batch_size=shape["batch_size"], shuffle=shape["shuffle"], seed=shape["seed"],
                   drop_last=shape["drop_last"], block_size=shape["block_size"], window=shape["window"],
                   world_size=shape["world_size"])
    rank = data.draw(st.integers(0, shape["world_size"] - 1))
    reference = [sample_ids(images) for images, _ in gdsdata.Loader(ds, rank=rank, **options)]
    stop = data.draw(st.integers(0, len(reference)))
    first = gdsdata.Loader(ds, rank=rank, **options)
    batches = iter(first)
    head = [sample_ids(next(batches)[0]) for _ in range(stop)]  # a checkpoint after `stop` steps
    state = first.state_dict()
    first.close()
    second = gdsdata.Loader(ds, rank=rank, **options)
    second.load_state_dict(state)
    tail = [sample_ids(images) for images, _ in second]
    assert head + tail == reference


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_resume_with_another_world_size_sees_the_rest_once(shape, data):
    spec = ShardSpec(**{**shape, "drop_last": False})
    full = all_ranks(spec, 2)
    done = data.draw(st.integers(0, len(full[0])))
    before = [x for b in full for x in b[:done]]
    delivered = consumed_after(spec, 2, None, done)
    new = ShardSpec(**{**spec.__dict__, "world_size": data.draw(st.integers(1, 8)),
                       "batch_size": data.draw(st.integers(1, 32))})
    after = [x for b in all_ranks(new, 2, delivered) for x in b]
    seen = np.concatenate(before + after) if before + after else np.zeros(0, np.int64)
    assert set(seen.tolist()) == set(range(spec.size))
    rest = np.concatenate(after) if after else np.zeros(0, np.int64)
    assert not set(rest.tolist()) & set(np.flatnonzero(delivered).tolist())
    assert len(rest) - len(set(rest.tolist())) < new.world_size  # only the new padding repeats


def test_a_state_taken_at_an_epoch_s_end_resumes_at_the_next_epoch_in_any_topology():
    """The last batch of an epoch delivered (the iterator still open, as a checkpoint inside the
    loop takes it): resumed with another world size or batch size, the epoch is over, and the
    samples its drop_last left out are not delivered as an extra batch."""
    ds = CountingDataset(120)
    first = gdsdata.Loader(ds, 16, world_size=4, rank=0, drop_last=True, seed=1)
    batches = iter(first)
    assert len([next(batches) for _ in range(len(first))]) == 1  # (30 a rank: 1 batch, 14 samples dropped)
    state = first.state_dict()
    first.close()
    for world, batch in ((1, 16), (2, 8), (4, 16)):
        second = gdsdata.Loader(ds, batch, world_size=world, rank=0, drop_last=True, seed=1)
        second.load_state_dict(state)
        assert second.batches_left() == 0 and list(second) == [] and second.epoch == 1, (world, batch)
        assert len(list(second)) == len(second)  # the next epoch whole
        second.close()


def test_block_shuffle_keeps_runs_and_mixes_classes():
    spec = ShardSpec(10_000, shuffle="block", block_size=64, window=16, seed=3)
    order = epoch_order(spec, 0)
    assert sorted(order.tolist()) == list(range(10_000))
    # classes laid out in runs of 100 consecutive samples, as a packed ImageFolder is
    labels = np.arange(10_000) // 100
    batch_classes = [len(set(labels[order[i:i + 256]].tolist())) for i in range(0, 10_000 - 255, 256)]
    full = epoch_order(ShardSpec(10_000, shuffle="full", seed=3), 0)
    full_classes = [len(set(labels[full[i:i + 256]].tolist())) for i in range(0, 10_000 - 255, 256)]
    assert np.mean(batch_classes) >= 10  # a batch draws from many places, not one class run
    assert np.mean(batch_classes) < np.mean(full_classes)  # but less than a full shuffle


def test_loader_state_dict_resumes_exactly(photos_dataset):
    ds = gdsdata.GDSDataset(photos_dataset[2])
    make = lambda: gdsdata.Loader(ds, 7, seed=5, transform=gdsdata.CenterCrop(32, 36, dtype="uint8"))  # noqa: E731
    reference = [(imgs.clone(), labels.clone()) for imgs, labels in make()]
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    first.close()
    second = make()
    second.load_state_dict(state)
    tail = list(second)
    assert len(head) + len(tail) == len(reference)
    for (a, la), (b, lb) in zip(head + tail, reference):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert second.epoch == 1 and len(second) == len(reference)


def test_loader_refuses_a_state_from_another_dataset(photos_dataset):
    ds = gdsdata.GDSDataset(photos_dataset[2])
    state = gdsdata.Loader(ds, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        gdsdata.Loader(ds, 4, seed=2).load_state_dict(state)


def test_pipeline_runs_on_across_epochs_like_fresh_loaders(photos_dataset):
    import gc

    from conftest import loader_threads

    ds = gdsdata.GDSDataset(photos_dataset[2])
    transform = gdsdata.RandomResizedCrop(24, dtype="uint8", seed=9)
    loader = gdsdata.Loader(ds, 16, seed=4, transform=transform)
    carried = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        carried.append([(images.clone(), labels.clone()) for images, labels in loader])
        assert loader._carry is not None  # already reading the next epoch
    for epoch, batches in enumerate(carried):
        fresh = gdsdata.Loader(ds, 16, seed=4, transform=transform)
        fresh.set_epoch(epoch)
        for (a, la), (b, lb) in zip(batches, fresh):
            assert torch.equal(a, b) and torch.equal(la, lb)
        fresh.close()
    loader.set_epoch(7)  # another epoch than the one prefetched: restarts cleanly
    fresh = gdsdata.Loader(ds, 16, seed=4, transform=transform)
    fresh.set_epoch(7)
    assert [labels.tolist() for _, labels in loader] == [labels.tolist() for _, labels in fresh]
    del loader, fresh
    gc.collect()
    assert not loader_threads()
