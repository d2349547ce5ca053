"""A small typed ctypes binding to nvJPEG's batched decoder.

No Python library exposes nvJPEG's device-bitstream backends (HARDWARE_DEVICE, GPU_HYBRID_DEVICE),
so gdsdata binds the library from NVIDIA's wheels itself: ``nvidia-nvjpeg`` (CUDA 13,
``nvidia/cu13/lib/libnvjpeg.so.13``) or ``nvidia-nvjpeg-cu12`` (``nvidia/nvjpeg/lib/libnvjpeg.so.12``).
Only what the batched flow needs is bound:

    nvjpegCreateEx -> nvjpegJpegStateCreate -> nvjpegDecodeBatchedInitialize (per batch size)
    -> nvjpegDecodeBatched(handle, state, data[], lengths[], images[], stream)

and decoding a window of each image (``rois``: the hardware backend only; ``nvjpegDecodeParams*``,
``nvjpegDecodeBatchedEx``; a probe of bench/decode_ceiling.py), and, for the decode assist
(``decode_assist.py``), decoding images one by one with the Huffman stage on a host thread
(``HostHuffmanDecoder``: the decoupled phases ``nvjpegJpegStreamParse`` -> ``nvjpegDecodeJpegHost``
-> ``...TransferToDevice`` -> ``...Device``, driven by the native loop of ``_hostdecode.c``).

Every status is checked and turned into ``NvjpegError`` with nvJPEG's name for it.
"""

import ctypes
import glob
import logging
import os
import threading
import time

from .errors import GpuUnavailableError

log = logging.getLogger(__name__)

BACKENDS = {"default": 0, "hybrid": 1, "gpu_hybrid": 2, "hardware": 3, "gpu_hybrid_device": 4, "hardware_device": 5}
DEVICE_BITSTREAM_BACKENDS = {"gpu_hybrid_device", "hardware_device"}
OUTPUT_RGBI = 5
# nvjpegCreateEx flag: upsample chroma with interpolation, as libjpeg's "fancy upsampling" does,
# rather than by replication; brings GPU pixels closer to the CPU decoders'.
FLAG_UPSAMPLING_WITH_INTERPOLATION = 1 << 5
_MAX_COMPONENT = 4
_STATUS = {
    0: "SUCCESS", 1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG", 4: "JPEG_NOT_SUPPORTED",
    5: "ALLOCATOR_FAILURE", 6: "EXECUTION_FAILED", 7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR",
    9: "IMPLEMENTATION_NOT_SUPPORTED", 10: "INCOMPLETE_BITSTREAM",
}
_MAJOR, _MINOR, _PATCH = 0, 1, 2  # libraryPropertyType
_INSTALL_HINT = ("install nvJPEG: pip install nvidia-nvjpeg (CUDA 13) or nvidia-nvjpeg-cu12 (CUDA 12), "
                 "or gdsdata[cu13] / gdsdata[cu12]; GDSDATA_NVJPEG_LIBRARY may name the library file")


class NvjpegError(RuntimeError):
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
        "nvjpegDecodeBatched": (c.c_void_p, c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t),
                                c.c_void_p, c.c_void_p),
        "nvjpegSetDeviceMemoryPadding": (c.c_size_t, c.c_void_p),
        "nvjpegSetPinnedMemoryPadding": (c.c_size_t, c.c_void_p),
    }
    optional = {  # windows (ROI) of a batch; older libraries may lack them
        "nvjpegDecodeParamsCreate": (c.c_void_p, handle_p),
        "nvjpegDecodeParamsDestroy": (c.c_void_p,),
        "nvjpegDecodeParamsSetOutputFormat": (c.c_void_p, c.c_int),
        "nvjpegDecodeParamsSetROI": (c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int),
        "nvjpegDecodeBatchedEx": (c.c_void_p, c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t),
                                  c.c_void_p, c.POINTER(c.c_void_p), c.c_void_p),
    }
    v = c.c_void_p
    optional.update({  # the decoupled phases: Huffman on a host thread, the rest on the GPU (HostHuffmanDecoder)
        "nvjpegDecoderCreate": (v, c.c_int, handle_p),
        "nvjpegDecoderDestroy": (v,),
        "nvjpegDecoderStateCreate": (v, v, handle_p),
        "nvjpegBufferPinnedCreate": (v, v, handle_p),
        "nvjpegBufferPinnedDestroy": (v,),
        "nvjpegBufferDeviceCreate": (v, v, handle_p),
        "nvjpegBufferDeviceDestroy": (v,),
        "nvjpegStateAttachPinnedBuffer": (v, v),
        "nvjpegStateAttachDeviceBuffer": (v, v),
        "nvjpegJpegStreamCreate": (v, handle_p),
        "nvjpegJpegStreamDestroy": (v,),
        "nvjpegJpegStreamParse": (v, v, c.c_size_t, c.c_int, c.c_int, v),
        "nvjpegDecodeJpegHost": (v, v, v, v, v),
        "nvjpegDecodeJpegTransferToDevice": (v, v, v, v, v),
        "nvjpegDecodeJpegDevice": (v, v, v, v, v),
    })
    for name, argtypes in [*signatures.items(), *optional.items()]:
        fn = getattr(lib, name, None)
        if fn is None and name in optional:
            continue
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


def image_struct():
    """``nvjpegImage_t``: CUDA 13 headers declare ``size_t pitch[4]``, CUDA 12 ``unsigned int``."""
    pitch = ctypes.c_size_t if version()[0] >= 13 else ctypes.c_uint

    class NvjpegImage(ctypes.Structure):
        _fields_ = [("channel", ctypes.c_void_p * _MAX_COMPONENT), ("pitch", pitch * _MAX_COMPONENT)]

    return NvjpegImage


def _release(lib, owner, attr, destroy):
    """Destroy the nvJPEG object held in ``owner.attr``, if any, with ``lib.<destroy>``."""
    if getattr(owner, attr):
        getattr(lib, destroy)(getattr(owner, attr))
        setattr(owner, attr, ctypes.c_void_p())


class _Owner:
    """Holds nvJPEG objects: ``close()`` destroys them, also when the holder is collected unclosed."""

    def close(self):
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class BatchedDecoder(_Owner):
    """One nvJPEG handle and decode state for one backend; decodes batches into RGB interleaved."""

    def __init__(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"nvJPEG backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.lib = library()
        self.backend = backend
        self.device_bitstreams = backend in DEVICE_BITSTREAM_BACKENDS
        self.handle = ctypes.c_void_p()
        self.state = ctypes.c_void_p()
        self._image_t = image_struct()
        self._batch = 0
        self._params = []  # nvjpegDecodeParams_t, one per image of a windowed batch
        self.interpolated = True
        status = self.lib.nvjpegCreateEx(BACKENDS[backend], None, None, FLAG_UPSAMPLING_WITH_INTERPOLATION,
                                         ctypes.byref(self.handle))
        if status != 0:  # a library or backend without the flag: plain upsampling
            self.interpolated = False
            status = self.lib.nvjpegCreateEx(BACKENDS[backend], None, None, 0, ctypes.byref(self.handle))
        _check(f"nvjpegCreateEx({backend})", status)
        try:
            _check("nvjpegJpegStateCreate", self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)))
        except NvjpegError:
            self.lib.nvjpegDestroy(self.handle)
            raise

    def hardware_info(self):
        """(engines, cores per engine) of the hardware decoder; raises where there is none."""
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        _check("nvjpegGetHardwareDecoderInfo",
               self.lib.nvjpegGetHardwareDecoderInfo(self.handle, ctypes.byref(engines), ctypes.byref(cores)))
        return engines.value, cores.value

    def decode(self, data_ptrs, lengths, out_ptrs, pitches, stream: int, rois=None):
        """Decode ``len(data_ptrs)`` bitstreams (host or device pointers, per the backend) into the
        RGB interleaved buffers at ``out_ptrs`` (row pitch ``pitches``), on CUDA ``stream``. With
        ``rois`` (one ``(x, y, width, height)`` per image), only that window of each image, into
        buffers of the window's size (``nvjpegDecodeBatchedEx``; the hardware backend)."""
        n = len(data_ptrs)
        if n != self._batch:
            _check("nvjpegDecodeBatchedInitialize",
                   self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, n, 1, OUTPUT_RGBI))
            self._batch = n
        data = (ctypes.c_void_p * n)(*data_ptrs)
        sizes = (ctypes.c_size_t * n)(*lengths)
        images = (self._image_t * n)()
        for k in range(n):
            images[k].channel[0] = out_ptrs[k]
            images[k].pitch[0] = pitches[k]
        if rois is None:
            call = "nvjpegDecodeBatched"
            status = self.lib.nvjpegDecodeBatched(self.handle, self.state, data, sizes, images,
                                                  ctypes.c_void_p(stream))
        else:
            call = "nvjpegDecodeBatchedEx"
            params = self._decode_params(n)
            for k, (x, y, w, h) in enumerate(rois):
                _check("nvjpegDecodeParamsSetROI", self.lib.nvjpegDecodeParamsSetROI(params[k], x, y, w, h))
            status = self.lib.nvjpegDecodeBatchedEx(self.handle, self.state, data, sizes, images, params,
                                                    ctypes.c_void_p(stream))
        if status != 0:
            self._batch = 0  # nvJPEG asks for a re-initialisation after a failed batch
            raise NvjpegError(call, status)

    def _decode_params(self, n):
        if getattr(self.lib, "nvjpegDecodeBatchedEx", None) is None:
            raise GpuUnavailableError(f"this nvJPEG ({self.lib.path}) cannot decode windows of a batch")
        while len(self._params) < n:
            params = ctypes.c_void_p()
            _check("nvjpegDecodeParamsCreate", self.lib.nvjpegDecodeParamsCreate(self.handle, ctypes.byref(params)))
            self._params.append(params)
            _check("nvjpegDecodeParamsSetOutputFormat", self.lib.nvjpegDecodeParamsSetOutputFormat(params, OUTPUT_RGBI))
        return (ctypes.c_void_p * n)(*[p.value for p in self._params[:n]])

    def close(self):
        for params in self._params:
            self.lib.nvjpegDecodeParamsDestroy(params)
        self._params = []
        _release(self.lib, self, "state", "nvjpegJpegStateDestroy")
        _release(self.lib, self, "handle", "nvjpegDestroy")


_PHASES = {1: "nvjpegJpegStreamParse", 2: "nvjpegDecodeJpegHost", 3: "nvjpegDecodeJpegTransferToDevice",
           4: "nvjpegDecodeJpegDevice"}
_native = None


class _NativeFns(ctypes.Structure):
    """``gds_nvjpeg_fns`` of ``_hostdecode.c``: the decoupled phases' entry points."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("parse", "host", "transfer", "device")]


class _NativePart(ctypes.Structure):
    """``gds_part`` of ``_hostdecode.c``: one pool thread's part of a batch."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("handle", "decoder", "params", "states", "jpeg_streams")] + [
        ("lo", ctypes.c_int), ("hi", ctypes.c_int)]


def _errors(status, count, base=0) -> dict:
    """Position -> NvjpegError for the native loop's non-zero statuses (1000 x phase + nvJPEG's)."""
    import numpy as np

    errors = {}
    for k in np.flatnonzero(status[:count]).tolist():
        phase, code = divmod(int(status[k]), 1000)
        errors[base + k] = NvjpegError(_PHASES.get(phase, "nvJPEG"), code)
    return errors


def native_loop():
    """The host Huffman loop of ``gdsdata/_hostdecode.c`` (built with the package where a C compiler
    was found), loaded with ctypes; raises ``GpuUnavailableError`` saying why it is missing."""
    global _native
    with _lib_lock:
        if _native is None:
            import importlib.util

            spec = importlib.util.find_spec("gdsdata._hostdecode")
            if spec is None or not spec.origin:
                _native = GpuUnavailableError("gdsdata's native host decoding loop was not built (no C compiler "
                                              "when gdsdata was installed)")
            else:
                native = ctypes.CDLL(spec.origin)
                v = ctypes.c_void_p
                native.gds_host_decode.argtypes = [ctypes.POINTER(_NativeFns), v, v, v, v, v, v, v, v, v,
                                                   ctypes.c_int, v, ctypes.c_int, v]
                native.gds_host_decode.restype = ctypes.c_int
                native.gds_pool_create.argtypes = [ctypes.c_int]
                native.gds_pool_create.restype = v
                native.gds_pool_submit.argtypes = [v, ctypes.POINTER(_NativeFns), v, v, v, v, v, ctypes.c_int, v]
                native.gds_pool_submit.restype = None
                native.gds_pool_wait.argtypes = [v, v, ctypes.POINTER(ctypes.c_int64)]
                native.gds_pool_wait.restype = ctypes.c_int
                native.gds_pool_destroy.argtypes = [v]
                native.gds_pool_destroy.restype = None
                _native = native
    if isinstance(_native, Exception):
        raise _native
    return _native


class HostHuffmanDecoder(_Owner):
    """JPEGs through nvJPEG's decoupled phases with the HYBRID decoder: Huffman decoding on the calling
    (host) thread, dequantisation, IDCT and colour conversion on the GPU. For decoding part of each
    batch beside the hardware engines on spare CPU cores; bitstreams in host memory.

    A run of images is one native call (``native_loop``), which holds no interpreter lock: every host
    phase, then the copies and kernels queued on the stream. Each image of a run has a slot of its
    own (decoder state, pinned and device buffers, parsed stream). The slots form two banks used in
    turn, up to ``slots // 2`` images a run: a run waits only for the queued work of the run before
    the previous one, so the thread does not wait for its kernels, which may queue behind other
    work on the GPU for a while."""

    def __init__(self, slots: int = 8):
        if slots < 2:
            raise ValueError(f"HostHuffmanDecoder needs at least 2 slots, got {slots}")
        self.native = native_loop()
        lib = self.lib = library()
        if getattr(lib, "nvjpegDecodeJpegHost", None) is None:
            raise GpuUnavailableError(f"this nvJPEG ({lib.path}) lacks the decoupled decoding phases")
        self._fns = _NativeFns(*[ctypes.cast(getattr(lib, _PHASES[k]), ctypes.c_void_p).value for k in (1, 2, 3, 4)])
        self._pitch32 = int(version()[0] < 13)
        self.handle, self.decoder, self.params = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._slots = []  # per slot: (state, pinned buffer, device buffer, parsed stream)
        self._states = (ctypes.c_void_p * slots)()
        self._jpegs = (ctypes.c_void_p * slots)()
        self._states_at, self._jpegs_at = ctypes.addressof(self._states), ctypes.addressof(self._jpegs)
        self.native_seconds = self.slot_wait_seconds = 0.0  # in the native loop / waiting for a bank
        self._bank = 0  # the bank the next run uses
        self._done = [None, None]  # per bank: a CUDA event after its last run's queued work
        status = lib.nvjpegCreateEx(BACKENDS["hybrid"], None, None, FLAG_UPSAMPLING_WITH_INTERPOLATION,
                                    ctypes.byref(self.handle))
        if status != 0:
            status = lib.nvjpegCreateEx(BACKENDS["hybrid"], None, None, 0, ctypes.byref(self.handle))
        _check("nvjpegCreateEx(hybrid)", status)
        try:
            _check("nvjpegDecoderCreate", lib.nvjpegDecoderCreate(self.handle, BACKENDS["hybrid"],
                                                                  ctypes.byref(self.decoder)))
            _check("nvjpegDecodeParamsCreate", lib.nvjpegDecodeParamsCreate(self.handle, ctypes.byref(self.params)))
            _check("nvjpegDecodeParamsSetOutputFormat", lib.nvjpegDecodeParamsSetOutputFormat(self.params, OUTPUT_RGBI))
            for k in range(slots):
                slot = [ctypes.c_void_p() for _ in range(4)]
                self._slots.append(slot)
                state, pinned, device, jpeg = slot
                _check("nvjpegDecoderStateCreate", lib.nvjpegDecoderStateCreate(self.handle, self.decoder,
                                                                                ctypes.byref(state)))
                _check("nvjpegBufferPinnedCreate", lib.nvjpegBufferPinnedCreate(self.handle, None,
                                                                                ctypes.byref(pinned)))
                _check("nvjpegBufferDeviceCreate", lib.nvjpegBufferDeviceCreate(self.handle, None,
                                                                                ctypes.byref(device)))
                _check("nvjpegStateAttachPinnedBuffer", lib.nvjpegStateAttachPinnedBuffer(state, pinned))
                _check("nvjpegStateAttachDeviceBuffer", lib.nvjpegStateAttachDeviceBuffer(state, device))
                _check("nvjpegJpegStreamCreate", lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(jpeg)))
                self._states[k], self._jpegs[k] = state.value, jpeg.value
        except NvjpegError:
            self.close()
            raise

    @property
    def run_size(self) -> int:
        """Images one native call takes: a bank's slots."""
        return len(self._states) // 2

    def claim(self):
        """The next bank for a run, once its previous run's copies and kernels have run: (bank,
        address of its states, address of its parsed streams)."""
        bank = self._bank
        self._bank ^= 1
        t0 = time.perf_counter()
        if self._done[bank] is not None:
            self._done[bank].synchronize()
        self.slot_wait_seconds += time.perf_counter() - t0
        offset = bank * self.run_size * ctypes.sizeof(ctypes.c_void_p)
        return bank, self._states_at + offset, self._jpegs_at + offset

    def queued(self, bank, stream):
        """The run on ``bank`` has queued its work on ``stream`` (a torch stream): mark the point."""
        import torch

        if self._done[bank] is None:
            self._done[bank] = torch.cuda.Event()
        self._done[bank].record(stream)  # also after a failed image: its copy may be queued

    def decode(self, data_ptrs, lengths, out_ptrs, pitches, stream: int):
        """Decode host bitstreams into RGB interleaved buffers on CUDA ``stream``, on this thread; the
        same arguments as ``BatchedDecoder.decode``. Returns when the last image's host phase is
        done, with the images that failed: position -> NvjpegError (the others are decoded)."""
        import numpy as np
        import torch

        recorder, errors, size = torch.cuda.ExternalStream(stream), {}, self.run_size
        status = np.zeros(size, np.int32)
        for start in range(0, len(data_ptrs), size):
            stop = min(start + size, len(data_ptrs))
            run = [np.asarray(values[start:stop], dtype=np.uint64)
                   for values in (data_ptrs, lengths, out_ptrs, pitches)]
            bank, states, jpegs = self.claim()
            t0 = time.perf_counter()
            self.native.gds_host_decode(ctypes.byref(self._fns), self.handle, self.decoder, self.params, states,
                                        jpegs, *[a.ctypes.data for a in run], stop - start, stream, self._pitch32,
                                        status.ctypes.data)
            self.native_seconds += time.perf_counter() - t0
            self.queued(bank, recorder)
            errors.update(_errors(status, stop - start, start))
        return errors

    def close(self):
        lib = self.lib
        for event in self._done:
            if event is not None:
                event.synchronize()
        self._done = [None, None]
        for state, pinned, device, jpeg in self._slots:
            for obj, destroy in ((state, "nvjpegJpegStateDestroy"), (pinned, "nvjpegBufferPinnedDestroy"),
                                 (device, "nvjpegBufferDeviceDestroy"), (jpeg, "nvjpegJpegStreamDestroy")):
                if obj:
                    getattr(lib, destroy)(obj)
        self._slots = []
        _release(lib, self, "params", "nvjpegDecodeParamsDestroy")
        _release(lib, self, "decoder", "nvjpegDecoderDestroy")
        _release(lib, self, "handle", "nvjpegDestroy")


class HostDecodePool(_Owner):
    """``threads`` native threads (``_hostdecode.c``'s pool), each with a ``HostHuffmanDecoder``,
    running the host phases of a batch's images in equal parts: ``submit`` hands them out and
    returns at once; ``wait(stream)`` returns once every host phase is done, having queued every
    image's copy and kernels on ``stream``. Neither the threads nor their nvJPEG calls take the
    interpreter lock; each thread's part is at most ``max_part`` images."""

    def __init__(self, threads: int, device, slots: int = 16):
        import torch

        self.native = native_loop()
        self.pool = None
        self.decoders = []
        with torch.cuda.device(device):
            self.decoders = [HostHuffmanDecoder(slots) for _ in range(threads)]
        self.pool = self.native.gds_pool_create(threads)
        if not self.pool:
            self.close()
            raise GpuUnavailableError(f"could not start {threads} native decoding threads")
        self._parts = (_NativePart * threads)()
        self._batch = None  # the submitted batch: arrays the threads read, banks they use

    @property
    def max_part(self) -> int:
        return self.decoders[0].run_size

    def submit(self, data_ptrs, lengths, out_ptrs, pitches):
        """Start the host phases of a batch (host bitstreams to be decoded into RGB interleaved
        buffers, as ``BatchedDecoder.decode`` takes them) on the threads. At most ``threads *
        max_part`` images."""
        import numpy as np

        n, threads = len(data_ptrs), len(self.decoders)
        if n > threads * self.max_part:
            raise ValueError(f"{n} images for {threads} threads of at most {self.max_part} each")
        arrays = [np.asarray(values, dtype=np.uint64) for values in (data_ptrs, lengths, out_ptrs, pitches)]
        status = np.zeros(max(1, n), np.int32)
        banks = []
        for t, decoder in enumerate(self.decoders):
            lo, hi = n * t // threads, n * (t + 1) // threads
            part = self._parts[t]
            part.lo, part.hi = lo, hi
            if hi > lo:
                bank, part.states, part.jpeg_streams = decoder.claim()
                part.handle, part.decoder = decoder.handle.value, decoder.decoder.value
                part.params = decoder.params.value
                banks.append((decoder, bank))
        fns = self.decoders[0]._fns
        self.native.gds_pool_submit(self.pool, ctypes.byref(fns), ctypes.addressof(self._parts),
                                    *[a.ctypes.data for a in arrays], self.decoders[0]._pitch32, status.ctypes.data)
        self._batch = (arrays, status, n, banks)

    def wait(self, stream):
        """Wait for the submitted batch's host phases and queue its copies and kernels on ``stream``
        (a torch stream): (position -> NvjpegError for the images that failed, seconds from the
        submit to the end of the slowest part's host phases)."""
        arrays, status, n, banks = self._batch
        elapsed = ctypes.c_int64()
        self.native.gds_pool_wait(self.pool, stream.cuda_stream, ctypes.byref(elapsed))
        self._batch = None
        for decoder, bank in banks:
            decoder.queued(bank, stream)
        return _errors(status, n), elapsed.value / 1e9

    def close(self):
        if self.pool:
            if self._batch is not None:
                import torch

                self.wait(torch.cuda.current_stream())
            self.native.gds_pool_destroy(self.pool)
            self.pool = None
        for decoder in self.decoders:
            decoder.close()
        self.decoders = []


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
