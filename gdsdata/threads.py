"""Daemon worker threads: a pool whose workers never keep the interpreter from exiting.

``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter shuts down, so a
worker stuck in a system call (a read from a dead drive) would hang the exit of a script that has
already been told about the stall. The Loader's read-ahead, the streaming reads and the CPU pool
(CPU decoding and resampling) use this pool instead.
"""

import queue
import threading
import time
from concurrent.futures import Future


class DaemonPool:
    """Up to ``count`` daemon threads named ``name_k`` running submitted calls in order of
    submission; a thread is started when a call finds every started one busy."""

    def __init__(self, count: int, name: str):
        self._jobs = queue.SimpleQueue()
        self._count, self._name = max(1, count), name
        self._threads, self._idle, self._shut = [], 0, False
        self._lock = threading.Lock()
        self._outstanding = 0  # calls submitted and not yet ended
        self._settled = threading.Condition(self._lock)

    def _work(self):
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if job is None:
                return
            future, call, args = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = call(*args)
                    except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            finally:
                # what the call held (a dataset and its open shards, say) is not kept alive while
                # this thread waits for the next one
                del job, future, call, args
                result = None
                with self._lock:
                    self._outstanding -= 1
                    if not self._outstanding:
                        self._settled.notify_all()

    def submit(self, call, *args) -> Future:
        """Queue ``call(*args)``; a ``RuntimeError`` (the pool shut down, or no thread to run it could
        be started) queues nothing."""
        future = Future()
        with self._lock:  # (queued under the lock: a shutdown between the check and the queuing would strand it)
            if self._shut:  # (its workers are ending: the call would never run; in concurrent.futures' words)
                raise RuntimeError(f"cannot schedule new futures after shutdown ({self._name})")
            if self._idle <= self._jobs.qsize() and len(self._threads) < self._count:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # ("can't start new thread": the ones started run it, if any)
                    if not self._threads:
                        raise
                else:
                    self._threads.append(thread)
            self._jobs.put((future, call, args))
            self._outstanding += 1
        return future

    def drain(self, wait_s: float) -> bool:
        """Wait at most ``wait_s`` seconds for every call submitted so far to end; True if they did."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._outstanding, timeout=wait_s)

    def shutdown(self, wait_s: float = 0.0) -> bool:
        """Let the workers end once the calls already submitted are done, waiting for that at most
        ``wait_s`` seconds; True if they all ended."""
        with self._lock:
            threads, self._shut = list(self._threads), True
        for _ in threads:
            self._jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads if t is not threading.current_thread())
