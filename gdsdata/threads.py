"""Daemon worker threads: a pool whose workers never keep the interpreter from exiting.

``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter shuts down, so a
worker stuck in a system call (a read from a dead drive) would hang the exit of a script that has
already been told about the stall. The Loader's read-ahead and the streaming reads use this pool
instead.
"""

import queue
import threading
from concurrent.futures import Future


class DaemonPool:
    """``count`` daemon threads named ``name_k`` running submitted calls in order of submission."""

    def __init__(self, count: int, name: str):
        self._jobs = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{k}", daemon=True)
                         for k in range(max(1, count))]
        for thread in self._threads:
            thread.start()

    def _work(self):
        while (job := self._jobs.get()) is not None:
            future, call, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call(*args)
            except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(e)
            else:
                future.set_result(result)

    def submit(self, call, *args) -> Future:
        future = Future()
        self._jobs.put((future, call, args))
        return future

    def shutdown(self, wait_s: float = 0.0) -> bool:
        """Let the workers end once the calls already submitted are done, waiting for that at most
        ``wait_s`` seconds; True if they all ended."""
        import time

        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads if t is not threading.current_thread())
