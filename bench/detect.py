#!/usr/bin/env python3
"""Detection training batches: gdsdata beside Ultralytics' own dataloader, in one run.

Both build YOLO training batches at --imgsz (default 640) with Ultralytics' default augmentation
(4-image mosaic, random affine, HSV, horizontal flip) from the same images
(``tools/make_detection.py``: COCO-like boxes, 640 px images):

  gdsdata       gdsdata.Loader(transform=YoloAugment(targets="ultralytics")) on --device
  ultralytics   Ultralytics' YOLODataset + build_dataloader (its InfiniteDataLoader), --workers
                processes, batches moved to --device as its trainer moves them

Modes: the loader alone, and with --train the training client: a YOLO model (--model, built from
its YAML, no weights) takes a train step (its own loss, SGD, bf16 autocast on CUDA) on each batch,
beside the same step on one synthetic batch made once on the device (the model's own ceiling).
Each row starts its pipeline afresh (no loader works ahead while another row runs), takes
--workers + 4 batches untimed, then times --steps batches (default: an epoch's). Rows are
interleaved over --rounds rounds after a warm-up round; figures are medians; CPU-seconds per 1,000
images count the process and its workers over the timed batches.

    python bench/detect.py --dir /tmp/det-bench --count 2000 --device cuda --train --out results/
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)
os.environ.setdefault("YOLO_OFFLINE", "1")

import torch  # noqa: E402
from common import begin, build_pipelines, cpu_seconds, interleaved, shown_rate  # noqa: E402

import gdsdata  # noqa: E402

PIPELINES = ("gdsdata", "ultralytics")


def gdsdata_pipeline(args, roots):
    ds = gdsdata.GDSDataset(roots["gds"], device=args.device)

    def start():
        loader = gdsdata.Loader(ds, args.batch, shuffle=True, drop_last=True,
                                transform=gdsdata.YoloAugment(imgsz=args.imgsz, targets="ultralytics"))
        return endless(lambda: iter(loader)), loader.close

    return start


def ultralytics_pipeline(args, roots):
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset

    cfg = get_cfg(overrides={"imgsz": args.imgsz, "workers": args.workers, "cache": False})
    names = gdsdata.GDSDataset(roots["gds"]).classes
    data = {"names": dict(enumerate(names)), "nc": len(names), "channels": 3, "path": roots["yolo"]}
    device = torch.device(args.device)

    def start():  # its workers live as long as the row: none works ahead during another row
        dataset = build_yolo_dataset(cfg, os.path.join(roots["yolo"], "images", "train"), args.batch, data,
                                     mode="train", stride=32)
        loader = build_dataloader(dataset, args.batch, args.workers, shuffle=True, rank=-1, drop_last=True)

        def batches():
            for batch in loader:
                for key in ("img", "batch_idx", "cls", "bboxes"):
                    batch[key] = batch[key].to(device, non_blocking=device.type == "cuda")
                yield batch

        return endless(batches), loader.close

    return start


def endless(make):
    """Epoch after epoch of ``make()``'s batches."""
    while True:
        yield from make()


class Model:
    """A YOLO detector's train step with its own loss (bf16 autocast on CUDA)."""

    def __init__(self, args, nc):
        from ultralytics.cfg import get_cfg
        from ultralytics.nn.tasks import DetectionModel

        self.device = torch.device(args.device)
        self.model = DetectionModel(args.model, nc=nc, verbose=False).to(self.device)
        self.model.args = get_cfg()
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.937, nesterov=True)

    def step(self, batch):
        batch = dict(batch, img=batch["img"].float() / 255)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            loss, _ = self.model.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()
        self.optimizer.step()


def synthetic(args, reference):
    """One batch made once on the device, taken from the first gdsdata batch: the model's ceiling."""
    batches, close = reference()
    batch = next(batches)
    close()
    fixed = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    return lambda: (iter(lambda: fixed, None), lambda: None)


def timed_row(start, model, device, steps, skip):
    """A fresh pipeline's batches: ``skip`` of them untimed (workers starting, queues filling), then
    ``steps`` timed; images/s and CPU-seconds per 1,000 images over the timed ones."""
    batches, close = start()
    try:
        for _ in range(skip):
            batch = next(batches)
            if model is not None:
                model.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        n, t0, c0 = 0, time.perf_counter(), cpu_seconds()
        for _ in range(steps):
            batch = next(batches)
            if model is not None:
                model.step(batch)
            n += batch["img"].shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0), (cpu_seconds() - c0) / n * 1000
    finally:
        close()


def prepare(args):
    from make_detection import generate

    src = os.path.join(args.dir, f"src-{args.count}")
    if not os.path.exists(os.path.join(src, "yolo", "data.yaml")):
        generate(src, args.count, classes=args.classes, seed=0, val=0.0)
    gds = os.path.join(args.dir, f"det-{args.count}.gds")
    if not os.path.exists(os.path.join(gds, "index.gdsi")):
        gdsdata.pack(os.path.join(src, "yolo", "data.yaml"), gds, format="yolo", overwrite=True)
    return {"yolo": os.path.join(src, "yolo"), "gds": gds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data/detect", help="working folder")
    parser.add_argument("--count", type=int, default=2000, help="training images")
    parser.add_argument("--classes", type=int, default=20)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="Ultralytics dataloader workers")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds after a warm-up")
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--steps", type=int, default=0, help="timed batches a row (default: an epoch's)")
    parser.add_argument("--train", action="store_true", help="also the training client (a YOLO train step)")
    parser.add_argument("--model", default="yolo11n.yaml", help="Ultralytics model YAML for --train")
    parser.add_argument("--out", default="bench-results")
    args, system = begin(parser, argv)
    roots = prepare(args)
    pipelines = build_pipelines({"gdsdata": gdsdata_pipeline, "ultralytics": ultralytics_pipeline},
                                args.pipelines.split(","), args, roots)
    device = torch.device(args.device)
    modes = [("alone", None)]
    if args.train:
        model = Model(args, len(gdsdata.GDSDataset(roots["gds"]).classes))
        if "gdsdata" in pipelines:
            pipelines["synthetic"] = synthetic(args, pipelines["gdsdata"])
        modes.append((f"training {os.path.splitext(args.model)[0]}", model))
    steps, skip = args.steps or args.count // args.batch, args.workers + 4
    table = interleaved(pipelines, modes, args.rounds, lambda make, model: timed_row(make, model, device, steps, skip),
                        wanted=lambda name, model: name != "synthetic" or model is not None)
    print(f"\n== {args.count} images, batch {args.batch}, {args.imgsz} px, mosaic + affine + HSV + flip, "
          f"{args.device}, {os.cpu_count()} cores ==")
    for row in table:
        same = {r["pipeline"]: r for r in table if r["mode"] == row["mode"]}
        notes = []
        if "ultralytics" in same and row["pipeline"] == "gdsdata":
            theirs = same["ultralytics"]
            notes.append(f"{row['images_per_s'] / theirs['images_per_s']:.2f}x Ultralytics' images/s at "
                         f"{row['cpu_s_per_1k'] / theirs['cpu_s_per_1k']:.2f}x its CPU-s")
        if "synthetic" in same and row["pipeline"] != "synthetic":
            row["of_synthetic"] = row["images_per_s"] / same["synthetic"]["images_per_s"]
            notes.append(f"{row['of_synthetic']:.3f} of synthetic")
        print(f"{row['pipeline']:<12} {row['mode']:<20} {shown_rate(row['images_per_s']):>8} images/s "
              f"({shown_rate(min(row['rates']))}-{shown_rate(max(row['rates']))})  "
              f"{row['cpu_s_per_1k']:6.2f} CPU-s/1k  "
              + ", ".join(notes))
    with open(os.path.join(args.out, "detect.json"), "w") as f:
        json.dump({"system": system, "args": vars(args), "results": table}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
