"""``gdsdata pack --ray``: a pack's parts as Ray tasks on a cluster (or a local Ray), then one merge.

The driver lists the source once (a folder, local or through fsspec; tar shards and LMDBs are
listed by each task) and holds the output's writer lock throughout. Each part (``pack --num-parts
N --part K``, today's crash-safe machinery) is one task packing into ``.OUT.gdsdata-parts-*/part-K``
beside OUT, so that every node must see OUT's filesystem at the same path. A task that fails or whose
worker is killed is retried by Ray and resumes its part from the shards it finished
(``pack(resume=True)``). When every part is done they are merged, with the checks of ``merge``,
into OUT (their shards hard-linked, or with shard roots moved on their drives into OUT's own
folders), and the part folders go.
"""

import logging
import os
import signal
import sys
import threading
import time

from tqdm import tqdm

from gdsdata.format import layout as fmt
from gdsdata.errors import GdsDataError, SourceError
from gdsdata.format.lock import aside, remove_dataset, remove_quietly, writer_lock
from gdsdata.packing.detection import DetectionSource, open_detection
from gdsdata.packing.sources import Listing, FolderSource, RemoteFolderSource, display, open_source

log = logging.getLogger(__name__)
_IMAGES_PER_PART = 500  # below this a part's fixed costs (a task, a process, its shards) dominate
_PARTS_PER_CPU = 2  # a few parts per CPU, so that a retried part does not leave the others idle


def choose_parts(items: int, cpus: int) -> int:
    """Parts for ``items`` images on a cluster of ``cpus`` CPUs: enough for every CPU and a retry to
    overlap with others, no part much under ``_IMAGES_PER_PART`` images."""
    return max(1, min(_PARTS_PER_CPU * max(1, cpus), items // _IMAGES_PER_PART))


def _import_ray():
    try:
        import ray
    except ImportError:
        raise GdsDataError("--ray needs Ray: pip install 'gdsdata[ray]'") from None
    return ray


def pack_on_ray(src, out, *, address=None, num_parts=0, options=None, shard_size=1 << 30,
                alignment=fmt.DEFAULT_ALIGNMENT, strict=False, overwrite=False, progress=False,
                allow_empty_classes=False, max_retries=3, format="folder", split="train", annotations=None,
                shard_roots=None) -> dict:
    """Pack ``src`` into ``out`` with the parts as Ray tasks (``address``: a running cluster, None:
    start or join a local Ray). Returns the merge's summary plus ``parts`` and ``seconds``.
    ``shard_roots``: as ``pack``'s (folders every node sees at the same paths); each part writes its
    shards there and the merge moves them, on their drives, into ``out``'s own folders."""
    from gdsdata.packing.merge import merge_checked
    from gdsdata.packing.packer import check_output, dataset_owner, shard_roots_of, within

    ray = _import_ray()
    started = time.perf_counter()
    local = isinstance(src, str) and "://" not in src
    src = os.path.abspath(src) if local else src
    out = os.path.realpath(os.fspath(out))
    if local and os.path.isdir(src) and within(out, src):
        raise SourceError(f"{out}: inside the source folder {src}; pack into a folder outside it")
    with writer_lock(out, f"pack --ray of {display(src)}"):
        check_output(out, overwrite)
        if not ray.is_initialized():
            on_term = signal.getsignal(signal.SIGTERM)
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False,
                     configure_logging=False)
            if callable(on_term) and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_term)  # ray.init puts its own: the caller's (the CLI's) stays
        cpus = int(ray.cluster_resources().get("CPU", 1))
        if format == "folder":
            source = open_source(src, strict=strict, allow_empty=allow_empty_classes)
        else:
            source = open_detection(format, src, split=split, annotations=annotations, strict=strict)
        try:
            listed = isinstance(source, (FolderSource, RemoteFolderSource, DetectionSource))
            total = len(source.items)
            job_source = ray.put(Listing(source)) if listed else src
        finally:
            source.close()
        parts = num_parts or choose_parts(total, cpus)
        kwargs = dict(options=options, shard_size=shard_size, alignment=alignment, strict=strict,
                      allow_empty_classes=allow_empty_classes,
                      shard_roots=shard_roots_of(shard_roots, out, src if local else None))
        folder = aside(out, "parts")
        counter = _Counter.remote() if parts else None
        task = ray.remote(max_retries=max_retries, retry_exceptions=True, num_cpus=1)(_pack_part)
        pending = {task.remote(job_source, os.path.join(folder, f"part-{k}"), parts, k, kwargs, counter): k
                   for k in range(parts)}
        done_parts = {}
        try:
            bar = tqdm(total=total, unit="img", desc=f"pack on Ray ({parts} parts, {cpus} CPUs)",
                       disable=not progress, file=sys.stderr)
            with bar:
                while pending:
                    ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                    bar.update(ray.get(counter.count.remote()) - bar.n)
                    for ref in ready:
                        k = pending.pop(ref)
                        try:
                            done_parts[k] = ray.get(ref)
                        except Exception as e:  # noqa: BLE001 - Ray wraps what the task raised
                            raise GdsDataError(f"part {k} of {parts} failed after {max_retries} retries: "
                                               f"{_reason(e)}") from None
            summary = merge_checked([os.path.join(folder, f"part-{k}") for k in range(parts)], out,
                                    overwrite=overwrite, adopt=True)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
            for k in range(parts):  # with what they left on the shard roots (after a failure)
                part = os.path.join(folder, f"part-{k}")
                remove_dataset(part, dataset_owner(part))
            remove_quietly(folder)
    summary.update(parts=parts, cpus=cpus, seconds=time.perf_counter() - started,
                   skipped=sum(len(r["skipped"]) for r in done_parts.values()),
                   resumed_shards=sum(r["resumed_shards"] for r in done_parts.values()))
    return summary


def _reason(error) -> str:
    cause = getattr(error, "cause", None) or error
    return (str(cause).strip().splitlines() or [type(cause).__name__])[-1]


def _pack_part(job_source, part_out, parts, k, kwargs, counter):
    """One part, in a Ray worker: packed, or (after a failure or a killed worker) resumed."""
    from gdsdata.packing.packer import pack

    if os.path.exists(os.path.join(part_out, fmt.INDEX_NAME)):  # finished before the retry
        return {"skipped": [], "resumed_shards": 0}
    resume = os.path.isdir(part_out) and any(n.endswith(fmt.JOURNAL_SUFFIX) for n in os.listdir(part_out))
    done = {"n": 0}

    def tell(n):
        done["n"] += n
        if done["n"] >= 32:
            counter.add.remote(done["n"])
            done["n"] = 0

    result = pack(job_source, part_out, workers=1, num_parts=parts, part=k, resume=resume, on_progress=tell,
                  **kwargs)
    counter.add.remote(done["n"])
    return {"skipped": result.skipped, "resumed_shards": result.resumed_shards}


def _counter_class():
    ray = _import_ray()

    @ray.remote(num_cpus=0)
    class Counter:
        """Images done over the whole job, for the driver's progress bar."""

        def __init__(self):
            self.n = 0

        def add(self, n):
            self.n += n

        def count(self):
            return self.n

    return Counter


class _LazyCounter:
    def remote(self):
        return _counter_class().remote()


_Counter = _LazyCounter()
