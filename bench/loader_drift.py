#!/usr/bin/env python3
"""Does a Loader slow down epoch after epoch? One dataset, one Loader, many epochs: per epoch its
seconds, its stage times (ms per batch), the process's Python objects and garbage collections, and
on the GPU torch's allocator (allocated, reserved, cudaMalloc retries) and the process's threads.

Written after the first JPEG Loader of a benchmark process ran its decode stage slower epoch after
epoch (11.9 -> 16.2 ms a batch over 12 epochs); its 30-epoch runs on the H200 found no growth, only
episodes of a slower decode stage (docs/benchmarks.md).

Variants: ``--gc-freeze`` (the objects alive before the first epoch are left out of the collector's
passes), ``--throwaway N`` (N epochs of another Loader over another instance of the dataset first),
``--train`` (random-resized-crop 224, flip, normalise fp16, as the training rows; else decoded
pixels).

    python bench/loader_drift.py DATASET --device cuda --epochs 40 [--train] [--gc-freeze] [--throwaway 4]
"""

import argparse
import gc
import json
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import loader_epoch, print_system_block, system_block  # noqa: E402

import gdsdata  # noqa: E402


def run_epochs(ds, epochs, batch, train, report=None):
    epoch = loader_epoch(ds, gdsdata.RandomResizedCrop(224, dtype="float16") if train else None, batch=batch)
    cuda = ds.device.type == "cuda"
    try:
        for k in range(epochs):
            collections = sum(g["collections"] for g in gc.get_stats())
            epoch()
            row = {"epoch": k, **epoch.stages[-1], "objects": len(gc.get_objects()),
                   "gc_runs": sum(g["collections"] for g in gc.get_stats()) - collections,
                   "threads": threading.active_count()}
            if cuda:
                memory = torch.cuda.memory_stats(ds.device)
                row.update(allocated_mb=round(memory.get("allocated_bytes.all.current", 0) / 2**20),
                           reserved_mb=round(memory.get("reserved_bytes.all.current", 0) / 2**20),
                           malloc_retries=memory.get("num_alloc_retries", 0),
                           segments=memory.get("segment.all.current", 0))
            if report is not None:
                report(row)
    finally:
        epoch.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", help="a packed dataset (gdsdata pack)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--throwaway", type=int, default=0, help="epochs of another dataset instance first")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    print_system_block(system_block())
    if args.throwaway:
        first = gdsdata.GDSDataset(args.dataset, device=args.device)
        run_epochs(first, args.throwaway, args.batch, args.train)
        first.close()
    ds = gdsdata.GDSDataset(args.dataset, device=args.device)
    print(f"{ds._backend.describe() if args.device != 'cpu' else 'cpu'}; {len(ds)} samples, batch {args.batch}, "
          f"{'train batches' if args.train else 'decode only'}, gc.freeze {args.gc_freeze}, "
          f"throwaway epochs {args.throwaway}", flush=True)
    if args.gc_freeze:
        gc.freeze()
    rows = []

    def report(row):
        rows.append(row)
        print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)

    run_epochs(ds, args.epochs, args.batch, args.train, report)
    ds.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
