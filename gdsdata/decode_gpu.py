"""Staging buffer -> pixels in GPU memory: nvJPEG batched decode for JPEG, nothing at all for raw.

The result is a ``batch.PixelBatch`` on the GPU. JPEGs decode into one arena allocated per batch and sized
from the width and height in the index (the device-bitstream backends parse nothing on the host).
Raw samples are used where they lie: in the device staging buffer, or in one upload of the pinned
staging buffer.
"""

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt
from .batch import PixelBatch
from .errors import CorruptSampleError
from .nvjpeg import BatchedDecoder, NvjpegError

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
    jpeg: bool = False
    data: np.ndarray = None  # uint64 bitstream addresses in the staging buffer
    lengths: np.ndarray = None  # uint64 bitstream lengths
    pitches: np.ndarray = None  # int64 output row pitches (width x 3)


class _State:
    """One nvJPEG decode state and the last GPU work queued with it (its buffers are in use until
    that work is done)."""

    def __init__(self, nvjpeg: BatchedDecoder):
        self.nvjpeg = nvjpeg
        self.last = None  # (stream, event) of its previous decode

    def wait_before(self, stream):
        """Make ``stream`` wait for the state's previous decode if that ran on another stream."""
        if self.last is not None and self.last[0] != stream:
            stream.wait_event(self.last[1])

    def done_on(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        self.last = (stream, event)


class GpuDecoder:
    """Decodes prepared batches on the GPU. One nvJPEG handle per dataset (the hardware engines take
    no second one) and a decode state per thread decoding at that moment: a Loader's decode threads
    call nvJPEG at the same time, each with its own state, and while one is between calls the other
    keeps the engines busy. A state is taken from a free list and handed back after the call, so
    there are never more states than threads decoding at once."""

    def __init__(self, index, device: torch.device, backend: str):
        self.index = index
        self.device = device
        self.backend = backend
        self._states = []  # every state made; the first one's handle is everyone's
        self._free = []
        self._lock = threading.Lock()  # guards the two lists

    def _take(self) -> _State:
        with self._lock:
            if self._free:
                return self._free.pop()
            with torch.cuda.device(self.device):
                owner = self._states[0].nvjpeg if self._states else None
                state = _State(BatchedDecoder(self.backend, share=owner))
            self._states.append(state)
            return state

    def _give(self, state: _State):
        with self._lock:
            self._free.append(state)

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
        return DecodeJob(list(indices), heights, widths, np.full(len(indices), 3), offsets, jpeg=True,
                         data=data, lengths=plan.sample_lengths.astype(np.uint64), pitches=(widths * 3))

    def decode(self, staging: torch.Tensor, job: "DecodeJob", stream) -> PixelBatch:
        """Queue the decode ``job`` (from ``prepare``) on ``stream``."""
        if not job.jpeg:
            return self._raw(staging, job, stream)
        arena = torch.empty(int((job.heights * job.pitches).sum()), dtype=torch.uint8, device=self.device)
        outs = np.uint64(arena.data_ptr()) + job.offsets.astype(np.uint64)
        errors = {}
        state = self._take()
        try:
            if staging.is_cuda != state.nvjpeg.device_bitstreams:
                raise ValueError(f"nvJPEG backend {self.backend} cannot take bitstreams from "
                                 f"{'GPU' if staging.is_cuda else 'host'} memory")
            state.wait_before(stream)
            try:
                state.nvjpeg.decode(job.data, job.lengths, outs, job.pitches, stream.cuda_stream)
            except NvjpegError as batch_error:
                log.warning("batch decode failed (%s); retrying image by image to find the bad sample", batch_error)
                for k in range(len(job.indices)):
                    try:
                        state.nvjpeg.decode(job.data[k:k + 1], job.lengths[k:k + 1], outs[k:k + 1],
                                            job.pitches[k:k + 1], stream.cuda_stream)
                    except NvjpegError as e:
                        errors[k] = CorruptSampleError(f"{self.index.describe(job.indices[k])}: GPU JPEG "
                                                       f"decoding failed ({e})")
            state.done_on(stream)
        finally:
            self._give(state)
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
            for state in reversed(self._states):  # the handle's owner last
                if state.last is not None:
                    state.last[1].synchronize()
                state.nvjpeg.close()
            self._states, self._free = [], []
