"""The GPU kernels of the transforms: a whole batch of differently sized images in one launch per pass.

Each kernel reads an image's row of ``meta`` (offset, height, width, channels, top, left, crop
height, crop width, flip, the size the crop resizes to and the output's place in that, and the
image's place in the antialiased filter's intermediate buffer) and writes normalised values,
interpolating from the interleaved uint8 source. A crop resized to the output size is all of the
output (``RandomResizedCrop``); ``CenterCrop`` resizes the whole image and keeps a block of it, so
output pixel (y, x) is pixel (y + out_top, x + out_left) of the resized image: only those are
computed.

- ``_bilinear``: plain bilinear, half-pixel centres clamped to the box (``interpolate(bilinear,
  align_corners=False, antialias=False)``), one pass: program (n, b) writes output pixels
  [b*BLOCK, (b+1)*BLOCK) of image n, all three channels;
- ``_aa_rows`` then ``_aa_columns``: torch's antialiased bilinear (``antialias=True``, torchvision
  v2's default), a triangle filter whose support grows with the downscale factor, each axis's weights
  normalised, exactly the index and weight arithmetic of ``interpolate``'s CPU kernel. Separable, as
  torch computes it: the rows of the crop are filtered to the output width first (into float16
  planes of crop height x output width per image and channel), then its columns to the output
  height, so a pixel costs the taps of one axis plus the taps of the other rather than their
  product. A program computes a tile of whole output rows, so the filter's window along a row is
  worked out once for all the tile's rows, and every load and store of a tile row is contiguous.
  The taps go two at a time (six loads in flight before their sums, the sums in torch's order),
  the window's arithmetic in 32-bit integers, and where every image of a batch has three channels
  the row pass reads them at constant offsets.

The CPU reference the GPU tests compare with is ``transforms._resample_torch``.

``_detect`` samples a detection batch (``transforms.detection``: mosaic, affine, flips, letterbox,
HSV jitter) in one launch from a plan's tables; its CPU reference is that module's torch path.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from gdsdata.batch import upload

_BLOCK = 256
TILE = 512  # values an antialiasing program computes: whole output rows (2 of 224 px), with WARPS warps
WARPS = 4
META = tl.constexpr(14)  # columns of a ``meta`` row: the 13 of ``transforms.table``, the intermediate's offset


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
    row = meta + n * META
    return (tl.load(row + 0), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
            tl.load(row + 6).to(tl.float32), tl.load(row + 7).to(tl.float32), tl.load(row + 8))


@triton.jit
def _resized(meta, n):
    """Image ``n``'s resized height and width, and the output's top row and left column in that."""
    row = meta + n * META
    return (tl.load(row + 9).to(tl.float32), tl.load(row + 10).to(tl.float32), tl.load(row + 11).to(tl.float32),
            tl.load(row + 12).to(tl.float32))


@triton.jit
def _bilinear(src, meta, out, out_h, out_w, s0, s1, s2, b0, b1, b2,
              NCHW: tl.constexpr, TO_U8: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    pid = tl.program_id(1)
    off, width, chans, top, left, crop_h, crop_w, flip = _image(meta, n)
    resized_h, resized_w, out_top, out_left = _resized(meta, n)
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
    y0, y1, wy = _coords(top, crop_h, resized_h, fy + out_top)
    x0, x1, wx = _coords(left, crop_w, resized_w, fx + out_left)
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
    low = tl.maximum((center - support + 0.5).to(tl.int32), 0)  # truncation, as the C++ cast
    high = tl.minimum((center + support + 0.5).to(tl.int32), extent.to(tl.int32))
    return low, high - low, center, invscale


@triton.jit
def _taps(extent, size):
    """The most taps any output pixel has along an axis: 2 * support + 1, rounded up."""
    return (2.0 * tl.maximum(extent / size, 1.0) + 2.0).to(tl.int32)


@triton.jit
def _weight(k, low, size, center, invscale):
    """The triangle filter's weight of tap ``k`` (0 beyond the window)."""
    return tl.where(k < size, tl.maximum(1.0 - tl.abs((k + low - center + 0.5) * invscale), 0.0), 0.0)


@triton.jit
def _filter(start, stride, step, taps, low, size, center, invscale, mask, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The three channels' normalised triangle-filter sums along one axis for a ROWS x COLS tile: tap k
    of a pixel is at ``start + k * stride`` (its channels ``step`` apart), ``taps`` the most any pixel
    has; the window (``low``, ``size``, ``center``, ``invscale``) is a row or a column of the tile's,
    shared by the other axis. Two taps an iteration, their six loads issued before the sums, which
    add in tap order (a tap past ``taps`` weighs 0 and loads nothing: the sums are unchanged)."""
    acc0 = tl.zeros([ROWS, COLS], tl.float32)
    acc1 = tl.zeros([ROWS, COLS], tl.float32)
    acc2 = tl.zeros([ROWS, COLS], tl.float32)
    total = tl.zeros_like(center)
    for k in range(0, taps, 2):
        w = _weight(k, low, size, center, invscale)
        u = _weight(k + 1, low, size, center, invscale)
        p = start + k * stride
        q = p + stride
        inside = mask & (k < size)
        beyond = mask & (k + 1 < size)
        a0 = tl.load(p, mask=inside, other=0).to(tl.float32)
        a1 = tl.load(p + step, mask=inside, other=0).to(tl.float32)
        a2 = tl.load(p + 2 * step, mask=inside, other=0).to(tl.float32)
        b0 = tl.load(q, mask=beyond, other=0).to(tl.float32)
        b1 = tl.load(q + step, mask=beyond, other=0).to(tl.float32)
        b2 = tl.load(q + 2 * step, mask=beyond, other=0).to(tl.float32)
        total += w
        acc0 += w * a0
        acc1 += w * a1
        acc2 += w * a2
        total += u
        acc0 += u * b0
        acc1 += u * b1
        acc2 += u * b2
    norm = 1.0 / tl.maximum(total, 1e-20)
    return acc0 * norm, acc1 * norm, acc2 * norm


@triton.jit
def _aa_rows(src, meta, tmp, out_w, ROWS: tl.constexpr, COLS: tl.constexpr, RGB: tl.constexpr):
    """Pass 1: rows [b*ROWS, (b+1)*ROWS) of image n's crop filtered to ``out_w`` columns (flipped if
    asked) into ``tmp``, a plane per channel; programs past the crop's last row return at once.
    RGB: every image of the batch has three channels (their bytes at constant offsets)."""
    n = tl.program_id(0)
    first = tl.program_id(1) * ROWS
    off, width, chans, top, left, crop_h, crop_w, flip = _image(meta, n)
    rows = crop_h.to(tl.int32)
    if first >= rows:
        return
    base_tmp = tl.load(meta + n * META + 13)
    _, resized_w, _, out_left = _resized(meta, n)
    r = first + tl.arange(0, ROWS)[:, None]
    ox = tl.arange(0, COLS)[None, :]
    mask = (r < rows) & (ox < out_w)
    sx = tl.where(flip > 0, (out_w - 1) - ox, ox)
    xmin, xsize, xcenter, xinv = _axis(sx.to(tl.float32) + out_left, crop_w, resized_w)
    if RGB:  # compile-time constants: the channels' loads at immediate offsets
        chans = 3
        step = 1
    else:
        step = tl.where(chans == 3, 1, 0).to(tl.int64)
    start = src + off + (top + r).to(tl.int64) * (width * chans) + (left + xmin.to(tl.int64)) * chans
    v0, v1, v2 = _filter(start, chans, step, _taps(crop_w, resized_w), xmin, xsize, xcenter, xinv, mask,
                         ROWS, COLS)
    plane = rows.to(tl.int64) * out_w
    dest = tmp + base_tmp + r.to(tl.int64) * out_w + ox
    tl.store(dest, v0.to(tmp.dtype.element_ty), mask=mask)
    tl.store(dest + plane, v1.to(tmp.dtype.element_ty), mask=mask)
    tl.store(dest + 2 * plane, v2.to(tmp.dtype.element_ty), mask=mask)


@triton.jit
def _aa_columns(meta, tmp, out, out_h, out_w, s0, s1, s2, b0, b1, b2,
                NCHW: tl.constexpr, TO_U8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Pass 2: output rows [b*ROWS, (b+1)*ROWS) of image n, its ``tmp`` planes' columns filtered to
    ``out_h`` rows, normalised into ``out``."""
    n = tl.program_id(0)
    oy = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    ox = tl.arange(0, COLS)[None, :]
    crop_h = tl.load(meta + n * META + 6)
    base_tmp = tl.load(meta + n * META + 13)
    resized_h, _, out_top, _ = _resized(meta, n)
    mask = (oy < out_h) & (ox < out_w)
    extent = crop_h.to(tl.float32)
    ymin, ysize, ycenter, yinv = _axis(oy.to(tl.float32) + out_top, extent, resized_h)
    start = tmp + base_tmp + ymin.to(tl.int64) * out_w + ox
    v0, v1, v2 = _filter(start, out_w, crop_h * out_w, _taps(extent, resized_h), ymin, ysize, ycenter, yinv, mask,
                         ROWS, COLS)
    area = out_h * out_w
    idx = oy * out_w + ox
    _store(out, n, idx, area, 0, v0, mask, s0, b0, NCHW, TO_U8)
    _store(out, n, idx, area, 1, v1, mask, s1, b1, NCHW, TO_U8)
    _store(out, n, idx, area, 2, v2, mask, s2, b2, NCHW, TO_U8)


def _tile(out_w: int) -> tuple[int, int]:
    """(rows, columns) of the antialiased passes' tiles: whole output rows, about TILE values."""
    cols = triton.next_power_of_2(out_w)
    return max(1, TILE // cols), cols


def resample(buffer, meta: np.ndarray, out, size, scale, shift, nchw, antialias):
    """Resample the images ``meta`` (host int64 rows of ``transforms.table``) describes from
    ``buffer`` into ``out``, on the buffer's device and the current stream."""
    n = len(meta)
    out_h, out_w = size
    rows = meta[:, 6]
    places = np.zeros(n, np.int64)
    np.cumsum(rows[:-1] * out_w * 3, out=places[1:])
    table = upload(torch.from_numpy(np.ascontiguousarray(np.concatenate([meta, places[:, None]], axis=1))),
                   buffer.device)
    norm = (float(scale[0]), float(scale[1]), float(scale[2]), float(shift[0]), float(shift[1]), float(shift[2]))
    flags = {"NCHW": nchw, "TO_U8": out.dtype.is_floating_point is False}
    if not antialias:
        _bilinear[(n, triton.cdiv(out_h * out_w, _BLOCK))](buffer, table, out, out_h, out_w, *norm, **flags,
                                                            BLOCK=_BLOCK)
        return
    tile_rows, tile_cols = _tile(out_w)
    tiles = {"ROWS": tile_rows, "COLS": tile_cols, "num_warps": WARPS}
    tmp = torch.empty(int(rows.sum()) * out_w * 3, dtype=torch.float16, device=buffer.device)
    _aa_rows[(n, triton.cdiv(int(rows.max()), tile_rows))](buffer, table, tmp, out_w, **tiles,
                                                           RGB=bool((meta[:, 3] == 3).all()))
    _aa_columns[(n, triton.cdiv(out_h, tile_rows))](table, tmp, out, out_h, out_w, *norm, **flags, **tiles)


# --- detection: YoloAugment's and Letterbox's sampling, one launch a batch ---------------------------
SLOT = tl.constexpr(11)  # columns of a plan's slot row: source, x1a, y1a, x2a, y2a, padw, padh, w, h, w0, h0


@triton.jit
def _rint(v):
    """Round half to even, as torch.round."""
    r = tl.floor(v + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - v) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _mod(a, b):
    return a - b * tl.floor(a / b)


@triton.jit
def _from_hsv(hue, v8, chroma, n: tl.constexpr):
    k = _mod(hue + n, 6.0)
    return _rint(v8 - chroma * tl.minimum(tl.maximum(tl.minimum(k, 4.0 - k), 0.0), 1.0))


@triton.jit
def _bilerp(p, right, down, wx, wy, inside, pad):
    """One channel: bilinear between the pixels at p, p + right, p + down, p + down + right, rounded
    to 0..255 (``pad`` outside)."""
    v00 = tl.load(p, mask=inside, other=0).to(tl.float32)
    v01 = tl.load(p + right, mask=inside, other=0).to(tl.float32)
    v10 = tl.load(p + down, mask=inside, other=0).to(tl.float32)
    v11 = tl.load(p + down + right, mask=inside, other=0).to(tl.float32)
    upper = v00 + (v01 - v00) * wx
    lower = v10 + (v11 - v10) * wx
    value = tl.where(inside, upper + (lower - upper) * wy, pad)
    return tl.minimum(tl.maximum(_rint(value), 0.0), 255.0)


@triton.jit
def _detect(src, offsets, channels, inverse, centre, slots, gains, out, height, width, pad,
            HSV: tl.constexpr, TO_U8: tl.constexpr, BLOCK: tl.constexpr):
    """Program (n, b): output pixels [b*BLOCK, (b+1)*BLOCK) of image n. Each pixel maps through the
    image's inverse affine onto the canvas, picks its mosaic quadrant's slot (nearest pixel centres
    decide, as the placement's integer edges), and is sampled bilinearly from that slot's source,
    mapped canvas -> resized image -> source with half-pixel centres (as cv2.resize maps them);
    ``pad`` where no image lies. Then rounded, and HSV-jittered as ``detection._hsv`` computes it."""
    n = tl.program_id(0)
    area = height * width
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < area
    fx = (idx % width).to(tl.float32)
    fy = (idx // width).to(tl.float32)
    row = inverse + n * 6
    cx = tl.load(row + 0) * fx + tl.load(row + 1) * fy + tl.load(row + 2)
    cy = tl.load(row + 3) * fx + tl.load(row + 4) * fy + tl.load(row + 5)
    quadrant = (cx >= tl.load(centre + n * 2) - 0.5).to(tl.int32) + 2 * (cy >= tl.load(centre + n * 2 + 1) - 0.5).to(
        tl.int32)
    slot = slots + (n * 4 + quadrant) * SLOT
    source = tl.load(slot + 0, mask=mask, other=-1.0)
    x1a, y1a = tl.load(slot + 1, mask=mask, other=0.0), tl.load(slot + 2, mask=mask, other=0.0)
    x2a, y2a = tl.load(slot + 3, mask=mask, other=0.0), tl.load(slot + 4, mask=mask, other=0.0)
    padw, padh = tl.load(slot + 5, mask=mask, other=0.0), tl.load(slot + 6, mask=mask, other=0.0)
    w, h = tl.load(slot + 7, mask=mask, other=1.0), tl.load(slot + 8, mask=mask, other=1.0)
    w0, h0 = tl.load(slot + 9, mask=mask, other=1.0), tl.load(slot + 10, mask=mask, other=1.0)
    inside = mask & (source >= 0) & (cx > x1a - 0.5) & (cx < x2a - 0.5) & (cy > y1a - 0.5) & (cy < y2a - 0.5)
    sx = tl.minimum(tl.maximum((cx - padw + 0.5) * (w0 / tl.maximum(w, 1.0)) - 0.5, 0.0), w0 - 1.0)
    sy = tl.minimum(tl.maximum((cy - padh + 0.5) * (h0 / tl.maximum(h, 1.0)) - 0.5, 0.0), h0 - 1.0)
    x0, y0 = tl.floor(sx), tl.floor(sy)
    wx, wy = sx - x0, sy - y0
    s = tl.maximum(source, 0.0).to(tl.int64)
    ch = tl.load(channels + s, mask=inside, other=3)
    stride = w0.to(tl.int64) * ch  # (the source's row; ``width`` is the output's)
    first = tl.load(offsets + s, mask=inside, other=0) + y0.to(tl.int64) * stride + x0.to(tl.int64) * ch
    right = tl.where(x0 + 1.0 < w0, ch, 0)
    down = tl.where(y0 + 1.0 < h0, stride, 0)
    lane = tl.where(ch == 3, 1, 0).to(tl.int64)
    r = _bilerp(src + first, right, down, wx, wy, inside, pad)
    g = _bilerp(src + first + lane, right, down, wx, wy, inside, pad)
    b = _bilerp(src + first + 2 * lane, right, down, wx, wy, inside, pad)
    if HSV:  # OpenCV's 8-bit HSV, Ultralytics' lookup tables, back as OpenCV converts
        v = tl.maximum(tl.maximum(r, g), b)
        delta = v - tl.minimum(tl.minimum(r, g), b)
        s8 = tl.floor(delta * 255.0 / tl.maximum(v, 1.0) + 0.5)
        raw = tl.where(v == r, g - b, tl.where(v == g, b - r + 2.0 * delta, r - g + 4.0 * delta))
        h8 = tl.floor(raw * 30.0 / tl.maximum(delta, 1.0) + 0.5)
        h8 = tl.where(h8 < 0.0, h8 + 180.0, h8)
        h8 = tl.floor(_mod(h8 + (tl.load(gains + n * 3) - 1.0) * 180.0, 180.0))
        s8 = tl.floor(tl.minimum(tl.maximum(s8 * tl.load(gains + n * 3 + 1), 0.0), 255.0))
        v8 = tl.floor(tl.minimum(tl.maximum(v * tl.load(gains + n * 3 + 2), 0.0), 255.0))
        hue, chroma = h8 / 30.0, v8 * (s8 / 255.0)
        r, g, b = _from_hsv(hue, v8, chroma, 5.0), _from_hsv(hue, v8, chroma, 3.0), _from_hsv(hue, v8, chroma, 1.0)
    dest = out + n.to(tl.int64) * 3 * area + idx
    if TO_U8:
        tl.store(dest, r.to(out.dtype.element_ty), mask=mask)
        tl.store(dest + area, g.to(out.dtype.element_ty), mask=mask)
        tl.store(dest + 2 * area, b.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(dest, (r / 255.0).to(out.dtype.element_ty), mask=mask)
        tl.store(dest + area, (g / 255.0).to(out.dtype.element_ty), mask=mask)
        tl.store(dest + 2 * area, (b / 255.0).to(out.dtype.element_ty), mask=mask)


def sample_detection(buffer, offsets, channels, p, pad: int, hsv: bool, dtype) -> torch.Tensor:
    """A detection plan's ``p`` batch of images of ``p.size`` (NCHW, ``dtype``: uint8, or a float
    dtype for values in [0, 1]) from the decoded sources in ``buffer``, on its device and the
    current stream."""
    device = buffer.device
    n = len(p.inverse)

    def table(array, kind):
        return upload(torch.from_numpy(np.ascontiguousarray(array, dtype=kind)), device)

    height, width = p.size
    out = torch.empty((n, 3, height, width), dtype=dtype, device=device)
    _detect[(n, triton.cdiv(height * width, _BLOCK))](
        buffer.reshape(-1), table(offsets, np.int64), table(channels, np.int64), table(p.inverse, np.float32),
        table(p.centre, np.float32), table(p.slots, np.float32), table(p.hsv, np.float32), out, height, width,
        float(pad),
        HSV=hsv, TO_U8=not dtype.is_floating_point, BLOCK=_BLOCK)
    return out
