"""Storage -> host staging buffer on the CPU path: coalesced ``os.preadv`` reads of a batch."""

import os
import threading

import numpy as np

from . import settings, stall
from .errors import FormatError
from .plan import Plan, plan_reads


class CpuReader:
    """Reads the payloads of a batch of samples into one host buffer. Safe across ``fork``: file
    descriptors are reopened in a child process."""

    def __init__(self, index):
        self.index = index
        self._fds = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _fd(self, shard):
        with self._lock:
            if self._pid != os.getpid():
                self._fds, self._pid = {}, os.getpid()
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(self.index.shard_path(shard), os.O_RDONLY)
            return fd

    def plan(self, indices) -> Plan:
        return plan_reads(self.index.samples, indices, self.index.alignment,
                          settings.get("max_gap"), settings.get("max_read"))

    def read(self, indices):
        """Returns (staging buffer, plan); sample k of ``indices`` is
        ``buffer[plan.sample_offsets[k]:][:plan.sample_lengths[k]]``."""
        plan = self.plan(indices)
        buffer = np.empty(plan.total, np.uint8)
        for read in plan.reads:
            view = memoryview(buffer[read.buffer_offset:read.buffer_offset + read.size])
            with stall.native("preadv"):
                got = os.preadv(self._fd(read.shard), [view], read.offset)
            if got != read.size:
                raise FormatError(f"{self.index.shard_path(read.shard)}: short read at offset "
                                  f"{read.offset} ({got} of {read.size} bytes): truncated shard")
        return buffer, plan

    def close(self):
        with self._lock:
            if self._pid == os.getpid():
                for fd in self._fds.values():
                    os.close(fd)
            self._fds = {}

    def __getstate__(self):
        return {"index": self.index}

    def __setstate__(self, state):
        self.__init__(state["index"])
