"""Spare CPU cores decoding part of each JPEG batch beside nvJPEG's hardware engines (off by default).

The engines are the JPEG ceiling on the H200: one batched HARDWARE decoder runs about 26,000 of our
100 KB images/s and a second decoder only slows the first. Host threads running nvJPEG's decoupled
phases (``nvjpeg_host.HostHuffmanDecoder``: Huffman decoding on the thread, the rest on the GPU) add to
it: on the H200 (``bench/decode_ceiling.py --sections cpu``) each thread decoded 551 images/s at
1.8 CPU-ms an image, and eight threads taking 32 images of every 256 ran beside the engines without
slowing them (28,699 images/s together against 25,676 for the engines' 224 alone).

Used with pinned host staging (the bitstreams must be readable by the CPU) and the HARDWARE backend.
Each batch's last ``share(n)`` images go to the threads, in equal parts, the rest to the engines.
The threads are native (``nvjpeg_host.HostDecodePool``, ``_hostdecode.c``): with Python threads around
the same native loop, on the H200 each spent about 4 ms of a 10 ms batch in the loop and the rest
outside it (Python around the loop, a dozen threads sharing one interpreter lock), and the Loader
ran 8-12 % slower with them than without.

The share follows the measured rates: after each batch, the engines' images per second (CUDA
events around their part) and the threads' images per second of wall time set the next share, so
that both parts of a batch take about as long whatever else runs on the machine.

Off by default (``assist_threads=0``): on the H200 the Loader ran 5-20 % slower with the native
threads too, in every design and thread count measured, the engines' own rate falling while the
threads ran (docs/benchmarks.md, 2026-11-30). ``stats()`` says where the time went.
"""

import os
import time

import torch

from . import settings
from .nvjpeg_host import HostDecodePool

THREAD_RATE = 550.0  # images/s of one host Huffman thread (H200 machine, 100 KB images): the first guess
ENGINE_RATE = 3700.0  # images/s of one hardware engine (H200: 7 engines, 25,900 together): the first guess
SLOTS = 16  # a thread's HostHuffmanDecoder slots: two banks, so at most 8 images of a batch a thread
_SMOOTHING = 0.25  # weight of the latest batch in the rates
_MAX_AUTO_THREADS = 12
_KEEP_CORES = 4  # left to the Loader's I/O, decode and consumer threads


def assist_threads() -> int:
    """Threads from the ``assist_threads`` setting: ``auto`` takes the cores this process may use,
    shared among the node's GPU processes (``LOCAL_WORLD_SIZE``), less four, at most twelve; none
    where gdsdata's native loop was not built."""
    value = settings.get("assist_threads")
    if value != "auto":
        return int(value)
    from .errors import GpuUnavailableError
    from .nvjpeg_host import native_loop

    try:
        native_loop()
    except GpuUnavailableError:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_process = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, min(_MAX_AUTO_THREADS, per_process - _KEEP_CORES))


class DecodeAssist:
    def __init__(self, threads: int, engines: int, device: torch.device):
        self.threads = threads
        self.device = device
        self.thread_rate = threads * THREAD_RATE  # images/s, all threads together
        self.engine_rate = engines * ENGINE_RATE  # images/s of the engines
        self._pool = None  # the HostDecodePool, made on first use (tests build the share alone)
        self._timing = None  # (images, start and end events, host seconds) of the engines' last part
        self.images = 0  # images the threads decoded
        # where the time went (``stats()``): seconds of the engines' parts (as timed), of the threads'
        # parts (submit to the end of the slowest), and of the decode thread waiting for the threads
        self.engine_images, self.engine_seconds = 0, 0.0
        self.thread_seconds, self.wait_seconds = 0.0, 0.0

    @property
    def pool(self) -> HostDecodePool:
        if self._pool is None:
            self._pool = HostDecodePool(self.threads, self.device, SLOTS)
        return self._pool

    def share(self, n: int) -> int:
        """How many of a batch of ``n`` the threads take: balancing the two rates, at least one
        image per thread (to keep measuring them) and at most ``SLOTS // 2`` per thread."""
        if n <= self.threads:
            return 0
        balanced = n * self.thread_rate / (self.thread_rate + self.engine_rate)
        return int(min(n - 1, self.threads * (SLOTS // 2), max(self.threads, round(balanced))))

    def engines_timed(self, images, stream):
        """Time the engines' part of a batch: ``end = engines_timed(images, stream)`` before queuing
        it, ``end()`` after. Its length is the longer of the host call (the library may wait for
        the engines) and the GPU time between events around it (or it may queue their work)."""
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()

        def end():
            host_seconds = time.perf_counter() - t0
            stop = torch.cuda.Event(enable_timing=True)
            stop.record(stream)
            self._read_engine_timing()
            self._timing = (images, start, stop, host_seconds)

        return end

    def _read_engine_timing(self):
        """Fold the previous batch's engine timing into the rate, once its events have completed."""
        if self._timing is None or not self._timing[2].query():
            return
        images, start, stop, host_seconds = self._timing
        self._timing = None
        seconds = max(host_seconds, start.elapsed_time(stop) / 1000)
        self.engine_images += images
        self.engine_seconds += seconds
        if seconds > 0 and images:
            self.engine_rate += _SMOOTHING * (images / seconds - self.engine_rate)

    def submit(self, start, data, lengths, outs, pitches, stream):
        """Start the host phases of images ``start:`` of a batch (pointers as ``BatchedDecoder.decode``
        takes them) on the threads. Returns a wait function: call it once the engines' part is
        queued; it queues the threads' images' copies and kernels on ``stream`` and returns the
        failures (batch position -> NvjpegError)."""
        pool = self.pool
        pool.submit(data[start:], lengths[start:], outs[start:], pitches[start:])

        def wait():
            t0 = time.perf_counter()
            errors, seconds = pool.wait(stream)  # the copies and kernels go to the batch's stream
            n = len(data) - start
            if seconds > 0:
                self.thread_rate += _SMOOTHING * (n / seconds - self.thread_rate)
            self.images += n
            self.thread_seconds += seconds
            self.wait_seconds += time.perf_counter() - t0
            return {start + k: e for k, e in errors.items()}

        return wait

    def stats(self) -> dict:
        """Totals since the assist began: images and seconds of each part, the decode thread's wait
        for the threads, the threads' wait for their slots, and the current rates (images/s) that
        set the share."""
        slot_wait = sum(d.slot_wait_seconds for d in self._pool.decoders) if self._pool is not None else 0.0
        return {"threads": self.threads, "images": self.images, "engine_images": self.engine_images,
                "engine_seconds": self.engine_seconds, "thread_seconds": self.thread_seconds,
                "wait_seconds": self.wait_seconds, "slot_wait_seconds": slot_wait,
                "engine_rate": self.engine_rate, "thread_rate": self.thread_rate}

    def close(self):
        if self._pool is not None:
            self._pool.close()
            self._pool = None
