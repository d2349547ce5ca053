"""``gdsdata pack``: turn an ImageFolder tree into aligned shards plus an index.

Flow: scan the source (labels as torchvision's ImageFolder assigns them), validate and normalise
every image in a process pool (``normalize.prepare``), append the results in source order to shards
(``shards.ShardWriter``), write ``pack_report.json``, and write the index last. Until the index is
renamed into place the folder is not a dataset; on failure the shards written so far are removed.
"""

import datetime
import json
import logging
import multiprocessing
import os
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from . import __version__
from . import format as fmt
from . import index as index_io
from .errors import BadImageError, GdsDataError, OutputExistsError, SourceError
from .normalize import PackOptions, prepare
from .shards import ShardWriter

log = logging.getLogger(__name__)

# The extensions torchvision's ImageFolder accepts; other files are ignored, not reported as bad.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class PackResult:
    out: str
    packed: int
    converted: int
    resized: int
    shards: int
    bytes: int
    seconds: float
    skipped: list = field(default_factory=list)  # [{"path", "reason"}]
    ignored: list = field(default_factory=list)  # relative paths of non-image files
    report_path: str = ""


def scan(src):
    """List an ImageFolder tree: (class names, [(relative path, label)]), in ImageFolder's order."""
    src = os.fspath(src)
    if not os.path.exists(src):
        raise SourceError(f"{src}: no such folder")
    if not os.path.isdir(src):
        raise SourceError(f"{src}: not a folder (expected one subfolder per class)")
    classes = sorted(entry.name for entry in os.scandir(src) if entry.is_dir())
    if not classes:
        raise SourceError(f"{src}: no class subfolders (expected the ImageFolder layout SRC/CLASS/IMAGE)")
    items, ignored = [], []
    for label, name in enumerate(classes):
        for root, _, names in sorted(os.walk(os.path.join(src, name), followlinks=True)):
            for fname in sorted(names):
                rel = os.path.relpath(os.path.join(root, fname), src)
                (items if fname.lower().endswith(IMAGE_EXTENSIONS) else ignored).append((rel, label))
    if not items:
        raise SourceError(f"{src}: no image files in its {len(classes)} class folders "
                          f"(extensions: {' '.join(IMAGE_EXTENSIONS)})")
    return classes, items, [rel for rel, _ in ignored]


def _prepare_file(job):
    src, rel, options = job
    try:
        with open(os.path.join(src, rel), "rb") as f:
            data = f.read()
        return rel, prepare(data, options), None
    except BadImageError as e:
        return rel, None, str(e)
    except OSError as e:
        return rel, None, f"cannot read: {e.strerror or e}"


def _gdsdata_owned(name):
    return (name in (fmt.INDEX_NAME, fmt.REPORT_NAME) or name.endswith(fmt.TMP_SUFFIX)
            or (name.startswith("shard-") and name.endswith(".gds")))


def _prepare_output(out, overwrite):
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExistsError(f"{out}: exists and is not a folder")
    existing = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if existing and not overwrite:
        what = "holds a gdsdata dataset" if fmt.INDEX_NAME in existing else "is not empty"
        raise OutputExistsError(f"{out}: {what}; pass --overwrite to replace it (left untouched)")
    foreign = [n for n in existing if not _gdsdata_owned(n)]
    if foreign:
        raise OutputExistsError(f"{out}: refusing to overwrite, it holds files gdsdata did not write "
                                f"(e.g. {foreign[0]})")
    if fmt.INDEX_NAME in existing:  # the dataset stops being one before anything else goes
        os.unlink(os.path.join(out, fmt.INDEX_NAME))
    for name in existing:
        if name != fmt.INDEX_NAME:
            os.unlink(os.path.join(out, name))
    os.makedirs(out, exist_ok=True)


def _results(jobs, workers):
    if workers <= 1:
        yield from map(_prepare_file, jobs)
        return
    # fork: workers start at once and need not re-import __main__; a worker that dies raises
    # BrokenProcessPool here instead of hanging the pack.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        yield from pool.map(_prepare_file, jobs, chunksize=8)


def _write_report(out, report):
    path = os.path.join(out, fmt.REPORT_NAME)
    with open(path + fmt.TMP_SUFFIX, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    os.replace(path + fmt.TMP_SUFFIX, path)
    return path


def _remove_shards(out, writer):
    writer.abort()
    for shard in range(writer.next_shard):
        try:
            os.unlink(os.path.join(out, fmt.shard_name(shard)))
        except FileNotFoundError:
            pass


def pack(src, out, *, options: PackOptions = None, shard_size: int = 1 << 30,
         alignment: int = fmt.DEFAULT_ALIGNMENT, workers: int = 0, strict: bool = False,
         overwrite: bool = False, progress: bool = False) -> PackResult:
    """Pack the ImageFolder tree ``src`` into the dataset folder ``out``."""
    options = options or PackOptions()
    src, out = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if shard_size < alignment * 2:
        raise ValueError(f"shard size must be at least twice the alignment ({alignment * 2} bytes)")
    workers = workers or os.cpu_count() or 1
    started = time.perf_counter()
    classes, items, ignored = scan(src)
    _prepare_output(out, overwrite)
    dataset_id = os.urandom(16)
    writer = ShardWriter(out, alignment, shard_size, dataset_id)
    records, strings, skipped = [], bytearray(), []
    converted = resized = 0
    jobs = [(src, rel, options) for rel, _ in items]
    labels = dict(items)
    report = {"source": src, "out": out, "status": "failed", "classes": len(classes),
              "ignored": ignored, "skipped": skipped}
    try:
        bar = tqdm(total=len(jobs), unit="img", desc="pack", disable=not progress, file=sys.stderr)
        with bar:
            for rel, prepared, reason in _results(jobs, workers):
                bar.update()
                if prepared is None:
                    if strict:
                        raise BadImageError(f"{os.path.join(src, rel)}: {reason}")
                    skipped.append({"path": rel, "reason": reason})
                    log.warning("skipped %s: %s", rel, reason)
                    continue
                shard, offset = writer.add(prepared.payload)
                path_bytes = rel.encode("utf-8")
                records.append((offset, len(strings), len(prepared.payload), shard, labels[rel],
                                prepared.width, prepared.height, zlib.crc32(prepared.payload), len(path_bytes),
                                prepared.codec, prepared.components, prepared.subsampling, prepared.flags))
                strings += path_bytes
                converted += bool(prepared.flags & fmt.FLAG_CONVERTED)
                resized += bool(prepared.flags & fmt.FLAG_RESIZED)
        if not records:
            raise SourceError(f"{src}: none of its {len(items)} image files could be packed "
                              f"(reasons in {os.path.join(out, fmt.REPORT_NAME)})")
        writer.close_shard()
    except BaseException as e:
        _remove_shards(out, writer)
        report["error"] = str(e) if isinstance(e, GdsDataError) else repr(e)
        _write_report(out, report)
        raise
    samples = np.array(records, dtype=fmt.SAMPLE_RECORD)
    shard_table = np.array(writer.records, dtype=fmt.SHARD_RECORD)
    seconds = time.perf_counter() - started
    per_class = np.bincount(samples["label"], minlength=len(classes)).tolist()
    meta = {
        "classes": classes,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gdsdata_version": __version__,
        "source": src,
        "options": {**asdict(options), "shard_size": shard_size, "alignment": alignment},
        "counts": {"packed": len(samples), "skipped": len(skipped), "converted": converted,
                   "resized": resized, "ignored": len(ignored), "per_class": per_class},
    }
    total = int(shard_table["size"].sum())
    report.update(status="complete", packed=len(samples), converted=converted, resized=resized,
                  shards=len(shard_table), bytes=total, seconds=round(seconds, 3),
                  empty_classes=[c for c, n in zip(classes, per_class) if n == 0])
    report_path = _write_report(out, report)
    index_io.write(out, alignment, dataset_id, shard_table, samples, bytes(strings), meta)
    log.info("packed %d images into %d shards in %.1f s", len(samples), len(shard_table), seconds)
    return PackResult(out, len(samples), converted, resized, len(shard_table), total, seconds,
                      skipped, ignored, report_path)
