"""The GPU resampling kernel: one Triton launch for a whole batch of differently sized images.

Program (n, b) writes output pixels [b*BLOCK, (b+1)*BLOCK) of image n, all three channels: it reads
the image's crop box from ``meta`` (offset, height, width, channels, top, left, crop height, crop
width, flip), interpolates bilinearly from the interleaved uint8 source and writes normalised
values. The arithmetic is that of ``transforms._resample_torch``, which the GPU tests compare with.
"""

import triton
import triton.language as tl

_BLOCK = 1024


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
def _kernel(src, meta, out, size, s0, s1, s2, b0, b1, b2,
            NCHW: tl.constexpr, TO_U8: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    pid = tl.program_id(1)
    row_meta = meta + n * 9
    off = tl.load(row_meta + 0)
    width = tl.load(row_meta + 2)
    chans = tl.load(row_meta + 3)
    top = tl.load(row_meta + 4).to(tl.float32)
    left = tl.load(row_meta + 5).to(tl.float32)
    crop_h = tl.load(row_meta + 6).to(tl.float32)
    crop_w = tl.load(row_meta + 7).to(tl.float32)
    flip = tl.load(row_meta + 8)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < size * size
    oy = idx // size
    ox = idx % size
    fy = oy.to(tl.float32)
    fx = ox.to(tl.float32)
    fx = tl.where(flip > 0, (size - 1) - fx, fx)
    y0, y1, wy = _coords(top, crop_h, size, fy)
    x0, x1, wx = _coords(left, crop_w, size, fx)
    row = width * chans
    r0 = off + y0 * row
    r1 = off + y1 * row
    c0 = x0 * chans
    c1 = x1 * chans
    step = tl.where(chans == 3, 1, 0).to(tl.int64)
    area = size * size
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
        if TO_U8:
            result = tl.minimum(tl.maximum(tl.floor(value + 0.5), 0.0), 255.0)
        else:
            result = value * scale + shift
        if NCHW:
            dest = out + n.to(tl.int64) * 3 * area + c * area + idx
        else:
            dest = out + (n.to(tl.int64) * area + idx) * 3 + c
        tl.store(dest, result.to(out.dtype.element_ty), mask=mask)


def resample(buffer, meta, out, size, scale, shift, nchw):
    n = meta.shape[0]
    grid = (n, triton.cdiv(size * size, _BLOCK))
    _kernel[grid](buffer, meta, out, size, float(scale[0]), float(scale[1]), float(scale[2]),
                  float(shift[0]), float(shift[1]), float(shift[2]),
                  NCHW=nchw, TO_U8=out.dtype.is_floating_point is False, BLOCK=_BLOCK)
