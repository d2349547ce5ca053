"""Nothing hangs: a Loader stage stuck inside a call becomes a StallError in the training loop,
naming the stage, the batch and the call, within the stall_timeout bound."""

import os
import re
import threading
import time

import pytest

import gdsdata
from gdsdata import stall
from conftest import child_env, loader_threads, slow_decode


def _stuck_decode(ds, at_batch, release):
    """Make the dataset's decode of its ``at_batch``-th batch block inside a named native call."""
    original = ds._backend.decode
    calls = {"n": 0}

    def decode(staged, stream=None):
        calls["n"] += 1
        if calls["n"] == at_batch + 1:
            with stall.native("fakeDecodeThatNeverReturns"):
                release.wait(60)
        return original(staged, stream)

    ds._backend.decode = decode


def test_a_stuck_decode_raises_naming_stage_batch_and_call(photos_dataset):
    _, _, out = photos_dataset
    release = threading.Event()
    ds = gdsdata.GDSDataset(out)
    _stuck_decode(ds, at_batch=2, release=release)
    loader = gdsdata.Loader(ds, 8, shuffle=None, transform=gdsdata.CenterCrop(32, dtype="float32"))
    got = 0
    try:
        with gdsdata.settings.set(stall_timeout=1.5):
            t0 = time.monotonic()
            with pytest.raises(gdsdata.StallError) as caught:
                for _ in loader:
                    got += 1
            waited = time.monotonic() - t0
        message = str(caught.value)
        assert got == 2
        assert "decode thread" in message and "batch 2 of epoch 0" in message
        assert "fakeDecodeThatNeverReturns" in message and "GDSDATA_STALL_TIMEOUT" in message
        assert re.search(r"made no progress for [1-9]\.[0-9] s on batch", message), message  # tenths, under 10 s
        assert isinstance(caught.value, gdsdata.GdsDataError)
        assert waited < 1.5 + 5  # the bound, plus the poll and the bounded close
    finally:
        release.set()
        ds.close()
    deadline = time.monotonic() + 10
    while loader_threads() and time.monotonic() < deadline:  # the stuck thread ends once released
        time.sleep(0.05)
    assert not loader_threads()


def test_a_slow_but_moving_pipeline_is_not_a_stall(photos_dataset):
    """Each batch takes longer than nothing, but none takes longer than the bound."""
    _, _, out = photos_dataset
    ds = gdsdata.GDSDataset(out)
    slow_decode(ds, 0.3)
    with gdsdata.settings.set(stall_timeout=1.0):
        batches = list(gdsdata.Loader(ds, 16, shuffle=None))
    assert len(batches) == 4
    ds.close()


def test_a_stopped_process_is_not_a_stall(photos_dataset, tmp_path):
    """A process stopped for longer than the bound mid-batch (Ctrl-Z then fg, a suspended Slurm job, a
    paused container) carries on when it resumes: the stopped time is not a stage's lack of progress.
    Here the decode of batch 2 stops its own process for 6 s against a bound of 3 s, and then goes
    on for a second outside the interpreter (2 s to spare for a busy machine)."""
    import subprocess
    import sys

    script = tmp_path / "stopped.py"
    script.write_text(f"""
import os, signal, subprocess, time
import gdsdata
ds = gdsdata.GDSDataset({photos_dataset[2]!r})
original, calls = ds._backend.decode, []
def decode(staged, stream=None):
    calls.append(1)
    if len(calls) == 3:
        subprocess.Popen(["sh", "-c", "sleep 6; kill -CONT %d" % os.getpid()])
        last = start = time.monotonic()  # (before the kill: the stop may come inside it, or just after)
        os.kill(os.getpid(), signal.SIGSTOP)
        while time.monotonic() - last < 3 and last - start < 15:  # until the stop has come and gone
            last = time.monotonic()
            time.sleep(0.01)
        time.sleep(1)
    return original(staged, stream)
ds._backend.decode = decode
with gdsdata.settings.set(stall_timeout=3):
    print(sum(len(labels) for _, labels in gdsdata.Loader(ds, 8, shuffle=None)), len(calls) >= 3)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0 and done.stdout.split() == ["60", "True"], done.stderr[-2000:]


def test_a_stop_mid_batch_is_not_a_stage_s_time_on_it(photos_dataset, tmp_path):
    """The loop waits out the bound for a batch whose read and decode each take less (1.5 and 1.8 s of
    running time against 2), while the process is stopped for 4 s in the decode: no stage made no
    progress for the bound, so no StallError (the stage's time had counted the stop)."""
    import subprocess
    import sys

    script = tmp_path / "stopped_mid_batch.py"
    script.write_text(f"""
import os, signal, subprocess, time
import gdsdata
ds = gdsdata.GDSDataset({photos_dataset[2]!r})

def slow(seconds):  # seconds of running time (a stop does not count)
    done, last = 0.0, time.monotonic()
    while done < seconds:
        time.sleep(0.01)
        now = time.monotonic()
        done += now - last if now - last < 0.5 else 0
        last = now

original, calls = ds._backend.decode, []
def decode(staged, stream=None):
    calls.append(1)
    if len(calls) == 1:
        slow(0.2)
        subprocess.Popen(["sh", "-c", "sleep 4; kill -CONT %d" % os.getpid()])
        os.kill(os.getpid(), signal.SIGSTOP)
        slow(1.6)
    return original(staged, stream)
ds._backend.decode = decode
read = ds.read_staged
def read_staged(*args, **kwargs):
    slow(1.5)
    return read(*args, **kwargs)
ds.read_staged = read_staged
with gdsdata.settings.set(stall_timeout=2):
    print(sum(len(labels) for _, labels in gdsdata.Loader(ds, 30, shuffle=None)))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0 and done.stdout.split() == ["60"], done.stderr[-2000:]


def test_waits_count_the_time_the_process_ran(monkeypatch):
    """``Waited`` and ``slices`` count a gap between polls beyond their interval (and a second) as none."""
    clock = [100.0]
    monkeypatch.setattr(stall.time, "monotonic", lambda: clock[0])
    waited = stall.Waited(0.1)
    for gap in (0.1, 0.1, 1.05, 30.0, 0.1):
        clock[0] += gap
        waited.poll()
    assert waited.seconds == pytest.approx(1.35)
    timeouts, gaps = [], iter([1.0, 40.0, 1.0, 0.5])
    for wait in stall.slices(2.5):
        timeouts.append(wait)
        clock[0] += next(gaps)
    assert timeouts == [1.0, 1.0, 1.0, 0.5]  # the 40 s gap: stopped, not waited
    assert list(stall.slices(float("inf"))) == [None]


def test_the_bound_a_dataset_was_built_with_holds_for_its_loaders(photos_dataset):
    """A dataset keeps the settings it was built with, the stall bound among them (the lower of its
    own and the one in force around the loop holds)."""
    with gdsdata.settings.set(stall_timeout=1):
        ds = gdsdata.GDSDataset(photos_dataset[2])
    slow_decode(ds, 3)
    try:
        with pytest.raises(gdsdata.StallError, match=r"decode thread made no progress .*=1 s\)"):
            list(gdsdata.Loader(ds, 16, shuffle=None))
    finally:
        ds.close()


def test_waits_inside_a_dataset_take_the_bound_it_was_built_with(photos_dataset):
    """A wait the dataset makes itself (nvJPEG's lock, a GPU event: here a lock another thread holds)
    is bounded by the dataset's own setting where that is lower, on a Loader's threads and in
    ``ds[i]``, as the Loader's watchdog is; the one in force bounds it where it is lower."""
    import threading

    from gdsdata import stall

    with gdsdata.settings.set(stall_timeout=1):
        ds = gdsdata.GDSDataset(photos_dataset[2])
    busy = threading.Lock()
    original = ds._backend.decode

    def waits_for_the_lock(staged, stream=None):
        with stall.held(busy, "the test's lock"):
            return original(staged, stream)

    ds._backend.decode = waits_for_the_lock
    busy.acquire()
    try:
        for read in (lambda: ds[0], lambda: list(gdsdata.Loader(ds, 16, shuffle=None))):
            started = time.monotonic()
            with pytest.raises(gdsdata.StallError, match="the test's lock has been busy for 1 s"):
                read()
            assert time.monotonic() - started < 30
        assert stall.bound() == gdsdata.settings.get("stall_timeout")  # (this thread: the setting in force)
        with gdsdata.settings.set(stall_timeout=0.5):
            with pytest.raises(gdsdata.StallError, match="busy for 0.5 s"):
                ds[0]
    finally:
        busy.release()
        ds.close()


def test_streaming_reads_ahead_take_the_dataset_s_bound_too(photos_dataset):
    """Streaming reads (``io_engine=direct``) run a batch's read on read-ahead threads of their own:
    a wait there takes the dataset's bound as the pass's own threads do."""
    import threading

    from gdsdata import stall

    with gdsdata.settings.set(stall_timeout=1, io_engine="direct"):
        ds = gdsdata.GDSDataset(photos_dataset[2])
    assert ds.load_path.reads == "direct"
    busy = threading.Lock()
    original = ds.read_staged

    def waits_for_the_lock(*args, **kwargs):
        with stall.held(busy, "the test's lock"):
            return original(*args, **kwargs)

    ds.read_staged = waits_for_the_lock
    busy.acquire()
    try:
        started = time.monotonic()
        # the read-ahead thread's own wait and the Loader's watchdog both take the dataset's 1 s: either says it
        with pytest.raises(gdsdata.StallError, match=r"the test's lock has been busy for 1 s|I/O thread .* made no "
                                                     r"progress for 1\.[0-9] s"):
            list(gdsdata.Loader(ds, 16, shuffle=None))
        assert time.monotonic() - started < 30
    finally:
        busy.release()
        ds.close()


def test_stall_timeout_setting_is_validated():
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="stall_timeout"):
            gdsdata.settings.set(stall_timeout=bad)


def test_a_script_that_never_closes_its_loader_exits_cleanly(photos_dataset, tmp_path):
    """The Loader reads on into the next epoch; at exit its threads are stopped before the
    interpreter finalises (a daemon thread inside a torch call then made torch abort: exit 134)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(f"""
import torch, gdsdata
ds = gdsdata.GDSDataset({photos_dataset[2]!r})
loader = gdsdata.Loader(ds, 8, shuffle=True, transform=gdsdata.RandomResizedCrop(32))
model = torch.nn.Conv2d(3, 4, 3)
for epoch in range(2):
    for images, labels in loader:
        model(images).sum().backward()
print("done")
""")
    env = child_env()
    for _ in range(6):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0 and "done" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_loop_in_a_thread_the_main_thread_left_runs_to_its_end(photos_dataset, tmp_path):
    """Python waits for a non-daemon thread after the main thread ends, but concurrent.futures takes no
    work from then on: a Loader (and ``__getitems__``, torch's DataLoader's batched fetch) in such a
    thread decodes on in place instead of failing with "cannot schedule new futures"."""
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(f"""
import threading, time, torch, gdsdata
ds = gdsdata.GDSDataset({photos_dataset[2]!r})
loader = gdsdata.Loader(ds, 8, shuffle=True, transform=gdsdata.RandomResizedCrop(32))
reference = [images.clone() for images, _ in loader]
loader.set_epoch(0)
def train():
    time.sleep(0.5)  # the main thread has ended
    same = all(torch.equal(a, b) for a, b in zip(reference, (images for images, _ in loader)))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=gdsdata.collate))
    print("done", same, len(batches), flush=True)
threading.Thread(target=train).start()
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0 and "done True" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_script_exits_after_a_stall_in_the_cpu_pool(photos_dataset, tmp_path):
    """A CPU decode that never returns (on the pool that CPU decoding and resampling share) is a
    StallError, and the script that caught it still exits: the pool's threads never keep the
    interpreter from exiting (concurrent.futures' did: its exit joined them for good)."""
    import subprocess
    import sys

    script = tmp_path / "stuck.py"
    script.write_text(f"""
import threading, gdsdata
import gdsdata.backends.cpu as backend
real, stuck = backend.decode, threading.Event()
def decode(*args, **kwargs):
    if stuck.is_set() and threading.current_thread().name.startswith("gdsdata-cpu"):
        threading.Event().wait()  # a libjpeg-turbo call that never returns
    return real(*args, **kwargs)
backend.decode = decode
ds = gdsdata.GDSDataset({photos_dataset[2]!r})
loader = gdsdata.Loader(ds, 16, shuffle=None, transform=gdsdata.CenterCrop(32, dtype="float32"))
stuck.set()
with gdsdata.settings.set(stall_timeout=1.5):
    try:
        for _ in loader:
            print("a batch", flush=True)
    except gdsdata.StallError as e:
        print("stalled:", e, flush=True)
    loader.close()
ds.close()
print("done", flush=True)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=child_env())
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "a batch" not in done.stdout and "stalled:" in done.stdout and "CPU decode" in done.stdout, done.stdout
    assert done.stdout.endswith("done\n"), done.stdout


def test_exit_does_not_wait_forever_for_a_decoder_a_stuck_decode_holds():
    """At exit the idle nvJPEG decoders are destroyed, each only if its lock comes within the bound:
    a decode stuck in nvJPEG (its thread left behind by close) holds that lock for good."""
    from gdsdata.decode import gpu

    class Stuck:
        key, users, pid, last = ("stuck", "hardware"), 0, os.getpid(), None
        lock = threading.Lock()

        class nvjpeg:
            closed = False

            @classmethod
            def close(cls):
                cls.closed = True

    Stuck.lock.acquire()  # the stuck decode
    gpu._SharedDecoder._open[Stuck.key] = Stuck
    try:
        t0 = time.monotonic()
        gpu._SharedDecoder.close_idle(timeout=0.5)
        assert time.monotonic() - t0 < 5 and not Stuck.nvjpeg.closed
        assert Stuck.key not in gpu._SharedDecoder._open
        Stuck.lock.release()
        gpu._SharedDecoder._open[Stuck.key] = Stuck  # free: destroyed
        gpu._SharedDecoder.close_idle(timeout=0.5)
        assert Stuck.nvjpeg.closed
    finally:
        gpu._SharedDecoder._open.pop(Stuck.key, None)


def _one_image_job():
    """A GPU decode job of one 1x1 RGB JPEG (what the stall tests hand ``GpuDecoder.decode``)."""
    import numpy as np

    from gdsdata.decode.gpu import DecodeJob

    one = np.ones(1, np.int64)
    return DecodeJob([0], one, one, one * 3, np.zeros(1, np.int64), data=np.zeros(1, np.uint64),
                     lengths=np.ones(1, np.uint64), pitches=one * 3)


def test_a_decode_waits_for_the_gpu_decoder_only_within_the_bound():
    """A decode left stuck inside nvJPEG (its Loader thread left behind after a StallError) holds
    the process's decoder for good: a later decode, ``ds[i]`` say, waits for it within the bound and
    then raises, rather than hang."""
    import types

    import torch

    from gdsdata.decode.gpu import GpuDecoder

    shared = types.SimpleNamespace(lock=threading.Lock())
    shared.lock.acquire()  # the stuck decode
    decoder = types.SimpleNamespace(shared=shared, device=torch.device("cpu"), backend="hardware")
    job = _one_image_job()
    with gdsdata.settings.set(stall_timeout=0.2):
        t0 = time.monotonic()
        with pytest.raises(gdsdata.StallError, match=r"the GPU's JPEG decoder \(another decode, inside nvJPEG\) has "
                                                     r"been busy for 0.2 s"):
            GpuDecoder.decode(decoder, torch.zeros(1, dtype=torch.uint8), job, None)
    assert time.monotonic() - t0 < 5


def test_the_hardware_decode_waits_on_the_host_for_reads_still_landing():
    """nvJPEG's hardware decode reads its bitstreams as the call is made, whatever its stream waits
    for: a batch whose reads are still in flight on the GPU (``Staged.ready``) is waited for on the
    host before the call, within the bound; ``gpu_hybrid`` works in the stream's order and only
    makes its stream wait. Either way the stream waits for it, which is what a staging slot handed
    back after a failed wait goes by."""
    import types

    import torch

    from gdsdata.decode.gpu import GpuDecoder

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    ready = types.SimpleNamespace(query=lambda: False)  # reads that never land
    job = _one_image_job()
    for backend, stuck in (("hardware", "waiting for a batch's reads to land before nvJPEG's hardware decode"),
                           ("gpu_hybrid", "the GPU's JPEG decoder")):
        shared = types.SimpleNamespace(lock=threading.Lock())
        shared.lock.acquire()  # so that gpu_hybrid, which does not wait on the host, stops at the decoder
        decoder = types.SimpleNamespace(shared=shared, device=torch.device("cpu"), backend=backend)
        stream = Stream()
        with gdsdata.settings.set(stall_timeout=0.2):
            with pytest.raises(gdsdata.StallError, match=re.escape(stuck)):
                GpuDecoder.decode(decoder, torch.zeros(1, dtype=torch.uint8), job, stream, ready)
        assert stream.waited == [ready], backend
