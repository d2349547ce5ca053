"""Spare CPU cores decoding part of each JPEG batch beside nvJPEG's hardware engines.

The engines are the JPEG ceiling on the H200: one batched HARDWARE decoder runs about 26,000 of our
100 KB images/s and a second decoder only slows the first. Host threads running nvJPEG's decoupled
phases (``nvjpeg.HostHuffmanDecoder``: Huffman decoding on the thread, the rest on the GPU) add to
it: on the H200 (``bench/decode_ceiling.py --sections cpu``) each thread decoded 551 images/s at
1.8 CPU-ms an image, and eight threads taking 32 images of every 256 ran beside the engines without
slowing them (28,699 images/s together against 25,676 for the engines' 224 alone).

Used with pinned host staging (the bitstreams must be readable by the CPU) and the HARDWARE backend.
Each batch's last ``share(n)`` images go to the threads, in equal parts (one native call each, see
``_hostdecode.c``), the rest to the engines. The share follows the measured rates: after each
batch, the engines' images per second of GPU time (CUDA events around their part) and the
threads' images per second of wall time set the next share, so that both parts of a batch take
about as long whatever else runs on the machine.
"""

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import settings
from .errors import CorruptSampleError
from .nvjpeg import HostHuffmanDecoder

log = logging.getLogger(__name__)

THREAD_RATE = 550.0  # images/s of one host Huffman thread (H200 machine, 100 KB images): the first guess
ENGINE_RATE = 3700.0  # images/s of one hardware engine (H200: 7 engines, 25,900 together): the first guess
SLOTS = 8  # images a thread takes of one batch at most (HostHuffmanDecoder's slots)
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
    from .nvjpeg import native_loop

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
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gdsdata-assist")
        self._local = threading.local()
        self._workers = []  # (decoder, stream) of every thread, for close()
        self._lock = threading.Lock()
        self._timing = None  # (images, start and end events, host seconds) of the engines' last part
        self.images = 0  # images the threads decoded
        # where the time went (``stats()``): seconds of the engines' parts (as timed), of the threads'
        # parts (submit to the last one's end), and of the decode thread waiting for the threads
        self.engine_images, self.engine_seconds = 0, 0.0
        self.thread_seconds, self.wait_seconds = 0.0, 0.0

    def share(self, n: int) -> int:
        """How many of a batch of ``n`` the threads take: balancing the two rates, at least one
        image per thread (to keep measuring them) and at most ``SLOTS`` per thread."""
        if n <= self.threads:
            return 0
        balanced = n * self.thread_rate / (self.thread_rate + self.engine_rate)
        return int(min(n - 1, self.threads * SLOTS, max(self.threads, round(balanced))))

    def _worker(self):
        mine = getattr(self._local, "worker", None)
        if mine is None:
            with torch.cuda.device(self.device):
                mine = self._local.worker = (HostHuffmanDecoder(SLOTS), torch.cuda.Stream(self.device))
            with self._lock:
                self._workers.append(mine)
        return mine

    def _decode(self, start, data, lengths, outs, pitches, after):
        """One thread's part: returns (position -> error, done event, finish time)."""
        decoder, stream = self._worker()
        stream.wait_event(after)  # the arena's memory is free of the decode stream's earlier work
        errors = {start + k: e for k, e in decoder.decode(data, lengths, outs, pitches, stream.cuda_stream).items()}
        done = torch.cuda.Event()
        done.record(stream)
        return errors, done, time.perf_counter()

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
        """Queue images ``start:`` of a batch (pointers as ``BatchedDecoder.decode`` takes them) on the
        threads, after the work queued on ``stream`` so far. Returns a wait function: call it once the
        engines' part is queued; it makes ``stream`` wait for the threads' kernels and returns the
        failures (batch position -> NvjpegError)."""
        after = torch.cuda.Event()
        after.record(stream)
        n, parts = len(data) - start, []
        t0 = time.perf_counter()
        for t in range(self.threads):
            lo, hi = start + n * t // self.threads, start + n * (t + 1) // self.threads
            if hi > lo:
                parts.append(self._pool.submit(self._decode, lo, data[lo:hi], lengths[lo:hi], outs[lo:hi],
                                               pitches[lo:hi], after))

        def wait():
            errors, finished, waited = {}, t0, time.perf_counter()
            for future in parts:
                failed, done, at = future.result()
                errors.update(failed)
                stream.wait_event(done)
                finished = max(finished, at)
            if finished > t0:
                self.thread_rate += _SMOOTHING * (n / (finished - t0) - self.thread_rate)
            self.images += n
            self.thread_seconds += finished - t0
            self.wait_seconds += time.perf_counter() - waited
            return errors

        return wait

    def stats(self) -> dict:
        """Totals since the assist began: images and seconds of each part, the decode thread's wait
        for the threads, the threads' time in the native loop and waiting for their slots, and the
        current rates (images/s) that set the share."""
        with self._lock:
            native = sum(decoder.native_seconds for decoder, _ in self._workers)
            slot_wait = sum(decoder.slot_wait_seconds for decoder, _ in self._workers)
        return {"threads": self.threads, "images": self.images, "engine_images": self.engine_images,
                "engine_seconds": self.engine_seconds, "thread_seconds": self.thread_seconds,
                "wait_seconds": self.wait_seconds, "native_seconds": native, "slot_wait_seconds": slot_wait,
                "engine_rate": self.engine_rate, "thread_rate": self.thread_rate}

    def close(self):
        self._pool.shutdown(wait=True)
        with self._lock:
            for decoder, _ in self._workers:
                decoder.close()
            self._workers = []


def describe_errors(index, indices, errors) -> dict:
    """Batch position -> CorruptSampleError naming the sample, for the threads' failures."""
    return {k: CorruptSampleError(f"{index.describe(indices[k])}: GPU JPEG decoding failed ({e})")
            for k, e in errors.items()}
