"""What each pipeline thread is doing, so that a stage that stops making progress becomes an error.

A Loader's threads say which batch they work on (``Activity``); the calls that can block in native
code (nvJPEG, CUDA event waits, kvikio reads, ``preadv``) say so with ``native("name")``. The
consumer, once it has waited the ``stall_timeout`` setting for a batch, asks ``stalled`` whether a
thread has been on one batch as long, and raises ``StallError`` naming the stage, the batch and the
call it is stuck in.

Bounds are counted in the time this process runs: a wait polls (``Waited``, ``slices``), and a gap
between two polls a second longer than their interval is a stop of the whole process (Ctrl-Z, a
suspended Slurm job, a paused container or VM), after which every stage carries on, not a stall.
"""

import contextlib
import threading
import time

from gdsdata.errors import StallError

_calls = {}  # thread ident -> (native call, monotonic start)
_kept = threading.local()  # .seconds: the bound of the dataset this thread works for (``bounded``)
_PAUSE_SLACK = 1.0  # seconds a gap between two polls of a wait outlasts their interval by: a stopped process


def bound(kept: float = None) -> float:
    """The stall bound of a wait: the stall_timeout setting in force, or ``kept`` (default: the bound
    of the dataset this thread works for, ``bounded``; a dataset keeps the settings it was built
    with) where that is lower."""
    from gdsdata import settings

    now = settings.get("stall_timeout")
    kept = getattr(_kept, "seconds", None) if kept is None else kept
    return now if kept is None else min(kept, now)


@contextlib.contextmanager
def bounded(seconds: float):
    """Waits on this thread within the block take at most ``seconds`` (``bound``)."""
    outer = getattr(_kept, "seconds", None)
    _kept.seconds = seconds
    try:
        yield
    finally:
        _kept.seconds = outer


def timeout_or_none(seconds: float):
    """``seconds`` as a wait's timeout, or None (no end) where the setting is beyond what a wait can
    take (``inf``: the bound switched off)."""
    return None if seconds >= threading.TIMEOUT_MAX else seconds


class Waited:
    """The seconds a wait that polls every ``every`` seconds (at most) has waited while this process
    ran: ``poll()`` after each poll returns them; a gap since the last poll longer than ``every`` +
    ``_PAUSE_SLACK`` counts as none (a thread kept from the interpreter that long only delays an
    error)."""

    def __init__(self, every: float):
        self._last, self._longest = time.monotonic(), every + _PAUSE_SLACK
        self.seconds = 0.0

    def poll(self) -> float:
        now = time.monotonic()
        gap, last, self._last = now - self._last, self._last, now
        if gap <= self._longest:
            self.seconds += gap
        else:
            _stopped(last, now)
        return self.seconds


_stops = []  # (from, to) on the monotonic clock: the stops of the process waits have seen, the latest 16
_stops_lock = threading.Lock()


def _stopped(start: float, end: float):
    """Note that the process was stopped (no poll ran) from ``start`` to ``end``; stops seen by
    several waits at once are one."""
    with _stops_lock:
        for k, (a, b) in enumerate(_stops):
            if start <= b and a <= end:
                _stops[k] = (min(a, start), max(b, end))
                return
        _stops.append((start, end))
        del _stops[:-16]


def stopped_within(since: float, now: float) -> float:
    """The seconds between ``since`` and ``now`` the process was stopped, as far as its waits saw."""
    with _stops_lock:
        return sum(max(0.0, min(b, now) - max(a, since)) for a, b in _stops)


def slices(seconds: float, step: float = 1.0):
    """The timeouts of the successive slices of a wait bounded by ``seconds`` of this process's
    running time (``Waited``): the caller waits each out and stops at the first that ends its
    wait; the generator ends when the bound is spent. One slice without end (None) where ``seconds``
    is beyond what a wait takes (inf: the bound switched off)."""
    if timeout_or_none(seconds) is None:
        yield None
        return
    waited = Waited(step)
    while (left := seconds - waited.poll()) > 0:
        yield min(step, left)


@contextlib.contextmanager
def native(call: str):
    """Mark the calling thread as inside the native call ``call`` for the duration of the block."""
    ident = threading.get_ident()
    outer = _calls.get(ident)
    _calls[ident] = (call, time.monotonic())
    try:
        yield
    finally:
        if outer is None:
            _calls.pop(ident, None)
        else:
            _calls[ident] = outer


def wait(work, call: str, timeout: float = None):
    """Wait until the CUDA ``work`` (an event or a stream) is done, at most ``timeout`` seconds
    (default: the stall_timeout setting, ``bound``), polling so that the wait stays bounded; raises
    ``StallError`` naming ``call``."""
    if work.query():
        return
    timeout = bound() if timeout is None else timeout
    with native(call):
        waited = Waited(1e-3)
        pause = 20e-6
        while not work.query():
            if waited.poll() > timeout:
                raise StallError(f"gdsdata: {call} did not finish within {timeout:g} s (the stall_timeout "
                                 f"setting, GDSDATA_STALL_TIMEOUT): the GPU work it waits for is stuck")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


@contextlib.contextmanager
def held(lock, what: str, timeout: float = None):
    """Hold ``lock`` for the block, waiting at most ``timeout`` seconds (default: the stall_timeout
    setting, ``bound``) for it; raises ``StallError`` saying ``what`` holds it."""
    timeout = bound() if timeout is None else timeout
    with native(f"waiting for {what}"):
        taken = any(lock.acquire(timeout=-1 if wait is None else wait) for wait in slices(timeout))
    if not taken:
        raise StallError(f"gdsdata: {what} has been busy for {timeout:g} s (the stall_timeout setting, "
                         f"GDSDATA_STALL_TIMEOUT): the call holding it is stuck")
    try:
        yield
    finally:
        lock.release()


def native_call(thread: threading.Thread):
    """(call, seconds inside it) for the native call ``thread`` is in, or None."""
    entry = _calls.get(thread.ident)
    return None if entry is None else (entry[0], time.monotonic() - entry[1])


class Activity:
    """One pipeline thread's current work item: the stage, the batch, since when (None: waiting on
    a queue, which is not a stall of this stage)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.thread = None
        self.batch = None  # (epoch, batch number within the epoch)
        self.since = None

    def start(self, epoch, number):
        self.thread = self.thread or threading.current_thread()
        self.batch, self.since = (epoch, number), time.monotonic()

    def stop(self):
        self.since = None

    def stuck_for(self, now: float) -> float:
        """Seconds on its batch while the process ran (a stop a wait saw is not counted)."""
        return 0.0 if self.since is None else max(0.0, now - self.since - stopped_within(self.since, now))


def stalled(activities, timeout: float) -> StallError:
    """A ``StallError`` for the activity stuck longest beyond ``timeout`` seconds, or None."""
    now = time.monotonic()
    stuck = max(activities, key=lambda a: a.stuck_for(now), default=None)
    if stuck is None or stuck.stuck_for(now) <= timeout:
        return None
    epoch, number = stuck.batch
    call = native_call(stuck.thread) if stuck.thread is not None else None
    where = f"stuck in {call[0]} for {as_seconds(call[1])} s" if call else "not inside a native call gdsdata knows"
    return StallError(f"gdsdata Loader: the {stage_name(stuck.stage)} made no progress for "
                      f"{as_seconds(stuck.stuck_for(now))} s on batch {number} of epoch {epoch} ({where}); "
                      f"the bound is the stall_timeout setting (GDSDATA_STALL_TIMEOUT={timeout:g} s)")


def as_seconds(value: float) -> str:
    """A time waited, as the messages give it: whole seconds from 10 s, tenths below (a bound under a
    second would otherwise read as "0 s")."""
    return f"{value:.0f}" if round(value, 1) >= 10 else f"{value:.1f}"


def stage_name(stage: str) -> str:
    return {"read": "I/O thread (storage -> staging)", "decode": "decode thread",
            "transform": "transform thread"}.get(stage, f"{stage} thread")
