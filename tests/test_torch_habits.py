"""The habits torch users bring (DataLoader, StatefulDataLoader, Subset, torchvision transforms) work
on gdsdata's Loader, or fail with one line that names the gdsdata way."""

import numpy as np
import pytest
import torch

import gdsdata


@pytest.fixture
def ds(photos_dataset):
    dataset = gdsdata.GDSDataset(photos_dataset[2])
    yield dataset
    dataset.close()


def labels_of(loader):
    return [labels.tolist() for _, labels in loader]


def fails_on(n):
    """A batch_transform that raises ValueError("a bad batch") on its ``n``-th call, else passes the batch."""
    calls = []

    def transform(images, labels):
        calls.append(1)
        if len(calls) == n:
            raise ValueError("a bad batch")
        return images, labels

    return transform


def test_shuffle_takes_booleans(ds):
    on = labels_of(gdsdata.Loader(ds, 8, shuffle=True, seed=3))
    assert on == labels_of(gdsdata.Loader(ds, 8, True, seed=3))  # third positional, as DataLoader's
    assert on == labels_of(gdsdata.Loader(ds, 8, shuffle="full", seed=3))
    off = labels_of(gdsdata.Loader(ds, 8, shuffle=False))
    assert off == labels_of(gdsdata.Loader(ds, 8, shuffle=None))
    assert sum(off, []) == ds.targets
    with pytest.raises(ValueError, match="shuffle must be True, False"):
        gdsdata.Loader(ds, 8, shuffle="yes")


def test_a_loader_is_a_context_manager_closing_its_threads(ds):
    """``with Loader(...) as loader:`` as with the dataset: the threads reading ahead stop at the
    block's end, the dataset stays open."""
    import time

    from conftest import loader_threads

    with gdsdata.Loader(ds, 8, shuffle=False) as loader:
        batches = iter(loader)
        next(batches)
        assert loader_threads()
    deadline = time.monotonic() + 10
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loader_threads() and ds[0][1] == ds.targets[0]


def test_len_is_batches_per_epoch_whatever_was_iterated(ds):
    loader = gdsdata.Loader(ds, 8)  # 60 samples
    assert len(loader) == 8
    it = iter(loader)
    assert len(it) == 8  # (as a DataLoader's iterator: tqdm(iter(loader)) and trainers take it)
    for _ in range(3):
        next(it)
    assert len(loader) == 8 and loader.batches_left() == 5
    loader.close()


def test_a_loader_of_no_batch_says_so_once_made(ds, caplog):
    """drop_last with fewer samples than a batch: an epoch of nothing, as torch's DataLoader gives, but
    said (a loop over it would silently do nothing)."""
    with caplog.at_level("WARNING", logger="gdsdata"):
        with gdsdata.Loader(ds, 64, drop_last=True) as loader:  # 60 samples
            assert len(loader) == 0 and labels_of(loader) == []
    said = [r.getMessage() for r in caplog.records if "yields no batch" in r.getMessage()]
    assert said == ["this Loader yields no batch an epoch: 60 sample(s), world_size 1, batch_size 64, drop_last=True"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdsdata"):
        with gdsdata.Loader(ds, 60, drop_last=True) as loader:
            assert len(loader) == 1
    assert not [r for r in caplog.records if "yields no batch" in r.getMessage()]


def test_a_pass_ended_by_an_error_counts_as_no_pass_while_its_iterator_lives_on(ds):
    """The iterator of a pass a batch's error ended lives on in the traceback (and the loop's frame)
    until collected: the Loader no longer counts that dead pass's batches, as the next pass reads
    the whole epoch; its state keeps where it stood."""
    loader = gdsdata.Loader(ds, 8, batch_transform=fails_on(3))  # 60 samples: 8 batches
    batches = iter(loader)
    with pytest.raises(ValueError, match="a bad batch"):
        for _ in batches:
            pass
    assert loader.batches_left() == 8 and len(loader.indices()) == 8
    assert loader.state_dict()["batches_done"] == 2
    assert len(list(batches)) == 5  # its next() goes on past the batch that failed, as a DataLoader's does
    assert (loader.epoch, loader.state_dict()["batches_done"]) == (1, 0)
    assert len(list(loader)) == 8
    loader.close()


@pytest.mark.parametrize("bad", [1, 7])
def test_the_next_batch_after_one_that_raised_goes_on_with_the_epoch(ds, bad):
    """A loop that catches a batch's error and goes on gets the rest of the epoch, as from torch's
    DataLoader (it ended quietly: one batch of eight, then StopIteration, the epoch not over)."""
    expected = labels_of(gdsdata.Loader(ds, 8, shuffle=True, seed=4))
    loader = gdsdata.Loader(ds, 8, shuffle=True, seed=4, batch_transform=fails_on(bad + 1))
    got, errors, batches = [], 0, iter(loader)
    while True:
        try:
            _, labels = next(batches)
        except StopIteration:
            break
        except ValueError:
            errors += 1
            continue
        got.append(labels.tolist())
    assert errors == 1 and got == expected[:bad] + expected[bad + 1:]
    assert loader.epoch == 1 and loader.batches_left() == 8
    again = gdsdata.Loader(ds, 8, shuffle=True, seed=4)
    again.set_epoch(1)
    assert labels_of(loader) == labels_of(again)
    loader.close()


def test_going_on_after_an_error_keeps_its_epoch_and_its_count(ds, monkeypatch):
    """The iterator goes on in its own epoch: a set_epoch between the error and the next next() ends
    it (it went on in the new epoch, its first batch lost); a pass for the rest that cannot be made
    ends it without counting batches never read; the stats go on counting the epoch's batches."""
    import gdsdata.loader as L

    loader = gdsdata.Loader(ds, 8, shuffle=True, seed=4, batch_transform=fails_on(4))
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(ValueError):
        next(it)
    loader.set_epoch(5)
    assert list(it) == [] and (loader.epoch, loader.state_dict()["batches_done"]) == (5, 0)
    expected = gdsdata.Loader(ds, 8, shuffle=True, seed=4)
    expected.set_epoch(5)
    assert labels_of(loader) == labels_of(expected)  # epoch 5 whole
    assert loader.stats()["batches"] == 8

    loader = gdsdata.Loader(ds, 8, shuffle=False, batch_transform=fails_on(2))
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError):
        next(it)
    real = L._Prefetcher.__init__

    def cannot(self, *args, **kwargs):
        raise RuntimeError("no staging")

    monkeypatch.setattr(L._Prefetcher, "__init__", cannot)
    with pytest.raises(RuntimeError, match="no staging"):
        next(it)
    monkeypatch.setattr(L._Prefetcher, "__init__", real)
    assert list(it) == [] and loader.state_dict()["batches_done"] == 1  # nothing counted that was not read
    loader.close()
    loader = gdsdata.Loader(ds, 8, shuffle=False, batch_transform=fails_on(2))
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError):
        next(it)
    assert len(list(it)) == 6 and loader.stats()["batches"] == 7  # the stats of the whole epoch
    loader.close()


def test_an_ended_iterator_stays_ended_while_its_pass_reads_the_next_epoch(ds):
    """A Python iterator that has ended keeps raising StopIteration (as a DataLoader's does): an old
    ``iter(loader)`` never hands out the next epoch's batches, nor counts them against the epoch
    ``set_epoch`` named since (the state a checkpoint takes)."""
    loader = gdsdata.Loader(ds, 16, shuffle=True, seed=1)  # 60 samples: 4 batches
    first = iter(loader)
    assert len(list(first)) == 4
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(first)
    assert list(first) == []
    loader.set_epoch(5)
    with pytest.raises(StopIteration):
        next(first)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (5, 0)
    second = iter(loader)  # the next epoch, whole
    assert sorted(sum((labels.tolist() for _, labels in second), [])) == sorted(ds.targets)
    assert list(first) == [] and len(list(iter(loader))) == 4
    loader.close()


def test_peek_then_loop_gives_a_whole_epoch(ds):
    loader = gdsdata.Loader(ds, 8, seed=1, transform=gdsdata.CenterCrop(16))
    first_images, _ = next(iter(loader))
    batches = list(loader)
    assert len(batches) == len(loader) == 8
    assert torch.equal(batches[0][0], first_images)  # the loop started the epoch again
    assert loader.epoch == 1


def test_a_second_iter_inside_a_loop_ends_the_first_loudly(ds):
    """One pass at a time per Loader: a peek inside the loop replaces the loop's pass, whose next
    next() raises instead of ending the epoch quietly after 3 of 8 batches; the state is the new pass's."""
    loader = gdsdata.Loader(ds, 8, seed=1)
    reference = labels_of(gdsdata.Loader(ds, 8, seed=1))
    seen = []
    with pytest.raises(RuntimeError, match="a new iter\\(loader\\) replaced it: a Loader runs one pass at a time"):
        for k, (_, labels) in enumerate(loader):
            seen.append(labels.tolist())
            if k == 2:
                peeked = next(iter(loader))[1].tolist()
    assert seen == reference[:3] and peeked == reference[0]
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, 1)  # where the pass that replaced it stands
    assert labels_of(loader) == reference and loader.epoch == 1  # the next loop is a whole epoch
    it = iter(loader)
    next(it)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match="load_state_dict\\(\\) ended it"):
        next(it)
    assert labels_of(loader) == reference[1:]
    loader.close()


def test_close_during_a_loop_ends_it_loudly(ds):
    """loader.close() (from the loop, or another thread) under a running loop: its next next() raises
    rather than end the epoch after 3 of 8 batches as if it were whole; a loop that has ended stays
    ended, and the Loader runs the next loop from the epoch's start."""
    loader = gdsdata.Loader(ds, 8, seed=1)
    seen = 0
    with pytest.raises(RuntimeError, match=r"loader.close\(\) stopped it before the epoch's end"):
        for _ in loader:
            seen += 1
            if seen == 3:
                loader.close()
    assert seen == 3 and loader.epoch == 0
    ended = iter(loader)
    assert len(list(ended)) == 8 and loader.epoch == 1
    loader.close()
    with pytest.raises(StopIteration):  # an iterator that ended stays ended
        next(ended)
    with gdsdata.Loader(ds, 8, seed=1) as inside:
        assert len(list(inside)) == 8  # closed by the with block after the loop: nothing raised


def test_close_from_another_thread_while_the_loop_waits_for_a_batch(photos_dataset):
    """The loop waiting on a batch (a slow decode) when another thread closes the Loader (a watchdog, a
    signal handler's thread): RuntimeError from that next(), not an error from the closed pass's parts."""
    import threading

    from conftest import slow_decode

    ds = gdsdata.GDSDataset(photos_dataset[2])
    slow_decode(ds, 0.5)
    loader = gdsdata.Loader(ds, 8, prefetch=1)
    it = iter(loader)
    next(it)
    closer = threading.Timer(0.2, loader.close)  # while next() waits for the next batch's decode
    closer.start()
    with pytest.raises(RuntimeError, match=r"loader.close\(\) stopped it before the epoch's end"):
        for _ in it:  # (each next() waits about half a second: the close comes during one)
            pass
    closer.join()
    ds.close()


def test_torch_dataloader_attributes_say_what_the_loader_does_instead(ds):
    """``loader.sampler.set_epoch(epoch)``, the DistributedSampler habit: an AttributeError (hasattr()
    stays False) that names ``loader.set_epoch``."""
    loader = gdsdata.Loader(ds, 8)
    with pytest.raises(AttributeError, match=r"gdsdata.Loader has no sampler \(a torch DataLoader attribute\): "
                                             r"loader.set_epoch\(epoch\) does what DistributedSampler"):
        loader.sampler.set_epoch(1)
    with pytest.raises(AttributeError, match="no num_workers .*its own I/O, decode and transform threads"):
        _ = loader.num_workers
    assert not hasattr(loader, "collate_fn") and not hasattr(loader, "nothing_of_the_kind")
    with pytest.raises(AttributeError, match="'Loader' object has no attribute 'nothing_of_the_kind'"):
        _ = loader.nothing_of_the_kind


def test_a_device_torch_does_not_know_gets_one_line(photos_dataset):
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda' \(or 'cuda:N', a torch.device\), got 'gpu'"):
        gdsdata.GDSDataset(photos_dataset[2], device="gpu")


def test_set_epoch_during_a_pass_takes_the_next_pass_as_distributed_sampler_does(ds):
    """The pass reads its epoch to the end, the state stays its own, and the next pass reads the
    epoch set (before: the loader's epoch changed under the running pass, and it then counted on
    from the new value)."""
    loader = gdsdata.Loader(ds, 8, seed=1)
    reference = labels_of(gdsdata.Loader(ds, 8, seed=1))
    later = gdsdata.Loader(ds, 8, seed=1)
    later.set_epoch(5)
    epoch5 = labels_of(later)
    seen = []
    for k, (_, labels) in enumerate(loader):
        seen.append(labels.tolist())
        if k == 1:
            loader.set_epoch(5)
            assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batches_done"] == 2
    assert seen == reference and loader.epoch == 5
    assert labels_of(loader) == epoch5 and loader.epoch == 6
    loader.set_epoch(6)  # between passes, as usual: at once
    assert loader.epoch == 6
    loader.close()


def test_a_loop_broken_off_starts_again_at_the_epoch_start(ds):
    loader = gdsdata.Loader(ds, 8, seed=1)
    reference = labels_of(gdsdata.Loader(ds, 8, seed=1))
    for k, _ in enumerate(loader):
        if k == 2:
            break
    assert labels_of(loader) == reference


def test_resume_continues_and_len_stays(ds):
    make = lambda: gdsdata.Loader(ds, 8, seed=4)  # noqa: E731
    reference = labels_of(make())
    first = make()
    it = iter(first)
    head = [next(it)[1].tolist() for _ in range(3)]
    state = first.state_dict()
    first.close()
    second = make()
    second.load_state_dict(state)
    second.set_epoch(0)  # the loop's usual set_epoch at the top keeps the resume of the same epoch
    assert len(second) == 8 and second.batches_left() == 5
    tail = labels_of(second)
    assert head + tail == reference
    assert len(labels_of(second)) == 8  # the next pass is a whole epoch again


def test_each_copy_of_a_sample_drawn_more_than_once_gets_its_own_crop(ds):
    """A draw with repeats (what WeightedRandomSampler gives, as ``indices=``): each copy of a sample
    is cropped and flipped apart, as torchvision would, while a sample drawn once keeps the crop it
    gets in any Loader; the same again on a resume."""
    crop = gdsdata.RandomResizedCrop(24, dtype="uint8", seed=7)
    drawn = [3] * 12 + [5, 9] + [3] * 2
    images = torch.cat([x for x, _ in gdsdata.Loader(ds, 8, shuffle=False, indices=drawn, transform=crop)])
    copies = images[[*range(12), 14, 15]]
    assert len({c.numpy().tobytes() for c in copies}) == 14
    once = torch.cat([x for x, _ in gdsdata.Loader(ds, 8, shuffle=False, indices=[3, 5, 9], transform=crop)])
    assert torch.equal(images[0], once[0]) and torch.equal(images[12:14], once[1:])
    whole = [x for x, _ in gdsdata.Loader(ds, 4, shuffle=True, seed=2, indices=drawn, transform=crop)]
    loader = gdsdata.Loader(ds, 4, shuffle=True, seed=2, indices=drawn, transform=crop)
    it = iter(loader)
    head = [next(it)[0] for _ in range(2)]
    state = loader.state_dict()
    loader.close()
    again = gdsdata.Loader(ds, 4, shuffle=True, seed=2, indices=drawn, transform=crop)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(head + [x for x, _ in again], whole))


@pytest.mark.parametrize("how", ["subset", "indices", "nested", "random_split"])
def test_subsets_read_only_their_samples(ds, how):
    picked = list(range(10, 50, 3))
    if how == "subset":
        loader = gdsdata.Loader(torch.utils.data.Subset(ds, picked), 4, shuffle=False)
    elif how == "indices":
        loader = gdsdata.Loader(ds, 4, shuffle=False, indices=picked)
    elif how == "nested":
        outer = torch.utils.data.Subset(ds, list(range(10, 60)))
        loader = gdsdata.Loader(torch.utils.data.Subset(outer, [p - 10 for p in picked]), 4, shuffle=False)
    else:
        train, val = torch.utils.data.random_split(ds, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
        picked = list(val.indices)
        loader = gdsdata.Loader(val, 4, shuffle=False)
    assert sum(labels_of(loader), []) == [ds.targets[i] for i in picked]
    assert len(loader) == -(-len(picked) // 4) and loader.batch_size == 4 and loader.drop_last is False
    if how != "indices":  # what it was given, as torch's DataLoader.dataset: len() counts the split's samples
        assert len(loader.dataset) == len(picked)
    planned = np.concatenate(loader.indices()).tolist()
    assert planned == picked


@pytest.mark.parametrize("reads", ["cached", "direct"])
def test_subsets_read_only_their_samples_in_every_epoch(photos_dataset, reads):
    """A subset's Loader keeps its pass running from one epoch into the next (set_epoch at the top of
    the loop): every epoch reads the subset's samples, those a fresh Loader reads for that epoch."""
    with gdsdata.settings.set(**({"io_engine": "direct"} if reads == "direct" else {})):
        ds = gdsdata.GDSDataset(photos_dataset[2])
    train, _ = torch.utils.data.random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(1))
    spec = dict(shuffle="block", block_size=4, window=3, transform=gdsdata.CenterCrop(32))
    carried = gdsdata.Loader(train, 5, **spec)
    for epoch in range(3):
        carried.set_epoch(epoch)
        fresh = gdsdata.Loader(train, 5, **spec)
        fresh.set_epoch(epoch)
        assert set(np.concatenate(fresh.indices()).tolist()) == set(train.indices)
        got, want = list(carried), list(fresh)
        assert len(got) == len(want) == 9
        for (a, la), (b, lb) in zip(got, want):
            assert torch.equal(a, b) and torch.equal(la, lb)
        fresh.close()
    carried.close()
    ds.close()


def test_train_and_val_splits_resume_and_shard_like_a_whole_dataset(ds):
    train, _ = torch.utils.data.random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(1))
    ranks = [gdsdata.Loader(train, 4, seed=2, rank=r, world_size=2) for r in range(2)]
    seen = [i for loader in ranks for batch in loader.indices() for i in batch.tolist()]
    assert set(seen) == set(train.indices) and len(seen) - len(set(seen)) < 2  # padding repeats one
    first = gdsdata.Loader(train, 4, seed=2)
    it = iter(first)
    head = [next(it)[1].tolist() for _ in range(2)]
    state = first.state_dict()
    first.close()
    again = gdsdata.Loader(train, 4, seed=2)
    again.load_state_dict(state)
    assert head + labels_of(again) == labels_of(gdsdata.Loader(train, 4, seed=2))
    other = gdsdata.Loader(torch.utils.data.Subset(ds, list(range(len(train)))), 4, seed=2)
    with pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)


def test_batch_transform_takes_torchvision_v2_and_mixup(ds):
    from torchvision.transforms import v2

    mixup = v2.MixUp(num_classes=3)
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32),
                            batch_transform=v2.Compose([v2.RandomGrayscale(p=1.0), mixup]))
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (8, 3) and torch.allclose(labels.sum(1), torch.ones(8))  # soft labels
    assert torch.allclose(images[:, 0], images[:, 1])  # gray
    loader.close()
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32),
                            batch_transform=lambda x, y: (x.flip(-1), y + 1))
    images, labels = next(iter(loader))
    assert labels.min() >= 1
    loader.close()


def test_batch_transform_draws_repeat_and_leave_the_loop_s_own(ds):
    """MixUp's draws are the batch's (seeded per batch, as DataLoader's seeded workers make them):
    the same run to run whatever the loop draws meanwhile, again on a resume, and the loop's own draws
    (dropout, noise) are those it makes without a batch_transform."""
    from torchvision.transforms import v2

    def run(batch_transform, steps=None, state=None):
        torch.manual_seed(0)
        loader = gdsdata.Loader(ds, 8, seed=5, transform=gdsdata.RandomResizedCrop(16), batch_transform=batch_transform)
        if state is not None:
            loader.load_state_dict(state)
        labels, own = [], []
        for k, (_, y) in enumerate(loader):
            labels.append(y)
            own.append(torch.rand(2))  # the loop's own draw
            if k + 1 == steps:
                state = loader.state_dict()
                break
        loader.close()
        return labels, torch.stack(own), state

    mixup = v2.MixUp(num_classes=3)
    labels, own, _ = run(mixup)
    assert len({round(float(y[(y > 0) & (y < 1)].max()), 6) for y in labels if ((y > 0) & (y < 1)).any()}) > 1
    again, _, _ = run(mixup)
    assert all(torch.equal(a, b) for a, b in zip(labels, again))
    _, plain, _ = run(None)
    assert torch.equal(own, plain)
    head, _, state = run(mixup, steps=3)
    tail, _, _ = run(mixup, state=state)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, labels)) and len(head + tail) == len(labels)
    with pytest.raises(TypeError, match="batch_transform must return"):
        next(iter(gdsdata.Loader(ds, 8, batch_transform=lambda x, y: x)))


def test_unusable_transforms_get_one_clear_error(ds):
    from torchvision.transforms import v2

    with pytest.raises(TypeError, match="batch_transform="):
        gdsdata.Loader(ds, 8, transform=v2.Compose([v2.RandomResizedCrop(224)]))
    with pytest.raises(TypeError, match=r"got torchvision\.transforms\.v2\.RandomResizedCrop; pass"):
        gdsdata.Loader(ds, 8, transform=v2.RandomResizedCrop(224))  # (not gdsdata's, whose name it shares)
    with pytest.raises(TypeError, match="batch_transform="):
        gdsdata.Loader(ds, 8, transform=lambda x: x)
    with pytest.raises(TypeError, match="callable"):
        gdsdata.Loader(ds, 8, batch_transform="flip")
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.CenterCrop(16), batch_transform=lambda x, y: x)
    with pytest.raises(TypeError, match="must return \\(images, labels\\)"):
        next(iter(loader))


@pytest.mark.parametrize("given", [dict(transform=lambda im: im[:, :10, :10]),
                                   dict(target_transform=lambda y: y + 100),
                                   dict(transforms=lambda im, y: (im, y + 100))])
def test_a_dataset_with_per_sample_transforms_is_refused(photos_dataset, given):
    """The Loader builds batches with its own transform= and batch_transform=: a dataset whose
    transform= or target_transform= ds[i] applies would otherwise give untransformed batches."""
    ds = gdsdata.GDSDataset(photos_dataset[2], **given)
    name = next(iter(given))
    for source in (ds, torch.utils.data.Subset(ds, range(10))):
        with pytest.raises(ValueError, match=f"opened with GDSDataset\\(..., {name}=\\).*the Loader applies its own "
                                             f"transform=.*torch's DataLoader"):
            gdsdata.Loader(source, 8, transform=gdsdata.CenterCrop(16))
    ds.close()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=1.5), TypeError, "batch_size must be an integer, got 1.5"),
    (dict(batch_size="8"), TypeError, "batch_size must be an integer"),
    (dict(batch_size=0), ValueError, "batch_size must be at least 1"),
    (dict(batch_size=4, seed=-1), ValueError, "seed must be at least 0"),
    (dict(batch_size=4, seed=0.5), TypeError, "seed must be an integer"),
    (dict(batch_size=4, prefetch=0), ValueError, "prefetch"),
    (dict(batch_size=4, drop_last="no"), TypeError, "drop_last"),
    (dict(batch_size=4, rank=2, world_size=2), ValueError, "rank 2 is outside"),
    (dict(batch_size=4, rank=1), ValueError, r"rank 1 is outside world_size 1 \(world_size not given, and no "
     r"torch.distributed process group is initialised: give rank= and world_size= both\)"),
    (dict(batch_size=4, world_size=2), ValueError, r"world_size=2 given without rank=, and no torch.distributed "
     r"process group is initialised: give rank= and world_size= both"),
    (dict(batch_size=4, indices=[0, 99]), IndexError, "99, out of range for 60"),
    (dict(batch_size=4, indices=[]), ValueError, "empty"),
    (dict(batch_size=4, indices=[0.5]), TypeError, "indices must be a 1-D sequence of integers"),
    (dict(batch_size=4, num_workers=8, pin_memory=True), TypeError,
     r"Loader takes no num_workers= \(a torch DataLoader argument\): its own I/O, decode and transform threads"),
    (dict(batch_size=4, pin_memory=True), TypeError, "batches come on the dataset's device"),
    (dict(batch_size=4, sampler=range(4)), TypeError, r"WeightedRandomSampler\) needs torch's DataLoader"),
    (dict(batch_size=4, shufle=True), TypeError, "got an unexpected keyword argument 'shufle'"),
])
def test_arguments_are_checked_in_one_line(ds, kwargs, error, match):
    with pytest.raises(error, match=match):
        gdsdata.Loader(ds, **kwargs)


def test_a_launched_process_without_a_process_group_is_refused_not_fed_every_sample(ds, monkeypatch):
    """torchrun sets WORLD_SIZE in each process: a Loader made there before init_process_group (or
    without it) would read every sample in every rank, as torch's DistributedSampler refuses to."""
    assert (gdsdata.Loader(ds, 4, rank=0).spec.world_size, gdsdata.Loader(ds, 4, world_size=1).spec.rank) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for alone in ({}, {"rank": 0}):
        with pytest.raises(ValueError, match=r"WORLD_SIZE=2 in the environment .* no torch.distributed process "
                                             r"group is initialised \(not yet, or no longer\): to read this rank's "
                                             r"share, make the Loader after torch.distributed.init_process_group\(\); "
                                             r"to read every sample .* give rank=0, world_size=1"):
            gdsdata.Loader(ds, 4, **alone)
    with pytest.raises(TypeError, match="rank must be an integer"):  # (its own error first)
        gdsdata.Loader(ds, 4, rank=1.5)
    assert gdsdata.Loader(ds, 4, rank=0, world_size=1).spec.world_size == 1  # every sample, asked for
    assert gdsdata.Loader(ds, 4, world_size=1).spec.world_size == 1
    assert gdsdata.Loader(ds, 4, rank=1, world_size=2).spec.rank == 1
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process under torchrun: no shares to take
    assert gdsdata.Loader(ds, 4).spec.world_size == 1


def test_dataloader_arguments_at_their_defaults_are_taken_as_asking_for_nothing(ds):
    """Code ported from a DataLoader keeps num_workers=0, pin_memory=False, sampler=None ...: those ask
    for nothing; any other value still gets its one line."""
    loader = gdsdata.Loader(ds, 4, num_workers=0, pin_memory=False, persistent_workers=False, timeout=0,
                            prefetch_factor=None, sampler=None, batch_sampler=None, collate_fn=None,
                            worker_init_fn=None, generator=None, multiprocessing_context=None, in_order=True,
                            pin_memory_device="")
    assert len(loader) == 15
    gdsdata.Loader(ds, 4, timeout=0.0, num_workers=np.int64(0), pin_memory=0, in_order=1)  # (as the DataLoader)
    for given in (dict(num_workers=1), dict(pin_memory=True), dict(timeout=5), dict(in_order=False),
                  dict(num_workers=None), dict(num_workers="0"), dict(pin_memory_device=None)):
        with pytest.raises(TypeError, match=f"Loader takes no {next(iter(given))}="):
            gdsdata.Loader(ds, 4, **given)


def test_other_datasets_are_pointed_to_the_dataloader():
    with pytest.raises(TypeError, match="torch.utils.data.DataLoader"):
        gdsdata.Loader(list(range(10)), 2)


@pytest.mark.parametrize("change, match", [
    (lambda s: {}, "lacks"),
    (lambda s: {**s, "batches_done": -3}, "below 0"),
    (lambda s: {**s, "batches_done": 1000}, "delivered, but it has"),
    (lambda s: {**s, "batches_done": 9, "batch_size": 16}, r"delivered, but it has 4 \(at world size 1, batch size 16"),
    (lambda s: {**s, "batches_done": 5, "world_size": 2}, r"delivered, but it has 4 \(at world size 2, batch size 8"),
    (lambda s: {**s, "epoch": "1"}, "not int"),
    (lambda s: {**s, "consumed": b"\x00"}, "mask"),
    (lambda s: {**s, "consumed": "not hex"}, "mask"),
    (lambda s: {**s, "dataset": "another"}, "fingerprint"),
    (lambda s: {**s, "version": 4}, "version 4, this gdsdata reads states up to version 3"),
    (lambda s: [1, 2], "takes the dict"),
])
def test_corrupted_or_foreign_states_are_refused(ds, change, match):
    loader = gdsdata.Loader(ds, 8, seed=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    with pytest.raises((ValueError, TypeError), match=match):
        gdsdata.Loader(ds, 8, seed=1).load_state_dict(change(state))


def test_stats_survive_a_break(ds):
    loader = gdsdata.Loader(ds, 8)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    del _
    assert loader.stats() is not None and loader.stats()["batches"] == 2


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_the_dataloader_route_with_workers(photos_dataset, context):
    """Per-sample transforms as torchvision datasets take them, the module-level collate for images
    of different sizes, two workers under each start method."""
    from torchvision.transforms import v2

    root = photos_dataset[2]
    resized = gdsdata.GDSDataset(root, transform=v2.Compose([v2.RandomResizedCrop(32), v2.ToDtype(torch.float32,
                                                                                               scale=True)]))
    loader = torch.utils.data.DataLoader(resized, batch_size=8, shuffle=True, num_workers=2,
                                         multiprocessing_context=context, collate_fn=gdsdata.collate)
    batches = list(loader)
    images, labels = batches[0]
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and sum(len(b[1]) for b in batches) == 60
    plain = gdsdata.GDSDataset(root)
    images, labels = next(iter(torch.utils.data.DataLoader(plain, batch_size=4, num_workers=2,
                                                           multiprocessing_context=context,
                                                           collate_fn=gdsdata.collate)))
    assert isinstance(images, list) and len(images) == 4  # sizes differ: a list, as the Loader gives
    assert all(im.dtype == torch.uint8 for im in images)


def test_dataset_transforms_and_indices(photos_dataset):
    ds = gdsdata.GDSDataset(photos_dataset[2], transform=lambda im: im.float() / 255,
                            target_transform=lambda y: y + 10)
    image, label = ds[3]
    assert image.dtype == torch.float32 and label == ds.targets[3] + 10
    assert torch.equal(ds[np.int64(3)][0], image) and torch.equal(ds[torch.tensor(3)][0], image)
    with pytest.raises(TypeError, match="must be an integer, got 1.7"):
        ds[1.7]
    for flag in (True, np.bool_(True), torch.tensor(True)):  # a bool is no sample index, as in numpy
        with pytest.raises(TypeError, match="must be an integer"):
            ds[flag]
    with pytest.raises(TypeError, match="not a slice"):
        ds[0:3]
    with pytest.raises(IndexError, match="out of range"):
        ds[60]
    with pytest.raises(TypeError, match="transform must be a callable"):
        gdsdata.GDSDataset(photos_dataset[2], transform="resize")
    joint = gdsdata.GDSDataset(photos_dataset[2], transforms=lambda im, y: (im[:, :5, :5], y + 20))
    image, label = joint[3]  # (image, label) together, as torchvision datasets' transforms=
    assert torch.equal(image, gdsdata.GDSDataset(photos_dataset[2])[3][0][:, :5, :5])
    assert label == ds.targets[3] + 20


def test_python_dash_m_and_help_for_every_command():
    import subprocess
    import sys

    for command in ("pack", "merge", "inspect", "verify", "doctor"):
        done = subprocess.run([sys.executable, "-m", "gdsdata", command, "--help"], capture_output=True, text=True)
        assert done.returncode == 0
        described = done.stdout.split("\n\n")[1]
        assert not described.startswith(("positional", "options")), (command, done.stdout[:300])


def test_transforms_take_torch_dtypes_as_well_as_their_names():
    for make in (gdsdata.RandomResizedCrop, gdsdata.CenterCrop):
        assert make(32, dtype=torch.float16) == make(32, dtype="float16")
        assert make(32, dtype=torch.uint8).dtype == "uint8"
        with pytest.raises(ValueError, match="dtype must be"):
            make(32, dtype=torch.int32)
        assert make([32]).output_size == (32, 32) == make((32, 32)).output_size  # a one-element size, as torchvision
        with pytest.raises(TypeError, match="size must be"):
            make([32, 32, 3])


def test_a_state_goes_through_json_also_after_a_resume_with_another_batch_size(ds):
    """state_dict() is plain values (the mask of delivered samples as hex): json takes it."""
    import json

    loader = gdsdata.Loader(ds, 8, seed=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = gdsdata.Loader(ds, 4, seed=3)
    other.load_state_dict(json.loads(json.dumps(state)))
    it = iter(other)
    next(it)
    again = json.loads(json.dumps(other.state_dict()))
    other.close()
    rest = gdsdata.Loader(ds, 4, seed=3)
    rest.load_state_dict(again)
    seen = [i for batch in rest.indices() for i in batch]
    assert len(seen) == len(ds) - 12 and len(set(seen)) == len(seen)


def test_a_transform_set_between_epochs_is_the_next_epoch_s(ds):
    """Progressive resizing, MixUp switched off late: the pass already reading the next epoch was made
    with the old transform, so it gives way to one with the new."""
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32, dtype="uint8"))
    assert {tuple(x.shape[-2:]) for x, _ in loader} == {(32, 32)}
    loader.transform = gdsdata.RandomResizedCrop(16, dtype="uint8")
    loader.batch_transform = lambda x, y: (x * 0, y)
    batches = list(loader)
    assert {tuple(x.shape[-2:]) for x, _ in batches} == {(16, 16)} and not any(x.any() for x, _ in batches)
    class Scale:  # a batch_transform switched off in place (timm's mixup_enabled = False), then reassigned
        k = 1

        def __call__(self, x, y):
            return x * self.k, y

    scale = loader.batch_transform = Scale()
    list(loader)
    scale.k = 0
    loader.batch_transform = scale  # the same object: the assignment says it changed
    assert not any(x.any() for x, _ in loader)
    loader.transform = gdsdata.RandomResizedCrop(16, dtype="uint8")  # an equal one, as a loop makes it each epoch
    loader.prefetch, loader.pixels = 2, False  # the values held: as good as not assigned
    carried = loader._carry  # the pass already reading the next epoch ...
    epoch = iter(loader)
    assert carried is not None and epoch._pass is carried  # ... carries on
    list(epoch)
    loader.transform = gdsdata.RandomResizedCrop(16, dtype="uint8", scale=np.array([0.5, 1.0]))  # (fields that
    loader.transform = gdsdata.RandomResizedCrop(16, dtype="uint8", scale=np.array([0.5, 1.0]))  # do not compare)
    assert {tuple(x.shape[-2:]) for x, _ in loader} == {(16, 16)}
    loader.pixels = True
    loader.transform = loader.batch_transform = None
    assert all(isinstance(b[0], gdsdata.PixelBatch) for b in loader)
    loader.pixels = False
    state = None
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    loader.transform = "not a transform"
    with pytest.raises(TypeError, match="transform= takes gdsdata.RandomResizedCrop"):
        iter(loader)
    assert loader.batches_left() == len(loader) - 3  # the refused pass kept the loaded state
    with pytest.raises(ValueError, match="make a new Loader"):
        loader.dataset = ds
    loader.close()


def test_closing_the_dataset_between_epochs_leaves_the_next_epoch_whole(ds):
    """GDSDataset.close() stops the pass that was reading the next epoch ahead: the next iter() reads
    that epoch afresh (closing under a running loop still raises)."""
    loader = gdsdata.Loader(ds, 8, seed=2)
    first = labels_of(loader)
    ds.close()
    assert len(labels_of(loader)) == len(first)
    loader.close()


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
def test_a_loader_copies_at_any_point_as_a_dataloader_does(ds, copier):
    import copy
    import pickle
    copied = (lambda x: pickle.loads(pickle.dumps(x))) if copier == "pickle" else copy.deepcopy
    epochs = gdsdata.Loader(ds, 8, seed=2)
    reference = [labels_of(epochs), labels_of(epochs)]  # epochs 0 and 1
    loader = gdsdata.Loader(ds, 8, seed=2, transform=gdsdata.CenterCrop(16))
    assert labels_of(copied(loader)) == reference[0]  # before any pass
    assert labels_of(loader) == reference[0]  # the Loader now holds a pass already reading epoch 1
    after = copied(loader)
    assert after.epoch == 1 and labels_of(after) == reference[1]
    it = iter(loader)
    next(it)  # mid-epoch: the copy's iter() starts the epoch, as any new pass does; the original reads on
    assert labels_of(copied(loader)) == reference[1]
    assert [labels.tolist() for _, labels in it] == reference[1][1:]
