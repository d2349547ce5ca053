#!/usr/bin/env python3
"""A plain torchvision detection loop on gdsdata batches: Faster R-CNN (MobileNetV3 FPN, no
downloaded weights) trained on YoloAugment batches, evaluated on Letterbox batches.

    python examples/train_detection.py --train /data/det-train.gds --val /data/det-val.gds --epochs 20

torchvision's detection models take a list of float images in [0, 1] and a target dict per image
with XYXY pixel boxes and labels from 1 (0 is their background): the Loader gives the images as one
tensor and the dicts, so the loop only shifts the labels. Meant for a GPU: on a CPU the model
trains a few images a second (the batches come far faster), so try it there with a small --imgsz
and --epochs 1.
"""

import argparse
import time

import torch
import torchvision

import gdsdata


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="packed detection set (gdsdata pack --format yolo|coco)")
    parser.add_argument("--val", help="packed validation set")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        train = gdsdata.GDSDataset(args.train, device=device)
        val = gdsdata.GDSDataset(args.val, device=device) if args.val else None
    except gdsdata.GdsDataError as e:  # no pack there, or a damaged one: one line, not a traceback
        parser.exit(1, f"train_detection.py: error: {e}\n")
    for ds in (train, val):
        if ds is not None and ds.task != "detect":
            parser.exit(1, f"train_detection.py: error: {ds.root} is a classification dataset (a label per image); "
                           f"pack a detection set with gdsdata pack --format yolo|coco\n")
    if args.batch_size > len(train):  # (drop_last: not one batch an epoch)
        parser.exit(1, f"train_detection.py: error: --batch-size {args.batch_size} is more than the {len(train)} "
                       f"images of {args.train}: no whole batch to train on\n")
    loader = gdsdata.Loader(train, args.batch_size, shuffle=True, drop_last=True,
                            transform=gdsdata.YoloAugment(imgsz=args.imgsz, epochs=args.epochs, dtype="float32"))
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=len(train.classes) + 1,
        min_size=args.imgsz, max_size=args.imgsz).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    step, total = 0, len(loader) * args.epochs
    for epoch in range(args.epochs):
        model.train()
        t0, seen = time.perf_counter(), 0
        for images, targets in loader:
            targets = [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets]
            losses = model(list(images), targets)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step, seen = step + 1, seen + len(images)
            print(f"epoch {epoch} step {step}/{total} loss {loss.item():.3f}", flush=True)
            if args.max_steps and step >= args.max_steps:
                break
        print(f"epoch {epoch}: {seen / (time.perf_counter() - t0):.0f} images/s")
        if args.max_steps and step >= args.max_steps:
            break
    if val is not None:
        evaluate(model, val, args)


@torch.no_grad()
def evaluate(model, ds, args):
    """Detections per image on Letterbox batches (their boxes are in the letterboxed frame)."""
    model.eval()
    found = images_seen = 0
    for images, _ in gdsdata.Loader(ds, args.batch_size, shuffle=False,
                                    transform=gdsdata.Letterbox(imgsz=args.imgsz, dtype="float32")):
        found += sum(len(d["boxes"]) for d in model(list(images)))
        images_seen += len(images)
    print(f"validation: {found} detections on {images_seen} images")


if __name__ == "__main__":
    main()
