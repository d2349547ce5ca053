"""The GPU resampling kernels: one Triton launch for a whole batch of differently sized images.

Program (n, b) writes output pixels [b*BLOCK, (b+1)*BLOCK) of image n, all three channels: it reads
the image's crop box from ``meta`` (offset, height, width, channels, top, left, crop height, crop
width, flip) and writes normalised values, interpolating from the interleaved uint8 source:

- ``_bilinear``: plain bilinear, half-pixel centres clamped to the box (``interpolate(bilinear,
  align_corners=False, antialias=False)``);
- ``_antialiased``: torch's antialiased bilinear (``antialias=True``, torchvision v2's default): a
  triangle filter whose support grows with the downscale factor, the weights of each output row and
  column normalised, exactly the index and weight arithmetic of ``interpolate``'s CPU kernel.

The CPU reference the GPU tests compare with is ``transforms._resample_torch``.
"""

import triton
import triton.language as tl

_BLOCK = 256


@triton.jit
def _coords(start, extent, size, pos):
    last = start + extent - 1.0
    coord = start + (pos + 0.5) * (extent / size) - 0.5
    coord = tl.minimum(tl.maximum(coord, start), last)
    low = tl.floor(coord)
    weight = coord - low
    high = tl.minimum(low + 1.0, last)
    return low.to(tl.int64), high.to(tl.int64), weight


@triton.jit
def _store(out, n, idx, area, c, value, mask, scale, shift, NCHW: tl.constexpr, TO_U8: tl.constexpr):
    if TO_U8:
        result = tl.minimum(tl.maximum(tl.floor(value + 0.5), 0.0), 255.0)
    else:
        result = value * scale + shift
    if NCHW:
        dest = out + n.to(tl.int64) * 3 * area + c * area + idx
    else:
        dest = out + (n.to(tl.int64) * area + idx) * 3 + c
    tl.store(dest, result.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _image(meta, n):
    """Image ``n``'s row of ``meta``: offset, width, channels, crop top, left, height, width, flip."""
    row = meta + n * 9
    return (tl.load(row + 0), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
            tl.load(row + 6).to(tl.float32), tl.load(row + 7).to(tl.float32), tl.load(row + 8))


@triton.jit
def _bilinear(src, meta, out, out_h, out_w, s0, s1, s2, b0, b1, b2,
              NCHW: tl.constexpr, TO_U8: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    pid = tl.program_id(1)
    off, width, chans, top, left, crop_h, crop_w, flip = _image(meta, n)
    top = top.to(tl.float32)
    left = left.to(tl.float32)
    area = out_h * out_w
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < area
    oy = idx // out_w
    ox = idx % out_w
    fy = oy.to(tl.float32)
    fx = ox.to(tl.float32)
    fx = tl.where(flip > 0, (out_w - 1) - fx, fx)
    y0, y1, wy = _coords(top, crop_h, out_h, fy)
    x0, x1, wx = _coords(left, crop_w, out_w, fx)
    row = width * chans
    r0 = off + y0 * row
    r1 = off + y1 * row
    c0 = x0 * chans
    c1 = x1 * chans
    step = tl.where(chans == 3, 1, 0).to(tl.int64)
    for c in tl.static_range(3):
        k = step * c
        v00 = tl.load(src + r0 + c0 + k, mask=mask, other=0).to(tl.float32)
        v01 = tl.load(src + r0 + c1 + k, mask=mask, other=0).to(tl.float32)
        v10 = tl.load(src + r1 + c0 + k, mask=mask, other=0).to(tl.float32)
        v11 = tl.load(src + r1 + c1 + k, mask=mask, other=0).to(tl.float32)
        top_row = v00 + (v01 - v00) * wx
        bottom_row = v10 + (v11 - v10) * wx
        value = top_row + (bottom_row - top_row) * wy
        if c == 0:
            scale, shift = s0, b0
        elif c == 1:
            scale, shift = s1, b1
        else:
            scale, shift = s2, b2
        _store(out, n, idx, area, c, value, mask, scale, shift, NCHW, TO_U8)


@triton.jit
def _axis(pos, extent, size):
    """torch's antialiased index arithmetic along one axis for output positions ``pos``: the first
    source index, the window length, the window centre, the inverse filter scale, and the taps."""
    scale = extent / size
    down = scale >= 1.0
    support = tl.where(down, scale, 1.0)
    invscale = tl.where(down, 1.0 / scale, 1.0)
    center = scale * (pos + 0.5)
    low = tl.maximum((center - support + 0.5).to(tl.int64), 0)  # truncation, as the C++ cast
    high = tl.minimum((center + support + 0.5).to(tl.int64), extent.to(tl.int64))
    return low, high - low, center, invscale


@triton.jit
def _antialiased(src, meta, out, out_h, out_w, s0, s1, s2, b0, b1, b2,
                 NCHW: tl.constexpr, TO_U8: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    pid = tl.program_id(1)
    off, width, chans, top, left, crop_h, crop_w, flip = _image(meta, n)
    area = out_h * out_w
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < area
    oy = idx // out_w
    ox = idx % out_w
    ox = tl.where(flip > 0, (out_w - 1) - ox, ox)
    ymin, ysize, ycenter, yinv = _axis(oy.to(tl.float32), crop_h, out_h)
    xmin, xsize, xcenter, xinv = _axis(ox.to(tl.float32), crop_w, out_w)
    # the most taps any pixel of this image has along each axis: 2 * support + 1, rounded up
    taps_y = (2.0 * tl.maximum(crop_h / out_h, 1.0) + 2.0).to(tl.int32)
    taps_x = (2.0 * tl.maximum(crop_w / out_w, 1.0) + 2.0).to(tl.int32)
    row = width * chans
    step = tl.where(chans == 3, 1, 0).to(tl.int64)
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    total_y = tl.zeros([BLOCK], tl.float32)
    total_x = tl.zeros([BLOCK], tl.float32)
    for k in range(0, taps_x):
        wx = tl.maximum(1.0 - tl.abs((k + xmin - xcenter + 0.5) * xinv), 0.0)
        total_x += tl.where(k < xsize, wx, 0.0)
    for j in range(0, taps_y):
        inside_y = j < ysize
        wy = tl.where(inside_y, tl.maximum(1.0 - tl.abs((j + ymin - ycenter + 0.5) * yinv), 0.0), 0.0)
        total_y += wy
        base = off + (top + ymin + j) * row
        for k in range(0, taps_x):
            inside = mask & inside_y & (k < xsize)
            wx = tl.where(k < xsize, tl.maximum(1.0 - tl.abs((k + xmin - xcenter + 0.5) * xinv), 0.0), 0.0)
            w = wy * wx
            p = src + base + (left + xmin + k) * chans
            acc0 += w * tl.load(p, mask=inside, other=0).to(tl.float32)
            acc1 += w * tl.load(p + step, mask=inside, other=0).to(tl.float32)
            acc2 += w * tl.load(p + 2 * step, mask=inside, other=0).to(tl.float32)
    norm = 1.0 / tl.maximum(total_y * total_x, 1e-20)
    _store(out, n, idx, area, 0, acc0 * norm, mask, s0, b0, NCHW, TO_U8)
    _store(out, n, idx, area, 1, acc1 * norm, mask, s1, b1, NCHW, TO_U8)
    _store(out, n, idx, area, 2, acc2 * norm, mask, s2, b2, NCHW, TO_U8)


def resample(buffer, meta, out, size, scale, shift, nchw, antialias):
    n = meta.shape[0]
    out_h, out_w = size
    grid = (n, triton.cdiv(out_h * out_w, _BLOCK))
    kernel = _antialiased if antialias else _bilinear
    kernel[grid](buffer, meta, out, out_h, out_w, float(scale[0]), float(scale[1]), float(scale[2]),
                 float(shift[0]), float(shift[1]), float(shift[2]),
                 NCHW=nchw, TO_U8=out.dtype.is_floating_point is False, BLOCK=_BLOCK)
