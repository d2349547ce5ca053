"""Batches between the stages of both paths: ``Staged`` (payloads in a staging buffer, after storage)
and ``PixelBatch`` (after decode): one flat uint8 buffer of interleaved pixels plus, per sample, where
its pixels start and their height, width and channel count. The transforms read a PixelBatch
directly, whatever the image sizes, on the CPU (``dataset._CpuBackend``) or the GPU (``decode_gpu``)."""

import threading
from dataclasses import dataclass

import numpy as np
import torch

from gdsdata import stall
from gdsdata._native.cuda import new_stream

_own_streams = {}  # device index -> gdsdata's own stream there (``own_stream``)
_own_streams_lock = threading.Lock()


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (labels, per-sample parameters) onto ``device``, queued on the current
    stream. A copy from pageable memory would first wait for all work on that stream (a decode still
    running); through pinned memory from torch's caching host allocator it does not."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """gdsdata's own stream of ``device``, made by the driver, outside torch's pool (which hands its
    streams round to every caller): nothing runs on it; memory is allocated there (``gpu_empty``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _own_streams_lock:
        if index not in _own_streams:
            _own_streams[index] = torch.cuda.ExternalStream(new_stream(index), device=torch.device("cuda", index))
        return _own_streams[index]


def gpu_empty(nbytes: int, device: torch.device, call: str) -> torch.Tensor:
    """``nbytes`` of GPU memory that no work queued on any stream still uses, for writers that ignore
    stream order: nvJPEG's hardware decode, which writes as the call is made (docs/design.md, "The
    decode's output has a stream of its own"), and reads into staging issued from the host.

    Allocated on ``own_stream``: torch's caching allocator hands out there only memory freed there,
    and a block that other streams used (``record_stream``) only once they finished with it. Then
    waited for on the host (``call`` names the wait), for an allocator that orders its frees on the
    stream instead (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``); with torch's own nothing is
    queued there and the wait returns at once."""
    own = own_stream(device)
    with torch.cuda.stream(own):
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stall.wait(own, call)
    return tensor


@dataclass
class PixelBatch:
    buffer: torch.Tensor  # uint8, on the CPU or the GPU
    offsets: np.ndarray  # int64 per sample: start of its pixels in buffer
    heights: np.ndarray
    widths: np.ndarray
    channels: np.ndarray  # 1 or 3 per sample
    errors: dict  # position -> CorruptSampleError for samples that failed to decode
    owned: bool  # False when buffer is a staging buffer that a later batch will reuse
    release_fn: object = None  # called with the stream once consumers have read buffer

    def __len__(self):
        return len(self.offsets)

    def image(self, k: int) -> torch.Tensor:
        """Sample k as a uint8 CHW RGB tensor: a view of the batch's own buffer, or a copy when the
        buffer is a staging buffer that will be reused."""
        h, w, c, o = int(self.heights[k]), int(self.widths[k]), int(self.channels[k]), int(self.offsets[k])
        pixels = self.buffer[o:o + h * w * c].view(h, w, c)
        if c == 1:
            pixels = pixels.expand(h, w, 3)
        pixels = pixels.permute(2, 0, 1)
        return pixels if self.owned else pixels.contiguous()

    def release(self, stream):
        """Say that the GPU work queued on ``stream`` so far is the last to read the buffer.

        Parameters
        ----------
        stream : torch.cuda.Stream or None
            The stream of the last work that reads the pixels (None: nothing on the GPU reads
            them any more). A staging buffer is reused only once that work is done, and so is
            the batch's own buffer once it is freed (``record_stream``).
        """
        if stream is not None and self.owned and self.buffer.is_cuda:
            self.buffer.record_stream(stream)
        if self.release_fn is not None:
            self.release_fn(stream)
            self.release_fn = None


@dataclass
class Staged:
    """A batch whose payloads sit in a staging buffer, waiting for decode."""

    indices: list
    plan: object
    tensor: object  # the staging buffer: a torch tensor (GPU path) or numpy array (CPU path)
    slot: object  # the GPU path's staging slot, None on the CPU
    failed: dict  # position -> CorruptSampleError found before decoding (checksums)
    ready: object = None  # GPU path: a CUDA event the staged bytes wait on (reads still in flight), or None
    job: object = None  # GPU path: the decode's host half (``decode_gpu.DecodeJob``), prepared as it was read
    outputs: list = None  # the batch's own samples when it reads more than it yields (a mosaic's partners)
    asked: list = None  # the samples asked for, where replacements of bad ones were read instead (on_error="skip")
    copies: object = None  # per sample, how many earlier samples of the Loader's are the same (repeats), or None


def collate(samples):
    """torch DataLoader's ``collate_fn`` for a GDSDataset: ``(images, labels)`` with images stacked
    into one tensor when they all have the same shape (after a transform that resizes), else a
    list, and labels as an int64 tensor. A module-level function, so it pickles for worker
    processes under fork, spawn and forkserver.

    Parameters
    ----------
    samples : list of (torch.Tensor, int)
        What ``GDSDataset.__getitem__`` returns, one pair per sample.

    Returns
    -------
    (torch.Tensor or list of torch.Tensor, torch.Tensor)
        The images (stacked when their shapes agree) and the labels.
    """
    images = [image for image, _ in samples]
    labels = [label for _, label in samples]
    if images and all(isinstance(im, torch.Tensor) for im in images) and len({tuple(im.shape) for im in images}) == 1:
        images = torch.stack(images)
    if labels and all(isinstance(label, (int, np.integer)) for label in labels):
        labels = torch.tensor(labels, dtype=torch.int64)
    elif labels and all(isinstance(label, torch.Tensor) for label in labels):
        labels = torch.stack(labels)
    return images, labels
