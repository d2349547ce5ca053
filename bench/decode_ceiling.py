#!/usr/bin/env python3
"""How fast can nvJPEG's batched decoder go on this GPU? Variants of the minimal loop over bytes
already staged in pinned host memory, in sections (``--sections``; run a risky one in a process of
its own, under ``timeout``):

- whole: the HARDWARE loop alone (always first);
- window: decoding only each image's random-resized-crop window (``nvjpegDecodeBatchedEx``, one ROI
  per image) instead of the whole image;
- split: the engines beside the SMs, part of each batch through GPU_HYBRID(_DEVICE) at the same time
  (hung on the H200: see docs/benchmarks.md);
- handles: batch size, chroma upsampling flag, several decoder handles on several threads;
- states: one handle, several decode states on several threads, each with its share of the batches
  (while one thread is between calls, another keeps the engines busy).

Every row gives images/s and process CPU-seconds per 1,000 images.

    python bench/decode_ceiling.py --dir /tmp/bench --count 10000 --sections whole,window
"""

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import print_system_block, system_block  # noqa: E402
from make_images import generate  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata import nvjpeg  # noqa: E402
from gdsdata.errors import GpuUnavailableError  # noqa: E402


def arena(sizes):
    """One GPU output buffer for images of ``sizes`` bytes, and each image's address in it."""
    offsets = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8, device="cuda")
    return buffer, (buffer.data_ptr() + offsets).tolist()


def staged_batches(ds, batch, device_bitstreams):
    """Every payload of the CPU dataset ``ds`` read once into pinned memory (and copied to the GPU
    for the device-bitstream backends), cut into batches with their output arenas allocated."""
    samples = ds.index.samples
    buffer, plan = ds._backend.reader.read(list(range(len(samples))))
    host = torch.from_numpy(buffer).pin_memory()
    staged = host.cuda() if device_bitstreams else host
    sizes = samples["height"].astype(np.int64) * samples["width"].astype(np.int64) * 3
    out = []
    for start in range(0, len(samples), batch):
        k = slice(start, min(start + batch, len(samples)))
        pixels, outs = arena(sizes[k])
        out.append(((staged.data_ptr() + plan.sample_offsets[k]).tolist(), plan.sample_lengths[k].tolist(),
                    outs, (samples["width"][k].astype(np.int64) * 3).tolist(), pixels))
    return staged, out


def window_batches(ds, batches, seed=0):
    """The same batches with one random-resized-crop window per image (the crop a training batch
    would take) and output arenas of the windows' sizes."""
    samples, crop, out, start = ds.index.samples, gdsdata.RandomResizedCrop(224, seed=seed), [], 0
    for data, lengths, _, _, _ in batches:
        k = np.arange(start, start + len(data))
        start += len(data)
        p = crop.params(samples["height"][k], samples["width"][k], k)
        pixels, outs = arena(np.asarray(p.height * p.width * 3, np.int64))
        rois = list(zip(p.left.tolist(), p.top.tolist(), p.width.tolist(), p.height.tolist()))
        out.append((data, lengths, outs, (p.width * 3).tolist(), pixels, rois))
    return out


def run(batches, backend, handles, interpolate, repeats=3, share=False):
    """(images/s, CPU-s per 1,000 images) of ``handles`` decoders of one backend, each with its share
    of ``batches`` (``share``: the first decoder's handle, a state each)."""
    return run_jobs([(backend, batches[h::handles]) for h in range(handles)], interpolate, repeats, share)


def timed(body, repeats, failed):
    """Run ``body`` ``repeats`` + 1 times, the first a warm-up, stopping early once ``failed()``:
    (median seconds, median process CPU-seconds) of the timed runs (of the last run, if it stopped
    early)."""
    times, cpu = [], []
    for _ in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        body()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if failed():
            break
    return float(np.median(times[1:] or times)), float(np.median(cpu[1:] or cpu))


def run_jobs(jobs, interpolate=True, repeats=3, share=False):
    """(images/s, process CPU-s per 1,000 images) of several decoders at once, one per
    ``(backend, batches)`` job, each on its own stream: the first job on the calling thread, the
    others on threads of their own (ctypes lets go of the interpreter during nvJPEG's calls). With
    ``share``, the decoders use the first one's handle, each with a decode state of its own."""
    flag = nvjpeg.FLAG_UPSAMPLING_WITH_INTERPOLATION
    if not interpolate:
        nvjpeg.FLAG_UPSAMPLING_WITH_INTERPOLATION = 0
    decoders = [nvjpeg.BatchedDecoder(jobs[0][0])]
    decoders += [nvjpeg.BatchedDecoder(backend, share=decoders[0] if share else None) for backend, _ in jobs[1:]]
    nvjpeg.FLAG_UPSAMPLING_WITH_INTERPOLATION = flag
    streams = [torch.cuda.Stream() for _ in jobs]
    errors = []

    def worker(h):
        try:
            with torch.cuda.stream(streams[h]):
                for data, lengths, outs, pitches, _, *rois in jobs[h][1]:  # rois: window_batches'
                    decoders[h].decode(data, lengths, outs, pitches, streams[h].cuda_stream,
                                       **({"rois": rois[0]} if rois else {}))
            streams[h].synchronize()
        except Exception as e:  # noqa: BLE001 - a failed decode must fail the row, not print a rate
            e.backend = jobs[h][0]  # which decoder of the row failed
            errors.append(e)

    def all_jobs():
        threads = [threading.Thread(target=worker, args=(h,)) for h in range(1, len(jobs))]
        for t in threads:
            t.start()
        worker(0)
        for t in threads:
            t.join()

    seconds, cpu = timed(all_jobs, repeats, lambda: bool(errors))
    for d in reversed(decoders):  # sharers before the decoder whose handle they use
        d.close()
    if errors:
        raise errors[0]
    count = sum(len(b[0]) for _, batches in jobs for b in batches)
    return count / seconds, 1000 * cpu / count


def images(batches, start, stop=None):
    """Images ``start:stop`` of each batch, as a list of batches."""
    return [tuple(part[start:stop] for part in b[:4]) + (b[4],) for b in batches]


def split(batches, cut):
    """Each batch's first ``cut`` images, and the rest, as two lists of batches."""
    return images(batches, 0, cut), images(batches, cut)


SECTIONS = ("whole", "window", "split", "handles", "states")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (run a risky one in a process of its own)")
    parser.add_argument("--shares", default="64,128", help="images of each batch of 256 beside the engines (split)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        parser.error(f"unknown sections {sorted(sections - set(SECTIONS))}")
    print_system_block(system_block())
    src = os.path.join(args.dir, "images")
    if not os.path.exists(os.path.join(src, f".complete-{args.count}")):
        generate(src, args.count, classes=100)
        open(os.path.join(src, f".complete-{args.count}"), "w").close()
    out = os.path.join(args.dir, "jpeg.gds")
    if not os.path.exists(os.path.join(out, "index.gdsi")):
        gdsdata.pack(src, out, overwrite=True)
    ds = gdsdata.GDSDataset(out)
    print(f"{'backend':<16} {'batch':>6} {'handles':>8} {'interp':>7} {'images/s':>10} {'CPU-s/1k':>9}")

    def measured(fn):
        try:
            rate, cpu = fn()
            return f"{rate:>10.0f} {cpu:>9.3f}"
        except (nvjpeg.NvjpegError, GpuUnavailableError) as e:
            return f"failed ({getattr(e, 'backend', '?')}): {e}"

    def row(label, batches, backend, handles, interpolate, batch=256, share=False):
        rate = measured(lambda: run(batches, backend, handles, interpolate, share=share))
        print(f"{label:<16} {batch:>6} {handles:>8} {str(interpolate):>7} {rate}", flush=True)

    held = staged_batches(ds, 256, False)  # pinned host bitstreams: what compatibility mode stages
    row("hardware", held[1], "hardware", 1, True)
    if "states" in sections:  # one handle (all the engines allow), a decode state per thread
        for states in (2, 3):
            row(f"hardware, {states} states", held[1], "hardware", states, True, share=True)
    if "window" in sections:  # whole images against their random-resized-crop windows
        row("hardware, windows (random-resized-crop, one ROI per image)", window_batches(ds, held[1]),
            "hardware", 1, True)
    if "split" in sections:  # the engines beside the SMs: part of each batch with Huffman on the GPU
        on_gpu = staged_batches(ds, 256, True)
        for backend, staged in (("gpu_hybrid", held), ("gpu_hybrid_device", on_gpu)):
            row(backend, staged[1], backend, 1, True)
            for share in map(int, args.shares.split(",")):  # GPU Huffman needs batches of over 50
                engines, _ = split(held[1], 256 - share)
                _, sms = split(staged[1], 256 - share)
                alone = [measured(lambda job=job: run_jobs([job])) for job in (("hardware", engines),
                                                                                 (backend, sms))]
                print(f"hardware {256 - share} alone {alone[0]}; {backend} {share} alone {alone[1]}", flush=True)
                together = measured(lambda e=engines, s=sms, b=backend: run_jobs([("hardware", e), (b, s)]))
                print(f"hardware {256 - share} + {backend} {share} of each batch, at once {together}", flush=True)
        del on_gpu
    del held
    if "handles" in sections:
        for backend in ("hardware_device", "hardware"):  # several HARDWARE handles failed on the H200: last
            for batch in (256, 128):
                staged = staged_batches(ds, batch, backend.endswith("_device"))
                for handles in (1, 2):
                    for interpolate in (True, False):
                        if handles > 1 and not interpolate:
                            continue
                        row(backend, staged[1], backend, handles, interpolate, batch)
                del staged


if __name__ == "__main__":
    main()
