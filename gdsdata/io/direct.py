"""Storage -> host staging past the page cache: the streaming reads of datasets larger than memory.

A planned batch (``io.plan``: whole aligned pages, coalesced) is read with ``O_DIRECT``: the drive
DMAs into the staging buffer and nothing of the shard stays in the page cache, so an epoch over a
dataset larger than the host's memory neither evicts the training process's own pages nor keeps
the last epoch's bytes. The planned reads are cut into pieces, and the pieces of the whole batch
are issued together by ``depth`` threads (``os.preadv`` releases the interpreter lock while the
drive works): the requests in flight that a drive's queue needs to give its rate. A batch of a few
large reads (file order, block shuffle) is cut into at least ``depth`` pieces (no smaller than
``MIN_PIECE``), so that it too keeps the queue full; no piece is larger than ``PIECE``.

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and FUSE filesystems) or a read's
alignment does not suit the device (a dataset packed with an alignment under the device's logical
block size), that shard is read through the page cache and each range is dropped from it again
after the read (``POSIX_FADV_DONTNEED``): the cache still does not grow. A log line says so once
per shard.

The staging buffer's address must be a multiple of the page size (pinned staging is; the CPU path
allocates it so: ``aligned_empty``); the plan's offsets and sizes are multiples of the dataset's
alignment.
"""

import errno
import logging
import mmap
import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gdsdata import stall
from gdsdata.errors import FormatError
from gdsdata.format.shards import check_opened
from gdsdata.io.cpu import OpenShards

log = logging.getLogger(__name__)
PIECE = 4 << 20  # most bytes of one request (kvikio's default task size)
MIN_PIECE = 256 << 10  # fewest bytes of a piece cut from a larger read
PAGE = mmap.PAGESIZE


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose first byte is page aligned."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes]


class _Shard:
    """An open shard: its descriptor, and whether reads bypass the page cache."""

    def __init__(self, path: str, fd: int, direct: bool):
        self.path, self.fd, self.direct = path, fd, direct
        self.lock = threading.Lock()
        self._retired = []  # descriptors other threads may still be reading from: closed with the shard

    def reopen_buffered(self, why: str):
        with self.lock:
            if self.direct:
                log.info("%s: read through the page cache, each range dropped after its read (%s)", self.path, why)
                self._retired.append(self.fd)
                self.fd, self.direct = _buffered(self.path), False

    def close(self):
        for fd in [self.fd, *self._retired]:
            os.close(fd)


def _buffered(path) -> int:
    """A descriptor for reads through the page cache without readahead: the pages read are dropped
    after each read, and readahead would cache pages beyond them."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _open(index, path, shard) -> _Shard:
    try:
        handle = _Shard(path, os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT"))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        handle = _Shard(path, _buffered(path), False)
        log.info("%s: the filesystem refuses O_DIRECT: read through the page cache, each range dropped after "
                 "its read", path)
    try:
        head = aligned_empty(PAGE)
        _pread(handle, head, 0)
        check_opened(head.tobytes(), path, index, shard)
    except BaseException:
        handle.close()
        raise
    return handle


def _pread(handle: _Shard, dest: np.ndarray, offset: int) -> int:
    """Read ``len(dest)`` bytes at ``offset`` (fewer only at the end of the file)."""
    done, size = 0, len(dest)
    while done < size:
        fd, direct = handle.fd, handle.direct
        try:
            got = os.preadv(fd, [memoryview(dest[done:])], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            handle.reopen_buffered(f"O_DIRECT refused a read of {size - done} bytes at offset {offset + done}")
            continue
        if got == 0:
            break
        done += got
    if not handle.direct:
        os.posix_fadvise(handle.fd, offset, size, os.POSIX_FADV_DONTNEED)
    return done


class DirectReads:
    """Reads planned batches past the page cache into host buffers, ``depth`` requests at a time,
    with at most ``max_open`` shard files open (``OpenShards``: each held only while a piece of it
    is read)."""

    def __init__(self, index, depth: int, max_open: int = None):
        self.index = index
        self.depth = max(1, depth)
        self._files = OpenShards(index, lambda path, shard: _open(index, path, shard), lambda h: h.close(), max_open)
        self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="gdsdata-direct")

    def pieces(self, plan) -> int:
        """The bytes of each piece the plan's reads are cut into: enough pieces to keep ``depth``
        requests in flight, each a whole number of pages between ``MIN_PIECE`` and ``PIECE``."""
        share = -(-plan.total // self.depth)
        return min(PIECE, max(MIN_PIECE, -(-share // PAGE) * PAGE))

    def _piece(self, shard, dest, offset):
        with self._files.use(shard) as handle:
            return _pread(handle, dest, offset)

    def read(self, plan, dest: np.ndarray):
        """Fill ``dest`` (uint8, page aligned, at least ``plan.total`` bytes) with the plan's reads."""
        if dest.ctypes.data % PAGE:
            raise ValueError("direct reads need a page-aligned buffer")
        pending, piece = [], self.pieces(plan)
        try:
            for read in plan.reads:
                for start in range(0, read.size, piece):
                    size = min(piece, read.size - start)
                    view = dest[read.buffer_offset + start:read.buffer_offset + start + size]
                    pending.append((read, start, size,
                                    self._pool.submit(self._piece, read.shard, view, read.offset + start)))
            for read, start, size, future in pending:
                with stall.native("pread (O_DIRECT)"):
                    got = future.result()
                if got != size:
                    raise FormatError(f"{self.index.shard_path(read.shard)}: short read at offset "
                                      f"{read.offset + start} ({got} of {size} bytes): truncated shard")
        finally:  # no piece may still be writing into the buffer once this returns
            futures.wait([future for *_, future in pending])

    def close(self):
        self._pool.shutdown(wait=True)
        self._files.close()
