#!/usr/bin/env python3
"""Where the time of a raw batch goes on the GPU path, stage by stage (page cache warm).

For a raw-codec dataset (packed by bench/gpu.py, or here): storage -> staging alone for each staging
kind, I/O engine and thread count, in shuffled and in file order; the pinned -> GPU copy of one
batch alone; and the whole Loader (random-resized-crop 224, flip, normalise fp16) per engine. The
reference is one plain kvikio pread of each whole shard into GPU memory. Medians of several passes.

    python bench/io_paths.py --dir /tmp/bench
"""

import argparse
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (kvikio_pread_epoch, loader_epoch, print_stages, print_system_block,  # noqa: E402
                    shard_paths, system_block, warm)

import gdsdata  # noqa: E402
from gdsdata import settings  # noqa: E402

BATCH = 256


def median_rate(fn, nbytes, runs=5):
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def batches(n, shuffle, count):
    order = np.random.default_rng(0).permutation(n) if shuffle else np.arange(n)
    return [order[k * BATCH:(k + 1) * BATCH].tolist() for k in range(min(count, n // BATCH))]


def read_epoch(ds, shuffle, count):
    """An epoch of up to ``count`` batches read into staging buffers and handed straight back
    (``epoch.batches`` of them), and the bytes it reads."""
    work, backend = batches(len(ds), shuffle, count), ds._backend
    nbytes = sum(int(ds.index.samples["length"][b].sum()) for b in work)

    def epoch():
        for indices in work:
            backend.release(backend.read(indices))
        torch.cuda.synchronize()  # reads still in flight on a CUDA stream (mapped) count

    epoch.batches = len(work)
    return epoch, nbytes


def read_stage(root, staging, engine, threads, shuffle, count=40, pool=0, kvikio_config=None):
    """Batches read into staging buffers and nothing else. ``kvikio_config``: kvikio defaults for the
    run, e.g. ``task_size`` (how a read is split over kvikio's threads; 4 MiB by default, so a 33 MB
    read of a file-order batch is 8 tasks) or ``gds_threshold`` (reads into GPU memory smaller than
    this skip the thread pool and run on the calling thread; gdsdata lowers it to the alignment)."""
    import contextlib

    with settings.set(staging=staging, io_engine=engine, io_threads=threads, gather_pool=pool):
        ds = gdsdata.GDSDataset(root, device="cuda")
        epoch, nbytes = read_epoch(ds, shuffle, count)
        configured = contextlib.nullcontext()
        if kvikio_config:
            import kvikio.defaults

            configured = kvikio.defaults.set(kvikio_config)
        with configured:
            rate = median_rate(epoch, nbytes)
        ds.close()
    return rate


def read_stage_beside(root, side, count=40, pool=0):
    """Shuffled reads (pinned staging, page gather) while another thread keeps doing ``side``:
    "copy" uploads pinned batches to the GPU back to back (memory bandwidth shared with the copy
    engine), "python" keeps a core busy with numpy and Python (what the decode thread does)."""
    with settings.set(staging="host", io_engine="mmap"):
        ds = gdsdata.GDSDataset(root, device="cuda")
    epoch, nbytes = read_epoch(ds, True, count)
    stop = threading.Event()

    def copies():
        pinned = torch.empty(nbytes // epoch.batches, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                pinned.to("cuda", non_blocking=True)
                stream.synchronize()

    def python():
        while not stop.is_set():
            np.random.default_rng(0).random(20000).sum()

    helper = threading.Thread(target={"copy": copies, "python": python}[side], daemon=True)
    helper.start()
    with settings.set(gather_pool=pool):
        rate = median_rate(epoch, nbytes)
    stop.set()
    helper.join()
    ds.close()
    return rate


def stage_times(root, transform, count=40):
    """One thread, no overlap, the automatic path: milliseconds per shuffled batch for reading,
    queuing the copy and the transform (host time), and waiting for the GPU to finish them; and the
    path's description."""
    ds = gdsdata.GDSDataset(root, device="cuda")
    path = ds._backend.describe()
    backend, stream = ds._backend, torch.cuda.current_stream()
    work = batches(len(ds), True, count)
    spent = np.zeros(3)
    for n, indices in enumerate(work):
        t0 = time.perf_counter()
        staged = backend.read(indices)
        t1 = time.perf_counter()
        batch = backend.decode(staged, stream)
        params = transform.params(batch.heights, batch.widths, indices)
        gdsdata.transforms.apply(transform, batch.buffer, batch.offsets, batch.heights, batch.widths,
                                 batch.channels, params)
        batch.release(stream)
        t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        if n >= 5:
            spent += (t1 - t0, t2 - t1, t3 - t2)
    ds.close()
    return (*(spent / (len(work) - 5) * 1000), path)


def loader_rate(root, engine, shuffle, transform, pool=0):
    staging = "device" if engine == "mapped" else "host"
    with settings.set(io_engine=engine, gather_pool=pool, staging=staging):
        ds = gdsdata.GDSDataset(root, device="cuda")
        epoch = loader_epoch(ds, transform, shuffle, BATCH)
        rate = median_rate(epoch, int(ds.index.samples["length"].sum()), runs=3)
        stats = epoch.loader.stats()
        epoch.close()
        ds.close()
    return rate, stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="folder holding raw.gds (bench/gpu.py makes it)")
    parser.add_argument("--dataset", default=None, help="a raw-codec dataset (default DIR/raw.gds)")
    parser.add_argument("--mapped-only", action="store_true", help="the reference and the mapped engine's rows only")
    args = parser.parse_args(argv)
    print_system_block(system_block())
    root = args.dataset or os.path.join(args.dir, "raw.gds")
    ds = gdsdata.GDSDataset(root)
    shards = shard_paths(ds)
    sample_bytes = float(ds.index.samples["length"].mean())
    ds.close()
    warm(shards)
    pread_all, total = kvikio_pread_epoch(shards, 16)
    reference = median_rate(pread_all, total)
    del pread_all
    print(f"\nmean sample {sample_bytes / 1e3:.0f} KB; plain kvikio pread of whole shards -> GPU (16 threads): "
          f"{reference / 1e9:.1f} GB/s\n")

    def row(name, rate):
        print(f"{name:<58} {rate / 1e9:6.1f} GB/s {rate / sample_bytes:9.0f} images/s "
              f"{rate / reference * 100:5.0f} %", flush=True)

    rrc = gdsdata.RandomResizedCrop(224, dtype="float16")
    if not args.mapped_only:
        pinned_paths(root, sample_bytes, row, rrc)
    mapped_paths(root, row, rrc)


def pinned_paths(root, sample_bytes, row, rrc):
    print(f"storage -> staging only (batches of 256, no decode, no copy; mmap gathers with torch's "
          f"{torch.get_num_threads()} threads)")
    for shuffle in (True, False):
        for staging, engine, threads in (("host", "mmap", 16), ("host", "kvikio", 16), ("host", "kvikio", 32),
                                         ("device", "kvikio", 16)):
            row(f"  {'shuffled' if shuffle else 'file order'} staging={staging} {engine} x{threads}",
                read_stage(root, staging, engine, threads, shuffle))
        for pool in (4, 8, 12):
            row(f"  {'shuffled' if shuffle else 'file order'} staging=host mmap, gather pool of {pool}",
                read_stage(root, "host", "mmap", 16, shuffle, pool=pool))
        order = "shuffled" if shuffle else "file order"
        for task in (1 << 20, 256 << 10):
            row(f"  {order} staging=host kvikio x16, {task >> 10} KiB tasks",
                read_stage(root, "host", "kvikio", 16, shuffle, kvikio_config={"task_size": task}))
        row(f"  {order} staging=device kvikio x16, kvikio's own gds_threshold (1 MiB)",
            read_stage(root, "device", "kvikio", 16, shuffle, kvikio_config={"gds_threshold": 1 << 20}))

    pinned = torch.empty(int(sample_bytes * BATCH), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()

    def upload():
        with torch.cuda.stream(stream):
            for _ in range(20):
                pinned.to("cuda", non_blocking=True)
        stream.synchronize()

    row("pinned -> GPU copy of one batch, alone", median_rate(upload, pinned.numel() * 20))

    for pool in (0, 8):
        for side in ("copy", "python"):
            row(f"read only, shuffled, mmap (gather pool {pool}), beside a thread doing {side}",
                read_stage_beside(root, side, pool=pool))

    read_ms, queue_ms, gpu_ms, path = stage_times(root, rrc)
    print(f"serial, per shuffled batch ({path}): read {read_ms:.2f} ms, queue copy + transform {queue_ms:.2f} ms, "
          f"GPU wait {gpu_ms:.2f} ms")
    print("\nwhole Loader, random-resized-crop 224 + flip + normalise fp16, pinned staging")
    for engine in ("mmap", "kvikio"):
        for shuffle in ("full", None):
            rate, stats = loader_rate(root, engine, shuffle, rrc)
            row(f"  Loader reads={engine}{' (torch threads)' if engine == 'mmap' else ''} shuffle={shuffle}", rate)
            print_stages(stats)
    for pool in (4, 8, 12):
        rate, stats = loader_rate(root, "mmap", "full", rrc, pool)
        row(f"  Loader reads=mmap shuffle=full, gather pool of {pool}", rate)
        print_stages(stats)
    rate, stats = loader_rate(root, "mmap", "full", None)
    row("  Loader reads=mmap (torch threads) shuffle=full, no transform (pixels=True)", rate)
    print_stages(stats)


def mapped_paths(root, row, rrc):
    print("\nio_engine=mapped, registered page-cache pages -> GPU staging: the copy engines take a batch's reads "
          "(dma: one cuMemcpyBatchAsync) or the SMs gather them (gather); each batch queued, not waited for")
    for copy in ("dma", "gather"):
        try:
            with settings.set(mapped_copy=copy):
                for shuffle in (True, False):
                    row(f"  read only, {'shuffled' if shuffle else 'file order'}, mapped ({copy})",
                        read_stage(root, "device", "mapped", 16, shuffle))
                for shuffle in ("full", None):
                    rate, stats = loader_rate(root, "mapped", shuffle, rrc)
                    row(f"  Loader reads=mapped ({copy}) shuffle={shuffle}", rate)
                    print_stages(stats)
        except Exception:  # noqa: BLE001 - say how it failed, and go on
            import traceback

            print(f"  mapped engine ({copy}) FAILED\n{traceback.format_exc()}")


if __name__ == "__main__":
    main()
