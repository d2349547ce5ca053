"""Storage -> staging: the GPU path's memory-map gather (pure host code, so it runs on the CPU)
reads exactly what the CPU reader's preads read, for any batch, and names a truncated shard."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from conftest import child_env, stand_in_driver
from hypothesis import strategies as st

import gdsdata
from gdsdata.errors import FormatError
from gdsdata.format.index import load as load_index
from gdsdata.io.plan import plan_reads
from gdsdata.io.cpu import CpuReader
from gdsdata.io.gpu import ShardMaps


@pytest.fixture(scope="module")
def small_shards(photos_dataset, tmp_path_factory):
    """The photos repacked into shards of a few samples each, so that batches span shards."""
    src, _, _ = photos_dataset
    out = str(tmp_path_factory.mktemp("reader") / "ds")
    gdsdata.pack(src, out, workers=2, shard_size=64 * 1024)
    return out


@hypothesis_settings(max_examples=60, deadline=None)
@given(data=st.data(), max_gap=st.sampled_from([0, 8192, 1 << 20]), threads=st.sampled_from([1, 3]))
def test_mmap_gather_equals_preads(small_shards, data, max_gap, threads):
    """The page gather, on the caller alone or with a pool, reads what preads read."""
    index = load_index(small_shards)
    assert len(index.shards) > 2
    indices = data.draw(st.lists(st.integers(0, len(index.samples) - 1), min_size=1, max_size=40))
    plan = plan_reads(index.samples, indices, index.alignment, max_gap, 1 << 30)
    with gdsdata.settings.set(max_gap=max_gap, max_read=1 << 30):
        expected, _ = CpuReader(index).read(indices)
    maps = ShardMaps(index, threads)
    target = torch.full((plan.total,), 7, dtype=torch.uint8)
    maps.gather(plan, target)
    assert np.array_equal(target.numpy(), expected)
    maps.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_mmap_gather_names_a_truncated_shard(small_shards, tmp_path, threads):
    copy = str(tmp_path / "ds")
    shutil.copytree(small_shards, copy)
    index = load_index(copy)
    last = len(index.samples) - 1
    path = index.shard_path(int(index.samples[last]["shard"]))
    with open(path, "r+b") as f:
        f.truncate(int(index.samples[last]["offset"]) + 10)
    plan = plan_reads(index.samples, [last], index.alignment, 0, 1 << 30)
    maps = ShardMaps(index, threads)
    with pytest.raises(FormatError, match=rf"{os.path.basename(path)}: a read ends .* truncated shard"):
        maps.gather(plan, torch.empty(plan.total, dtype=torch.uint8))
    maps.close()


@pytest.mark.parametrize("threads", [1, 3, 7, 500])
def test_pooled_gather_spans_cross_reads_and_shards(small_shards, threads):
    """The destination pages are cut into one span per thread wherever the cut falls: inside a read,
    across shards, or (more threads than pages) nowhere at all."""
    index = load_index(small_shards)
    indices = list(range(len(index.samples)))[::-1]
    with gdsdata.settings.set(max_gap=1 << 20, max_read=1 << 30):
        expected, plan = CpuReader(index).read(indices)
        assert len({r.shard for r in plan.reads}) > 1 and max(r.size for r in plan.reads) > 4 * 4096
        maps = ShardMaps(index, threads)
        target = torch.zeros(plan.total, dtype=torch.uint8)
        maps.gather(plan, target)
        maps.close()
    assert np.array_equal(target.numpy(), expected)


def test_an_emptied_shard_gives_a_one_line_error(small_shards, tmp_path):
    copy = str(tmp_path / "ds")
    shutil.copytree(small_shards, copy)
    index = load_index(copy)
    path = index.shard_path(0)
    open(path, "wb").close()
    maps = ShardMaps(index)
    plan = plan_reads(index.samples, [0], index.alignment, 0, 1 << 30)
    with pytest.raises(FormatError, match=rf"{os.path.basename(path)}: cannot map the shard"):
        maps.gather(plan, torch.empty(plan.total, dtype=torch.uint8))
    maps.close()


def test_batched_copy_says_what_is_missing(monkeypatch):
    """Without a driver that has cuMemcpyBatchAsync, asking for the batched copy names what it needs."""
    from gdsdata._native import cuda as memcpy_batch
    from gdsdata.errors import GpuUnavailableError

    monkeypatch.setattr(memcpy_batch, "entry_point", lambda: None)
    with pytest.raises(GpuUnavailableError, match="cuMemcpyBatchAsync needs a driver for CUDA 12.8"):
        memcpy_batch.BatchCopy(0)


_CONTEXTS_DRIVER = r"""
#include <stdint.h>
static __thread uintptr_t current = 0;  /* each thread's current context, none at first */
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(uintptr_t *context, int device) { *context = 0x1000 + device; return 0; }
int cuCtxGetCurrent(uintptr_t *context) { *context = current; return 0; }
int cuCtxSetCurrent(uintptr_t context) { current = context; return 0; }
int cuStreamCreate(uintptr_t *stream, unsigned flags) {  /* 201: CUDA_ERROR_INVALID_CONTEXT */
    if (!current) return 201; *stream = (current << 8) | flags; return 0; }
int cuGetErrorName(int error, const char **name) { *name = "CUDA_ERROR_INVALID_CONTEXT"; return 0; }
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                    reason="needs Linux and a C compiler")
def test_a_stream_of_its_own_is_made_in_the_device_s_primary_context(tmp_path):
    """``new_stream`` (the decoder's output memory: decode/gpu.py) asks the driver for a non-blocking
    stream in the device's primary context, made current for the call on a thread with none or
    another device's, and leaves the thread's context as it found it (a stand-in driver here)."""
    library = stand_in_driver(tmp_path, "contexts", _CONTEXTS_DRIVER)
    (tmp_path / "found").mkdir()
    (tmp_path / "found" / "libcuda.so.1").symlink_to(library)
    code = ("import ctypes, json; from gdsdata._native import cuda; lib = cuda._driver(); c = ctypes.c_void_p()\n"
            "def current():\n    lib.cuCtxGetCurrent(ctypes.byref(c)); return c.value\n"
            "first = cuda.new_stream(1); then = current()\n"
            "lib.cuCtxSetCurrent(ctypes.c_void_p(0x1000)); second = cuda.new_stream(2)\n"
            "print(json.dumps([first, then, second, current()]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(LD_LIBRARY_PATH=str(tmp_path / "found")))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == [(0x1001 << 8) | 1, None, (0x1002 << 8) | 1, 0x1000]


def test_a_dataset_dropped_without_close_gives_its_descriptors_back_at_once(photos_dataset):
    """A dataset dropped without close() closes its shards as it goes (the reader's opener pointed
    back at the reader: a cycle only the garbage collector broke, with every shard held till then)."""
    import gc

    _, _, root = photos_dataset
    gc.collect()
    gc.disable()
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            ds = gdsdata.GDSDataset(root)
            ds[0], ds[len(ds) - 1]  # (two shards open)
            del ds
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        gc.enable()
