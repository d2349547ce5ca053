"""The on-disk format of a gdsdata dataset, and nothing else.

A dataset is a folder holding ``index.gdsi`` and shard files ``shard-NNNNN.gds`` (NNNNN: the
shard's position in the index; ``merge`` may link in shards whose headers name another pack). Every integer is
little-endian; every structure is a numpy dtype with explicit ``<`` so that the files read the same on
any machine. ``docs/format.md`` gives the byte tables and ``tests/test_format.py`` checks these
dtypes against it.

Shard file: a ``SHARD_HEADER`` at offset 0, zero padding up to ``alignment``, then sample payloads,
each starting at a multiple of ``alignment`` and followed by zero padding up to the next multiple.

Index file: an ``INDEX_HEADER``, then the shard table (``SHARD_RECORD`` x num_shards), the sample
table (``SAMPLE_RECORD`` x num_samples), the strings blob (UTF-8 relative source paths, addressed by
``path_offset``/``path_length``), the metadata blob (UTF-8 JSON: class names, creation info) and,
for detection datasets, the annotation table: ``BOX_START`` x (num_samples + 1) (sample i's boxes
are rows ``box_start[i]`` to ``box_start[i + 1]``), then ``BOX_RECORD`` x num_boxes.
"""

import numpy as np

FORMAT_VERSION = 3  # of the index; version 2 indexes (no annotation table) read the same
READABLE_VERSIONS = (2, 3)
SHARD_VERSION = 2  # shards have not changed since version 2
INDEX_MAGIC = b"GDSINDEX"
SHARD_MAGIC = b"GDSSHARD"
INDEX_NAME = "index.gdsi"
REPORT_NAME = "pack_report.json"
TMP_SUFFIX = ".tmp"
JOURNAL_SUFFIX = ".journal"  # beside each finished shard while a pack runs, for --resume; removed at the end
MERGE_RECORD = "merge" + JOURNAL_SUFFIX  # a merge's dataset id while it builds, as a pack's journals hold it
DEFAULT_ALIGNMENT = 4096


def shard_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}.gds"


# Codecs (SAMPLE_RECORD.codec).
CODEC_JPEG = 1
CODEC_RAW = 2  # decoded uint8 pixels, height x width x components, row-major
CODEC_NAMES = {CODEC_JPEG: "jpeg", CODEC_RAW: "raw"}

# Chroma subsampling (SAMPLE_RECORD.subsampling); the values are nvjpegChromaSubsampling_t's.
SUBSAMPLING_444 = 0
SUBSAMPLING_422 = 1
SUBSAMPLING_420 = 2
SUBSAMPLING_440 = 3
SUBSAMPLING_411 = 4
SUBSAMPLING_410 = 5
SUBSAMPLING_GRAY = 6
SUBSAMPLING_NONE = 255  # raw samples
SUBSAMPLING_NAMES = {
    SUBSAMPLING_444: "4:4:4", SUBSAMPLING_422: "4:2:2", SUBSAMPLING_420: "4:2:0",
    SUBSAMPLING_440: "4:4:0", SUBSAMPLING_411: "4:1:1", SUBSAMPLING_410: "4:1:0",
    SUBSAMPLING_GRAY: "gray", SUBSAMPLING_NONE: "none",
}

# Sample flags (SAMPLE_RECORD.flags, a bit set).
FLAG_CONVERTED = 1  # re-encoded at pack time (the source was not stored byte for byte)
FLAG_RESIZED = 2  # downscaled at pack time (max side, or the raw codec's target size)

INDEX_HEADER = np.dtype([
    ("magic", "S8"),
    ("version", "<u2"),
    ("flags", "<u2"),
    ("alignment", "<u4"),
    ("num_samples", "<u8"),
    ("num_shards", "<u4"),
    ("num_classes", "<u4"),
    ("dataset_id", "S16"),
    ("shards_offset", "<u8"),
    ("samples_offset", "<u8"),
    ("strings_offset", "<u8"),
    ("strings_size", "<u8"),
    ("meta_offset", "<u8"),
    ("meta_size", "<u8"),
    ("body_crc32", "<u4"),
    ("annotations_offset", "<u8"),
    ("num_boxes", "<u8"),
    ("header_crc32", "<u4"),  # 0 in indexes written before it was (they read as before)
    ("reserved", "V8"),
])

SHARD_RECORD = np.dtype([
    ("size", "<u8"),
    ("first_sample", "<u8"),
    ("num_samples", "<u4"),
    ("crc32", "<u4"),
    ("origin_id", "S16"),  # dataset id in the shard's own header (the packer's; kept by merge)
    ("origin_index", "<u4"),  # shard index in the shard's own header
    ("reserved", "<u4"),
])

SAMPLE_RECORD = np.dtype([
    ("offset", "<u8"),
    ("path_offset", "<u8"),
    ("length", "<u4"),
    ("shard", "<u4"),
    ("label", "<u4"),
    ("width", "<u4"),
    ("height", "<u4"),
    ("crc32", "<u4"),
    ("path_length", "<u4"),
    ("codec", "u1"),
    ("components", "u1"),
    ("subsampling", "u1"),
    ("flags", "u1"),
])

# Box flags (BOX_RECORD.flags, a bit set).
BOX_CROWD = 1  # COCO's iscrowd: a region of many objects (kept, marked; detection losses usually skip it)

BOX_START = np.dtype("<u8")

BOX_RECORD = np.dtype([  # one object of a detection sample, in the stored image's frame
    ("x0", "<f4"),  # left, as a fraction of the image width
    ("y0", "<f4"),  # top, of the height
    ("x1", "<f4"),  # right
    ("y1", "<f4"),  # bottom
    ("label", "<u4"),  # class index into the metadata's classes
    ("flags", "<u4"),
])

SHARD_HEADER = np.dtype([
    ("magic", "S8"),
    ("version", "<u2"),
    ("reserved0", "<u2"),
    ("alignment", "<u4"),
    ("shard_index", "<u4"),
    ("num_samples", "<u4"),
    ("dataset_id", "S16"),
    ("reserved", "V24"),
])


def ident(field) -> bytes:
    """A 16-byte id field (``dataset_id``, ``origin_id``) as written: numpy's "S16" drops trailing
    zero bytes when it reads one, and an id ending in 0x00 (one in 256) must still name its shards'
    folders and match its shards' headers."""
    return bytes(field).ljust(16, b"\0")


def short_ident(ident_: bytes) -> bytes:
    """An id as gdsdata read it before ``ident``: without its trailing zero bytes. What was named
    or hashed with it then (shard folders of an append, Loader state fingerprints) stays the id's."""
    return ident_.rstrip(bytes(1))
