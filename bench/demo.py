#!/usr/bin/env python3
"""The demo: generate a small photographic image set, pack it, load it through gdsdata (on the GPU if
one is present, else the CPU) and through torchvision's ImageFolder + DataLoader, and compare.

Both sides produce the same thing: every image decoded to a uint8 CHW RGB tensor, in batches of 64,
using all cores. Numbers from this demo are indicative; bench/ has the controlled benchmarks.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import image_set, measure, print_system_block, print_table, system_block  # noqa: E402

import gdsdata  # noqa: E402


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def imagefolder_epoch(src, batch, workers):
    """torchvision's ImageFolder (PIL loader) + DataLoader: the standard recipe."""
    try:
        from torchvision.datasets import ImageFolder
        from torchvision.transforms import PILToTensor
    except ImportError:
        return None, "torchvision not installed"
    except (RuntimeError, OSError) as e:  # a torchvision built for another torch (PyPI's CUDA one beside a CPU torch)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, (f"torchvision {_version('torchvision')} does not load beside torch {torch.__version__} "
                      f"({first}): install the torchvision built for it (the same index as torch)")
    dataset = ImageFolder(src, transform=PILToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers,
                                         collate_fn=lambda b: b, persistent_workers=workers > 0)

    def epoch():
        for _ in loader:
            pass

    return epoch, "torchvision ImageFolder + DataLoader"


def gdsdata_epoch(ds, batch, device):
    order = list(range(len(ds)))

    def epoch():
        for start in range(0, len(order), batch):
            items = ds.__getitems__(order[start:start + batch])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return items

    return epoch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="demo-data", help="working folder (default ./demo-data)")
    parser.add_argument("--count", type=int, default=2000, help="images to generate (default 2000)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers (default: cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    src, out = os.path.join(args.dir, "images"), os.path.join(args.dir, "packed")
    print_system_block(system_block())
    print("\n== test images ==")
    image_set(src, args.count, classes=10, progress=sys.stderr.isatty())
    print(f"\n== packing into {out} ==")
    result = gdsdata.pack(src, out, overwrite=True, progress=sys.stderr.isatty())
    print(f"packed {result.packed} images into {result.shards} shard(s) in {result.seconds:.1f} s")

    print(f"\n== loading every image as a uint8 tensor, batch {args.batch}, {args.runs} timed runs "
          f"after a warm-up (page cache warm) ==")
    ds = gdsdata.GDSDataset(out, device=args.device)
    results = [measure(f"gdsdata GDSDataset ({args.device})", gdsdata_epoch(ds, args.batch, args.device),
                       len(ds), runs=args.runs, nbytes=int(ds.index.samples["length"].sum()))]
    epoch, name = imagefolder_epoch(src, args.batch, args.workers)
    baseline = None
    if epoch is not None:
        sources = sum(os.path.getsize(os.path.join(src, ds.source(i))) for i in range(len(ds)))
        baseline = measure(f"{name} ({args.workers} workers)", epoch, len(ds), runs=args.runs, nbytes=sources)
        results.append(baseline)
    else:
        print(f"(baseline skipped: {name})")
    print()
    print_table(results, reference=baseline)
    if baseline:
        print(f"\ngdsdata on {args.device}: {results[0].images_per_s / baseline.images_per_s:.2f}x the "
              f"images/s of the standard DataLoader on this machine")
    ds.close()


if __name__ == "__main__":
    main()
