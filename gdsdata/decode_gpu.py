"""Staging buffer -> pixels in GPU memory: nvJPEG batched decode for JPEG, nothing at all for raw.

The result is a ``batch.PixelBatch`` on the GPU. JPEGs decode into one arena allocated per batch and sized
from the width and height in the index (the device-bitstream backends parse nothing on the host).
Raw samples are used where they lie: in the device staging buffer, or in one upload of the pinned
staging buffer.
"""

import logging
import threading

import numpy as np
import torch

from . import format as fmt
from .batch import PixelBatch
from .errors import CorruptSampleError
from .nvjpeg import BatchedDecoder, NvjpegError

log = logging.getLogger(__name__)


class GpuDecoder:
    def __init__(self, index, device: torch.device, backend: str):
        self.index = index
        self.device = device
        self.backend = backend
        self._nvjpeg = None
        # One nvJPEG handle and state per dataset, and any thread may decode (two Loaders over one
        # dataset, __getitems__ beside a Loader): calls take turns, and a call on another stream
        # waits on the GPU for the previous one, whose work still uses the state's buffers.
        self._lock = threading.Lock()
        self._last = None  # (stream, event) of the previous decode

    @property
    def nvjpeg(self):
        if self._nvjpeg is None:
            with torch.cuda.device(self.device):
                self._nvjpeg = BatchedDecoder(self.backend)
        return self._nvjpeg

    def decode(self, staging: torch.Tensor, plan, indices, stream) -> PixelBatch:
        """Decode the samples ``indices`` whose payloads ``plan`` placed in ``staging``."""
        records = self.index.samples[np.asarray(indices, dtype=np.int64)]
        heights = records["height"].astype(np.int64)
        widths = records["width"].astype(np.int64)
        codecs = records["codec"]
        if np.all(codecs == fmt.CODEC_RAW):
            return self._raw(staging, plan, records, heights, widths, stream)
        if not np.all(codecs == fmt.CODEC_JPEG):  # a batch is all JPEG or all raw (one codec a pack)
            bad = int(np.flatnonzero(codecs != fmt.CODEC_JPEG)[0])
            raise CorruptSampleError(f"{self.index.describe(indices[bad])}: codec {codecs[bad]} in a batch of "
                                     f"JPEGs (a dataset holds one codec)")
        sizes = heights * widths * 3
        offsets = np.zeros(len(indices), np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        arena = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=self.device)
        base, out = staging.data_ptr(), arena.data_ptr()
        data = (base + plan.sample_offsets).tolist()
        lengths = plan.sample_lengths.tolist()
        outs = (out + offsets).tolist()
        pitches = (widths * 3).tolist()
        errors = {}
        with self._lock:
            if staging.is_cuda != self.nvjpeg.device_bitstreams:
                raise ValueError(f"nvJPEG backend {self.backend} cannot take bitstreams from "
                                 f"{'GPU' if staging.is_cuda else 'host'} memory")
            if self._last is not None and self._last[0] != stream:
                stream.wait_event(self._last[1])
            try:
                self.nvjpeg.decode(data, lengths, outs, pitches, stream.cuda_stream)
            except NvjpegError as batch_error:
                log.warning("batch decode failed (%s); retrying image by image to find the bad sample", batch_error)
                for k in range(len(indices)):
                    try:
                        self.nvjpeg.decode([data[k]], [lengths[k]], [outs[k]], [pitches[k]], stream.cuda_stream)
                    except NvjpegError as e:
                        errors[k] = CorruptSampleError(f"{self.index.describe(indices[k])}: GPU JPEG decoding "
                                                       f"failed ({e})")
            event = torch.cuda.Event()
            event.record(stream)
            self._last = (stream, event)
        return PixelBatch(arena, offsets, heights, widths, np.full(len(indices), 3), errors, owned=True)

    def _raw(self, staging, plan, records, heights, widths, stream):
        channels = records["components"].astype(np.int64)
        expected = heights * widths * channels
        bad = np.flatnonzero(expected != plan.sample_lengths)
        if len(bad):
            k = int(bad[0])
            raise CorruptSampleError(f"raw sample holds {plan.sample_lengths[k]} bytes, expected "
                                     f"{heights[k]}x{widths[k]}x{channels[k]}")
        if staging.is_cuda:
            buffer, owned = staging, False
        else:
            with torch.cuda.stream(stream):
                buffer, owned = staging.to(self.device, non_blocking=True), True
        return PixelBatch(buffer, plan.sample_offsets.copy(), heights, widths, channels, {}, owned)

    def close(self):
        with self._lock:
            if self._last is not None:
                self._last[1].synchronize()
                self._last = None
            if self._nvjpeg is not None:
                self._nvjpeg.close()
                self._nvjpeg = None
