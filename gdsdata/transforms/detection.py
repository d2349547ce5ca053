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
no image lies), on a GPU by one kernel for the whole batch, on the CPU by torch operations.
Ultralytics resizes each image first and warps the resized canvas second, so pixels agree within
interpolation differences, not exactly.
HSV jitter follows OpenCV's 8-bit HSV (hue in 0..179) and Ultralytics' lookup tables (8.3.79 on).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gdsdata.args import is_integer
from gdsdata.batch import upload
from gdsdata.transforms import dtype_named, each_image, uniforms

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
    dtype : {None, "float16", "float32"} or the torch dtype of one
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
        if self.epochs is not None and (not is_integer(self.epochs) or self.epochs <= 0):
            raise ValueError(f"epochs must be a positive integer or None, got {self.epochs!r}")
        if not is_integer(self.close_mosaic) or self.close_mosaic < 0:
            raise ValueError(f"close_mosaic must be a non-negative integer, got {self.close_mosaic!r}")
        if not is_integer(self.seed) or self.seed < 0:
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
        n = len(indices)
        if n >= 4:
            others = np.minimum((u[:, 1:4] * (n - 1)).astype(np.int64), n - 2)
            others += others >= np.arange(n)[:, None]  # skip the output itself
            return [[k, *others[k].tolist()] if use[k] else [k] for k in range(n)]
        out, after = [], n
        for k in range(n):
            out.append([k, after, after + 1, after + 2] if use[k] else [k])
            after += 3 * bool(use[k])
        return out

    def _mosaics(self, indices, epoch):
        u = uniforms(self.seed, epoch, indices, _DRAWS)
        use = (u[:, 0] < self.mosaic) if self.mosaic_on(epoch) else np.zeros(len(indices), bool)
        return use, u


@dataclass(frozen=True)
class Letterbox:
    """Ultralytics' evaluation transform: the long side resized to ``imgsz`` (as its ``load_image``
    does, small images enlarged too), centred on an ``imgsz`` square padded with ``pad``. With
    ``rect=True``, on the batch's own rectangle instead, as Ultralytics' validation batches: the
    smallest multiple of ``stride`` (plus half a stride) on each side that holds every image of the
    batch at its loaded size, the long side ``imgsz`` (``BaseDataset.set_rectangle``); the Loader given
    the samples in ``Letterbox.rect_order(dataset)``, unshuffled, then makes Ultralytics' batches.
    ``targets`` and ``dtype`` as for ``YoloAugment``. Each torchvision-form target also holds
    ``orig_size`` (int64 [2]: the stored image's height, width) and ``ratio_pad`` (float32 [4]: ratio_h,
    ratio_w, pad_w, pad_h), as the Ultralytics form's ``ori_shape`` and ``ratio_pad``: a box in the
    stored image's pixels is (x - pad_w) / ratio_w, (y - pad_h) / ratio_h (a pack made with
    ``--max-side`` stores downscaled images, so the annotations' frame is a further annotated width /
    orig_size[1] larger), and ``iscrowd`` (uint8 [K]: COCO's crowd boxes kept and flagged, as
    ``ds.target(i)`` has them); from a pack of COCO annotations, also ``image_id`` (COCO's)."""

    imgsz: int = 640
    pad: int = 114
    targets: str = "torchvision"
    dtype: str = None
    rect: bool = False
    stride: int = 32

    def __post_init__(self):
        _check_common(self)
        if not isinstance(self.rect, (bool, np.bool_)):
            raise ValueError(f"rect must be True or False, got {self.rect!r}")
        if not is_integer(self.stride) or self.stride < 1:
            raise ValueError(f"stride must be a positive integer (the model's largest stride), got {self.stride!r}")

    @staticmethod
    def rect_order(dataset) -> np.ndarray:
        """The samples of ``dataset`` (a GDSDataset, or a torch Subset of one: positions in the Subset)
        by aspect ratio, height over width, as Ultralytics orders its validation images for
        rectangular batches: pass as the Loader's ``indices`` over the same ``dataset``."""
        from gdsdata.loader import _in_range, unwrapped  # (the Loader imports the transforms)

        base, picked = unwrapped(dataset)
        if not hasattr(getattr(base, "index", None), "samples"):
            raise TypeError(f"Letterbox.rect_order takes a gdsdata.GDSDataset or a torch Subset of one, got "
                            f"{type(dataset).__name__}")
        records = base.index.samples
        if picked is not None:
            records = records[_in_range(picked, len(records), "Subset.indices")]
        return np.argsort(records["height"].astype(np.float64) / np.maximum(records["width"], 1))

    def sources(self, indices: Sequence[int], epoch: int, population: Sequence[int]) -> list[int]:
        return list(indices)

    def members(self, indices: Sequence[int], epoch: int) -> list[list[int]]:
        return [[k] for k in range(len(indices))]


def _check_common(t):
    if not is_integer(t.imgsz) or t.imgsz < 32 or t.imgsz % 2:
        raise ValueError(f"imgsz must be an even integer of at least 32, got {t.imgsz!r}")
    if not is_integer(t.pad) or not 0 <= t.pad <= 255:
        raise ValueError(f"pad must be an integer in 0..255, got {t.pad!r}")
    if t.targets not in TARGET_FORMS:
        raise ValueError(f"targets must be one of {', '.join(TARGET_FORMS)}, got {t.targets!r}")
    dtype_named(t)
    if t.dtype not in (None, "float16", "float32"):
        raise ValueError(f"dtype must be None (uint8), 'float16' or 'float32' (or torch's), got {t.dtype!r}")


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
    shapes: list  # per output: ((h0, w0), ratio_pad), Ultralytics' ratio_pad: ((ratio_h, ratio_w), (padw, padh))
    #               for Letterbox, the loaded image's (ratio_h, ratio_w) for YoloAugment
    size: tuple  # the outputs' (height, width)


def load_size(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """Ultralytics' ``load_image`` size: the long side to ``imgsz``, each side rounded up, at most imgsz."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def _affine(t, u, size, canvas):
    """Ultralytics' ``RandomPerspective.affine_transform`` without perspective, per output: M = T @ S
    @ R @ C for a ``canvas`` (w, h) warped to ``size`` x ``size``; returns M (n, 3, 3) and the scales."""
    n = len(u)
    eye = np.broadcast_to(np.eye(3), (n, 3, 3))
    C, R, S, T = eye.copy(), eye.copy(), eye.copy(), eye.copy()
    C[:, 0, 2], C[:, 1, 2] = -canvas[:, 0] / 2, -canvas[:, 1] / 2
    a = np.radians((2 * u[:, 6] - 1) * t.degrees)
    scale = 1 - t.scale + 2 * t.scale * u[:, 7]
    cos, sin = scale * np.cos(a), scale * np.sin(a)  # cv2.getRotationMatrix2D at (0, 0)
    R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1] = cos, sin, -sin, cos
    S[:, 0, 1] = np.tan(np.radians((2 * u[:, 8] - 1) * t.shear))
    S[:, 1, 0] = np.tan(np.radians((2 * u[:, 9] - 1) * t.shear))
    T[:, 0, 2] = (0.5 - t.translate + 2 * t.translate * u[:, 10]) * size
    T[:, 1, 2] = (0.5 - t.translate + 2 * t.translate * u[:, 11]) * size
    return T @ S @ R @ C, scale


def box_candidates(box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100, area_thr: float = 0.1,
                   eps: float = 1e-16) -> np.ndarray:
    """Ultralytics' rule for boxes that survive an augmentation: ``box1`` before (scaled), ``box2``
    after, both XYXY [K, 4]."""
    w1, h1 = box1[:, 2] - box1[:, 0], box1[:, 3] - box1[:, 1]
    w2, h2 = box2[:, 2] - box2[:, 0], box2[:, 3] - box2[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def rect_shape(heights, widths, imgsz: int, stride: int) -> tuple[int, int]:
    """Ultralytics' rectangular batch shape (height, width) for images of these sizes:
    ``BaseDataset.set_rectangle`` with its validation pad of half a stride."""
    ar = np.asarray(heights, np.float64) / np.asarray(widths, np.float64)
    shape = [1.0, 1.0]
    if ar.max() < 1:
        shape = [ar.max(), 1.0]
    elif ar.min() > 1:
        shape = [1.0, 1 / ar.min()]
    h, w = (np.ceil(np.array(shape) * imgsz / stride + 0.5).astype(int) * stride).tolist()
    return h, w


def _warp_boxes(boxes, M, size):
    """Each box's corners through its own M (K, 3, 3), the enclosing boxes clipped to the output's
    ``size`` (height, width)."""
    corners = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(-1, 4, 2)
    x = M[:, None, 0, 0] * corners[..., 0] + M[:, None, 0, 1] * corners[..., 1] + M[:, None, 0, 2]
    y = M[:, None, 1, 0] * corners[..., 0] + M[:, None, 1, 1] * corners[..., 1] + M[:, None, 1, 2]
    out = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], axis=1) if len(boxes) else boxes.reshape(0, 4)
    return np.clip(out, 0, [size[1], size[0], size[1], size[0]])


def plan(t: "YoloAugment | Letterbox", heights, widths, boxes: list, labels: list, indices: Sequence[int],
         epoch: int) -> Plan:
    """The geometry and the boxes of a batch of outputs ``indices`` whose sources (``t.sources``
    order; ``t.members`` says which make each output) have decoded sizes ``heights``/``widths`` and
    boxes ``boxes`` (XYXY fractions of the image, one [K, 4] array per source) with ``labels``.
    Computed for the whole batch at once (array operations, a few hundred microseconds for 64
    outputs): the host thread that plans holds the interpreter lock the training loop needs."""
    n, s = len(indices), t.imgsz
    if not n:
        return Plan(np.zeros((0, 2, 3)), np.zeros((0, 2)), np.zeros((0, 11)), [], [], np.ones((0, 3)), [], (s, s))
    augment = isinstance(t, YoloAugment)
    u = uniforms(t.seed, epoch, indices, _DRAWS) if augment else np.zeros((n, _DRAWS))
    hsv_u = uniforms(t.seed ^ 0x5BD1E995, epoch, indices, _HSV_DRAWS) if augment else np.full((n, 3), 0.5)
    layout = t.members(indices, epoch)
    members = np.full((n, 4), -1, np.int64)
    for k, m in enumerate(layout):
        members[k, :len(m)] = m
    mosaic = members[:, 1] >= 0
    h0, w0 = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    # Ultralytics' load_image size of every source: the long side to s, each side rounded up
    r = s / np.maximum(h0, w0)
    lh = np.where(r == 1, h0, np.minimum(np.ceil(h0 * r), s)).astype(np.int64)
    lw = np.where(r == 1, w0, np.minimum(np.ceil(w0 * r), s)).astype(np.int64)
    m = members.clip(min=0)
    h, w = lh[m], lw[m]  # (n, 4) placed sizes
    rect = np.zeros((n, 4, 6), np.int64)  # x1a, y1a, x2a, y2a, padw, padh
    canvas = np.stack([w[:, 0], h[:, 0]], axis=1).astype(np.float64)
    # Ultralytics' training labels: the output's own image's size and its load_image ratios (ratio_h, ratio_w)
    shapes = [((int(h0[k]), int(w0[k])), (int(lh[k]) / int(h0[k]), int(lw[k]) / int(w0[k]))) for k in range(n)]
    size = (s, s)
    if not augment:  # LetterBox (centred, never enlarged) of the loaded image on an s x s square, or the batch's
        size = rect_shape(h0, w0, s, t.stride) if t.rect else size
        ratio = np.minimum(np.minimum(size[0] / h[:, 0], size[1] / w[:, 0]), 1.0)
        h[:, 0], w[:, 0] = np.round(h[:, 0] * ratio), np.round(w[:, 0] * ratio)
        left, top = np.round((size[1] - w[:, 0]) / 2 - 0.1), np.round((size[0] - h[:, 0]) / 2 - 0.1)
        rect[:, 0] = np.stack([left, top, left + w[:, 0], top + h[:, 0], left, top], axis=1)
        canvas[:] = size[::-1]
        shapes = [((int(h0[k]), int(w0[k])), ((int(h[k, 0]) / int(h0[k]), int(w[k, 0]) / int(w0[k])),
                                               (int(left[k]), int(top[k])))) for k in range(n)]
    else:  # the loaded image itself is the canvas the affine centres on
        rect[:, 0, 2], rect[:, 0, 3] = w[:, 0], h[:, 0]
    centre = np.full((n, 2), 1e9)
    if mosaic.any():  # Ultralytics' _mosaic4 placement around a centre uniform in [s/2, 3s/2)
        xc, yc = (s / 2 + u[:, 4] * s).astype(np.int64), (s / 2 + u[:, 5] * s).astype(np.int64)
        for q in range(4):
            wq, hq = w[:, q], h[:, q]
            x1a = np.maximum(xc - wq, 0) if q in (0, 2) else xc
            x2a = xc if q in (0, 2) else np.minimum(xc + wq, 2 * s)
            y1a = np.maximum(yc - hq, 0) if q in (0, 1) else yc
            y2a = yc if q in (0, 1) else np.minimum(yc + hq, 2 * s)
            x1b = wq - (x2a - x1a) if q in (0, 2) else 0
            y1b = hq - (y2a - y1a) if q in (0, 1) else 0
            placed = np.stack([x1a, y1a, x2a, y2a, x1a - x1b, y1a - y1b], axis=1)
            rect[mosaic, q] = placed[mosaic]
        centre[mosaic] = np.stack([xc, yc], axis=1)[mosaic]
        canvas[mosaic] = 2 * s
    valid = members >= 0
    slots = np.full((n, 4, 11), -1.0)
    slots[valid] = np.concatenate([members[:, :, None], rect, w[:, :, None], h[:, :, None],
                                   w0[m][:, :, None], h0[m][:, :, None]], axis=2)[valid]
    # every slot's boxes, placed on its canvas (rows in output, slot, box order)
    counts = np.array([len(b) for b in boxes], np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    every = np.concatenate([np.asarray(b, np.float64).reshape(-1, 4) for b in boxes])
    every_labels = np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in labels])
    slot_source = members[valid]  # row-major: output k, then slot q
    per_slot = counts[slot_source]
    rows = np.repeat(start[slot_source] - np.concatenate([[0], np.cumsum(per_slot)[:-1]]), per_slot) + np.arange(
        per_slot.sum())
    table = slots[valid]
    scale_xy = np.repeat(table[:, [7, 8, 7, 8]], per_slot, axis=0)
    shift = np.repeat(table[:, [5, 6, 5, 6]], per_slot, axis=0)
    b = every[rows] * scale_xy + shift
    lab = every_labels[rows]
    owner = np.repeat(np.nonzero(valid)[0], per_slot)
    in_mosaic = mosaic[owner]
    if in_mosaic.any():  # Mosaic._cat_labels: clipped to the canvas, zero-area boxes removed
        b[in_mosaic] = np.clip(b[in_mosaic], 0, 2 * s)
        good = ~in_mosaic | (((b[:, 2] - b[:, 0]) > 0) & ((b[:, 3] - b[:, 1]) > 0))
        b, lab, owner = b[good], lab[good], owner[good]
    eye = np.broadcast_to(np.eye(3), (n, 3, 3))
    M, scale = (_affine(t, u, s, canvas) if augment else (eye.copy(), np.ones(n)))
    flip = eye.copy()
    if augment:
        lr, ud = u[:, 12] < t.fliplr, u[:, 13] < t.flipud
        flip[lr, 0, 0], flip[lr, 0, 2] = -1, s
        flip[ud, 1, 1], flip[ud, 1, 2] = -1, s
    new = _warp_boxes(b, M[owner], size)
    if augment:
        keep = box_candidates(b * scale[owner, None], new)
        new, lab, owner = new[keep], lab[keep], owner[keep]
    new = _warp_boxes(new, flip[owner], size)  # RandomFlip after the affine (the identity where none)
    pixels = flip.copy()  # a mirrored pixel index is s - 1 - x where a box edge is s - x
    pixels[:, :2, 2] = np.where(pixels[:, :2, 2] > 0, s - 1, 0)
    inverse = np.linalg.inv(pixels @ M)[:, :2]
    split = np.cumsum(np.bincount(owner, minlength=n))[:-1]
    gains = np.array([t.hsv_h, t.hsv_s, t.hsv_v]) if augment else np.zeros(3)
    hsv = (2 * hsv_u - 1) * gains + 1
    return Plan(inverse, centre, slots.reshape(n * 4, 11), np.split(new.astype(np.float32), split),
                np.split(lab, split), hsv, shapes, size)


# --- the pixels: torch, on the batch's device --------------------------------------------------------
def _to(array, dtype, device) -> torch.Tensor:
    """A small host array on ``device``, queued on the current stream (through pinned memory: a
    copy from pageable memory would wait for all work queued before it)."""
    return upload(torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)), torch.device(device))



def source_boxes(index, indices: Sequence[int], crowds: bool = False) -> tuple[list, list, list]:
    """Per sample of ``indices``: its boxes (XYXY fractions of the image, float64 [K, 4]), labels
    and crowd flags (uint8); crowd boxes left out (Ultralytics' COCO conversion leaves them out too)
    unless ``crowds``."""
    from gdsdata.format import layout as fmt

    idx = np.asarray(indices, np.int64)
    if index.boxes is None or not len(idx):
        return ([np.zeros((0, 4)) for _ in idx], [np.zeros(0, np.int64) for _ in idx],
                [np.zeros(0, np.uint8) for _ in idx])
    start = index.box_start[idx].astype(np.int64)
    counts = index.box_start[idx + 1].astype(np.int64) - start
    rows = np.repeat(start - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
    records = index.boxes[rows]
    crowd = (records["flags"] & fmt.BOX_CROWD) != 0
    keep = np.ones(len(records), bool) if crowds else ~crowd
    records = records[keep]
    boxes = np.stack([records[k] for k in ("x0", "y0", "x1", "y1")], axis=1).astype(np.float64)
    split = np.cumsum(np.bincount(np.repeat(np.arange(len(idx)), counts)[keep], minlength=len(idx)))[:-1]
    return (np.split(boxes, split), np.split(records["label"].astype(np.int64), split),
            np.split(crowd[keep].astype(np.uint8), split))


def render(t: "YoloAugment | Letterbox", buffer: torch.Tensor, offsets, channels, p: Plan) -> torch.Tensor:
    """The batch's images of ``p.size`` (uint8 NCHW, or float in [0, 1] for a float ``dtype``) from the
    decoded sources (interleaved uint8 pixels at ``offsets`` in the flat ``buffer``). On a GPU one
    kernel samples, rounds and HSV-jitters the whole batch (``kernels.sample_detection``); on the CPU
    (or without Triton) torch operations sample each source over the output window it covers
    (``_sample_windows``), then ``_hsv`` an image at a time. The two compute the same values."""
    from gdsdata.transforms import _triton_ready

    jitter = bool((p.hsv != 1).any())
    dtype = torch.uint8 if t.dtype is None else getattr(torch, t.dtype)
    if buffer.is_cuda and _triton_ready():
        from gdsdata.transforms.kernels import sample_detection

        return sample_detection(buffer, offsets, channels, p, t.pad, jitter, dtype)
    out = _sample_windows(t, buffer, offsets, channels, p).round_().clamp_(0, 255)
    if jitter:
        gains = _to(p.hsv, np.float32, buffer.device)

        def jitter_one(a):
            out[a:a + 1] = _hsv(out[a:a + 1], gains[a:a + 1])

        each_image(jitter_one, len(out), buffer)
    if t.dtype is None:
        return out.to(torch.uint8)
    return (out / 255).to(dtype)


def _sample_windows(t, buffer, offsets, channels, p: Plan) -> torch.Tensor:
    n, (height, width) = len(p.inverse), p.size
    out = torch.full((n, 3, height, width), float(t.pad), device=buffer.device)

    def sample_one(k):
        inv = p.inverse[k]
        forward = np.linalg.inv(np.vstack([inv, [0.0, 0.0, 1.0]]))
        for q in range(4):
            source, x1a, y1a, x2a, y2a, padw, padh, w, h, w0, h0 = p.slots[k * 4 + q]
            if source < 0 or x2a <= x1a or y2a <= y1a:
                continue
            corners = np.array([[x1a, y1a, 1], [x2a, y1a, 1], [x1a, y2a, 1], [x2a, y2a, 1]]) - [0.5, 0.5, 0]
            ox, oy = (corners @ forward.T)[:, 0], (corners @ forward.T)[:, 1]
            left, right = max(int(np.floor(ox.min())), 0), min(int(np.ceil(ox.max())) + 1, width)
            top, bottom = max(int(np.floor(oy.min())), 0), min(int(np.ceil(oy.max())) + 1, height)
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

    each_image(sample_one, n, buffer)
    return out


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
def batch_form(t: "YoloAugment | Letterbox", p: Plan, images: torch.Tensor, names: Sequence[str] | None = None,
               image_ids: Sequence[int] | None = None, crowds: Sequence[np.ndarray] | None = None):
    """The targets as torchvision's detection models take them (a dict per image), or Ultralytics'
    batch dict (which holds the images too); ``image_ids``: COCO's, ``crowds``: each box's crowd
    flag, for Letterbox's targets (whose boxes are the sources', in order)."""
    device = images.device
    if t.targets == "torchvision":
        targets = [{"boxes": _to(b, np.float32, device), "labels": _to(lab, np.int64, device)}
                   for b, lab in zip(p.boxes, p.labels)]
        if isinstance(t, Letterbox):  # where each image came from
            sizes = _to(np.array([shape for shape, _ in p.shapes], np.int64).reshape(-1, 2), np.int64, device)
            ratio_pad = _to(np.array([[*ratio, *pad] for _, (ratio, pad) in p.shapes], np.float64).reshape(-1, 4),
                            np.float32, device)
            for k, target in enumerate(targets):
                target["orig_size"], target["ratio_pad"] = sizes[k], ratio_pad[k]
                if image_ids is not None:
                    target["image_id"] = image_ids[k]
                if crowds is not None:
                    target["iscrowd"] = _to(crowds[k], np.uint8, device)
        return targets
    height, width = p.size
    counts = [len(b) for b in p.boxes]
    boxes = np.concatenate(p.boxes) if sum(counts) else np.zeros((0, 4), np.float32)
    xywh = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2, boxes[:, 2] - boxes[:, 0],
                     boxes[:, 3] - boxes[:, 1]], axis=1) / [width, height, width, height] if len(boxes) else boxes
    labels = np.concatenate(p.labels) if sum(counts) else np.zeros(0, np.int64)
    batch = {"img": images,
             "batch_idx": _to(np.repeat(np.arange(len(counts)), counts), np.float32, device),
             "cls": _to(labels[:, None], np.float32, device),
             "bboxes": _to(xywh, np.float32, device),
             "ori_shape": tuple(shape for shape, _ in p.shapes),
             "resized_shape": tuple(tuple(p.size) for _ in p.shapes),
             "ratio_pad": tuple(ratio_pad for _, ratio_pad in p.shapes)}
    if names is not None:
        batch["im_file"] = tuple(names)
    return batch
