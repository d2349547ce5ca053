"""Storage -> staging: the GPU path's memory-map gather (pure host code, so it runs on the CPU)
reads exactly what the CPU reader's preads read, for any batch, and names a truncated shard."""

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
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
@given(data=st.data(), max_gap=st.sampled_from([0, 8192, 1 << 20]), pool=st.sampled_from([0, 1, 3]))
def test_mmap_gather_equals_preads(small_shards, data, max_gap, pool):
    """Both gathers (torch's page gather; a pool of threads taking reads in 1 MiB pieces)."""
    index = load_index(small_shards)
    assert len(index.shards) > 2
    indices = data.draw(st.lists(st.integers(0, len(index.samples) - 1), min_size=1, max_size=40))
    plan = plan_reads(index.samples, indices, index.alignment, max_gap, 1 << 30)
    with gdsdata.settings.set(max_gap=max_gap, max_read=1 << 30):
        expected, _ = CpuReader(index).read(indices)
    maps = ShardMaps(index)
    target = torch.full((plan.total,), 7, dtype=torch.uint8)
    with gdsdata.settings.set(gather_pool=pool):
        maps.gather(plan, target)
    assert np.array_equal(target.numpy(), expected)
    maps.close()


@pytest.mark.parametrize("pool", [0, 2])
def test_mmap_gather_names_a_truncated_shard(small_shards, tmp_path, pool):
    copy = str(tmp_path / "ds")
    shutil.copytree(small_shards, copy)
    index = load_index(copy)
    last = len(index.samples) - 1
    path = index.shard_path(int(index.samples[last]["shard"]))
    with open(path, "r+b") as f:
        f.truncate(int(index.samples[last]["offset"]) + 10)
    plan = plan_reads(index.samples, [last], index.alignment, 0, 1 << 30)
    maps = ShardMaps(index)
    with gdsdata.settings.set(gather_pool=pool), \
            pytest.raises(FormatError, match=rf"{os.path.basename(path)}: a read ends .* truncated shard"):
        maps.gather(plan, torch.empty(plan.total, dtype=torch.uint8))
    maps.close()


@pytest.mark.parametrize("setting, staging, io_mode, pool, threads, expected", [
    ("auto", "host", "compat", 8, 1, "mixed"),        # compatibility mode, pinned staging: per batch
    ("auto", "host", "compat", 0, 16, "mixed"),       # the gather on torch's threads
    ("auto", "host", "compat", 0, 1, "kvikio"),       # ... of which torchrun leaves one (OMP_NUM_THREADS=1)
    ("auto", "host", "unavailable", 0, 1, "mmap"),    # no kvikio installed: pinned staging still works
    ("auto", "host", "gds", 8, 16, "kvikio"),         # GDS
    ("auto", "device", "compat", 8, 16, "kvikio"),    # GPU staging
    ("kvikio", "host", "compat", 8, 16, "kvikio"),
    ("mmap", "host", "compat", 8, 1, "mmap"),
    ("mixed", "host", "compat", 0, 1, "mixed"),
])
def test_io_engine_choice(monkeypatch, setting, staging, io_mode, pool, threads, expected):
    from gdsdata.io import gpu as reader_gpu

    monkeypatch.setattr(reader_gpu.torch, "get_num_threads", lambda: threads)
    with gdsdata.settings.set(io_engine=setting, gather_pool=pool):
        assert reader_gpu.choose_engine(staging, io_mode) == expected
        # a raw dataset that suits the mapped engine changes the automatic choice on GPU staging only
        mapped = "mapped" if (setting, staging) == ("auto", "device") else expected
        assert reader_gpu.choose_engine(staging, io_mode, prefer_mapped=True) == mapped


def test_mapped_suits_raw_datasets_that_fit_in_memory(photos_dataset, tmp_path, monkeypatch):
    from gdsdata.io import gpu as reader_gpu

    src, _, jpeg = photos_dataset
    raw = str(tmp_path / "raw")
    gdsdata.pack(src, raw, options=gdsdata.PackOptions(codec="raw", raw_size=32), workers=1)
    try:
        import cupy  # noqa: F401
        have_cupy = True
    except ImportError:
        have_cupy = False
    assert not reader_gpu.mapped_suits(load_index(jpeg))  # JPEG decodes faster from pinned memory
    assert reader_gpu.mapped_suits(load_index(raw)) == have_cupy
    sysconf = os.sysconf
    monkeypatch.setattr(reader_gpu.os, "sysconf", lambda name: 1024 if name == "SC_PHYS_PAGES" else sysconf(name))
    assert not reader_gpu.mapped_suits(load_index(raw))  # more than half the host's memory


def test_mapped_engine_needs_gpu_staging():
    from gdsdata.io import gpu as reader_gpu

    with gdsdata.settings.set(io_engine="mapped"), pytest.raises(ValueError, match="it needs staging=device"):
        reader_gpu.choose_engine("host", "compat")
    with gdsdata.settings.set(io_engine="mapped"):
        assert reader_gpu.choose_engine("device", "compat") == "mapped"


def test_mmap_engine_cannot_fill_gpu_staging():
    from gdsdata.io import gpu as reader_gpu

    for engine in ("mmap", "mixed"):
        with gdsdata.settings.set(io_engine=engine), pytest.raises(ValueError, match="device staging needs kvikio"):
            reader_gpu.choose_engine("device", "compat")


@pytest.mark.parametrize("threads", [1, 3, 7, 500])
def test_pooled_gather_spans_cross_reads_and_shards(small_shards, threads):
    """The destination pages are cut into one span per thread wherever the cut falls: inside a read,
    across shards, or (more threads than pages) nowhere at all."""
    index = load_index(small_shards)
    indices = list(range(len(index.samples)))[::-1]
    with gdsdata.settings.set(max_gap=1 << 20, max_read=1 << 30, gather_pool=threads):
        expected, plan = CpuReader(index).read(indices)
        assert len({r.shard for r in plan.reads}) > 1 and max(r.size for r in plan.reads) > 4 * 4096
        maps = ShardMaps(index)
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
    """Without a driver that has cuMemcpyBatchAsync, asking for the batched copy names what it needs,
    and the mapped engine's automatic copy is the SMs' gather."""
    from gdsdata.commands import doctor
    from gdsdata._native import cuda as memcpy_batch
    from gdsdata.errors import GpuUnavailableError

    monkeypatch.setattr(memcpy_batch, "entry_point", lambda: None)
    with pytest.raises(GpuUnavailableError, match="cuMemcpyBatchAsync needs a driver for CUDA 12.8"):
        memcpy_batch.BatchCopy(0)
    assert doctor.mapped_copy() == "the SMs gather"
    with gdsdata.settings.set(mapped_copy="dma"):
        assert "missing from this driver" in doctor.mapped_copy()
    monkeypatch.setattr(memcpy_batch, "entry_point", lambda: "cuMemcpyBatchAsync_v2")
    assert doctor.mapped_copy() == "the copy engines (cuMemcpyBatchAsync_v2)"
