"""The CPU Dataset: batched reads, DataLoader integration, bad samples, verify."""

import os
import pathlib
import pickle
import time

import numpy as np
import pytest
import torch
from conftest import damaged_copy, loader_threads, mean_abs_diff, pil_reference

import gdsdata
from gdsdata.format import layout as fmt
from gdsdata import settings
from gdsdata.dataset import GDSDataset
from gdsdata.errors import CorruptSampleError
from gdsdata.commands.verify import verify


def test_getitems_equals_getitem_in_any_order(photos_dataset):
    _, _, out = photos_dataset
    ds = GDSDataset(out)
    order = [17, 3, 3, 59, 0, 41, 20, 21, 22, -1]
    batch = ds.__getitems__(order)
    for i, (image, label) in zip(order, batch):
        single, single_label = ds[i]
        assert torch.equal(image, single) and label == single_label


def test_pixels_match_pil_across_shards(photos_dataset):
    src, paths, out = photos_dataset
    ds = GDSDataset(out)
    for i, (image, _) in enumerate(ds.__getitems__(range(len(ds)))):
        assert mean_abs_diff(image, pil_reference(os.path.join(src, paths[i]))) <= 1


@pytest.mark.parametrize("max_gap", [0, 4096, 1 << 20])
def test_coalescing_settings_do_not_change_results(photos_dataset, max_gap):
    _, _, out = photos_dataset
    ds = GDSDataset(out)
    reference = [img for img, _ in ds.__getitems__(range(0, 60, 2))]
    with settings.set(max_gap=max_gap, max_read=64 * 1024):
        again = [img for img, _ in ds.__getitems__(range(0, 60, 2))]
    assert all(torch.equal(a, b) for a, b in zip(reference, again))


def _collate(batch):
    return [img for img, _ in batch], torch.tensor([label for _, label in batch])


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_fetches_whole_batches(photos_dataset, workers):
    _, _, out = photos_dataset
    ds = GDSDataset(out)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=workers, collate_fn=_collate)
    seen = []
    for images, labels in loader:
        assert len(images) == len(labels) <= 16
        seen.extend(labels.tolist())
    assert seen == ds.targets


def test_dataset_pickles_for_spawned_workers(photos_dataset):
    _, _, out = photos_dataset
    ds = GDSDataset(out)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[5][0], ds[5][0])


def test_out_of_range_index(photos_dataset):
    ds = GDSDataset(photos_dataset[2])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


@pytest.fixture()
def corrupted(photos_dataset, tmp_path):
    """A copy of the photos dataset whose sample 7 has its JPEG headers destroyed: undecodable."""
    return damaged_copy(photos_dataset[2], str(tmp_path / "ds"), 7, 2, b"\x00" * 600)


def test_bad_sample_raises_naming_it(corrupted):
    ds = GDSDataset(corrupted)
    with pytest.raises(CorruptSampleError, match=r"sample 7 \(class\d/.*\.jpg, shard-\d+\.gds offset \d+\)"):
        ds.__getitems__([6, 7, 8])


def test_checksum_catches_silent_corruption(photos_dataset, tmp_path):
    out = damaged_copy(photos_dataset[2], str(tmp_path / "ds"), 4, -200, b"\x13\x37")  # entropy-coded data
    GDSDataset(out, verify_checksums=False)[4]  # without checksums the image still decodes (to wrong pixels)
    with pytest.raises(CorruptSampleError, match="sample 4 .*checksum mismatch"):
        GDSDataset(out)[4]  # checked by default
    problems = verify(out)
    assert len(problems) == 2 and "shard checksum mismatch" in problems[0]
    assert "sample 4" in problems[1] and "checksum mismatch" in problems[1]


def test_a_bad_sample_is_replaced_where_reads_are_planned(corrupted, monkeypatch):
    """on_error="skip": a checksum failure is replaced on the read thread, before decode; from then
    on the bad sample is never read again, its replacement read in its place; the Loader counts
    one replacement an epoch."""
    import threading

    ds = GDSDataset(corrupted, on_error="skip")
    reads, probes = [], []
    real_read, real_load = ds._backend.read, ds._backend.load_batch
    monkeypatch.setattr(ds._backend, "read", lambda indices: reads.append(list(indices)) or real_read(indices))
    monkeypatch.setattr(ds._backend, "load_batch", lambda indices, stream=None: probes.append(
        threading.current_thread().name) or real_load(indices, stream))
    loader = gdsdata.Loader(ds, 8, shuffle=False, transform=gdsdata.CenterCrop(32))
    first = [labels for _, labels in loader]
    assert loader.skipped == {0: 1} and probes and set(probes) == {"gdsdata-read"}
    reads.clear()
    probes.clear()
    second = [labels for _, labels in loader]
    assert loader.skipped == {0: 1, 1: 1} and not probes
    assert all(7 not in r for r in reads) and sum(r.count(8) for r in reads) == 2  # 8 read in 7's place
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_replacement_that_turns_bad_is_replaced_for_every_sample_it_stood_in_for(corrupted, monkeypatch):
    ds = GDSDataset(corrupted, on_error="skip")
    ds.load_batch([7])  # 7 is bad: 8 is read in its place
    record = ds.index.samples[8]
    with open(ds.index.shard_path(int(record["shard"])), "r+b") as f:  # now 8 goes bad too
        f.seek(int(record["offset"]) + 2)
        f.write(b"\x00" * 600)
    _, final = ds.load_batch([7])
    assert final == [9] and ds.skipped == 2
    reads = []
    real_read = ds._backend.read
    monkeypatch.setattr(ds._backend, "read", lambda indices: reads.append(list(indices)) or real_read(indices))
    _, again = ds.load_batch([7, 8])
    assert again == [9, 9] and reads == [[9, 9]] and ds.skipped == 4


def test_skip_replaces_bad_sample_deterministically(corrupted):
    ds = GDSDataset(corrupted, on_error="skip")
    batch = ds.__getitems__([6, 7, 8])
    assert ds.skipped == 1
    assert torch.equal(batch[1][0], ds[8][0]) and batch[1][1] == ds.targets[8]
    again = GDSDataset(corrupted, on_error="skip").__getitems__([6, 7, 8])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batch, again))


def test_verify_reports_every_bad_sample(corrupted):
    problems = verify(corrupted)  # the shard's line, and one line for the sample: its checksum, and its decode
    assert len(problems) == 2 and problems[0].endswith("shard checksum mismatch (in sample 7: below)"), problems
    assert problems[1].startswith("sample 7 (") and problems[1].count("sample 7") == 1, problems
    assert "checksum mismatch" in problems[1] and "; JPEG decoding failed" in problems[1], problems


def test_verify_says_a_shard_damaged_between_its_samples_keeps_them_intact(photos_dataset, tmp_path):
    """A flipped byte in the padding after a sample fails the shard's checksum only: verify says
    so, and that every sample of the shard passes, so that the user knows training on it is safe."""
    from gdsdata.format.index import load

    index = load(photos_dataset[2])
    sample = next(i for i in range(len(index)) if int(index.samples[i]["length"]) % index.alignment)
    out = damaged_copy(photos_dataset[2], str(tmp_path / "ds"), sample, int(index.samples[sample]["length"]),
                       b"\x13")
    shard = load(out).shard_path(int(index.samples[sample]["shard"]))
    assert verify(out) == [f"{shard}: shard checksum mismatch outside every sample (in the padding between "
                           f"samples): every sample of it passes its checksum and decodes"]


@pytest.mark.parametrize("at", [10, 100, 4000], ids=["reserved0", "reserved", "padding"])
def test_verify_says_a_damaged_byte_in_a_shard_header_s_unused_bytes(photos_dataset, tmp_path, at):
    """A byte set where a shard's header holds nothing (its reserved fields, the padding up to its
    first sample): beyond the shard's data checksum and unseen by reading, said by verify."""
    import shutil

    from gdsdata.format.index import load

    out = str(tmp_path / "ds")
    shutil.copytree(photos_dataset[2], out)
    shard = load(out).shard_path(0)
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(b"\x01")
    assert verify(out) == [f"{shard}: its header's reserved bytes, or the padding after it, are not zero: damage "
                           f"outside every sample (reading is unaffected; packing again mends it)"]
    ds = gdsdata.GDSDataset(out)
    assert len(ds[0][0])  # reading is unaffected


def test_verify_goes_on_past_a_shard_cut_short_and_a_missing_one(tmp_path):
    """Every problem listed: a shard cut short and a missing one each said once, the samples of the
    other shards still checked (verify had stopped at the first bad shard)."""
    from conftest import write_photos

    from gdsdata.format.index import load
    from gdsdata.packing.packer import pack

    write_photos(str(tmp_path / "src"), 24, classes=2, start_seed=700)
    out = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1, shard_size=120_000).out
    index = load(out)
    assert len(index.shards) >= 3
    with open(index.shard_path(0), "r+b") as f:
        f.truncate(os.path.getsize(index.shard_path(0)) - 5000)
    os.unlink(index.shard_path(len(index.shards) - 1))
    problems = verify(out)
    assert sum("shard-00000.gds" in p for p in problems) == 1 and "its samples are not checked" in problems[0]
    last = os.path.basename(index.shard_path(len(index.shards) - 1))
    assert any(f"{last}: shard file missing" in p and p.endswith("its samples are not checked") for p in problems)
    assert len(problems) == 2  # the shards between are sound, and were read


def test_verify_passes_a_sound_dataset(photos_dataset):
    assert verify(photos_dataset[2]) == []


def test_raw_gray_samples_expand_to_rgb(tmp_path):
    from PIL import Image

    from gdsdata.packing.prepare import PackOptions
    from gdsdata.packing.packer import pack

    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    gray = (np.arange(48 * 40) % 251).astype(np.uint8).reshape(40, 48)
    Image.fromarray(gray).save(src / "g.png")
    out = str(tmp_path / "raw")
    pack(str(tmp_path / "src"), out, options=PackOptions(codec="raw"), workers=1)
    image = GDSDataset(out)[0][0]
    assert image.shape == (3, 40, 48)
    assert all(torch.equal(image[c], torch.from_numpy(gray)) for c in range(3))
    assert GDSDataset(out).index.samples[0]["codec"] == fmt.CODEC_RAW


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_memory_is_flat_over_20_epochs(photos_dataset):
    """Soak: the CPU path's resident memory from epoch 2 to epoch 20 stays within 5 %."""
    import gc

    import gdsdata

    ds = GDSDataset(photos_dataset[2])
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(48))
    rss = []
    for epoch in range(20):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        gc.collect()
        rss.append(_rss_bytes())
    assert max(rss[1:]) <= rss[1] * 1.05, [r // 2**20 for r in rss]
    loader.close()


def test_a_dropped_loader_stops_reading_ahead_at_once(photos_dataset):
    """After a full epoch a Loader's threads read the next one ahead; dropping the Loader stops
    them without waiting for the garbage collector (nothing holds the Loader in a cycle)."""
    import gc
    import time

    import gdsdata

    ds = GDSDataset(photos_dataset[2])
    before = loader_threads()
    gc.disable()
    try:
        loader = gdsdata.Loader(ds, 8, shuffle="full")
        for _ in loader:
            pass
        mine = loader_threads() - before
        assert mine, "the finished pass should be reading the next epoch"
        del loader
        deadline = time.monotonic() + 5
        while any(t.is_alive() for t in mine):
            assert time.monotonic() < deadline, "threads of a dropped Loader still running"
            time.sleep(0.05)
    finally:
        gc.enable()
    ds.close()


def test_closing_the_dataset_stops_its_loaders(photos_dataset):
    """A Loader left reading ahead is stopped by closing its dataset, before the dataset lets go of
    its files (on the GPU: its staging memory and decoder)."""

    import gdsdata

    ds = GDSDataset(photos_dataset[2])
    before = loader_threads()
    loader = gdsdata.Loader(ds, 8, shuffle="full")
    for _ in loader:
        pass
    mine = loader_threads() - before
    assert mine
    ds.close()
    assert not any(t.is_alive() for t in mine)


def test_loader_stats_say_where_the_time_goes(photos_dataset):
    import gdsdata

    ds = GDSDataset(photos_dataset[2])
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32))
    assert loader.stats() is None
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    stats = loader.stats()
    assert stats["batches"] == 2 * len(loader)
    assert stats["read_s"] > 0 and stats["decode_s"] > 0
    assert stats["transform_s"] > 0
    assert stats["consumer_gpu_wait_s"] == 0  # no CUDA stream on the CPU path
    assert all(value >= 0 for value in stats.values())
    loader.close()
    ds.close()


def test_a_shard_truncated_under_a_running_loader_raises_naming_it(photos_dataset, tmp_path):
    """Storage errors in the read-ahead thread reach the training loop as the one-line error."""
    import shutil

    import gdsdata
    from gdsdata.errors import FormatError

    copy = str(tmp_path / "ds")
    shutil.copytree(photos_dataset[2], copy)
    ds = GDSDataset(copy)
    last = ds.index.shard_path(len(ds.index.shards) - 1)
    with open(last, "r+b") as f:
        f.truncate(4096)
    loader = gdsdata.Loader(ds, 8, shuffle=None)
    with pytest.raises(FormatError, match=rf"{os.path.basename(last)}: short read .* truncated shard"):
        for _ in loader:
            pass
    loader.close()
    ds.close()


@pytest.mark.parametrize("device, reads", [("cpu", "cached"), ("cpu", "direct"),
                                           pytest.param("cuda", "cached", marks=pytest.mark.gpu)])
def test_a_shard_gone_with_a_replaced_dataset_raises_format_error(photos_dataset, tmp_path, device, reads):
    """Repacked into fewer shards while open: a shard the old index names no longer exists, and
    ds[i] and the Loader both say the dataset was replaced (a GdsDataError), not FileNotFoundError."""
    from gdsdata.errors import FormatError, GdsDataError
    from gdsdata.packing.packer import pack

    src, _, _ = photos_dataset
    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=600_000)
    with settings.set(**({"io_engine": "direct"} if reads == "direct" else {})):
        ds = GDSDataset(out, device=device)
    last = len(ds) - 1
    gone = os.path.basename(ds.index.shard_path(int(ds.index.samples[last]["shard"])))
    assert gone != "shard-00000.gds"
    ds[0]  # shard 0 opened before the replacement
    pack(src, out, overwrite=True, workers=1)  # one shard now
    assert not os.path.exists(os.path.join(out, gone))
    said = rf"{gone}: missing, gone since the dataset was opened \(if it was packed again, open it again"
    with pytest.raises(FormatError, match=said) as raised:
        ds[last]
    assert isinstance(raised.value.__cause__, FileNotFoundError)
    with pytest.raises(GdsDataError, match=said):
        next(iter(gdsdata.Loader(ds, 4, shuffle=False, indices=[last])))
    ds.close()


# --- a damaged index header, odd shard files, damaged states ---------------------------------------
@pytest.mark.parametrize("field, bit", [("num_samples", 6), ("num_samples", 0), ("strings_offset", 2),
                                        ("num_shards", 1), ("meta_size", 3), ("dataset_id", 1), ("flags", 0),
                                        ("reserved", 4)])
def test_a_bit_flip_in_the_index_header_is_refused(photos_dataset, tmp_path, field, bit):
    """The body's checksum covers the body only: a flipped count or offset loaded as a smaller dataset
    (or shifted names) that every checksum still passed; a flipped dataset id passed verify, and made
    the dataset's shards on other drives another's (an overwrite left them). The header's own
    checksum refuses each."""
    import shutil

    from gdsdata.errors import FormatError
    from gdsdata.format import index as index_io

    _, _, out = photos_dataset
    copy = str(tmp_path / "ds")
    shutil.copytree(out, copy)
    path = os.path.join(copy, fmt.INDEX_NAME)
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[fmt.INDEX_HEADER.fields[field][1]] ^= 1 << bit
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(FormatError, match="index"):
        GDSDataset(copy)
    with pytest.raises(FormatError, match="index"):
        verify(copy)
    if field in ("dataset_id", "flags", "reserved"):  # what nothing else checks: the header's own checksum
        with pytest.raises(FormatError, match="index header checksum mismatch"):
            GDSDataset(copy)
        assert index_io.header_id(copy) is None  # a damaged id owns no shards on other drives


def test_a_shard_whose_open_hangs_holds_up_only_its_own_reads(photos_dataset, tmp_path, monkeypatch):
    """A shard whose open does not return (a network mount that stopped answering) blocks the reads
    of that shard, not those of the others, nor close(); a FIFO named as a shard is refused at once
    (opening one would wait for a writer)."""
    import shutil
    import threading

    from gdsdata.errors import FormatError
    from gdsdata.io import cpu

    _, _, out = photos_dataset
    copy = str(tmp_path / "ds")
    shutil.copytree(out, copy)
    ds = GDSDataset(copy)
    first, last = 0, len(ds) - 1
    stuck = ds.index.shard_path(int(ds.index.samples[last]["shard"]))
    assert int(ds.index.samples[first]["shard"]) != int(ds.index.samples[last]["shard"])
    answer, real = threading.Event(), cpu.open_regular

    def hanging(path, *args):
        if path == stuck:
            answer.wait(60)
        return real(path, *args)

    monkeypatch.setattr(cpu, "open_regular", hanging)
    got = []
    reader = threading.Thread(target=lambda: got.append(ds[last]), daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # its open does not return
    done = threading.Event()
    threading.Thread(target=lambda: (ds[first], done.set()), daemon=True).start()
    assert done.wait(30), "a read of another shard waited for the stuck open"
    answer.set()  # the mount answers at last
    reader.join(30)
    assert not reader.is_alive() and got
    ds.close()
    os.unlink(stuck)
    os.mkfifo(stuck)
    with pytest.raises(FormatError, match=f"{stuck}: a FIFO where a shard file belongs"):
        GDSDataset(copy)[last]


def test_shard_files_that_cannot_be_opened_are_named(photos_dataset, tmp_path):
    import errno
    import shutil

    from gdsdata.errors import FormatError, GdsDataError
    from gdsdata.io.cpu import OpenShards

    _, _, out = photos_dataset
    copy = str(tmp_path / "ds")
    shutil.copytree(out, copy)
    ds = GDSDataset(copy)
    shard = ds.index.shard_path(int(ds.index.samples[len(ds) - 1]["shard"]))
    os.unlink(shard)
    os.mkdir(shard)
    with pytest.raises(FormatError, match=f"{shard}: a folder where a shard file belongs"):
        ds[len(ds) - 1]

    def too_many(path, shard):
        raise OSError(errno.EMFILE, "Too many open files")

    with pytest.raises(GdsDataError, match="too many files open .*ulimit -n"):
        with OpenShards(ds.index, too_many, lambda handle: None).use(0):
            pass
    ds.close()


def test_a_state_with_a_huge_world_size_is_refused_at_once(photos_dataset):
    _, _, out = photos_dataset
    loader = gdsdata.Loader(GDSDataset(out), 8)
    state = loader.state_dict()
    state["world_size"] = 10 ** 9
    with pytest.raises(ValueError, match="world_size 1000000000 is more than the dataset's 60 samples"):
        loader.load_state_dict(state)
    few = gdsdata.Loader(GDSDataset(out), 1, indices=[0, 1, 2], rank=0, world_size=8)  # more ranks than samples
    next(iter(few))
    fewer = gdsdata.Loader(GDSDataset(out), 1, indices=[0, 1, 2], rank=0, world_size=2)
    fewer.load_state_dict(few.state_dict())  # a legitimate state: resumed on fewer ranks


def test_labels_stay_read_only_in_a_pickled_dataset(photos_dataset):
    _, _, out = photos_dataset
    copy = pickle.loads(pickle.dumps(GDSDataset(out)))
    with pytest.raises(ValueError):
        copy.labels[0] = 4


def test_open_shards_close_what_an_open_finishing_after_close_opened_and_survive_a_failed_close(photos_dataset):
    import threading

    from gdsdata.errors import GdsDataError
    from gdsdata.format import index as index_io
    from gdsdata.io.cpu import OpenShards

    _, _, out = photos_dataset
    index = index_io.load(out)
    closed, release = [], threading.Event()

    def slow(path, shard):
        release.wait(10)
        return f"handle {shard}"

    files = OpenShards(index, slow, closed.append)
    failed = []

    def read():
        try:
            with files.use(0):
                pass
        except GdsDataError as e:
            failed.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    files.close()  # while shard 0 opens
    release.set()
    reader.join(10)
    assert closed == ["handle 0"] and "closed while this shard was being opened" in str(failed[0])

    def failing_close(handle):
        raise OSError(5, "Input/output error")

    files = OpenShards(index, lambda path, shard: f"handle {shard}", failing_close, max_open=1)
    with files.use(0):
        pass
    with files.use(1):  # evicts shard 0, whose close fails: this read goes on
        pass
    with files.use(1):
        pass
    assert len(files) == 1 and not files._opening


def test_the_cpu_pool_runs_each_item_once_waits_for_all_and_raises_a_failure():
    """``run_parallel`` (the CPU decode's and resample's): every k once; on a failure nothing of the
    batch still runs once it has raised; called again from inside the pool (work that nests) it
    runs in place instead of waiting on the pool it occupies."""
    import threading
    import time

    from gdsdata.decode.cpu import run_parallel

    with settings.set(cpu_threads=2):
        seen, lock = [], threading.Lock()

        def note(k):
            with lock:
                seen.append(k)

        run_parallel(note, 37)
        assert sorted(seen) == list(range(37))
        seen.clear()

        def fails_at_5(k):
            if k == 5:
                raise ValueError("sample five")
            time.sleep(0.005)
            note(k)

        with pytest.raises(ValueError, match="sample five"):
            run_parallel(fails_at_5, 40)
        ran = len(seen)
        time.sleep(0.1)
        assert len(seen) == ran and 5 not in seen
        nested = []
        worker = threading.Thread(target=run_parallel, args=(lambda k: run_parallel(
            lambda j: nested.append((k, j)), 3), 8), daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "run_parallel inside the pool waited on the pool"
        assert sorted(nested) == [(k, j) for k in range(8) for j in range(3)]


def test_the_cpu_pool_runs_in_place_what_it_refuses_and_waits_for_what_it_took(monkeypatch, caplog):
    """What the pool refuses (shut down, or no thread could be started) it never queued: that runs
    in place, each k once, after which the runs it took are waited for. A thread that could not
    start leaves the pool whole: the next thread starts when it can."""
    import threading

    from gdsdata.decode import cpu
    from gdsdata.threads import DaemonPool

    seen, lock = [], threading.Lock()

    def note(k):
        with lock:
            seen.append(k)

    closed = DaemonPool(2, "gdsdata-cpu-test")
    closed.shutdown()
    monkeypatch.setattr(cpu, "cpu_pool", lambda: closed)
    cpu.run_parallel(note, 20)
    assert sorted(seen) == list(range(20))
    assert "could be started" not in caplog.text  # (a pool shut down is no failure to report)

    pool, real_start, starts = DaemonPool(2, "gdsdata-cpu-test"), threading.Thread.start, []

    def start(thread):
        starts.append(thread.name)
        if len(starts) > 1:  # (the first starts, no other)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(cpu, "cpu_pool", lambda: pool)
    seen.clear()
    cpu.run_parallel(note, 40)
    assert sorted(seen) == list(range(40))  # (run by the one thread that started)
    assert len(pool._threads) == 1
    fresh = DaemonPool(2, "gdsdata-cpu-test")  # none starts: refused, run in place
    monkeypatch.setattr(threading.Thread, "start", lambda thread: (_ for _ in ()).throw(RuntimeError("no")))
    monkeypatch.setattr(cpu, "cpu_pool", lambda: fresh)
    seen.clear()
    cpu.run_parallel(note, 40)
    assert sorted(seen) == list(range(40)) and "no CPU worker thread could be started (no)" in caplog.text
    monkeypatch.setattr(threading.Thread, "start", real_start)
    seen.clear()
    pool.shutdown(5)
    fresh.submit(note, 1).result(5)  # the next thread starts when it can
    assert seen == [1] and len(fresh._threads) == 1
    fresh.shutdown(5)


def test_the_cpu_pool_replaced_mid_work_strands_nothing():
    """The cpu_threads setting changed while other threads run work on the pool: the old pool is
    shut down, and every call given it still runs (a shutdown between a submit's check and its
    queuing had stranded the call behind the workers' ends, and run_parallel waited for good)."""
    import sys
    import threading

    from gdsdata.decode.cpu import run_parallel

    done, stop = [], threading.Event()

    def worker():
        while not stop.is_set():
            run_parallel(lambda k: None, 64)
        done.append(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switched as often as can be: the race's window comes up)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 4
        size = 1
        while time.monotonic() < deadline:
            size = size % 3 + 2
            with settings.set(cpu_threads=size):
                time.sleep(0.001)
        stop.set()
        for thread in threads:
            thread.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert len(done) == 3, "a run_parallel waited for good on a call a replaced pool stranded"


def test_the_pool_drains_within_its_bound():
    """``DaemonPool.drain``: True once every call submitted has ended, False at its bound while one
    still runs (what the exit waits for, at most a few seconds, before the interpreter finalises)."""
    import threading

    from gdsdata.threads import DaemonPool

    pool, release = DaemonPool(2, "gdsdata-drain-test"), threading.Event()
    assert pool.drain(0)
    futures = [pool.submit(release.wait, 30), pool.submit(time.sleep, 0.01)]
    t0 = time.monotonic()
    assert not pool.drain(0.3) and 0.25 < time.monotonic() - t0 < 5
    release.set()
    assert pool.drain(10) and all(f.done() for f in futures)
    pool.shutdown(5)


def test_a_shard_header_with_another_sample_count_is_named(photos_dataset, tmp_path):
    """The count in a shard's header (outside its checksum) is checked against the index's."""
    import shutil

    import numpy as np

    from gdsdata.errors import FormatError
    from gdsdata.format import layout as fmt
    from gdsdata.format.index import load

    out = str(tmp_path / "ds")
    shutil.copytree(photos_dataset[2], out)
    path = load(out).shard_path(0)
    with open(path, "r+b") as f:
        f.seek(fmt.SHARD_HEADER.fields["num_samples"][1])
        f.write(np.uint32(7).tobytes())
    with pytest.raises(FormatError, match="shard-00000.gds: shard header says 7 samples, the index records"):
        GDSDataset(out)
    assert any("shard header says 7 samples" in p for p in verify(out))
