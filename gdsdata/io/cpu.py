"""Storage -> host staging buffer on the CPU path: coalesced ``os.preadv`` reads of a batch."""

import collections
import contextlib
import errno
import functools
import logging
import os
import resource
import threading

import numpy as np

from gdsdata import settings
from gdsdata import stall
from gdsdata.errors import FormatError, GdsDataError
from gdsdata.format.shards import cannot_read, check_opened, dangling, open_regular
from gdsdata.io.plan import Plan, max_gap, plan_reads

log = logging.getLogger(__name__)


def open_files_budget() -> int:
    """How many shard files one reader keeps open: a quarter of the process's descriptor limit, at
    most 256 (a dataset of thousands of shards must not run a process out of descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(4, min(256, soft // 4))


def shard_gone(error: FileNotFoundError, path):
    """Raise a ``FormatError`` for a shard file gone since the index was loaded (the dataset was
    replaced with fewer shards, or the file removed), chained to ``error``, instead of a bare
    ``FileNotFoundError``."""
    raise FormatError(f"{path}: missing, gone since the dataset was opened{dangling(path)} (if it was packed again, "
                      f"open it again; if the file was removed, the dataset is incomplete)") from error


class OpenShards:
    """Shard files a reader holds open, at most ``max_open`` of them: opening one more closes the
    least recently used one that no read is using (reads may hold a few more for a moment). Each
    file is checked against the index when it is opened (``check(head, path, shard)``)."""

    def __init__(self, index, opener, closer, max_open=None):
        self.index, self._opener, self._closer = index, opener, closer
        self.max_open = max_open or open_files_budget()
        self._open = collections.OrderedDict()  # shard -> handle, least recently used first
        self._busy = collections.Counter()
        self._opening = {}  # shard -> Event set once its opening ended (others wait for it)
        self._closed = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, shard):
        while True:
            with self._lock:
                handle = self._open.get(shard)
                if handle is not None:
                    self._open.move_to_end(shard)
                    self._busy[shard] += 1
                    break
                opening = self._opening.get(shard)
                if opening is None:
                    opening = self._opening[shard] = threading.Event()
                    break
            opening.wait()  # another read opens it: take its handle (or open it again if that failed)
        if handle is None:  # opened outside the lock: a shard whose open hangs holds up only its own reads
            handle = self._open_new(shard, opening)
        try:
            yield handle
        finally:
            with self._lock:
                self._busy[shard] -= 1

    def _open_new(self, shard, opening):
        """Open ``shard`` (its ``opening`` event set when done, whatever happens), registered busy."""
        path = self.index.shard_path(shard)
        handle, kept, evicted = None, False, []
        try:
            handle = self._open_checked(path, shard)
            with self._lock:
                if self._closed:
                    raise GdsDataError(f"{path}: the dataset was closed while this shard was being opened")
                idle = [k for k in self._open if not self._busy[k]]
                evicted = [self._open.pop(k) for k in idle[:max(0, len(self._open) + 1 - self.max_open)]]
                self._open[shard] = handle
                self._busy[shard] += 1
                kept = True
        finally:
            with self._lock:
                self._opening.pop(shard, None)
            opening.set()
            for old in evicted + ([] if kept or handle is None else [handle]):
                try:
                    self._closer(old)
                except Exception as e:  # noqa: BLE001 - a failed close of another file fails no read
                    log.warning("closing a shard file failed: %s", e)
        return handle

    def _open_checked(self, path, shard):
        """The opener's handle; its errors as gdsdata's, naming the file."""
        try:
            return self._opener(path, shard)
        except FileNotFoundError as e:
            shard_gone(e, path)
        except OSError as e:
            if e.errno == errno.EMFILE:
                raise GdsDataError(f"{path}: cannot open it, the process has too many files open (its limit: "
                                   f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; the reader keeps up to "
                                   f"{self.max_open} shards open, and reads past the page cache more): raise the "
                                   f"limit (ulimit -n) or lower GDSDATA_DIRECT_DEPTH") from e
            if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ESPIPE):  # (ESPIPE: a FIFO)
                raise FormatError(f"{path}: not a shard file ({e.strerror or e})") from e
            raise GdsDataError(cannot_read(path, e)) from e  # (EACCES, EIO...)

    def __len__(self):
        return len(self._open)

    def close(self):
        with self._lock:
            self._closed = True  # (an open still running closes its file itself)
            handles, self._open = list(self._open.values()), collections.OrderedDict()
        for handle in handles:
            self._closer(handle)


def _open_checked(index, path, shard):
    """A descriptor of shard ``shard`` at ``path``, its header checked against ``index``."""
    fd = open_regular(path)
    try:
        check_opened(os.pread(fd, 4096, 0), path, index, shard)
    except BaseException:
        os.close(fd)
        raise
    return fd


class CpuReader:
    """Reads the payloads of a batch of samples into one host buffer. Safe across ``fork``: file
    descriptors are reopened in a child process. A bounded number of shard files is open at once
    (``OpenShards``), each checked against the index when opened. ``config``: a snapshot of the
    settings (``max_gap``, ``max_read``, ``direct_depth``; default: the settings now). ``direct``: read
    past the page cache (``io.direct``) instead."""

    def __init__(self, index, max_open=None, config=None, direct: bool = False):
        self.index = index
        self.config = settings.snapshot() if config is None else config
        self._max_open = max_open
        self.direct = direct
        self._files = None
        self._direct = None
        self._pid = None
        self._lock = threading.Lock()

    @property
    def files(self) -> OpenShards:
        if self._files is None or self._pid != os.getpid():  # a forked child opens its own
            # (the opener holds the index, not this reader: no cycle keeps a dropped reader's descriptors open)
            self._files, self._direct = OpenShards(self.index, functools.partial(_open_checked, self.index), os.close,
                                                   self._max_open), None
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._files

    def _direct_reads(self):
        from gdsdata.io.direct import DirectReads

        self.files  # noqa: B018 - a forked child drops its parent's readers first
        with self._lock:
            if self._direct is None:
                self._direct = DirectReads(self.index, self.config["direct_depth"], self._max_open)
            return self._direct

    def plan(self, indices) -> Plan:
        return plan_reads(self.index.samples, indices, self.index.alignment,
                          max_gap(self.config, self.direct), self.config["max_read"])

    def window(self, plan, uses: int):
        """A ``Window`` over ``plan`` for ``read`` (``io.direct``), or None where reads go through
        the page cache."""
        return self._direct_reads().window(plan, uses) if self.direct else None

    def read(self, indices, windows=()):
        """Returns (staging buffer, plan); sample k of ``indices`` is
        ``buffer[plan.sample_offsets[k]:][:plan.sample_lengths[k]]``. ``windows``: the ``window()``
        windows that hold the samples (else they are read)."""
        plan = self.plan(indices)
        if self.direct:
            from gdsdata.io.direct import aligned_empty, fill

            buffer = aligned_empty(plan.total)
            if not fill(windows, plan, buffer):
                self._direct_reads().read(plan, buffer)
            return buffer, plan
        buffer = np.empty(plan.total, np.uint8)
        for read in plan.reads:
            view = memoryview(buffer[read.buffer_offset:read.buffer_offset + read.size])
            with self.files.use(read.shard) as fd, stall.native("preadv"):
                try:
                    got = os.preadv(fd, [view], read.offset)
                except OSError as e:  # (EIO: a failing drive) naming the file
                    raise GdsDataError(cannot_read(self.index.shard_path(read.shard), e)) from e
            if got != read.size:
                raise FormatError(f"{self.index.shard_path(read.shard)}: short read at offset "
                                  f"{read.offset} ({got} of {read.size} bytes): truncated shard")
        return buffer, plan

    def close(self):
        if self._pid == os.getpid():
            for reader in (self._files, self._direct):
                if reader is not None:
                    reader.close()
        self._files = self._direct = None

    def __del__(self):  # a dataset dropped without close() gives its descriptors back
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __getstate__(self):
        return {"index": self.index, "max_open": self._max_open, "config": dict(self.config), "direct": self.direct}

    def __setstate__(self, state):
        self.__init__(state["index"], state.get("max_open"), state.get("config"), state.get("direct", False))
