"""Detection sources: the Ultralytics YOLO layout and COCO instances JSON. Each lists its images
with their boxes (``Item.boxes``: ``BOX_RECORD`` rows, corners as fractions of the image) and what
it found wrong in the labels, in the words of the file and line it found it in.

YOLO (``--format yolo``), as Ultralytics reads it:
- SRC is a data YAML (``path``, ``train``/``val``/``test``, ``names``), a dataset folder holding
  ``images/<split>/``, or an images folder: one split's images, or the folders of its splits
  (``train/``, ``val/``, ...), of which ``split`` picks one (unasked, two or more are refused: packed
  together, validation images would train). A relative ``path`` is looked for from the YAML's
  folder and where Ultralytics looks (the current folder, then its ``datasets_dir`` setting): a place
  that holds the split is the dataset, and two that would make it other files are refused; no
  ``path``: the YAML's folder. ``nc`` alone names the classes ``class_0``...; ``validation`` stands
  for ``val``. A split's images are the files with Ultralytics' image extensions
  (``YOLO_IMAGE_EXTENSIONS``), in Ultralytics' order (their paths sorted as text), hidden files and
  folders left out. A split is a folder of images (searched
  recursively), a ``.txt`` list of image paths, or a list of either. In a ``.txt`` list (UTF-8, a
  byte-order mark allowed) a line starting with ``./`` is relative to the list's own folder (COCO's
  ``train2017.txt`` beside ``images/``), other relative lines to the current folder, as Ultralytics'
  ``get_img_files`` reads them; a line naming no file is listed under ``unreadable`` (``--strict``:
  the pack stops).
- The label file of ``.../images/.../name.jpg`` is ``.../labels/.../name.txt`` (the last ``images``
  folder of the path becomes ``labels``). One object per line: ``class cx cy w h``, normalised to
  the image, or ``class x1 y1 x2 y2 ...`` (a polygon, taken as its bounding box).
- Class names: the YAML's ``names`` (a list or a {id: name} mapping); a folder given as SRC: a
  ``classes.txt`` (one name per line) beside ``images/`` or ``labels/``, else the data YAML in the
  folder (so a split packed from the folder is named as one packed from the YAML), else the ids as text, up to
  the largest id used; then an id of 2**20 or more leaves its image out (``bad_labels``), so that a
  stray huge id cannot make hundreds of millions of classes.
- Images are oriented by their EXIF tag before packing, as Ultralytics (OpenCV) reads them; the
  labels are in that frame.

COCO (``--format coco``), as torchvision's ``CocoDetection`` reads it: ``images``, ``annotations``
(``bbox`` [x, y, w, h] in pixels, ``category_id``, ``iscrowd``) and ``categories``. Category ids are
mapped to contiguous labels in id order (the mapping is kept in the metadata); images are stored
as the file holds them (no EXIF rotation), in image id order.

What the labels may get wrong, and what packing does (each case named in ``pack_report.json``):
- a box that reaches outside the image: clipped to it (``clipped``); one with no area left inside
  it, or with no width or height to begin with: dropped with the reason (``dropped``);
- the same object twice (identical rows): kept once (``duplicates``);
- a line that is not numbers, a class id that is not in the names, a YOLO row whose cx cy w h (a
  polygon's: its box's) fall outside Ultralytics' bounds (above 1.01, or below 0 beyond its -0.01
  allowance for a centre), boxes and polygons mixed in one file: the image is left out with the
  reason (``bad_labels``), as Ultralytics ignores such an image; so is a YOLO image under 10 pixels
  a side, or whose content is not one of Ultralytics' formats (``skipped``);
- labels without an image (YOLO label files, COCO annotations of unknown images): reported
  (``orphans``); images without labels: kept as negatives (``negatives``).
"""

import contextlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from gdsdata.args import is_integer
from gdsdata.errors import FormatError, SourceError
from gdsdata.format import layout as fmt
from gdsdata.format.shards import open_regular
from gdsdata.packing.prepare import stored_size
from gdsdata.packing.sources import (UNNAMED_LABELS, YOLO_IMAGE_EXTENSIONS, YOLO_IMAGE_FORMATS, Item, display,
                                     is_url, unnamed_label_problem)

log = logging.getLogger(__name__)

# Ultralytics' bounds for a YOLO row's cx cy w h (verify_image_label): at most 1.01, at least 0 (-0.01 for the
# centre where the width and height are not negative); an image with a row outside them is left out.
_MOST, _LEAST = 1.01, -0.01
YOLO_MIN_SIDE = 10  # Ultralytics leaves out images under 10 pixels a side
_SLACK = 1e-4  # a corner this far outside the image is the rounding of the label text: clipped without a word


def each_once(entries, known=()) -> list:
    """A report list's entries ({"path", ...}) each path once (its first), without the paths in ``known``."""
    seen, once = set(known), []
    for entry in entries:
        if entry["path"] not in seen:
            seen.add(entry["path"])
            once.append(entry)
    return once


@dataclass
class LabelReport:
    """What a detection source found in its labels."""

    negatives: int = 0
    no_label_file: str = None  # why no image has labels (YOLO: where the first one's file was looked for; COCO:
    # a file without annotations)
    clipped: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)
    bad_labels: list = field(default_factory=list)
    orphans: list = field(default_factory=list)
    left_out: list = field(default_factory=list)  # the images bad_labels leaves out, each once (``settle``)
    _noted: dict = field(default_factory=dict, repr=False)  # image -> the notes its boxes added, (list, entry)
    BOX_NOTES = ("dropped", "clipped", "duplicates")  # the lists whose entries note an image's boxes

    @contextlib.contextmanager
    def noting(self, image: str):
        """Around the making of ``image``'s boxes (its name as the pack reports it): remember the notes
        they add (boxes dropped, clipped, repeated), which ``forget`` takes back; each names the image
        (``image``), so that a report joined from parts can drop those of images another part skipped.
        (A COCO annotation dropped before its image's boxes are made names the image in its label.)"""
        before = {kind: len(getattr(self, kind)) for kind in self.BOX_NOTES}
        yield
        added = [(kind, entry) for kind in self.BOX_NOTES for entry in getattr(self, kind)[before[kind]:]]
        for _, entry in added:
            entry["image"] = image
        if added:
            self._noted[image] = added

    def forget(self, image: str):
        """``image`` was left out of the pack after all (its file not the size its labels were drawn
        on, say): the notes on its boxes go with it, the reason it was left out says what matters."""
        for kind, entry in self._noted.pop(image, ()):
            entries = getattr(self, kind)
            entries[:] = [e for e in entries if e is not entry]

    def settle(self, packed) -> list:
        """The images ``bad_labels`` leaves out of the dataset (``left_out``), each once with its first
        reason: not those it gives after all (``packed``: the names of the images the source gives or
        could not read; a COCO file one record of which is left out while another names it)."""
        self.left_out = [{"path": entry["path"], "reason": entry["reason"]}
                         for entry in each_once(self.bad_labels, packed)]
        return self.left_out

    def as_dict(self) -> dict:
        return {"negatives": self.negatives, **{kind: getattr(self, kind) for kind in self.BOX_NOTES},
                "bad_labels": self.bad_labels, "left_out": self.left_out, "orphans": self.orphans,
                **({"no_label_file": self.no_label_file} if self.no_label_file else {})}


def _coordinates_problem(row) -> str:
    """Why Ultralytics would ignore the image of this ``class cx cy w h`` row, or ""."""
    values = np.asarray(row[1:], np.float32)  # (compared in float32, as Ultralytics holds them)
    if values.max() > np.float32(_MOST):
        return (f"coordinates up to {values.max():.4g}, beyond the image: YOLO labels are fractions of its "
                f"width and height (at most {_MOST}, as Ultralytics allows)")
    if values.min() < 0 and (values.min() < np.float32(_LEAST) or values[2:].min() < 0):
        return f"negative coordinates (down to {values.min():.4g}; Ultralytics allows {_LEAST} for a centre)"
    return ""


def boxes_from_xyxy(xyxy, labels, flags, where, report, keys=None, shown=None) -> np.ndarray:
    """``BOX_RECORD`` rows from corners as fractions (N x 4): clipped to the image, degenerate and
    duplicate boxes out, each change noted in ``report`` under ``where`` (a file and line, or an
    annotation id), each box as ``shown`` writes corners (the annotation's own form; else the
    corners as fractions). ``keys``: what makes a row a repeat of another (YOLO: its numbers as
    written, as Ultralytics compares them), else its class, crowd flag and clipped box."""
    form = shown or _numbers
    xyxy = np.asarray(xyxy, np.float64).reshape(-1, 4)
    labels, flags = np.asarray(labels, np.int64), np.asarray(flags, np.int64)
    keep, seen = [], set()
    for k in range(len(xyxy)):
        x0, y0, x1, y1 = xyxy[k]
        if not (x1 > x0 and y1 > y0):
            report.dropped.append({"label": where(k), "reason": f"degenerate box (no width or height): "
                                                            f"{form(xyxy[k])}"})
            continue
        clipped = np.clip(xyxy[k], 0.0, 1.0)
        stored = np.float32(clipped)  # as the index holds it: a box thinner than float32 tells apart has no width
        if not (stored[2] > stored[0] and stored[3] > stored[1]):
            reason = "box outside the image" if not (clipped[2] > clipped[0] and clipped[3] > clipped[1]) else \
                "box narrower than a float32 fraction of the image tells apart"
            report.dropped.append({"label": where(k), "reason": f"{reason}: {form(xyxy[k])}"})
            continue
        if np.abs(clipped - xyxy[k]).max() > _SLACK:
            report.clipped.append({"label": where(k), "reason": f"box reaches outside the image: {form(xyxy[k])} "
                                                            f"clipped to {form(clipped)}"})
        key = keys[k] if keys is not None else (int(labels[k]), int(flags[k]), *stored.tolist())  # (crowd: not again)
        if key in seen:
            report.duplicates.append({"label": where(k), "reason": "the same box and class again: kept once"})
            continue
        seen.add(key)
        keep.append((*stored.tolist(), int(labels[k]), int(flags[k])))
    return np.array(keep, dtype=fmt.BOX_RECORD)


def _numbers(values, digits=4) -> str:
    return "[" + ", ".join(f"{v:.{digits}g}" for v in values) + "]"


def _coco_bbox(width, height):
    """Corners as fractions written as a COCO ``bbox`` of the image: [x, y, w, h] in its pixels."""
    def shown(values):
        x0, y0, x1, y1 = values
        return "bbox " + _numbers((x0 * width, y0 * height, (x1 - x0) * width, (y1 - y0) * height), digits=6)
    return shown


class DetectionSource:
    """Common ground of the detection sources: items with boxes, classes, a label report."""

    task = "detect"
    format = ""

    def __init__(self):
        self.items, self.ignored, self.unreadable, self.special = [], [], [], []
        self.report = LabelReport()
        self.category_ids = None

    def read(self, item):
        return None  # the packing workers read the image files

    def close(self):
        pass



def annotate(meta, classes, format, category_ids, per_sample_boxes, image_ids=None) -> dict:
    """Mark ``meta`` as a detection index (``task``, ``detection``, per-class counts of boxes, not of
    samples; ``image_ids``: COCO's image id of each sample, in sample order) and return the ``boxes``
    and ``box_start`` arguments of ``index.write``."""
    meta["task"] = "detect"
    meta["detection"] = detection_meta(classes, format, category_ids, per_sample_boxes)
    if image_ids is not None and len(set(image_ids)) < len(image_ids):  # (datasets of other COCO files joined)
        log.warning("image ids repeat among the samples (annotations of other COCO files, appended or merged): "
                    "the dataset keeps none, as no id would name one image")
    elif image_ids is not None:
        meta["detection"]["image_ids"] = [int(i) for i in image_ids]
    meta.setdefault("counts", {})["per_class"] = meta["detection"]["per_class_boxes"]
    boxes = np.concatenate(per_sample_boxes) if per_sample_boxes else np.zeros(0, fmt.BOX_RECORD)
    return {"boxes": boxes, "box_start": np.concatenate([[0], np.cumsum([len(b) for b in per_sample_boxes])])}


def detection_meta(classes, format, category_ids, per_sample_boxes) -> dict:
    """The metadata's ``detection`` entry for the boxes actually packed."""
    counts = np.zeros(len(classes), np.int64)
    for boxes in per_sample_boxes:
        np.add.at(counts, boxes["label"].astype(np.int64), 1)
    meta = {"format": format, "boxes": int(counts.sum()), "per_class_boxes": counts.tolist(),
            "negatives": sum(1 for boxes in per_sample_boxes if not len(boxes))}
    if category_ids is not None:
        meta["category_ids"] = list(category_ids)
    return meta


# --- YOLO ---------------------------------------------------------------------------------------
def _swap_last(path: str, folder: str, other: str) -> str:
    """``path`` with its last ``/folder/`` made ``/other/`` (as it is without one)."""
    head, sep, tail = path.rpartition(f"{os.sep}{folder}{os.sep}")
    return (head + f"{os.sep}{other}{os.sep}" + tail) if sep else path


def label_path(image_path: str) -> str:
    """Ultralytics' rule: the last ``/images/`` of the path becomes ``/labels/``, the extension ``.txt``."""
    return os.path.splitext(_swap_last(image_path, "images", "labels"))[0] + ".txt"


def _images_folder(labels_folder: str) -> str:
    """The folder whose images ``label_path`` puts their labels in ``labels_folder``."""
    return _swap_last(labels_folder.rstrip(os.sep) + os.sep, "labels", "images")


def _load_yaml(path):
    import yaml

    try:
        with open(open_regular(path, what="a data YAML"), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SourceError(f"{display(path)}: cannot read the data YAML ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        raise SourceError(f"{display(path)}: not a readable YAML file ({str(e).splitlines()[0]})") from e
    if not isinstance(data, dict):
        raise SourceError(f"{display(path)}: a data YAML is a mapping (path, train, val, names)")
    return data


def _names(raw, where) -> list:
    if isinstance(raw, dict):
        try:
            ids = sorted(int(k) for k in raw)
        except (TypeError, ValueError) as e:
            raise SourceError(f"{where}: names must map class ids (0, 1, ...) to names") from e
        if ids != list(range(len(ids))):
            raise SourceError(f"{where}: class ids in names must be 0..{len(ids) - 1} without gaps, got {ids}")
        return [str(raw[k] if k in raw else raw[str(k)]) for k in ids]
    if isinstance(raw, list) and raw:
        return [str(name) for name in raw]
    raise SourceError(f"{where}: no class names (names: a list, or a mapping from id to name)")


def _yaml_names(data, where) -> list:
    """A data YAML's class names: ``names``; with only ``nc``, Ultralytics' ``class_0``, ``class_1``...
    Both given, their counts must agree (Ultralytics refuses them otherwise)."""
    nc = data.get("nc")
    if isinstance(nc, (str, float)) and not isinstance(nc, bool):  # "2" and 2.0 count, as Ultralytics takes them
        try:
            nc = int(nc) if float(nc) == int(float(nc)) else nc
        except (ValueError, OverflowError):
            pass
    if nc is not None and (not is_integer(nc) or isinstance(nc, bool) or not 0 < nc < UNNAMED_LABELS):
        raise SourceError(f"{where}: nc must be a class count from 1 to {UNNAMED_LABELS - 1}, not {nc!r}")
    if data.get("names") is None and nc is not None:
        return [f"class_{k}" for k in range(nc)]
    names = _names(data.get("names"), where)
    if nc is not None and nc != len(names):
        raise SourceError(f"{where}: names holds {len(names)} classes, nc says {nc}")
    return names


def _ultralytics_datasets_dir() -> str:
    """Ultralytics' ``datasets_dir`` setting, read from its settings file (importing Ultralytics would
    write one): ``$YOLO_CONFIG_DIR/Ultralytics`` (8.4; the folder itself before), else the user's
    config folder; without the file, its default: ``datasets`` in the current folder."""
    configured = os.environ.get("YOLO_CONFIG_DIR")
    if configured:
        folders = [os.path.join(os.path.expanduser(configured), "Ultralytics"), os.path.expanduser(configured)]
    elif sys.platform == "darwin":
        folders = [os.path.expanduser(os.path.join("~", "Library", "Application Support", "Ultralytics"))]
    else:
        folders = [os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser(os.path.join("~", ".config")),
                                "Ultralytics")]
    for folder in folders:
        try:
            with open(os.path.join(folder, "settings.json"), encoding="utf-8") as f:
                found = json.load(f).get("datasets_dir")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str) and found:
            return found
    return os.path.abspath("datasets")


def _split_entries(root, entries) -> list:
    """A split's entries under the dataset root, as Ultralytics' ``check_det_dataset`` places them (an
    entry ``../x`` that is not there is tried as ``x``); None unless every one of them exists."""
    placed = []
    for entry in entries:
        path = os.path.normpath(os.path.join(root, entry))
        if not os.path.exists(path) and entry.startswith("../"):
            path = os.path.normpath(os.path.join(root, entry[3:]))
        if not os.path.exists(path):
            return None
        placed.append(path)
    return placed


def _kpt_shape(data, where):
    """A pose YAML's ``kpt_shape`` (keypoints, values per keypoint), or None: its label rows are read
    for their boxes, as Ultralytics' detection training reads them."""
    shape = data.get("kpt_shape")
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise SourceError(f"{where}: kpt_shape: must be [keypoints, 2 or 3], got {shape!r}")
    return tuple(shape)


def _dataset_root(yaml_path, path, split, entries):
    """(dataset root, the split's entries as paths) for a data YAML whose ``path`` is ``path``. A
    relative ``path`` is tried from the YAML's folder, then where Ultralytics looks (the current
    folder, then its ``datasets_dir``); the root is the one place that holds the split, and a YAML that
    two different places would satisfy is refused rather than packed from a guess."""
    here = os.path.dirname(os.path.abspath(yaml_path))
    if isinstance(path, int) and not isinstance(path, bool):
        path = str(path)  # (a folder named 2024)
    if path is not None and not isinstance(path, str):
        raise SourceError(f"{display(yaml_path)}: path: must be a folder, not {type(path).__name__} {path!r}")
    if not path:
        candidates = [here]  # no path: the YAML's folder, for Ultralytics too
    elif os.path.isabs(path):
        candidates = [path]
    else:
        candidates = [os.path.join(here, path), os.path.abspath(path),
                      os.path.join(_ultralytics_datasets_dir(), path)]
    found = {}  # what the split is (its entries' real paths) -> (root, entries): the same files are no doubt
    for root in candidates:
        placed = _split_entries(os.path.normpath(root), entries)
        if placed is not None:
            found.setdefault(tuple(os.path.realpath(p) for p in placed), (os.path.normpath(root), placed))
    if len(found) > 1:
        first, second = (display(root) for root, _ in list(found.values())[:2])
        raise SourceError(f"{display(yaml_path)}: path: {path!r} makes split {split!r} other files in {first} than "
                          f"in {second} (from the YAML's folder, and where Ultralytics looks); give path: as an "
                          f"absolute folder")
    if not found:
        tried = ", ".join(dict.fromkeys(display(os.path.normpath(root)) for root in candidates))
        missing = [e for e in entries if all(_split_entries(os.path.normpath(r), [e]) is None for r in candidates)]
        raise SourceError(f"{display(yaml_path)}: split {split!r} ({', '.join(missing or entries)}): no such folder "
                          f"or file under {'any of ' if len(candidates) > 1 else ''}{tried}")
    return next(iter(found.values()))


def _images_under(top, others) -> list:
    """(sort key, path) of each image under ``top``, as Ultralytics' ``glob("**/*.*")`` finds them:
    hidden files and folders (``.ipynb_checkpoints``, macOS' ``._x.jpg``) left out; the key is the
    path from the folder's real path, as Ultralytics sorts them. The other files' paths go to
    ``others``."""
    found, real = [], os.path.realpath(top)
    for folder, dirs, files in os.walk(top, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        key = os.path.join(real, os.path.relpath(folder, top))
        for name in sorted(n for n in files if not n.startswith(".")):
            if name.lower().endswith(YOLO_IMAGE_EXTENSIONS):
                found.append((os.path.normpath(os.path.join(key, name)), os.path.join(folder, name)))
            elif not name.endswith(".txt"):  # (labels may lie beside their images)
                others.append(os.path.join(folder, name))
    return found


# the folders a YOLO images folder holds its splits in (Ultralytics', Roboflow's and COCO's names)
_SPLIT_NAME = re.compile(r"(train|val|valid|validation|test)(\d*)")


def _split_folder(src, split):
    """The folder of images a YOLO folder SRC packs: a dataset folder's ``images/<split>`` (train by
    default); an images folder's ``<split>`` folder; else the folder itself, which holds one split
    (``split`` then does not apply, and one holding the folders of several splits needs it)."""
    if os.path.isdir(os.path.join(src, "images")):
        folder = os.path.join(src, "images", split or "train")
        if not os.path.isdir(folder):
            raise SourceError(f"{display(src)}: no images/{split or 'train'} folder (--split chooses the split)")
        return folder
    try:
        splits = sorted(e.name for e in os.scandir(src) if _SPLIT_NAME.fullmatch(e.name) and e.is_dir())
    except OSError as e:
        raise SourceError(f"{display(src)}: cannot list the folder ({e.strerror or e})") from e
    if split is None:
        if len(splits) > 1:
            raise SourceError(f"{display(src)}: holds the folders of several splits ({', '.join(splits)}); "
                              f"--split chooses the one to pack")
        return src
    if os.path.isdir(os.path.join(src, split)):
        return os.path.join(src, split)
    if splits:
        raise SourceError(f"{display(src)}: no {split} folder (its split folders: {', '.join(splits)})")
    raise SourceError(f"{display(src)}: a folder of one split's images (no images/ or split folders in it): "
                      f"--split does not apply; leave it out, or give the dataset folder or its data YAML")


class YoloSource(DetectionSource):
    format = "yolo"
    min_side = YOLO_MIN_SIDE
    image_formats = YOLO_IMAGE_FORMATS

    def __init__(self, src, split=None, strict=False):
        super().__init__()
        src = os.fspath(src)
        self.root = src
        if not os.path.exists(src):
            raise SourceError(f"{display(src)}: no such file or folder")
        if not os.path.isfile(src) and not os.path.isdir(src):  # (a FIFO's reader would wait for a writer)
            raise SourceError(f"{display(src)}: not a regular file or a folder: --format yolo takes a data YAML "
                              f"or a folder")
        names, keypoints, self._others = None, None, []
        if os.path.isfile(src):
            if not src.endswith((".yaml", ".yml")):
                raise SourceError(f"{display(src)}: --format yolo takes a data YAML or a folder")
            data = _load_yaml(src)
            if split == "val" and data.get("val") in (None, "") and data.get("validation"):
                data["val"] = data["validation"]  # (Ultralytics renames the key)
            split = split or "train"
            if data.get(split) in (None, ""):
                known = [k for k in ("train", "val", "test") if data.get(k)]
                raise SourceError(f"{display(src)}: no split {split!r} (the YAML has {', '.join(known) or 'none'}; "
                                  f"--split chooses)")
            names = _yaml_names(data, display(src))
            keypoints = _kpt_shape(data, display(src))
            entries = data[split] if isinstance(data[split], list) else [data[split]]
            if not all(isinstance(entry, str) and entry for entry in entries):
                raise SourceError(f"{display(src)}: split {split!r} must be a path or a list of paths")
            base, entries = _dataset_root(src, data.get("path"), split, entries)
            listed = []
            for entry in entries:
                listed += self._split(entry)
            if strict and self.unreadable:
                raise SourceError(f"{self.unreadable[0]['path']}: {self.unreadable[0]['reason']} (--strict)")
            self.root = os.path.abspath(base)
        else:
            folder = _split_folder(src, split)
            listed = self._split(folder)
            names = self._classes_txt(src, folder)
            named, keypoints = self._folder_yaml(src)  # (its kpt_shape also beside a classes.txt)
            if names is not None and named is not None and names != named:
                raise SourceError(f"{display(src)}: classes.txt and the data YAML there name the classes otherwise "
                                  f"({names[:3]}... against {named[:3]}...); make them agree, or pack the YAML")
            names = names if names is not None else named
            self.root = os.path.abspath(src)
        images = [path for _, path in sorted(listed)]  # Ultralytics' get_img_files order: its paths sorted as text
        if not images:
            split = split or ("train" if os.path.isdir(os.path.join(src, "images")) else None)  # (a YAML's is set)
            where = f"in split {split!r}" if split else "in it"
            raise SourceError(f"{display(src)}: no image files {where} (extensions: {' '.join(YOLO_IMAGE_EXTENSIONS)})")
        labels_of = {image: label_path(image) for image in images}
        parsed = {image: self._labels(labels_of[image], keypoints) for image in images}
        if all(rows is None and problem is None for rows, problem, _ in parsed.values()):
            self.report.no_label_file = (f"none of its {len(images)} images has a label file "
                                         f"({display(labels_of[images[0]])} for {display(images[0])}, as Ultralytics "
                                         f"looks for them: a labels folder beside the images folder)")
            log.warning("%s: %s: every image is packed without objects", display(src), self.report.no_label_file)
        if names is None:  # the ids as names, up to the largest id used; a stray huge id leaves its image out
            for image, (rows, problem, keys) in parsed.items():
                if problem is None and rows is not None and len(rows):
                    problem = unnamed_label_problem(int(rows[:, 0].max()), "class id")
                    if problem is not None:
                        parsed[image] = (None, f"{problem}; give the class names in a data YAML or classes.txt",
                                         None)
            used = {int(k) for rows, _, _ in parsed.values() if rows is not None and len(rows) for k in rows[:, 0]}
            top = max(used, default=0)
            names = [str(k) for k in range(top + 1)]
            unused = len(names) - len(used)
            log.warning("%s: no class names (a data YAML's names or a classes.txt): %d class(es) named by their ids "
                        "0..%d%s (pack the dataset's data YAML to take its names)", display(src), len(names), top,
                        f", {unused} of which no box uses" if unused else "")
        self.classes = names
        for image in images:
            rel = os.path.relpath(image, self.root)
            rows, problem, keys = parsed[image]
            if problem is None and rows is not None and len(rows) and (rows[:, 0].max() >= len(names)):
                bad = int(rows[:, 0].max())
                problem = f"class id {bad} is not in the {len(names)} names (0..{len(names) - 1})"
            if problem is not None:
                if strict:
                    raise SourceError(f"{display(labels_of[image])}: {problem} (--strict)")
                label_file = display(os.path.relpath(labels_of[image], self.root))
                self.report.bad_labels.append({"path": display(rel), "reason": f"{label_file}: {problem}"})
                continue
            with self.report.noting(display(rel)):
                boxes = self._boxes(rows, keys, os.path.relpath(labels_of[image], self.root))
            self.report.negatives += not len(boxes)
            self.items.append(Item(rel, 0, path=image, boxes=boxes))
        self.ignored = [display(os.path.relpath(path, self.root)) for path in self._others]
        self._orphans(set(labels_of.values()))

    def _split(self, entry) -> list:
        if os.path.isdir(entry):
            return _images_under(entry, self._others)
        if os.path.isfile(entry) and entry.endswith(".txt"):
            return self._listed(entry)
        raise SourceError(f"{display(entry)}: a split is a folder of images or a .txt list of them")

    def _listed(self, entry) -> list:
        """The images a ``.txt`` list names, resolved as Ultralytics' ``get_img_files`` does: ``./x`` from
        the folder of the list (its real path: ``Path.resolve``), other relative lines from the current
        folder; images that are not there are reported (``unreadable``). Each with its sort key: the
        line as Ultralytics holds it (``./`` made the list's folder, other lines as written)."""
        parent = os.path.dirname(os.path.realpath(entry))
        try:
            with open(entry, encoding="utf-8-sig") as f:
                lines = f.read().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SourceError(f"{display(entry)}: cannot read the image list ({getattr(e, 'strerror', None) or e})") \
                from e
        images = []
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line.lower().endswith(YOLO_IMAGE_EXTENSIONS):
                continue
            key = parent + os.sep + line[2:] if line.startswith("./") else line
            path = os.path.normpath(key if line.startswith("./") else os.path.abspath(line))
            if os.path.isfile(path):
                images.append((key, path))
                continue
            where = "" if line.startswith("./") or os.path.isabs(line) else (
                " (a relative line not starting with ./ names a file of the current folder, as in Ultralytics)")
            self.unreadable.append({"path": display(line), "reason": f"line {number} of {display(entry)}: no such "
                                                                      f"file {display(path)}{where}"})
        return images

    @staticmethod
    def _classes_txt(src, folder):
        for candidate in (os.path.join(src, "classes.txt"), os.path.join(src, "labels", "classes.txt"),
                          os.path.join(os.path.dirname(label_path(os.path.join(folder, "x.jpg"))), "classes.txt")):
            if os.path.isfile(candidate):
                try:
                    with open(candidate, encoding="utf-8-sig") as f:
                        names = [line.strip() for line in f if line.strip()]
                except (OSError, UnicodeDecodeError) as e:
                    raise SourceError(f"{display(candidate)}: cannot read the class names "
                                      f"({getattr(e, 'strerror', None) or e})") from e
                if names:
                    return names
        return None

    @staticmethod
    def _folder_yaml(src):
        """(names, kpt_shape) of the data YAML in the dataset folder ``src`` (a ``.yaml``/``.yml`` file
        there with ``names`` or ``nc``), so that a split packed from the folder has the class names
        the YAML gives the others; (None, None) without one. Several that disagree are refused."""
        found = {}
        for entry in sorted(os.scandir(src), key=lambda e: e.name):
            if entry.name.endswith((".yaml", ".yml")) and entry.is_file():
                try:  # another YAML there (a config, notes) is none of the dataset's business
                    data = _load_yaml(entry.path)
                    if data.get("names") is not None or data.get("nc") is not None:
                        found[entry.path] = (_yaml_names(data, display(entry.path)),
                                             _kpt_shape(data, display(entry.path)))
                except SourceError as e:
                    log.debug("not a data YAML, left aside: %s", e)
        if len(set(map(repr, found.values()))) > 1:
            raise SourceError(f"{display(src)}: its data YAMLs ({', '.join(map(os.path.basename, found))}) give "
                              f"different class names; pack the one to use (SRC: the YAML, with --split)")
        return next(iter(found.values()), (None, None))

    @staticmethod
    def _labels(path, keypoints=None):
        """(rows as an N x 5 array of class, cx, cy, w, h, or None without a label file; the reason
        the file is unusable, or None; what tells each row apart from a repeat: its numbers in
        float32, a polygon's its points), read as Ultralytics' ``verify_image_label`` reads a file:
        UTF-8 with or without a byte-order mark; a pose row (``keypoints``: the YAML's ``kpt_shape``)
        its box; a file with a row of more than 6 values all polygons (each its bounding box)."""
        try:
            with open(open_regular(path, what="a label file"), encoding="utf-8-sig") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return None, None, None
        except (OSError, UnicodeDecodeError) as e:
            return None, f"cannot read the label file ({getattr(e, 'strerror', None) or e})", None
        except FormatError as e:  # a folder or a FIFO where the label file belongs: that image's problem
            return None, f"cannot read the label file ({str(e).split(': ', 1)[-1]})", None
        numbered = []
        for number, line in enumerate(lines, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                values = [float(v) for v in parts]
            except ValueError:
                return None, f"line {number}: not numbers: {line.strip()[:60]!r}", None
            if not np.isfinite(values).all():
                return None, f"line {number}: a value that is not finite", None
            if values[0] != int(values[0]) or values[0] < 0:
                return None, f"line {number}: class id {parts[0]} is not a non-negative integer", None
            if keypoints and len(values) == 5 + keypoints[0] * keypoints[1]:
                values = values[:5]  # a pose row: its box
            numbered.append((number, values))
        polygons = any(len(values) > 6 for _, values in numbered)
        rows, keys = [], []
        for number, values in numbered:
            if polygons and len(values) == 5:
                return None, (f"line {number}: boxes and polygons mixed in one file (Ultralytics ignores such an "
                              f"image)"), None
            if polygons and len(values) % 2 == 1:  # a polygon: its bounding box
                xs, ys = values[1::2], values[2::2]
                x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
                rows.append([values[0], (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
                keys.append(("polygon", *np.float32(values).tolist()))  # (distinct polygons may share a box)
            elif len(values) == 5 and not polygons:
                rows.append(values)
                keys.append(("box", *np.float32(values).tolist()))
            else:
                return None, f"line {number}: {len(values)} values (class cx cy w h, or class and a polygon)", None
            problem = _coordinates_problem(rows[-1])
            if problem and len(values) > 5:  # (Ultralytics checks a polygon's box: say which points made it)
                xs, ys = values[1::2], values[2::2]
                problem = (f"the bounding box (cx cy w h) of its polygon, x {min(xs):.4g} to {max(xs):.4g}, "
                           f"y {min(ys):.4g} to {max(ys):.4g}, has {problem}")
            if problem:
                return None, f"line {number}: {problem}", None
        return np.array(rows, np.float64).reshape(-1, 5), None, keys

    def _boxes(self, rows, keys, where):
        if rows is None or not len(rows):
            return np.zeros(0, fmt.BOX_RECORD)
        cx, cy, w, h = rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4]
        xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
        return boxes_from_xyxy(xyxy, rows[:, 0], np.zeros(len(rows)), lambda k: f"{display(where)}:{k + 1}",
                               self.report, keys)

    def _orphans(self, wanted):
        """Label files beside this split's with no image of their name at all (an image of another
        split, listed in its own .txt, is no orphan's)."""
        folders = {os.path.dirname(p) for p in wanted}
        for folder in sorted(folders):
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            try:
                beside = os.listdir(_images_folder(folder))
            except OSError:
                beside = []
            stems = {os.path.splitext(n)[0] for n in beside if n.lower().endswith(YOLO_IMAGE_EXTENSIONS)}
            others = {os.path.splitext(n)[0]: n for n in beside
                      if not n.lower().endswith(YOLO_IMAGE_EXTENSIONS) and not n.endswith(".txt")}
            for name in names:
                path, stem = os.path.join(folder, name), os.path.splitext(name)[0]
                if name.endswith(".txt") and name != "classes.txt" and path not in wanted and stem not in stems:
                    reason = "a label file without an image" if stem not in others else (
                        f"its image {display(others[stem])} has no image extension of Ultralytics' (ignored)")
                    self.report.orphans.append({"label": display(os.path.relpath(path, self.root)), "reason": reason})


# --- COCO ---------------------------------------------------------------------------------------
class CocoSource(DetectionSource):
    format = "coco"

    def __init__(self, annotations, images, strict=False):
        super().__init__()
        annotations, images = os.fspath(annotations), os.fspath(images)
        self.root = os.path.abspath(images)
        if not os.path.isdir(images):
            raise SourceError(f"{display(images)}: no such images folder")
        try:
            with open(open_regular(annotations, what="COCO annotations"), encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise SourceError(f"{display(annotations)}: cannot read ({e.strerror or e})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{display(annotations)}: not a JSON file ({e})") from e
        where = display(annotations)
        if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "categories")):
            raise SourceError(f"{where}: not COCO instances (needs lists 'images' and 'categories', and "
                              f"'annotations' for boxes)")
        try:
            categories = sorted(data["categories"], key=lambda c: _coco_id(c["id"]))
            self.category_ids = [_coco_id(c["id"]) for c in categories]
            self.classes = [str(c["name"]) for c in categories]
            label = {cid: k for k, cid in enumerate(self.category_ids)}
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(f"{where}: a category without a usable id or name ({e})") from e
        if not self.classes:
            raise SourceError(f"{where}: no categories")
        repeated = sorted({c for c in self.category_ids if self.category_ids.count(c) > 1})
        if repeated:
            raise SourceError(f"{where}: category ids repeat ({', '.join(map(str, repeated))})")
        records = {}  # image id -> its record: the last one listed, as COCO's API (and torchvision) keep it
        for k, record in enumerate(data["images"]):
            try:
                image_id = _coco_id(record["id"])
            except (KeyError, TypeError, ValueError) as e:
                self.report.bad_labels.append({"path": str(record.get("file_name", f"images[{k}]"))
                                               if isinstance(record, dict) else f"images[{k}]",
                                               "reason": f"an image record without a usable id ({e})"})
                continue
            if image_id in records:
                self.report.bad_labels.append({"path": str(records[image_id].get("file_name")), "reason": (
                    f"image id {image_id} is listed again (for {record.get('file_name')}): COCO's API keeps the "
                    f"last record of an id, so this one is left out")})
            records[image_id] = record
        files = {image_id: str(records[image_id].get("file_name")) for image_id in sorted(records)}
        if files and not data.get("annotations"):  # (a test split's image_info file lists images alone)
            self.report.no_label_file = (f"it lists {len(files)} images and "
                                         f"{'an empty' if 'annotations' in data else 'no'} 'annotations' list")
            log.warning("%s: %s: every image is packed without objects", where, self.report.no_label_file)
        by_image = {image_id: [] for image_id in files}
        for k, ann in enumerate(data.get("annotations") or []):
            name = f"annotation {ann.get('id', k)}" if isinstance(ann, dict) else f"annotation #{k}"
            problem, image_id, box = _annotation(ann, files, label)
            if problem is not None:
                named = f"{name} ({files[image_id]})" if image_id in files else name
                (self.report.orphans if problem.startswith("image id") else self.report.dropped).append(
                    {"label": named, "reason": problem})
                if strict:
                    raise SourceError(f"{where}: {named}: {problem} (--strict)")
                continue
            by_image[image_id].append((name, *box))
        listed = {}  # file name -> the image id that named it first
        for image_id, record in sorted(records.items()):
            if not isinstance(record.get("file_name"), str) or not record["file_name"]:
                self.report.bad_labels.append({"path": f"image id {record['id']}", "reason": (
                    f"file_name {json.dumps(record.get('file_name'))} is not a path")})
                continue
            file_name, anns = record["file_name"], by_image[image_id]
            if file_name in listed:  # one sample a file: the first record's (torchvision would make two samples)
                self.report.bad_labels.append({"path": file_name, "reason": (
                    f"listed again as image id {record['id']} (first as image id {listed[file_name]}): this "
                    f"record and its {len(anns)} annotation(s) left out")})
                continue
            listed[file_name] = record["id"]
            path = os.path.join(images, file_name)
            if not os.path.isfile(path):
                self.unreadable.append({"path": display(file_name), "reason": "listed in the annotations, " + (
                    "a folder, not an image file" if os.path.isdir(path) else "no such file")})
                if strict:
                    raise SourceError(f"{display(path)}: listed in {where}, no such file (--strict)")
                continue
            size, problem = _record_size(record, path)
            if problem is not None:
                self.report.bad_labels.append({"path": file_name, "reason": problem})
                continue
            width, height = size
            xyxy = [(x / width, y / height, (x + w) / width, (y + h) / height) for _, x, y, w, h, _, _ in anns]
            with self.report.noting(display(file_name)):
                boxes = boxes_from_xyxy(xyxy, [a[5] for a in anns], [a[6] for a in anns],
                                        lambda k, anns=anns, name=file_name: f"{anns[k][0]} ({name})", self.report,
                                        shown=_coco_bbox(width, height))
            self.report.negatives += not len(boxes)
            self.items.append(Item(file_name, 0, path=path, boxes=boxes, size=(width, height), image_id=image_id))
        if strict and self.report.bad_labels:
            raise SourceError(f"{where}: {self.report.bad_labels[0]['path']}: {self.report.bad_labels[0]['reason']} "
                              f"(--strict)")
        if not self.items:
            raise SourceError(f"{where}: none of its {len(records)} images is in {display(images)}")


def _record_size(record, path):
    """((width, height) the boxes of a COCO image record were drawn on, None; or None, why there is
    none). A record without both is given the file's own size, as stored (COCO's API and torchvision's
    ``CocoDetection`` need none: their boxes are in the pixels of the file as it is read)."""
    width, height = record.get("width"), record.get("height")
    if width is None and height is None:
        try:
            return stored_size(path), None
        except Exception as e:  # noqa: BLE001 - whatever PIL makes of a bad file is its reason
            return None, f"no width and height in its record, and the file's own size cannot be read ({e})"
    try:
        width, height = int(width), int(height)
    except (TypeError, ValueError):
        return None, (f"its record gives width {json.dumps(width)} and height {json.dumps(height)}: two sizes in "
                      f"pixels, or neither (the file's own size is then taken)")
    if width <= 0 or height <= 0:
        return None, f"declared size {width}x{height}"
    return (width, height), None


def _coco_id(value) -> int:
    """A COCO id: an integer (a JSON number with no fraction). Text is refused: COCO's API matches
    ids as they are given, so "4" names no image 4."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or \
            value != int(value):
        raise ValueError(f"id {value!r} is not an integer")
    return int(value)


def _field_id(ann, key):
    """(the id ``ann[key]`` holds, None; or None, why it holds none)."""
    try:
        return _coco_id(ann[key]), None
    except KeyError:
        return None, f"no {key}"
    except ValueError as e:
        return None, f"{key}: {e}"


def _annotation(ann, files, label):
    """A COCO annotation read: (why it gives no box, or None; its image id where it has one; its box
    as (x, y, w, h, class label, flags), or None)."""
    if not isinstance(ann, dict):
        return "not an object", None, None
    image_id, problem = _field_id(ann, "image_id")
    if problem is not None:
        return problem, None, None
    if image_id not in files:
        return f"image id {image_id} is not in 'images'", image_id, None
    cid, problem = _field_id(ann, "category_id")
    if problem is not None:
        return problem, image_id, None
    if cid not in label:
        return f"category id {cid} is not in 'categories'", image_id, None
    bbox = ann.get("bbox")
    if bbox is None:
        return "no bbox (a segmentation alone: gdsdata packs boxes)", image_id, None
    if not (isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             and np.isfinite(v) for v in bbox)):
        return f"bbox is not [x, y, w, h] numbers: {json.dumps(bbox)[:60]}", image_id, None
    crowd = ann.get("iscrowd") or 0  # (null or missing: not a crowd, as COCO's API reads it)
    if crowd not in (0, 1):  # (COCO's 0 or 1; True and 1.0 equal 1)
        return f"iscrowd is {json.dumps(crowd)[:30]}, not 0 or 1", image_id, None
    return None, image_id, (*(float(v) for v in bbox), label[cid], fmt.BOX_CROWD if crowd else 0)


def open_detection(format, src, *, split=None, annotations=None, strict=False):
    """The detection source of ``format`` ("yolo" or "coco") at ``src``."""
    remote = next((p for p in (src, annotations) if p is not None and is_url(str(p))), None)
    if remote is not None:
        raise SourceError(f"{remote}: --format {format} packs from local files (a URL is taken for image folders, "
                          f"tar shards and LMDBs); copy the dataset here first")
    if format == "yolo":
        source = YoloSource(src, split=split, strict=strict)
    elif format == "coco":
        if annotations is None:
            raise SourceError("--format coco needs the annotations JSON: gdsdata pack --format coco "
                              "ANNOTATIONS.json IMAGES OUT")
        source = CocoSource(annotations, src, strict=strict)
    else:
        raise ValueError(f"format must be 'folder', 'yolo' or 'coco', got {format!r}")
    _warn_repeated_names(source.classes, annotations or src)
    return source


def _warn_repeated_names(classes, where):
    """Class names that repeat (Ultralytics allows them) leave ``class_to_idx`` one label per name:
    said once, naming each repeat's labels."""
    labels = {}
    for k, name in enumerate(classes):
        labels.setdefault(name, []).append(k)
    repeats = {name: ks for name, ks in labels.items() if len(ks) > 1}
    if repeats:
        said = "; ".join(f"{name!r} is class {', '.join(map(str, ks))}" for name, ks in list(repeats.items())[:5])
        log.warning("%s: class names repeat (%s): the labels stay apart, but class_to_idx keeps each name's last",
                    display(where), said)
