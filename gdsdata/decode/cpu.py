"""Staging buffer -> RGB pixels on the CPU path.

JPEGs are decoded with simplejpeg (libjpeg-turbo, releases the GIL): faster than PIL, with
identical pixels (docs/design.md).
"""

import logging
import os
import threading
from concurrent.futures import wait

import numpy as np
import simplejpeg

from gdsdata.format import layout as fmt
from gdsdata import settings
from gdsdata.errors import CorruptSampleError
from gdsdata.threads import DaemonPool

log = logging.getLogger(__name__)
_pool = {"executor": None, "pid": None, "size": None}
_pool_lock = threading.Lock()
_PREFIX = "gdsdata-cpu"


def cpu_pool() -> DaemonPool:
    """The process's CPU worker threads (the cpu_threads setting), shared by CPU decoding and CPU
    resampling, so that the two stages of a Loader share the cores; made again in a forked child
    or when the setting changes. Daemon threads: a decode stuck in libjpeg-turbo, which the Loader
    reports as a stall, never keeps the interpreter from exiting."""
    size = settings.get("cpu_threads")
    with _pool_lock:
        if _pool["executor"] is None or _pool["pid"] != os.getpid() or _pool["size"] != size:
            if _pool["executor"] is not None and _pool["pid"] == os.getpid():
                _pool["executor"].shutdown()  # (its threads end once the work given them is done)
            _pool.update(executor=DaemonPool(size, _PREFIX), pid=os.getpid(), size=size)
        return _pool["executor"]


def drain(wait_s: float) -> bool:
    """Wait at most ``wait_s`` seconds for the work given the CPU pool to end (at exit, before the
    interpreter finalises: a daemon thread inside a torch call then makes torch abort); True if it did."""
    pool = _pool["executor"]
    return pool is None or _pool["pid"] != os.getpid() or pool.drain(wait_s)


def run_parallel(work, count: int):
    """``work(k)`` for each k in ``range(count)`` on the CPU pool, the k in a few contiguous runs a
    thread: a task (a future) per image held the GIL for as long as the image's own Python did, and
    the training thread of the same process waits for the GIL. Returns when every run has ended
    (nothing runs on after it); a run stops at its first exception, and the exception of the first
    run that failed (in run order) is raised then. Called from a thread of the pool itself (work
    that nests) it runs the work in place: waiting there for the pool could wait forever."""
    if count <= 1 or threading.current_thread().name.startswith(_PREFIX):
        for k in range(count):
            work(k)
        return
    runs = min(count, 4 * settings.get("cpu_threads"))  # a few runs a thread: images differ in cost

    def run(r):
        for k in range(r * count // runs, (r + 1) * count // runs):
            work(k)

    futures = []
    for r in range(runs):
        try:
            futures.append(cpu_pool().submit(run, r))
        except RuntimeError as e:  # nothing queued: the rest runs in place
            if not str(e).startswith("cannot schedule new futures after"):  # (not a pool being replaced)
                log.warning("no CPU worker thread could be started (%s): the CPU work runs in the calling thread", e)
            break
    failure = None
    for r in range(len(futures), runs):
        try:
            run(r)
        except Exception as e:  # noqa: BLE001 - raised below, after the runs in the pool, which come first
            failure = failure or e
    wait(futures)
    for future in futures:
        future.result()
    if failure is not None:
        raise failure


try:  # Intel ISA-L's CRC-32 (the same polynomial as zlib's), faster than zlib's
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib computes the same value
    from zlib import crc32


def _named(name) -> str:
    """``name``: how an error names the sample, or a call that makes it (made only for an error)."""
    return name() if callable(name) else name


def checksum_error(name) -> CorruptSampleError:
    return CorruptSampleError(f"{_named(name)}: checksum mismatch (the stored bytes changed since packing)")


def check_crc(payload, record, name):
    """Raise ``CorruptSampleError`` naming the sample unless ``payload`` has the CRC-32 packed with it."""
    if crc32(payload) != int(record["crc32"]):
        raise checksum_error(name)


def check_batch(index, buffer, plan, indices) -> dict:
    """Each sample's CRC-32 where ``plan`` placed it in the host ``buffer``: position ->
    ``CorruptSampleError`` for those that do not match."""
    expected = index.samples["crc32"][np.asarray(indices, dtype=np.int64)].tolist()
    failed = {}
    for k, (start, length) in enumerate(zip(plan.sample_offsets.tolist(), plan.sample_lengths.tolist())):
        if crc32(buffer[start:start + length]) != expected[k]:  # named only when it fails
            failed[k] = checksum_error(index.describe(indices[k]))
    return failed


def decode(payload, record, name, out=None) -> np.ndarray:
    """Decode one stored sample to an HxWx3 uint8 array (into ``out`` when given, a writable buffer of
    height*width*3 bytes); ``name`` is how errors name the sample (or a call that makes it)."""
    codec = int(record["codec"])
    height, width = int(record["height"]), int(record["width"])
    if codec == fmt.CODEC_JPEG:
        try:
            pixels = simplejpeg.decode_jpeg(payload, colorspace="RGB", buffer=out)
        except (ValueError, RuntimeError) as e:
            raise CorruptSampleError(f"{_named(name)}: JPEG decoding failed ({e})") from e
    elif codec == fmt.CODEC_RAW:
        components = int(record["components"])
        if len(payload) != height * width * components:
            raise CorruptSampleError(f"{_named(name)}: raw payload holds {len(payload)} bytes, expected "
                                     f"{height}x{width}x{components}")
        pixels = np.frombuffer(payload, np.uint8).reshape(height, width, components)
        if components == 1:
            pixels = np.repeat(pixels, 3, axis=2)
        if out is not None:
            target = np.frombuffer(out, np.uint8).reshape(height, width, 3)
            target[...] = pixels
            pixels = target
    else:
        raise CorruptSampleError(f"{_named(name)}: unknown codec {codec}")
    if pixels.shape != (height, width, 3):
        raise CorruptSampleError(f"{_named(name)}: decoded {pixels.shape[1]}x{pixels.shape[0]}, the index "
                                 f"records {width}x{height}")
    return pixels
