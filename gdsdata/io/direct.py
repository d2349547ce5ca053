"""Storage -> host staging past the page cache: the streaming reads of datasets larger than memory.

A planned batch (``io.plan``: whole aligned pages, coalesced) is read with ``O_DIRECT``: the drive
DMAs into the staging buffer and nothing of the shard stays in the page cache, so an epoch over a
dataset larger than the host's memory neither evicts the training process's own pages nor keeps
the last epoch's bytes. The planned reads are cut into pieces, and the pieces of the whole batch
are submitted together, ``depth`` at a time, through Linux native AIO (``_native.aio``), or where
the system refuses an AIO context issued by ``depth`` threads (``os.preadv``): the requests in
flight that a drive's queue needs to give its rate. A batch of a few large reads (file order,
block shuffle) is cut into at least ``depth`` pieces (no smaller than ``MIN_PIECE``), so that it
too keeps the queue full; no piece is larger than ``PIECE``.

A ``Window`` reads a run of samples at once (a Loader's block-shuffled samples of one shuffle window:
whole blocks of consecutive samples, so a few reads of megabytes each where each batch alone would
make one small read per sample), and ``fill`` copies each batch's staging from the windows that
hold its samples.

Where the filesystem refuses ``O_DIRECT`` (some network and FUSE filesystems; tmpfs before Linux 6.6) or a read's
alignment does not suit the device (a dataset packed with an alignment under the device's logical
block size), that shard is read through the page cache and each range is dropped from it again
after the read (``POSIX_FADV_DONTNEED``): the cache still does not grow. A log line says so once
per shard.

The staging buffer's address must be a multiple of the page size (pinned staging is; the CPU path
allocates it so: ``aligned_empty``); the plan's offsets and sizes are multiples of the dataset's
alignment.
"""

import copy
import errno
import logging
import mmap
import os
import threading
from collections import deque
from concurrent import futures

import numpy as np

from gdsdata import stall
from gdsdata.errors import FormatError, GdsDataError
from gdsdata.format.lock import identity
from gdsdata.format.shards import cannot_read, check_opened, open_regular, replaced_while_open
from gdsdata.io.cpu import OpenShards
from gdsdata.threads import DaemonPool

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
                fd = _buffered(self.path, self.fd)  # first: a failure leaves the handle as it was
                self._retired.append(self.fd)
                self.fd, self.direct = fd, False

    def close(self):
        with self.lock:
            fds, self._retired = [self.fd, *self._retired], []
        for fd in fds:
            os.close(fd)


def _buffered(path, fd_open: "int | None" = None) -> int:
    """A descriptor for reads through the page cache without readahead (the pages read are dropped
    after each read, and readahead would cache pages beyond them); with ``fd_open``, of the file it
    has open: the shard whose header was checked, even where ``path`` names another file now (the
    dataset packed again with --overwrite)."""
    fd = None
    if fd_open is not None:
        try:
            fd = os.open(f"/proc/self/fd/{fd_open}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # (no /proc): the path, if it still names that file
            pass
    if fd is None:
        fd = open_regular(path)
    try:
        if fd_open is not None and identity(fd) != identity(fd_open):
            raise FormatError(replaced_while_open(path))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open(index, path, shard) -> _Shard:
    try:
        handle = _Shard(path, open_regular(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT"))
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
            if e.errno != errno.EINVAL or not direct:  # (EIO: a failing drive) naming the file
                raise GdsDataError(cannot_read(handle.path, e)) from e
            handle.reopen_buffered(f"O_DIRECT refused a read of {size - done} bytes at offset {offset + done}")
            continue
        if got == 0:
            break
        done += got
    if not handle.direct:
        os.posix_fadvise(handle.fd, offset, size, os.POSIX_FADV_DONTNEED)
    return done


class _Piece:
    """One request of a batch: ``size`` bytes of shard ``shard`` at ``offset`` into ``dest``."""

    __slots__ = ("shard", "offset", "size", "dest", "address", "got")

    def __init__(self, shard, offset, size, dest, address):
        self.shard, self.offset, self.size, self.dest, self.got = shard, offset, size, dest, 0
        self.address = address  # of ``dest``'s first byte


class DirectReads:
    """Reads planned batches past the page cache into host buffers, ``depth`` requests at a time,
    with at most ``max_open`` shard files open (``OpenShards``: each held only while a piece of it
    is read). The requests go to the kernel through native AIO (``_native.aio``: one submission a
    batch, no thread per request) where the system allows it (``aio``), else from ``depth``
    threads; shards read through the page cache (filesystems without ``O_DIRECT``) always take the
    threads."""

    def __init__(self, index, depth: int, max_open: int = None, aio: bool = True):
        self.index = index
        self.depth = max(1, depth)
        self._files = OpenShards(index, lambda path, shard: _open(index, path, shard), lambda h: h.close(), max_open)
        self._pool = DaemonPool(self.depth, "gdsdata-direct")  # daemons: a stuck read never blocks the exit
        self._aio = aio
        self._contexts, self._idle, self._lock = [], [], threading.Lock()  # AIO contexts: all, not in use
        self._spares = []  # buffers of finished windows (``Window``), for the next ones

    def pieces(self, plan) -> int:
        """The bytes of each piece the plan's reads are cut into: enough pieces to keep ``depth``
        requests in flight, each a whole number of pages between ``MIN_PIECE`` and ``PIECE``."""
        share = -(-plan.total // self.depth)
        return min(PIECE, max(MIN_PIECE, -(-share // PAGE) * PAGE))

    def read(self, plan, dest: np.ndarray):
        """Fill ``dest`` (uint8, page aligned, at least ``plan.total`` bytes) with the plan's reads."""
        if dest.ctypes.data % PAGE:
            raise ValueError("direct reads need a page-aligned buffer")
        most, pieces, base = self.pieces(plan), [], dest.ctypes.data
        for read in plan.reads:
            for start in range(0, read.size, most):
                size = min(most, read.size - start)
                at = read.buffer_offset + start
                pieces.append(_Piece(read.shard, read.offset + start, size, dest[at:at + size], base + at))
        context = self._context()
        if context is None:
            self._read_threads(pieces)
        else:
            try:
                self._read_aio(context, pieces)
            finally:
                busy = context.in_flight  # requests the kernel still holds: never reused; destroying waits for them
                with self._lock:
                    if context in self._contexts:  # (not closed under this read)
                        if busy:
                            self._contexts.remove(context)
                        else:
                            self._idle.append(context)
                if busy:
                    context.close()
        for piece in pieces:
            if piece.got != piece.size:
                raise FormatError(f"{self.index.shard_path(piece.shard)}: short read at offset {piece.offset} "
                                  f"({piece.got} of {piece.size} bytes): truncated shard")

    def window(self, plan, uses: int) -> "Window":
        """A ``Window`` over ``plan`` (the joint plan of ``uses`` batches), read when first used."""
        return Window(self, plan, uses)

    def _context(self):
        """An AIO context no other read uses (one per batch read at once), or None where native AIO
        is off or refused (logged once)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if not self._aio:
            return None
        from gdsdata._native.aio import Context

        try:
            context = Context(self.depth)
        except OSError as e:
            self._aio = False
            log.info("native AIO unavailable (%s): direct reads issued from %d threads", e, self.depth)
            return None
        with self._lock:
            self._contexts.append(context)
        return context

    def _piece(self, piece: _Piece, done: int = 0):
        """Read ``piece`` (from its byte ``done`` on: the rest of a short read) on this thread."""
        with self._files.use(piece.shard) as handle:
            piece.got = done + _pread(handle, piece.dest[done:], piece.offset + done)

    def _read_threads(self, pieces):
        pending = []
        try:
            for piece in pieces:
                pending.append(self._pool.submit(self._piece, piece))
            for future in pending:
                with stall.native("pread (O_DIRECT)"):
                    future.result()
        finally:  # no piece may still be writing into the buffer once this returns
            futures.wait(pending)

    def _read_aio(self, context, pieces):
        """The pieces through ``context``: as many in flight as it holds, the pieces of at most
        ``max_open`` shards at once. On the threads instead: pieces of shards read through the
        cache, pieces the kernel did not take, and the rest of a piece it read short or refused.
        Returns or raises only once the kernel holds none of them."""
        waiting, flying, held, threaded = deque(pieces), {}, {}, []
        error = None

        def hold(shard):
            entry = held.get(shard)
            if entry is None:
                use = self._files.use(shard)
                entry = held[shard] = [use, 0, use.__enter__()]
            entry[1] += 1
            return entry[2]

        def release(shard):
            entry = held[shard]
            entry[1] -= 1
            if not entry[1]:
                del held[shard]
                entry[0].__exit__(None, None, None)

        try:
            while (waiting and error is None) or flying:
                batch = []
                while waiting and error is None and len(batch) < context.room:
                    if waiting[0].shard not in held and len(held) >= max(1, self._files.max_open):
                        break
                    piece = waiting.popleft()
                    handle = hold(piece.shard)
                    if handle.direct:
                        batch.append((piece, handle))
                    else:  # read through the cache: a thread's buffered read (it holds the shard itself)
                        release(piece.shard)
                        threaded.append(self._pool.submit(self._piece, piece))
                if batch:
                    try:
                        slots = context.submit([(h.fd, p.address, p.size, p.offset) for p, h in batch])
                    except OSError as e:  # the kernel took none: the threads read them
                        log.debug("io_submit refused %d reads (%s): read from threads", len(batch), e)
                        slots = []
                    for slot, entry in zip(slots, batch):
                        flying[slot] = entry
                    for piece, _ in batch[len(slots):]:
                        release(piece.shard)
                        threaded.append(self._pool.submit(self._piece, piece))
                if not flying:
                    continue
                with stall.native("io_getevents (O_DIRECT)"):
                    done = [(flying.pop(slot), result) for slot, result in context.reap(0.5) if slot in flying]
                for (piece, handle), result in done:
                    try:
                        if result == piece.size:
                            piece.got = result
                        elif error is not None:
                            pass
                        elif result == -errno.EINVAL:  # the device refused the alignment
                            handle.reopen_buffered(f"O_DIRECT refused a read of {piece.size} bytes at offset "
                                                   f"{piece.offset}")
                            threaded.append(self._pool.submit(self._piece, piece))
                        elif result < 0:
                            error = GdsDataError(f"{self.index.shard_path(piece.shard)}: cannot be read ("
                                                 f"{os.strerror(-result)}, a read of {piece.size} bytes at "
                                                 f"offset {piece.offset})")
                        else:  # short: the rest (the end of the file, or a partial read)
                            threaded.append(self._pool.submit(self._piece, piece, result))
                    except BaseException as e:  # noqa: BLE001 - raised once nothing is in flight
                        error = error or e
                    finally:  # the shard is let go only once its piece is handled
                        release(piece.shard)
        finally:  # nothing may still be writing into the buffer once this returns
            try:
                while context.in_flight:
                    with stall.native("io_getevents (O_DIRECT)"):
                        context.reap(0.5)
            finally:
                for use, *_ in list(held.values()):
                    use.__exit__(None, None, None)
                held.clear()
                futures.wait(threaded)
        if error is not None:
            raise error
        for future in threaded:
            future.result()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A page-aligned buffer of at least ``nbytes`` for a window: one an earlier window handed
        back where it is large enough (its pages already faulted in), else a new one."""
        with self._lock:
            for k, spare in enumerate(self._spares):
                if len(spare) >= nbytes:
                    return self._spares.pop(k)
        return aligned_empty(-(-nbytes * 5 // 4 // PAGE) * PAGE)  # room for the next windows, a little larger

    def _give_back(self, buffer: np.ndarray):
        with self._lock:
            self._spares = [*self._spares, buffer][-_SPARE_WINDOWS:]

    def close(self):
        if not self._pool.shutdown(wait_s=stall.bound()):  # a read stuck in the kernel
            log.error("direct reads of %s still stuck in the kernel: their shards stay open", self.index.root)
            return
        with self._lock:
            contexts, self._contexts, self._idle = self._contexts, [], []
        stuck = [context for context in contexts if context.in_flight]  # (a reader left behind by a StallError)
        for context in contexts:
            if not context.in_flight:
                context.close()
        if stuck:  # io_destroy would wait for their requests, for good where the drive stopped answering
            log.error("%d direct read(s) of %s still in the kernel: their contexts and shards stay open",
                      sum(context.in_flight for context in stuck), self.index.root)
            return
        self._files.close()


_SPARE_WINDOWS = 1  # window buffers a reader keeps for the next windows


class Window:
    """The pages of a run of samples (a shuffle window's: whole blocks), read in one plan past the
    page cache (``plan``: samples next to each other in a shard are one read whichever batch they
    belong to); ``fill`` copies each batch's staging from the windows that hold its samples.

    Read once, by ``load_ahead`` (a Loader calls it on a thread of its own as soon as the window is
    planned, so that the drive reads it while the window before is copied out) or else by the first
    ``fill``; the other fills wait for it. ``uses``: how many fills draw from the window, after which
    its buffer goes back to the reader for the next window."""

    def __init__(self, reads: DirectReads, plan, uses: int = 1):
        self.reads, self.plan, self.uses = reads, plan, uses
        self.buffer, self.error, self.abandoned = None, None, False
        self._lock = threading.Lock()
        alignment = reads.index.alignment
        self._keys = (plan.shards << 40) | (plan.offsets // alignment)  # first page of each read, sorted
        self._pages = plan.sizes // alignment
        self._first = plan.buffer_offsets // alignment

    def load(self, ahead: bool = False) -> np.ndarray:
        """Read the window (once: later calls wait for the first) and return its pages, a 2-D array
        of alignment-sized rows. ``ahead``: the read ahead of the fills, which reads nothing (and
        returns None) once every fill is done or the window was abandoned."""
        with stall.native("direct reads of a window (read by the first of its batches or ahead)"):
            self._lock.acquire()
        try:
            if ahead and (self.uses <= 0 or self.abandoned):
                return None
            if self.error is not None:  # each batch of the window raises its own copy where it copies
                error = _copy(self.error)
                if error is self.error:
                    raise error
                raise error from self.error
            if self.buffer is None and self.abandoned:  # the Loader stopped: its batches are dropped unread
                raise GdsDataError("a window of streaming reads abandoned: the Loader's pass stopped")
            if self.buffer is None:
                buffer = self.reads._buffer(self.plan.total)
                try:
                    self.reads.read(self.plan, buffer[:self.plan.total])
                except BaseException as e:
                    self.error = e
                    raise
                self.buffer = buffer
            return self.buffer[:self.plan.total].reshape(-1, self.reads.index.alignment)
        finally:
            self._lock.release()

    def locate(self, keys: np.ndarray):
        """For shard pages ``keys`` (shard << 40 | page number), (whether the window holds each, the
        window's page holding it: 0 where it does not)."""
        if not len(self._keys):
            return np.zeros(len(keys), bool), np.zeros(len(keys), np.int64)
        read = np.maximum(np.searchsorted(self._keys, keys, "right") - 1, 0)
        offset = keys - self._keys[read]
        inside = (offset >= 0) & (offset < self._pages[read])
        return inside, np.where(inside, self._first[read] + offset, 0)

    def load_ahead(self):
        """``load`` ahead of the fills, on a thread of the Loader's (nothing once they are done)."""
        self.load(ahead=True)

    def abandon(self):
        """No fill is coming any more (the Loader's pass stopped): the window is not read from now on
        (a read ahead reads nothing, a fill raises). Without the window's lock, which a read under
        way holds: the windows after it are marked before it ends."""
        self.abandoned = True

    def release(self):
        """One fill less to come: the last hands the buffer back to the reader."""
        with self._lock:
            self.uses -= 1
            buffer = self.buffer if self.uses <= 0 else None
            if buffer is not None:
                self.buffer = None
        if buffer is not None:
            self.reads._give_back(buffer)


def _copy(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise in another thread (the original's traceback is not extended
    there), or ``error`` itself where it does not copy."""
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception whose arguments do not rebuild it
        return error


def _staging_pages(plan, alignment):
    """For each alignment-sized page of ``plan``'s staging, (the shard page it holds as shard << 40 |
    page number, whether sample bytes lie in it: the other pages are holes nothing reads)."""
    pages = plan.pages(alignment)
    keys = (np.repeat(plan.shards, plan.sizes // alignment) << 40) | pages
    marks = np.zeros(len(pages) + 1, np.int64)
    np.add.at(marks, plan.sample_offsets // alignment, 1)
    np.add.at(marks, -(-(plan.sample_offsets + plan.sample_lengths) // alignment), -1)
    return keys, np.cumsum(marks[:-1]) > 0


def fill(windows, plan, dest: np.ndarray) -> bool:
    """Copy ``plan``'s reads into ``dest`` (at least ``plan.total`` bytes) from ``windows``; False
    (nothing copied) when they do not hold all of its samples (a replacement of a bad sample, say:
    the caller reads it from the drive). Each window counts the fill as one of its uses either way."""
    try:
        if not windows:
            return False
        alignment = windows[0].reads.index.alignment
        keys, needed = _staging_pages(plan, alignment)
        found = [w.locate(keys) for w in windows]
        covered = np.logical_or.reduce([inside for inside, _ in found]) if len(found) > 1 else found[0][0]
        if not np.all(covered[needed]):
            return False
        pages = dest[:plan.total].reshape(-1, alignment)
        if len(windows) == 1:  # one np.take: the interpreter lock is let go while it copies
            np.take(windows[0].load(), found[0][1], axis=0, out=pages, mode="clip")
        else:  # a batch across the end of one window and the start of the next
            for window, (inside, source) in zip(windows, found):
                at = np.flatnonzero(inside)
                if len(at):
                    pages[at] = window.load()[source[at]]
        return True
    finally:
        for window in windows:
            window.release()
