"""A small typed ctypes binding to nvJPEG's batched decoder.

No Python library exposes nvJPEG's device-bitstream backends (HARDWARE_DEVICE, GPU_HYBRID_DEVICE),
so gdsdata binds the library from NVIDIA's wheels itself: ``nvidia-nvjpeg`` (CUDA 13,
``nvidia/cu13/lib/libnvjpeg.so.13``) or ``nvidia-nvjpeg-cu12`` (``nvidia/nvjpeg/lib/libnvjpeg.so.12``).
Only what the batched flow needs is bound:

    nvjpegCreateEx -> nvjpegJpegStateCreate -> nvjpegDecodeBatchedInitialize (per batch size)
    -> nvjpegDecodeBatched(handle, state, data[], lengths[], images[], stream)

Every status is checked and turned into ``NvjpegError`` with nvJPEG's name for it.
"""

import ctypes
import glob
import logging
import os
import threading

import numpy as np

from gdsdata import stall
from gdsdata.errors import GpuError, GpuUnavailableError

log = logging.getLogger(__name__)

BACKENDS = {"gpu_hybrid": 2, "hardware": 3, "gpu_hybrid_device": 4, "hardware_device": 5}
DEVICE_BITSTREAM_BACKENDS = {"gpu_hybrid_device", "hardware_device"}
OUTPUT_RGBI = 5
# nvjpegCreateEx flags (nvjpeg.h):
# - HW_DECODE_NO_PIPELINE: the hardware backends finish a call's work before the next call starts.
#   Pipelined (nvJPEG's default), each call first waits inside nvJPEG (cuEventSynchronize) for work
#   the previous call left on nvJPEG's internal streams, and beside a model training on the same GPU
#   that wait never returned: the internal work never ran, while every stream of gdsdata and of the
#   training loop was idle. It never hung with the pipeline off, nor with a CUDA_DEVICE_MAX_CONNECTIONS
#   of 32 instead of 8 (each stream its own hardware queue), which points at a false dependency between
#   nvJPEG's internal streams sharing one of the GPU's hardware queues (docs/design.md).
# - ENABLE_MEMORY_POOLS: nvJPEG keeps its device and pinned buffers in pools rather than allocating
#   and freeing them per call (a cudaFree waits for the whole GPU, training included).
# - UPSAMPLING_WITH_INTERPOLATION: chroma upsampled with interpolation, as libjpeg's "fancy
#   upsampling" does, rather than by replication; brings GPU pixels closer to the CPU decoders'.
FLAG_HW_DECODE_NO_PIPELINE = 1
FLAG_ENABLE_MEMORY_POOLS = 1 << 1
FLAG_UPSAMPLING_WITH_INTERPOLATION = 1 << 5
HARDWARE_BACKENDS = {"hardware", "hardware_device"}
_MAX_COMPONENT = 4
_STATUS = {
    0: "SUCCESS", 1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG", 4: "JPEG_NOT_SUPPORTED",
    5: "ALLOCATOR_FAILURE", 6: "EXECUTION_FAILED", 7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR",
    9: "IMPLEMENTATION_NOT_SUPPORTED", 10: "INCOMPLETE_BITSTREAM",
}
_MAJOR, _MINOR, _PATCH = 0, 1, 2  # libraryPropertyType
_INSTALL_HINT = ("install nvJPEG: pip install nvidia-nvjpeg (CUDA 13) or nvidia-nvjpeg-cu12 (CUDA 12); "
                 "GDSDATA_NVJPEG_LIBRARY may name the library file")


class NvjpegError(GpuError):
    """An nvJPEG call returned a failure status."""

    def __init__(self, call, status):
        self.status = status
        super().__init__(f"{call} failed: NVJPEG_STATUS_{_STATUS.get(status, status)}")


def _candidates():
    explicit = os.environ.get("GDSDATA_NVJPEG_LIBRARY")
    if explicit:
        yield explicit
        return
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        yield load_nvidia_dynamic_lib("nvjpeg").abs_path
    except Exception:  # noqa: BLE001 - pathfinder is optional; fall back to the wheels' layout
        pass
    try:
        import nvidia

        for root in nvidia.__path__:
            for pattern in ("cu13/lib/libnvjpeg.so.13*", "nvjpeg/lib/libnvjpeg.so.12*", "cu12/lib/libnvjpeg.so.12*"):
                yield from sorted(glob.glob(os.path.join(root, pattern)))
    except ImportError:
        pass
    yield from ("libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so")


_lib = None
_lib_lock = threading.Lock()


def _bind(lib):
    c = ctypes
    handle_p = c.POINTER(c.c_void_p)
    signatures = {
        "nvjpegGetProperty": (c.c_int, c.POINTER(c.c_int)),
        "nvjpegCreateEx": (c.c_int, c.c_void_p, c.c_void_p, c.c_uint, handle_p),
        "nvjpegDestroy": (c.c_void_p,),
        "nvjpegJpegStateCreate": (c.c_void_p, handle_p),
        "nvjpegJpegStateDestroy": (c.c_void_p,),
        "nvjpegGetHardwareDecoderInfo": (c.c_void_p, c.POINTER(c.c_uint), c.POINTER(c.c_uint)),
        "nvjpegDecodeBatchedInitialize": (c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_int),
        "nvjpegDecodeBatched": (c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise AttributeError(f"{name} missing from nvJPEG")
        fn.argtypes = list(argtypes)
        fn.restype = c.c_int


def library():
    """Load libnvjpeg once; raises ``GpuUnavailableError`` saying what to install."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for candidate in _candidates():
            try:
                lib = ctypes.CDLL(candidate)
            except OSError as e:
                tried.append(f"{candidate} ({e})")
                continue
            _bind(lib)
            _lib = lib
            _lib.path = candidate
            log.info("nvJPEG loaded from %s", candidate)
            return lib
        raise GpuUnavailableError(f"nvJPEG library not found; {_INSTALL_HINT} (tried: {'; '.join(tried[:4])})")


def _check(call, status):
    if status != 0:
        raise NvjpegError(call, status)


def version():
    lib = library()
    parts = []
    for prop in (_MAJOR, _MINOR, _PATCH):
        value = ctypes.c_int()
        _check("nvjpegGetProperty", lib.nvjpegGetProperty(prop, ctypes.byref(value)))
        parts.append(value.value)
    return tuple(parts)


def image_dtype() -> np.dtype:
    """``nvjpegImage_t`` as a numpy record, so that a batch's array of them is filled without a
    Python loop: CUDA 13 headers declare ``size_t pitch[4]``, CUDA 12 ``unsigned int``."""
    pitch = np.uint64 if version()[0] >= 13 else np.uint32
    return np.dtype([("channel", np.uint64, _MAX_COMPONENT), ("pitch", pitch, _MAX_COMPONENT)], align=True)


class BatchedDecoder:
    """An nvJPEG handle and a decode state for one backend; decodes batches into RGB interleaved."""

    def __init__(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"nvJPEG backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.lib = library()
        self.backend = backend
        self.device_bitstreams = backend in DEVICE_BITSTREAM_BACKENDS
        self.handle = ctypes.c_void_p()
        self.state = ctypes.c_void_p()
        self._image_t = image_dtype()
        self._batch = 0
        self.interpolated = self._create(backend)
        try:
            _check("nvjpegJpegStateCreate", self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)))
        except NvjpegError:
            self.lib.nvjpegDestroy(self.handle)
            raise

    def _create(self, backend) -> bool:
        """Create the handle with the flags above; returns whether chroma is interpolated. The
        hardware backends are never created pipelined: a library that creates them only so is an
        error, a GPU without the engines an ``NvjpegError`` (as from any failed creation)."""
        required = FLAG_HW_DECODE_NO_PIPELINE if backend in HARDWARE_BACKENDS else 0
        status = None
        for optional in (FLAG_ENABLE_MEMORY_POOLS | FLAG_UPSAMPLING_WITH_INTERPOLATION,
                         FLAG_UPSAMPLING_WITH_INTERPOLATION, 0):
            status = self.lib.nvjpegCreateEx(BACKENDS[backend], None, None, required | optional,
                                             ctypes.byref(self.handle))
            if status == 0:
                return bool(optional & FLAG_UPSAMPLING_WITH_INTERPOLATION)
        if required and self.lib.nvjpegCreateEx(BACKENDS[backend], None, None, 0, ctypes.byref(self.handle)) == 0:
            self.lib.nvjpegDestroy(self.handle)
            self.handle = ctypes.c_void_p()
            raise GpuUnavailableError(f"this nvJPEG ({self.lib.path}) creates a {backend} decoder only with its "
                                      f"pipeline on (no NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE), which can hang "
                                      f"beside training; nvJPEG 11.4 or newer has the flag")
        _check(f"nvjpegCreateEx({backend})", status)

    def hardware_info(self):
        """(engines, cores per engine) of the hardware decoder; raises where there is none."""
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        _check("nvjpegGetHardwareDecoderInfo",
               self.lib.nvjpegGetHardwareDecoderInfo(self.handle, ctypes.byref(engines), ctypes.byref(cores)))
        return engines.value, cores.value

    def decode(self, data_ptrs, lengths, out_ptrs, pitches, stream: int):
        """Decode ``len(data_ptrs)`` bitstreams (host or device pointers, per the backend) into the
        RGB interleaved buffers at ``out_ptrs`` (row pitch ``pitches``), on CUDA ``stream``."""
        n = len(data_ptrs)
        if n != self._batch:
            _check("nvjpegDecodeBatchedInitialize",
                   self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, n, 1, OUTPUT_RGBI))
            self._batch = n
        # numpy arrays the call reads through their addresses (kept alive by these names until it returns)
        data = np.ascontiguousarray(data_ptrs, dtype=np.uint64)
        sizes = np.ascontiguousarray(lengths, dtype=np.uint64)
        images = np.zeros(n, self._image_t)
        images["channel"][:, 0] = out_ptrs
        images["pitch"][:, 0] = pitches
        with stall.native("nvjpegDecodeBatched"):
            status = self.lib.nvjpegDecodeBatched(self.handle, self.state, data.ctypes.data, sizes.ctypes.data,
                                                  images.ctypes.data, ctypes.c_void_p(stream))
        if status != 0:
            self._batch = 0  # nvJPEG asks for a re-initialisation after a failed batch
            raise NvjpegError("nvjpegDecodeBatched", status)

    def close(self):
        if self.state:
            self.lib.nvjpegJpegStateDestroy(self.state)
            self.state = ctypes.c_void_p()
        if self.handle:
            self.lib.nvjpegDestroy(self.handle)
        self.handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def library_info() -> dict:
    """What ``gdsdata doctor`` shows about nvJPEG."""
    lib = library()
    info = {"nvjpeg": f"{'.'.join(map(str, version()))} ({lib.path})"}
    try:
        decoder = BatchedDecoder("hardware")
        engines, cores = decoder.hardware_info()
        info["nvjpeg hardware decoder"] = f"{engines} engine(s) x {cores} core(s)"
        info["nvjpeg chroma upsampling"] = "interpolated" if decoder.interpolated else "replicated"
        decoder.close()
    except NvjpegError as e:
        info["nvjpeg hardware decoder"] = f"none ({e}); decoding uses the CUDA backend"
    return info
