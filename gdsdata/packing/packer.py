"""``gdsdata pack``: turn a source (``sources.py``) into aligned shards plus an index.

Flow: list the source (labels as torchvision's ImageFolder assigns them), validate and normalise
every image in a process pool (``normalize.prepare``), append the results in source order to shards
(``shards.ShardWriter``), write ``pack_report.json``, and write the index last. Until the index is
renamed into place the folder is not a dataset.

Beside each finished shard a journal records its samples, so ``resume=True`` finishes an
interrupted pack (even one killed with SIGKILL) without redoing finished shards, and produces the
same samples and shard bytes as an uninterrupted pack. ``num_parts``/``part`` pack one contiguous
part of the source, with labels from the full class list, for ``merge.merge`` to join.
"""

import concurrent.futures.process
import contextlib
import ctypes
import datetime
import errno
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import re
import signal
import stat
import sys
import time
import zlib
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # (not yet the builtin before Python 3.11)
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence  # noqa: F401 - in annotations

import numpy as np

from gdsdata import __version__, settings
from gdsdata.args import given_path, is_integer, output_path, skip_limit, skips_allowed
from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io
from gdsdata.errors import (BadImageError, FormatError, GdsDataError, LockLost, OutputExistsError, SourceError,
                            SourceGoneError)
from gdsdata.format.lock import (aside, check_held, dataset_owner, deferred_signals, drop_inherited_locks,
                                 keep_if_lost, lost, remove_dataset, remove_shards, swap_in, writer_lock)
from gdsdata.packing.prepare import PackOptions, prepare
from gdsdata.format.shards import ShardWriter, data_crc32, open_regular
from gdsdata.packing.detection import LabelReport, annotate, each_once, open_detection
from gdsdata.packing.sources import (FolderSource, Item, Listing, RemoteFolderSource, display, is_url, local_path,
                                     gone, open_source, read_url, storage_gone)
from gdsdata.progress import bar as progress_bar
from gdsdata.stall import slices

log = logging.getLogger(__name__)
_WINDOW_PER_WORKER = 16  # images in flight per worker: bounds memory for sources read here
_PR_SET_PDEATHSIG = 1  # prctl: the signal a process gets when its parent ends


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
    unreadable: list = field(default_factory=list)  # [{"path", "reason"}]: folders or files that could not be read
    special: list = field(default_factory=list)  # [{"path", "reason"}]: FIFOs, devices, sockets named like images
    report_path: str = ""
    resumed_shards: int = 0  # shards kept from an interrupted pack (resume=True)
    labels: dict = None  # detection packs: what the labels got wrong (detection.LabelReport.as_dict())
    boxes: int = 0  # detection packs: boxes packed
    new: int = 0  # images this run packed itself: ``packed`` less a resume's kept ones or an append's base
    relabeled: list = field(default_factory=list)  # an append: the dataset's classes whose label changed
    repaired: list = field(default_factory=list)  # [{"path", "reason"}]: JPEGs libjpeg decodes only with warnings
    finished_before: bool = False  # a resume of a pack that had finished: the dataset as it was


def scan(src):
    """List a source: (class names, [(relative path, label)], ignored), in packing order."""
    source = open_source(src)
    source.close()
    return source.classes, [(item.rel, item.label) for item in source.items], source.ignored


def _prepare_item(job):
    """(name, the prepared image or None, why not or None, the source's stamp as read: ``_stamp``)."""
    rel, path, data, options, error, stamp = job
    if error is not None:
        return rel, None, error, stamp
    if data is None:
        try:
            if is_url(path):
                data = read_url(path)
            else:
                data, stamp = _read_regular(path)
        except BadImageError as e:
            return rel, None, str(e), stamp
        except OSError as e:
            if storage_gone(e):
                raise gone(path, e) from None
            return rel, None, f"cannot read: {e.strerror or e}", _stamp(Item(rel, 0, path=path))
        except Exception as e:  # noqa: BLE001 - a remote read's failure, whatever its library raises
            return rel, None, f"cannot read: {type(e).__name__}: {e}", stamp
    try:
        return rel, prepare(data, options), None, stamp
    except BadImageError as e:
        return rel, None, str(e), stamp


def _read_regular(path) -> tuple:
    """A regular file's bytes, and its stamp as it was opened (``file_stamp``);
    anything else (a FIFO or device swapped in since the scan) is refused without blocking on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadImageError("not a regular file (any more): skipped unopened")
        chunks, size = [], 0
        while size <= info.st_size:  # a file that grows is read as far as it went when scanned, plus one byte
            chunk = os.read(fd, info.st_size + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), file_stamp(info)
    finally:
        os.close(fd)


def _job(source, item, options):
    """What a packing worker gets for ``item``: its path, or the bytes the source read here (with
    their stamp, a tar member's from its header)."""
    stamp = _stamp(item) if item.path is None else None  # (a file's: the worker's, as it opens it)
    try:
        return item.rel, item.path, source.read(item), options, None, stamp
    except BadImageError as e:
        return item.rel, None, None, options, str(e), stamp


_OWNED = re.compile(r"(?:(?:{index}|{report}|shard-\d{{5,}}\.gds(?:{journal})?)(?:{tmp})?"
                    r"|shard-\d{{5,}}\.gds\.link{tmp}|{merge})".format(
                        index=re.escape(fmt.INDEX_NAME), report=re.escape(fmt.REPORT_NAME),
                        journal=re.escape(fmt.JOURNAL_SUFFIX), tmp=re.escape(fmt.TMP_SUFFIX),
                        merge=re.escape(fmt.MERGE_RECORD)))


def gdsdata_owned(name):
    """Files a pack or merge writes into its output folder, by their exact names (the index, the
    report, shards, their journals, each of these while written, and a merge's record)."""
    return _OWNED.fullmatch(name) is not None


def _stopped_report(path) -> bool:
    """Whether ``path`` is the report of a pack that failed or was stopped (beside it: no dataset)."""
    try:
        with open(open_regular(path, what="a report"), encoding="utf-8") as f:
            return json.load(f).get("status") in ("failed", "interrupted")
    except (OSError, ValueError, AttributeError, FormatError):
        return False


def check_output(out, overwrite, resumable=True, resume=False) -> bool:
    """Refuse an ``out`` that must not be written: a dataset (or any other file) without
    ``overwrite`` (or ``resume``), files gdsdata did not write even with either, a folder inside a
    dataset. Returns whether ``out`` holds anything (then an overwrite builds the new dataset aside
    and swaps it in when complete)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExistsError(f"{out}: exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out))
    while parent != os.path.dirname(parent):
        if os.path.isfile(os.path.join(parent, fmt.INDEX_NAME)):  # a folder of its would hide in it
            raise OutputExistsError(f"{out}: inside the dataset {parent}; write to a folder outside it")
        parent = os.path.dirname(parent)
    existing = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if existing == [fmt.REPORT_NAME] and _stopped_report(os.path.join(out, fmt.REPORT_NAME)):
        return False  # a pack that failed or was stopped left only its report: nothing to keep, pack again
    foreign = [n for n in existing if not gdsdata_owned(n)]
    if foreign:  # whatever the options: --overwrite would not be taken either
        raise OutputExistsError(f"{out}: holds files gdsdata did not write (e.g. {foreign[0]}), which it will not "
                                f"replace; write the dataset to a new or empty folder (left untouched)")
    if existing and not (overwrite or resume):
        what = "holds a gdsdata dataset" if fmt.INDEX_NAME in existing else "holds an unfinished dataset"
        hint = "" if fmt.INDEX_NAME in existing or not resumable else " (or --resume to finish an interrupted pack)"
        raise OutputExistsError(f"{out}: {what}; pass --overwrite to replace it{hint} (left untouched)")
    return bool(existing)


def into(out, overwrite, build, resumable=True):
    """Run ``build(folder)`` to make a complete dataset for ``out``: in ``out`` itself when it is
    empty or new, else (an overwrite) in a sibling folder swapped in once ``build`` returns; a
    failed build leaves the old dataset as it was and nothing of the new one. ``resumable``: an
    unfinished build in ``out`` can be finished (a pack's ``--resume``)."""
    if not check_output(out, overwrite, resumable):
        os.makedirs(out, exist_ok=True)
        return build(out)
    replaced = _identity(out)  # what the overwrite replaces: the same folder and dataset when it swaps
    staging = aside(out, "new")
    try:
        result = build(staging)
    except BaseException:
        remove_dataset(staging, dataset_owner(staging))  # with what it wrote on other drives
        raise
    now, taken = _identity(out), lost(out)
    if taken or (now is not None and now != replaced):  # moved away and something else put there (a user's mv)
        kept = f"{out}.new-{time.strftime('%Y%m%d-%H%M%S')}"  # (a name the next writer's clean-up leaves alone)
        os.rename(staging, kept)
        if taken:
            raise LockLost(out, taken, f"it is left as it is, and the new dataset is complete in {kept}: move it "
                                       f"where it belongs once no other gdsdata writes {out}")
        raise OutputExistsError(f"{out}: replaced by another folder while this ran, which it leaves as it is; "
                                f"the new dataset is complete in {kept}: move it where it belongs")
    swap_in(staging, out, now and now[2])  # (which removes whichever of the two is not out's; no out: renamed)
    return result


def _identity(out):
    """The folder ``out`` is (device, inode) and the dataset it holds (its id), or None."""
    try:
        info = os.stat(out)
    except OSError:
        return None
    return info.st_dev, info.st_ino, dataset_owner(out)


def _prepare_chunk(jobs):
    return [_prepare_item(job) for job in jobs]


def _quiet_worker(parent: int):
    """Packing workers leave Ctrl-C to the parent, which stops them and reports once; SIGTERM (sent
    to the whole process group by ``timeout`` and Slurm) ends them as the pool itself ends its
    workers, while the parent unwinds as for Ctrl-C. They hold none of its writer lock, and end
    with it (Linux): a pack killed outright leaves no worker behind to keep the dataset locked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, which a fork inherits
    drop_inherited_locks()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent ended before the signal was asked for
            os._exit(1)


def _isolated(job, context, bound):
    """Prepare one job in a process of its own: what killed a pool's worker shows up here as the
    item that kills its process, and what stalled one as the item that takes longer than ``bound``
    seconds alone (its process killed)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_send_result, args=(job, send, os.getpid()), daemon=True)
    process.start()
    send.close()
    if not any(receive.poll(wait) for wait in slices(bound)):  # (a result, or end-of-file: the process died)
        process.kill()
        process.join(5)  # (one stuck in the kernel, in uninterruptible sleep, dies when its call returns)
        return job[0], None, _STALLED.format(bound=bound), job[-1]  # (not looked at here: a hung mount hangs a stat)
    try:
        result = receive.recv()
    except EOFError:
        result = None
    process.join()
    if isinstance(result, SourceGoneError):
        raise result
    if result is not None:
        return result
    code = process.exitcode
    how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}")
    hint = " (out of memory?)" if code == -signal.SIGKILL else ""
    return job[0], None, f"the packing worker died preparing it: {how}{hint}", job[-1]


def _send_result(job, send, parent):
    _quiet_worker(parent)
    try:
        result = _prepare_item(job)
    except SourceGoneError as e:  # (the storage, not the item: the pack stops, as in a pool's worker)
        result = e
    send.send(result)
    send.close()


def _ordered(pool_factory, jobs, window, context, bound, chunk=8):
    """Prepared items in source order, computed in chunks of ``chunk`` (fewer round trips to the
    workers) with at most ``window`` jobs submitted ahead (bounded memory for sources read in this
    process). A worker that dies (killed by the kernel's OOM killer, say) breaks the pool, and one
    that gives no chunk back within ``bound`` seconds an item (the stall_timeout setting: stuck) is
    ended with its pool: the chunk it was working on is redone one item per process, so that the item
    that kills its process, or takes longer than ``bound`` alone, is reported as bad and everything
    else is packed; later chunks go to a new pool. If the first two items of such a chunk both stall
    alone, the pack stops (``GdsDataError``): that is the machine, not the items."""
    jobs = iter(jobs)
    pending = deque()  # (future, chunk of jobs)
    redo = deque()  # chunks of a broken pool, to submit again
    pool = pool_factory()
    finished = False
    try:
        while True:
            batch = redo.popleft() if redo else list(itertools.islice(jobs, chunk))
            if batch:
                try:
                    future = pool.submit(_prepare_chunk, batch)
                except BrokenProcessPool as e:  # (the pool broke since the last wait: its turn comes below)
                    future = Future()
                    future.set_exception(e)
                except OSError as e:  # (its worker processes start as work comes: no memory, no process left)
                    raise GdsDataError(f"cannot start a packing worker process: {e.strerror or e} (fewer --workers, "
                                       f"or free memory)") from None
                pending.append((future, batch))
            if pending and (not batch or len(pending) * chunk >= window):
                future, done = pending.popleft()
                try:
                    results = _result(future, bound * len(done))
                except (BrokenProcessPool, FutureTimeout) as e:
                    if isinstance(e, BrokenProcessPool):
                        log.warning("a packing worker died; finding the item that killed it")
                        pool.shutdown(wait=False, cancel_futures=True)
                    else:
                        log.warning("a packing worker gave nothing back for %g s (%d images); preparing them one by "
                                    "one", bound * len(done), len(done))
                        _stop(pool)
                    redo.extend(b for _, b in pending)
                    pending.clear()
                    results = _alone(done, context, bound)
                    pool = pool_factory()
                yield from results
            if not batch and not pending and not redo:
                finished = True
                return
    finally:
        if finished:
            pool.shutdown(wait=True)
        else:  # Ctrl-C or an error: nobody will collect the work in flight
            _stop(pool)


_STALLED = "preparing it alone took longer than {bound:g} s (the stall_timeout setting, GDSDATA_STALL_TIMEOUT)"


def _result(future, seconds):
    """``future``'s result, waited for at most ``seconds`` of this process's running time (a pack
    stopped with Ctrl-Z and resumed is not a stall: ``stall.slices``); ``FutureTimeout`` past them."""
    for wait in slices(seconds):
        try:
            return future.result(timeout=wait)
        except FutureTimeout:
            pass
    raise FutureTimeout


def _alone(jobs, context, bound) -> list:
    """``jobs`` prepared one per process (``_isolated``); if the first two both stall, ``GdsDataError``."""
    results = []
    for job in jobs:
        results.append(_isolated(job, context, bound))
        if len(results) == 2 and all(reason == _STALLED.format(bound=bound) for _, _, reason, _ in results):
            stalled = [rel for rel, *_ in results]
            raise GdsDataError(f"packing workers make no progress: {stalled[0]} and {stalled[1]} each took longer "
                               f"than {bound:g} s alone, one after the other (the machine rather than the "
                               f"images? GDSDATA_STALL_TIMEOUT raises the bound; --workers 1 packs in this process)")
    return results


def _stop(pool):
    """Shut a pool down without waiting on work nobody will collect (Ctrl-C, an error). A worker
    terminated while it sends a result leaves half a message in the results pipe, which the pool's
    own thread then waits on for good, and the interpreter's exit with it (it joins that thread):
    once the workers are gone, the parent's copy of the pipe's writing end is closed, so that the
    half message ends in end-of-file and the pool winds up as broken; and jobs queued for workers
    that are gone are not waited for."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # none may outlive the pack
    calls, results = getattr(pool, "_call_queue", None), getattr(pool, "_result_queue", None)
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    _joined(processes, 5)
    alive = [process for process in processes if process.is_alive()]
    for process in alive:  # stopped (SIGSTOP, a frozen cgroup): SIGTERM waits for it to run again, SIGKILL does not
        process.kill()
    if alive and _joined(alive, 5):  # one still in the kernel (uninterruptible): it goes when the kernel lets it
        _LEFT.extend(process for process in alive if process.is_alive())
        if manager is not None:  # the interpreter's exit joins the pool's thread, which waits for that worker
            getattr(concurrent.futures.process, "_threads_wakeups", {}).pop(manager, None)
    if calls is not None:
        calls.cancel_join_thread()
    writer = getattr(results, "_writer", None)
    if writer is not None and not any(process.is_alive() for process in processes):
        writer.close()


_LEFT = []  # packing workers a stop left alive (SIGKILL waits for an uninterruptible wait in the kernel to end)


def workers_left() -> bool:
    """Whether a stopped pool left a worker alive: then the interpreter's exit waits for it (its pool's
    thread, not a daemon, joins it), and the command ends with ``os._exit`` once its output is out."""
    return any(process.is_alive() for process in _LEFT)


def _joined(processes, seconds) -> bool:
    """Join ``processes`` for at most ``seconds`` in all; whether any is still alive."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    return any(process.is_alive() for process in processes)


def _results(jobs, workers):
    if workers <= 1:
        yield from map(_prepare_item, jobs)
        return
    # fork: workers start at once and need not re-import __main__
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    yield from _ordered(lambda: ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_worker,
                                                    initargs=(os.getpid(),)),
                        jobs, workers * _WINDOW_PER_WORKER, context, settings.get("stall_timeout"))


def report_opening(src, out, classes, roots, lists: dict, part=None) -> dict:
    """``pack_report.json``'s fields known before anything is packed (a failed pack's report holds
    these): the source, OUT, ``status`` "failed" until ``report_complete``, the class count, the
    lists of files left out (``lists``: ignored, skipped, unreadable, special), the part of a
    ``--num-parts`` pack and the shard roots."""
    report = {"source": display(src), "out": display(out), "status": "failed", "classes": len(classes), **lists}
    if part is not None:
        report["part"] = part
    if roots:
        report["shard_roots"] = [display(root) for root in roots]
    return report


def report_complete(report, classes, per_class, shard_table, seconds, *, packed, converted, resized,
                    resumed_shards) -> dict:
    """``report`` made complete once the index is about to be written: the counts, the shards and
    their bytes, the time, the shards a resume kept, the classes without samples."""
    report.update(status="complete", packed=packed, converted=converted, resized=resized, shards=len(shard_table),
                  bytes=int(shard_table["size"].sum()), seconds=round(seconds, 3), resumed_shards=resumed_shards,
                  empty_classes=[c for c, n in zip(classes, per_class) if n == 0])
    return report


def _write_json(path, payload):
    """Write ``payload`` whole or not at all (a failed write, a full disk say, leaves no temporary file)."""
    try:
        with open(path + fmt.TMP_SUFFIX, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)  # ASCII with escapes: names that are not UTF-8 survive
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + fmt.TMP_SUFFIX, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(path + fmt.TMP_SUFFIX)
        if isinstance(e, OSError) and not e.filename:  # name the file: "No space left on device" alone says nothing
            raise OSError(e.errno, e.strerror, path) from e
        raise
    return path


def _journal_path(out, shard):
    return os.path.join(out, fmt.shard_name(shard) + fmt.JOURNAL_SUFFIX)


def _listing_digest(items, classes=None) -> str:
    """A digest of the items' names and labels in packing order: a resume goes on where the journals
    end only in the same order (another order, or a source with files added, removed or renamed
    inside the listing, would pack some images twice and leave others out). With ``classes``, also
    the class names and each item's boxes, COCO image id and annotated size: all a finished
    dataset's index holds of its source beyond the images (what a resume of it compares)."""
    digest = hashlib.sha256()
    if classes is not None:
        digest.update(json.dumps(list(classes)).encode("utf-8", "surrogateescape") + b"\n")
    for item in items:
        digest.update(f"{item.rel}\0{item.label}\n".encode("utf-8", "surrogateescape"))
        if classes is not None:
            boxes = b"" if item.boxes is None else np.ascontiguousarray(item.boxes).tobytes()
            digest.update(boxes + f"\0{item.image_id}\0{item.size}\n".encode())
    return digest.hexdigest()


def file_stamp(st) -> list:
    """A file's stamp from its stat: size, modification and change times (ns; the change time moves
    with a chmod or a file put back in place too)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp(item):
    """A source item's stamp as it is now: a local file's (``file_stamp``), a tar member's size and
    modification time as its header gives them; None where the listing says nothing of the kind (an
    LMDB value, an object store's object) or the file cannot be looked at. A pack's journals hold
    each item's as it was read (a file that could not be read: as it could be looked at then); a
    resume compares them."""
    try:
        if isinstance(item.ref, tuple) and hasattr(item.ref[1], "mtime"):  # (a tar member: path, TarInfo)
            return [item.ref[1].size, int(item.ref[1].mtime * 1e9)]
        if item.path is None or is_url(item.path):
            return None
        st = os.stat(item.path)
    except OSError:
        return None
    return file_stamp(st)


def _changed_source(journal, items):
    """The first source item a journal's shard was packed from (or skipped) that has changed since
    (``_stamp``), as its path or name, or None. ``items``: the listing's items by name, and by the
    name as reports print it."""
    named = list(zip(journal["paths"], journal.get("stamps") or ()))
    named += (journal.get("skipped_stamps") or {}).items()  # (those skipped within its shard's span)
    checked = [(items[rel], stamp) for rel, stamp in named if stamp is not None and rel in items]
    with ThreadPoolExecutor(16) as pool:  # (a stat each: many at once on a network filesystem)
        now = list(pool.map(_stamp, [item for item, _ in checked]))
    return next((item.path or item.rel for (item, stamp), current in zip(checked, now) if current != stamp), None)


def _resume_state(out, signature, progress=False, items=()):
    """What an interrupted pack finished: the longest run of shards 0..k-1 whose journal matches
    this pack, whose bytes match the journal (each read whole: a bar on stderr with ``progress``)
    and whose source ``items`` are as they were when packed (``_stamp``). Everything after them is
    removed. (None found: a pack from the start.)"""
    by_name = {display(item.rel): item for item in items} | {item.rel: item for item in items}
    listed = [os.path.join(out, name[:-len(fmt.JOURNAL_SUFFIX)]) for name in os.listdir(out)
              if name.endswith(fmt.JOURNAL_SUFFIX)]
    total = sum(os.path.getsize(path) for path in listed if os.path.isfile(path))
    journals = []
    with progress_bar(progress and total, total=total, unit="B", unit_scale=True, desc="check finished shards") as bar:
        while True:
            shard_path = os.path.join(out, fmt.shard_name(len(journals)))
            try:
                with open(open_regular(_journal_path(out, len(journals)), what="a journal"), encoding="utf-8") as f:
                    journal = json.load(f)  # (a FIFO there: FormatError, the resume stops)
            except (OSError, ValueError):
                break
            theirs = journal.get("signature") or {}
            if "listing" not in theirs and "ends" in theirs:  # (journals of gdsdata before 2026-12-05)
                raise SourceError(f"{out}: the interrupted pack was begun by an earlier gdsdata, whose journals do "
                                  f"not record the whole listing (and YOLO splits are listed in another order now): "
                                  f"it cannot be resumed safely; pack again with --overwrite")
            if theirs != signature:
                raise SourceError(f"{out}: the interrupted pack differs from this one: "
                                  f"{_differences(theirs, signature)}; resume it with its source and options, or "
                                  f"pack again with --overwrite")
            size, _, _, crc = journal["shard"][:4]
            if not os.path.exists(shard_path) or os.path.getsize(shard_path) != size or \
                    data_crc32(shard_path, signature["alignment"]) != crc:
                break
            changed = _changed_source(journal, by_name)
            if changed is not None:  # packed as it was before the change: this shard and the rest again
                log.warning("%s: changed since the interrupted pack read it; packing again from %s on",
                            display(changed), fmt.shard_name(len(journals)))
                break
            bar.update(size)
            journals.append(journal)
    kept = {fmt.shard_name(k) for k in range(len(journals))} | {
        fmt.shard_name(k) + fmt.JOURNAL_SUFFIX for k in range(len(journals))}
    owner = dataset_owner(out)  # (the first journal's id: the interrupted pack's, whether kept or not)
    doomed = []
    for name in os.listdir(out):
        if gdsdata_owned(name) and name not in kept:
            if name.endswith(fmt.TMP_SUFFIX) and name[:-len(fmt.TMP_SUFFIX)] in kept:
                os.unlink(os.path.join(out, name))  # the link to a kept shard while it was written
            else:
                doomed.append(os.path.join(out, name))
    remove_shards(doomed, owner)
    return journals


def pack(src: "str | os.PathLike", out: "str | os.PathLike", *, options: PackOptions = None,
         shard_size: int = 1 << 30, alignment: int = fmt.DEFAULT_ALIGNMENT, workers: int = 0,
         strict: bool = False, overwrite: bool = False, progress: bool = False, num_parts: int = 1,
         part: int = 0, resume: bool = False, append: bool = False, allow_empty_classes: bool = False,
         on_progress: "Callable[[int], None] | None" = None, format: str = "folder", split: str | None = None,
         annotations: "str | os.PathLike | None" = None, shard_roots: "Sequence[str | os.PathLike] | None" = None,
         max_skipped: "int | str | None" = None) -> PackResult:
    """Pack an image source into a dataset folder (what ``gdsdata pack`` does).

    Parameters
    ----------
    src : str or os.PathLike
        An ImageFolder tree (one subfolder per class), an LMDB of (image bytes, label), WebDataset
        tar shards; a local path or an fsspec URL (``s3://``, ``gs://``, ...).
    out : str or os.PathLike
        The dataset folder to write (one writer at a time; an existing dataset needs ``overwrite``).
    options : PackOptions, optional
        How images are stored: codec (jpeg or raw), quality of re-encoded images, downscaling, the
        pixel limit checked before decoding. An append without them stores its images as the
        dataset's were; with other ones it is refused.
    shard_size, alignment : int
        Target shard size and payload alignment in bytes.
    workers : int
        Processes preparing images (0: one per core, at least two). 1 prepares them in this process,
        one after another: no worker is ended if an image stalls (for debugging).
    strict : bool
        Stop at the first bad or unreadable file or folder instead of skipping it.
    max_skipped : int or str, optional
        Stop as ``strict`` does once more files are skipped, unreadable or (detection) left out for
        their labels than this: a count (10) or a share of the files to pack ("0.5%"; a part's share
        of its own files; part 0 checks what the listing left out once, of the whole source's). None:
        no limit.
    overwrite : bool
        Replace a dataset in ``out``: the new one is built aside and swapped in when complete.
    progress : bool
        Show progress on stderr: a bar on a terminal, else a line a minute (``gdsdata.progress``).
    num_parts, part : int
        Pack contiguous part ``part`` of ``num_parts`` (for ``merge``).
    resume : bool
        Finish an interrupted pack into ``out`` with the same options, keeping its finished shards.
    append : bool
        Add the images of ``src`` that ``out`` does not hold yet (new classes get the next labels).
    allow_empty_classes : bool
        Keep class folders without images as classes (torchvision's ImageFolder refuses them).
    on_progress : callable, optional
        Called with 0 as the images start (the source listed, a resume's shards checked), then with
        a count as images are done.
    format : str
        "folder" (classification: ImageFolder, LMDB, tar), or a detection source: "yolo" (``src``:
        an Ultralytics data YAML, a dataset folder with ``images/<split>``, or an images folder) or
        "coco" (``src``: the images folder; ``annotations``: the instances JSON).
    split : str, optional
        YOLO: the split to pack ("train", "val", "test"; a data YAML's or a dataset folder's default:
        "train"). An images folder holding split folders (``train/``, ``val/``...) needs it; one of a
        single split's images refuses it.
    annotations : str or os.PathLike, optional
        COCO: the instances JSON.
    shard_roots : sequence of str or os.PathLike, optional
        Folders on other drives (one per NVMe drive, say) to spread the shards over, shard k on
        root k mod N (part p's shard k on root (p + k) mod N), in a folder
        ``NAME.gdsdata-shards-ID`` there; ``out`` holds the index and a symbolic link to each shard.
        Reads of a batch then go to every drive at once.

    Returns
    -------
    PackResult
        Counts, sizes, time, and what was skipped, ignored or could not be read (also in
        ``out/pack_report.json``).

    Raises
    ------
    GdsDataError
        Its subclasses (``SourceError``, ``OutputExistsError``, ``FormatError``...) with the one line
        the CLI prints. It names the CLI's options; each is the keyword of the same name here
        (``--overwrite``: ``overwrite=True``, ``--resume``: ``resume=True``).
    """
    inherit = options is None  # (an append then stores its images as the dataset's were)
    options = options or PackOptions()
    settings.as_dict()  # a bad GDSDATA_* variable is said before OUT is made
    src, annotations = local_path(given_path("src", src)), local_path(given_path("annotations", annotations))
    if not isinstance(src, Listing) and not is_url(src):
        src = os.path.abspath(os.fspath(src))
    # a link to a dataset: that dataset (its own folder is swapped)
    out = os.path.realpath(os.fspath(output_path("out", out)))
    if shard_size < alignment * 2:
        raise ValueError(f"shard size must be at least twice the alignment ({alignment * 2} bytes)")
    if not 0 <= part < num_parts:
        raise ValueError(f"part must be between 0 and num_parts - 1 ({num_parts - 1}), got {part}")
    if append and (resume or overwrite or num_parts > 1):
        raise ValueError("append goes with none of resume, overwrite or parts")
    if resume and overwrite:
        raise ValueError("resume keeps what an interrupted pack finished, overwrite replaces it: not both")
    if alignment < 64 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two of at least 64, got {alignment}")
    if not is_integer(workers) or workers < 0:
        raise ValueError(f"workers must be 0 (every core) or a number of processes, got {workers!r}")
    max_skipped = skip_limit(max_skipped)
    roots = shard_roots_of(shard_roots, out, src if isinstance(src, str) else None)
    # 1: this process alone, without the stall bound (the automatic choice is always a pool: bounded)
    workers = workers or max(2, settings.usable_cores())
    started = time.perf_counter()
    if format == "folder" or isinstance(src, Listing):
        source = open_source(src, strict=strict, allow_empty=allow_empty_classes)
    else:
        source = open_detection(format, src, split=split, annotations=annotations, strict=strict)
    if getattr(source, "format", "") == "yolo" and not options.exif_transpose:
        options = replace(options, exif_transpose=True)  # YOLO labels are in the EXIF-oriented frame
    name = src if isinstance(src, str) else source.root
    try:
        if (part + 1) * len(source.items) // num_parts == part * len(source.items) // num_parts:
            raise SourceError(f"{name}: part {part} of {num_parts} would hold no image ({len(source.items)} in all): "
                              f"split it into at most {len(source.items)} parts")
        if format == "folder" and isinstance(src, str) and os.path.isdir(src) and within(out, src):
            raise SourceError(f"{out}: inside the source folder {src}; pack into a folder outside it (its "
                              f"shards would be read as images of a class)")
        what = "append" if append else "resume" if resume else "pack"
        with writer_lock(out, f"{what} of {annotations if format == 'coco' and annotations else name}"):
            def build(folder):
                return _pack(source, name, folder, out, options, shard_size, alignment, workers, strict,
                             progress, num_parts, part, resume, append, started, on_progress, roots, inherit,
                             max_skipped)

            if resume and os.path.isdir(out):
                check_output(out, False, resume=True)  # (an interrupted pack's files, or a finished one's, only)
                return build(out)
            if append:
                return build(out)
            return into(out, overwrite, build)  # (a resume with nothing to resume packs from the start)
    finally:
        source.close()


def reasons(left_out, most=3) -> str:
    """The first files of a report's list, each with why it was left out."""
    said = "; ".join(f"{item['path']}: {item['reason']}" for item in left_out[:most])
    return said + (" ..." if len(left_out) > most else "")


# the lists of a report that name files left out of the dataset (what --max-skipped counts): those the
# listing could not read, a detection source's images left out for their labels (each once), those that
# failed to decode or check
LEFT_OUT = ("unreadable", "labels.left_out", "skipped")


def saved_report(folder, complete=True):
    """The ``pack_report.json`` in ``folder`` (a dataset, a part) as a dict, or None where there is
    none readable (with ``complete``, also where its pack did not finish)."""
    try:
        with open(open_regular(os.path.join(folder, fmt.REPORT_NAME), what="a report"), encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError, FormatError):
        return None
    if not isinstance(report, dict) or (complete and report.get("status") != "complete"):
        return None
    return report


def report_lists(folder, lists=("skipped",)):
    """The files the ``pack_report.json`` in ``folder`` (a dataset, a part) lists under ``lists``
    ({"path", "reason"} each; "labels.left_out" is a list inside one), or None without a readable one."""
    report = saved_report(folder, complete=False)
    return None if report is None else listed_in(report, lists)


def listed_in(report, lists=("skipped",)):
    """The files a report (a ``pack_report.json``'s dict) lists under ``lists``, or None where they
    are not lists of {"path", "reason"} (a report damaged or written by hand)."""
    def entries(name):
        found = report
        for key in name.split("."):
            found = found.get(key) if found is not None else None
        if found is None and name == "labels.left_out":  # (a report from before left_out: its bad labels,
            found = (report.get("labels") or {}).get("bad_labels") or []  # each path once)
            found = each_once(found) if all(isinstance(item, dict) and "path" in item for item in found) else found
        return found or []
    try:
        listed = [item for name in lists for item in entries(name)]
    except (AttributeError, TypeError):
        return None
    if not all(isinstance(item, dict) and isinstance(item.get("path"), str) for item in listed):
        return None
    return [{"path": item["path"], "reason": str(item.get("reason", ""))} for item in listed]


def check_skipped(what, left_out, packed, max_skipped, listed=True):
    """Raise ``BadImageError`` when ``left_out`` (files unreadable, left out for their labels or
    skipped, as a report lists them) is more than ``max_skipped`` allows of ``packed`` plus them. The
    line says how many, the limit, and (``listed``: a failed report in OUT lists them all) the last
    file, or else the first ones."""
    files = packed + len(left_out)
    allowed = skips_allowed(max_skipped, files)
    if allowed is None or len(left_out) <= allowed:
        return
    share = f" ({allowed} of {files} files)" if isinstance(max_skipped, str) else ""
    last = left_out[-1]
    which = (f"the last: {last['path']}: {last['reason']} ({fmt.REPORT_NAME} lists them)" if listed else
             f"{reasons(left_out)}")
    raise BadImageError(f"{what}: {len(left_out)} file(s) left out, more than --max-skipped {max_skipped}{share} "
                        f"allows; {which}")


def _listing_left_out(source) -> list:
    """What the listing of ``source`` left out of the dataset before anything is packed: the files it
    could not read, then a detection source's images left out for their labels, each once (which its
    label report keeps as ``left_out``)."""
    unreadable = each_once(getattr(source, "unreadable", []))  # (a list file may name a missing file twice)
    report = getattr(source, "report", None)
    if not isinstance(report, LabelReport):
        return unreadable
    return unreadable + report.settle(_named(source))


def _named(source) -> set:
    """The names (as reports give them) of the images ``source`` gives or could not read: a COCO file
    named by a record left out and by one kept is among them."""
    return {display(item.rel) for item in source.items} | {item["path"] for item in getattr(source, "unreadable", [])}


def _known_left_out(out, held) -> set:
    """The paths an append's --max-skipped does not count: the files its dataset's report lists as left
    out (counted when they were), and those the dataset holds (``held``, by path: a file since deleted
    is not left out)."""
    return {item["path"] for item in report_lists(out, LEFT_OUT) or []} | {display(name) for name in held}


def _appendable(out, source, alignment):
    """(dataset, items to add with their labels in the dataset's class list, the extended list, the
    dataset's samples by path)."""
    base = index_io.load(out)
    if base.alignment != alignment:
        raise SourceError(f"{out}: alignment {base.alignment}; append with --alignment {base.alignment}")
    task = getattr(source, "task", "classify")
    if base.task != task:
        raise SourceError(f"{out}: a {base.task} dataset; {source.root} is a {task} source")
    if task == "detect" and source.classes != base.classes:
        raise SourceError(f"{out}: appending detection images needs the same class names ({len(base.classes)} in "
                          f"the dataset, {len(source.classes)} in {source.root})")
    held = {}  # every sample of a path (a merge of datasets may hold a path twice)
    for i in range(len(base)):
        held.setdefault(base.path(i), []).append(i)
    _check_held(base, source, held)
    if task == "detect":
        _check_held_boxes(base, source, held)
    added = set(source.classes) - set(base.classes)
    if isinstance(source, (FolderSource, RemoteFolderSource)) and base.classes == sorted(base.classes):
        classes = sorted(set(base.classes) | added)  # ImageFolder's labels: the sorted names, old and new alike
    else:  # the order a source gave (an LMDB's class list, a tar's label numbers): new classes after it, in it
        classes = base.classes + [name for name in source.classes if name in added]
    label = {name: k for k, name in enumerate(classes)}
    items = [replace(item, label=label[source.classes[item.label]]) for item in source.items if item.rel not in held]
    return base, items, classes, held


PIXEL_OPTIONS = ("codec", "quality", "max_side", "raw_size", "exif_transpose")  # what a sample's bytes depend on


def packed_options(meta) -> dict:
    """The options a dataset's metadata records that its samples' stored bytes depend on."""
    return {k: v for k, v in (meta.get("options") or {}).items() if k in PIXEL_OPTIONS}


def _append_options(base, options, inherit) -> PackOptions:
    """The options an append stores its images with: the dataset's (``inherit``: none given), or the
    given ones where they store images as the dataset's were; others are refused, as one dataset of
    mixed sizes or codecs would be (its recorded options the last append's)."""
    held = packed_options(base.meta)
    if inherit:
        return replace(options, **held)
    other = {k: v for k, v in held.items() if getattr(options, k) != v}
    if other:
        given = ", ".join(f"{k}={getattr(options, k)!r}" for k in other)
        packed = ", ".join(f"{k}={v!r}" for k, v in other.items())
        raise SourceError(f"{base.root}: packed with {packed}; appending with {given} would store its new images "
                          f"otherwise: append with the dataset's options (the command line takes them when none "
                          f"is given; in Python, options=None)")
    return options


def _check_held(base, source, held):
    """An append adds the paths the dataset does not hold; a file at a path it holds must be the image
    packed from it, or the new image would be dropped unseen. Compared where the dataset stored the file
    byte for byte (not converted at pack time): its size (a folder's file, an object's size as listed, a
    tar member's), and in an LMDB, whose values are read to know it, its CRC-32 too."""
    for item in source.items:
        stored = [k for k in held.get(item.rel, ()) if not base.samples[k]["flags"] & fmt.FLAG_CONVERTED]
        if not stored:
            continue
        try:
            if isinstance(item.ref, tuple):  # a tar member: the size its header gives
                size, crc = item.ref[1].size, None
            elif item.ref is not None:
                data = source.read(item)
                size, crc = len(data), zlib.crc32(data)
            elif is_url(item.path):  # the size the listing gave (no request an object)
                size, crc = source.sizes[item.rel], None
            else:
                size, crc = os.stat(item.path).st_size, None
        except (BadImageError, OSError):
            continue  # unreadable now: nothing to compare (the dataset keeps what it packed)
        if size is None:  # a listing that gives no sizes (HTTP)
            continue
        if not any(int(base.samples[k]["length"]) == size and crc in (None, int(base.samples[k]["crc32"]))
                   for k in stored):
            length = int(base.samples[stored[0]]["length"])
            where = item.path or os.path.join(str(source.root), item.rel)
            raise SourceError(f"{display(where)}: {base.root} already holds a "
                              f"different image under {display(item.rel)} ({size:,} bytes here, {length:,} packed); "
                              f"--append adds only the paths the dataset does not hold: pack again with "
                              f"--overwrite to replace images")


def _check_held_boxes(base, source, held):
    """A detection append adds the images the dataset does not hold; an image it holds whose labels
    now give other boxes than were packed for it, or are bad now (the source leaves it out), is
    refused, or its new labels would be dropped unseen (the image itself is compared by ``_check_held``)."""
    def same(a, b):  # the same boxes in any order (a re-exported annotations file may order them otherwise)
        return len(a) == len(b) and np.array_equal(np.sort(a, order=list(a.dtype.names)),
                                                   np.sort(b, order=list(b.dtype.names)))

    given = _named(source)
    held_names = {display(name) for name in held}
    for entry in source.report.bad_labels:
        if entry["path"] in held_names and entry["path"] not in given:
            raise SourceError(f"{display(os.path.join(str(source.root), entry['path']))}: its labels are bad now "
                              f"({entry['reason']}), and {base.root} holds it with the boxes packed before; --append "
                              f"adds only the images the dataset does not hold: pack again with --overwrite to "
                              f"leave it out")
    for item in source.items:
        packed = [base.sample_boxes(k) for k in held.get(item.rel, ())]
        if not packed or any(same(boxes, item.boxes) for boxes in packed):
            continue
        where = item.path or os.path.join(str(source.root), item.rel)
        now = (f"other boxes than the {len(packed[0])}" if len(item.boxes) == len(packed[0]) else
               f"{len(item.boxes)} box(es), not the {len(packed[0])}")
        raise SourceError(f"{display(where)}: its labels give {now} {base.root} holds for it; --append adds only the "
                          f"images the dataset does not hold: pack again with --overwrite to take the new labels")


def _finished(out, src, signature, source, items, started) -> PackResult:
    """A resume of a pack that finished: the dataset as it is (untouched) where its index records
    this pack's source, options, part and listing; ``OutputExistsError`` where it records others."""
    base = index_io.load(out)
    meta = base.meta
    options = {**signature["options"], "shard_size": signature["shard_size"], "alignment": signature["alignment"]}
    part = (meta.get("part") or {}).get("part", 0), (meta.get("part") or {}).get("num_parts", 1)
    if meta.get("listing") is None:
        raise OutputExistsError(f"{out}: already a finished dataset (its index does not record the listing it was "
                                f"packed from: a merge, an append or an earlier gdsdata); nothing to resume")
    packed = {"source": meta.get("source"), "options": meta.get("options"), "part": list(part),
              "listing": meta.get("listing")}
    now = {"source": src, "options": options, "part": signature["part"],
           "listing": _listing_digest(items, source.classes)}
    if packed != now:
        raise OutputExistsError(f"{out}: already a finished dataset, which differs from this pack: "
                                f"{_differences(packed, now)}; nothing to resume (pack with --overwrite to replace it)")
    log.info("%s: finished already (packed from %s with these options); nothing to resume", out, display(src))
    result = _unchanged(base, source, out, started)
    saved = saved_report(out)  # (None: it ended between its index and its report)
    try:
        if saved is not None:
            result.report_path = os.path.join(out, fmt.REPORT_NAME)
            result.skipped = list(saved.get("skipped") or [])  # what that pack left out: a retry's log says it again
            result.repaired = list(saved.get("repaired") or [])
            result.labels = saved.get("labels") if isinstance(saved.get("labels"), dict) else None
    except TypeError:  # (a report written by hand)
        pass
    result.finished_before = True
    return result


def _differences(then: dict, now: dict) -> str:
    """What differs between the signature a pack recorded (``then``) and this pack's, in words."""
    said = []
    if then.get("source") != now.get("source"):
        said.append(f"packed from {then.get('source')}, now from {now.get('source')}")
    if then.get("part") != now.get("part"):
        said.append(f"part {then.get('part')}, now {now.get('part')} (part, parts)")
    def options(record):  # (a journal's signature holds shard_size and alignment beside its options)
        return {**(record.get("options") or {}), **{k: record[k] for k in ("shard_size", "alignment") if k in record}}

    before, given = options(then), options(now)
    said.extend(f"{k} {before.get(k)!r} then, {given.get(k)!r} now" for k in sorted(set(before) | set(given))
                if before.get(k) != given.get(k))
    if not said and then.get("listing") != now.get("listing"):
        said.append("the source changed since (files added, removed, renamed or relabelled, or other class names or "
                    "boxes)")
    return "; ".join(said) or "its record differs"


def _unchanged(base, source, out, started, skipped=(), labels=None) -> PackResult:
    """An append that adds nothing: the dataset as it is (left untouched), and the new files that
    could not be packed, if any (``labels``: the source's label report, settled)."""
    log.info("nothing appended to %s from %s (%d new file(s) that cannot be packed)", out, source.root, len(skipped))
    return PackResult(out, len(base), *base.flag_counts(), len(base.shards), int(base.shards["size"].sum()),
                      time.perf_counter() - started, list(skipped), source.ignored,
                      getattr(source, "unreadable", []), getattr(source, "special", []),
                      labels=labels, boxes=base.meta.get("detection", {}).get("boxes", 0), new=0)


def within(path, folder) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it, links followed."""
    real = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), real]) == real


def shard_roots_of(shard_roots, out, src=None) -> list:
    """``pack``'s shard_roots as absolute paths, each a folder (made if missing) outside ``out`` and
    outside the source folder ``src`` (links followed)."""
    roots = [os.path.abspath(os.fspath(output_path("a shard root", r))) for r in (shard_roots or ())]
    real = [os.path.realpath(r) for r in roots]
    if len(set(real)) != len(roots):
        twice = next(r for k, r in enumerate(roots) if real[k] in real[:k])
        raise ValueError(f"{twice}: named twice as a shard root (--shard-root)")
    for root in roots:
        if os.path.exists(root) and not os.path.isdir(root):
            raise OutputExistsError(f"{root}: a shard root must be a folder")
        if within(root, out) or within(out, root):
            raise OutputExistsError(f"{root}: a shard root must lie outside the dataset folder {out} and not "
                                    f"hold it")
        if isinstance(src, str) and os.path.isdir(src) and within(root, src):
            raise OutputExistsError(f"{root}: a shard root inside the source folder {src} would become a class "
                                    f"folder of it")
    devices = {}
    for root in roots:
        devices.setdefault(_device_of(root), []).append(root)
    shared = [group for group in devices.values() if len(group) > 1]
    if shared:
        log.warning("shard roots on one device: %s; their reads do not add up as separate drives' do (a drive "
                    "not mounted?)", "; ".join(", ".join(group) for group in shared))
    return roots


def _device_of(path) -> int:
    """The device of the file system ``path`` is on (or would be made on: its nearest existing folder's)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return os.stat(path).st_dev


def _then_resume(error: OSError) -> str:
    """What to do before ``--resume`` after a write error: make room where the disk or quota is full,
    else put right what the error says (a file removed under the pack, a read-only remount...)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space, then run the same command with --resume"
    return "once that is put right, run the same command with --resume"


def _pack(source, src, folder, out, options, shard_size, alignment, workers, strict, progress,
          num_parts, part, resume, append, started, on_progress=None, roots=(), inherit=False, max_skipped=None):
    """Pack into ``folder`` (``out`` itself, or where an overwrite builds its replacement); messages
    and the report name ``out``."""
    classes, everything = source.classes, source.items
    # a detection source's label report: an image left out takes its boxes' notes with it
    label_report = source.report if isinstance(getattr(source, "report", None), LabelReport) else None
    if append:
        base, everything, classes, held = _appendable(out, source, alignment)
        options = _append_options(base, options, inherit)
        if not everything:  # up to date: the dataset stays as it is, untouched (unless more new files than
            listing_left_out = _listing_left_out(source)  # --max-skipped allows were left out)
            if max_skipped is not None:
                known = _known_left_out(out, held)
                check_skipped(display(src), [item for item in listing_left_out if item["path"] not in known],
                              0, max_skipped, listed=False)
            return _unchanged(base, source, out, started, labels=label_report and label_report.as_dict())
    first, last = part * len(everything) // num_parts, (part + 1) * len(everything) // num_parts
    items = everything[first:last]
    ignored = source.ignored if part == 0 else []
    signature = {"source": src, "options": asdict(options), "shard_size": shard_size, "alignment": alignment,
                 "part": [part, num_parts], "items": len(items), "listing": _listing_digest(items)}
    if resume and os.path.exists(os.path.join(out, fmt.INDEX_NAME)):
        return _finished(out, src, signature, source, items, started)
    begun = resume and os.path.isdir(out) and any(name.endswith(fmt.JOURNAL_SUFFIX) for name in os.listdir(out))
    journals = _resume_state(out, signature, progress, items) if resume else []
    if resume and not begun:
        log.warning("%s: nothing to resume (no finished shard of an interrupted pack there): packing from the start",
                    out)
    dataset_id = bytes.fromhex(journals[0]["dataset_id"]) if journals else os.urandom(16)
    records, strings, skipped, repaired = [], bytearray(), [], []
    stamps, skipped_stamps = [], {}  # each record's source as read, and each file skipped since the last journal's
    shard_rows = []
    converted = resized = done = 0
    base_stamp = index_io.stamp(out) if append else None  # which index file the dataset held when it began
    if append:  # the dataset so far, unchanged; new samples go to new shards
        position = {name: k for k, name in enumerate(classes)}
        relabel = [position[name] for name in base.classes]  # the dataset's labels in the merged class list
        dataset_id, records, strings, shard_rows = base.dataset_id, base.samples.tolist(), bytearray(base.strings), \
            base.shards.tolist()
        records = [row[:4] + (relabel[row[4]],) + row[5:] for row in records]
        stamps = [None] * len(records)
        converted, resized = base.flag_counts()
    for journal in journals:
        for row, rel in zip(journal["samples"], journal["paths"]):
            path_bytes = rel.encode("utf-8", "surrogateescape")
            records.append(tuple(row[:1]) + (len(strings),) + tuple(row[2:]))
            strings += path_bytes
        stamps += journal.get("stamps") or [None] * len(journal["samples"])
        shard_rows.append(tuple(journal["shard"][:4]) + (dataset_id, journal["shard"][5], 0))
        skipped[:] = journal["skipped"]
        if label_report is not None:
            for item in skipped:
                label_report.forget(item["path"])
        repaired[:] = journal.get("repaired", [])
        converted, resized, done = journal["converted"], journal["resized"], journal["items_done"]
    position = {"item": done, "shard_start": len(records)}  # source items consumed; this shard's first record
    carried = len(records)  # an append's base and a resume's kept shards: packed before this run

    def remove_written(keep=False):
        """What this run wrote, on every drive (``keep``: only a journal cut short; its finished shards stay
        for ``--resume``)."""
        doomed = []
        for shard in range(len(shard_rows), writer.next_shard + 1):
            journal = _journal_path(folder, shard)
            names = (fmt.shard_name(shard), fmt.shard_name(shard) + fmt.TMP_SUFFIX, journal)
            whole = not keep or not os.path.exists(journal)  # (a shard finished as its journal was cut short too)
            doomed += [journal + fmt.TMP_SUFFIX] + ([os.path.join(folder, n) for n in names] if whole else [])
        # (a folder made read-only meanwhile): what stopped the run is what is said
        remove_shards(doomed, dataset_id, on_error=lambda path, e: log.warning(
            "%s: left behind, it cannot be removed (%s)", path, e.strerror or e))

    left = "no index written, and nothing removed: " + (  # (where OUT's lock file went: ``lock.lost``)
        "the dataset there is as it was (the next append clears this one's shards)" if append else
        "its finished shards stay for pack --resume, once no other gdsdata writes it")

    def still_locked():
        """Before each shard takes its name and before the index, in place: ``LockLost`` where OUT's
        lock file went while this ran (built aside, ``into`` keeps the result whole)."""
        if folder == out:
            check_held(out, left)

    def write_journal(shard, record):
        mine = range(position["shard_start"], len(records))
        position["shard_start"] = len(records)
        _write_json(_journal_path(folder, shard), {
            "signature": signature, "dataset_id": dataset_id.hex(),
            "shard": [int(v) if not isinstance(v, bytes) else v.hex() for v in record],
            "samples": [list(records[k]) for k in mine],
            "paths": [_record_path(records[k], strings) for k in mine],
            "stamps": [stamps[k] for k in mine], "skipped_stamps": dict(skipped_stamps),  # (its shard's alone)
            "skipped": skipped, "repaired": repaired, "converted": converted, "resized": resized,
            "items_done": position["item"]})
        skipped_stamps.clear()

    if append:  # what an append that failed left beyond the dataset's shards (its own, on every drive)
        doomed = []
        for name in os.listdir(folder):
            number = name.split(".")[0].removeprefix("shard-")
            if gdsdata_owned(name) and name.startswith("shard-") and number.isdigit() and \
                    int(number) >= len(shard_rows):
                doomed.append(os.path.join(folder, name))
        remove_shards(doomed, dataset_id)
    writer = ShardWriter(folder, alignment, shard_size, dataset_id, first_shard=len(shard_rows),
                         first_sample=len(records), on_close=write_journal, before_close=still_locked, roots=roots,
                         owner=out, root_offset=part)
    unreadable = getattr(source, "unreadable", []) if part == 0 else []
    special = getattr(source, "special", []) if part == 0 else []
    labels_noted = label_report is not None and part == 0  # (the source's label report: in part 0's report)
    listing_left_out = _listing_left_out(source) if part == 0 else []  # (with the images left out for their labels)
    report = report_opening(src, out, classes, roots,
                            {"ignored": ignored, "skipped": skipped, "unreadable": unreadable, "special": special,
                             "repaired": repaired, **({"labels": label_report.as_dict()} if labels_noted else {})},
                            part={"part": part, "num_parts": num_parts, "first_item": first, "items": len(items)}
                            if num_parts > 1 else None)
    jobs = (_job(source, item, options) for item in items[done:])
    labels = {item.rel: item.label for item in items}
    task = getattr(source, "task", "classify")
    sizes = {item.rel: item.size for item in items if item.size is not None}
    min_side = getattr(source, "min_side", 0)  # YOLO: Ultralytics leaves out images under 10 pixels a side,
    formats = getattr(source, "image_formats", None)  # and those whose content is not one of its formats
    listed = folder == out and not append  # (a failed report in OUT lists what was left out; an overwrite or
    # an append that fails leaves OUT's dataset and report as they were)
    # an append tries again the files its dataset's report lists as left out: they count once, not each time
    known = _known_left_out(out, held) if append and max_skipped is not None else set()
    # a part of several counts the files of its own range; part 0 checks what the listing left out once,
    # against the whole source's files (a share of one part's files would stop it where the whole passes)
    counted = listing_left_out if num_parts == 1 else []
    left_out = {"count": sum(item["path"] not in known for item in counted + skipped)}  # (the listing's, a
    # resume's; counted as files are skipped, the list made only to say it)

    def check_left_out(item=None):
        left_out["count"] += item is not None and item["path"] not in known
        allowed = skips_allowed(max_skipped, len(items) - len(skipped) + left_out["count"])
        if left_out["count"] > allowed:
            check_skipped(display(src), [item for item in counted + skipped if item["path"] not in known],
                          len(items) - len(skipped), max_skipped, listed)

    try:
        if max_skipped is not None:
            if num_parts > 1 and listing_left_out:
                check_skipped(display(src), listing_left_out, len(everything), max_skipped, listed)
            check_left_out()
        bar = progress_bar(progress, total=len(items), initial=done, unit="img", desc="pack")
        with bar:
            if on_progress is not None:
                on_progress(0)
            for rel, prepared, reason, stamp in _results(jobs, workers):
                bar.update()
                if on_progress is not None:
                    on_progress(1)
                declared = sizes.get(rel)
                if prepared is not None and declared and not prepared.flags & fmt.FLAG_RESIZED and \
                        (prepared.width, prepared.height) != declared:
                    turned = (prepared.height, prepared.width) == tuple(declared)
                    prepared, reason = None, (f"the image is {prepared.width}x{prepared.height}, its annotations "
                                              f"were made for {declared[0]}x{declared[1]}" + (
                                                  " (the same turned a quarter: COCO images are packed as stored, "
                                                  "no EXIF orientation applied, as torchvision reads them)"
                                                  if turned else ""))
                if prepared is not None and min_side and min(prepared.source_size) < min_side:
                    prepared, reason = None, (f"the image is {prepared.source_size[0]}x{prepared.source_size[1]}, "
                                              f"under {min_side} pixels a side (Ultralytics leaves such an image out)")
                if prepared is not None and formats is not None and prepared.source_format not in formats:
                    prepared, reason = None, (f"a {prepared.source_format.upper() or 'unnamed'} image by its content, "
                                              f"not one of Ultralytics' image formats (it leaves such an image out)")
                if prepared is not None and prepared.warning and strict:
                    prepared, reason = None, (f"libjpeg: {prepared.warning}: it decodes only with warnings (without "
                                              f"--strict: stored as PIL decodes it, listed under repaired)")
                if prepared is None:
                    if strict:
                        raise BadImageError(f"{display(os.path.join(src, rel))}: {reason}")
                    skipped.append({"path": display(rel), "reason": reason})
                    skipped_stamps[display(rel)] = stamp
                    if label_report is not None:
                        label_report.forget(display(rel))
                    log.info("skipped %s: %s", display(rel), reason)  # (the report lists them, the CLI says them)
                    if max_skipped is not None:
                        check_left_out(skipped[-1])
                    position["item"] += 1
                    continue
                shard, offset = writer.add(prepared.payload)  # may close a shard: its journal ends here
                path_bytes = rel.encode("utf-8", "surrogateescape")  # the name's bytes, whatever they are
                records.append((offset, len(strings), len(prepared.payload), shard, labels[rel],
                                prepared.width, prepared.height, zlib.crc32(prepared.payload), len(path_bytes),
                                prepared.codec, prepared.components, prepared.subsampling, prepared.flags))
                strings += path_bytes
                stamps.append(stamp)
                converted += bool(prepared.flags & fmt.FLAG_CONVERTED)
                resized += bool(prepared.flags & fmt.FLAG_RESIZED)
                if prepared.warning:  # (after add: a journal it closed holds its own shard's, not this one)
                    repaired.append({"path": display(rel), "reason": f"libjpeg: {prepared.warning}; stored as PIL "
                                                                       f"decodes it"})
                position["item"] += 1
        if append and len(records) == len(base):  # every new file was bad (each in skipped): nothing written
            return _unchanged(base, source, out, started, skipped)
        if not records and num_parts == 1:  # (a part of bad files only is an empty part: the merge skips it)
            reasons = "; ".join(f"{item['path']}: {item['reason']}" for item in skipped[:3])
            raise SourceError(f"{src}: none of its {len(items)} image files could be packed ({reasons}"
                              f"{' ...' if len(skipped) > 3 else ''})")
        writer.close_shard()
    except BaseException as e:
        if folder == out:  # (where OUT's lock file went, another writer's files may be here now: none removed)
            keep_if_lost(out, e, left)
        writer.abort()  # the shard being written, never finished, goes
        # resumable: finished shards stay (not those of an overwrite's replacement, nor an append's, which go)
        keep = isinstance(e, (KeyboardInterrupt, OSError, SourceGoneError)) and folder == out and not append
        remove_written(keep)
        finished = sum(os.path.exists(_journal_path(folder, k)) for k in range(len(shard_rows), writer.next_shard))
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        report.update(status=status, error=str(e) if isinstance(e, (GdsDataError, OSError)) else repr(e),
                      finished_shards=finished if keep else 0)
        try:
            if not append:  # (an append leaves the dataset as it was, its report too)
                _write_json(os.path.join(folder, fmt.REPORT_NAME), report)
        except OSError:  # the disk may be full: the error says what happened
            pass
        kept = finished + len(journals) if keep else 0  # (finished shards a --resume goes on from)
        if isinstance(e, SourceGoneError):
            then = (f"{kept} finished shard(s) kept: once it answers again, run the same command with --resume"
                    if kept else "the dataset there is unchanged" if append or folder != out else "nothing kept")
            raise SourceGoneError(e.what, then + ("" if kept else "; once it answers again, run the same command")) \
                from None
        if isinstance(e, OSError) and keep:
            hint = f"; {kept} finished shard(s) kept: {_then_resume(e)}" if kept else ""
            raise OSError(e.errno, f"{e.strerror or e} while writing {e.filename or out}{hint}",
                          out) from e
        if isinstance(e, OSError):  # an overwrite's replacement, built aside, or an append's shards: removed
            what = "the appended shards" if append else "the replacement dataset"
            raise OSError(e.errno, f"{e.strerror or e} while writing {what}; the dataset there is unchanged",
                          out) from e
        raise
    indexed = False
    try:  # the tables, then the index: the dataset is complete once it is renamed into place
        samples = np.array(records, dtype=fmt.SAMPLE_RECORD)
        shard_table = np.array(shard_rows + writer.records, dtype=fmt.SHARD_RECORD)
        seconds = time.perf_counter() - started
        per_class = np.bincount(samples["label"], minlength=len(classes)).tolist()
        meta = {
            "classes": classes,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gdsdata_version": __version__,
            "source": src,
            "options": {**asdict(options), "shard_size": shard_size, "alignment": alignment},
            "listing": None if append else _listing_digest(items, classes),  # (what a resume of it compares)
            "counts": {"packed": len(samples), "skipped": len(skipped), "converted": converted,
                       "resized": resized, "ignored": len(ignored), "per_class": per_class},
        }
        if num_parts > 1:
            meta["part"] = report["part"]
        box_args = {}
        if task == "detect":
            # every sample's boxes and COCO image id in sample order: an append's base samples with their own,
            # then the source's, found by the sample's path
            first = len(base) if append else 0
            item_of = {item.rel: item for item in items}
            new = [item_of[_record_path(record, strings)] for record in records[first:]]
            per_sample = [base.sample_boxes(k) for k in range(first)] + [item.boxes for item in new]
            before = base.image_ids if append else []
            ids = None if before is None or any(item.image_id is None for item in items) else \
                before + [item.image_id for item in new]
            box_args = annotate(meta, classes, source.format, source.category_ids, per_sample, ids)
            per_class = meta["counts"]["per_class"]  # boxes per class, not samples
            report["labels"] = source.report.as_dict() if part == 0 or num_parts == 1 else None
            if num_parts == 1:  # the source's images kept without boxes (not those then skipped, nor a base's)
                report["labels"]["negatives"] = sum(1 for boxes in per_sample[first:] if not len(boxes))
        total = int(shard_table["size"].sum())
        if append:
            report["appended"] = len(samples) - len(base)
            meta["appended"] = base.meta.get("appended", []) + [{"source": src, "samples": report["appended"]}]
        report_complete(report, classes, per_class, shard_table, seconds, packed=len(samples), converted=converted,
                        resized=resized, resumed_shards=len(journals))
        gone = next((name for name in map(fmt.shard_name, range(len(shard_table)))
                     if not os.path.isfile(os.path.join(folder, name))), None)
        if gone is not None:  # (the folder removed or changed under the pack: no index that names what is not there)
            raise GdsDataError(f"{os.path.join(folder, gone)}: gone before the pack could finish (the folder was "
                               f"removed or changed while it ran); no index written: pack again")
        still_locked()
        with deferred_signals():  # the index, the report that describes it, the journals gone (the index is
            # authoritative): Ctrl-C or SIGTERM waits for all three (then raised here, the dataset complete)
            index_io.write(folder, alignment, dataset_id, shard_table, samples, bytes(strings), meta, **box_args)
            indexed = True
            report_path = _complete_report(folder, out, report)
            _drop_journals(folder, len(shard_table))
    except BaseException as e:
        if folder == out and not indexed:  # (as above; once indexed, the dataset is complete)
            keep_if_lost(out, e, left)
        with contextlib.suppress(OSError):  # an index cut short (finished shards and journals stay for --resume)
            os.unlink(os.path.join(folder, fmt.INDEX_NAME + fmt.TMP_SUFFIX))
        if append and index_io.stamp(out) == base_stamp:  # the dataset's own index still in place: this run's go
            remove_written()
        if isinstance(e, OSError) and not append:
            report.update(status="failed", error=f"{e.strerror or e} while writing the index")
            try:
                _write_json(os.path.join(folder, fmt.REPORT_NAME), report)
            except OSError:
                pass
        if isinstance(e, OSError):
            then = ("the dataset there is unchanged" if append or folder != out else
                    f"its shards are kept: {_then_resume(e)}")
            raise OSError(e.errno, f"{e.strerror or e} while writing the index of {display(out)}; {then}") from e
        raise
    log.info("packed %d images into %d shards in %.1f s", len(samples), len(shard_table), seconds)
    return PackResult(out, len(samples), converted, resized, len(shard_table), total, seconds,
                      skipped, ignored, unreadable, special, report_path, len(journals), report.get("labels"),
                      meta.get("detection", {}).get("boxes", 0), len(samples) - carried,
                      [name for k, name in enumerate(base.classes) if relabel[k] != k] if append else [],
                      repaired=repaired)


def _drop_journals(folder, shards: int):
    """The journals of a dataset whose index is in place (one that cannot go now, the next writer removes)."""
    for shard in range(shards):
        with contextlib.suppress(OSError):
            os.unlink(_journal_path(folder, shard))


def _complete_report(folder, out, report) -> str:
    """Write a complete dataset's report; its path in ``out``, or "" where it could not be written (the
    index is in place: the dataset is complete whether or not it can)."""
    try:
        _write_json(os.path.join(folder, fmt.REPORT_NAME), report)
    except OSError as e:
        log.warning("%s: the dataset is complete, but its report could not be written (%s)", out, e.strerror or e)
        return ""
    return os.path.join(out, fmt.REPORT_NAME)


def _record_path(record, strings) -> str:
    """A sample record's (a SAMPLE_RECORD tuple's) source path in the strings blob."""
    return bytes(strings[record[1]:record[1] + record[8]]).decode("utf-8", "surrogateescape")
