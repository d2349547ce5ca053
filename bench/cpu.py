#!/usr/bin/env python3
"""The CPU path beside the CPU loaders people use, on the same cores, in one run.

Every pipeline produces antialiased random-resized-crop 224 training batches with a horizontal flip
(uint8, or float32 normalised with --float) from the same JPEGs:

  gdsdata       gdsdata.Loader on the CPU (its cpu_threads pool), checksums checked (the default)
  gdsdata-nocrc the same with verify_checksums=False: what the checksums cost
  imagefolder   torchvision ImageFolder + PIL + DataLoader(--workers) + transforms.v2
  litdata       litdata's optimize() of the same files, StreamingDataset + StreamingDataLoader(--workers),
                torchvision decode_jpeg + transforms.v2 (when litdata imports)
  ffcv          an FFCV .beton of the same files, RandomResizedCropRGBImageDecoder (when ffcv imports)

Modes: the loader alone, and feeding a small convolutional model's train step on the CPU (--model),
which takes its share of the same cores. Rows are interleaved over --rounds rounds; the figure is the
median epoch over rounds, CPU-seconds per 1,000 images count the process and its workers.

    python bench/cpu.py --dir /tmp/cpu-bench --count 2000 --model --out results/cpu-uint8
    python bench/cpu.py --dir /tmp/cpu-bench --count 2000 --model --float --out results/cpu-float
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import begin, build_pipelines, cpu_seconds, image_set, interleaved  # noqa: E402

import gdsdata  # noqa: E402

SIZE = 224
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def _v2(float_out):
    from torchvision.transforms import v2

    # on the PIL image, then to a tensor: torchvision's fast order (on a tensor first it took twice as long)
    steps = [v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage()]
    if float_out:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize([m / 255 for m in MEAN], [s / 255 for s in STD])]
    return v2.Compose(steps)


def gdsdata_pipeline(args, root, float_out, verify=None):
    ds = gdsdata.GDSDataset(root, verify_checksums=verify)
    loader = gdsdata.Loader(ds, args.batch, shuffle=True, drop_last=True,
                            transform=gdsdata.RandomResizedCrop(SIZE, dtype="float32" if float_out else "uint8"))

    def batches():
        """One epoch; the Loader closed after it, so that it reads no further epoch ahead while the
        other rows are timed (that work would count against them, and give this row a head start)."""
        try:
            yield from loader
        finally:
            loader.close()

    return batches


def imagefolder_pipeline(args, src, float_out):
    from torchvision.datasets import ImageFolder

    loader = torch.utils.data.DataLoader(ImageFolder(src, transform=_v2(float_out)), batch_size=args.batch,
                                         shuffle=True, drop_last=True, num_workers=args.workers,
                                         persistent_workers=True, prefetch_factor=4)
    return lambda: iter(loader)


try:  # at module level, so that the StreamingDataLoader's spawned workers can unpickle it
    import litdata

    class LitJpegs(litdata.StreamingDataset):
        """litdata's usual recipe: JPEG bytes and label per sample, torchvision decode + v2 on read."""

        def __init__(self, root, transform):
            super().__init__(root, shuffle=True, drop_last=True)
            self.augment = transform  # not "transform": StreamingDataset applies that one to the raw item

        def __getitem__(self, index):
            from torchvision.io import decode_jpeg

            data, label = super().__getitem__(index)
            return self.augment(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))), label
except ImportError:
    litdata = None


def _lit_item(path_label):
    path, label = path_label
    with open(path, "rb") as f:
        return f.read(), label


def litdata_pipeline(args, src, float_out):
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    if litdata is None:
        raise ImportError("litdata is not installed")
    root = os.path.join(args.dir, "litdata")
    if not os.path.exists(os.path.join(root, "index.json")):
        samples = ImageFolder(src).samples
        litdata.optimize(fn=_lit_item, inputs=samples, output_dir=root, chunk_bytes="64MB",
                         num_workers=args.workers, mode="overwrite")
    # decode_jpeg gives a tensor: the crop then runs on the tensor, antialiased
    steps = [v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()]
    if float_out:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize([m / 255 for m in MEAN], [s / 255 for s in STD])]
    dataset = LitJpegs(root, v2.Compose(steps))
    loader = litdata.StreamingDataLoader(dataset, batch_size=args.batch, num_workers=args.workers,
                                         drop_last=True, persistent_workers=True)
    return lambda: iter(loader)


def ffcv_pipeline(args, src, float_out):
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    path = os.path.join(args.dir, "images.beton")
    if not os.path.exists(path):
        DatasetWriter(path, {"image": RGBImageField(write_mode="raw_jpg" if hasattr(RGBImageField, "RAW_JPG")
                                                    else "jpg", jpeg_quality=95),
                             "label": IntField()}, num_workers=args.workers).from_indexed_dataset(ImageFolder(src))
    image = [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip()]
    if float_out:
        image += [NormalizeImage(np.array(MEAN), np.array(STD), np.float32)]
    image += [ToTensor(), ToTorchImage()]
    loader = Loader(path, batch_size=args.batch, num_workers=args.workers, order=OrderOption.RANDOM,
                    drop_last=True, pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]})
    return lambda: iter(loader)


PIPELINES = {"gdsdata": gdsdata_pipeline,
             "gdsdata-nocrc": lambda args, root, float_out: gdsdata_pipeline(args, root, float_out, verify=False),
             "imagefolder": imagefolder_pipeline, "litdata": litdata_pipeline, "ffcv": ffcv_pipeline}


def small_model():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4, padding=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 100))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def epoch(make, model):
    n, t0, c0 = 0, time.perf_counter(), cpu_seconds()
    for images, labels in make():
        if model is not None:
            net, optimizer = model
            x = images if images.dtype == torch.float32 else images.float().div_(255)
            loss = torch.nn.functional.cross_entropy(net(x), labels.long())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        n += len(labels)
    return n / (time.perf_counter() - t0), (cpu_seconds() - c0) / n * 1000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data/cpu", help="working folder")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers (= cores)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds after a warm-up")
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--float", action="store_true", help="float32 normalised output instead of uint8")
    parser.add_argument("--model", action="store_true", help="also time each pipeline feeding a small CPU model")
    parser.add_argument("--out", default="bench-results")
    args, system = begin(parser, argv)
    src = image_set(os.path.join(args.dir, f"images-{args.count}"), args.count, classes=10)
    root = os.path.join(args.dir, f"jpeg-{args.count}.gds")  # a set of another --count is another set
    if not os.path.exists(os.path.join(root, "index.gdsi")):
        gdsdata.pack(src, root, overwrite=True)
    builders = {name: (lambda a, f, build=build, name=name: build(a, root if name.startswith("gdsdata") else src, f))
                for name, build in PIPELINES.items()}
    pipelines = build_pipelines(builders, args.pipelines.split(","), args, args.float)
    modes = [("alone", None)] + ([("with a small CPU model", small_model())] if args.model else [])
    table = interleaved(pipelines, modes, args.rounds, epoch)
    table.sort(key=lambda row: list(pipelines).index(row["pipeline"]))  # each pipeline's modes together
    print(f"\n== {args.count} JPEGs, batch {args.batch}, RandomResizedCrop {SIZE} antialiased + flip, "
          f"{'float32 normalised' if args.float else 'uint8'}, {os.cpu_count()} cores ==")
    for row in table:
        peers = [r for r in table if r["mode"] == row["mode"] and not r["pipeline"].startswith("gdsdata")]
        best = max((r["images_per_s"] for r in peers), default=None)
        ratio = f"{row['images_per_s'] / best:.2f}x the best peer" if best and row["pipeline"] == "gdsdata" else ""
        row["vs_best_peer"] = row["images_per_s"] / best if best else None
        print(f"{row['pipeline']:<12} {row['mode']:<24} {row['images_per_s']:7.0f} images/s "
              f"({min(row['rates']):.0f}-{max(row['rates']):.0f})  {row['cpu_s_per_1k']:5.2f} CPU-s/1k  {ratio}")
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump({"system": system, "args": vars(args), "results": table}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
