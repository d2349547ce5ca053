#!/usr/bin/env python3
"""The side-by-side suite: the same images through gdsdata and the usual alternatives.

Pipelines (each producing training batches: random-resized-crop 224 + flip + normalise):
  gdsdata on the GPU (each staging mode / nvJPEG backend)    when CUDA is present
  gdsdata on the CPU
  torchvision ImageFolder + PIL + DataLoader                 (--workers)
  LMDB of JPEG bytes + PIL + DataLoader                      (built by tools/make_lmdb.py)
  plain file reads (+ host-to-device copy on a GPU)          bytes only, no decode
  DALI                                                       when importable
Metrics: images/s (median, spread), GB/s of payload, CPU-seconds per 1,000 images, peak GPU memory,
time to first batch. Output: a table, OUT/suite.json and the chart OUT/suite.png. The page cache is
warm; --cold drops it before every timed epoch when permitted (and says so when not).

    python bench/run.py --size small --out bench-results     # make bench-suite: any machine
    python bench/run.py --size full --out bench-results
"""

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import chart, image_set, measure, print_system_block, print_table, system_block, write_json  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata import settings  # noqa: E402

SIZES = {"tiny": (48, 4, 16), "small": (1000, 10, 64), "full": (10000, 100, 256)}  # images, classes, batch


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def gdsdata_epoch(ds, batch, transform, cold):
    loader = gdsdata.Loader(ds, batch, transform=transform, shuffle="full", prefetch=3)
    state = {"epoch": 0}

    def epoch():
        if cold:
            drop_caches()
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        t0, first = time.perf_counter(), None
        for images, labels in loader:
            if first is None:
                if ds.device.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
        if ds.device.type == "cuda":
            torch.cuda.synchronize()
        return first

    return epoch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="small", help="tiny (smoke test), small (CPU), full (GPU)")
    parser.add_argument("--dir", default="bench-data", help="working folder for images and datasets")
    parser.add_argument("--out", default="bench-results", help="folder for suite.json and suite.png")
    parser.add_argument("--runs", type=int, default=3, help="timed epochs per pipeline (median)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every timed epoch")
    parser.add_argument("--only", default="", help="comma-separated subset: gdsdata-gpu,gdsdata-cpu,imagefolder,"
                        "lmdb,files,dali")
    args = parser.parse_args(argv)
    count, classes, batch = SIZES[args.size]
    only = set(filter(None, args.only.split(",")))
    wanted = lambda name: not only or name in only  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    system = system_block()
    cold = args.cold and drop_caches()
    system["cache"] = "cold (dropped before each epoch)" if cold else (
        "warm (could not drop the page cache: not root)" if args.cold else "warm")
    print_system_block(system)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    work = os.path.join(args.dir, args.size)
    src = image_set(os.path.join(work, "images"), count, classes=classes)
    gdsdata.pack(src, os.path.join(work, "jpeg.gds"), overwrite=True)
    payload = int(gdsdata.GDSDataset(os.path.join(work, "jpeg.gds")).index.samples["length"].sum())  # no padding
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(src) for f in names if f.endswith(".jpg"))
    n = len(files)
    print(f"\n{n} images in {classes} classes, batch {batch}, {args.runs} timed epochs after a warm-up")

    results = []

    def run(name, make, nbytes=payload, images=n):
        """Build a pipeline with ``make()`` and time its epochs; a failure is reported, not fatal."""
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = measure(name, make(), images, runs=args.runs, nbytes=nbytes)
            result.note = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if cuda else ""
            results.append(result)
            first = "" if result.first_batch_s is None else f"  first batch {result.first_batch_s:.3f} s"
            print(f"  {result.row()}{first}", flush=True)
            write_json(os.path.join(args.out, "suite.json"), system, results)
        except Exception:  # noqa: BLE001 - one failing pipeline must not hide the others
            print(f"  {name}: FAILED\n{traceback.format_exc()}", flush=True)

    import peers

    gpu_rrc = gdsdata.RandomResizedCrop(224, dtype="float16")
    cpu_rrc = gdsdata.RandomResizedCrop(224, dtype="float32")
    if cuda and wanted("gdsdata-gpu"):
        for staging, backend in (("auto", "auto"), ("device", "hardware")):
            with settings.set(staging=staging, decode_backend=backend):
                ds = gdsdata.GDSDataset(os.path.join(work, "jpeg.gds"), device="cuda")
                run(f"gdsdata GPU [{ds.load_path.describe()}]", lambda ds=ds: gdsdata_epoch(ds, batch, gpu_rrc, cold))
                ds.close()
    if wanted("gdsdata-cpu"):
        ds = gdsdata.GDSDataset(os.path.join(work, "jpeg.gds"))
        run(f"gdsdata CPU ({settings.get('cpu_threads')} threads)",
            lambda ds=ds: gdsdata_epoch(ds, batch, cpu_rrc, cold))
        ds.close()
    if wanted("imagefolder"):
        run(f"ImageFolder + PIL + DataLoader ({args.workers} workers)",
            lambda: peers.imagefolder(src, batch, args.workers, device))
    if wanted("lmdb"):
        lmdb_path = os.path.join(work, "images.lmdb")

        def make_lmdb():
            from make_lmdb import build

            if not os.path.exists(os.path.join(lmdb_path, "data.mdb")):
                build(src, lmdb_path)
            return peers.lmdb_pipeline(lmdb_path, batch, args.workers, device)

        run(f"LMDB + PIL + DataLoader ({args.workers} workers)", make_lmdb)
    if wanted("files"):
        run("plain file reads" + (" + host-to-device copy (no decode)" if cuda else " (no decode)"),
            lambda: peers.file_reads(files, device), sum(os.path.getsize(f) for f in files))
    if cuda and wanted("dali"):
        try:
            for name, pipe in peers.dali(src, batch, args.workers).items():
                run(name, lambda pipe=pipe: peers.dali_epoch(pipe, n, batch), images=-(-n // batch) * batch)
        except ImportError as e:
            print(f"  DALI not importable ({e}); skipped")

    print()
    reference = next((r for r in results if r.name.startswith("ImageFolder")), None)
    print_table(results, reference)
    write_json(os.path.join(args.out, "suite.json"), system, results)
    try:
        chart([r.to_dict() for r in results], os.path.join(args.out, "suite.png"),
              f"{'CPU only' if str(system.get('gpu', 'none')).startswith('none') else system['gpu']}, "
              f"{n} images, batch {batch}, {system['cache']} cache, "
              f"{system.get('io mode', 'no GPU').split(':')[0]}, commit {system['commit']}")
        print(f"chart: {os.path.join(args.out, 'suite.png')}")
    except ImportError:
        print("chart skipped: matplotlib not installed (pip install 'gdsdata[bench]')")


if __name__ == "__main__":
    main()
