"""Staging buffer -> pixels in GPU memory: nvJPEG batched decode for JPEG, nothing at all for raw.

The result is a ``batch.PixelBatch`` on the GPU. JPEGs decode into one arena allocated per batch and sized
from the width and height in the index (the device-bitstream backends parse nothing on the host).
Raw samples are used where they lie: in the device staging buffer, or in one upload of the pinned
staging buffer.
"""

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from gdsdata.format import layout as fmt
from gdsdata import stall
from gdsdata.batch import PixelBatch, gpu_empty
from gdsdata.errors import CorruptSampleError
from gdsdata._native.nvjpeg import HARDWARE_BACKENDS, BatchedDecoder, NvjpegError

log = logging.getLogger(__name__)


@dataclass
class DecodeJob:
    """A batch's decode, prepared on the host: per sample its pixels' size and place in the output,
    and for JPEG nvJPEG's arguments (bitstream addresses and lengths, output row pitches)."""

    indices: list
    heights: np.ndarray  # int64 per sample
    widths: np.ndarray
    channels: np.ndarray
    offsets: np.ndarray  # int64 per sample: start of its pixels in the output (raw: in staging)
    data: np.ndarray = None  # JPEG: uint64 bitstream addresses in the staging buffer (raw: None)
    lengths: np.ndarray = None  # uint64 bitstream lengths
    pitches: np.ndarray = None  # int64 output row pitches (width x 3)

    @property
    def jpeg(self) -> bool:
        return self.data is not None


class _SharedDecoder:
    """The process's one nvJPEG decoder for a GPU and backend, shared by every dataset on it: the
    hardware engines take one handle (a second handle or state decoding at the same time fails or
    hangs: docs/design.md). Any thread may decode (two datasets,
    two Loaders over one dataset, ``__getitems__`` beside a Loader): calls take turns under
    ``lock``, and a call on another stream waits on the GPU for the previous one, whose work still
    uses the state's buffers. It outlives the datasets that use it (creating a hardware decoder
    takes most of a second, which a fresh dataset would otherwise pay on its first batch), until
    the interpreter exits."""

    _open = {}  # (device index, backend) -> _SharedDecoder
    _open_lock = threading.Lock()

    def __init__(self, key):
        self.key, self.users = key, 0  # users: the datasets decoding with it now
        self.pid = os.getpid()  # a forked child inherits the map, not the decoder
        self.lock = threading.Lock()
        self.last = None  # (stream, event) of the previous decode
        with torch.cuda.device(key[0]):
            self.nvjpeg = BatchedDecoder(key[1])

    @classmethod
    def acquire(cls, device: torch.device, backend: str) -> "_SharedDecoder":
        with cls._open_lock:
            shared = cls._open.get((device.index, backend))
            if shared is None:
                shared = cls._open[(device.index, backend)] = cls((device.index, backend))
            shared.users += 1
            return shared

    def release(self):
        with self._open_lock:
            self.users -= 1

    @classmethod
    def close_idle(cls, timeout: float = 5.0):
        """Destroy this process's decoders that no dataset uses (at exit, while CUDA is still up:
        nvJPEG torn down with the interpreter's last objects could outlive the CUDA context). One
        still in use, or whose lock a thread stuck in a decode holds, is left to the process's end."""
        with cls._open_lock:
            idle = [shared for shared in cls._open.values() if not shared.users and shared.pid == os.getpid()]
            for shared in idle:
                del cls._open[shared.key]
        for shared in idle:
            if not shared.lock.acquire(timeout=timeout):
                continue
            try:
                if shared.last is not None:  # its last decode's GPU work still uses the state's buffers
                    stall.wait(shared.last[1], "waiting for the last nvJPEG decode before destroying its decoder",
                               timeout)
                shared.nvjpeg.close()
            except Exception:  # noqa: BLE001 - at exit: the process's end frees it
                pass
            finally:
                shared.lock.release()


def close_idle():
    """Destroy the process's idle nvJPEG decoders (the Loader's exit handler calls it once every
    pass has stopped)."""
    _SharedDecoder.close_idle()


class GpuDecoder:
    def __init__(self, index, device: torch.device, backend: str):
        self.index = index
        self.device = device
        self.backend = backend
        self._shared = None  # taken at the first decode, handed back by close()
        self._lock = threading.Lock()

    @property
    def shared(self) -> _SharedDecoder:
        with self._lock:
            if self._shared is None:
                self._shared = _SharedDecoder.acquire(self.device, self.backend)
            return self._shared

    def prepare(self, staging: torch.Tensor, plan, indices) -> "DecodeJob":
        """The host half of decoding the samples ``indices`` whose payloads ``plan`` placed in
        ``staging``: sizes, output offsets and nvJPEG's argument arrays, from the index. The I/O
        thread prepares a batch as it reads it, so the decode thread only calls nvJPEG."""
        records = self.index.samples[np.asarray(indices, dtype=np.int64)]
        heights = records["height"].astype(np.int64)
        widths = records["width"].astype(np.int64)
        codecs = records["codec"]
        if np.all(codecs == fmt.CODEC_RAW):
            channels = records["components"].astype(np.int64)
            bad = np.flatnonzero(heights * widths * channels != plan.sample_lengths)
            if len(bad):
                k = int(bad[0])
                raise CorruptSampleError(f"{self.index.describe(indices[k])}: raw sample holds "
                                         f"{plan.sample_lengths[k]} bytes, expected "
                                         f"{heights[k]}x{widths[k]}x{channels[k]}")
            return DecodeJob(list(indices), heights, widths, channels, plan.sample_offsets.copy())
        if not np.all(codecs == fmt.CODEC_JPEG):  # a batch is all JPEG or all raw (one codec a pack)
            bad = int(np.flatnonzero(codecs != fmt.CODEC_JPEG)[0])
            raise CorruptSampleError(f"{self.index.describe(indices[bad])}: codec {codecs[bad]} in a batch of "
                                     f"JPEGs (a dataset holds one codec)")
        sizes = heights * widths * 3
        offsets = np.zeros(len(indices), np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        data = (np.uint64(staging.data_ptr()) + plan.sample_offsets.astype(np.uint64))
        return DecodeJob(list(indices), heights, widths, np.full(len(indices), 3), offsets, data=data,
                         lengths=plan.sample_lengths.astype(np.uint64), pitches=(widths * 3))

    def decode(self, staging: torch.Tensor, job: "DecodeJob", stream, ready=None) -> PixelBatch:
        """Queue the decode ``job`` (from ``prepare``) on ``stream``, after ``ready`` (a CUDA event:
        the staging's reads landed) where one is given.

        nvJPEG's hardware decode reads its bitstreams and writes its output as the call is made, not
        in the order of ``stream`` (docs/design.md, "The decode's output has a stream of its own"):
        for it ``ready`` is waited for on the host too, and the output is memory no queued work
        still uses (``gpu_empty``), marked used by ``stream``. ``gpu_hybrid`` works in the stream's
        order: its output is allocated on ``stream``, as torch expects."""
        hardware = job.jpeg and self.backend in HARDWARE_BACKENDS
        if ready is not None:
            stream.wait_event(ready)  # (also what a staging slot released after a failed wait goes by)
            if hardware:
                stall.wait(ready, "waiting for a batch's reads to land before nvJPEG's hardware decode")
        if not job.jpeg:
            return self._raw(staging, job, stream)
        errors = {}
        shared = self.shared
        size = int((job.heights * job.pitches).sum())
        # (bounded: a decode left stuck inside nvJPEG after a StallError holds it for good)
        with stall.held(shared.lock, "the GPU's JPEG decoder (another decode, inside nvJPEG)"):
            if hardware:  # (allocated under the lock: a decode waiting for a stuck one allocates nothing)
                arena = gpu_empty(size, self.device,
                                  "waiting for GPU memory's last users before nvJPEG's hardware decode")
                arena.record_stream(stream)
            else:
                with torch.cuda.stream(stream):
                    arena = torch.empty(size, dtype=torch.uint8, device=self.device)
            outs = np.uint64(arena.data_ptr()) + job.offsets.astype(np.uint64)
            nvjpeg = shared.nvjpeg
            if staging.is_cuda != nvjpeg.device_bitstreams:
                raise ValueError(f"nvJPEG backend {self.backend} cannot take bitstreams from "
                                 f"{'GPU' if staging.is_cuda else 'host'} memory")
            if shared.last is not None and shared.last[0] != stream:
                stream.wait_event(shared.last[1])
            try:
                nvjpeg.decode(job.data, job.lengths, outs, job.pitches, stream.cuda_stream)
            except NvjpegError as batch_error:
                log.warning("batch decode failed (%s); retrying image by image to find the bad sample", batch_error)
                for k in range(len(job.indices)):
                    try:
                        nvjpeg.decode(job.data[k:k + 1], job.lengths[k:k + 1], outs[k:k + 1],
                                      job.pitches[k:k + 1], stream.cuda_stream)
                    except NvjpegError as e:
                        errors[k] = CorruptSampleError(f"{self.index.describe(job.indices[k])}: GPU JPEG "
                                                       f"decoding failed ({e})")
            event = torch.cuda.Event()
            event.record(stream)
            shared.last = (stream, event)
        return PixelBatch(arena, job.offsets, job.heights, job.widths, job.channels, errors, owned=True)

    def _raw(self, staging, job, stream):
        if staging.is_cuda:
            buffer, owned = staging, False
        else:
            with torch.cuda.stream(stream):
                buffer, owned = staging.to(self.device, non_blocking=True), True
        return PixelBatch(buffer, job.offsets, job.heights, job.widths, job.channels, {}, owned)

    def close(self):
        with self._lock:
            shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()
