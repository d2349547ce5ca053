"""The native host Huffman loop (gdsdata/_hostdecode.c) against a stand-in nvJPEG: the order of the
phases, the image structs it fills for either CUDA version, and the statuses it reports. The real
library runs under it in tests/test_gpu.py."""

import ctypes

import numpy as np
import pytest

from gdsdata import nvjpeg_host
from gdsdata.errors import GpuUnavailableError

try:
    nvjpeg_host.native_loop()
except GpuUnavailableError as e:  # optional by design: gdsdata works without it (no decode assist)
    pytest.skip(str(e), allow_module_level=True)

V = ctypes.c_void_p
PARSE = ctypes.CFUNCTYPE(ctypes.c_int, V, V, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, V)
HOST = ctypes.CFUNCTYPE(ctypes.c_int, V, V, V, V, V)
TRANSFER = ctypes.CFUNCTYPE(ctypes.c_int, V, V, V, V, V)
DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, V, V, V, V, V)


class Image13(ctypes.Structure):
    _fields_ = [("channel", V * 4), ("pitch", ctypes.c_size_t * 4)]


class Image12(ctypes.Structure):
    _fields_ = [("channel", V * 4), ("pitch", ctypes.c_uint * 4)]


def run_loop(data, *, pitch32=False, parse_fails=(), host_fails=(), device_fails=()):
    """Run gds_host_decode over ``data`` (fake pointers) with a stand-in whose phases log their calls."""
    native = nvjpeg_host.native_loop()
    calls = []
    n = len(data)
    states = (V * n)(*[1000 + k for k in range(n)])
    jpegs = (V * n)(*[2000 + k for k in range(n)])

    def parse(handle, ptr, length, save_metadata, save_stream, jpeg):
        calls.append(("parse", ptr, length, jpeg))
        return 3 if ptr in parse_fails else 0  # BAD_JPEG

    def host(handle, decoder, state, params, jpeg):
        calls.append(("host", state, jpeg, params))
        return 4 if state - 1000 in host_fails else 0  # JPEG_NOT_SUPPORTED

    def transfer(handle, decoder, state, jpeg, stream):
        calls.append(("transfer", state, jpeg, stream))
        return 0

    def device(handle, decoder, state, destination, stream):
        image = ctypes.cast(destination, ctypes.POINTER(Image12 if pitch32 else Image13)).contents
        calls.append(("device", state, image.channel[0], image.pitch[0], image.channel[1], stream))
        return 6 if state - 1000 in device_fails else 0  # EXECUTION_FAILED

    callbacks = [PARSE(parse), HOST(host), TRANSFER(transfer), DEVICE(device)]
    fns = nvjpeg_host._NativeFns(*[ctypes.cast(f, V).value for f in callbacks])
    arrays = [np.asarray(values, np.uint64) for values in
              (data, [100 + k for k in range(n)], [5000 + 16 * k for k in range(n)], [30 + k for k in range(n)])]
    status = np.zeros(n, np.int32)
    failed = native.gds_host_decode(ctypes.byref(fns), 11, 12, 13, ctypes.addressof(states), ctypes.addressof(jpegs),
                                    *[a.ctypes.data for a in arrays], n, 77, int(pitch32), status.ctypes.data)
    return failed, status, calls


@pytest.mark.parametrize("pitch32", [False, True], ids=["cuda13", "cuda12"])
def test_every_host_phase_runs_before_the_queued_phases_and_fills_the_image(pitch32):
    failed, status, calls = run_loop([0x10, 0x20, 0x30], pitch32=pitch32)
    assert failed == 0 and status.tolist() == [0, 0, 0]
    assert [c[0] for c in calls] == ["parse", "host"] * 3 + ["transfer", "device"] * 3
    assert calls[0] == ("parse", 0x10, 100, 2000) and calls[5] == ("host", 1002, 2002, 13)
    assert calls[6] == ("transfer", 1000, 2000, 77)
    # image k: its slot's state, RGB interleaved into outs[k] with pitches[k], the other channels empty
    assert calls[7] == ("device", 1000, 5000, 30, None, 77)
    assert calls[11] == ("device", 1002, 5032, 32, None, 77)


def test_a_failed_image_is_reported_with_its_phase_and_the_others_decode():
    failed, status, calls = run_loop([0x10, 0x20, 0x30, 0x40], parse_fails={0x20}, host_fails={2}, device_fails={3})
    assert failed == 3
    assert status.tolist() == [0, 1003, 2004, 4006]  # 1000 x phase + nvJPEG's status
    queued = [(c[0], c[1]) for c in calls if c[0] in ("transfer", "device")]
    assert queued == [("transfer", 1000), ("device", 1000), ("transfer", 1003), ("device", 1003)]
    assert ("host", 1001, 2001, 13) not in calls  # a stream that did not parse goes no further


def test_the_native_pool_decodes_each_threads_part_on_its_own_objects():
    """gds_pool_*: three native threads, seven images in parts of 2, 2 and 3; every image goes through
    its part's thread objects (handle, states) once, the copies and kernels all on the waiting
    thread's stream after every host phase, and a failure keeps its position."""
    import threading

    native = nvjpeg_host.native_loop()
    seen, lock = [], threading.Lock()

    def parse(handle, ptr, length, save_metadata, save_stream, jpeg):
        with lock:
            seen.append(("parse", handle, ptr, jpeg))
        return 3 if ptr == 0x50 else 0

    def host(handle, decoder, state, params, jpeg):
        return 0

    def transfer(handle, decoder, state, jpeg, stream):
        return 0

    def device(handle, decoder, state, destination, stream):
        image = ctypes.cast(destination, ctypes.POINTER(Image13)).contents
        with lock:
            seen.append(("device", handle, state, stream, image.channel[0]))
        return 0

    callbacks = [PARSE(parse), HOST(host), TRANSFER(transfer), DEVICE(device)]
    fns = nvjpeg_host._NativeFns(*[ctypes.cast(f, V).value for f in callbacks])
    pool = native.gds_pool_create(3)
    assert pool
    try:
        slots = [(V * 4)(*[100 * t + k + 1 for k in range(4)]) for t in range(3)]
        jpegs = [(V * 4)(*[200 * t + k + 1000 for k in range(4)]) for t in range(3)]
        parts = (nvjpeg_host._NativePart * 3)()
        for t, (lo, hi) in enumerate([(0, 2), (2, 4), (4, 7)]):
            parts[t].handle, parts[t].decoder, parts[t].params = 10 + t, 20 + t, 30 + t
            parts[t].states, parts[t].jpeg_streams = ctypes.addressof(slots[t]), ctypes.addressof(jpegs[t])
            parts[t].lo, parts[t].hi = lo, hi
        arrays = [np.asarray(v, np.uint64) for v in ([0x10 * (k + 1) for k in range(7)], [9] * 7,
                                                     [5000 + k for k in range(7)], [3] * 7)]
        for _ in range(2):  # the threads wait for the next batch between batches
            seen.clear()
            status = np.zeros(7, np.int32)
            native.gds_pool_submit(pool, ctypes.byref(fns), ctypes.addressof(parts), *[a.ctypes.data for a in arrays],
                                   0, status.ctypes.data)
            elapsed = ctypes.c_int64()
            assert native.gds_pool_wait(pool, 40, 1, ctypes.byref(elapsed)) == 1  # queued on stream 40 here
            assert elapsed.value > 0
            assert status.tolist() == [0, 0, 0, 0, 1003, 0, 0]  # image 4 (0x50) failed to parse
            parsed = sorted((ptr, handle, jpeg) for kind, handle, ptr, jpeg in
                            [s for s in seen if s[0] == "parse"])
            assert parsed == [(0x10, 10, 1000), (0x20, 10, 1001), (0x30, 11, 1200), (0x40, 11, 1201),
                              (0x50, 12, 1400), (0x60, 12, 1401), (0x70, 12, 1402)]
            decoded = sorted((out, handle, state, stream) for kind, handle, state, stream, out in
                             [s for s in seen if s[0] == "device"])
            assert decoded == [(5000, 10, 1, 40), (5001, 10, 2, 40), (5002, 11, 101, 40), (5003, 11, 102, 40),
                               (5005, 12, 202, 40), (5006, 12, 203, 40)]
            assert {s[0] for s in seen[-6:]} == {"device"}  # queued after every host phase
        seen.clear()  # queue=0: the host phases alone
        native.gds_pool_submit(pool, ctypes.byref(fns), ctypes.addressof(parts), *[a.ctypes.data for a in arrays],
                               0, status.ctypes.data)
        assert native.gds_pool_wait(pool, 40, 0, ctypes.byref(elapsed)) == 1
        assert len(seen) == 7 and {s[0] for s in seen} == {"parse"}
    finally:
        native.gds_pool_destroy(pool)
