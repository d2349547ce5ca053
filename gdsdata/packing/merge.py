"""``gdsdata merge``: join datasets packed as parts (``pack --num-parts N --part K``) into one.

Shard data is not copied: each part's shards are hard-linked into the output (symbolic links across
filesystems; a part's shards on other drives get hard links in the output's own folders there), or
copied with ``copy=True``. The merged index renumbers the shard files and keeps each
shard's origin (the id and index in its header, format.md). Parts must share the class list and the
alignment; their samples follow each other in the order the parts are given; each dataset is given
once. While it runs the merge holds each part's writer lock shared (a writer of a part is refused,
naming the merge), and every shard it places is checked against what the part's index said of it
(its header's dataset id and index, and its size): a part rewritten meanwhile where the lock does not
reach (another host) fails the merge, which then leaves nothing.
"""

import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import shutil
import time

import numpy as np

from gdsdata import __version__
from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io
from gdsdata.args import given_path, output_path, skip_limit
from gdsdata.errors import FormatError, SourceError
from gdsdata.format.lock import (SHARDS_TAG, check_held, drop_if_empty, keep_if_lost, make_shard_folder, owned_target,
                                 reader_lock, remove_quietly, remove_shards, shard_folder, writer_lock)
from gdsdata.format.shards import read_header
from gdsdata.progress import bar as progress_bar
from gdsdata.packing.detection import LabelReport, annotate
from gdsdata.packing.packer import (LEFT_OUT, PIXEL_OPTIONS, _write_json, check_skipped, into, packed_options,
                                    listed_in, reasons, report_complete, report_lists, report_opening,
                                    saved_report)

log = logging.getLogger(__name__)


def _on_its_drive(src, dst, part_id, out, folder_of, placed, move):
    """A shard a part keeps on another drive (``pack --shard-root``) gets a name in the merged
    dataset's own folder on that drive, linked from ``dst``: a hard link there (the part and the
    merged dataset each own theirs), or with ``move`` (``pack --ray``, whose parts go after the
    merge) the part's own shard moved there, the folder there naming ``out`` its owner. Returns None
    for a shard on no such drive."""
    real = os.path.realpath(src)
    if SHARDS_TAG not in os.path.basename(os.path.dirname(real)):
        return None
    mine = folder_of(os.path.dirname(os.path.dirname(real)))
    name = os.path.join(mine, os.path.basename(dst))
    try:
        make_shard_folder(mine, os.path.dirname(dst), out, None)
        os.symlink(name, dst)  # first: whoever clears a merge killed outright finds all it placed through its links
        if move and owned_target(src, part_id):
            os.rename(real, name)  # the same drive: one step, no copy
            how = "moved on its drive"
        else:
            os.link(real, name)
            how = "hard-linked on its drive"
    except OSError as e:  # no hard links there (or no right to make them): a link to the part's shard
        if e.errno not in (errno.EPERM, errno.EMLINK, errno.EXDEV, errno.EOPNOTSUPP, errno.EACCES, errno.EROFS):
            raise
        for undo, path in ((os.unlink, dst), (drop_if_empty, mine)):  # the folder stays if other shards are there
            try:
                undo(path)
            except OSError:
                pass
        return None
    placed.append(name)
    return how


def _place(src, dst, copy):
    if copy:  # under a temporary name until complete: a full disk leaves no truncated shard
        try:
            shutil.copyfile(src, dst + fmt.TMP_SUFFIX)
        except OSError as e:
            try:
                os.unlink(dst + fmt.TMP_SUFFIX)
            except FileNotFoundError:
                pass
            raise OSError(e.errno, f"{e.strerror or e} while copying {src}", dst) from e
        os.replace(dst + fmt.TMP_SUFFIX, dst)
        return "copied"
    src = os.path.realpath(src)  # the shard itself, not a part's link to it
    try:
        os.link(src, dst)
        return "hard-linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        os.symlink(src, dst)
        return "symlinked"


def _given_once(parts, out):
    """Each folder once, none of them ``out``; else one line naming both arguments."""
    seen = {}
    for part in parts:
        real = os.path.realpath(os.fspath(part))
        if real == out:
            raise SourceError(f"{part}: a part cannot be merged into itself")
        if real in seen:
            also = "" if os.fspath(seen[real]) == os.fspath(part) else f" (as {seen[real]}: the same folder)"
            raise SourceError(f"{part}: given twice{also}; merge takes each dataset once")
        seen[real] = part


def _distinct(parts, indexes):
    """No dataset twice under other names (a copy keeps its id) and no shard in two of them (a merged
    dataset and one of its parts, a dataset and its append): their samples would be merged twice."""
    ids, shards = {}, {}
    for part, index in zip(parts, indexes):
        if index.dataset_id in ids:
            raise SourceError(f"{part}: the same dataset as {ids[index.dataset_id]} (a copy of it: the same "
                              f"dataset id); merge takes each dataset once")
        ids[index.dataset_id] = part
        for s, record in enumerate(index.shards):
            origin = (fmt.ident(record["origin_id"]), int(record["origin_index"]))
            other = shards.setdefault(origin, part)
            if other is not part:
                raise SourceError(f"{part}: its {fmt.shard_name(s)} is a shard {other} holds too (one dataset "
                                  f"merged or appended from the other); merge takes each sample once")


def _as_recorded(placed, part, shard, index):
    """The shard just placed (``placed``, a link to it or a copy) is the one ``part``'s index, read when
    the merge began, records: a part packed again meanwhile has other shards under the same names."""
    record = index.shards[shard]
    try:
        read_header(placed, int(record["origin_index"]), fmt.ident(record["origin_id"]), index.alignment)
        size = os.path.getsize(placed)
        if size != int(record["size"]):
            raise FormatError(f"{placed}: {size} bytes, the index records {int(record['size'])}")
    except (FormatError, OSError) as e:
        reason = str(e).removeprefix(f"{placed}: ").split(" (")[0] if isinstance(e, FormatError) else \
            (e.strerror or str(e))
        raise FormatError(f"{part}: {fmt.shard_name(shard)} is not the shard its index recorded when the merge "
                          f"began ({reason}): the part was written meanwhile; merge again once it is done "
                          f"(nothing of this merge was kept)") from None


def _stored_otherwise(index, first) -> str:
    """The options that store samples otherwise in ``index`` than in ``first`` ("" if none)."""
    mine, theirs = packed_options(index.meta), packed_options(first.meta)
    keys = [k for k in PIXEL_OPTIONS if mine.get(k) != theirs.get(k)]
    return ", ".join(f"{k} {mine.get(k)!r} against {theirs.get(k)!r}" for k in keys)


def _check_parts(parts, indexes):
    """Parts of one pack, each once, all of them, in order; else one line saying what is wrong.
    Returns the parts in part order."""
    _distinct(parts, indexes)
    first = indexes[0]
    for part, index in zip(parts, indexes):
        if index.task != first.task:
            raise SourceError(f"{part}: a {index.task} dataset, {parts[0]} is a {first.task} dataset")
        if index.classes != first.classes:
            raise SourceError(f"{part}: its class list differs from {parts[0]}'s; a merge joins datasets of the "
                              f"same classes (parts of one pack --num-parts N, or whole packs of one class list): "
                              f"to add classes, pack --append")
        other = _stored_otherwise(index, first)  # (the source path, shard size, pixel limit may differ)
        if other:
            raise SourceError(f"{part}: packed with other options than {parts[0]} ({other}); its samples would be "
                              f"stored otherwise than the rest: pack the parts with the same --codec, --quality, "
                              f"--max-side and --size")
        if index.alignment != first.alignment:
            raise SourceError(f"{part}: alignment {index.alignment}, {parts[0]} has {first.alignment}")
    infos = [index.meta.get("part") for index in indexes]
    if not any(infos):
        _warn_repeats(parts, indexes)
        return list(zip(parts, indexes))  # whole datasets of the same source and options, joined in order
    missing = [p for p, info in zip(parts, infos) if not info]
    if missing:
        raise SourceError(f"{missing[0]}: a whole dataset, not a part (the others were packed with --num-parts)")
    counts = {info["num_parts"] for info in infos}
    if len(counts) > 1:
        raise SourceError(f"the parts come from packs of different --num-parts ({', '.join(map(str, sorted(counts)))})")
    total = counts.pop()
    seen = {}
    for part, info in zip(parts, infos):
        if info["part"] in seen:
            raise SourceError(f"{part}: part {info['part']} of {total} given twice (also {seen[info['part']]})")
        seen[info["part"]] = part
    absent = [k for k in range(total) if k not in seen]
    if absent:
        raise SourceError(f"part {absent[0]} of {total} is missing ({len(seen)} of {total} parts given); "
                          f"merge needs all of them")
    ordered = sorted(zip(parts, indexes, infos), key=lambda t: t[2]["part"])
    for (_, _, before), (part, _, info) in zip(ordered, ordered[1:]):
        if info["first_item"] != before["first_item"] + before["items"]:
            raise SourceError(f"{part}: part {info['part']} does not start where part {before['part']} ends "
                              f"(items {info['first_item']} against {before['first_item'] + before['items']})")
    return [(part, index) for part, index, _ in ordered]


def merge(parts: list, out, *, copy: bool = False, overwrite: bool = False, progress: bool = False,
          max_skipped: "int | str | None" = None) -> dict:
    """Join the parts of one pack into one dataset (what ``gdsdata merge`` does).

    Parameters
    ----------
    parts : list of str
        Every part of one ``pack(..., num_parts=N, part=K)``, each once, in any order.
    out : str or os.PathLike
        The merged dataset folder (one writer at a time; an existing dataset needs ``overwrite``,
        and is replaced only once the merged one is complete).
    copy : bool
        Copy shard data instead of hard-linking it (symbolic links across filesystems).
    overwrite : bool
        Replace a dataset in ``out``.
    progress : bool
        Progress of the shard bytes placed, on stderr (copying may take long): a bar on a terminal,
        else a line a minute (``gdsdata.progress``).
    max_skipped : int or str, optional
        Refuse the merge when the parts together left out more files than this (skipped, unreadable,
        or left out for their labels; a count, or a share of all their files: "0.5%"), as their
        ``pack_report.json`` files list.

    Returns
    -------
    dict
        ``out``, ``parts``, ``samples``, ``shards``, how the shards were placed, ``boxes`` (detection)
        and ``report_path``: the ``pack_report.json`` joining the parts' reports, written for the
        parts of one pack that each have theirs (None otherwise).
    """
    out = os.path.realpath(os.fspath(output_path("out", out)))
    parts = [given_path("a part", part) for part in parts]
    _given_once(parts, out)
    max_skipped = skip_limit(max_skipped)  # (a bad value said before anything is locked or read)
    with writer_lock(out, f"merge of {len(parts)} part(s)"), contextlib.ExitStack() as reading:
        for part in parts:  # no writer of a part while its shards are placed (other merges may read it too)
            reading.enter_context(reader_lock(part, f"merge into {out}"))
        return merge_checked(parts, out, copy=copy, overwrite=overwrite, progress=progress, max_skipped=max_skipped)


def _warn_repeats(parts, indexes):
    """Whole datasets that hold the same samples (the same path and the same stored bytes: two packs
    of one source, a pack and an append of it): joined, the merge holds each of those twice; and
    ones that hold other images under the same paths (two sources named alike): joined, a path no
    longer names one image. Said, not refused (repeats may be meant: oversampling a class)."""
    paths, samples = [], []  # per dataset: its samples' path hashes (64-bit), and (path, bytes' CRC-32) mixed
    for index in indexes:
        records = index.samples
        hashed = np.fromiter((int.from_bytes(hashlib.blake2b(index.strings[int(start):int(start) + int(length)],
                                                             digest_size=8).digest(), "little")
                              for start, length in zip(records["path_offset"], records["path_length"])),
                             np.uint64, len(index))
        with np.errstate(over="ignore"):  # (a multiplicative mix, modulo 2**64)
            mixed = hashed ^ (records["crc32"].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        mixed, first = np.unique(mixed, return_index=True)
        paths.append(hashed[first])  # the path of each distinct sample
        samples.append(mixed)
    for a in range(len(parts)):
        for b in range(a + 1, len(parts)):
            same = len(np.intersect1d(samples[a], samples[b], assume_unique=True))
            # paths both hold where one holds a sample the other does not (a path held twice counts once)
            apart = np.union1d(paths[a][~np.isin(samples[a], samples[b], assume_unique=True)],
                               paths[b][~np.isin(samples[b], samples[a], assume_unique=True)])
            named = len(np.intersect1d(apart, np.intersect1d(paths[a], paths[b])))
            if same:
                log.warning("%s and %s hold %d of the same samples (the same file paths and stored bytes): the "
                            "merged dataset holds each of them twice", parts[a], parts[b], same)
            if named:
                log.warning("%s and %s hold other images under %d of the same file paths: in the merged dataset "
                            "such a path (ds.source(i), pack_report.json) names two images", parts[a], parts[b], named)


def merge_checked(parts, out, *, copy=False, overwrite=False, adopt=False, progress=False, report=None,
                  max_skipped=None, left_out=None, retry="merge again with --overwrite") -> dict:
    """``merge`` for a caller that holds ``out``'s writer lock already (``pack --ray``); ``adopt``:
    the parts go after the merge, and the shards they wrote on other drives become ``out``'s;
    ``report``: a function of the merged index's metadata and shard table giving the
    ``pack_report.json`` written beside the index once it is (as a pack writes its own);
    ``max_skipped`` (from ``args.skip_limit``): checked against the files the parts' reports list as
    left out (``LEFT_OUT``), or against ``left_out`` where given: (what to name, those files);
    ``retry``: what the user does where ``out``'s lock file went while the merge ran in it."""
    if not parts:
        raise SourceError("merge needs at least one part")
    out = os.path.realpath(os.fspath(out))
    _given_once(parts, out)
    indexes = [index_io.load(p) for p in parts]
    ordered = _check_parts(parts, indexes)
    if not any(len(index) for index in indexes):  # as one pack of those files would fail
        raise SourceError(f"none of the {len(parts)} parts holds an image: every file failed to decode "
                          f"({_first_reasons(parts)})")
    needed = report is None or (max_skipped is not None and not left_out)  # (pack --ray gives both from its parts)
    saved = {part: saved_report(part, complete=False) for part in parts} if needed else {}  # (each read once)
    if max_skipped is not None:
        what, listed = left_out or _skipped_by(parts, saved)
        check_skipped(what, listed, sum(len(index) for index in indexes), max_skipped, listed=False)
    if report is None:
        report = _parts_report(ordered, out, saved)
    fresh = not (os.path.isdir(out) and os.listdir(out))
    left = f"no index written, and what it placed there stays: {retry} once no other gdsdata writes it"
    try:
        return into(out, overwrite, lambda folder: _merge(ordered, folder, out, copy, adopt, progress, report, left),
                    resumable=False)
    except BaseException as e:
        if fresh:  # a merge does not resume: nothing of a failed one stays to fill the disk
            keep_if_lost(out, e, left)  # (but where another writer may have started: nothing removed)
            remove_quietly(out)
        raise


class JoinedReport:
    """What ``out/pack_report.json`` holds once the parts of one pack are merged (``merge_checked(report=)``):
    the fields a pack in one piece writes, the parts' lists joined in part order, the counts of the
    merged dataset, and ``extra`` (how the parts were packed)."""

    def __init__(self, src, out, reports, roots, started, extra):
        self.src, self.out, self.reports, self.roots, self.started = src, out, reports, roots, started
        self.extra = extra
        self.made = None

    def __call__(self, meta, shards):
        reports, counts = self.reports, meta["counts"]
        report = report_opening(self.src, self.out, meta["classes"], self.roots,
                                {key: [entry for part in reports for entry in part.get(key) or []]
                                 for key in ("ignored", "skipped", "unreadable", "special", "repaired")})
        if any("labels" in part for part in reports):
            # the labels' report of the whole source: part 0's, with the negatives the dataset kept, without
            # the notes on boxes of images the other parts skipped
            labels = reports[0].get("labels")
            if labels is not None and "detection" in meta:
                skipped = {entry.get("path") for entry in report["skipped"]}
                labels = {**labels, "negatives": meta["detection"]["negatives"],
                          **{kind: [entry for entry in labels.get(kind) or [] if entry.get("image") not in skipped]
                             for kind in LabelReport.BOX_NOTES}}
            report["labels"] = labels
        report_complete(report, meta["classes"], counts["per_class"], shards, time.perf_counter() - self.started,
                        packed=int(counts["packed"]), converted=int(counts["converted"]),
                        resized=int(counts["resized"]),
                        resumed_shards=sum(part.get("resumed_shards", 0) for part in reports))
        report.update(self.extra)
        self.made = report
        return report


def _parts_report(ordered, out, saved):
    """The joined report of the parts of one ``--num-parts`` pack, each with its finished pack's
    report (``saved``: each part's report as read, or None); None for whole datasets, or where a
    part has none (a merge then writes no report)."""
    reports = []
    for part, index in ordered:
        report = saved.get(part) if index.meta.get("part") else None
        if report is None or report.get("status") != "complete":
            return None
        reports.append(report)
    merged = {"parts": len(reports), "seconds_of_parts": [part.get("seconds") for part in reports]}
    return JoinedReport(reports[0].get("source", ""), out, reports, reports[0].get("shard_roots"),
                        time.perf_counter(), {"merge": merged})


def _skipped_by(parts, saved):
    """(the parts' names, the files their reports (``saved``, as read) list as left out), for
    --max-skipped."""
    left_out = []
    for part in parts:
        listed = None if saved.get(part) is None else listed_in(saved[part], LEFT_OUT)
        if listed is None:
            raise SourceError(f"{part}: no readable {fmt.REPORT_NAME} (missing or damaged) to count the files it "
                              f"left out by (--max-skipped)")
        left_out += listed
    return (", ".join(parts) if len(parts) <= 3 else f"{parts[0]} and {len(parts) - 1} more parts"), left_out


def _first_reasons(parts) -> str:
    """The first files the parts' reports list as skipped, with why."""
    return reasons([item for part in parts for item in report_lists(part) or []]) or \
        f"each part's {fmt.REPORT_NAME} says why"


def _merge(ordered, folder, out, copy, adopt=False, progress=False, report=None, left=""):
    parts = [part for part, _ in ordered]
    indexes = [index for _, index in ordered]
    dataset_id = os.urandom(16)
    placed = []  # names of shards in this dataset's own folders on other drives (gone if the merge fails)
    record = os.path.join(folder, fmt.MERGE_RECORD)  # a merge killed outright: whoever clears it knows them its own
    with open(record, "w", encoding="utf-8") as f:
        json.dump({"dataset_id": dataset_id.hex()}, f)
    try:
        summary = _merge_into(indexes, parts, folder, out, copy, adopt, dataset_id, placed, progress, report, left)
        os.unlink(record)
        return summary
    except BaseException as e:
        if folder == out:  # (the record names them for whoever clears the folder)
            keep_if_lost(out, e, left)
        remove_shards(placed, None)
        for shards in {os.path.dirname(path) for path in placed}:
            drop_if_empty(shards)
        raise


def _merge_into(indexes, parts, folder, out, copy, adopt, dataset_id, placed, progress=False, report=None, left=""):
    """``left``: what a merge in place whose lock file went leaves (``lock.check_held``)."""
    first = indexes[0]
    shard_rows, sample_tables, strings, how = [], [], bytearray(), set()
    sample_base = 0
    total = sum(int(index.shards["size"].sum()) for index in indexes)  # as the indexes record (load checks it)
    with progress_bar(progress, total=total, unit="B", unit_scale=True, desc="copy" if copy else "link") as bar:
        for part, index in zip(parts, indexes):
            shard_base = len(shard_rows)
            for s in range(len(index.shards)):
                src, dst = index.shard_path(s), os.path.join(folder, fmt.shard_name(shard_base + s))
                if folder == out:  # (built aside: ``into`` keeps it whole)
                    check_held(out, left)
                drive = None if copy else _on_its_drive(
                    src, dst, index.dataset_id, out, lambda root: shard_folder(root, os.path.basename(out), dataset_id),
                    placed, adopt)
                how.add(drive or _place(src, dst, copy))
                _as_recorded(dst, part, s, index)
                row = index.shards[s].copy()
                bar.update(int(row["size"]))
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
    box_args = {}
    if first.task == "detect":
        per_sample = [index.sample_boxes(i) for index in indexes for i in range(len(index))]
        ids = [index.image_ids for index in indexes]
        box_args = annotate(meta, first.classes, first.meta["detection"].get("format", ""),
                            first.meta["detection"].get("category_ids"), per_sample,
                            None if any(part is None for part in ids) else [i for part in ids for i in part])
    shards = np.array(shard_rows, dtype=fmt.SHARD_RECORD)
    if folder == out:
        check_held(out, left)
    index_io.write(folder, first.alignment, dataset_id, shards, samples, bytes(strings), meta, **box_args)
    if report is not None:
        _write_json(os.path.join(folder, fmt.REPORT_NAME), report(meta, shards))
    log.info("merged %d parts: %d samples, %d shards (%s)", len(parts), len(samples), len(shards), ", ".join(how))
    return {"out": out, "parts": len(parts), "samples": len(samples), "shards": len(shards),
            "shards_placed": sorted(how), "boxes": meta.get("detection", {}).get("boxes", 0),
            "report_path": os.path.join(out, fmt.REPORT_NAME) if report is not None else None}
