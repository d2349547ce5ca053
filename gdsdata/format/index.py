"""Reading, validating and writing ``index.gdsi`` (layout in ``format.py``)."""

import json
import os
import zlib
from dataclasses import dataclass

import numpy as np

from gdsdata.format import layout as fmt
from gdsdata.errors import FormatError
from gdsdata.format.shards import cannot_read, open_regular, read_header


@dataclass
class Index:
    root: str
    alignment: int
    dataset_id: bytes
    shards: np.ndarray  # SHARD_RECORD
    samples: np.ndarray  # SAMPLE_RECORD
    strings: bytes
    meta: dict
    body_crc32: int = 0  # of the index body: changes with any sample, shard, class or box
    box_start: np.ndarray = None  # BOX_START x (samples + 1), detection datasets only
    boxes: np.ndarray = None  # BOX_RECORD x boxes
    version: int = fmt.FORMAT_VERSION  # the index's format version as read

    @property
    def task(self) -> str:
        """"classify" (one label per sample) or "detect" (boxes per sample)."""
        return self.meta.get("task", "classify")

    @property
    def image_ids(self) -> list | None:
        """COCO's image id of each sample, in sample order (a pack of COCO annotations); else None."""
        return self.meta.get("detection", {}).get("image_ids")

    def sample_boxes(self, i: int) -> np.ndarray:
        """Sample i's boxes (BOX_RECORD rows; empty for a negative or a classification sample)."""
        if self.boxes is None:
            return np.zeros(0, fmt.BOX_RECORD)
        return self.boxes[int(self.box_start[i]):int(self.box_start[i + 1])]

    @property
    def fingerprint(self) -> str:
        """The dataset's identity: its id (from packing) and its index's checksum."""
        return f"{self.dataset_id.hex()}-{self.body_crc32:08x}"

    def flag_counts(self) -> tuple[int, int]:
        """(converted, resized): the samples re-encoded at pack time, and those downscaled."""
        flags = self.samples["flags"]
        return int(((flags & fmt.FLAG_CONVERTED) != 0).sum()), int(((flags & fmt.FLAG_RESIZED) != 0).sum())

    @property
    def legacy_fingerprint(self) -> str:
        """The fingerprint as gdsdata gave it before ids were read whole (``layout.ident``): an id
        ending in zero bytes lost them. Loader states saved then still resume."""
        return f"{fmt.short_ident(self.dataset_id).hex()}-{self.body_crc32:08x}"

    @property
    def classes(self):
        return list(self.meta["classes"])

    def __len__(self):
        return len(self.samples)

    @property
    def all_raw(self) -> bool:
        """Whether the dataset holds raw pixels only (a pack has one codec); False when empty."""
        return bool(len(self.samples)) and bool((self.samples["codec"] == fmt.CODEC_RAW).all())

    def path(self, i: int) -> str:
        record = self.samples[i]
        start = int(record["path_offset"])
        return self.strings[start:start + int(record["path_length"])].decode("utf-8", "surrogateescape")

    def shard_path(self, shard: int) -> str:
        return os.path.join(self.root, fmt.shard_name(shard))

    def describe(self, i: int) -> str:
        """How an error names sample i: index, source path, shard and offset."""
        record = self.samples[i]
        return (f"sample {i} ({self.path(i)}, {fmt.shard_name(int(record['shard']))} "
                f"offset {int(record['offset'])})")


def write(out_dir, alignment, dataset_id, shards, samples, strings: bytes, meta: dict, boxes=None,
          box_start=None) -> str:
    """Write the index under a temporary name, then rename it: the dataset is complete from here.
    ``boxes`` and ``box_start`` (detection datasets, ``meta["task"] == "detect"``): every sample's
    boxes in sample order, and where each sample's run starts (``len(samples) + 1`` entries)."""
    shards = np.ascontiguousarray(shards, fmt.SHARD_RECORD)
    samples = np.ascontiguousarray(samples, fmt.SAMPLE_RECORD)
    if (meta.get("task") == "detect") != (boxes is not None):
        raise ValueError("a detection index has boxes and box starts; a classification index has neither")
    annotations = b""
    if boxes is not None:
        boxes = np.ascontiguousarray(boxes, fmt.BOX_RECORD)
        box_start = np.ascontiguousarray(box_start, fmt.BOX_START)
        if len(box_start) != len(samples) + 1 or int(box_start[-1]) != len(boxes):
            raise ValueError("box starts must have one entry per sample and end at the number of boxes")
        annotations = box_start.tobytes() + boxes.tobytes()
    meta_bytes = json.dumps(meta, sort_keys=True).encode("utf-8")  # ASCII escapes: any class name survives
    header = np.zeros((), fmt.INDEX_HEADER)
    header["magic"] = fmt.INDEX_MAGIC
    header["version"] = fmt.FORMAT_VERSION
    header["alignment"] = alignment
    header["num_samples"] = len(samples)
    header["num_shards"] = len(shards)
    header["num_classes"] = len(meta["classes"])
    header["dataset_id"] = dataset_id
    offset = fmt.INDEX_HEADER.itemsize
    header["shards_offset"] = offset
    offset += shards.nbytes
    header["samples_offset"] = offset
    offset += samples.nbytes
    header["strings_offset"] = offset
    header["strings_size"] = len(strings)
    offset += len(strings)
    header["meta_offset"] = offset
    header["meta_size"] = len(meta_bytes)
    offset += len(meta_bytes)
    if boxes is not None:
        header["annotations_offset"] = offset
        header["num_boxes"] = len(boxes)
    body = shards.tobytes() + samples.tobytes() + strings + meta_bytes + annotations
    header["body_crc32"] = zlib.crc32(body)
    header["header_crc32"] = _header_crc(header)
    path = os.path.join(str(out_dir), fmt.INDEX_NAME)
    with open(path + fmt.TMP_SUFFIX, "wb") as f:
        f.write(header.tobytes())
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + fmt.TMP_SUFFIX, path)
    return path


def _section(raw, path, name, offset, size):
    if offset < fmt.INDEX_HEADER.itemsize or offset + size > len(raw):
        raise FormatError(f"{path}: {name} section (offset {offset}, {size} bytes) lies outside the "
                          f"file ({len(raw)} bytes): truncated or corrupt index")
    return raw[offset:offset + size]


def _header_crc(header) -> int:
    """``header_crc32`` for ``header``: the CRC-32 of its bytes with that field zero; 1 for a CRC of
    0 (which marks an index written before the field was)."""
    zeroed = header.copy()
    zeroed["header_crc32"] = 0
    return zlib.crc32(zeroed.tobytes()) or 1


def _header_intact(header) -> bool:
    return int(header["header_crc32"]) in (0, _header_crc(header))


def header_id(root) -> "bytes | None":
    """The dataset id in ``root``'s index header, without reading or checking the rest (the shards
    may be gone: a dataset being removed); None without a readable index."""
    try:
        with open(open_regular(os.path.join(os.fspath(root), fmt.INDEX_NAME), what="an index"), "rb") as f:
            raw = f.read(fmt.INDEX_HEADER.itemsize)
    except (OSError, FormatError):
        return None
    if len(raw) < fmt.INDEX_HEADER.itemsize:
        return None
    header = np.frombuffer(raw, fmt.INDEX_HEADER, count=1)[0]
    if header["magic"] != fmt.INDEX_MAGIC or not _header_intact(header):  # (a damaged id owns no shards)
        return None
    return fmt.ident(header["dataset_id"])


def stamp(root):
    """Which index file ``root`` holds: (inode, modification time, size), or None. ``write`` replaces
    the file whole, by a rename, so a new index has a new stamp."""
    try:
        info = os.stat(os.path.join(root, fmt.INDEX_NAME))
    except (OSError, TypeError, ValueError):
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def still(root, before, doing: str):
    """Raise ``FormatError`` if ``root`` no longer holds the index it held at ``stamp`` ``before``:
    what ``doing`` found (shards missing, say) may be a dataset swapped out meanwhile."""
    if stamp(root) != before:
        raise FormatError(f"{root}: the dataset changed while it was being {doing} (a pack --overwrite, "
                          f"--append or merge into it?): try again once that is done")


def load(root, shards: bool = True) -> Index:
    """Read and check a dataset's index and (``shards``) its shard files' headers and sizes; raises
    ``FormatError`` naming the file. ``gdsdata verify`` checks the shards itself, each in turn."""
    root = os.fspath(root)
    path = os.path.join(root, fmt.INDEX_NAME)
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise FormatError(f"{root}: a file, not a dataset folder (give the folder that holds "
                              f"{fmt.INDEX_NAME} and the shards)")
        raise FormatError(f"{root}: no such dataset folder")
    if not os.path.exists(path):
        from gdsdata.format.lock import writing

        names = os.listdir(root)
        if (writer := writing(root)) is not None:
            hint = f" yet: a gdsdata {writer} is writing it; wait for it to finish"
        elif fmt.MERGE_RECORD in names:
            hint = " (an unfinished merge: merge again with --overwrite)"
        elif any(n.endswith(fmt.TMP_SUFFIX) or n.endswith(".gds") for n in names):
            hint = " (an unfinished pack: finish it with --resume, or pack again with --overwrite)"
        elif names == [fmt.REPORT_NAME]:
            hint = f" (a pack into it stopped before it wrote a shard: {fmt.REPORT_NAME} says why; pack again)"
        else:
            hint = " (an image folder? pack it first: gdsdata pack SRC OUT)"
        raise FormatError(f"{path}: no index, so {root} is not a finished gdsdata dataset{hint}")
    with open(open_regular(path, what="an index"), "rb") as f:
        raw = f.read()
    if len(raw) < fmt.INDEX_HEADER.itemsize:
        raise FormatError(f"{path}: truncated index ({len(raw)} bytes, shorter than its header)")
    header = np.frombuffer(raw, fmt.INDEX_HEADER, count=1)[0]
    if header["magic"] != fmt.INDEX_MAGIC:
        raise FormatError(f"{path}: not a gdsdata index (bad magic)")
    if not _header_intact(header):  # (before the version: a damaged one is no newer format)
        raise FormatError(f"{path}: index header checksum mismatch (corrupt index)")
    if header["version"] not in fmt.READABLE_VERSIONS:
        raise FormatError(f"{path}: format version {header['version']}; this gdsdata reads versions "
                          f"{', '.join(map(str, fmt.READABLE_VERSIONS))} (upgrade gdsdata, or pack again)")
    num_samples = int(header["num_samples"])
    sections = _sections(header)
    body = {name: _section(raw, path, name, offset, size) for name, offset, size in sections}
    shards_raw, samples_raw = body["shard table"], body["sample table"]
    strings, meta_raw = body["strings"], body["metadata"]
    body_start = fmt.INDEX_HEADER.itemsize
    if zlib.crc32(raw[body_start:]) != int(header["body_crc32"]):
        raise FormatError(f"{path}: index checksum mismatch (corrupt or truncated index)")
    _check_layout(sections, len(raw), path)
    try:
        meta = json.loads(meta_raw.decode("utf-8"))
        classes = meta["classes"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: unreadable metadata or source paths ({e})") from e
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise FormatError(f"{path}: the metadata's class list is not a list of names")
    odd = next(((key, kind) for key, kind in _META_TYPES.items()
                if meta.get(key) is not None and not isinstance(meta[key], kind)), None)
    if odd is not None:
        raise FormatError(f"{path}: corrupt index metadata (its {odd[0]!r} is {type(meta[odd[0]]).__name__}, not "
                          f"{odd[1].__name__})")
    if len(classes) != int(header["num_classes"]):
        raise FormatError(f"{path}: {len(classes)} class names, header says {header['num_classes']}")
    box_start = boxes = None
    if meta.get("task") == "detect":
        if "annotation table" not in body:
            raise FormatError(f"{path}: a detection dataset without its annotation table (corrupt index)")
        starts_size = (num_samples + 1) * fmt.BOX_START.itemsize
        annotations = body["annotation table"]
        box_start = np.frombuffer(annotations[:starts_size], fmt.BOX_START).copy()
        boxes = np.frombuffer(annotations[starts_size:], fmt.BOX_RECORD).copy()
    index = Index(root, int(header["alignment"]), fmt.ident(header["dataset_id"]),
                  np.frombuffer(shards_raw, fmt.SHARD_RECORD).copy(),
                  np.frombuffer(samples_raw, fmt.SAMPLE_RECORD).copy(), strings, meta, int(header["body_crc32"]),
                  box_start, boxes, int(header["version"]))
    _check(index, path, shards)
    return index


def _sections(header) -> list:
    """(name, offset, size) of each section of the index body the header describes, in file order
    (``write`` lays them out so); the annotation table where there is one (format 3, detection)."""
    num_samples = int(header["num_samples"])
    sections = [("shard table", int(header["shards_offset"]), int(header["num_shards"]) * fmt.SHARD_RECORD.itemsize),
                ("sample table", int(header["samples_offset"]), num_samples * fmt.SAMPLE_RECORD.itemsize),
                ("strings", int(header["strings_offset"]), int(header["strings_size"])),
                ("metadata", int(header["meta_offset"]), int(header["meta_size"]))]
    if header["version"] >= 3 and int(header["annotations_offset"]):
        boxes = int(header["num_boxes"])
        sections.append(("annotation table", int(header["annotations_offset"]),
                         (num_samples + 1) * fmt.BOX_START.itemsize + boxes * fmt.BOX_RECORD.itemsize))
    return sections


def _check_layout(sections, file_size: int, path: str):
    """The header's counts and offsets against the body they describe (its checksum covers the body
    only): the sections follow each other from the header to the end of the file. A damaged count or
    offset would otherwise load as a smaller dataset, or shifted names, that every checksum still
    passes (``_check`` adds that the shards hold the samples)."""
    at = fmt.INDEX_HEADER.itemsize
    for name, offset, size in sections:
        if offset != at:
            raise FormatError(f"{path}: corrupt index header (its {name} should start at byte {at}, the header "
                              f"says {offset})")
        at += size
    if at != file_size:
        raise FormatError(f"{path}: corrupt index header (its sections end at byte {at}, the file at {file_size})")


def _check(index: Index, path: str, shards_too: bool = True):
    """Cross-check the tables against each other and (``shards_too``) against the shard files on disk."""
    samples, shards = index.samples, index.shards
    if int(shards["num_samples"].sum()) != len(samples):  # (a damaged count in the header: see _check_layout)
        raise FormatError(f"{path}: corrupt index header ({len(samples)} samples, its shards hold "
                          f"{int(shards['num_samples'].sum())})")
    if len(samples) and int(samples["shard"].max()) >= len(shards):
        bad = int(np.argmax(samples["shard"] >= len(shards)))
        raise FormatError(f"{path}: sample {bad} points to shard {samples['shard'][bad]}, "
                          f"but the dataset has {len(shards)} shards")
    if len(samples) and int(samples["label"].max()) >= len(index.meta["classes"]):
        bad = int(np.argmax(samples["label"] >= len(index.meta["classes"])))
        raise FormatError(f"{path}: sample {bad} has label {samples['label'][bad]} beyond the class list")
    path_ends = samples["path_offset"] + samples["path_length"]
    if len(samples) and int(path_ends.max()) > len(index.strings):
        raise FormatError(f"{path}: a source path lies outside the strings section")
    if shards_too:
        for shard, last_end in enumerate(last_sample_ends(index)):
            check_shard(index, shard, int(last_end))
    if index.boxes is not None:
        _check_boxes(index, path)
    ids = index.image_ids
    if ids is not None and (not isinstance(ids, list) or len(ids) != len(samples)
                            or not all(type(i) is int for i in ids)):
        raise FormatError(f"{path}: corrupt index metadata (its image ids are not one integer a sample)")
    unaligned = samples["offset"] % index.alignment != 0
    if unaligned.any():
        raise FormatError(f"{path}: {index.describe(int(np.argmax(unaligned)))} is not aligned to "
                          f"{index.alignment} bytes")


_META_TYPES = {"task": str, "source": str, "created": str, "gdsdata_version": str, "listing": str, "options": dict,
               "counts": dict, "part": dict, "detection": dict, "merged_from": list, "appended": list}


def last_sample_ends(index: Index) -> np.ndarray:
    """Where each shard's last sample ends (0 for one without samples), found for every shard at once."""
    samples = index.samples
    last = np.zeros(len(index.shards), np.int64)
    np.maximum.at(last, samples["shard"].astype(np.int64), (samples["offset"] + samples["length"]).astype(np.int64))
    return last


def shard_problem(index: Index, shard: int, last_end: int = None) -> str | None:
    """What ``check_shard`` finds wrong with a shard file, as one line naming it; None when sound."""
    try:
        check_shard(index, shard, last_end)
    except FileNotFoundError:
        return f"{index.shard_path(shard)}: missing"
    except FormatError as e:
        return str(e)  # (it names the file)
    except OSError as e:
        return cannot_read(index.shard_path(shard), e)
    return None


def check_shard(index: Index, shard: int, last_end: int = None):
    """Shard ``shard``'s file against the index: its header, its size, and that its samples lie inside
    it (``last_end``: where its last sample ends, if known); raises ``FormatError`` naming it."""
    record, samples = index.shards[shard], index.samples
    shard_path = index.shard_path(shard)
    read_header(shard_path, int(record["origin_index"]), fmt.ident(record["origin_id"]), index.alignment,
                int(record["num_samples"]))
    size = os.path.getsize(shard_path)
    if size != int(record["size"]):
        raise FormatError(f"{shard_path}: {size} bytes on disk, the index records {record['size']} "
                          f"(truncated or replaced shard)")
    if last_end is not None and last_end <= size:
        return
    mine = np.flatnonzero(samples["shard"] == shard)
    ends = samples["offset"][mine] + samples["length"][mine]
    if len(mine) and int(ends.max()) > size:
        bad = int(mine[np.argmax(ends)])
        raise FormatError(f"{os.path.join(index.root, fmt.INDEX_NAME)}: {index.describe(bad)} ends at byte "
                          f"{int(ends.max())}, past the end of its shard ({size} bytes)")


def _check_boxes(index: Index, path: str):
    starts, boxes = index.box_start.astype(np.int64), index.boxes
    if starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] != len(boxes):
        raise FormatError(f"{path}: the annotation table's box starts are not an increasing run from 0 to "
                          f"{len(boxes)} (corrupt index)")
    corners = np.stack([boxes[k] for k in ("x0", "y0", "x1", "y1")], axis=1) if len(boxes) else np.zeros((0, 4))
    bad = ~np.isfinite(corners).all(1) | (corners < 0).any(1) | (corners > 1).any(1) | \
        (corners[:, 2] <= corners[:, 0]) | (corners[:, 3] <= corners[:, 1]) | (boxes["label"] >= len(index.classes))
    if bad.any():
        row = int(np.argmax(bad))
        sample = int(np.searchsorted(starts, row, side="right") - 1)
        raise FormatError(f"{path}: box {row} of {index.describe(sample)} is not a box inside the image with a "
                          f"known class ({corners[row].tolist()}, label {int(boxes['label'][row])})")
