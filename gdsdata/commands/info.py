"""``gdsdata inspect``: what a packed dataset holds (counts, sizes, codecs, conversions, overhead)."""

import os

import numpy as np

from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io


def _stats(values):
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return {"min": 0, "mean": 0, "max": 0}
    return {"min": int(values.min()), "mean": round(float(values.mean()), 1), "max": int(values.max())}


def _tally(values, names):
    kinds, counts = np.unique(values, return_counts=True)
    return {names.get(int(k), f"unknown({int(k)})"): int(c) for k, c in zip(kinds, counts)}


def _shard_folders(index) -> dict:
    """Where the shard files are (links followed): folder -> how many, and the devices they are on."""
    folders, devices = {}, set()
    for k in range(len(index.shards)):
        path = os.path.realpath(index.shard_path(k))
        folder = os.path.dirname(path)
        folders[folder] = folders.get(folder, 0) + 1
        try:
            devices.add(os.stat(path).st_dev)
        except OSError:  # a missing shard: said in "problems"
            pass
    return {"folders": folders, "devices": len(devices)}


def info(root) -> dict:
    """What a dataset holds (what ``gdsdata inspect`` shows), as a dict: samples, classes and the
    count per class, shards, payload and alignment overhead, image sizes, codecs and chroma
    subsampling, what was converted at pack time, and where it came from (parts, merges, appends).

    Parameters
    ----------
    root : str or os.PathLike
        The dataset folder.

    Returns
    -------
    dict
        Plain values (``json.dumps`` takes it); ``gdsdata inspect --json`` prints the same.
    """
    before = index_io.stamp(root)
    index = index_io.load(root, shards=False)  # a damaged shard is said below ("problems"), not fatal here
    samples, shards = index.samples, index.shards
    problems = [problem for shard, last_end in enumerate(index_io.last_sample_ends(index))
                if (problem := index_io.shard_problem(index, shard, int(last_end))) is not None]
    if problems:
        index_io.still(root, before, "inspected")
    converted, resized = index.flag_counts()
    payload = int(samples["length"].sum())
    stored = int(shards["size"].sum())
    per_class = np.bincount(samples["label"], minlength=len(index.classes))
    meta = index.meta
    out = {
        "path": os.path.abspath(index.root),
        "format_version": index.version,
        "created": meta.get("created"),
        "gdsdata_version": meta.get("gdsdata_version"),
        "samples": len(samples),
        "classes": len(index.classes),
        "per_class": {name: int(n) for name, n in zip(index.classes, per_class)},
        "shards": len(shards),
        "alignment": index.alignment,
        "payload_bytes": payload,
        "shard_bytes": stored,
        "alignment_overhead": round((stored - payload) / stored, 5) if stored else 0.0,
        "sample_bytes": _stats(samples["length"]),
        "width": _stats(samples["width"]),
        "height": _stats(samples["height"]),
        "codecs": _tally(samples["codec"], fmt.CODEC_NAMES),
        "subsampling": _tally(samples["subsampling"], fmt.SUBSAMPLING_NAMES),
        "stored_as_is": len(samples) - converted,
        "converted": converted,
        "resized": resized,
        "pack_options": meta.get("options", {}),
        "pack_counts": meta.get("counts", {}),
        "part": meta.get("part"),
        "merged_from": [m["path"] for m in meta.get("merged_from", [])],
        "appended": meta.get("appended", []),
        "task": index.task,
        "shard_folders": _shard_folders(index),
        "problems": problems,  # shard files missing, cut short or not the index's: the dataset does not open
    }
    if index.task == "detect":
        per_image = np.diff(index.box_start.astype(np.int64))
        boxes = index.boxes
        width = (boxes["x1"] - boxes["x0"]) * samples["width"].repeat(per_image)
        height = (boxes["y1"] - boxes["y0"]) * samples["height"].repeat(per_image)
        area = width * height  # COCO's size classes by box area, in pixels of the stored images (COCOeval: the
        # annotations' own area, a mask's for a segmentation, which the pack does not keep)
        out["per_class"] = {name: int(n) for name, n in zip(
            index.classes, np.bincount(boxes["label"], minlength=len(index.classes)))}
        out["detection"] = {
            "format": meta.get("detection", {}).get("format"),
            "boxes": len(boxes),
            "boxes_per_image": _stats(per_image),
            "negatives": int((per_image == 0).sum()),
            "crowd": int(((boxes["flags"] & fmt.BOX_CROWD) != 0).sum()),
            "small_medium_large": [int((area < 32 ** 2).sum()), int(((area >= 32 ** 2) & (area < 96 ** 2)).sum()),
                                   int((area >= 96 ** 2).sum())],
            # images downscaled at pack time: their boxes measured in the smaller stored frame
            "resized_images": int(((samples["flags"] & fmt.FLAG_RESIZED) != 0).sum()),
        }
    return out
