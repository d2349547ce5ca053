"""Linux native asynchronous I/O for ``O_DIRECT`` reads: ``io_setup``, ``io_submit`` and
``io_getevents`` called as system calls through ctypes (no libaio needed).

A batch's reads are submitted to the kernel in one call and reaped in a few, so a queue of dozens
of requests stays full without a thread per request, and without the interpreter lock changing
hands each time a request completes (ctypes releases the lock for the length of each call). The
kernel runs such reads asynchronously only on files opened ``O_DIRECT``; ``io.direct`` uses it for
those and falls back to its threads elsewhere, or where the system refuses a context (``io_setup``
failing: no AIO in the kernel, ``aio-max-nr`` reached, a seccomp filter).
"""

import ctypes
import errno
import os
import platform

import numpy as np

# (io_setup, io_destroy, io_submit, io_getevents) by machine: the kernel's system call numbers
_NUMBERS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_IOCB_CMD_PREAD = 0


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h), little-endian layout
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.syscall
    call.restype = ctypes.c_long
    return call


class Context:
    """One AIO context of ``depth`` requests: ``submit`` reads into buffers given by address,
    ``reap`` what completed. Not shared between threads (each keeps its own)."""

    def __init__(self, depth: int):
        numbers = _NUMBERS.get(platform.machine())
        if numbers is None or ctypes.sizeof(ctypes.c_void_p) != 8 or not hasattr(os, "O_DIRECT"):
            raise OSError(errno.ENOSYS, f"no native AIO binding for a {ctypes.sizeof(ctypes.c_void_p) * 8}-bit "
                                        f"interpreter on {platform.machine()}")
        self._setup, self._destroy, self._submit, self._getevents = numbers
        self._call = _syscall()
        self.depth = depth
        self._handle = ctypes.c_ulong(0)
        if self._call(self._setup, ctypes.c_long(depth), ctypes.byref(self._handle)) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup({depth}): {os.strerror(code)}")
        # filled and read through numpy views: a batch's requests in a few array operations, not
        # ctypes attribute by attribute (interpreter time the training loop's thread waits for)
        self._iocbs = (_Iocb * depth)()
        self._requests = np.ctypeslib.as_array(self._iocbs)
        self._pointers = (ctypes.c_uint64 * depth)()  # struct iocb *[]: the slots' addresses
        self._addresses = np.ctypeslib.as_array(self._pointers)
        self._events = (_Event * depth)()
        self._done = np.ctypeslib.as_array(self._events)
        self._base = ctypes.addressof(self._iocbs)
        self._free = list(range(depth))  # iocb slots not in flight

    @property
    def room(self) -> int:
        """Requests that can be submitted now."""
        return len(self._free)

    def submit(self, requests) -> list:
        """Submit ``requests``, each ``(fd, address, nbytes, offset)`` (at most ``room``): returns
        the slots of those the kernel took, in order (a prefix of ``requests``; each slot comes back
        from ``reap`` with its result). Raises only when it took none: after a failure part way it
        returns those it took."""
        if not requests:
            return []
        count = len(requests)
        if count > len(self._free):
            raise ValueError(f"{count} requests for {len(self._free)} free slots")
        slots = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        columns = np.array(requests, dtype=np.int64).reshape(count, 4)
        at = np.array(slots, dtype=np.int64)
        iocbs = np.zeros(count, self._requests.dtype)  # the other fields stay 0
        iocbs["data"], iocbs["opcode"] = at, _IOCB_CMD_PREAD
        iocbs["fildes"], iocbs["buf"], iocbs["nbytes"], iocbs["offset"] = columns.T
        self._requests[at] = iocbs
        self._addresses[:count] = self._base + at * ctypes.sizeof(_Iocb)
        done = 0
        while done < len(slots):
            got = self._call(self._submit, self._handle, ctypes.c_long(len(slots) - done),
                             ctypes.byref(self._pointers, done * ctypes.sizeof(ctypes.c_void_p)))
            if got < 0:
                code = ctypes.get_errno()
                if code == errno.EINTR:
                    continue
                if code == errno.EAGAIN or done:
                    break  # the rest are handed back: those taken are in flight and must be reaped
                self._free.extend(slots)
                raise OSError(code, f"io_submit: {os.strerror(code)}")
            if not got:  # took nothing without an error: the rest are handed back
                break
            done += got
        self._free.extend(slots[done:])
        return slots[:done]

    def reap(self, wait_s: float) -> list:
        """``(slot, result)`` of the requests done, waiting up to ``wait_s`` seconds for at least
        one; result: bytes read, or ``-errno``."""
        timeout = _Timespec(int(wait_s), int((wait_s % 1) * 1e9))
        while True:
            got = self._call(self._getevents, self._handle, ctypes.c_long(1), ctypes.c_long(self.depth),
                             self._events, ctypes.byref(timeout))
            if got >= 0:
                break
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, f"io_getevents: {os.strerror(code)}")
        slots = self._done["data"][:got].tolist()
        self._free.extend(slots)  # first: nothing between the call and here may lose a slot
        return list(zip(slots, self._done["res"][:got].tolist()))

    @property
    def in_flight(self) -> int:
        return self.depth - len(self._free)

    def close(self):
        if self._handle.value:
            self._call(self._destroy, self._handle)
            self._handle = ctypes.c_ulong(0)
