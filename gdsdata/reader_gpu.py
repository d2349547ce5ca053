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
- ``posix``: the batch's reads cut into 4 MiB pieces and dealt to a pool of threads, one call per
  thread, each thread a loop of ``os.preadv`` into the pinned buffer. In compatibility mode kvikio
  does the same POSIX reads, but pays a Python call and a future per read; a shuffled batch is
  hundreds of reads. ``auto`` picks posix for host staging without GDS (see docs/benchmarks.md).

Staging buffers are allocated once per slot and grown only when a batch needs more; callers rotate
slots so that reading batch k+1 never overwrites what the GPU still reads of batch k.
"""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import settings
from .errors import FormatError, GpuUnavailableError
from .plan import split_reads
from .reader_cpu import ShardFiles

log = logging.getLogger(__name__)
_GROWTH = 1.25
_PIECE = 4 << 20  # posix engine: bytes per read call (kvikio's default task size)


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
        engine = "posix" if staging == "host" and not gds else "kvikio"
    if engine == "posix" and staging != "host":
        raise ValueError("io_engine=posix reads into host memory only; device staging needs kvikio")
    return engine


class GpuReader:
    """Reads planned batches into staging buffers, with kvikio or a pool of POSIX reads."""

    def __init__(self, index, device: torch.device, engine: str = "kvikio"):
        self.index = index
        self.device = device
        self.engine = engine
        self.threads = settings.get("io_threads")
        self._files = {}
        self._lock = threading.Lock()
        if engine == "kvikio":
            self.kvikio = import_kvikio()
            if self.kvikio.defaults.get("num_threads") != self.threads:
                self.kvikio.defaults.set({"num_threads": self.threads})
        else:
            self.posix_files = ShardFiles(index)
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gdsdata-io")

    def _file(self, shard):
        with self._lock:
            handle = self._files.get(shard)
            if handle is None:
                handle = self._files[shard] = self.kvikio.CuFile(self.index.shard_path(shard), "r")
            return handle

    def read(self, plan, staging: StagingBuffer) -> torch.Tensor:
        """Issue every read of ``plan`` in parallel into ``staging``; returns the filled tensor."""
        target = staging.ensure(plan.total)
        if self.engine == "posix":
            host = target.numpy()
            groups = split_reads(plan.reads, self.threads, _PIECE, self.index.alignment)
            futures = [self._pool.submit(self._read_group, host, group) for group in groups[1:]]
            if groups:
                self._read_group(host, groups[0])  # this thread takes a share too
            for future in futures:
                future.result()
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

    def _read_group(self, host, group):
        for piece in group:
            self.posix_files.read_into(host, piece)

    def close(self):
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files = {}
        if self.engine == "posix":
            self._pool.shutdown(wait=True)
            self.posix_files.close()
