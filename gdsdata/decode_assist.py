"""Spare CPU cores decoding part of each JPEG batch beside nvJPEG's hardware engines.

The engines are the JPEG ceiling on the H200: one batched HARDWARE decoder runs about 26,000 of our
100 KB images/s and a second decoder only slows the first. Threads running nvJPEG's decoupled
phases (``nvjpeg.HostHuffmanDecoder``: Huffman decoding on the thread, the rest on the GPU) add to
it: on the H200 (``bench/decode_ceiling.py --sections cpu``, 85194b2) each thread decoded 551
images/s at 1.8 CPU-ms an image, and eight threads taking 32 images of every 256 ran beside the
engines without slowing them (28,699 images/s together against 25,676 for the engines' 224 alone).

Used with pinned host staging (the bitstreams must be readable by the CPU) and the HARDWARE backend.
Each batch's last ``share(n)`` images go to the threads, in equal parts, the rest to the engines;
the share balances the measured rates, so that both finish a batch at about the same time.
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

THREAD_RATE = 550.0  # images/s of one host Huffman thread (H200 machine, 100 KB images)
ENGINE_RATE = 3700.0  # images/s of one hardware engine (H200: 7 engines, 25,900 together)
_MAX_AUTO_THREADS = 12
_KEEP_CORES = 4  # left to the Loader's I/O, decode and consumer threads


def assist_threads() -> int:
    """Threads from the ``assist_threads`` setting: ``auto`` takes the cores this process may use,
    shared among the node's GPU processes (``LOCAL_WORLD_SIZE``), less four, at most twelve."""
    value = settings.get("assist_threads")
    if value != "auto":
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_process = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, min(_MAX_AUTO_THREADS, per_process - _KEEP_CORES))


class DecodeAssist:
    def __init__(self, threads: int, engines: int, device: torch.device):
        self.threads = threads
        self.device = device
        self._fraction = threads * THREAD_RATE / (engines * ENGINE_RATE + threads * THREAD_RATE)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gdsdata-assist")
        self._local = threading.local()
        self._workers = []  # (decoder, stream) of every thread, for close()
        self._lock = threading.Lock()
        self.seconds = 0.0  # time the threads spent, for the Loader's stage report
        self.images = 0

    def share(self, n: int) -> int:
        """How many of a batch of ``n`` the threads take."""
        return min(n - 1, int(round(n * self._fraction))) if n > 1 else 0

    def _worker(self):
        mine = getattr(self._local, "worker", None)
        if mine is None:
            with torch.cuda.device(self.device):
                mine = self._local.worker = (HostHuffmanDecoder(), torch.cuda.Stream(self.device))
            with self._lock:
                self._workers.append(mine)
        return mine

    def _decode(self, start, data, lengths, outs, pitches, after):
        """One thread's part: images decoded one by one; returns (position -> error, done event)."""
        decoder, stream = self._worker()
        t0 = time.perf_counter()
        stream.wait_event(after)  # the arena's memory is free of the decode stream's earlier work
        errors = {start + k: e for k, e in decoder.decode(data, lengths, outs, pitches, stream.cuda_stream).items()}
        done = torch.cuda.Event()
        done.record(stream)
        with self._lock:
            self.seconds += time.perf_counter() - t0
            self.images += len(data)
        return errors, done

    def submit(self, start, data, lengths, outs, pitches, stream):
        """Queue images ``start:`` of a batch (pointers as ``BatchedDecoder.decode`` takes them) on the
        threads, after the work queued on ``stream`` so far. Returns a wait function: call it once the
        engines' part is queued; it makes ``stream`` wait for the threads' kernels and returns the
        failures (batch position -> NvjpegError)."""
        after = torch.cuda.Event()
        after.record(stream)
        n, parts = len(data) - start, []
        for t in range(self.threads):
            lo, hi = start + n * t // self.threads, start + n * (t + 1) // self.threads
            if hi > lo:
                parts.append(self._pool.submit(self._decode, lo, data[lo:hi], lengths[lo:hi], outs[lo:hi],
                                               pitches[lo:hi], after))

        def wait():
            errors = {}
            for future in parts:
                failed, done = future.result()
                errors.update(failed)
                stream.wait_event(done)
            return errors

        return wait

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
