"""Storage -> staging buffer on the GPU path: a batch's coalesced reads, issued in parallel.

Two staging modes:
- ``device``: kvikio ``CuFile.pread`` straight into a GPU buffer. With GPUDirect Storage this is a
  DMA from the drive to GPU memory; in kvikio's compatibility mode kvikio reads through its own
  pinned bounce buffers and copies.
- ``host``: reads into a pinned host buffer; nvJPEG's HARDWARE backend takes bitstreams from pinned
  memory directly, raw pixels go up in one asynchronous copy.

I/O engines issue the reads (``GDSDATA_IO_ENGINE``; ``gdsdata.io.path.resolve`` chooses one):
- ``kvikio``: one ``CuFile.pread`` per planned read, run by kvikio's thread pool. Needed for device
  staging and GPUDirect Storage.
- ``mmap``: every shard mapped read-only once; a batch is a gather of alignment-sized pages into
  the pinned buffer, no Python call per read: ``gather_threads`` gdsdata threads each copy an equal
  span of the batch with one ``np.take`` (GIL released).
- ``mapped``: the same maps registered with CUDA; the GPU's copy engines take every read of a batch
  from the page cache into GPU staging (one ``cuMemcpyBatchAsync`` per batch, queued without
  waiting), or, with drivers older than CUDA 12.8, its SMs gather the pages over PCIe; no CPU core
  copies a byte.

``direct`` reads past the page cache with O_DIRECT into pinned staging (``io.direct``): datasets
larger than the host's memory.

``mixed`` reads each batch its way: batches of many small reads (shuffled) through the page gather,
batches of a few large reads (file order) through kvikio, which splits each read over its threads.

Staging buffers are allocated once per slot and grown only when a batch needs more; callers rotate
slots so that reading batch k+1 never overwrites what the GPU still reads of batch k.
"""

import contextlib
import functools
import logging
import mmap
import os
import threading
import warnings
import weakref

import numpy as np
import torch

from gdsdata import stall
from gdsdata.batch import gpu_empty
from gdsdata.io.cpu import OpenShards, shard_gone
from gdsdata.io.direct import DirectReads, fill
from gdsdata.threads import DaemonPool
from gdsdata.format.shards import check_opened, open_regular
from gdsdata.errors import FormatError, GpuError, GpuUnavailableError, StallError, install_hint

log = logging.getLogger(__name__)
_GROWTH = 1.25


def import_kvikio():
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        raise GpuUnavailableError(f"the GPU path needs kvikio ({e}); {install_hint('gpu')}") from e
    return kvikio


class StagingBuffer:
    """One reusable staging area: a uint8 tensor on the GPU or in pinned host memory."""

    def __init__(self, kind: str, device: torch.device):
        self.kind = kind
        self.device = device
        self.tensor = None
        self.busy = None  # CUDA event recorded after the last GPU work that read this buffer

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.busy is not None:  # the GPU has finished reading the previous batch
            stall.wait(self.busy, "waiting for the GPU to finish reading a staging buffer")
            self.busy = None
        if self.tensor is None or self.tensor.numel() < nbytes:
            size = max(int(nbytes * _GROWTH), 1 << 20)
            self.tensor = None
            if self.kind == "device":  # written from the host (kvikio) or by copies on a stream of their own
                self.tensor = gpu_empty(size, self.device, "waiting for GPU memory's last users before reading into it")
            else:  # page aligned, as direct (O_DIRECT) reads need, whatever the pinned allocator gives
                whole = torch.empty(size + mmap.PAGESIZE, dtype=torch.uint8, pin_memory=True)
                self.tensor = whole[-whole.data_ptr() % mmap.PAGESIZE:][:size]
            log.debug("staging buffer (%s) grown to %d bytes", self.kind, size)
        return self.tensor[:nbytes]

    def free(self):
        if self.busy is not None:
            stall.wait(self.busy, "waiting for the GPU to finish reading a staging buffer")
        self.busy = None
        self.tensor = None


class SlotPool:
    """Reusable staging buffers. ``acquire`` hands out a free one, or makes one more when all are in
    use (several Loaders over one dataset each hold a few; waiting for one to come back could wait
    forever). How far ahead a Loader reads is bounded by its queues, not here: the pool holds as
    many buffers as were ever in use at once. ``release(slot,
    stream)`` hands it back once the GPU work queued on ``stream`` (the last reader of its bytes) is
    done."""

    def __init__(self, kind: str, device: torch.device):
        self.kind, self.device = kind, device
        self._free, self._all = [], []
        self._lock = threading.Lock()
        self.spare = _SPARE

    def reserve(self, count: int):
        """A reader of the pool (a Loader pass) may hold ``count`` buffers at once: make up to that
        many, plus two, before waiting for the GPU to finish with one."""
        with self._lock:
            self.spare = max(self.spare, count + 2)

    def acquire(self) -> StagingBuffer:
        """A free buffer the GPU has finished reading; while fewer than ``spare`` exist, a new one
        rather than one the GPU still reads (reading the next batch then never waits for the GPU);
        beyond, the longest free one (``ensure`` waits for the GPU to finish with it)."""
        with self._lock:
            for k, slot in enumerate(self._free):
                if slot.busy is None or slot.busy.query():
                    return self._free.pop(k)
            if self._free and len(self._all) >= self.spare:
                return self._free.pop(0)
            slot = StagingBuffer(self.kind, self.device)
            self._all.append(slot)
            log.debug("staging buffer %d made (all others in use)", len(self._all))
            return slot

    def release(self, slot: StagingBuffer, stream, event=None):
        """Hand ``slot`` back once the work queued on ``stream`` so far, or ``event``, is done."""
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        if event is not None:
            slot.busy = event
        with self._lock:
            self._free.append(slot)

    def close(self):
        for slot in self._all:
            slot.free()


_KVIKIO_READ = 4 << 20  # mixed engine: batches whose reads average this much go through kvikio
_SPARE = 4  # staging buffers made before a reader waits for the GPU, until a Loader reserves more (``reserve``)


class ShardMaps:
    """Read-only memory maps of a dataset's shards, mapped on first use, and the gather of a planned
    batch from them into a host buffer on ``threads`` threads (the caller and a pool)."""

    def __init__(self, index, threads: int = 1):
        self.index = index
        self.threads = threads
        self._pages = {}
        self._maps = []
        self._lock = threading.Lock()
        self._pool, self._pool_size = None, 0

    def pages(self, shard) -> torch.Tensor:
        """The shard as a 2-D uint8 tensor of alignment-sized pages."""
        with self._lock:
            if shard not in self._pages:
                path = self.index.shard_path(shard)
                try:
                    fd = open_regular(path)
                    try:
                        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)  # the map outlives the descriptor
                    finally:
                        os.close(fd)
                except FileNotFoundError as e:
                    shard_gone(e, path)
                except (OSError, ValueError) as e:  # ValueError: an empty file
                    raise FormatError(f"{path}: cannot map the shard ({e})") from e
                check_opened(mapped[:4096], path, self.index, shard)
                with warnings.catch_warnings():  # read-only memory: nothing here ever writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    whole = torch.frombuffer(mapped, dtype=torch.uint8)
                alignment = self.index.alignment
                count = whole.numel() // alignment
                self._pages[shard] = whole[:count * alignment].view(count, alignment)
                self._maps.append(mapped)
            return self._pages[shard]

    def gather(self, plan, target: torch.Tensor):
        """Copy every read of ``plan`` to its place in ``target`` (a host tensor)."""
        if not len(plan.sizes):
            return
        runs, source = self.page_runs(plan)
        self._take_pooled(runs, source, target.view(-1, self.index.alignment).numpy(), self.threads)

    def page_runs(self, plan):
        """Page by page: which pages of which shard land on which pages of the staging buffer, as
        ``(runs, source)``: ``source[k]`` is the shard page that goes to staging page k, and each
        run ``(shard, p0, p1)`` covers staging pages p0..p1 of one shard. Reads are alignment-sized
        multiples at aligned offsets (plan.py), listed by shard, then offset, so a shard's reads are
        one contiguous run of staging pages. A read past a shard's end is a truncated shard."""
        spans = self.check_bounds(plan)
        alignment = self.index.alignment
        counts = plan.sizes // alignment
        first = np.cumsum(counts) - counts
        source = plan.pages(alignment)
        runs = [(int(plan.shards[lo]), int(first[lo]), int(first[hi - 1] + counts[hi - 1])) for lo, hi in spans]
        return runs, source

    def check_bounds(self, plan):
        """Raise ``FormatError`` for a read past its shard's end (a truncated shard); maps the shards.
        Returns the plan's reads grouped by shard, as ``(lo, hi)`` index ranges (plans list reads by
        shard, then offset)."""
        edges = (np.flatnonzero(np.diff(plan.shards)) + 1).tolist()
        spans = list(zip([0, *edges], [*edges, len(plan.shards)]))
        for lo, hi in spans:
            shard = int(plan.shards[lo])
            end, have = int((plan.offsets[lo:hi] + plan.sizes[lo:hi]).max()), self.pages(shard).numel()
            if end > have:
                raise FormatError(f"{self.index.shard_path(shard)}: a read ends at byte {end}, past the "
                                  f"end of the file ({have} bytes): truncated shard")
        return spans

    def _take_pooled(self, runs, source, dest, threads):
        """The same gather on ``threads`` threads (the caller and a pool of gdsdata threads): the
        destination pages are cut into equal spans, one per thread, and each thread copies its span
        with one ``np.take`` per shard it crosses (no GIL held while copying). One Python call per
        thread and shard, whatever the number of reads."""
        pages = {shard: self.pages(shard).numpy() for shard, _, _ in runs}
        cuts = np.linspace(0, len(source), threads + 1).astype(np.int64)

        def span(k):
            lo, hi = int(cuts[k]), int(cuts[k + 1])
            for shard, p0, p1 in runs:
                a, b = max(lo, p0), min(hi, p1)
                if a < b:  # mode="clip": no buffered copy; page_runs() checked every page is in the file
                    np.take(pages[shard], source[a:b], axis=0, out=dest[a:b], mode="clip")

        with self._lock:
            if self._pool_size != threads - 1:  # the caller takes the first span itself
                if self._pool is not None:
                    self._pool.shutdown()
                self._pool_size = threads - 1
                # daemons: a thread stuck in a page fault (a drive or NFS server that stopped answering)
                # never blocks close() or the interpreter's exit
                self._pool = DaemonPool(self._pool_size, "gdsdata-gather") if self._pool_size else None
            pool = self._pool
        others = [pool.submit(span, k) for k in range(1, threads)] if pool is not None else []
        span(0)
        for other in others:
            other.result()

    def close(self):
        with self._lock:
            self._pages = {}
            maps, self._maps = self._maps, []
            pool, self._pool, self._pool_size = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait_s=5)
        for mapped in maps:
            try:
                mapped.close()
            except BufferError:  # a tensor or array still views it; it is unmapped when that goes
                pass


_HOST_REGISTER_MAPPED, _HOST_REGISTER_READ_ONLY = 0x02, 0x08  # cudaHostRegister flags


def _unregister(registered, device_index, stream, maps):
    """Release ``registered`` host ranges (after the GPU is done reading them), before ``maps`` (held
    here only so that they outlive the registrations) can be unmapped. Runs once: at ``close()`` or
    when the engine is garbage-collected unclosed; a registration left behind would make CUDA refuse
    the next mapping that the kernel places at the same address."""
    if not registered:
        return True
    import cupy

    try:  # (bounded: a copy stuck on a drive that stopped answering leaves the registrations, not a hang)
        stall.wait(stream, "the mapped shards' last copies, before unregistering them")
        with cupy.cuda.Device(device_index):
            for ptr in registered:
                cupy.cuda.runtime.hostUnregister(ptr)
    except StallError as e:  # the GPU may still read them: they stay registered and mapped, for good
        log.error("%s; the mapped shards stay mapped", e)
        _STILL_READ.append(list(maps))
        return False
    except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone; nothing left to free
        log.debug("unregistering mapped shards: %s", e)
    registered.clear()
    return True


_STILL_READ = []  # the maps of shards the GPU may still be reading (a copy stuck): never unmapped


class MappedShards(ShardMaps):
    """The ``mapped`` engine (device staging): the same read-only maps, each registered with CUDA
    (``cudaHostRegister``, mapped and read-only) on first use, so that a batch's reads go from the
    page cache into GPU staging without any CPU core copying a byte. Registering pins the whole
    shard, so it suits datasets that fit in host memory; CUDA reads a cold shard in as it registers
    it.

    How the bytes move (``copy``, from the ``LoadPath``): ``dma`` queues every read of a batch on the
    copy engines with one ``cuMemcpyBatchAsync`` call (``_native/cuda.py``; drivers for CUDA 12.8 and
    later); ``gather`` has the SMs gather the pages over PCIe (one ``torch.index_select`` per shard
    over 8-byte words). Either way ``gather()`` only queues the copy on the engine's stream and
    returns an event that completes with it."""

    def __init__(self, index, device: torch.device, copy: str = "dma"):
        super().__init__(index)
        self.device = device
        self.copy = copy
        self._batch_copy = None
        if copy == "dma":
            from gdsdata._native.cuda import BatchCopy

            self._batch_copy = BatchCopy(device.index)
        self._device_pages = {}
        self._registered = []
        self._stream = torch.cuda.Stream(device)
        self._release = weakref.finalize(self, _unregister, self._registered, device.index, self._stream, self._maps)

    def device_pages(self, shard) -> torch.Tensor:
        """The shard's pages as a CUDA tensor over its registered host memory."""
        host = self.pages(shard)
        with self._lock:
            if shard not in self._device_pages:
                import cupy

                ptr, nbytes = host.data_ptr(), host.numel()
                with cupy.cuda.Device(self.device.index):
                    try:
                        cupy.cuda.runtime.hostRegister(ptr, nbytes, _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY)
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        raise GpuError(f"{self.index.shard_path(shard)}: CUDA cannot register the mapped "
                                                  f"shard ({e}); read with GDSDATA_IO_ENGINE=mixed") from e
                    self._registered.append(ptr)
                    pointer = cupy.cuda.runtime.pointerGetAttributes(ptr).devicePointer
                    memory = cupy.cuda.UnownedMemory(pointer, nbytes, host, self.device.index)
                    word = cupy.int64 if self.index.alignment % 8 == 0 else cupy.uint8  # pages in 8-byte words
                    array = cupy.ndarray((nbytes // word().itemsize,), word, cupy.cuda.MemoryPointer(memory, 0))
                self._device_pages[shard] = torch.from_dlpack(array).view(host.shape[0], -1)
            return self._device_pages[shard]

    def gather(self, plan, target: torch.Tensor):
        """Queue the copy of every read of ``plan`` to its place in ``target`` (a GPU tensor);
        returns a CUDA event that completes with the copy (None for an empty plan)."""
        if not len(plan.sizes):
            return None
        with torch.cuda.stream(self._stream):
            if self._batch_copy is not None:
                self.check_bounds(plan)
                self._copy_reads(plan, target)
            else:
                runs, source = self.page_runs(plan)
                pages = {shard: self.device_pages(shard) for shard, _, _ in runs}
                dest = target.view(next(iter(pages.values())).dtype).view(len(target) // self.index.alignment, -1)
                source = torch.from_numpy(source).pin_memory().to(self.device, non_blocking=True)
                for shard, p0, p1 in runs:
                    torch.index_select(pages[shard], 0, source[p0:p1], out=dest[p0:p1])
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return ready

    def _copy_reads(self, plan, target: torch.Tensor):
        """One batched copy of every read from the registered pages."""
        shards = np.unique(plan.shards)
        bases = np.zeros(int(shards[-1]) + 1, np.uint64)
        for shard in shards.tolist():
            self.device_pages(shard)  # registered on first use
            bases[shard] = self.pages(shard).data_ptr()
        srcs = bases[plan.shards] + plan.offsets.astype(np.uint64)
        dsts = plan.buffer_offsets.astype(np.uint64) + np.uint64(target.data_ptr())
        self._batch_copy.copy(dsts, srcs, plan.sizes, self._stream.cuda_stream)

    def close(self):
        with self._lock:
            self._device_pages = {}
        if self._release() is False:  # (the GPU may still read them: they stay mapped, _STILL_READ holds them)
            with self._lock:
                self._maps, self._pages = [], {}
        super().close()


def _open_cufile(index, path, shard):
    with open(open_regular(path), "rb") as f:
        check_opened(f.read(4096), path, index, shard)
    return import_kvikio().CuFile(path, "r")


def _close_handle(handle):
    handle.close()


class GpuReader:
    """Reads planned batches into staging buffers, with kvikio, from memory maps, (``mixed``) each
    batch through whichever suits its reads, or (``mapped``) by the GPU from registered maps. With
    ``fallback``, a ``mapped`` reader whose shards CUDA cannot register (a locked-memory limit, say)
    logs why and reads with the ``fallback`` engine from then on. ``config``: the dataset's snapshot
    of the settings (``io_threads``, ``gather_threads``, ``direct_depth``); ``copy``: how ``mapped`` moves bytes."""

    def __init__(self, index, device: torch.device, engine: str, config, copy: str = "", fallback: str = None):
        self.index = index
        self.device = device
        self.config = config
        self.copy = copy
        self.fallback = fallback
        # (the opener holds the index, not the reader: a bound method made a cycle that kept every
        # shard open until the garbage collector ran)
        self._files = OpenShards(index, functools.partial(_open_cufile, index), _close_handle)
        self._lock = threading.Lock()
        self._retired = []
        self._start(engine)

    def _start(self, engine):
        self.engine = engine
        self.maps = None
        if engine in ("kvikio", "mixed"):
            self.kvikio = import_kvikio()
            threads = self.config["io_threads"]
            if self.kvikio.defaults.get("num_threads") != threads:
                self.kvikio.defaults.set({"num_threads": threads})
            # kvikio reads into GPU memory below its gds_threshold (1 MiB unless KVIKIO_GDS_THRESHOLD
            # says otherwise) on the calling thread, through POSIX, one after another: neither GDS nor
            # the thread pool would ever see a sample-sized read. Reads here are whole aligned pages.
            alignment = self.index.alignment
            if "KVIKIO_GDS_THRESHOLD" not in os.environ and self.kvikio.defaults.get("gds_threshold") > alignment:
                self.kvikio.defaults.set({"gds_threshold": alignment})
        if engine in ("mmap", "mixed"):
            self.maps = ShardMaps(self.index, self.config["gather_threads"])
        elif engine == "direct":
            self.maps = DirectReads(self.index, self.config["direct_depth"])
        elif engine == "mapped":
            self.maps = MappedShards(self.index, self.device, self.copy)

    def _fall_back(self, error):
        with self._lock:
            if self.engine != "mapped":
                return
            log.warning("%s; reading with io_engine=%s from now on", error, self.fallback)
            self._retired.append(self.maps)  # another thread may still be gathering from it: closed with the reader
            self._start(self.fallback)

    def window(self, plan, uses: int):
        """A ``Window`` over ``plan`` for ``read`` (``io.direct``), or None: only streaming reads
        (``direct``) read several batches' samples at once."""
        return self.maps.window(plan, uses) if self.engine == "direct" else None

    def read(self, plan, staging: StagingBuffer, windows=()):
        """Issue every read of ``plan`` in parallel into ``staging``; returns ``(tensor, ready)``:
        the staging tensor and, where the reads are still in flight on a CUDA stream (``mapped``), a
        CUDA event that completes with them (else None: the tensor is filled). ``windows``: the
        ``window()`` windows that hold the plan's samples (else they are read)."""
        target = staging.ensure(plan.total)
        if self.engine == "mapped":
            try:
                return target, self.maps.gather(plan, target)
            except GpuError as e:  # the shards cannot be registered: the fallback engine reads them
                if self.fallback is None:
                    raise
                self._fall_back(e)
        if self.engine == "direct":
            host = target.numpy()
            if not fill(windows, plan, host):
                self.maps.read(plan, host)
            return target, None
        few_large = plan.total >= _KVIKIO_READ * len(plan.sizes)
        if self.engine == "mmap" or (self.engine == "mixed" and not few_large):
            self.maps.gather(plan, target)
            return target, None
        host = None if staging.kind == "device" else target.numpy()
        futures = []
        with contextlib.ExitStack() as held:  # the handles stay open until their reads are done
            for read in plan.reads:
                if host is not None:
                    dest = host[read.buffer_offset:read.buffer_offset + read.size]
                else:
                    dest = target[read.buffer_offset:read.buffer_offset + read.size]
                handle = held.enter_context(self._files.use(read.shard))
                futures.append((read, handle.pread(dest, read.size, read.offset)))
            for read, future in futures:
                with stall.native("kvikio CuFile.pread"):
                    got = future.get()
                if got != read.size:
                    raise FormatError(f"{self.index.shard_path(read.shard)}: short read at offset {read.offset} "
                                      f"({got} of {read.size} bytes): truncated shard")
        return target, None

    def close(self):
        self._files.close()
        for maps in [self.maps, *self._retired]:
            if maps is not None:
                maps.close()
        self._retired = []
