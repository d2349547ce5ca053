"""Batched augmentation over images of different sizes: random-resized-crop (or resize + centre
crop), horizontal flip, normalisation, in one pass.

The random parameters follow torchvision's ``RandomResizedCrop`` (scale, ratio, ten attempts, then a
centre crop with the ratio clamped) and are drawn from a counter-based hash of (seed, epoch, sample
index): the same sample gets the same crop and flip on any device, in any batch, on any rank.

The pixels are resampled bilinearly (half-pixel centres, clamped to the crop box: torchvision's crop
then ``interpolate(mode="bilinear", align_corners=False, antialias=False)``). On the GPU one Triton kernel
does the whole batch (``transforms_triton``); on the CPU, and as the reference the GPU is tested
against, torch's own crop and interpolate run image by image (``_resample_torch``).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from .batch import upload

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
_ATTEMPTS = 10


def _mix(x):
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices, draws: int) -> np.ndarray:
    """len(indices) x draws uniforms in [0, 1), a pure function of (seed, epoch, index, draw)."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed & (2**64 - 1)) ^ _mix(np.uint64(epoch & (2**64 - 1)) + np.uint64(0x9E3779B97F4A7C15)))
        idx = np.asarray(indices, dtype=np.uint64)[:, None]
        counter = idx * np.uint64(draws) + np.arange(draws, dtype=np.uint64)[None, :]
        bits = _mix(_mix(counter + key) ^ key)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class CropParams:
    top: np.ndarray  # int64
    left: np.ndarray
    height: np.ndarray
    width: np.ndarray
    flip: np.ndarray  # bool


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip(p) + Normalize,
    batched. ``mean``/``std`` are on the 0-255 scale; None skips normalisation. ``dtype``: float16,
    bfloat16, float32 or uint8 (uint8 never normalises). ``layout``: NCHW or NHWC."""

    size: int = 224
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: str = "float16"
    layout: str = "NCHW"
    seed: int = 0

    def __post_init__(self):
        _validate(self)

    def params(self, heights, widths, indices, epoch: int = 0) -> CropParams:
        heights = np.asarray(heights, np.float64)
        widths = np.asarray(widths, np.float64)
        n = len(heights)
        u = uniforms(self.seed, epoch, indices, 4 * _ATTEMPTS + 1)
        area = (heights * widths)[:, None]
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 0:_ATTEMPTS])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, _ATTEMPTS:2 * _ATTEMPTS])
        w = np.round(np.sqrt(target * aspect))
        h = np.round(np.sqrt(target / aspect))
        ok = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
        first = np.argmax(ok, axis=1)
        found = ok[np.arange(n), first]
        rows = np.arange(n)
        h_sel, w_sel = h[rows, first], w[rows, first]
        top = np.floor(u[rows, 2 * _ATTEMPTS + first] * (heights - h_sel + 1))
        left = np.floor(u[rows, 3 * _ATTEMPTS + first] * (widths - w_sel + 1))
        # Fallback (no attempt fitted): the largest centre crop whose ratio lies within `ratio`.
        in_ratio = widths / heights
        fw = np.where(in_ratio < self.ratio[0], widths, np.where(in_ratio > self.ratio[1],
                                                                 np.round(heights * self.ratio[1]), widths))
        fh = np.where(in_ratio < self.ratio[0], np.round(widths / self.ratio[0]),
                      np.where(in_ratio > self.ratio[1], heights, heights))
        h_out = np.where(found, h_sel, fh)
        w_out = np.where(found, w_sel, fw)
        top = np.where(found, top, (heights - fh) // 2)
        left = np.where(found, left, (widths - fw) // 2)
        flip = u[:, 4 * _ATTEMPTS] < self.flip_p
        return CropParams(top.astype(np.int64), left.astype(np.int64), h_out.astype(np.int64),
                          w_out.astype(np.int64), flip)


@dataclass(frozen=True)
class CenterCrop:
    """Evaluation: resize the shorter side to ``resize`` and take the centre ``size`` x ``size``
    (torchvision's Resize(resize) + CenterCrop(size)), normalised, as one resampling pass."""

    size: int = 224
    resize: int = 256
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: str = "float16"
    layout: str = "NCHW"

    def __post_init__(self):
        _validate(self)

    def params(self, heights, widths, indices=None, epoch: int = 0) -> CropParams:
        heights = np.asarray(heights, np.float64)
        widths = np.asarray(widths, np.float64)
        side = np.minimum(heights, widths) * self.size / self.resize  # source pixels the crop covers
        h = np.minimum(np.round(side), heights)
        w = np.minimum(np.round(side), widths)
        return CropParams(((heights - h) // 2).astype(np.int64), ((widths - w) // 2).astype(np.int64),
                          h.astype(np.int64), w.astype(np.int64), np.zeros(len(heights), bool))


def _validate(t):
    if t.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {t.dtype!r}")
    if t.layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be NCHW or NHWC, got {t.layout!r}")
    if t.size <= 0:
        raise ValueError(f"size must be positive, got {t.size}")


def _norm(transform):
    """(scale, shift) per channel so that out = v * scale + shift; identity for uint8 or no mean/std."""
    if transform.dtype == "uint8" or transform.mean is None or transform.std is None:
        return (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)
    scale = tuple(1.0 / s for s in transform.std)
    return scale, tuple(-m / s for m, s in zip(transform.mean, transform.std))


def apply(transform, buffer: torch.Tensor, offsets, heights, widths, channels, params: CropParams):
    """Resample every image of a batch (interleaved uint8 pixels at ``offsets`` in the flat
    ``buffer``) into one output tensor, on the buffer's device."""
    n, size = len(offsets), transform.size
    device = buffer.device
    meta = upload(torch.from_numpy(np.stack([np.asarray(offsets, np.int64), np.asarray(heights, np.int64),
                                             np.asarray(widths, np.int64), np.asarray(channels, np.int64),
                                             params.top, params.left, params.height, params.width,
                                             params.flip.astype(np.int64)], axis=1)), device)
    dtype = _DTYPES[transform.dtype]
    shape = (n, 3, size, size) if transform.layout == "NCHW" else (n, size, size, 3)
    out = torch.empty(shape, dtype=dtype, device=device)
    if n == 0:
        return out
    scale, shift = _norm(transform)
    if device.type == "cuda" and _triton_ready():
        _resample_triton(buffer, meta, out, size, scale, shift, transform.layout == "NCHW")
    else:
        _resample_torch(buffer, meta, out, size, scale, shift, transform.layout == "NCHW")
    return out


def _resample_torch(buffer, meta, out, size, scale, shift, nchw):
    """Per image: crop, ``interpolate(bilinear, align_corners=False, antialias=False)``, flip,
    normalise; torch's own kernels, exactly torchvision's crop-then-resize."""
    rows = meta.cpu().tolist()
    scale_t = torch.tensor(scale, dtype=torch.float32, device=buffer.device).view(3, 1, 1)
    shift_t = torch.tensor(shift, dtype=torch.float32, device=buffer.device).view(3, 1, 1)
    for k, (off, height, width, chans, top, left, crop_h, crop_w, flip) in enumerate(rows):
        pixels = buffer[off:off + height * width * chans].view(height, width, chans)
        crop = pixels[top:top + crop_h, left:left + crop_w].permute(2, 0, 1).to(torch.float32)
        if chans == 1:
            crop = crop.expand(3, crop_h, crop_w)
        value = torch.nn.functional.interpolate(crop[None], size=(size, size), mode="bilinear",
                                                align_corners=False, antialias=False)[0]
        if flip:
            value = value.flip(-1)
        if out.dtype != torch.uint8:
            value = value * scale_t + shift_t
        if out.dtype == torch.uint8:
            value = torch.clamp(torch.floor(value + 0.5), 0, 255)
        out[k] = value if nchw else value.permute(1, 2, 0)


_TRITON = None


def _triton_ready() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            from . import transforms_triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


def _resample_triton(buffer, meta, out, size, scale, shift, nchw):
    from .transforms_triton import resample

    resample(buffer, meta, out, size, scale, shift, nchw)
