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

import atexit
import contextlib
import json
import logging
import os
import signal
import threading
import time

from gdsdata import settings
from gdsdata.format import layout as fmt
from gdsdata.errors import GdsDataError, SourceError, SourceGoneError, Terminated, install_hint
from gdsdata.format.lock import aside, deferred_signals, remove_dataset, remove_quietly, writer_lock
from gdsdata.format.shards import open_regular
from gdsdata.packing.detection import DetectionSource, open_detection
from gdsdata.packing.packer import saved_report
from gdsdata.progress import bar as progress_bar
from gdsdata.stall import as_seconds, timeout_or_none
from gdsdata.packing.sources import (Listing, FolderSource, RemoteFolderSource, display, is_url, local_path,
                                     open_source)

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
        raise GdsDataError(f"--ray needs Ray: {install_hint('ray')}") from None
    return ray


def pack_on_ray(src, out, *, address=None, num_parts=0, options=None, shard_size=1 << 30,
                alignment=fmt.DEFAULT_ALIGNMENT, strict=False, overwrite=False, progress=False,
                allow_empty_classes=False, max_retries=3, format="folder", split=None, annotations=None,
                shard_roots=None, max_skipped=None) -> dict:
    """Pack ``src`` into ``out`` with the parts as Ray tasks (``address``: a running cluster, None:
    start or join a local Ray). Returns the merge's summary plus ``parts``, ``cpus``, ``seconds``,
    ``skipped`` (how many), ``report`` (what ``out/pack_report.json`` holds, as a pack without Ray
    writes it: every part's skipped, ignored, unreadable and special files) and ``report_path``.
    ``shard_roots``: as ``pack``'s (folders every node sees at the same paths); each part writes its
    shards there and the merge moves them, on their drives, into ``out``'s own folders. A Ray this
    call starts (or joins) is shut down when it returns or fails; one already running in the process
    is left as it is. ``max_skipped``: as ``pack``'s, of every part's files together, checked before
    the merge (nothing is written then)."""
    from gdsdata.args import given_path, output_path, skip_limit
    from gdsdata.packing.merge import JoinedReport, merge_checked
    from gdsdata.packing.packer import LEFT_OUT, check_output, dataset_owner, listed_in, shard_roots_of, within

    max_skipped = skip_limit(max_skipped)
    ray = _import_ray()
    started = time.perf_counter()
    src = local_path(given_path("src", src))
    annotations = local_path(given_path("annotations", annotations))
    local = not is_url(src)
    src = os.path.abspath(os.fspath(src)) if local else src  # (a pathlib.Path too, as pack takes it)
    out = os.path.realpath(os.fspath(output_path("out", out)))
    if local and os.path.isdir(src) and within(out, src):
        raise SourceError(f"{out}: inside the source folder {src}; pack into a folder outside it")
    with writer_lock(out, f"pack --ray of {display(src)}"):
        check_output(out, overwrite)
        owner = None if ray.is_initialized() else _RayOwner(ray, address)
        came = []  # the signals that stopped the job (Ray's own waits may turn SIGTERM's unwinding into Ctrl-C's)
        pending, parts, folder, interrupted = {}, 0, None, False
        try:
            if owner is not None:
                owner.start()
            with _noted(came):
                cpus = int(ray.cluster_resources().get("CPU", 1))  # (an autoscaling cluster may have none yet)
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
                parts = max(1, min(num_parts or choose_parts(total, cpus), total))
                if num_parts > parts:
                    log.warning("%s: %d part(s) asked for, %d image file(s) to pack: %d part(s), one file or more "
                                "each", display(src), num_parts, total, parts)
                kwargs = dict(options=options, shard_size=shard_size, alignment=alignment, strict=strict,
                              allow_empty_classes=allow_empty_classes,
                              shard_roots=shard_roots_of(shard_roots, out, src if local else None))
                folder = aside(out, "parts")
                counter = _Counter.remote()
                watch = _Watch(ray, counter, parts)
                # retried here, not by Ray: the watch then knows when a part starts again, and a part's own
                # error (a bad source, workers that make no progress) ends the pack at once
                task = ray.remote(max_retries=0, num_cpus=1)(_pack_part)

                def submit(k):
                    return task.remote(job_source, os.path.join(folder, f"part-{k}"), parts, k, kwargs, counter,
                                       k in watch.isolated, watch.bound)

                pending = {submit(k): k for k in range(parts)}
                reports, failures = {}, dict.fromkeys(range(parts), 0)
                bar = progress_bar(progress, total=total, unit="img", desc=f"pack on Ray ({parts} parts, {cpus} CPUs)")
                with bar:
                    while pending:
                        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                        bar.update(min(total, watch.poll()) - bar.n)
                        for ref in ready:
                            k = pending.pop(ref)
                            try:
                                reports[k] = ray.get(ref)
                                continue
                            except Exception as e:  # noqa: BLE001 - Ray wraps what the task raised
                                error = e
                            cause = getattr(error, "cause", None) or error
                            if isinstance(cause, SourceGoneError):  # (the parts go: no --resume to run)
                                raise GdsDataError(f"part {k} of {parts} stopped: {cause.what}; run the same "
                                                   f"command once the source answers again") from None
                            if isinstance(cause, GdsDataError):
                                raise GdsDataError(f"part {k} of {parts} failed: {_reason(error)}") from None
                            if failures[k] >= max_retries:
                                raise GdsDataError(f"part {k} of {parts} failed after {max_retries} retries: "
                                                   f"{_reason(error)}") from None
                            failures[k] += 1
                            log.warning("part %d of %d failed (%s); packing it again from the shards it finished "
                                        "(retry %d of %d)", k, parts, _reason(error), failures[k], max_retries)
                            watch.restart(k)
                            pending[submit(k)] = k
                        for ref, k in watch.stalled(pending):
                            pending.pop(ref)
                            pending[submit(k)] = k
                union = JoinedReport(src, out, [reports[k] for k in range(parts)], kwargs["shard_roots"], started,
                                     {"ray": {"parts": parts, "cpus": cpus}})
                summary = merge_checked([os.path.join(folder, f"part-{k}") for k in range(parts)], out,
                                        overwrite=overwrite, adopt=True, report=union, max_skipped=max_skipped,
                                        retry="run the pack --ray again with --overwrite",
                                        left_out=(f"pack --ray of {display(src)}", [  # (from what the parts returned)
                                            item for k in range(parts)
                                            for item in listed_in(reports[k], LEFT_OUT) or []]))
        except KeyboardInterrupt as e:
            interrupted = True
            if signal.SIGTERM in came and not isinstance(e, Terminated):
                raise Terminated() from None
            raise
        finally:
            with deferred_signals():  # Ray's processes end before the part folders go, whatever comes meanwhile
                try:
                    if owner is None or owner.address is not None:  # (a local Ray this pack started goes whole)
                        for ref in pending:
                            ray.cancel(ref, force=True)
                finally:
                    if owner is not None:
                        owner.stop(interrupted=interrupted)
                    if folder is not None:
                        for k in range(parts):  # with what they left on the shard roots (after a failure)
                            part = os.path.join(folder, f"part-{k}")
                            remove_dataset(part, dataset_owner(part))
                        remove_quietly(folder)
    report = union.made
    summary.update(parts=parts, cpus=cpus, seconds=time.perf_counter() - started, skipped=len(report["skipped"]),
                   resumed_shards=report["resumed_shards"], report=report,
                   report_path=os.path.join(out, fmt.REPORT_NAME))
    return summary


class _RayOwner:
    """A local Ray (or a connection to a cluster) that this pack starts and shuts down. ``ray.init``
    runs in a thread of its own, which lives until ``stop``: in the main thread Ray puts its own
    SIGTERM handler (``sys.exit``) in place of the caller's for the start, and a signal there stops
    the start midway, leaving the processes it has started behind; here Ctrl-C and SIGTERM reach the
    caller's handlers, and the main thread waits for the start to end, shuts Ray down and unwinds.
    (Ray's processes end with the thread that started them: it waits for ``stop``.)"""

    def __init__(self, ray, address):
        self.ray, self.address, self.error = ray, address, None
        self.up, self.done = threading.Event(), threading.Event()
        self.abandoned = False  # a start whose processes were killed under it: left to itself (``_wind_up``)
        self.seen = set()  # the child processes seen while a local Ray starts (those it started)
        self._before = set()  # this process's children before it (not Ray's)

    def start(self):
        quiet = _NoThreadNotice()
        logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            self._before = _children() if self.address is None else set()  # (not Ray's)
            threading.Thread(target=self._run, name="gdsdata-ray-init", daemon=True).start()
            bound = max(120.0, 2 * settings.get("stall_timeout"))  # (Ray starts in seconds; a cold cluster in a minute)
            deadline = time.monotonic() + bound
            try:
                while not self.up.wait(0.1):
                    if self.address is None:
                        self.seen |= self._ray_processes()  # as they start (``_wind_up``)
                    if time.monotonic() > deadline:
                        raise GdsDataError(f"Ray did not start{f' at {self.address}' if self.address else ''} within "
                                           f"{bound:g} s (twice the stall_timeout setting, 2 minutes at least)")
            except BaseException:  # Ctrl-C, SIGTERM or the bound while Ray starts: a local Ray goes (in ``stop``)
                if self.address is None:  # once started (joining a cluster starts no process here: nothing to wait for)
                    with deferred_signals():
                        self._wind_up(bound)
                raise
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
        if self.address is None:
            self.seen |= self._ray_processes()  # (``stop``)
        address = self.address or os.environ.get("RAY_ADDRESS")
        if isinstance(self.error, ConnectionError) and address:
            said = str(self.error).split(". ")[0].rstrip(".")  # (Ray's next sentence names an --address flag)
            where = f"--ray {address}" if self.address else f"RAY_ADDRESS={address}"
            nothing = "Could not find any running Ray instance" in said  # (else one may run there but refuse
            # this driver: another Ray version, its authentication; Ray's log says which)
            why = "no Ray cluster to join there" if nothing else "cannot join the Ray cluster there"
            raise ConnectionError(f"{where}: {why} ({said}); start one (ray start --head) if none runs there and "
                                  f"give its address (ray://HEAD:10001), or give --ray no address to start a local "
                                  f"Ray") from self.error
        if self.error is not None:
            raise self.error

    def _wind_up(self, bound):
        """Wait for a local start that a signal stopped midway to end (then ``stop`` shuts it down),
        unless a process it made is gone meanwhile: a signal to the whole process group (``timeout``,
        Slurm) ends them too, and the start would then wait a minute for its GCS before Ray ends this
        process (exit status 1, no word of gdsdata's). The rest of its processes are then ended here
        and the start is left to itself (``abandoned``: nothing waits on it)."""
        deadline = time.monotonic() + bound
        while not self.up.wait(0.1) and time.monotonic() < deadline:
            alive = self._ray_processes()
            if self.seen - alive:
                _kill(alive)
                self.abandoned = True
                return
            self.seen |= alive

    def _ray_processes(self) -> set:
        """The child processes of this one that Ray started (those before it left out)."""
        return _children() - self._before

    def _run(self):
        try:
            # no address: a local Ray of its own (Ray's None would join a `ray start` cluster of this
            # machine, of its CPUs only), unless RAY_ADDRESS names one, as Ray's own commands take it
            where = self.address or (None if os.environ.get("RAY_ADDRESS") else "local")
            with _no_failure_signal_handler(self.ray):
                self.ray.init(address=where, ignore_reinit_error=True, log_to_driver=False,
                              include_dashboard=False, configure_logging=False)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            self.error = e
        finally:
            self.up.set()
        self.done.wait()

    def stop(self, bound: float = 120.0, interrupted: bool = False):
        """Shut down the Ray this pack started (a cluster it joined only loses this driver), what a
        failed start left included; waiting for that at most ``bound`` seconds (else said, and left).
        ``interrupted`` (Ctrl-C, SIGTERM): where a process Ray started is gone, the signal went to the
        whole process group; the rest are ended here, as a shutdown would wait on what is gone."""
        ended = threading.Thread(target=self.ray.shutdown, name="gdsdata-ray-shutdown", daemon=True)
        try:
            if self.abandoned or interrupted and self.seen - self._ray_processes():  # (a SIGTERM to the whole group)
                # its shutdown would wait for the start, or for the processes that are gone: the rest go here
                _kill(self._ray_processes() & self.seen)
                atexit.unregister(getattr(getattr(self.ray, "_private", None), "worker", self.ray).shutdown)
                return
            ended.start()
            ended.join(bound)
            if ended.is_alive():
                log.error("Ray did not shut down within %g s: its processes may outlive this pack", bound)
                # Ray's own shutdown at exit would wait for the lock the stuck one holds: the exit would hang
                atexit.unregister(getattr(getattr(self.ray, "_private", None), "worker", self.ray).shutdown)
        finally:
            self.done.set()


def _children() -> set:
    """This process's child processes still running (not zombies), from /proc (empty without it)."""
    found, me = set(), str(os.getpid())
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            found.add(int(pid))
    return found


def _kill(pids):
    for pid in pids:
        with contextlib.suppress(OSError):  # (gone meanwhile)
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _no_failure_signal_handler(ray):
    """Ray's driver (its C++ core worker, made by ``ray.init``) puts Abseil's failure signal handler
    on SIGTERM, in place of the caller's: a SIGTERM then aborted the pack (exit 134, Ray's processes
    left behind) instead of unwinding it. Not for the core worker this pack makes (what Ray reads
    as it makes one: RAY_DISABLE_FAILURE_SIGNAL_HANDLER), and as it was for any later."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    name = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
    with (settings.swapped(constants, name, True) if hasattr(constants, name) else contextlib.nullcontext()):
        yield


class _NoThreadNotice(logging.Filter):
    """Ray's note that it put no SIGTERM handler, which is the point of starting it in a thread."""

    def filter(self, record):
        return "SIGTERM handler is not set" not in record.getMessage()


@contextlib.contextmanager
def _noted(came: list):
    """Note in ``came`` a SIGTERM that reaches the caller's handler (which then runs as it would)."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum, frame):
        came.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is note:  # (the caller's handler may have put another)
            signal.signal(signal.SIGTERM, previous)


class _Watch:
    """The bound on a part's progress (the ``stall_timeout`` setting, as for a pack without Ray):
    each part tells the job's counter as it starts its images and then at least every second while
    it packs them. A part that makes no progress for the bound (stuck on an image: a decoder that
    loops, a read that never returns) is ended (its worker killed) and packed again from the shards
    it finished, now with each image prepared in a worker process under the bound (``pack``'s
    workers), so that the image that stalls is skipped with the reason and the rest packed. A part
    stuck again that way, beyond what those waits take, ends the pack in one line. Parts Ray has not
    started yet (no free CPU) and a part still listing its source are not timed; but if no part at
    all has started (its task begun) within ``_UNSTARTED`` bounds (10 minutes at the default), the
    cluster cannot run them, and the pack ends in one line."""

    _ISOLATED = 20  # bounds a part packing with workers may go without an image (a chunk's wait, then each alone)
    _UNSTARTED = 10

    def __init__(self, ray, counter, parts):
        self.ray, self.counter, self.parts = ray, counter, parts
        self.bound = settings.get("stall_timeout")
        self.answer = max(self.bound, 30)  # how long Ray may take to answer the driver
        self.quiet, self.isolated = {}, set()
        self.began = time.monotonic()

    def poll(self) -> int:
        """Images done over the job; notes how long each packing part has gone without one."""
        try:
            done, self.quiet, begun = self.ray.get(self.counter.status.remote(), timeout=timeout_or_none(self.answer))
        except self.ray.exceptions.GetTimeoutError:
            raise GdsDataError(f"Ray did not answer within {self.answer:g} s (the job's progress counter, an actor "
                               f"on the cluster): the cluster is overloaded or a node is gone") from None
        waited = time.monotonic() - self.began  # (``begun`` stays once a part has begun, listing its source say)
        if not begun and waited > self.bound * self._UNSTARTED:
            raise GdsDataError(f"no part of {self.parts} started within {waited:.0f} s: the Ray cluster runs none "
                               f"of them (each needs one CPU: are they all taken?); the stall_timeout setting, "
                               f"GDSDATA_STALL_TIMEOUT, is {self.bound:g} s, this wait {self._UNSTARTED} times that")
        return done

    def stalled(self, pending: dict) -> list:
        """The refs of ``pending`` (ref: part) whose part made no progress for the bound: each
        ended, its worker gone, before it is handed back to be packed again (``GdsDataError`` for
        a part that stalls packing with workers)."""
        ended = []
        for ref, k in list(pending.items()):
            quiet = self.quiet.get(k)
            limit = self.bound * (self._ISOLATED if k in self.isolated else 1)
            if quiet is None or quiet <= limit:
                continue
            if k in self.isolated:
                raise GdsDataError(f"part {k} of {self.parts} made no progress for {as_seconds(quiet)} s packing each "
                                   f"image in a worker process: the node rather than the images? (the stall_timeout "
                                   f"setting, GDSDATA_STALL_TIMEOUT, is {self.bound:g} s an image)")
            log.warning("part %d of %d made no progress for %g s (the stall_timeout setting); packing it again from "
                        "the shards it finished, each image in a worker process under the bound", k, self.parts,
                        self.bound)
            self.ray.cancel(ref, force=True)
            gone, _ = self.ray.wait([ref], timeout=timeout_or_none(self.answer))  # (its writer lock goes with it)
            if not gone:
                raise GdsDataError(f"part {k} of {self.parts} made no progress for {as_seconds(quiet)} s, and its "
                                   f"worker could not be ended (stuck in the kernel: a read of a storage that does not "
                                   f"answer?)")
            self.restart(k)
            self.isolated.add(k)
            ended.append((ref, k))
        return ended

    def restart(self, k):
        """Part ``k`` is packed again: not timed until it starts its images."""
        self.counter.forget.remote(k)
        self.quiet.pop(k, None)


def _reason(error) -> str:
    cause = getattr(error, "cause", None) or error
    return (str(cause).strip().splitlines() or [type(cause).__name__])[-1]


def _pack_part(job_source, part_out, parts, k, kwargs, counter, isolated=False, bound=None):
    """One part, in a Ray worker: packed, or (after a failure, a killed worker or a stall) resumed
    from what the earlier try left; ``isolated``: each image prepared in a worker process under the
    stall bound ``bound`` (the driver's setting) after a stall. Tells ``counter`` of its progress at
    least every second. Returns its ``pack_report.json``."""
    from gdsdata.packing.packer import pack

    if os.path.exists(os.path.join(part_out, fmt.INDEX_NAME)):  # finished before the retry
        return _part_report(part_out)
    counter.begin.remote(k)  # (begun: listing its source, if it lists one, before its images)
    resume = os.path.isdir(part_out)  # (with no finished shard there: from the start, the leftovers removed)
    done = {"n": 0, "told": 0.0}

    def tell(n):
        done["n"] += n
        now = time.monotonic()
        if n == 0 or done["n"] >= 32 or now - done["told"] >= 1:
            counter.add.remote(k, done["n"])
            done["n"], done["told"] = 0, now

    with settings.set(**({} if bound is None else {"stall_timeout": bound})):
        pack(job_source, part_out, workers=2 if isolated else 1, num_parts=parts, part=k, resume=resume,
             on_progress=tell, **kwargs)
    counter.add.remote(k, done["n"])
    return _part_report(part_out)


def _part_report(part_out) -> dict:
    """The report a part's pack wrote beside its index; for one killed between the two, the files
    its last journal lists as skipped (the rest is in the index)."""
    report = saved_report(part_out)
    if report is not None:
        return report
    journals = sorted(n for n in os.listdir(part_out) if n.endswith(fmt.JOURNAL_SUFFIX))
    try:
        with open(open_regular(os.path.join(part_out, journals[-1]), what="a journal"), encoding="utf-8") as f:
            return {"skipped": json.load(f)["skipped"]}
    except (OSError, ValueError, KeyError, IndexError, GdsDataError):
        log.warning("%s: no report of its skipped files (its pack ended between its index and its report)",
                    part_out)
        return {}


def _counter_class():
    ray = _import_ray()

    @ray.remote(num_cpus=0)
    class Counter:
        """Images done over the whole job, for the driver's progress bar, and when each part last
        made progress (on this actor's clock), for the stall bound."""

        def __init__(self):
            self.n, self.last, self.begun = 0, {}, False

        def begin(self, part):
            self.begun = True

        def add(self, part, n):
            self.n += n
            self.last[part] = time.monotonic()

        def forget(self, part):
            self.last.pop(part, None)

        def status(self):
            now = time.monotonic()
            return self.n, {part: now - t for part, t in self.last.items()}, self.begun

    return Counter


class _LazyCounter:
    def remote(self):
        return _counter_class().remote()


_Counter = _LazyCounter()
