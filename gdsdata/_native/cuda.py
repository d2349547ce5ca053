"""Many copies in one call: a typed binding to the CUDA driver's ``cuMemcpyBatchAsync`` (drivers for
CUDA 12.8 and later), through ctypes over ``libcuda.so.1``.

The ``mapped`` engine moves a batch's reads from registered page-cache pages into GPU staging with
one such call per batch: the copy engines take every read (no SM and no CPU core copies a byte) and
the call returns at once (why rather than a ``cudaMemcpyAsync`` per read or the SMs' page gather:
docs/design.md, "Who issues the reads").

CUDA 13 drivers export ``cuMemcpyBatchAsync_v2``; CUDA 12.8 and 12.9 drivers export
``cuMemcpyBatchAsync``, which takes a failure index before the stream. Both are bound.

Also ``new_stream``: a stream outside torch's pool (``cuStreamCreate``), for memory nothing else
allocates from (``gdsdata.batch.gpu_empty``).
"""

import contextlib
import ctypes
import functools
import threading

import numpy as np

from gdsdata.errors import GpuError, GpuUnavailableError

_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CUmemLocationType
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit wait for the legacy default stream


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda with what this module calls bound, or None where the driver is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    p, size_t = ctypes.c_void_p, ctypes.c_size_t
    for name, argtypes in {"cuCtxGetCurrent": [p], "cuCtxSetCurrent": [p], "cuDeviceGet": [p, ctypes.c_int],
                           "cuDevicePrimaryCtxRetain": [p, ctypes.c_int],
                           "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
                           "cuStreamCreate": [p, ctypes.c_uint],
                           "cuMemcpyBatchAsync_v2": [p, p, p, size_t, p, p, size_t, p],
                           "cuMemcpyBatchAsync": [p, p, p, size_t, p, p, size_t, p, p]}.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def entry_point():
    """The name of the driver's batched copy that this process will call, or None without one."""
    lib = _driver()
    for name in ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"):
        if lib is not None and getattr(lib, name, None) is not None:
            return name
    return None


def _check(lib, call, status):
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise GpuError(f"{call} failed: {(name.value or b'CUDA error').decode()} ({status})")


class BatchCopy:
    """Host -> GPU copies of one batch, queued on a CUDA stream with one driver call. ``entry``
    picks the driver function (default: the newest the driver has)."""

    def __init__(self, device_index: int, entry: str = None):
        self.lib = _driver()
        self.entry = entry or entry_point()
        if self.lib is None or self.entry is None or getattr(self.lib, self.entry, None) is None:
            raise GpuUnavailableError("this CUDA driver has no batched copy (cuMemcpyBatchAsync needs a driver "
                                      "for CUDA 12.8 or later)")
        self._fn = getattr(self.lib, self.entry)
        self.device_index = device_index
        self._attributes = _Attributes(_ACCESS_ORDER_STREAM, _Location(_LOCATION_HOST, 0),
                                       _Location(_LOCATION_DEVICE, device_index), 0)
        self._first = (ctypes.c_size_t * 1)(0)  # one set of attributes, from the first copy on
        self._failed = ctypes.c_size_t()

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int):
        """Queue ``sizes[k]`` bytes from host address ``srcs[k]`` to GPU address ``dsts[k]`` for
        every k, on ``stream`` (not the legacy default stream); returns at once."""
        count = len(sizes)
        if not count:
            return
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        with _in_primary_context(self.lib, self.device_index):
            args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count, ctypes.byref(self._attributes),
                    self._first, 1]
            if self.entry == "cuMemcpyBatchAsync":  # the CUDA 12.8 form: a failure index before the stream
                args.append(ctypes.byref(self._failed))
            _check(self.lib, self.entry, self._fn(*args, ctypes.c_void_p(stream)))


def new_stream(device_index: int) -> int:
    """A CUDA stream (its handle) of the device's primary context, torch's, made by the driver: not
    one of torch's pool, which hands its streams round to every caller, so nothing but what its
    maker queues ever runs on it. Lives as long as the process."""
    lib = _driver()
    if lib is None or getattr(lib, "cuStreamCreate", None) is None:
        raise GpuUnavailableError("no CUDA driver (libcuda.so.1) to make a stream with")
    stream = ctypes.c_void_p()
    with _in_primary_context(lib, device_index):
        _check(lib, "cuStreamCreate", lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING))
    return stream.value


_contexts = {}  # device index -> its primary context, retained once for the process (torch uses the same one)
_contexts_lock = threading.Lock()


@contextlib.contextmanager
def _in_primary_context(lib, device_index: int):
    """The device's primary context current on this thread for the block (a thread that has not
    touched CUDA yet has none; one may have another device's), then what was current before."""
    with _contexts_lock:
        if device_index not in _contexts:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), device_index))
            _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
            _contexts[device_index] = context.value
        mine = _contexts[device_index]
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    if current.value != mine:
        lib.cuCtxSetCurrent(ctypes.c_void_p(mine))
    try:
        yield
    finally:
        if current.value != mine:
            lib.cuCtxSetCurrent(current)
