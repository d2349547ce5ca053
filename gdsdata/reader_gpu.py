"""Storage -> staging buffer on the GPU path: a batch's coalesced reads, issued in parallel.

Two staging modes:
- ``device``: kvikio ``CuFile.pread`` straight into a GPU buffer. With GPUDirect Storage this is a
  DMA from the drive to GPU memory; in kvikio's compatibility mode kvikio reads through its own
  pinned bounce buffers and copies.
- ``host``: reads into a pinned host buffer; nvJPEG's HARDWARE backend takes bitstreams from pinned
  memory directly, raw pixels go up in one asynchronous copy.

Two I/O engines issue the reads (``GDSDATA_IO_ENGINE``):
- ``kvikio``: one ``CuFile.pread`` per planned read, run by kvikio's thread pool. Needed for device
  staging and GPUDirect Storage.
- ``mmap``: every shard mapped read-only once; a batch is one gather of alignment-sized pages per
  shard (``torch.index_select``: torch's threads, no GIL held), into the pinned staging buffer, or
  for device staging through a small ring of pinned bounce buffers and asynchronous copies. In
  compatibility mode kvikio does POSIX reads through the page cache too, but each read costs a
  Python call and a future on the thread that also feeds the decoder; a shuffled batch is hundreds
  of reads. ``auto`` picks mmap without GDS (measured: docs/benchmarks.md).

Staging buffers are allocated once per slot and grown only when a batch needs more; callers rotate
slots so that reading batch k+1 never overwrites what the GPU still reads of batch k.
"""

import logging
import mmap
import os
import threading
import warnings

import numpy as np
import torch

from . import settings
from .errors import FormatError, GpuUnavailableError

log = logging.getLogger(__name__)
_GROWTH = 1.25
_BOUNCE_BYTES = 4 << 20  # mmap engine into GPU memory: pinned buffer size and count
_BOUNCE_COUNT = 4


def import_kvikio():
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        raise GpuUnavailableError(f"the GPU path needs kvikio ({e}); pip install 'gdsdata[cu13]' "
                                  f"(CUDA 13) or 'gdsdata[cu12]' (CUDA 12)") from e
    return kvikio


class StagingBuffer:
    """One reusable staging area: a uint8 tensor on the GPU or in pinned host memory."""

    def __init__(self, kind: str, device: torch.device):
        self.kind = kind
        self.device = device
        self.tensor = None
        self.busy = None  # CUDA event recorded after the last GPU work that read this buffer

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.busy is not None:
            self.busy.synchronize()  # the GPU has finished reading the previous batch
            self.busy = None
        if self.tensor is None or self.tensor.numel() < nbytes:
            size = max(int(nbytes * _GROWTH), 1 << 20)
            self.tensor = None
            if self.kind == "device":
                self.tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            else:
                self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            log.debug("staging buffer (%s) grown to %d bytes", self.kind, size)
        return self.tensor[:nbytes]

    def free(self):
        if self.busy is not None:
            self.busy.synchronize()
        self.busy = None
        self.tensor = None


class SlotPool:
    """A fixed set of staging buffers. ``acquire`` blocks until one is free; ``release(slot, stream)``
    hands it back once the GPU work queued on ``stream`` (the last reader of its bytes) is done."""

    def __init__(self, kind: str, device: torch.device, count: int):
        self._free = [StagingBuffer(kind, device) for _ in range(count)]
        self._all = list(self._free)
        self._cond = threading.Condition()

    def acquire(self) -> StagingBuffer:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop(0)

    def release(self, slot: StagingBuffer, stream):
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            slot.busy = event
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def close(self):
        for slot in self._all:
            slot.free()


def choose_engine(staging: str, gds: bool) -> str:
    """The I/O engine from the setting, the staging kind and whether cuFile has GDS."""
    engine = settings.get("io_engine")
    if engine == "auto":
        engine = "kvikio" if gds else "mmap"
    return engine


class ShardMaps:
    """Read-only memory maps of a dataset's shards, each seen as a 2-D uint8 tensor of
    alignment-sized pages, mapped on first use."""

    def __init__(self, index):
        self.index = index
        self._pages = {}
        self._maps = []
        self._lock = threading.Lock()

    def pages(self, shard) -> torch.Tensor:
        with self._lock:
            pages = self._pages.get(shard)
            if pages is None:
                fd = os.open(self.index.shard_path(shard), os.O_RDONLY)
                try:
                    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                with warnings.catch_warnings():  # read-only memory: nothing here ever writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    whole = torch.frombuffer(mapped, dtype=torch.uint8)
                alignment = self.index.alignment
                count = whole.numel() // alignment
                pages = self._pages[shard] = whole[:count * alignment].view(count, alignment)
                self._maps.append(mapped)
            return pages

    def gather(self, plan, target: torch.Tensor, bounce=None):
        """Copy the pages of every read of ``plan`` to their places in ``target``: straight into a
        host tensor, or through ``bounce`` (a ``Bounce``) into a GPU tensor."""
        alignment = self.index.alignment
        reads = plan.reads
        if not reads:
            return
        shards = np.fromiter((r.shard for r in reads), np.int64, len(reads))
        starts = np.fromiter((r.offset for r in reads), np.int64, len(reads)) // alignment
        counts = np.fromiter((r.size for r in reads), np.int64, len(reads)) // alignment
        first = np.cumsum(counts) - counts
        for shard in np.unique(shards):
            end = int((starts + counts)[shards == shard].max())
            have = self.pages(int(shard)).shape[0]
            if end > have:
                raise FormatError(f"{self.index.shard_path(int(shard))}: a read ends at byte {end * alignment}, "
                                  f"past the end of the file ({have * alignment} bytes): truncated shard")
        source = torch.from_numpy(np.arange(int(counts.sum())) + np.repeat(starts - first, counts))
        page_shard = np.repeat(shards, counts)  # per destination page
        dest = target.view(-1, alignment)
        if bounce is None:
            self._copy_runs(page_shard, source, 0, len(source), dest)
            return
        for w0 in range(0, len(source), bounce.pages):
            w1 = min(len(source), w0 + bounce.pages)
            k = bounce.take()
            self._copy_runs(page_shard, source, w0, w1, bounce.buffers[k])
            bounce.send(k, w1 - w0, dest[w0:w1])
        bounce.finish()

    def _copy_runs(self, page_shard, source, w0, w1, out):
        """Pages w0..w1 of the plan into ``out`` (row 0 = page w0), one gather per shard run."""
        edges = np.flatnonzero(np.diff(page_shard[w0:w1])) + 1 + w0
        for lo, hi in zip(np.r_[w0, edges], np.r_[edges, w1]):
            torch.index_select(self.pages(int(page_shard[lo])), 0, source[lo:hi], out=out[lo - w0:hi - w0])

    def close(self):
        with self._lock:
            self._pages = {}
            maps, self._maps = self._maps, []
        for mapped in maps:
            try:
                mapped.close()
            except BufferError:  # a tensor still views it; it is unmapped when that goes
                pass


class Bounce:
    """A ring of small pinned buffers through which mapped pages go up to GPU memory: one is copied
    on the ring's own CUDA stream while the next is filled. Kept small so that what the CPU just
    wrote is still in its caches when the copy engine reads it (a whole batch written to pinned
    memory and then copied crosses main memory three times)."""

    def __init__(self, device, alignment):
        self.pages = max(1, _BOUNCE_BYTES // alignment)
        self.buffers = [torch.empty((self.pages, alignment), dtype=torch.uint8, pin_memory=True)
                        for _ in range(_BOUNCE_COUNT)]
        self.events = [None] * _BOUNCE_COUNT
        self.stream = torch.cuda.Stream(device)
        self.next = 0

    def take(self) -> int:
        """The next buffer of the ring (its number), once its previous copy is done."""
        k, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.events[k] is not None:
            self.events[k].synchronize()
            self.events[k] = None
        return k

    def send(self, k, pages, dest):
        """Copy the first ``pages`` rows of buffer ``k`` to ``dest`` (GPU memory), asynchronously."""
        with torch.cuda.stream(self.stream):
            dest.copy_(self.buffers[k][:pages], non_blocking=True)
            self.events[k] = torch.cuda.Event()
            self.events[k].record(self.stream)

    def finish(self):
        self.stream.synchronize()  # the batch is in GPU memory before anyone reads it

    def close(self):
        self.stream.synchronize()
        self.buffers = []


class GpuReader:
    """Reads planned batches into staging buffers, with kvikio or from memory maps."""

    def __init__(self, index, device: torch.device, engine: str = "kvikio"):
        self.index = index
        self.device = device
        self.engine = engine
        self._files = {}
        self._lock = threading.Lock()
        if engine == "kvikio":
            self.kvikio = import_kvikio()
            threads = settings.get("io_threads")
            if self.kvikio.defaults.get("num_threads") != threads:
                self.kvikio.defaults.set({"num_threads": threads})
        else:
            self.maps = ShardMaps(index)
            self._bounce = None

    def _file(self, shard):
        with self._lock:
            handle = self._files.get(shard)
            if handle is None:
                handle = self._files[shard] = self.kvikio.CuFile(self.index.shard_path(shard), "r")
            return handle

    def read(self, plan, staging: StagingBuffer) -> torch.Tensor:
        """Issue every read of ``plan`` in parallel into ``staging``; returns the filled tensor."""
        target = staging.ensure(plan.total)
        if self.engine == "mmap":
            if staging.kind == "device":
                with self._lock:  # one ring: one batch at a time goes through it
                    if self._bounce is None:
                        self._bounce = Bounce(self.device, self.index.alignment)
                    self.maps.gather(plan, target, self._bounce)
            else:
                self.maps.gather(plan, target)
            return target
        host = None if staging.kind == "device" else target.numpy()
        futures = []
        for read in plan.reads:
            if host is not None:
                dest = host[read.buffer_offset:read.buffer_offset + read.size]
            else:
                dest = target[read.buffer_offset:read.buffer_offset + read.size]
            futures.append((read, self._file(read.shard).pread(dest, read.size, read.offset)))
        for read, future in futures:
            got = future.get()
            if got != read.size:
                raise FormatError(f"{self.index.shard_path(read.shard)}: short read at offset {read.offset} "
                                  f"({got} of {read.size} bytes): truncated shard")
        return target

    def close(self):
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files = {}
        if self.engine == "mmap":
            self.maps.close()
            if self._bounce is not None:
                self._bounce.close()
                self._bounce = None
