"""Batches between the stages of both paths: ``Staged`` (payloads in a staging buffer, after storage)
and ``PixelBatch`` (after decode): one flat uint8 buffer of interleaved pixels plus, per sample, where
its pixels start and their height, width and channel count. The transforms read a PixelBatch
directly, whatever the image sizes, on the CPU (``backends.cpu``) or the GPU (``decode.gpu``).

A GPU JPEG batch decoded for the crop transform holds each image as its JPEG planes instead
(``PixelBatch.planes``): luma, then the two chroma planes at their own subsampled size, converted
to RGB by the transform kernel as it samples them (``planar_rgb`` is the same conversion in torch).
"""

from dataclasses import dataclass

import numpy as np
import torch


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (labels, per-sample parameters) onto ``device``, queued on the current
    stream. A copy from pageable memory would first wait for all work on that stream (a decode still
    running); through pinned memory from torch's caching host allocator it does not."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


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
    # planar YCbCr pixels: int64 rows (Cb offset, Cr offset, chroma width, chroma height, horizontal
    # and vertical subsampling factor), the luma plane at ``offsets``; None: interleaved RGB (or gray)
    planes: np.ndarray = None

    def __len__(self):
        return len(self.offsets)

    def image(self, k: int) -> torch.Tensor:
        """Sample k as a uint8 CHW RGB tensor: a view of the batch's own buffer, or a copy when the
        buffer is a staging buffer that will be reused (or holds planes)."""
        h, w, c, o = int(self.heights[k]), int(self.widths[k]), int(self.channels[k]), int(self.offsets[k])
        if self.planes is not None:
            return planar_rgb(self.buffer, o, h, w, c, self.planes[k]).permute(2, 0, 1)
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
            them any more). A staging buffer is reused only once that work is done.
        """
        if self.release_fn is not None:
            self.release_fn(stream)
            self.release_fn = None


# JFIF's YCbCr -> RGB (ITU-R BT.601, full range), as libjpeg and nvJPEG convert
CR_R, CB_G, CR_G, CB_B = 1.402, 0.344136, 0.714136, 1.772


def chroma_planes(heights, widths, channels, subsampling_factors):
    """Per image the planar layout ``PixelBatch.planes`` describes, from the start of each image's
    luma plane (0): rows (Cb offset, Cr offset, chroma width, chroma height, horizontal and
    vertical factor), and each image's whole size in bytes. A gray image gets chroma planes of its
    own size too (the decoder may write them), which the conversion ignores."""
    heights, widths = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    hs, vs = (np.asarray(f, np.int64) for f in subsampling_factors)
    gray = np.asarray(channels) == 1
    hs, vs = np.where(gray, 1, hs), np.where(gray, 1, vs)
    cw, ch = -(-widths // hs), -(-heights // vs)
    luma = heights * widths
    planes = np.stack([luma, luma + cw * ch, cw, ch, hs, vs], axis=1)
    return planes, luma + 2 * cw * ch


def planar_rgb(buffer: torch.Tensor, offset: int, height: int, width: int, channels: int, plane) -> torch.Tensor:
    """One image of a planar batch as uint8 HWC RGB: chroma interpolated to each pixel bilinearly
    at its centre (libjpeg's "fancy" upsampling: weights 3/4 and 1/4 for a factor of two, edges
    repeated), then JFIF's conversion, rounded and clamped; the transform kernel computes the same."""
    y = buffer[offset:offset + height * width].view(height, width).float()
    if channels == 1:
        return y.round().clamp(0, 255).to(torch.uint8)[..., None].expand(height, width, 3)
    cb_at, cr_at, cw, ch, hs, vs = (int(v) for v in plane)

    def axis(n, factor, size):
        pos = ((torch.arange(n, device=buffer.device, dtype=torch.float32) + 0.5) / factor - 0.5).clamp(0, size - 1)
        low = pos.floor()
        return low.long(), (low + 1).clamp(max=size - 1).long(), pos - low

    y0, y1, wy = axis(height, vs, ch)
    x0, x1, wx = axis(width, hs, cw)

    def up(at):
        c = buffer[offset + at:offset + at + cw * ch].view(ch, cw).float()
        top = c[y0][:, x0] + (c[y0][:, x1] - c[y0][:, x0]) * wx
        bottom = c[y1][:, x0] + (c[y1][:, x1] - c[y1][:, x0]) * wx
        return top + (bottom - top) * wy[:, None] - 128.0

    cb, cr = up(cb_at), up(cr_at)
    rgb = torch.stack([y + CR_R * cr, y - CB_G * cb - CR_G * cr, y + CB_B * cb], dim=-1)
    return (rgb + 0.5).floor().clamp(0, 255).to(torch.uint8)


def interleaved(buffer: torch.Tensor, offsets, heights, widths, channels, planes):
    """A planar batch's pixels as interleaved RGB: (buffer, offsets, channels) of a new buffer."""
    images = [planar_rgb(buffer, int(o), int(h), int(w), int(c), plane).reshape(-1)
              for o, h, w, c, plane in zip(offsets, heights, widths, channels, planes)]
    sizes = np.asarray(heights, np.int64) * np.asarray(widths, np.int64) * 3
    starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    flat = torch.cat(images) if images else torch.empty(0, dtype=torch.uint8, device=buffer.device)
    return flat, starts, np.full(len(sizes), 3, np.int64)


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
