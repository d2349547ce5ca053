#!/usr/bin/env python3
"""What the GPU input path costs a train step on the same GPU, stage by stage.

Where the training client (bench/train.py) gives one figure per input, this splits the JPEG path's:
one batch of its work a train step, on a side stream, from a thread of its own (as the Loader's
threads do), beside bench/train.py's own train step on synthetic input:

  step alone        the train step, nothing beside it
  decode            the batch decoded by nvJPEG from its staging buffer (the dataset's own decoder;
                    the batches are read into staging once, before: the training client times the reads)
  decode + resize   the same, then RandomResizedCrop(224) fp16 NCHW, antialiased (torchvision v2's
                    default) or plain bilinear

images/s as a fraction of the step alone, the modes interleaved pass by pass (alternating their
order), medians over --passes. Before that, the resize kernels alone: their GPU time a batch
(torch.profiler) over the same decoded batches.

    python bench/beside.py --dir /tmp/beside --out results/
"""

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import begin, image_set  # noqa: E402
from train import BATCH, _Model  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata import transforms as T  # noqa: E402

RESIZES = {"antialiased": True, "bilinear": False}


def dataset(folder, count):
    """``count`` ImageNet-like JPEGs (bench/train.py's set) packed once; the GPU dataset over them."""
    src = image_set(os.path.join(folder, f"images-{count}"), count, classes=8, noise=11.0, quality=92)
    root = os.path.join(folder, f"jpeg-{count}.gds")
    if not os.path.exists(os.path.join(root, "index.gdsi")):
        gdsdata.pack(src, root, overwrite=True)
    return gdsdata.GDSDataset(root, device="cuda")


class Input:
    """The JPEG path's GPU work for batch ``k`` (of the dataset's whole batches, in turn, each read into
    its staging buffer once) on ``stream``: nvJPEG's decode, then the resize if asked."""

    def __init__(self, ds):
        self.ds = ds
        batches = [list(range(b * BATCH, (b + 1) * BATCH)) for b in range(len(ds) // BATCH)]
        ds.reserve_staging(len(batches))
        self.staged = [ds.read_staged(indices) for indices in batches]
        # the crops made once, as a Loader's transform is, not once a batch
        self.transforms = {aa: gdsdata.RandomResizedCrop(224, dtype="float16", antialias=aa) for aa in RESIZES.values()}
        torch.cuda.synchronize()  # reads still in flight on the GPU (device staging) have landed

    def decode(self, k, stream):
        """Batch ``k`` decoded on ``stream`` from its staging buffer, which stays held for the next
        use (the dataset's ``decode_staged`` hands the buffer back after one decode: hence its
        decoder itself), as the Loader's decode thread decodes; the arena is freed when the returned
        batch goes."""
        staged = self.staged[k % len(self.staged)]
        with torch.cuda.stream(stream):
            return self.ds._backend.decoder.decode(staged.tensor, staged.job, stream), staged.indices

    def __call__(self, k, stream, antialias=None):
        batch, indices = self.decode(k, stream)
        if antialias is not None:
            with torch.cuda.stream(stream):
                self.resize(batch, indices, k, antialias)

    def close(self):
        for staged in self.staged:
            self.ds.release_staged(staged)
        self.ds.close()

    def resize(self, batch, indices, k, antialias):
        transform = self.transforms[antialias]
        params = transform.params(batch.heights, batch.widths, indices, epoch=k)
        T.apply(transform, batch.buffer, batch.offsets, batch.heights, batch.widths, batch.channels, params)


def kernel_ms(inputs, antialias, batches=16) -> float:
    """GPU time a batch of the resize kernels alone (torch.profiler), over decoded batches kept aside."""
    stream = torch.cuda.current_stream()
    decoded = [inputs.decode(k, stream) for k in range(4)]
    for k in range(4):
        inputs.resize(*decoded[k % 4], k, antialias)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for k in range(batches):
            inputs.resize(*decoded[k % 4], k, antialias)
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name) / 1e3 / batches


def rate(model, work, steps, images, labels) -> tuple:
    """(images/s, batches of input work a step) over ``steps`` train steps while a thread does
    ``work(k, stream)`` on a side stream, a batch for each step the loop has issued (at most two
    ahead, as the Loader's prefetch); ``work`` None: the step alone."""
    tokens, stop, failed, done = threading.Semaphore(2), threading.Event(), [], [0]
    side = torch.cuda.Stream()

    def feed():
        try:
            while not stop.is_set():
                if tokens.acquire(timeout=0.1):
                    work(done[0], side)
                    side.synchronize()
                    done[0] += 1
        except BaseException as e:  # noqa: BLE001 - raised by the pass
            failed.append(e)

    feeder = threading.Thread(target=feed, daemon=True) if work is not None else None
    if feeder is not None:
        feeder.start()
    try:
        torch.cuda.synchronize()
        t0, first = time.perf_counter(), done[0]
        for _ in range(steps):
            model.step(images, labels)
            tokens.release()
        torch.cuda.synchronize()
        seconds, batches = time.perf_counter() - t0, done[0] - first
    finally:
        stop.set()
    if feeder is not None:
        feeder.join(timeout=60)
        if feeder.is_alive():
            raise RuntimeError("the input work beside the step made no progress for 60 s")
    if failed:
        raise failed[0]
    return steps * BATCH / seconds, (batches / steps if work is not None else 0.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="working folder for the images and their pack")
    parser.add_argument("--count", type=int, default=2048, help=f"images, at least {BATCH} (default 2048: 8 batches)")
    parser.add_argument("--models", default="resnet18,resnet50", help="torchvision models of the train step")
    parser.add_argument("--steps", default="100,36", help="steps a pass: one count for every model, or one each")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out", default="bench-results", help="folder for beside.json")
    args, system = begin(parser, argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    if len(steps) == 1:
        steps *= len(models)
    if len(steps) != len(models) or args.count < BATCH:
        parser.error(f"--steps takes one count, or one per model ({len(models)}); --count at least {BATCH}")
    if not torch.cuda.is_available():
        print("bench/beside.py needs a CUDA GPU")
        return 1
    inputs = Input(dataset(args.dir, args.count))
    print(f"path: {inputs.ds.load_path.describe()}")
    results = {"arguments": vars(args),
               "kernel_ms": {name: kernel_ms(inputs, aa) for name, aa in RESIZES.items()}}
    print(f"\n== resize kernels alone, GPU ms a batch of {BATCH} (RandomResizedCrop 224, fp16 NCHW; the kernels' "
          f"time under torch.profiler) ==")
    for name, ms in results["kernel_ms"].items():
        print(f"{name:<12} {ms:7.3f}")
    modes = {"step alone": None, "decode": inputs,
             **{f"decode + {name} resize": functools.partial(inputs, antialias=aa) for name, aa in RESIZES.items()}}
    images = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.float16)
    labels = torch.randint(0, 1000, (BATCH,), device="cuda")
    for name, count in zip(models, steps):
        model = _Model(name)
        for work in modes.values():  # cuDNN's choices made, the kernels compiled, the decoder created
            rate(model, work, 15, images, labels)
        runs = {mode: [] for mode in modes}
        for p in range(args.passes):
            for mode in (list(modes) if p % 2 == 0 else list(modes)[::-1]):
                runs[mode].append(rate(model, modes[mode], count, images, labels))
        alone = statistics.median(r for r, _ in runs["step alone"])
        print(f"\n== {name} train step (bf16, channels_last, SGD, batch {BATCH}) with a batch of input work a "
              f"step beside it; median of {args.passes} passes of {count} steps ==")
        print(f"{'beside the step':<28} {'images/s':>9} {'of the step alone':>18} {'batches/step':>13}  each pass")
        rows = results.setdefault(name, {})
        for mode, values in runs.items():
            rates = [r for r, _ in values]
            median = statistics.median(rates)
            per_step = statistics.median(b for _, b in values)
            rows[mode] = {"images_per_s": median, "of_step_alone": median / alone, "rates": rates,
                          "batches_per_step": [b for _, b in values]}
            print(f"{mode:<28} {median:9.0f} {median / alone:18.4f} {per_step:13.2f}  "
                  + " ".join(f"{v:.0f}" for v in rates))
        del model
    inputs.close()
    with open(os.path.join(args.out, "beside.json"), "w") as f:
        json.dump({"system": system, "results": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
