#!/usr/bin/env python3
"""The GPU benchmark: gdsdata's GPU path beside its ceilings and its peers, in one run.

Every pipeline reads the same images (generated here, ImageNet-like sizes and file sizes) and is
timed after a warm-up epoch as the median of several runs, each as many back-to-back epochs as
fill --min-seconds; CPU cost is process CPU-seconds (workers included) per 1,000 images. Sections:

  ceilings   plain kvikio pread of the shards; a minimal nvJPEG batched loop over bytes already
             staged (pinned host for HARDWARE, GPU memory for HARDWARE_DEVICE)
  gdsdata    decode only and full training batches (random-resized-crop 224 + flip + normalise
             fp16), JPEG on each path, raw codec; transform kernel Triton vs torch
  peers      torch DataLoader + ImageFolder + PIL (workers configurable), DALI 2.x if importable
  cold       page cache dropped (when permitted): dd iflag=direct, and the raw loader
  mapped     io_engine=mapped for JPEG, last (for raw it is the automatic choice in compat mode)

    python bench/gpu.py --dir /tmp/bench --count 10000 --out results/
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import peers  # noqa: E402
from common import (drop_caches, image_set, kvikio_pread_epoch, loader_epoch, measure, print_system_block,  # noqa: E402
                    print_table, shard_paths, system_block, warm, write_json)

import gdsdata  # noqa: E402
from gdsdata import settings  # noqa: E402
from gdsdata import transforms as T  # noqa: E402
from gdsdata._native.nvjpeg import BatchedDecoder  # noqa: E402

BATCH = 256


# --- ceilings ---------------------------------------------------------------------------------
def staged_batches(ds, batch, device_bitstreams):
    """Every payload of the CPU dataset ``ds`` read once into pinned memory (and copied to the GPU
    for the device-bitstream backends), cut into batches with their output arenas allocated."""
    import numpy as np

    from gdsdata.io.cpu import CpuReader

    samples = ds.index.samples
    reader = CpuReader(ds.index)
    buffer, plan = reader.read(list(range(len(samples))))
    reader.close()
    host = torch.from_numpy(buffer).pin_memory()
    staged = host.cuda() if device_bitstreams else host
    sizes = samples["height"].astype(np.int64) * samples["width"].astype(np.int64) * 3
    out = []
    for start in range(0, len(samples), batch):
        k = slice(start, min(start + batch, len(samples)))
        offsets = np.zeros(len(sizes[k]), np.int64)
        np.cumsum(sizes[k][:-1], out=offsets[1:])
        pixels = torch.empty(int(sizes[k].sum()), dtype=torch.uint8, device="cuda")
        out.append(((staged.data_ptr() + plan.sample_offsets[k]).tolist(), plan.sample_lengths[k].tolist(),
                    (pixels.data_ptr() + offsets).tolist(), (samples["width"][k].astype(np.int64) * 3).tolist(),
                    pixels))
    return staged, out


def nvjpeg_ceiling_epoch(ds, backend):
    """A minimal batched nvJPEG loop over every payload of ``ds`` staged once, in batches of 256.
    ``epoch.close`` destroys its decoder and lets go of the staged bytes: no second nvJPEG handle
    stays alive beside the Loader's in the rows after it."""
    held = list(staged_batches(gdsdata.GDSDataset(ds.root), BATCH, backend.endswith("_device")))
    decoder = BatchedDecoder(backend)
    stream = torch.cuda.current_stream()

    def epoch():
        for data, lengths, outs, pitches, _ in held[1]:
            decoder.decode(data, lengths, outs, pitches, stream.cuda_stream)
        torch.cuda.synchronize()

    def close():
        torch.cuda.synchronize()
        decoder.close()
        held.clear()

    epoch.close = close
    return epoch


def transform_compare(ds):
    """Triton kernel vs the vectorised torch reference on one decoded batch, same arithmetic."""
    batch, idx = ds.load_batch(list(range(min(BATCH, len(ds)))))
    transform = gdsdata.RandomResizedCrop(224)
    params = transform.params(batch.heights, batch.widths, idx)
    args = (batch.buffer, batch.offsets, batch.heights, batch.widths, batch.channels, params)
    out = {}
    for name, use_triton in (("triton", True), ("torch", False)):
        T._TRITON = use_triton
        for _ in range(3):
            T.apply(transform, *args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            T.apply(transform, *args)
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / 20 * 1000
    T._TRITON = None
    a = T.apply(gdsdata.RandomResizedCrop(224, dtype="uint8"), *args)
    T._TRITON = False
    b = T.apply(gdsdata.RandomResizedCrop(224, dtype="uint8"), *args)
    T._TRITON = None
    out["max_abs_diff_uint8"] = int((a.int() - b.int()).abs().max())
    batch.release(torch.cuda.current_stream())
    return out


# --- main -------------------------------------------------------------------------------------
def gather_tag(ds, threads) -> str:
    """How many threads run the page gather, where a dataset's reads use it."""
    return "" if ds.load_path.reads in ("kvikio", "mapped") else f" gather_threads={threads}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="working folder for images and datasets")
    parser.add_argument("--count", type=int, default=10000, help="images (default 10000)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per pipeline (median)")
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="a timed run repeats the epoch until it lasts about this long (0: one epoch)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers / DALI threads")
    parser.add_argument("--raw-size", type=int, default=256, help="raw codec: shorter side at pack time")
    parser.add_argument("--noise", type=float, default=15.0,
                        help="image set: sensor noise (15: ~100 KB ImageNet-like files; 8 with --quality 90 "
                             "--scale 0.93: the 53 KB set of the project's field notes)")
    parser.add_argument("--quality", type=int, default=92, help="image set: JPEG quality")
    parser.add_argument("--scale", type=float, default=1.0, help="image set: scale of the ImageNet-like sizes")
    parser.add_argument("--out", default="bench-results", help="folder for gpu.json")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: peers,dali,cold,paths,raw,mapped")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    system = system_block()
    print_system_block(system)
    variant = f"n{args.noise:g}-q{args.quality}-s{args.scale:g}"
    src = image_set(os.path.join(args.dir, f"images-{variant}"), args.count, classes=100, noise=args.noise,
                    quality=args.quality, scale=args.scale)
    jpeg_dir, raw_dir = os.path.join(args.dir, f"jpeg-{variant}.gds"), os.path.join(args.dir, "raw.gds")
    packed = gdsdata.pack(src, jpeg_dir, overwrite=True)
    print(f"packed JPEG: {packed.packed} images, {packed.bytes / 1e9:.2f} GB, {packed.seconds:.1f} s "
          f"({packed.packed / packed.seconds:.0f} images/s, {os.cpu_count()} workers)")
    if "raw" not in skip:
        packed_raw = gdsdata.pack(src, raw_dir, overwrite=True,
                                  options=gdsdata.PackOptions(codec="raw", raw_size=args.raw_size))
        print(f"packed raw (shorter side {args.raw_size}): {packed_raw.bytes / 1e9:.2f} GB, "
              f"{packed_raw.seconds:.1f} s")
    else:
        skip.add("cold")

    results, notes = [], {"system": system, "image set": {"noise": args.noise, "quality": args.quality,
                                                          "scale": args.scale, "count": args.count}}
    jpeg = gdsdata.GDSDataset(jpeg_dir, device="cuda")
    raw = None if "raw" in skip else gdsdata.GDSDataset(raw_dir, device="cuda")
    n, payload = len(jpeg), int(jpeg.index.samples["length"].sum())
    raw_payload = 0 if raw is None else int(raw.index.samples["length"].sum())
    notes["gdsdata auto path"] = jpeg.load_path.describe()
    print(f"\ngdsdata auto path: {jpeg.load_path.describe()}")
    warm(shard_paths(jpeg) + ([] if raw is None else shard_paths(raw)))

    def run(name, fn, images, nbytes=0, runs=args.runs, warmup=1):
        try:
            try:
                result = measure(name, fn, images, runs=runs, warmup=warmup, nbytes=nbytes,
                                 min_seconds=args.min_seconds)
            finally:
                getattr(fn, "close", lambda: None)()
            timed = len(result.seconds) * result.epochs_per_run  # the timed epochs: the last ones run
            result.stages = getattr(fn, "stages", [])[-timed:] if timed else []
            results.append(result)
            print(f"  {result.row()}", flush=True)
            if result.stages:  # the slowest epoch's stages: which one held it up
                slowest = max(result.stages, key=lambda e: e["seconds"])
                print("      slowest epoch " + ", ".join(f"{k} {v}" for k, v in slowest.items()), flush=True)
            write_json(os.path.join(args.out, "gpu.json"), notes, results)
            return result
        except Exception:  # noqa: BLE001 - one failing pipeline must not hide the others
            print(f"  {name}: FAILED\n{traceback.format_exc()}", flush=True)
            return None

    print("\n== ceilings (page cache warm) ==")
    for threads in (16,):
        pread_raw = None
        if raw is not None:
            fn, nbytes = kvikio_pread_epoch(shard_paths(raw), threads)
            pread_raw = run(f"kvikio pread raw shards -> GPU ({threads} threads)", fn, len(raw), nbytes)
        fn, nbytes = kvikio_pread_epoch(shard_paths(jpeg), threads)
        run(f"kvikio pread JPEG shards -> GPU ({threads} threads)", fn, n, nbytes)
    for backend in ("hardware", "hardware_device"):  # nvJPEG's names; run() closes each loop's decoder after its row
        run(f"nvJPEG batched loop, {backend}, staged bytes", nvjpeg_ceiling_epoch(jpeg, backend), n, payload)

    print("\n== gdsdata (page cache warm) ==")
    rrc = gdsdata.RandomResizedCrop(224, dtype="float16")
    user_pool = settings.get("gather_threads")  # GDSDATA_GATHER_THREADS, for the automatic rows
    # (staging, backend, reads, io threads, gather threads): the automatic choice first, then forced paths
    auto = [("auto", "auto", "auto", 16, user_pool)]
    paths = auto if "paths" in skip else auto + [
        ("host", "hardware", "mmap", 16, user_pool), ("host", "hardware", "mmap", 16, 1),
        ("host", "hardware", "kvikio", 16, user_pool), ("device", "hardware", "kvikio", 16, user_pool)]

    def jpeg_rows(paths, note=""):
        for staging, backend, engine, io_threads, pool in paths:
            with settings.set(staging=staging, decode_backend=backend, io_engine=engine, io_threads=io_threads,
                              gather_threads=pool):
                ds = gdsdata.GDSDataset(jpeg_dir, device="cuda")
                tag = f"{ds.load_path.describe()} io_threads={io_threads}" + gather_tag(ds, pool) + note
                run(f"gdsdata decode only [{tag}]", loader_epoch(ds, None), n, payload)
                run(f"gdsdata train batches [{tag}]", loader_epoch(ds, rrc), n, payload)
                ds.close()

    def raw_rows(paths):
        """Shuffled and file-order raw train batches per path; returns the first path's shuffled row."""
        first = None
        for staging, engine, pool in () if raw is None else paths:
            with settings.set(staging=staging, io_engine=engine, gather_threads=pool):
                ds = gdsdata.GDSDataset(raw_dir, device="cuda")
                tag = f"staging={ds.load_path.staging} reads={ds.load_path.reads}{gather_tag(ds, pool)}"
                if staging == "auto":
                    tag = f"auto: {tag}"
                for shuffle in ("full", None):
                    result = run(f"gdsdata raw train batches [{tag} shuffle={shuffle}]",
                                 loader_epoch(ds, rrc, shuffle=shuffle), len(raw), raw_payload)
                    first = first or result
                ds.close()
        return first

    jpeg_rows(paths)
    jpeg_rows(auto, ", again")  # again, last: does a row's place in the run change it?
    raw_train = raw_rows((("auto", "auto", user_pool), ("host", "auto", user_pool), ("host", "mmap", user_pool),
                          ("host", "mmap", 1), ("host", "kvikio", user_pool),
                          ("device", "kvikio", user_pool)))  # first: the automatic choice, shuffled
    try:
        notes["transform_ms_per_batch"] = transform_compare(jpeg)
        print(f"  transform per batch of {BATCH}: {notes['transform_ms_per_batch']}")
    except Exception:  # noqa: BLE001
        print(f"  transform comparison FAILED\n{traceback.format_exc()}")

    if "peers" not in skip:
        print("\n== peers (page cache warm) ==")
        baseline = run(f"DataLoader + ImageFolder + PIL ({args.workers} workers)",
                       peers.imagefolder(src, BATCH, args.workers, torch.device("cuda")), n, payload, runs=2)
        notes["baseline"] = baseline.name if baseline else None
    if "dali" not in skip:
        try:
            for name, pipe in peers.dali(src, BATCH, args.workers).items():
                run(name, peers.dali_epoch(pipe, n, BATCH), -(-n // BATCH) * BATCH, payload)
        except ImportError as e:
            print(f"  DALI not importable ({e}); skipped")

    if "cold" not in skip:
        print("\n== cold cache ==")
        if drop_caches():
            notes["cold"] = {}
            big = max(shard_paths(raw), key=os.path.getsize)
            dd = subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=16M", "iflag=direct"],
                                capture_output=True, text=True)
            notes["cold"]["dd_iflag_direct"] = dd.stderr.strip().splitlines()[-1] if dd.stderr else dd.returncode
            print(f"  dd iflag=direct {big}: {notes['cold']['dd_iflag_direct']}")
            # a fresh dataset per row: the mapped engine pins what it has read until its dataset closes
            rows = [(f"raw train batches, cold, shuffle={shuffle}", raw_dir, len(raw), raw_payload, shuffle)
                    for shuffle in (None, "block", "full")]
            rows.append(("JPEG train batches, cold", jpeg_dir, n, payload, "full"))
            for name, root, count, nbytes, shuffle in rows:
                drop_caches()
                cold = gdsdata.GDSDataset(root, device="cuda")
                run(f"gdsdata {name} [reads={cold.load_path.reads}]", loader_epoch(cold, rrc, shuffle=shuffle),
                    count, nbytes, runs=1, warmup=0)
                cold.close()
        else:
            print("  cannot drop the page cache here (not root): cold numbers not measured")

    if "mapped" not in skip:
        # Last, so that a failure of the experimental engine cannot take the main table with it.
        print("\n== io_engine=mapped for JPEG: the GPU gathers bitstreams from registered page-cache pages ==")
        try:
            warm(shard_paths(jpeg))
            jpeg_rows([("device", "hardware", "mapped", 16, 1)])
        except Exception:  # noqa: BLE001 - the summary of everything else still follows
            print(f"  mapped engine FAILED\n{traceback.format_exc()}")

    print("\n== summary ==")
    reference = next((r for r in results if r.name.startswith("DataLoader")), None)
    print_table(results, reference)
    if pread_raw and raw_train:
        notes["raw_vs_pread_bytes"] = raw_train.bytes_per_s / pread_raw.bytes_per_s
        print(f"raw loader ({raw_train.name}) bytes/s vs plain kvikio pread: {notes['raw_vs_pread_bytes'] * 100:.0f} %")
    write_json(os.path.join(args.out, "gpu.json"), notes, results)
    with open(os.path.join(args.out, "gpu-notes.json"), "w") as f:
        json.dump(notes, f, indent=2, default=str)


if __name__ == "__main__":
    main()
