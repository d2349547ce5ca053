#!/usr/bin/env python3
"""Do the JPEG engines wait on Python? Every nvJPEG batched call timed from the host, in the
minimal loop over staged bytes and in the Loader (decode only, and training batches), so that the
time between one call's return and the next call is seen directly: while it lasts, no new work
reaches the engines. Per row: images/s, the mean call, and the gaps between calls (mean, median,
90th percentile, largest, their share of the wall time) and, in the Loader, that pause split into
the decode thread's work after a call, between two batches and before the next call; for several
Loader batch sizes (``--batch-sizes``, one after the other on one dataset and so on the process's
one nvJPEG handle) and interpreter switch intervals (``--switch-intervals``: the lock the Loader's
threads share hands over at most that often to a waiting thread).

    python bench/decode_gaps.py --dir /tmp/bench --count 10000 --batch-sizes 256,512
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import loader_epoch, print_system_block, shard_paths, system_block, warm  # noqa: E402
from decode_ceiling import staged_batches  # noqa: E402
from make_images import generate  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata import format as fmt  # noqa: E402
from gdsdata import nvjpeg  # noqa: E402

BATCH = 256


class Clock:
    """Host timestamps (start, end) of every call of ``owner.name`` while installed."""

    def __init__(self, owner, name):
        self.owner, self.name, self.calls = owner, name, []
        self._original = getattr(owner, name)

    def __enter__(self):
        calls, original = self.calls, self._original

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                calls.append((t0, time.perf_counter()))

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self._original)


def summary(calls, works, images, seconds) -> str:
    """images/s; the mean nvJPEG call; the stretches with no call in flight (mean, median, 90th
    percentile, largest, and their share of the wall time); with the decode thread's work items
    (``works``, one per call), the mean pause split into the work after a call, the time between
    two work items (handing one on, taking the next) and the work before the next call."""
    calls = np.asarray(sorted(calls))
    inside = (calls[:, 1] - calls[:, 0]) * 1e3
    gaps = np.maximum(calls[1:, 0] - np.maximum.accumulate(calls[:-1, 1]), 0) * 1e3
    line = (f"{images / seconds:9.0f} images/s  call {inside.mean():6.2f} ms  none in flight: mean "
            f"{gaps.mean():5.2f} median {np.median(gaps):5.2f} p90 {np.percentile(gaps, 90):5.2f} max "
            f"{gaps.max():6.2f} ms, {gaps.sum() / 1e3 / seconds:5.1%} of wall")
    if len(works) == len(calls):  # one call per work item: the pause, piece by piece
        works = np.asarray(sorted(works))
        after = (works[:-1, 1] - calls[:-1, 1]).mean() * 1e3
        between = (works[1:, 0] - works[:-1, 1]).mean() * 1e3
        before = (calls[1:, 0] - works[1:, 0]).mean() * 1e3
        line += f"  (after a call {after:.2f}, between items {between:.2f}, before the next {before:.2f} ms)"
    return line


def timed_epochs(epoch, epochs):
    """Run one untimed epoch, then ``epochs`` timed ones with every nvJPEG call and every decode
    work item of a Loader (``GDSDataset.decode_staged``) timed: (calls, works, seconds)."""
    epoch()
    torch.cuda.synchronize()
    with Clock(nvjpeg.BatchedDecoder, "decode") as calls, Clock(gdsdata.GDSDataset, "decode_staged") as works:
        t0 = time.perf_counter()
        for _ in range(epochs):
            epoch()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return calls.calls, works.calls, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="working folder for images and datasets")
    parser.add_argument("--count", type=int, default=10000, help="images (default 10000)")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per row")
    parser.add_argument("--noise", type=float, default=15.0, help="image set, as bench/gpu.py")
    parser.add_argument("--quality", type=int, default=92)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--switch-intervals", default="0.005", help="comma-separated, seconds")
    parser.add_argument("--batch-sizes", default=str(BATCH), help="comma-separated Loader batch sizes")
    args = parser.parse_args(argv)
    print_system_block(system_block())
    image_set = f"n{args.noise:g}-q{args.quality}-s{args.scale:g}"
    src = os.path.join(args.dir, f"images-{image_set}")
    if not os.path.exists(os.path.join(src, f".complete-{args.count}")):
        generate(src, args.count, classes=100, noise=args.noise, quality=args.quality, scale=args.scale)
        open(os.path.join(src, f".complete-{args.count}"), "w").close()
    root = os.path.join(args.dir, f"jpeg-{image_set}.gds")
    if not os.path.exists(os.path.join(root, fmt.INDEX_NAME)):
        gdsdata.pack(src, root, overwrite=True)
    ds = gdsdata.GDSDataset(root, device="cuda")
    warm(shard_paths(ds))
    n = len(ds)
    print(f"{n} images, gdsdata {gdsdata.__file__}, path {ds._backend.describe()}")

    _, batches = staged_batches(gdsdata.GDSDataset(root), BATCH, False)
    stream = torch.cuda.current_stream()

    def loop():
        for data, lengths, outs, pitches, _ in batches:
            loop.decoder.decode(data, lengths, outs, pitches, stream.cuda_stream)

    def row(label, epoch):
        calls, works, seconds = timed_epochs(epoch, args.epochs)
        print(f"switch {interval * 1e3:4g} ms  {label:32s}{summary(calls, works, n * args.epochs, seconds)}",
              flush=True)

    default = sys.getswitchinterval()
    for interval in [float(x) for x in args.switch_intervals.split(",") if x]:
        sys.setswitchinterval(interval)
        # the loop's own hardware handle lives for its row only, as in bench/gpu.py
        loop.decoder = nvjpeg.BatchedDecoder("hardware")
        row("nvJPEG loop, staged bytes", loop)
        loop.decoder.close()
        for size in [int(x) for x in args.batch_sizes.split(",") if x]:
            rows = [("decode only", loader_epoch(ds, None, batch=size)),
                    ("train batches", loader_epoch(ds, gdsdata.RandomResizedCrop(224, dtype="float16"), batch=size))]
            for name, epoch in rows:
                row(f"Loader {name}, batch {size}", epoch)
                epoch.close()
    sys.setswitchinterval(default)
    ds.close()


if __name__ == "__main__":
    main()
