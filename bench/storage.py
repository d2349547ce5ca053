#!/usr/bin/env python3
"""Storage-bound epochs: every epoch from storage, beside what the storage itself gives.

Each row starts cold (the page cache dropped, or, without the root that needs, the dataset's files
evicted from it) with a fresh dataset object, and times one epoch of --batch batches:

  limit        the storage's own rate over the same shards: ``dd iflag=direct bs=16M`` one shard after
               another, and a parallel direct read of every shard in blocks of each of --blocks
               (1, 4 and 16 MiB) with each of --threads requests in flight (16 and 64: some drives
               give their rate only at a deep queue), repeated over the shards for at least a second;
               the best of these is the limit the rows are a fraction of
  gdsdata      Loader epochs over the JPEG pack and the raw pack (``tools/make_images.py`` images),
               shuffle full and block, reads ``direct`` (streaming: past the page cache) and the
               cached engine the automatic choice takes for a dataset that fits in memory
  dali         where ``nvidia.dali`` imports: DALI's file reader + mixed decode training pipeline
               (bench/peers.py) over the same images as files, each epoch after the cache is dropped

Per row: images/s, the shards' bytes per second (each epoch reads every sample's pages once), that
as a fraction of the limit, the time to the first batch, how many bytes the epoch's planned reads
cover against the shards' (holes read through to join samples come from the drive when reads go
past the page cache), how much the page cache grew during the timed epochs (``Cached`` in
/proc/meminfo), and how many of the shards' pages are cached after it (``mincore``). A warm-up epoch
of each dataset runs first (untimed; the GPU, nvJPEG and the pools started). Streaming rows time
--epochs epochs back to back (each from the drive; the time to the first batch is paid once, as in
training); cached rows one (the next would come from the cache). Rows repeat --runs times (each
cold); figures are medians.

    python bench/storage.py --dir /tmp/storage --count 10000 --out results/
"""

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (begin, drop_caches, image_set, loader_epoch, page_cache_bytes, resident_pages,  # noqa: E402
                    shard_paths)

import gdsdata  # noqa: E402

BLOCK = 16 << 20


def dd_rate(paths) -> float:
    """Bytes/s of ``dd iflag=direct bs=16M`` over ``paths``, one after another."""
    total, t0 = 0, time.perf_counter()
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                       capture_output=True)
        total += os.path.getsize(p)
    return total / (time.perf_counter() - t0)


def parallel_direct_rate(paths, threads, block=BLOCK, seconds=1.0) -> float:
    """Bytes/s of O_DIRECT reads of every shard in ``block`` pieces, ``threads`` in flight, the
    shards read over again until ``seconds`` have passed (a pass over a small pack is over before a
    deep queue has filled)."""
    buffers = [np.frombuffer(mmap.mmap(-1, block), np.uint8) for _ in range(threads)]  # page aligned
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), block)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}
    passes = [0]

    def worker(t):  # thread t reads jobs t, t + threads, ... into its own buffer
        done = 0
        for p, off in jobs[t::threads]:
            done += os.preadv(fds[p], [memoryview(buffers[t])], off)
        return done

    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            total = 0
            while not passes[0] or time.perf_counter() - t0 < seconds:
                total += sum(pool.map(worker, range(threads)))
                passes[0] += 1
            return total / (time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)


def prepare(args):
    src = image_set(os.path.join(args.dir, "images"), args.count, classes=100, noise=args.noise, quality=92)
    roots = {"JPEG": os.path.join(args.dir, "jpeg.gds"), "raw": os.path.join(args.dir, "raw.gds")}
    for kind, root in roots.items():
        if not os.path.exists(os.path.join(root, "index.gdsi")):
            options = gdsdata.PackOptions(codec="raw", raw_size=256) if kind == "raw" else None
            gdsdata.pack(src, root, overwrite=True, options=options)
    return src, roots


def dali_cold(src, args, paths, limit):
    """The DALI row (None where DALI does not import): its training pipeline over the image files,
    a warm-up epoch, then --runs epochs each after the page cache is dropped."""
    try:
        import peers

        pipe = peers.dali(src, args.batch, args.dali_threads)["DALI train pipeline (rrc 224, flip, norm fp16)"]
    except ImportError:
        return None
    files = [os.path.join(d, f) for d, _, names in os.walk(src) for f in names]
    nbytes = sum(os.path.getsize(f) for f in files)
    epoch = peers.dali_epoch(pipe, len(files), args.batch)
    epoch()
    runs = []
    for _ in range(args.runs):
        how = drop_caches(paths + files)
        cached0 = page_cache_bytes()
        t0 = time.perf_counter()
        epoch()
        runs.append((time.perf_counter() - t0, page_cache_bytes() - cached0, how))
    seconds = statistics.median(r[0] for r in runs)
    row = {"kind": "JPEG", "row": "dali", "cold": runs[0][2], "images_per_s": len(files) / seconds,
           "bytes_per_s": nbytes / seconds, "of_limit": nbytes / seconds / limit,
           "cache_growth_mib": statistics.median(r[1] for r in runs) / 2**20,
           "rates": [len(files) / r[0] for r in runs]}
    print(f"JPEG DALI files, random shuffle {row['images_per_s']:8.0f} images/s {row['bytes_per_s'] / 1e9:5.2f} GB/s "
          f"= {row['of_limit']:.2f} of the limit; page cache +{row['cache_growth_mib']:.0f} MiB ({row['cold']})",
          flush=True)
    return row


def planned_bytes(ds, shuffle, batch, epoch=0) -> int:
    """The bytes the plans of one epoch's reads cover (holes and alignment included), as the dataset
    and a Loader plan them (each batch, or each shuffle window of block-shuffled streaming batches):
    against the shards' bytes, what the reads cost the drive."""
    from gdsdata.io.plan import max_gap, plan_reads
    from gdsdata.loader import _windowed
    from gdsdata.sampler import ShardSpec, epoch_order, window_numbers

    spec = ShardSpec(len(ds), batch_size=batch, shuffle=shuffle)
    order = epoch_order(spec, epoch)
    if _windowed(ds, spec):  # one plan a window
        numbers = window_numbers(spec, epoch)[order]
        cuts = np.r_[0, np.flatnonzero(numbers[1:] != numbers[:-1]) + 1, len(order)]
    else:
        cuts = np.r_[np.arange(0, len(order), batch), len(order)]
    gap = max_gap(ds.settings, ds.load_path.past_cache)
    return sum(int(plan_reads(ds.index.samples, order[lo:hi], ds.index.alignment, gap,
                              ds.settings["max_read"]).total) for lo, hi in zip(cuts[:-1], cuts[1:]))


def crop(ds):
    return gdsdata.RandomResizedCrop(224, dtype="float16" if ds.device.type == "cuda" else "float32")


def cold_epoch(root, engine, shuffle, args, paths):
    """A fresh dataset after the cache is dropped: one timed epoch, or for streaming reads (every
    epoch from the drive) ``--epochs`` back to back, the Loader reading on from one into the next."""
    how = drop_caches(paths)
    with gdsdata.settings.set(io_engine=engine):
        ds = gdsdata.GDSDataset(root, device=args.device)
    epoch = loader_epoch(ds, crop(ds), shuffle=shuffle, batch=args.batch)
    epochs = args.epochs if ds.load_path.reads == "direct" else 1
    cached0 = page_cache_bytes()
    t0 = time.perf_counter()
    first = epoch()
    for _ in range(epochs - 1):
        epoch()
    seconds = time.perf_counter() - t0
    grew = page_cache_bytes() - cached0
    pages = sum(resident_pages(p) for p in paths)
    reads = ds.load_path.reads
    planned = planned_bytes(ds, shuffle, args.batch)
    epoch.close()
    ds.close()
    return {"seconds": seconds, "epochs": epochs, "first_batch_s": first, "cache_growth": grew,
            "resident_pages": pages, "reads": reads, "planned_bytes": planned, "cold": how, "stages": epoch.stages}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data/storage")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--noise", type=float, default=11.0, help="image set noise (11: ~80 KB ImageNet-like JPEGs)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", default="16,64",
                        help="requests in flight of the parallel direct read, comma-separated (the best counts)")
    parser.add_argument("--blocks", default="1,4,16", help="MiB a request of the parallel direct read, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1,
                        help="streaming rows: epochs timed back to back from the cold start (each from the drive)")
    parser.add_argument("--kinds", default="JPEG,raw")
    parser.add_argument("--shuffles", default="block,full")
    parser.add_argument("--engines", default="direct,auto", help="direct (streaming), auto (cached)")
    parser.add_argument("--dali-threads", type=int, default=os.cpu_count(), help="DALI's CPU threads")
    parser.add_argument("--no-dali", action="store_true", help="leave the DALI row out")
    parser.add_argument("--out", default="bench-results")
    args, system = begin(parser, argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    src, roots = prepare(args)
    try:
        os.close(os.open(os.path.join(roots["JPEG"], "index.gdsi"), os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        sys.exit(f"{args.dir}: its filesystem refuses O_DIRECT ({e.strerror}): nothing to measure past the page cache")
    kinds = args.kinds.split(",")
    files, sizes = {}, {}
    for k in kinds:
        with gdsdata.GDSDataset(roots[k]) as ds:
            files[k], sizes[k] = shard_paths(ds), len(ds)
    nbytes = {k: sum(os.path.getsize(p) for p in files[k]) for k in kinds}
    every = [p for k in kinds for p in files[k]]
    rows = []

    limits = {}
    for k in kinds:
        counts = [int(t) for t in str(args.threads).split(",")]
        blocks = [int(b) for b in str(args.blocks).split(",")]
        dd, par = [], {f"{t}x{b}M": [] for t in counts for b in blocks}
        for _ in range(args.runs):
            drop_caches(every)
            dd.append(dd_rate(files[k]))
            for t in counts:
                for b in blocks:
                    drop_caches(every)
                    par[f"{t}x{b}M"].append(parallel_direct_rate(files[k], t, b << 20))
        parallel = {t: statistics.median(v) for t, v in par.items()}
        limits[k] = max(statistics.median(dd), *parallel.values())
        print(f"limit {k} shards ({nbytes[k] / 1e9:.2f} GB): dd iflag=direct {statistics.median(dd) / 1e9:.2f} GB/s, "
              + ", ".join(f"parallel direct {t} {v / 1e9:.2f} GB/s" for t, v in parallel.items()), flush=True)
        rows.append({"kind": k, "row": "limit", "dd_bytes_per_s": statistics.median(dd),
                     "parallel_bytes_per_s": max(parallel.values()), "parallel_by_requests": parallel,
                     "limit_bytes_per_s": limits[k]})

    for k in kinds:
        with gdsdata.settings.set(io_engine="direct"):  # warm-up: GPU, nvJPEG, pools
            warm = gdsdata.GDSDataset(roots[k], device=args.device)
        epoch = loader_epoch(warm, crop(warm), batch=args.batch)  # the rows' own kernels loaded before them
        epoch()
        epoch.close()
        warm.close()
        n = sizes[k]
        for shuffle in args.shuffles.split(","):
            for engine in args.engines.split(","):
                runs = [cold_epoch(roots[k], engine, shuffle, args, every) for _ in range(args.runs)]
                seconds = statistics.median(r["seconds"] / r["epochs"] for r in runs)  # an epoch's
                row = {"kind": k, "row": "gdsdata", "shuffle": shuffle, "engine": engine, "reads": runs[0]["reads"],
                       "cold": runs[0]["cold"], "images_per_s": n / seconds, "bytes_per_s": nbytes[k] / seconds,
                       "of_limit": nbytes[k] / seconds / limits[k],
                       "read_amplification": runs[0]["planned_bytes"] / nbytes[k],
                       "cache_growth_mib": statistics.median(r["cache_growth"] for r in runs) / 2**20,
                       "resident_mib": statistics.median(r["resident_pages"] for r in runs) * mmap.PAGESIZE / 2**20,
                       "first_batch_ms": statistics.median(r["first_batch_s"] for r in runs) * 1e3,
                       "epochs": runs[0]["epochs"], "rates": [n * r["epochs"] / r["seconds"] for r in runs],
                       "stages": [r["stages"] for r in runs]}
                rows.append(row)
                print(f"{k:<4} shuffle={shuffle:<5} reads={row['reads']:<7} {row['images_per_s']:8.0f} images/s "
                      f"{row['bytes_per_s'] / 1e9:5.2f} GB/s = {row['of_limit']:.2f} of the limit, first batch "
                      f"{row['first_batch_ms']:.0f} ms, reads {row['read_amplification']:.2f}x the shards; page cache "
                      f"+{row['cache_growth_mib']:.0f} MiB, shards cached after: {row['resident_mib']:.0f} MiB "
                      f"({row['cold']})", flush=True)
    if "JPEG" in kinds and args.device == "cuda" and not args.no_dali:
        row = dali_cold(src, args, every, limits["JPEG"])
        if row is not None:
            rows.append(row)
    with open(os.path.join(args.out, "storage.json"), "w") as f:
        json.dump({"system": system, "args": vars(args), "results": rows}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
