#!/usr/bin/env python3
"""A DDP training loop fed by gdsdata, for scaling runs: one process per GPU under torchrun.

    python bench/ddp.py prepare --dir /tmp/ddp --count 10000            # images + packed dataset
    torchrun --nproc_per_node 2 bench/ddp.py train --dir /tmp/ddp --epochs 3 --out result.json
    python bench/ddp.py summary run1.json run2.json ...                  # scaling over several runs

Each rank loads its share with ``gdsdata.Loader`` (rank and world size from torch.distributed),
random-resized-crop 224 + flip + normalise fp16 on its GPU, and takes a step of a small DDP model
(light enough that the loader, not the model, sets the pace). Rank 0 checks that every sample was
seen in each epoch (padding aside) and writes images/s per epoch, aggregated over ranks, and the
images/s of all epochs after the first taken together (short epochs make single epochs noisy).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)


def prepare(args):
    from common import image_set

    import gdsdata

    src = image_set(os.path.join(args.dir, "images"), args.count, classes=100)
    result = gdsdata.pack(src, os.path.join(args.dir, "jpeg.gds"), overwrite=True)
    print(f"packed {result.packed} images into {args.dir}/jpeg.gds")


def train(args):
    import torch
    import torch.distributed as dist
    from common import cpu_seconds, stage_ms

    import gdsdata

    # torchrun gives every rank OMP_NUM_THREADS=1; share the cores out instead for torch's own work
    # (gdsdata's page gather runs on its own GDSDATA_GATHER_THREADS: docs/usage.md, "Several GPUs and nodes").
    if "OMP_NUM_THREADS" not in os.environ or os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    ds = gdsdata.GDSDataset(os.path.join(args.dir, "jpeg.gds"), device=device)
    loader = gdsdata.Loader(ds, args.batch, shuffle="full", seed=0, transform=gdsdata.RandomResizedCrop(224))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 7, stride=4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, len(ds.classes))).to(device).half()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        planned = [b.tolist() for b in loader.indices()]
        dist.barrier()
        torch.cuda.synchronize()
        t0, c0, before = time.perf_counter(), cpu_seconds(), loader.stats()
        images_seen = 0
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            images_seen += len(labels)
        torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - t0
        stats = [None] * world
        dist.all_gather_object(stats, {"images": images_seen, "seconds": seconds, "cpu": cpu_seconds() - c0,
                                       "planned": planned, "batches": len(planned),
                                       "stages_ms": stage_ms(loader.stats(), before)})
        if rank == 0:
            seen = [i for s in stats for b in s["planned"] for i in b]
            missing = len(ds) - len(set(seen))
            total = sum(s["images"] for s in stats)
            wall = max(s["seconds"] for s in stats)
            epochs.append({"epoch": epoch, "images": total, "seconds": wall, "images_per_s": total / wall,
                           "cpu_s_per_1k": sum(s["cpu"] for s in stats) / total * 1000,
                           "missing_samples": missing, "duplicates": len(seen) - len(set(seen)),
                           "batches_per_rank": sorted({s["batches"] for s in stats}),
                           "stages_ms_per_rank": [s["stages_ms"] for s in stats]})
            print(json.dumps(epochs[-1]), flush=True)
    if rank == 0:
        timed = epochs[1:] or epochs  # the first epoch warms up (Triton compiles, staging grows)
        aggregate = sum(e["images"] for e in timed) / sum(e["seconds"] for e in timed)
        print(json.dumps({"aggregate_images_per_s_after_epoch_0": aggregate}), flush=True)
        result = {"world_size": world, "gpu": torch.cuda.get_device_name(device), "epochs": epochs,
                  "aggregate_images_per_s": aggregate, "io": ds.load_path.describe(),
                  "torch_threads_per_rank": torch.get_num_threads()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    loader.close()
    dist.destroy_process_group()


def summary(args):
    """Scaling from result files of several runs: per GPU count, the median images/s of every epoch
    after the first in every run (min-max), CPU-seconds per 1,000 images, and whether every epoch saw
    every sample once; then each count's median over the smallest count's."""
    import statistics

    by_world = {}
    for path in args.files:
        with open(path) as f:
            result = json.load(f)
        by_world.setdefault(result["world_size"], []).append(result)
    table = {}
    for world, results in sorted(by_world.items()):
        epochs = [e for r in results for e in (r["epochs"][1:] or r["epochs"])]
        rates = [e["images_per_s"] for e in epochs]
        table[world] = {"runs": len(results), "epochs": len(epochs), "median_images_per_s": statistics.median(rates),
                        "min": min(rates), "max": max(rates),
                        "cpu_s_per_1k": statistics.median(e["cpu_s_per_1k"] for e in epochs),
                        "every_sample_once": all(e["missing_samples"] == 0 and e["duplicates"] == 0
                                                 for r in results for e in r["epochs"]),
                        "io": results[0]["io"]}
    base = table[min(table)]["median_images_per_s"]
    print(f"{'GPUs':>4} {'runs':>4} {'images/s (median)':>18} {'min-max':>17} {'CPU-s/1k':>9} {'scaling':>8}  once")
    for world, row in table.items():
        row["scaling"] = row["median_images_per_s"] / base
        print(f"{world:>4} {row['runs']:>4} {row['median_images_per_s']:>18.0f} {row['min']:>8.0f}-{row['max']:<8.0f} "
              f"{row['cpu_s_per_1k']:>9.2f} {row['scaling']:>7.2f}x  {'yes' if row['every_sample_once'] else 'NO'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(k): v for k, v in table.items()}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "train", "summary"))
    parser.add_argument("files", nargs="*", help="summary: result files of train runs")
    parser.add_argument("--dir", default="bench-data/ddp")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", default=None, help="train: result file (default ddp.json); summary: table as JSON")
    args = parser.parse_args()
    if args.command == "train":
        args.out = args.out or "ddp.json"
    {"prepare": prepare, "train": train, "summary": summary}[args.command](args)


if __name__ == "__main__":
    main()
