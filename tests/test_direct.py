"""Streaming reads past the page cache (gdsdata.io.direct, io_engine=direct): the same bytes and
pixels as the buffered reads, the shards' pages not left in the page cache (counted with mincore),
filesystems without O_DIRECT read through the cache and dropped from it again, and the automatic
choice for datasets larger than half the host's memory."""

import errno
import mmap
import os
import pickle
import sys
import threading
import time

import numpy as np
import pytest
import torch

import gdsdata
from gdsdata.format.index import load as load_index
from gdsdata.io import direct
from gdsdata.io.cpu import CpuReader
from gdsdata.io.path import Machine, cpu_path, resolve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from common import evict, resident_pages as resident  # noqa: E402


def shard_files(root):
    index = load_index(root)
    return [index.shard_path(k) for k in range(len(index.shards))]


def evicted(paths):
    evict(paths)
    if sum(resident(p) for p in paths):
        pytest.skip("this filesystem keeps file pages in memory (tmpfs, say): nothing to bypass")


@pytest.fixture(params=["direct", "threads", "fallback"])
def mode(request, monkeypatch):
    """``direct``: O_DIRECT reads through native AIO; ``threads``: a system that refuses an AIO
    context (the reads issued from threads); ``fallback``: a filesystem that refuses O_DIRECT
    (open fails with EINVAL)."""
    if request.param == "threads":
        from gdsdata._native import aio

        def refused(depth):
            raise OSError(errno.EAGAIN, "io_setup: Resource temporarily unavailable")

        monkeypatch.setattr(aio, "Context", refused)
    if request.param == "fallback":
        real_open = os.open

        def refusing(path, flags, *args, **kwargs):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing)
    return request.param


@pytest.mark.parametrize("order", ["shuffled", "block", "repeats"])
def test_direct_reads_read_what_buffered_reads_read(photos_dataset, mode, order, monkeypatch):
    monkeypatch.setattr(direct, "PIECE", 8192)  # many pieces per read, pieces across threads
    _, _, root = photos_dataset
    index = load_index(root)
    n = len(index.samples)
    rng = np.random.default_rng(0)
    indices = {"shuffled": rng.permutation(n)[:40], "block": np.arange(10, 50),
               "repeats": np.array([3, 3, 59, 0, 3])}[order]
    expected, plan = CpuReader(index).read(indices)
    reader = CpuReader(index, direct=True)
    got, same_plan = reader.read(indices)
    assert got.ctypes.data % mmap.PAGESIZE == 0
    assert np.array_equal(plan.sample_lengths, same_plan.sample_lengths)  # placed apart: fewer holes joined
    for off, again, length in zip(plan.sample_offsets, same_plan.sample_offsets, plan.sample_lengths):
        assert np.array_equal(got[again:again + length], expected[off:off + length])
    reader.close()


def test_native_aio_carries_the_direct_reads_where_the_system_allows(photos_dataset):
    from gdsdata._native.aio import Context

    try:
        Context(4).close()
    except OSError as e:
        pytest.skip(f"no native AIO here: {e}")
    _, _, root = photos_dataset
    reader = CpuReader(load_index(root), direct=True)
    reader.read(np.arange(30))
    assert reader._direct._aio and len(reader._direct._contexts) == 1  # one context, reused
    reader.read(np.arange(30, 60))
    assert len(reader._direct._contexts) == 1
    reader.close()


def test_a_shard_cut_short_under_a_streaming_reader_is_named(photos_dataset, mode, tmp_path):
    import shutil

    from gdsdata.errors import FormatError

    _, _, root = photos_dataset
    copy = str(tmp_path / "ds")
    shutil.copytree(root, copy)
    index = load_index(copy)
    reader = CpuReader(index, direct=True)
    reader.read(np.arange(len(index.samples)))  # every shard opened and checked
    last = index.shard_path(len(index.shards) - 1)
    os.truncate(last, os.path.getsize(last) - 3 * 4096)
    with pytest.raises(FormatError, match=rf"{os.path.basename(last)}: short read .* truncated shard"):
        reader.read(np.arange(len(index.samples)))
    reader.close()


def test_a_read_error_under_a_streaming_reader_names_the_shard(photos_dataset, mode, monkeypatch):
    """EIO (a failing drive) from a read issued by a thread: gdsdata's error naming the shard and the
    reason, not the system's bare OSError (native AIO's own errors are said so too)."""
    from gdsdata.errors import GdsDataError

    if mode == "direct":
        pytest.skip("native AIO reads do not go through os.preadv")
    _, _, root = photos_dataset
    index = load_index(root)
    reader = CpuReader(index, direct=True)
    reader.read(np.arange(len(index.samples)))  # every shard opened and checked

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(GdsDataError, match=r"shard-\d+\.gds: cannot be read \(Input/output error\)"):
        reader.read(np.arange(len(index.samples)))
    reader.close()


def _aio_or_skip():
    from gdsdata._native.aio import Context

    try:
        Context(4).close()
    except OSError as e:
        pytest.skip(f"no native AIO here: {e}")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_device_that_refuses_every_aio_read_is_read_buffered_without_losing_a_descriptor(
        photos_dataset, monkeypatch):
    """Every request answered -EINVAL (a device refusing the dataset's alignment), two shards open
    at most: the reads finish through the cache, the bytes equal, no descriptor closed twice or
    leaked."""
    from gdsdata._native import aio

    _aio_or_skip()
    real_reap = aio.Context.reap
    monkeypatch.setattr(aio.Context, "reap", lambda self, wait_s: [(slot, -errno.EINVAL)
                                                                  for slot, _ in real_reap(self, wait_s)])
    _, _, root = photos_dataset
    index = load_index(root)
    plain = CpuReader(index)
    expected, plan = plain.read(np.arange(len(index.samples)))
    plain.close()
    import gc

    gc.collect()  # descriptors of earlier tests' readers closed now, not during this one
    before = _open_fds()
    reader = CpuReader(index, max_open=2, direct=True)
    got, _ = reader.read(np.arange(len(index.samples)))
    assert np.array_equal(got[:plan.total], expected[:plan.total])
    reader.close()
    assert _open_fds() <= before


def test_a_failure_while_handling_completions_raises_instead_of_hanging(photos_dataset, monkeypatch):
    from gdsdata._native import aio

    _aio_or_skip()
    real_reap = aio.Context.reap
    monkeypatch.setattr(aio.Context, "reap", lambda self, wait_s: [(slot, -errno.EINVAL)
                                                                  for slot, _ in real_reap(self, wait_s)])

    def no_descriptors(path, fd_open=None):
        raise OSError(errno.EMFILE, "Too many open files", path)

    monkeypatch.setattr(direct, "_buffered", no_descriptors)
    _, _, root = photos_dataset
    reader = CpuReader(load_index(root), direct=True)
    outcome = {}

    def read():
        try:
            reader.read(np.arange(40))
        except OSError as e:
            outcome["error"] = e

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the read hung"
    assert outcome["error"].errno == errno.EMFILE
    reader.close()


def test_a_submission_that_fails_part_way_returns_what_the_kernel_took(tmp_path):
    """io_submit takes the requests before a bad one and returns them, so they are reaped, never
    lost while the kernel writes into their buffers; the next call raises."""
    from gdsdata._native.aio import Context

    _aio_or_skip()
    path = tmp_path / "blob"
    data = np.random.default_rng(1).integers(0, 256, 4 << 20, np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = np.frombuffer(mmap.mmap(-1, 4 << 20), np.uint8)
    context = Context(8)
    try:
        piece = 1 << 20
        good = [(fd, buffer.ctypes.data + k * piece, piece, k * piece) for k in range(3)]
        slots = context.submit(good + [(2 ** 31 - 1, buffer.ctypes.data + 3 * piece, piece, 3 * piece)])
        assert len(slots) == 3 and context.in_flight == 3
        results = {}
        while len(results) < 3:
            results.update(context.reap(1.0))
        assert sorted(results) == sorted(slots) and set(results.values()) == {piece}
        assert np.array_equal(buffer[:3 * piece], data[:3 * piece]) and context.in_flight == 0
        with pytest.raises(OSError) as caught:
            context.submit([(2 ** 31 - 1, buffer.ctypes.data, piece, 0)])
        assert caught.value.errno == errno.EBADF and context.room == 8
    finally:
        context.close()
        os.close(fd)


@pytest.mark.parametrize("where", ["read-ahead", "pread"])
def test_a_stuck_streaming_read_does_not_keep_the_interpreter_from_exiting(photos_dataset, tmp_path, where):
    """The read-ahead threads and the threads issuing direct reads are daemons: after the
    StallError the script ends, the read still stuck in its call."""
    _, _, root = photos_dataset
    script = tmp_path / "stuck.py"
    script.write_text(f"""
import threading, gdsdata
from gdsdata.io import direct
with gdsdata.settings.set(io_engine="direct", direct_ahead=1):  # two batches at once: the third read stalls
    ds = gdsdata.GDSDataset({root!r})
original, calls = ds.read_staged, {{"n": 0}}
def read_staged(indices):
    calls["n"] += 1
    if calls["n"] == 3:
        if {where!r} == "read-ahead":
            threading.Event().wait()
        direct.DirectReads._context = lambda self: None  # every read from the direct threads from now on
        direct._pread = lambda *a: threading.Event().wait()
    return original(indices)
ds.read_staged = read_staged
try:
    for _ in gdsdata.Loader(ds, 5, shuffle=None, transform=gdsdata.CenterCrop(40)):
        pass
except gdsdata.StallError as e:
    print("stalled:", e)
""")
    import subprocess

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                          cwd=os.path.join(os.path.dirname(__file__), ".."),
                          env={**os.environ, "GDSDATA_STALL_TIMEOUT": "2"})
    assert done.returncode == 0 and "stalled" in done.stdout, done.stdout + done.stderr[-2000:]
    if where == "pread":
        assert "pread (O_DIRECT)" in done.stdout


def test_a_batch_of_few_large_reads_is_cut_to_fill_the_queue():
    """A block-shuffled batch (one long read) becomes at least ``depth`` page-multiple pieces
    between MIN_PIECE and PIECE; a batch of many small reads keeps its reads whole."""
    from types import SimpleNamespace

    reads = direct.DirectReads.__new__(direct.DirectReads)
    for depth, total in ((64, 21 << 20), (64, 67 << 20), (8, 1 << 30), (64, 1 << 20)):
        reads.depth = depth
        piece = reads.pieces(SimpleNamespace(total=total))
        assert piece % mmap.PAGESIZE == 0 and direct.MIN_PIECE <= piece <= direct.PIECE
        assert -(-total // piece) >= min(depth, total // direct.MIN_PIECE)


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    """200 photos in one shard of a few MB: large enough for the kernel's readahead to show."""
    from conftest import write_photos

    src = str(tmp_path_factory.mktemp("direct_src"))
    write_photos(src, 200)
    out = str(tmp_path_factory.mktemp("direct") / "ds")
    gdsdata.pack(src, out, workers=2, shard_size=1 << 26)
    return out


def test_a_direct_epoch_leaves_no_shard_pages_in_the_page_cache(one_shard, mode):
    root = one_shard
    files = shard_files(root)
    assert len(files) == 1 and os.path.getsize(files[0]) > 1 << 20
    evicted(files)
    with gdsdata.settings.set(io_engine="direct"):
        ds = gdsdata.GDSDataset(root)
    assert ds.load_path.reads == "direct"
    n = sum(len(images) for images, _ in gdsdata.Loader(ds, 16, shuffle=True, transform=gdsdata.CenterCrop(32)))
    assert n == len(ds)
    assert sum(resident(p) for p in files) == 0
    # the same epoch through the buffered reads leaves the shards cached: the count sees pages
    plain = gdsdata.GDSDataset(root)
    assert plain.load_path.reads == "preadv"
    for _ in gdsdata.Loader(plain, 16, transform=gdsdata.CenterCrop(32)):
        pass
    total = sum((os.path.getsize(p) + mmap.PAGESIZE - 1) // mmap.PAGESIZE for p in files)
    assert sum(resident(p) for p in files) > total // 2


def test_direct_batches_equal_the_buffered_batches_and_survive_pickling(photos_dataset):
    _, _, root = photos_dataset
    with gdsdata.settings.set(io_engine="direct"):
        ds = gdsdata.GDSDataset(root)
    plain = gdsdata.GDSDataset(root)
    for (a, la), (b, lb) in zip(gdsdata.Loader(ds, 7, transform=gdsdata.CenterCrop(48)),
                                gdsdata.Loader(plain, 7, transform=gdsdata.CenterCrop(48))):
        assert torch.equal(a, b) and torch.equal(la, lb)
    copy = pickle.loads(pickle.dumps(ds))  # as DataLoader workers get it
    assert copy.load_path.reads == "direct"
    image, label = copy[5]
    assert torch.equal(image, plain[5][0]) and label == plain[5][1]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, sampler=range(0, len(ds), 9))
    for k, (image, label) in zip(range(0, len(ds), 9), loader):
        assert torch.equal(image, plain[k][0])


def _direct(root):
    with gdsdata.settings.set(io_engine="direct"):
        return gdsdata.GDSDataset(root)


def _same_epochs(streamed, cached, epochs, batches):
    """``epochs`` epochs of two Loaders give the same ``batches`` batches, pixels and labels."""
    for epoch in range(epochs):
        streamed.set_epoch(epoch)
        cached.set_epoch(epoch)
        got, want = list(streamed), list(cached)
        assert len(got) == len(want) == batches
        for (a, la), (b, lb) in zip(got, want):
            assert torch.equal(a, b) and torch.equal(la, lb)


def test_streaming_loaders_read_two_batches_at_once_and_hand_them_on_in_order(photos_dataset):
    """reads=direct: the I/O thread keeps the direct_ahead setting's bytes in flight, two to eight
    batches (loader._read_overlap); epochs, their order and their ends are those of the
    one-batch-at-a-time reads."""
    from conftest import loader_threads
    from gdsdata.loader import _read_overlap

    _, _, root = photos_dataset
    ds, plain = _direct(root), gdsdata.GDSDataset(root)
    batch_bytes = int(ds.index.samples["length"].mean() * 5)
    assert (_read_overlap(ds, 5), _read_overlap(plain, 5)) == (8, 1)  # small samples: the most batches
    with gdsdata.settings.set(direct_ahead=3 * batch_bytes):
        assert _read_overlap(_direct(root), 5) == 3
    with gdsdata.settings.set(direct_ahead=1):
        assert _read_overlap(_direct(root), 5) == 2
    streamed = gdsdata.Loader(ds, 5, shuffle=True, transform=gdsdata.CenterCrop(40))
    cached = gdsdata.Loader(plain, 5, shuffle=True, transform=gdsdata.CenterCrop(40))
    _same_epochs(streamed, cached, 3, 12)
    for k, _ in enumerate(streamed):  # left early: the threads end, the staging comes back
        if k == 2:
            break
    del streamed, cached
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loader_threads()


def test_a_loader_reserves_the_staging_its_queues_can_hold(photos_dataset):
    """The GPU path's staging pool is sized from the Loader's depths (reserve_staging), not from a
    constant that silently depends on them."""
    from gdsdata.io.gpu import SlotPool

    _, _, root = photos_dataset
    for ds, pixels, expected in ((gdsdata.GDSDataset(root), False, 6),
                                 (_direct(root), False, 13),  # streaming: 8 batches in flight, not 1
                                 (gdsdata.GDSDataset(root), True, 9)):
        seen = []
        ds.reserve_staging = seen.append
        loader = gdsdata.Loader(ds, 5, pixels=pixels, prefetch=2, transform=None if pixels else gdsdata.CenterCrop(40))
        next(iter(loader))
        assert seen == [expected]
    pool = SlotPool("device", torch.device("cuda", 0))  # nothing allocated until a buffer is acquired
    pool.reserve(7)
    pool.reserve(3)
    assert pool.spare == 9


@pytest.mark.parametrize("code", [errno.EIO, errno.ETIMEDOUT])  # ETIMEDOUT: an OSError that is a TimeoutError
def test_a_streaming_read_that_fails_arrives_after_the_batches_before_it(photos_dataset, code):
    _, _, root = photos_dataset
    ds = _direct(root)
    original, calls = ds.read_staged, {"n": 0}

    def read_staged(indices):  # batches read on several threads at once: batch 3 (of 5 samples) fails
        calls["n"] += 1
        if 15 in indices:
            raise OSError(code, f"{os.strerror(code)} (the drive)")
        return original(indices)

    ds.read_staged = read_staged
    got = 0
    with pytest.raises(OSError, match=os.strerror(code)):
        for _ in gdsdata.Loader(ds, 5, shuffle=None, transform=gdsdata.CenterCrop(40)):
            got += 1
    assert got == 3


def test_a_stuck_streaming_read_names_the_io_thread_and_its_call(photos_dataset):
    from gdsdata import stall

    _, _, root = photos_dataset
    ds = _direct(root)
    original, calls, release = ds.read_staged, {"n": 0}, threading.Event()

    def read_staged(indices):
        calls["n"] += 1
        if 10 in indices:  # batch 2
            with stall.native("pread (O_DIRECT)"):
                release.wait(60)
        return original(indices)

    ds.read_staged = read_staged
    got = 0
    try:
        with gdsdata.settings.set(stall_timeout=1.5), pytest.raises(gdsdata.StallError) as caught:
            for _ in gdsdata.Loader(ds, 5, shuffle=None, transform=gdsdata.CenterCrop(40)):
                got += 1
    finally:
        release.set()
    message = str(caught.value)
    assert got == 2 and "I/O thread" in message and "batch 2 of epoch 0" in message
    assert "pread (O_DIRECT)" in message


def test_datasets_larger_than_half_the_memory_stream(photos_dataset):
    config = gdsdata.settings.snapshot()
    small, big = cpu_path(True, config, shard_bytes=10, memory=100), cpu_path(True, config, shard_bytes=60, memory=100)
    assert small.reads == "preadv" and big.reads == "direct"
    assert "more than half the host's memory" in big.why[0]
    with gdsdata.settings.set(io_engine="direct"):
        assert cpu_path(True, gdsdata.settings.snapshot(), shard_bytes=1, memory=100).reads == "direct"
    with gdsdata.settings.set(io_engine="mixed"):  # a GPU path's engine: cached on the CPU too, and said so
        kept = cpu_path(True, gdsdata.settings.snapshot(), shard_bytes=60, memory=100)
        assert kept.reads == "preadv" and "io_engine=mixed is a GPU path's engine" in kept.why[0]
    machine = Machine("cuda:0", "compat", "no nvidia_fs", True, "cuMemcpyBatchAsync_v2", 100, True)
    for raw in (False, True):
        path = resolve(machine, config, all_raw=raw, shard_bytes=60)
        assert (path.reads, path.staging) == ("direct", "host"), path
        assert any("O_DIRECT" in line for line in path.why)
    assert resolve(machine, config, all_raw=False, shard_bytes=10).reads == "mixed"
    gds = Machine("cuda:0", "gds", "GDS", True, "", 100, True)
    assert resolve(gds, config, all_raw=False, shard_bytes=60).reads == "kvikio"  # GDS reads past the cache itself
    with gdsdata.settings.set(io_engine="direct", staging="device"):
        with pytest.raises(ValueError, match="io_engine=direct reads into host memory"):
            resolve(machine, gdsdata.settings.snapshot(), all_raw=False, shard_bytes=1)
    with gdsdata.settings.set(io_engine="direct"):
        assert resolve(machine, gdsdata.settings.snapshot(), all_raw=True, shard_bytes=1).staging == "host"


@pytest.mark.gpu
def test_direct_reads_on_the_gpu_path(photos_dataset):
    _, _, root = photos_dataset
    files = shard_files(root)
    evict(files)
    with gdsdata.settings.set(io_engine="direct"):
        ds = gdsdata.GDSDataset(root, device="cuda")
    assert ds.load_path.reads == "direct" and ds.load_path.staging == "host"
    plain = gdsdata.GDSDataset(root, device="cuda")
    for (a, _), (b, _) in zip(gdsdata.Loader(ds, 16, transform=gdsdata.CenterCrop(32)),
                              gdsdata.Loader(plain, 16, transform=gdsdata.CenterCrop(32))):
        assert torch.equal(a, b)
    # block shuffle: windows copied into pinned staging
    spec = dict(shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(32))
    _same_epochs(gdsdata.Loader(ds, 5, **spec), gdsdata.Loader(plain, 5, **spec), 2, 12)


def test_direct_reads_keep_to_the_open_file_budget(photos_dataset, tmp_path):
    """A batch over many shards with room for two open files: each shard is held only while a piece
    of it is read, so the least recently used ones close as others open."""
    src, _, _ = photos_dataset
    root = str(tmp_path / "many")
    gdsdata.pack(src, root, workers=2, shard_size=64 * 1024)
    index = load_index(root)
    assert len(index.shards) > 8
    expected, plan = CpuReader(index).read(np.arange(len(index.samples)))
    reader = CpuReader(index, max_open=2, direct=True)
    got, _ = reader.read(np.arange(len(index.samples)))
    assert np.array_equal(got[:plan.total], expected[:plan.total])
    assert len(reader._direct._files) <= 2 + gdsdata.settings.get("direct_depth")
    reader.close()


def test_the_loader_counts_the_bytes_its_reads_cover(photos_dataset):
    """``stats()["read_bytes"]``: at least every sample's bytes over an epoch (more: alignment, the
    holes read through, the next epoch's first batches read ahead); ``load_path.past_cache`` says
    which reads come from the drive (test_plan: they join only small holes)."""
    _, _, root = photos_dataset
    ds, plain = _direct(root), gdsdata.GDSDataset(root)
    assert ds.load_path.past_cache and not plain.load_path.past_cache
    counted = []
    for dataset in (ds, plain):
        loader = gdsdata.Loader(dataset, 5, shuffle="block", transform=gdsdata.CenterCrop(40))
        for _ in loader:
            pass
        counted.append(loader.stats()["read_bytes"])
        loader.close()
    assert min(counted) >= int(ds.index.samples["length"].sum())
    ds.close()
    plain.close()


def _recorded_plans(monkeypatch):
    """Every plan DirectReads reads from the drive, as (reads, bytes, the plan)."""
    plans, real = [], direct.DirectReads.read

    def read(self, plan, dest):
        plans.append((len(plan.sizes), int(plan.total), plan))
        return real(self, plan, dest)

    monkeypatch.setattr(direct.DirectReads, "read", read)
    return plans


def test_block_shuffled_streaming_batches_are_read_a_window_at_a_time(photos_dataset, mode, monkeypatch):
    """reads=direct, shuffle="block": the samples of each shuffle window are read through one
    ``read_window`` (their joint plan: whole blocks, a read per block or fewer, where each batch
    alone would read its samples one by one) and each batch is copied from it: the same batches, in
    the same order, as through the page cache, every sample's bytes read from the drive once."""
    from gdsdata.loader import _windowed

    _, _, root = photos_dataset
    ds, plain = _direct(root), gdsdata.GDSDataset(root)
    spec = dict(shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(40))
    streamed, cached = gdsdata.Loader(ds, 4, **spec), gdsdata.Loader(plain, 4, **spec)
    assert _windowed(ds, streamed.spec) and not _windowed(plain, cached.spec)
    assert not _windowed(ds, gdsdata.Loader(ds, 12, **spec).spec)  # a batch of a whole window reads blocks itself
    plans = _recorded_plans(monkeypatch)
    _same_epochs(streamed, cached, 2, 15)
    streamed.close()
    windows = len(ds) // 12
    assert len(plans) >= 2 * windows  # (and the next epoch's first windows, read ahead)
    assert len({id(plan) for *_, plan in plans}) == len(plans)  # no window read twice
    assert all(reads <= 2 * 2 + 2 for reads, *_ in plans)  # a window: its 2 blocks, cut at shard ends
    epoch_bytes = sum(size for _, size, _ in plans[:windows])
    assert epoch_bytes < 1.1 * int(ds.index.samples["length"].sum()) + len(ds) * ds.index.alignment
    ds.close()
    plain.close()


@pytest.mark.parametrize("batch,world,rank", [(5, 1, 0), (7, 1, 0), (4, 2, 1), (5, 3, 2)])
def test_windows_serve_batches_that_straddle_them(photos_dataset, monkeypatch, batch, world, rank):
    """Batch sizes that do not divide a window, and DDP shares that start inside one: a batch across
    the end of one window and the start of the next is filled from both; every read from the drive
    is a window's (no batch reads on its own), and the batches are those of the page cache."""
    _, _, root = photos_dataset
    ds, plain = _direct(root), gdsdata.GDSDataset(root)
    spec = dict(shuffle="block", block_size=6, window=2, world_size=world, rank=rank,
                transform=gdsdata.CenterCrop(40))
    streamed, cached = gdsdata.Loader(ds, batch, **spec), gdsdata.Loader(plain, batch, **spec)
    plans, spans, real_fill = _recorded_plans(monkeypatch), [], direct.fill

    def fill(windows, plan, dest):
        spans.append(len(windows))
        return real_fill(windows, plan, dest)

    monkeypatch.setattr(direct, "fill", fill)
    _same_epochs(streamed, cached, 2, len(cached))
    streamed.close()
    assert all(reads <= 6 for reads, *_ in plans)  # whole blocks (cut at shard ends): windows only
    assert len({id(plan) for *_, plan in plans}) == len(plans)  # none read twice (ahead, then by a batch)
    assert max(spans) == 2 and min(spans) >= 1  # some batches filled from two windows
    ds.close()
    plain.close()


def test_a_resumed_streaming_epoch_reads_its_windows(photos_dataset, monkeypatch):
    """A Loader resumed mid-epoch (state_dict) streams the rest of the epoch through windows of the
    samples left: the batches of an uninterrupted epoch."""
    _, _, root = photos_dataset
    ds, plain = _direct(root), gdsdata.GDSDataset(root)
    spec = dict(shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(40))
    first = gdsdata.Loader(ds, 5, **spec)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    first.close()
    resumed, whole = gdsdata.Loader(ds, 5, **spec), list(gdsdata.Loader(plain, 5, **spec))
    resumed.load_state_dict(state)
    plans = _recorded_plans(monkeypatch)
    rest = list(resumed)
    assert len(rest) == len(whole) - 4
    for (a, la), (b, lb) in zip(rest, whole[4:]):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert plans and all(reads <= 6 for reads, *_ in plans)
    resumed.close()
    ds.close()
    plain.close()


def test_a_window_fills_the_batches_it_holds_and_refuses_the_others(photos_dataset):
    """``direct.fill`` copies exactly what a direct read of the batch's plan reads (every sample's
    bytes), from one window or from two that each hold part of the batch; a plan with a sample no
    window holds (a replacement) is refused, and read from the drive instead."""
    _, _, root = photos_dataset
    reader = CpuReader(load_index(root), direct=True)
    rng = np.random.default_rng(3)
    batches = [sorted(rng.choice(60, 7, replace=False).tolist()) for _ in range(3)]
    whole = reader.window(reader.plan([i for b in batches for i in b]), len(batches))
    halves = [reader.window(reader.plan(sorted({i for b in batches for i in b[part::2]})), len(batches))
              for part in (0, 1)]
    for batch in batches:
        plan = reader.plan(batch)
        read = direct.aligned_empty(plan.total)
        reader._direct_reads().read(plan, read)
        for windows in ([whole], halves):
            filled = direct.aligned_empty(plan.total)
            assert direct.fill(windows, plan, filled)
            for start, length in zip(plan.sample_offsets.tolist(), plan.sample_lengths.tolist()):
                assert np.array_equal(filled[start:start + length], read[start:start + length])
    outside = next(i for i in range(60) if all(i not in b for b in batches))
    plan = reader.plan([batches[0][0], outside])
    assert not direct.fill([reader.window(reader.plan(batches[0]), 1)], plan, direct.aligned_empty(plan.total))
    buffer, plan = reader.read([batches[0][0], outside], [reader.window(reader.plan(batches[0]), 1)])
    plain = CpuReader(load_index(root))
    want, want_plan = plain.read([batches[0][0], outside])
    for k in range(2):
        got_at, want_at = int(plan.sample_offsets[k]), int(want_plan.sample_offsets[k])
        length = int(plan.sample_lengths[k])
        assert np.array_equal(buffer[got_at:got_at + length], want[want_at:want_at + length])
    reader.close()
    plain.close()


def test_a_window_that_fails_to_read_raises_in_order_instead_of_hanging(photos_dataset, monkeypatch):
    _, _, root = photos_dataset
    ds = _direct(root)
    real = direct.DirectReads.read
    seen = []

    def read(self, plan, dest):
        seen.append(plan.total)
        if len(seen) == 2:  # the second window
            raise OSError(errno.EIO, "Input/output error (the drive)")
        return real(self, plan, dest)

    monkeypatch.setattr(direct.DirectReads, "read", read)
    got = 0
    with pytest.raises(OSError, match="Input/output error"):
        for _ in gdsdata.Loader(ds, 4, shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(40)):
            got += 1
    assert got == 3  # the first window's batches, then the second's error
    ds.close()


def test_on_error_skip_streams_through_windows(photos_dataset, tmp_path):
    """A sample whose checksum fails in a window is replaced (read on its own) and the batches are
    those of the page cache with the same damage."""
    from conftest import damaged_copy

    _, _, root = photos_dataset
    bad = damaged_copy(root, str(tmp_path / "bad"), 17, 100, b"\x00\x11\x22\x33")
    with gdsdata.settings.set(io_engine="direct"):
        ds = gdsdata.GDSDataset(bad, on_error="skip")
    plain = gdsdata.GDSDataset(bad, on_error="skip")
    spec = dict(shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(40))
    streamed, cached = gdsdata.Loader(ds, 5, **spec), gdsdata.Loader(plain, 5, **spec)
    _same_epochs(streamed, cached, 2, 12)
    assert streamed.skipped == cached.skipped == {0: 1, 1: 1}
    ds.close()
    plain.close()


def test_closing_a_loader_under_a_window_read_ahead_reads_no_more(photos_dataset, monkeypatch):
    """A pass stopped while windows are read ahead: the read under way ends before the pass does, the
    windows not yet started are not read, and once the dataset closes no shard descriptor is open."""
    _, _, root = photos_dataset
    ds = _direct(root)
    real, started = direct.DirectReads.read, []

    def slow(self, plan, dest):
        started.append(time.monotonic())
        time.sleep(0.3)  # a slow drive: the read ahead is still under way when the dataset closes
        return real(self, plan, dest)

    monkeypatch.setattr(direct.DirectReads, "read", slow)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):  # (the first pass also starts the pools: its timing differs)
        loader = gdsdata.Loader(ds, 3, shuffle="block", block_size=6, window=2, transform=gdsdata.CenterCrop(16))
        next(iter(loader))
        closing = time.monotonic()
        loader.close()
        closed = time.monotonic()
        # the window under way finishes; none starts once the pass has seen the stop (within its poll)
        assert not [t for t in started if t > closing + 0.2]
        assert closed - closing < 0.5  # the window under way at most, not the next one too
    ds.close()
    time.sleep(0.4)
    assert not [t for t in started if t > closing + 0.2]
    assert len(os.listdir("/proc/self/fd")) <= before


def test_close_leaves_a_context_with_reads_still_in_the_kernel(caplog):
    """Destroying an AIO context waits for its requests (io_destroy): one whose reads a drive that
    stopped answering holds (a reader left behind by a StallError) stays, with its shards, rather
    than close() and the program waiting for good; idle contexts are destroyed."""
    from types import SimpleNamespace

    class Context:
        def __init__(self, in_flight):
            self.in_flight, self.closed = in_flight, False

        def close(self):
            self.closed = True

    reads = direct.DirectReads.__new__(direct.DirectReads)
    idle, stuck = Context(0), Context(3)
    files = SimpleNamespace(closed=False, close=lambda: setattr(files, "closed", True))
    reads._pool = SimpleNamespace(shutdown=lambda wait_s: True)
    reads._lock, reads._contexts, reads._idle, reads._files = threading.Lock(), [idle, stuck], [idle], files
    reads.index = SimpleNamespace(root="/data/ds")
    with caplog.at_level("ERROR", logger="gdsdata.io.direct"):
        reads.close()
    assert idle.closed and not stuck.closed and not files.closed
    assert "3 direct read(s) of /data/ds still in the kernel: their contexts and shards stay open" in caplog.text


@pytest.mark.parametrize("checksums", [False, True])
def test_a_shard_read_buffered_after_o_direct_refused_it_is_still_the_one_opened(tmp_path, monkeypatch, checksums):
    """O_DIRECT refusing a read (a device whose block is larger than the dataset's alignment) makes
    the reader reopen the shard through the page cache: the file it had open, not whatever its path
    names now. Packed again with --overwrite meanwhile, the path is another dataset's shard, whose
    pixels would come under the old index's labels (checksums off) or as a "changed bytes" error."""
    import fcntl

    from conftest import write_photos
    from PIL import Image
    from gdsdata.errors import FormatError
    from gdsdata.packing.packer import pack

    first, second, out = tmp_path / "first", tmp_path / "second", str(tmp_path / "ds")
    write_photos(str(first), 4, classes=1, start_seed=10)
    write_photos(str(second), 4, classes=1, start_seed=20)  # the same names, other pictures
    pack(str(first), out, workers=1)
    refuse = threading.Event()
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):  # once set, the device refuses O_DIRECT reads
        if refuse.is_set() and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    reopened, real_buffered = [], direct._buffered

    def buffered(path, fd_open=None):
        reopened.append(fd_open)
        return real_buffered(path, fd_open)

    monkeypatch.setattr(direct, "_buffered", buffered)
    try:
        from gdsdata._native import aio

        real_reap = aio.Context.reap
        monkeypatch.setattr(aio.Context, "reap", lambda self, wait_s: [
            (slot, -errno.EINVAL if refuse.is_set() else got) for slot, got in real_reap(self, wait_s)])
    except ImportError:
        pass
    with gdsdata.settings.set(io_engine="direct"):
        ds = gdsdata.GDSDataset(out, verify_checksums=checksums)
        ds[1]  # the shard opened with O_DIRECT, its header checked
        if reopened:
            pytest.skip("this filesystem refuses O_DIRECT: shards are read through the page cache from the start")
        pack(str(second), out, workers=1, overwrite=True)
        refuse.set()
        try:
            image, _ = ds[0]
        except FormatError as e:
            assert "not the shard this dataset's index was loaded with" in str(e)
        else:  # the old dataset's pixels, as the index says
            expected = np.asarray(Image.open(first / ds.source(0)).convert("RGB"))
            assert np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected).max() <= 1
        assert reopened and reopened[-1] is not None  # the reopen of the shard it had open was what ran
        ds.close()
