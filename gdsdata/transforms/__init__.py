"""Batched augmentation over images of different sizes: random-resized-crop (or resize + centre
crop), horizontal flip, normalisation, in one pass.

The random parameters follow torchvision's ``RandomResizedCrop`` (scale, ratio, ten attempts, then a
centre crop with the ratio clamped) and are drawn from a counter-based hash of (seed, epoch, sample
index): the same sample gets the same crop and flip on any device, in any batch, on any rank (a
Loader hands the copies of a sample its ``indices=`` repeat keys of their own).

The pixels are resampled as torchvision v2's ``resized_crop`` does: the crop box, then bilinear
``interpolate(align_corners=False)``, antialiased by default (``antialias=False``: plain bilinear with
half-pixel centres clamped to the box); ``CenterCrop`` as its ``Resize`` then ``CenterCrop``: the
whole image resized, its centre block kept. On the GPU one Triton kernel does the whole batch
(``kernels``), computing only the pixels kept. On the CPU each image is cropped and resized on uint8
by torch's own kernel and flipped, the images of a batch in parallel on the CPU threads
(``settings`` cpu_threads); float32 is converted and normalised there too, image by image (other
dtypes: the batch at once, after). That is also the reference the GPU is tested against.

``dtype=None`` gives float16 on the GPU and float32 on the CPU (what a model there takes).
"""

import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gdsdata import stall
from gdsdata.args import is_integer
from gdsdata.decode.cpu import run_parallel

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
_ATTEMPTS = 10
WHOLE_LIMIT = 1 << 24  # pixels: past it CenterCrop's CPU path resizes the window its block covers, not the image


def _mix(x):
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices: Sequence[int], draws: int) -> np.ndarray:
    """len(indices) x draws uniforms in [0, 1), a pure function of (seed, epoch, index, draw)."""
    with np.errstate(over="ignore"):
        seed, epoch = int(seed) & (2**64 - 1), int(epoch) & (2**64 - 1)  # numpy integers too
        key = _mix(np.uint64(seed) ^ _mix(np.uint64(epoch) + np.uint64(0x9E3779B97F4A7C15)))
        idx = np.asarray(indices, dtype=np.uint64)[:, None]
        counter = idx * np.uint64(draws) + np.arange(draws, dtype=np.uint64)[None, :]
        bits = _mix(_mix(counter + key) ^ key)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class CropParams:
    """Per sample of a batch (int64 arrays): the window of the source image that is resampled
    (``top``, ``left``, ``height``, ``width``, in source pixels) and whether the output is flipped.
    The window resizes to ``resized_height`` x ``resized_width`` pixels, of which the output is the
    block at row ``out_top``, column ``out_left`` (each None: the output's size, 0: the window
    resizes to the output, as in ``RandomResizedCrop``). ``CenterCrop`` resizes the whole image and
    keeps its centre, as torchvision's ``Resize`` + ``CenterCrop`` do."""

    top: np.ndarray
    left: np.ndarray
    height: np.ndarray
    width: np.ndarray
    flip: np.ndarray  # bool
    resized_height: np.ndarray | None = None
    resized_width: np.ndarray | None = None
    out_top: np.ndarray | None = None
    out_left: np.ndarray | None = None


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size, scale, ratio, antialias)`` + ``RandomHorizontalFlip(p)``
    + ``Normalize``, batched.

    Parameters
    ----------
    size : int or (height, width)
        Output size.
    scale, ratio : (float, float)
        As torchvision's: the crop's share of the image area and its aspect ratio range.
    flip_p : float
        Probability of a horizontal flip.
    mean, std : 3 floats or None
        Per-channel normalisation on the 0-255 scale; None skips it (floats of 0-255; for floats of
        0-1, as torchvision's ``ToDtype(scale=True)`` gives, mean=(0, 0, 0), std=(255, 255, 255)).
        One None beside a value of your own for the other is refused (it would drop that value).
    dtype : str, torch.dtype or None
        "float16", "bfloat16", "float32" or "uint8", or the torch dtype of one of those names (uint8
        is never normalised); None: float16 on the GPU, float32 on the CPU.
    layout : str
        "NCHW" or "NHWC".
    antialias : bool
        Antialiased downscaling, torchvision v2's default.
    seed : int
        Crops and flips are a function of (seed, epoch, sample index).
    """

    size: object = 224
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: str = None
    layout: str = "NCHW"
    antialias: bool = True
    seed: int = 0

    def __post_init__(self):
        _validate(self)
        for name in ("scale", "ratio"):  # a tuple of two floats, as torchvision takes any pair: hashable
            value = getattr(self, name)
            try:
                pair = () if isinstance(value, (str, bytes, bytearray)) else \
                    tuple(float(v) for v in value if isinstance(v, numbers.Real))
                pair = pair if len(pair) == len(value) else ()
            except TypeError:
                pair = ()
            if len(pair) != 2 or not all(math.isfinite(v) for v in pair):
                raise TypeError(f"{name} must be a (low, high) pair of finite numbers, got {value!r}")
            object.__setattr__(self, name, pair)
        if not (0 < self.scale[0] <= self.scale[1]) or not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"scale and ratio must be increasing positive ranges, got scale={self.scale} "
                             f"ratio={self.ratio}")
        if not 0 <= self.flip_p <= 1:
            raise ValueError(f"flip_p must lie in [0, 1], got {self.flip_p}")
        if not is_integer(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def output_size(self) -> tuple:
        """(height, width) of the output images."""
        return _pair(self.size)

    def params(self, heights, widths, indices: Sequence[int], epoch: int = 0) -> CropParams:
        """The crop window and flip of each sample, as torchvision draws them.

        Parameters
        ----------
        heights, widths : array-like of int
            Each source image's size.
        indices : sequence of int
            The samples' indices in the dataset: with ``seed`` and ``epoch`` they fix the draw.
        epoch : int
            The epoch the batch belongs to.

        Returns
        -------
        CropParams
            Per sample: top, left, height, width of the window in the source image, and flip.
        """
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
    """Evaluation: torchvision's ``Resize(resize)`` (the shorter side) + ``CenterCrop(size)`` +
    ``Normalize``: the same pixels (on the CPU to the bit where torch resizes uint8 natively, as on
    x86 with AVX2 and on arm64; on a GPU within one level, computing only the centre's pixels).
    An image whose resized size would pass ``WHOLE_LIMIT`` pixels (at ``resize=256``, an aspect
    ratio over 256:1) is resampled on the CPU from the source window the centre covers, rounded to
    whole pixels (within a few levels), so that one odd image cannot take gigabytes there.

    Parameters
    ----------
    size : int or (height, width)
        Output size.
    resize : int, optional
        The shorter side before the centre crop; by default the crop's (longer) side / 0.875, rounded,
        as torchvision's ImageNet evaluation (256 for 224, 293 for 256).
    mean, std, dtype, layout, antialias
        As for ``RandomResizedCrop``.
    """

    size: object = 224
    resize: int = None
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: str = None
    layout: str = "NCHW"
    antialias: bool = True

    def __post_init__(self):
        _validate(self)
        if self.resize is None:
            object.__setattr__(self, "resize", round(max(_pair(self.size)) / 0.875))
        if not is_integer(self.resize) or self.resize <= 0:
            raise ValueError(f"resize must be a positive integer, got {self.resize!r}")
        if self.resize < max(_pair(self.size)):
            raise ValueError(f"resize ({self.resize}) is smaller than size {self.size}: torchvision's Resize + "
                             f"CenterCrop would pad the crop with zeros there; CenterCrop takes resize >= size")

    @property
    def output_size(self) -> tuple:
        return _pair(self.size)

    def params(self, heights, widths, indices: Sequence[int] | None = None, epoch: int = 0) -> CropParams:
        """The centre window of each sample (no randomness: ``indices`` and ``epoch`` are not used).

        Parameters
        ----------
        heights, widths : array-like of int
            Each source image's size.

        Returns
        -------
        CropParams
            Per sample: the whole image as the window, the size torchvision's ``Resize`` gives it,
            and the place of ``CenterCrop``'s block in that; flip False.
        """
        heights = np.asarray(heights, np.float64)
        widths = np.asarray(widths, np.float64)
        out_h, out_w = self.output_size
        # torchvision's Resize(resize): the shorter side to ``resize``, the longer truncated
        longer = np.floor(self.resize * np.maximum(heights, widths) / np.minimum(heights, widths))
        resized_h = np.where(heights <= widths, self.resize, longer)
        resized_w = np.where(heights <= widths, longer, self.resize)
        # its CenterCrop there: half the difference, rounded half to even (Python's round)
        zero = np.zeros(len(heights), np.int64)
        return CropParams(zero, zero, heights.astype(np.int64), widths.astype(np.int64), zero.astype(bool),
                          resized_h.astype(np.int64), resized_w.astype(np.int64),
                          np.round((resized_h - out_h) / 2).astype(np.int64),
                          np.round((resized_w - out_w) / 2).astype(np.int64))


def _pair(size) -> tuple:
    if is_integer(size):
        return int(size), int(size)
    if isinstance(size, (tuple, list)) and len(size) in (1, 2) and all(is_integer(v) for v in size):
        return int(size[0]), int(size[-1])  # ([224]: a square, as torchvision takes it)
    raise TypeError(f"size must be an int, a (height, width) pair of ints or [size], got {size!r}")


def dtype_named(t):
    """A transform's ``dtype`` given as a torch dtype (torch.float16 as well as "float16") made its name."""
    if isinstance(t.dtype, torch.dtype):
        object.__setattr__(t, "dtype", next((name for name, d in _DTYPES.items() if d == t.dtype), t.dtype))


def _validate(t):
    dtype_named(t)
    if t.dtype is not None and t.dtype not in _DTYPES:
        raise ValueError(f"dtype must be None or one of {', '.join(_DTYPES)}, got {t.dtype!r}")
    if t.layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be NCHW or NHWC, got {t.layout!r}")
    height, width = _pair(t.size)
    if isinstance(t.size, list):  # a tuple, as torchvision keeps it: hashable, not changed in place
        object.__setattr__(t, "size", tuple(int(v) for v in t.size))
    if height <= 0 or width <= 0:
        raise ValueError(f"size must be positive, got {t.size}")
    if not isinstance(t.antialias, bool):
        raise TypeError(f"antialias must be True or False, got {t.antialias!r}")
    for name in ("mean", "std"):  # checked here, as torchvision's Normalize does, not at the first batch
        value = getattr(t, name)
        if value is None:
            continue
        try:
            values = tuple(float(v) for v in value)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be 3 numbers (R, G, B on the 0-255 scale) or None, got {value!r}") from None
        if len(values) != 3 or not all(math.isfinite(v) for v in values):
            raise ValueError(f"{name} must hold 3 finite values (R, G, B on the 0-255 scale) or be None, "
                             f"got {value!r}")
        if name == "std" and 0 in values:
            raise ValueError(f"std holds a zero, got {value!r}: normalising divides by it; give each channel's "
                             f"spread on the 0-255 scale (ImageNet's: gdsdata.transforms.IMAGENET_STD), or "
                             f"mean=None, std=None to skip normalisation")
        object.__setattr__(t, name, values)
    # normalising takes both, as torchvision's Normalize does: one None beside the other's default skips
    # it, but one None beside a value of the caller's own would drop that value unsaid
    for given, missing, default in (("mean", "std", IMAGENET_MEAN), ("std", "mean", IMAGENET_STD)):
        value = getattr(t, given)
        if getattr(t, missing) is None and value is not None and value != tuple(map(float, default)):
            raise ValueError(f"{given}={value} given with {missing}=None: normalising takes both (each "
                             f"channel's mean and spread on the 0-255 scale), or mean=None, std=None to skip it")
    # either on the 0-1 scale is wrong on its own (mean=(0.485, ...) beside the default 0-255 std, say); a
    # zero mean and a unit std leave values as they are, and are said outright
    unit_mean = t.mean is not None and max(t.mean) <= 1 and t.mean != (0.0, 0.0, 0.0)
    unit_std = t.mean is not None and t.std is not None and max(t.std) <= 1 and t.std != (1.0, 1.0, 1.0)
    if unit_mean or unit_std:
        log.warning("mean=%s, std=%s: %s like values on the 0-1 scale (torchvision's Normalize after ToDtype "
                    "with scale=True); gdsdata normalises pixels of 0-255: ImageNet's are "
                    "gdsdata.transforms.IMAGENET_MEAN and IMAGENET_STD", t.mean, t.std,
                    "both look" if unit_mean and unit_std else "the mean looks" if unit_mean else "the std looks")


def output_dtype(transform, device: str | torch.device) -> torch.dtype:
    """The dtype ``transform`` produces on ``device``: its own, or float16 on CUDA, float32 elsewhere."""
    if transform.dtype is not None:
        return _DTYPES[transform.dtype]
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def _norm(transform, dtype):
    """(scale, shift) per channel so that out = v * scale + shift; identity for uint8 or no mean/std."""
    if dtype == torch.uint8 or transform.mean is None or transform.std is None:
        return (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)
    scale = tuple(1.0 / s for s in transform.std)
    return scale, tuple(-m / s for m, s in zip(transform.mean, transform.std))


def apply(transform, buffer: torch.Tensor, offsets, heights, widths, channels, params: CropParams) -> torch.Tensor:
    """Resample every image of a batch (interleaved uint8 pixels at ``offsets`` in the flat
    ``buffer``) into one output tensor, on the buffer's device."""
    n = len(offsets)
    out_h, out_w = transform.output_size
    device = buffer.device
    dtype = output_dtype(transform, device)
    nchw = transform.layout == "NCHW"
    meta = table(offsets, heights, widths, channels, params, (out_h, out_w))
    scale, shift = _norm(transform, dtype)
    if device.type == "cuda" and _triton_ready():
        out = torch.empty((n, 3, out_h, out_w) if nchw else (n, out_h, out_w, 3), dtype=dtype, device=device)
        if n:
            _resample_triton(buffer, meta, out, (out_h, out_w), scale, shift, nchw, transform.antialias)
        return out
    return _resample_torch(buffer, meta, (out_h, out_w), dtype, scale, shift, nchw, transform.antialias)


def table(offsets, heights, widths, channels, params: CropParams, size) -> np.ndarray:
    """The batch as the resampling takes it: an int64 row an image of offset, height, width,
    channels, the window (top, left, height, width), flip, the size the window resizes to and the
    output's place in that (``size``, the output's, and 0, 0 where ``params`` leave them out).
    Raises ValueError where the output's block does not lie inside the resized window (params
    made for another output size)."""
    n = len(offsets)

    def column(values, default):
        return np.full(n, default, np.int64) if values is None else np.asarray(values, np.int64)

    rows = np.stack([np.asarray(offsets, np.int64), np.asarray(heights, np.int64), np.asarray(widths, np.int64),
                     np.asarray(channels, np.int64), params.top, params.left, params.height, params.width,
                     params.flip.astype(np.int64), column(params.resized_height, size[0]),
                     column(params.resized_width, size[1]), column(params.out_top, 0), column(params.out_left, 0)],
                    axis=1).reshape(n, 13)
    outside = (rows[:, 11] < 0) | (rows[:, 11] + size[0] > rows[:, 9]) | (rows[:, 12] < 0) | \
        (rows[:, 12] + size[1] > rows[:, 10])
    if outside.any():
        k = int(np.argmax(outside))
        raise ValueError(f"crop parameters of image {k} put the {size[0]} x {size[1]} output at row "
                         f"{rows[k, 11]}, column {rows[k, 12]} of a {rows[k, 9]} x {rows[k, 10]} resized window: "
                         f"outside it (parameters made for another output size?)")
    return rows


def each_image(work, n: int, buffer):
    """``work(k)`` for each image k of a batch whose pixels are in ``buffer``: on the CPU threads in
    parallel (each k writes only its own image; torch's kernels release the GIL), on a GPU (without
    Triton) one after another."""
    if buffer.is_cuda:
        for k in range(n):
            work(k)
    else:
        with stall.native("CPU resampling on the cpu_threads pool"):
            run_parallel(work, n)


def _unnormalised(scale, shift) -> bool:
    """Whether v * scale + shift leaves the values as they are."""
    return scale == (1.0, 1.0, 1.0) and shift == (0.0, 0.0, 0.0)


def _normalise(values: torch.Tensor, dtype, scale, shift) -> torch.Tensor:
    """uint8 ``values`` (N x 3 x ...) converted to ``dtype`` and normalised: v * scale + shift."""
    out = values.to(dtype)
    if not _unnormalised(scale, shift):
        shape = (1, 3) + (1,) * (values.dim() - 2)
        out = out.mul_(torch.tensor(scale, dtype=dtype, device=values.device).view(shape))
        out = out.add_(torch.tensor(shift, dtype=dtype, device=values.device).view(shape))
    return out


def _resample_torch(buffer, meta, size, dtype, scale, shift, nchw, antialias):
    """Per image, on uint8: crop, ``interpolate(bilinear, align_corners=False, antialias)`` (torch's
    own kernel, torchvision v2's ``resized_crop``; CenterCrop: to the resized size, then its centre
    block), flip; the images on the CPU threads in parallel
    (torch's kernels release the GIL). float32 on the CPU: each image converted and normalised there
    too, by numpy (its multiply and add release the GIL: the same float32 operations as torch's, to
    the bit); else the whole batch at once."""
    n = len(meta)
    direct = dtype == torch.float32 and not buffer.is_cuda
    resized = torch.empty((n, 3, *size), dtype=dtype if direct else torch.uint8, device=buffer.device)
    if direct:
        target = resized.numpy()
        with np.errstate(all="ignore"):
            factors = [(np.float32(a), np.float32(b)) for a, b in zip(scale, shift)]
        plain = _unnormalised(scale, shift)
    rows = meta.tolist()  # Python ints once: numpy scalars a field at a time held the GIL per image
    buffer = buffer.contiguous()  # (a copy only of a strided buffer: the crops below assume unit steps)
    base = buffer.storage_offset()  # (as_strided counts from the storage's start, not the view's)

    def one(k):
        off, height, width, chans, top, left, crop_h, crop_w, flip, resized_h, resized_w, out_top, out_left = rows[k]
        whole = (resized_h, resized_w)
        if whole != size and resized_h * resized_w > WHOLE_LIMIT:  # an odd shape: the window its block covers
            (down, crop_h), (across, crop_w) = (_covered(crop_h, resized_h, out_top, size[0]),
                                                _covered(crop_w, resized_w, out_left, size[1]))
            top, left, whole = top + down, left + across, size
        # the crop window of the HWC image as a 1xCxHxW view, made in one call (the Python of each call holds the GIL)
        crop = buffer.as_strided((1, chans, crop_h, crop_w), (chans, 1, width * chans, chans),
                                 base + off + (top * width + left) * chans)
        if crop.is_cuda:  # CUDA's interpolate takes no uint8: in float32, rounded back (torchvision v2's way)
            value = torch.nn.functional.interpolate(crop.float(), size=whole, mode="bilinear", align_corners=False,
                                                    antialias=antialias)[0].round_().clamp_(0, 255).to(torch.uint8)
        else:
            value = torch.nn.functional.interpolate(crop, size=whole, mode="bilinear", align_corners=False,
                                                    antialias=antialias)[0]
        if whole != size:  # CenterCrop: the resized image's centre block
            value = value[:, out_top:out_top + size[0], out_left:out_left + size[1]]
        if flip:
            value = value.flip(-1)
        if not direct:
            resized[k] = value  # a gray image's one channel fills all three
            return
        levels = value.numpy()
        with np.errstate(all="ignore"):  # (an absurd mean or std overflows to inf, as in torch, without a warning)
            for c, (factor, offset) in enumerate(factors):
                np.copyto(target[k, c], levels[c if chans == 3 else 0], casting="unsafe")
                if not plain:
                    np.multiply(target[k, c], factor, out=target[k, c])
                    np.add(target[k, c], offset, out=target[k, c])

    with torch.no_grad():
        each_image(one, n, buffer)
        out = resized if direct or dtype == torch.uint8 else _normalise(resized, dtype, scale, shift)
    return out if nchw else out.permute(0, 2, 3, 1).contiguous()


def _covered(source: int, resized: int, start: int, out: int) -> tuple:
    """(first, count) of the ``source`` pixels under resized pixels [start, start + out) of
    ``resized``, each edge rounded to the nearest pixel edge; at least one pixel, inside."""
    scale = source / resized
    first = round(start * scale)
    count = min(max(round((start + out) * scale) - first, 1), source)
    return min(max(first, 0), source - count), count


_TRITON = None


def _triton_ready() -> bool:
    """Whether the GPU kernel can run (Triton importable); looked up once."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            from gdsdata.transforms import kernels as transforms_triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


def _resample_triton(buffer, meta, out, size, scale, shift, nchw, antialias):
    from gdsdata.transforms.kernels import resample

    resample(buffer, meta, out, size, scale, shift, nchw, antialias)
