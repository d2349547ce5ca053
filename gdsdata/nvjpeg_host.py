"""Host Huffman decoding through nvJPEG's decoupled phases, driven from native code: the decode
assist's decoders (``decode_assist.py``).

``HostHuffmanDecoder`` decodes images one run at a time on the calling thread; ``HostDecodePool``
runs a batch's host phases on native threads. Both drive the phases (bound in ``nvjpeg.py``:
``nvjpegJpegStreamParse`` -> ``nvjpegDecodeJpegHost`` -> ``...TransferToDevice`` -> ``...Device``)
through ``_hostdecode.c``, built with the package where a C compiler is found, so that no thread
takes the interpreter lock per image.
"""

import ctypes
import threading
import time

from .errors import GpuUnavailableError
from .nvjpeg import BACKENDS, OUTPUT_RGBI, NvjpegError, _check, _Owner, _release, create_handle, library, version

_PHASES = {1: "nvjpegJpegStreamParse", 2: "nvjpegDecodeJpegHost", 3: "nvjpegDecodeJpegTransferToDevice",
           4: "nvjpegDecodeJpegDevice"}
_native = None
_native_lock = threading.Lock()


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
    with _native_lock:
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
                native.gds_pool_wait.argtypes = [v, v, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
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
        self.handle = ctypes.c_void_p()  # until create_handle: close() may run first
        self.decoder, self.params = ctypes.c_void_p(), ctypes.c_void_p()
        self._slots = []  # per slot: (state, pinned buffer, device buffer, parsed stream)
        self._states = (ctypes.c_void_p * slots)()
        self._jpegs = (ctypes.c_void_p * slots)()
        self._states_at, self._jpegs_at = ctypes.addressof(self._states), ctypes.addressof(self._jpegs)
        self.slot_wait_seconds = 0.0  # waiting for a bank's previous run
        self._bank = 0  # the bank the next run uses
        self._done = [None, None]  # per bank: a CUDA event after its last run's queued work
        self.handle, _ = create_handle(lib, "hybrid")
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
            self.native.gds_host_decode(ctypes.byref(self._fns), self.handle, self.decoder, self.params, states,
                                        jpegs, *[a.ctypes.data for a in run], stop - start, stream, self._pitch32,
                                        status.ctypes.data)
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

    def wait(self, stream, queue=True):
        """Wait for the submitted batch's host phases and queue its copies and kernels on ``stream``
        (a torch stream): (position -> NvjpegError for the images that failed, seconds from the
        submit to the end of the slowest part's host phases). ``queue=False`` queues nothing, for
        probes of the host phases alone (the images are then not decoded)."""
        arrays, status, n, banks = self._batch
        elapsed = ctypes.c_int64()
        self.native.gds_pool_wait(self.pool, stream.cuda_stream, int(queue), ctypes.byref(elapsed))
        self._batch = None
        for decoder, bank in banks if queue else ():
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
