"""``gdsdata merge``: join datasets packed as parts (``pack --num-parts N --part K``) into one.

Shard data is not copied: each part's shards are hard-linked into the output (symbolic links across
filesystems), or copied with ``copy=True``. The merged index renumbers the shard files and keeps each
shard's origin (the id and index in its header, format.md). Parts must share the class list and the
alignment; their samples follow each other in the order the parts are given.
"""

import datetime
import errno
import logging
import os
import shutil

import numpy as np

from . import __version__
from . import format as fmt
from . import index as index_io
from .errors import SourceError
from .packer import prepare_output

log = logging.getLogger(__name__)


def _place(src, dst, copy):
    if copy:
        shutil.copyfile(src, dst)
        return "copied"
    try:
        os.link(src, dst)
        return "hard-linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        os.symlink(os.path.abspath(src), dst)
        return "symlinked"


def merge(parts, out, *, copy=False, overwrite=False) -> dict:
    """Merge the datasets ``parts`` into ``out``; returns a summary."""
    if not parts:
        raise SourceError("merge needs at least one part")
    out = os.path.abspath(os.fspath(out))
    indexes = [index_io.load(p) for p in parts]
    first = indexes[0]
    for part, index in zip(parts, indexes):
        if index.classes != first.classes:
            raise SourceError(f"{part}: its class list differs from {parts[0]}'s; parts must be packed from "
                              f"the same source (pack --num-parts N --part K)")
        codec, first_codec = index.meta.get("options", {}).get("codec"), first.meta.get("options", {}).get("codec")
        if codec != first_codec:
            raise SourceError(f"{part}: packed with codec {codec}, {parts[0]} with {first_codec}")
        if index.alignment != first.alignment:
            raise SourceError(f"{part}: alignment {index.alignment}, {parts[0]} has {first.alignment}")
        if os.path.abspath(index.root) == out:
            raise SourceError(f"{part}: a part cannot be merged into itself")
    prepare_output(out, overwrite)
    shard_rows, sample_tables, strings, how = [], [], bytearray(), set()
    sample_base = 0
    for index in indexes:
        shard_base = len(shard_rows)
        for s in range(len(index.shards)):
            how.add(_place(index.shard_path(s), os.path.join(out, fmt.shard_name(shard_base + s)), copy))
            row = index.shards[s].copy()
            row["first_sample"] += sample_base
            shard_rows.append(row)
        samples = index.samples.copy()
        samples["shard"] += shard_base
        samples["path_offset"] += len(strings)
        sample_tables.append(samples)
        strings += index.strings
        sample_base += len(samples)
    samples = np.concatenate(sample_tables)
    counts = [index.meta.get("counts", {}) for index in indexes]
    meta = {
        "classes": first.classes,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gdsdata_version": __version__,
        "source": first.meta.get("source"),
        "options": first.meta.get("options", {}),
        "merged_from": [{"path": os.path.abspath(index.root), "dataset_id": index.dataset_id.hex()}
                        for index in indexes],
        "counts": {"packed": len(samples),
                   **{k: sum(c.get(k, 0) for c in counts) for k in ("skipped", "converted", "resized", "ignored")},
                   "per_class": np.bincount(samples["label"], minlength=len(first.classes)).tolist()},
    }
    shards = np.array(shard_rows, dtype=fmt.SHARD_RECORD)
    index_io.write(out, first.alignment, os.urandom(16), shards, samples, bytes(strings), meta)
    log.info("merged %d parts: %d samples, %d shards (%s)", len(parts), len(samples), len(shards), ", ".join(how))
    return {"out": out, "parts": len(parts), "samples": len(samples), "shards": len(shards),
            "shards_placed": sorted(how)}
