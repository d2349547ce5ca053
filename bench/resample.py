#!/usr/bin/env python3
"""The resize kernels alone, and what they cost a train step on the same GPU.

One batch of decoded images of ImageNet-like sizes (333-500 x 375-500, random pixels) in GPU memory,
RandomResizedCrop(224) fp16 NCHW with the library's own crop parameters (8 batches of them, in turn):

  alone    the kernels' GPU time a batch (torch.profiler), antialiased (torchvision v2's default)
           and plain bilinear
  beside   bench/train.py's ResNet train step (bf16 autocast, channels_last, SGD, batch 256) on
           synthetic input, the resize launched once a step on a side stream: images/s against the
           step alone, passes interleaved, median of --passes

Compare two commits by running it in a checkout of each.

    python bench/resample.py --out results/
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import begin  # noqa: E402
from train import _Model  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata.transforms.kernels import resample  # noqa: E402

BATCH = 256
MEAN_STD = ((1 / 58.4, 1 / 57.1, 1 / 57.4), (-2.1, -2.0, -1.8))  # ImageNet's, as scale and shift


def batch_tables(sets=8):
    """A flat buffer of BATCH random images and ``sets`` crop tables (``transforms.apply``'s rows) over it."""
    rng = np.random.default_rng(0)
    h, w, c = rng.integers(333, 501, BATCH), rng.integers(375, 501, BATCH), np.full(BATCH, 3)
    sizes = h * w * c
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    buffer = torch.randint(0, 256, (int(sizes.sum()),), dtype=torch.uint8, device="cuda")
    crop = gdsdata.RandomResizedCrop(224, seed=1)
    metas = []
    for k in range(sets):
        p = crop.params(h, w, np.arange(BATCH) + k * BATCH)
        metas.append(np.stack([offsets, h, w, c, p.top, p.left, p.height, p.width, p.flip.astype(np.int64)],
                              1).astype(np.int64))
    return buffer, metas


def kernel_ms(work, batches=20) -> float:
    """GPU time of the kernels ``work(i)`` launches, per call (torch.profiler)."""
    for i in range(8):
        work(i)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(batches):
            work(i)
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name) / 1e3 / batches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="torchvision model of the train step")
    parser.add_argument("--steps", type=int, default=60, help="steps a pass")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out", default="bench-results", help="folder for resample.json")
    args, system = begin(parser, argv)
    if not torch.cuda.is_available():
        print("bench/resample.py needs a CUDA GPU")
        return 1
    buffer, metas = batch_tables()
    out = torch.empty((BATCH, 3, 224, 224), dtype=torch.float16, device="cuda")
    kinds = {"antialiased": True, "bilinear": False}

    def work(antialias):
        return lambda i: resample(buffer, metas[i % len(metas)], out, (224, 224), *MEAN_STD, True, antialias)

    results = {name: {"kernel_ms": kernel_ms(work(aa))} for name, aa in kinds.items()}

    model = _Model(args.model)  # the training client's step
    images = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.float16)
    labels = torch.randint(0, 1000, (BATCH,), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the buffer and tables were made on the current stream

    def rate(beside, steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            if beside is not None:
                with torch.cuda.stream(side):
                    beside(i)
            model.step(images, labels)
        torch.cuda.synchronize()
        return steps * BATCH / (time.perf_counter() - t0)

    rows = {"step alone": None, **{name: work(aa) for name, aa in kinds.items()}}
    for beside in rows.values():  # kernels compiled, cuDNN's choices made
        rate(beside, 30)
    rates = {name: [] for name in rows}
    for _ in range(args.passes):
        for name, beside in rows.items():
            rates[name].append(rate(beside, args.steps))
    alone = statistics.median(rates["step alone"])
    print(f"\n== {BATCH} crops to 224 px fp16; {args.model} train step, batch {BATCH}, median of {args.passes} "
          f"passes of {args.steps} steps ==")
    print(f"{'resize':<12} {'kernel ms':>9} {'images/s':>9} {'of the step alone':>18}")
    for name in rows:
        r = results.setdefault(name, {"kernel_ms": 0.0})
        r.update(images_per_s=statistics.median(rates[name]), rates=rates[name],
                 of_step_alone=statistics.median(rates[name]) / alone)
        print(f"{name:<12} {r['kernel_ms']:9.3f} {r['images_per_s']:9.0f} {r['of_step_alone']:18.4f}")
    with open(os.path.join(args.out, "resample.json"), "w") as f:
        json.dump({"system": system, "results": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
