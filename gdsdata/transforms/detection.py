"""Detection batches: Ultralytics' YOLO training augmentation and its evaluation letterbox, batched.

``YoloAugment`` builds what Ultralytics' ``v8_transforms`` (8.4) builds for a training image
(mosaic of four images on a 2S canvas, random affine to S x S, HSV jitter, flips; with the mosaic
off, the affine centred on the image itself), with Ultralytics' default hyper-parameters
(``ultralytics/cfg/default.yaml``). Not included: MixUp, CutMix and CopyPaste (off by default) and
the Albumentations step Ultralytics adds when that package is installed. ``Letterbox`` is its
evaluation transform (the long side resized to S, centred on an S x S square).

How it is computed: every random draw is a pure function of (seed, epoch, index) (``uniforms``), and
a mosaic's partners come from its own batch, so a resumed or distributed run builds the same
batches. The geometry of each output image is planned on the host with Ultralytics' integer
arithmetic (placement, resize sizes, padding) and its box rules
(mosaic boxes clipped to the canvas, zero-area boxes dropped, corners through the affine, clipped to
the output, then ``box_candidates``: at least 2 pixels wide and high, at least 10 % of the box's
scaled area kept, aspect ratio under 100). So boxes are exactly what that arithmetic gives, on every
device. Pixels are then sampled once from the decoded source images (bilinear, pad value 114 where
no image lies) by torch operations on the batch's device: Ultralytics resizes each image first and
warps the resized canvas second, so pixels agree within interpolation differences, not exactly.
HSV jitter follows OpenCV's 8-bit HSV (hue in 0..179) and Ultralytics' lookup tables (8.3.79 on).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gdsdata.batch import upload
from gdsdata.transforms import uniforms

_DRAWS = 16  # uniforms per output image: 0 mosaic?, 1-3 partners, 4-5 centre, 6 angle, 7 scale,
#               8-9 shear, 10-11 translate, 12 flip lr, 13 flip ud, 14-15 spare; HSV gains below
_HSV_DRAWS = 3
TARGET_FORMS = ("torchvision", "ultralytics")


@dataclass(frozen=True)
class YoloAugment:
    """Ultralytics' YOLO training augmentation of a detection dataset's batches.

    Parameters
    ----------
    imgsz : int
        Output side S (images are S x S).
    epochs : int, optional
        The run's epochs: the mosaic is off for the last ``close_mosaic`` of them. None: never off.
    mosaic, close_mosaic, degrees, translate, scale, shear, fliplr, flipud, hsv_h, hsv_s, hsv_v
        Ultralytics' hyper-parameters of the same names, with its defaults. ``perspective`` is not
        offered (its default, 0, is what this computes).
    pad : int
        The value of pixels no image covers.
    seed : int
        Seed of every draw (with the epoch and the sample index).
    targets : {"torchvision", "ultralytics"}
        The batch form: ``(images, [target dict per image])`` or Ultralytics' batch dict.
    dtype : {None, "float16", "float32"}
        None: uint8 images (what Ultralytics' trainer takes, dividing by 255 itself); a float dtype
        gives values in [0, 1].
    """

    imgsz: int = 640
    epochs: int = None
    mosaic: float = 1.0
    close_mosaic: int = 10
    degrees: float = 0.0
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    fliplr: float = 0.5
    flipud: float = 0.0
    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    pad: int = 114
    seed: int = 0
    targets: str = "torchvision"
    dtype: str = None

    def __post_init__(self):
        _check_common(self)
        for name in ("mosaic", "fliplr", "flipud"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {value!r}")
        for name in ("degrees", "translate", "scale", "shear", "hsv_h", "hsv_s", "hsv_v"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)!r}")
        if self.translate > 0.5 or self.scale >= 1.0:
            raise ValueError(f"translate must be at most 0.5 and scale below 1, got {self.translate}, {self.scale}")
        if self.epochs is not None and (not isinstance(self.epochs, int) or self.epochs <= 0):
            raise ValueError(f"epochs must be a positive integer or None, got {self.epochs!r}")
        if not isinstance(self.close_mosaic, int) or self.close_mosaic < 0:
            raise ValueError(f"close_mosaic must be a non-negative integer, got {self.close_mosaic!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    def mosaic_on(self, epoch: int) -> bool:
        """Whether ``epoch`` (0-based) may use the mosaic (Ultralytics' ``close_mosaic`` switch)."""
        return self.mosaic > 0 and (self.epochs is None or epoch < self.epochs - self.close_mosaic)

    def sources(self, indices: Sequence[int], epoch: int, population: Sequence[int]) -> list[int]:
        """The samples a batch of outputs ``indices`` reads. A mosaic takes its three partners from
        the batch itself, as Ultralytics takes them from the images it loaded last (its buffer), so
        nothing more is read; a batch of fewer than 4 images reads them from ``population`` (the
        Loader's samples) after its own."""
        indices = list(indices)
        use, u = self._mosaics(indices, epoch)
        if len(indices) >= 4 or not use.any():
            return indices
        population = np.asarray(population, np.int64)
        picks = population[np.minimum((u[:, 1:4] * len(population)).astype(np.int64), len(population) - 1)]
        return indices + [int(p) for k in np.flatnonzero(use) for p in picks[k]]

    def members(self, indices: Sequence[int], epoch: int) -> list[list[int]]:
        """Per output, the positions in ``sources(...)`` of the images it is made of: itself, then a
        mosaic's three partners (draws 1-3 pick among the batch's other images)."""
        use, u = self._mosaics(indices, epoch)
        n, out, after = len(indices), [], len(indices)
        for k in range(n):
            if not use[k]:
                out.append([k])
            elif n >= 4:
                others = np.minimum((u[k, 1:4] * (n - 1)).astype(np.int64), n - 2)
                out.append([k] + [int(j + (j >= k)) for j in others])
            else:
                out.append([k, after, after + 1, after + 2])
                after += 3
        return out

    def _mosaics(self, indices, epoch):
        u = uniforms(self.seed, epoch, indices, _DRAWS)
        use = (u[:, 0] < self.mosaic) if self.mosaic_on(epoch) else np.zeros(len(indices), bool)
        return use, u


@dataclass(frozen=True)
class Letterbox:
    """Ultralytics' evaluation transform: the long side resized to ``imgsz`` (as its ``load_image``
    does, small images enlarged too), centred on an ``imgsz`` square padded with ``pad``.
    ``targets`` and ``dtype`` as for ``YoloAugment``."""

    imgsz: int = 640
    pad: int = 114
    targets: str = "torchvision"
    dtype: str = None

    def __post_init__(self):
        _check_common(self)

    def sources(self, indices: Sequence[int], epoch: int, population: Sequence[int]) -> list[int]:
        return list(indices)

    def members(self, indices: Sequence[int], epoch: int) -> list[list[int]]:
        return [[k] for k in range(len(indices))]


def _check_common(t):
    if not isinstance(t.imgsz, int) or isinstance(t.imgsz, bool) or t.imgsz < 32 or t.imgsz % 2:
        raise ValueError(f"imgsz must be an even integer of at least 32, got {t.imgsz!r}")
    if not isinstance(t.pad, int) or not 0 <= t.pad <= 255:
        raise ValueError(f"pad must be an integer in 0..255, got {t.pad!r}")
    if t.targets not in TARGET_FORMS:
        raise ValueError(f"targets must be one of {', '.join(TARGET_FORMS)}, got {t.targets!r}")
    if t.dtype not in (None, "float16", "float32"):
        raise ValueError(f"dtype must be None (uint8), 'float16' or 'float32', got {t.dtype!r}")


# --- the plan: geometry and boxes, on the host ------------------------------------------------------
@dataclass
class Plan:
    """A batch's geometry. Per output image n: ``inverse[n]`` (2x3) maps output pixel coordinates
    to canvas coordinates; ``centre[n]`` the mosaic centre (or a huge value: one slot). Per output
    and slot (4 a mosaic, 1 otherwise, as ``slots`` rows of n*4+q): the source's position in the
    decoded batch, its placed rectangle on the canvas (x1a, y1a, x2a, y2a), the shift from canvas to
    resized image (padw, padh), the resized size and the source size. ``boxes[n]`` XYXY output
    pixels and ``labels[n]`` after the box rules; ``hsv[n]`` the three gains (1 = unchanged)."""

    inverse: np.ndarray
    centre: np.ndarray
    slots: np.ndarray  # float64 rows: source, x1a, y1a, x2a, y2a, padw, padh, w, h, w0, h0 (source -1: empty)
    boxes: list
    labels: list
    hsv: np.ndarray
    shapes: list  # per output: ((h0, w0), ((ratio_h, ratio_w), (padw, padh)) or None)


def load_size(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """Ultralytics' ``load_image`` size: the long side to ``imgsz``, each side rounded up, at most imgsz."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def _letterbox_geometry(h, w, imgsz):
    """Ultralytics' ``LetterBox`` (centred, not ``auto``) of an image ``load_image`` sized (h, w):
    the unpadded size and the top-left padding on an imgsz square."""
    r = min(imgsz / h, imgsz / w, 1.0)  # 1 but for rounding: load_image made the long side imgsz
    new_w, new_h = int(round(w * r)), int(round(h * r))
    dw, dh = (imgsz - new_w) / 2, (imgsz - new_h) / 2
    return new_h, new_w, int(round(dw - 0.1)), int(round(dh - 0.1))


def _mosaic_slots(centre, sizes, s):
    """Ultralytics' ``_mosaic4`` placement: per image (h, w) its canvas rectangle and the shift."""
    xc, yc = centre
    out = []
    for q, (h, w) in enumerate(sizes):
        if q == 0:
            x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
            x1b, y1b = w - (x2a - x1a), h - (y2a - y1a)
        elif q == 1:
            x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, s * 2), yc
            x1b, y1b = 0, h - (y2a - y1a)
        elif q == 2:
            x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(s * 2, yc + h)
            x1b, y1b = w - (x2a - x1a), 0
        else:
            x1a, y1a, x2a, y2a = xc, yc, min(xc + w, s * 2), min(s * 2, yc + h)
            x1b, y1b = 0, 0
        out.append((x1a, y1a, x2a, y2a, x1a - x1b, y1a - y1b))
    return out


def _affine(t, u, size, canvas):
    """Ultralytics' ``RandomPerspective.affine_transform`` without perspective: M = T @ S @ R @ C for
    a ``canvas`` (w, h) warped to ``size`` x ``size``; returns M (3x3) and the scale drawn."""
    C = np.eye(3)
    C[0, 2], C[1, 2] = -canvas[0] / 2, -canvas[1] / 2
    angle = (2 * u[6] - 1) * t.degrees
    scale = 1 - t.scale + 2 * t.scale * u[7]
    a = math.radians(angle)
    R = np.eye(3)
    cos, sin = scale * math.cos(a), scale * math.sin(a)  # cv2.getRotationMatrix2D at (0, 0)
    R[0, 0], R[0, 1], R[1, 0], R[1, 1] = cos, sin, -sin, cos
    S = np.eye(3)
    S[0, 1] = math.tan(math.radians((2 * u[8] - 1) * t.shear))
    S[1, 0] = math.tan(math.radians((2 * u[9] - 1) * t.shear))
    T = np.eye(3)
    T[0, 2] = (0.5 - t.translate + 2 * t.translate * u[10]) * size
    T[1, 2] = (0.5 - t.translate + 2 * t.translate * u[11]) * size
    return T @ S @ R @ C, scale


def box_candidates(box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100, area_thr: float = 0.1,
                   eps: float = 1e-16) -> np.ndarray:
    """Ultralytics' rule for boxes that survive an augmentation: ``box1`` before (scaled), ``box2``
    after, both XYXY [K, 4]."""
    w1, h1 = box1[:, 2] - box1[:, 0], box1[:, 3] - box1[:, 1]
    w2, h2 = box2[:, 2] - box2[:, 0], box2[:, 3] - box2[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def _warp_boxes(boxes, M, size):
    """Box corners through M, the enclosing boxes clipped to [0, size]."""
    if not len(boxes):
        return boxes.reshape(0, 4)
    corners = np.ones((len(boxes) * 4, 3))
    corners[:, :2] = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(-1, 2)
    xy = (corners @ M.T)[:, :2].reshape(len(boxes), 8)
    x, y = xy[:, [0, 2, 4, 6]], xy[:, [1, 3, 5, 7]]
    out = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], axis=1)
    return np.clip(out, 0, size)


def plan(t: "YoloAugment | Letterbox", heights, widths, boxes: list, labels: list, indices: Sequence[int],
         epoch: int) -> Plan:
    """The geometry and the boxes of a batch of outputs ``indices`` whose sources (``t.sources``
    order; ``t.members`` says which make each output) have decoded sizes ``heights``/``widths`` and
    boxes ``boxes`` (XYXY fractions of the image, one [K, 4] array per source) with ``labels``."""
    n, s = len(indices), t.imgsz
    augment = isinstance(t, YoloAugment)
    u = uniforms(t.seed, epoch, indices, _DRAWS) if augment else np.zeros((n, _DRAWS))
    hsv_u = uniforms(t.seed ^ 0x5BD1E995, epoch, indices, _HSV_DRAWS) if augment else np.full((n, 3), 0.5)
    layout = t.members(indices, epoch)
    counts = [len(m) for m in layout]
    inverse = np.zeros((n, 2, 3))
    centre = np.full((n, 2), 1e9)
    slots = np.full((n * 4, 11), -1.0)
    out_boxes, out_labels, shapes = [], [], []
    for k in range(n):
        members = layout[k]
        sizes = [load_size(int(heights[m]), int(widths[m]), s) for m in members]
        placed = []
        if counts[k] == 4:
            xc, yc = int(s / 2 + u[k, 4] * s), int(s / 2 + u[k, 5] * s)  # uniform(-border, 2s + border)
            centre[k] = (xc, yc)
            rects = _mosaic_slots((xc, yc), sizes, s)
            canvas = (2 * s, 2 * s)
            shape_info = ((int(heights[k]), int(widths[k])), None)
        elif augment:  # no mosaic: the loaded image itself is the canvas the affine centres on
            h, w = sizes[0]
            rects = [(0, 0, w, h, 0, 0)]
            canvas = (w, h)
            shape_info = ((int(heights[k]), int(widths[k])), None)
        else:
            h, w = sizes[0]
            new_h, new_w, left, top = _letterbox_geometry(h, w, s)
            sizes = [(new_h, new_w)]
            rects = [(left, top, left + new_w, top + new_h, left, top)]
            canvas = (s, s)
            h0, w0 = int(heights[k]), int(widths[k])
            shape_info = ((h0, w0), ((new_h / h0, new_w / w0), (left, top)))
        for q, (m, (h, w), rect) in enumerate(zip(members, sizes, rects)):
            x1a, y1a, x2a, y2a, padw, padh = rect
            slots[k * 4 + q] = (m, x1a, y1a, x2a, y2a, padw, padh, w, h, widths[m], heights[m])
            b = np.asarray(boxes[m], np.float64).reshape(-1, 4) * np.array([w, h, w, h]) + np.array(
                [padw, padh, padw, padh])
            placed.append((b, np.asarray(labels[m], np.int64).reshape(-1)))
        b = np.concatenate([p[0] for p in placed]) if placed else np.zeros((0, 4))
        lab = np.concatenate([p[1] for p in placed]) if placed else np.zeros(0, np.int64)
        if counts[k] == 4:  # Mosaic._cat_labels: clipped to the canvas, zero-area boxes removed
            b = np.clip(b, 0, 2 * s)
            good = ((b[:, 2] - b[:, 0]) > 0) & ((b[:, 3] - b[:, 1]) > 0)
            b, lab = b[good], lab[good]
        if augment:
            M, scale = _affine(t, u[k], s, canvas)
        else:
            M, scale = np.eye(3), 1.0
        flip = np.eye(3)
        if augment and u[k, 12] < t.fliplr:
            flip[0, 0], flip[0, 2] = -1, s
        if augment and u[k, 13] < t.flipud:
            flip[1, 1], flip[1, 2] = -1, s
        new = _warp_boxes(b, M, s)
        if augment:
            keep = box_candidates(b * scale, new)
            new, lab = new[keep], lab[keep]
        if len(new) and (flip != np.eye(3)).any():  # RandomFlip after the affine: mirrored boxes
            new = _warp_boxes(new, flip, s)
        pixels = flip.copy()  # a mirrored pixel index is s - 1 - x where a box edge is s - x
        pixels[:2, 2] = np.where(pixels[:2, 2] > 0, s - 1, 0)
        inverse[k] = np.linalg.inv(pixels @ M)[:2]
        out_boxes.append(new.astype(np.float32))
        out_labels.append(lab)
        shapes.append(shape_info)
    gains = np.array([t.hsv_h, t.hsv_s, t.hsv_v]) if augment else np.zeros(3)
    hsv = (2 * hsv_u - 1) * gains + 1
    return Plan(inverse, centre, slots, out_boxes, out_labels, hsv, shapes)


# --- the pixels: torch, on the batch's device --------------------------------------------------------
def _to(array, dtype, device) -> torch.Tensor:
    """A small host array on ``device``, queued on the current stream (through pinned memory: a
    copy from pageable memory would wait for all work queued before it)."""
    return upload(torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)), torch.device(device))



def source_boxes(index, indices: Sequence[int]) -> tuple[list, list]:
    """Per sample of ``indices``: its boxes (XYXY fractions of the image, float64 [K, 4]) and
    labels, crowd boxes left out (Ultralytics' COCO conversion leaves them out too)."""
    from gdsdata.format import layout as fmt

    boxes, labels = [], []
    for i in indices:
        rows = index.sample_boxes(int(i))
        rows = rows[(rows["flags"] & fmt.BOX_CROWD) == 0] if len(rows) else rows
        boxes.append(np.stack([rows[k] for k in ("x0", "y0", "x1", "y1")], axis=1).astype(np.float64)
                     if len(rows) else np.zeros((0, 4)))
        labels.append(rows["label"].astype(np.int64) if len(rows) else np.zeros(0, np.int64))
    return boxes, labels


def render(t: "YoloAugment | Letterbox", buffer: torch.Tensor, offsets, channels, p: Plan) -> torch.Tensor:
    """The batch's S x S images (uint8 NCHW, or float in [0, 1] for a float ``dtype``) from the
    decoded sources (interleaved uint8 pixels at ``offsets`` in the flat ``buffer``). On a GPU the
    whole batch is sampled at once (``_sample_batch``: a fixed number of kernels however many
    images); on the CPU each source over the output window it covers (``_sample_windows``: torch's
    ``grid_sample`` on a fraction of the pixels). The two compute the same values."""
    n = len(p.inverse)
    if buffer.is_cuda:  # a chunk of images at a time bounds the per-pixel temporaries (~90 MB an image at 640)
        out = torch.cat([_sample_batch(t, buffer, offsets, channels, p, a, min(a + _CHUNK, n))
                         for a in range(0, n, _CHUNK)])
    else:
        out = _sample_windows(t, buffer, offsets, channels, p)
    out = out.round_().clamp_(0, 255)
    if (p.hsv != 1).any():
        gains = _to(p.hsv, np.float32, buffer.device)
        step = _CHUNK if buffer.is_cuda else 1  # on the CPU an image at a time: reused, not fresh, pages
        out = torch.cat([_hsv(out[a:a + step], gains[a:a + step]) for a in range(0, n, step)])
    out = out.contiguous()
    if t.dtype is None:
        return out.to(torch.uint8)
    return (out / 255).to(getattr(torch, t.dtype))


_CHUNK = 16  # images sampled together on a GPU


def _sample_windows(t, buffer, offsets, channels, p: Plan) -> torch.Tensor:
    n, s = len(p.inverse), t.imgsz
    out = torch.full((n, 3, s, s), float(t.pad), device=buffer.device)
    for k in range(n):
        inv = p.inverse[k]
        forward = np.linalg.inv(np.vstack([inv, [0.0, 0.0, 1.0]]))
        for q in range(4):
            source, x1a, y1a, x2a, y2a, padw, padh, w, h, w0, h0 = p.slots[k * 4 + q]
            if source < 0 or x2a <= x1a or y2a <= y1a:
                continue
            corners = np.array([[x1a, y1a, 1], [x2a, y1a, 1], [x1a, y2a, 1], [x2a, y2a, 1]]) - [0.5, 0.5, 0]
            ox, oy = (corners @ forward.T)[:, 0], (corners @ forward.T)[:, 1]
            left, right = max(int(np.floor(ox.min())), 0), min(int(np.ceil(ox.max())) + 1, s)
            top, bottom = max(int(np.floor(oy.min())), 0), min(int(np.ceil(oy.max())) + 1, s)
            if right <= left or bottom <= top:
                continue
            ys, xs = torch.meshgrid(torch.arange(top, bottom, dtype=torch.float32),
                                    torch.arange(left, right, dtype=torch.float32), indexing="ij")
            cx = inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]
            cy = inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]
            inside = (cx > x1a - 0.5) & (cx < x2a - 0.5) & (cy > y1a - 0.5) & (cy < y2a - 0.5)
            # canvas -> resized image -> source (half-pixel centres), as grid_sample's normalised grid
            gx = (cx - padw + 0.5) * (w0 / max(w, 1)) / w0 * 2 - 1
            gy = (cy - padh + 0.5) * (h0 / max(h, 1)) / h0 * 2 - 1
            m, h0, w0 = int(source), int(h0), int(w0)
            ch = int(channels[m])
            image = buffer[int(offsets[m]):int(offsets[m]) + h0 * w0 * ch].view(h0, w0, ch).permute(2, 0, 1)
            image = image.expand(3, h0, w0) if ch == 1 else image
            sampled = torch.nn.functional.grid_sample(image[None].float(), torch.stack([gx, gy], -1)[None],
                                                      mode="bilinear", padding_mode="border", align_corners=False)[0]
            window = out[k, :, top:bottom, left:right]
            window.copy_(torch.where(inside, sampled, window))
    return out


def _sample_batch(t, buffer, offsets, channels, p: Plan, first: int = 0, last: int = None) -> torch.Tensor:
    """Output images [first, last) of the batch, all their pixels at once."""
    device = buffer.device
    last = len(p.inverse) if last is None else last
    s = t.imgsz
    f32 = torch.float32
    inv = _to(p.inverse[first:last], np.float32, device)  # n, 2, 3
    coords = torch.arange(s, dtype=f32, device=device)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    cx = inv[:, 0, 0, None, None] * xs + inv[:, 0, 1, None, None] * ys + inv[:, 0, 2, None, None]
    cy = inv[:, 1, 0, None, None] * xs + inv[:, 1, 1, None, None] * ys + inv[:, 1, 2, None, None]
    centre = _to(p.centre[first:last], np.float32, device)
    # canvas column xc (row yc) starts the right (lower) images: nearest pixel centres decide
    quadrant = (cx >= centre[:, 0, None, None] - 0.5).long() + 2 * (cy >= centre[:, 1, None, None] - 0.5).long()
    slot = torch.arange(first, last, device=device)[:, None, None] * 4 + quadrant
    table = _to(p.slots, np.float32, device)  # small integers: exact in float32
    source, x1a, y1a, x2a, y2a, padw, padh, w, h, w0, h0 = table[slot].unbind(-1)
    inside = (source >= 0) & (cx > x1a - 0.5) & (cx < x2a - 0.5) & (cy > y1a - 0.5) & (cy < y2a - 0.5)
    # canvas -> resized image -> source image (half-pixel centres, as cv2.resize maps them)
    sx = torch.minimum(((cx - padw + 0.5) * (w0 / w.clamp(min=1)) - 0.5).clamp_(min=0), w0 - 1)
    sy = torch.minimum(((cy - padh + 0.5) * (h0 / h.clamp(min=1)) - 0.5).clamp_(min=0), h0 - 1)
    x0, y0 = sx.floor(), sy.floor()
    wx, wy = (sx - x0)[..., None], (sy - y0)[..., None]
    src = source.clamp(min=0).long()
    ch = _to(channels, np.int64, device)[src]
    row = w0.long() * ch
    # the four neighbours' first bytes in the flat buffer, each pixel's three channels beside them
    first = _to(offsets, np.int64, device)[src] + y0.long() * row + x0.long() * ch
    right = (x0 + 1 < w0).long() * ch
    down = (y0 + 1 < h0).long() * row
    lanes = torch.arange(3, device=device) * (ch == 3).long()[..., None]  # gray: one channel three times
    flat = buffer.reshape(-1)

    def at(shift):
        return flat[(first + shift)[..., None] + lanes].to(f32)

    top = at(0)
    top = top + (at(right) - top) * wx
    bottom = at(down)
    bottom = bottom + (at(down + right) - bottom) * wx
    value = torch.where(inside[..., None], top + (bottom - top) * wy, float(t.pad))
    return value.permute(0, 3, 1, 2)


def _hsv(rgb: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """Ultralytics' ``RandomHSV`` on values 0..255 (n, 3, s, s): to OpenCV's 8-bit HSV (hue in
    0..179, rounded as OpenCV rounds), each channel through its lookup table (hue shifted by its
    gain's share of 180, modulo 180; saturation and value times theirs, clipped; truncated as the
    uint8 tables are), and back to RGB as OpenCV converts HSV."""
    r, g, b = rgb.unbind(1)
    v = torch.maximum(torch.maximum(r, g), b)
    delta = v - torch.minimum(torch.minimum(r, g), b)
    s8 = torch.floor(delta * 255 / v.clamp(min=1) + 0.5)
    raw = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * delta, r - g + 4 * delta))
    h8 = torch.floor(raw * 30 / delta.clamp(min=1) + 0.5)
    h8 = torch.where(h8 < 0, h8 + 180, h8)
    gh, gs, gv = (gains[:, k, None, None] for k in range(3))
    h8 = torch.floor(torch.remainder(h8 + (gh - 1) * 180, 180))  # Ultralytics 8.3.79 on: shifted, not scaled
    s8 = torch.floor((s8 * gs).clamp_(0, 255))
    v8 = torch.floor((v * gv).clamp_(0, 255))
    # back: channel = V - V S clamp(min(k, 4 - k), 0, 1), k = (n + H / 60) mod 6 for n = 5, 3, 1
    hue, chroma = h8 / 30, v8 * (s8 / 255)
    out = []
    for n in (5.0, 3.0, 1.0):
        k = torch.remainder(hue + n, 6)
        out.append(torch.round(v8 - chroma * torch.minimum(k, 4 - k).clamp_(0, 1)))
    return torch.stack(out, 1)


# --- the batch forms -------------------------------------------------------------------------------------
def batch_form(t: "YoloAugment | Letterbox", p: Plan, images: torch.Tensor, names: Sequence[str] | None = None):
    """The targets as torchvision's detection models take them (a dict per image), or Ultralytics'
    batch dict (which holds the images too)."""
    device = images.device
    if t.targets == "torchvision":
        return [{"boxes": _to(b, np.float32, device), "labels": _to(lab, np.int64, device)}
                        for b, lab in zip(p.boxes, p.labels)]
    s = float(t.imgsz)
    counts = [len(b) for b in p.boxes]
    boxes = np.concatenate(p.boxes) if sum(counts) else np.zeros((0, 4), np.float32)
    xywh = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2,
                     boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], axis=1) / s if len(boxes) else boxes
    labels = np.concatenate(p.labels) if sum(counts) else np.zeros(0, np.int64)
    batch = {"img": images,
             "batch_idx": _to(np.repeat(np.arange(len(counts)), counts), np.float32, device),
             "cls": _to(labels[:, None], np.float32, device),
             "bboxes": _to(xywh, np.float32, device),
             "ori_shape": tuple(shape for shape, _ in p.shapes),
             "resized_shape": tuple((t.imgsz, t.imgsz) for _ in p.shapes),
             "ratio_pad": tuple(ratio_pad for _, ratio_pad in p.shapes)}
    if names is not None:
        batch["im_file"] = tuple(names)
    return batch
