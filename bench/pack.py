#!/usr/bin/env python3
"""How fast packing runs: one process, a process pool over the cores, and Ray over the cores.

    python bench/pack.py --dir /tmp/pack-bench --count 4000 --out results/

The same generated images (ImageNet-like, all baseline JPEGs: each is validated with a strict
decode and stored byte for byte) are packed each way, page cache warm, the median of --runs runs;
the Ray row starts a local Ray with one CPU per core once, before the timed runs.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

from common import begin, image_set, warm  # noqa: E402

import gdsdata  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data/pack")
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parts", type=int, default=0, help="Ray parts (default: chosen from size and CPUs)")
    parser.add_argument("--out", default="bench-results")
    args, system = begin(parser, argv)
    src = image_set(os.path.join(args.dir, f"images-{args.count}"), args.count, classes=20)
    warm([os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs])
    cores = os.cpu_count()
    out = os.path.join(args.dir, "out.gds")

    def one(workers):
        return lambda: gdsdata.pack(src, out, workers=workers, overwrite=True)

    rows = [("1 process", one(1)), (f"process pool, {cores} workers", one(cores))]
    try:
        import ray

        from gdsdata.packing.ray import pack_on_ray

        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
        rows.append((f"Ray, local, {cores} CPUs", lambda: pack_on_ray(src, out, num_parts=args.parts, overwrite=True)))
    except ImportError:
        print("Ray not installed: its row skipped")
    results = []
    for name, run in rows:
        seconds = []
        for _ in range(args.runs):
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - t0)
        median = statistics.median(seconds)
        results.append({"name": name, "seconds": seconds, "images_per_s": args.count / median})
        print(f"  {name:<32} {args.count / median:8.0f} images/s  (median of {seconds})", flush=True)
    base = results[0]["images_per_s"]
    print(f"\n== packing {args.count} JPEGs, {cores} cores ==")
    for r in results:
        r["speedup"] = r["images_per_s"] / base
        print(f"{r['name']:<32} {r['images_per_s']:8.0f} images/s  {r['speedup']:.2f}x one process")
    with open(os.path.join(args.out, "pack.json"), "w") as f:
        json.dump({"system": system, "count": args.count, "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
