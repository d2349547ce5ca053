"""Smoke-run every benchmark pipeline that can run on a CPU, at tiny size (the numbers mean nothing)."""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gdsdata

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_suite_runs_every_cpu_baseline(tmp_path):
    for module in ("torchvision", "lmdb", "matplotlib"):
        pytest.importorskip(module)
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--size", "tiny", "--runs", "1",
                           "--workers", "1", "--out", str(out), "--dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout, proc.stdout
    names = [r["name"] for r in json.loads((out / "suite.json").read_text())["results"]]
    for prefix in ("gdsdata CPU", "ImageFolder + PIL + DataLoader", "LMDB + PIL + DataLoader", "plain file reads"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    assert (out / "suite.png").stat().st_size > 1000


def test_demo_runs(tmp_path):
    pytest.importorskip("torchvision")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "demo.py"), "--count", "40", "--runs", "1",
                           "--workers", "1", "--batch", "8", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gdsdata GDSDataset (cpu)" in proc.stdout and "the images/s of the standard DataLoader" in proc.stdout


def _bench_common():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import common

    return common


def test_an_image_set_is_made_once_whole_and_holds_only_images(tmp_path):
    """The benchmarks' generated image set: made once (a marker beside the folder, where packing does
    not list it), made again from empty for another count (no images of the last one left over)."""
    common = _bench_common()
    folder = str(tmp_path / "images")
    assert common.image_set(folder, 6, classes=2) == folder
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    assert len(files) == 6 and all(f.endswith(".jpg") for f in files)
    stamp = os.path.getmtime(os.path.join(folder, files[0]))
    common.image_set(folder, 6, classes=2)  # made once
    assert os.path.getmtime(os.path.join(folder, files[0])) == stamp
    common.image_set(folder, 4, classes=2)
    assert sum(len(fs) for _, _, fs in os.walk(folder)) == 4
    assert sorted(os.listdir(tmp_path)) == [".images.complete-4", "images"]
    result = gdsdata.pack(folder, str(tmp_path / "ds"), workers=1)
    assert result.packed == 4 and not result.ignored


def test_timed_runs_repeat_short_epochs_to_fill_min_seconds():
    common = _bench_common()
    calls = []

    def epoch():
        calls.append(1)
        import time

        time.sleep(0.3 if len(calls) == 1 else 0.02)  # the warm-up is slow (compiling): no guide

    result = common.measure("x", epoch, 10, runs=2, warmup=1, nbytes=100, min_seconds=0.1)
    assert result.epochs_per_run >= 4 and len(calls) == 1 + 1 + 2 * result.epochs_per_run
    assert result.images == 10 * result.epochs_per_run and result.bytes == 100 * result.epochs_per_run
    assert all(s >= 0.1 for s in result.seconds)
    cold = common.measure("y", epoch, 10, runs=1, warmup=0, min_seconds=0.1)  # no warm-up: one epoch
    assert cold.epochs_per_run == 1 and cold.images == 10


def test_stage_ms_per_batch_and_between_snapshots():
    common = _bench_common()
    before = {"batches": 10, "read_s": 1.0, "decode_s": 0.5}
    after = {"batches": 30, "read_s": 2.0, "decode_s": 1.5}
    assert common.stage_ms(after, before) == {"read": 50.0, "decode": 50.0}
    assert common.stage_ms(after) == {"read": round(2.0 / 30 * 1000, 2), "decode": 50.0}
    assert common.stage_ms(before, after) == {"read": 100.0, "decode": 50.0}  # a new pass: no delta


def test_ddp_summary_gives_scaling_and_coverage(tmp_path):
    def run(world, rates, missing=0):
        epochs = [{"images_per_s": r, "cpu_s_per_1k": 0.1, "missing_samples": missing, "duplicates": 0}
                  for r in rates]
        path = tmp_path / f"w{world}-{rates[1]}.json"
        path.write_text(json.dumps({"world_size": world, "epochs": epochs, "io": "io=compat"}))
        return str(path)

    files = [run(1, [5, 20, 22]), run(1, [5, 21, 19]), run(2, [9, 40, 38]), run(2, [9, 41, 42])]
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ddp.py"), "summary", *files, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())
    assert table["1"]["median_images_per_s"] == 20.5 and table["2"]["median_images_per_s"] == 40.5
    assert abs(table["2"]["scaling"] - 40.5 / 20.5) < 1e-9 and table["2"]["every_sample_once"]
    assert table["1"]["epochs"] == 4  # the first epoch of each run is left out
    files.append(run(2, [9, 40, 40], missing=3))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ddp.py"), "summary", *files],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "NO" in proc.stdout


def test_storage_bench_reads_cold_beside_the_storage_limit(tmp_path):
    """bench/storage.py at tiny size: the limit rows, then streaming epochs that leave the page
    cache as it was and cached ones that fill it."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("the test folder's filesystem refuses O_DIRECT (tmpfs, say)")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "storage.py"), "--dir", str(tmp_path / "d"),
                           "--count", "40", "--runs", "1", "--batch", "8", "--kinds", "raw", "--shuffles", "block",
                           "--threads", "2", "--epochs", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "storage.json").read_text())["results"]
    assert rows[0]["row"] == "limit" and rows[0]["limit_bytes_per_s"] > 0
    streamed, cached = rows[1], rows[2]
    assert (streamed["reads"], cached["reads"]) == ("direct", "preadv")
    assert streamed["resident_mib"] == 0 and cached["resident_mib"] > 0
    assert (streamed["epochs"], cached["epochs"]) == (2, 1)  # streaming epochs back to back; the cached one alone


def test_the_system_block_says_how_fast_the_host_runs():
    import re

    common = _bench_common()
    line = common.host_speed()
    pattern = r"copy [\d.]+ GB/s \(1 thread\), Python \d+ M loops/s, load [\d.]+, steal ([\d.]+ %|n/a)"
    assert re.fullmatch(pattern, line), line
    if os.path.exists("/proc/stat"):  # Linux: its cpu line
        steal, total = common.host_cpu_times()
        assert 0 <= steal <= total
    else:
        assert common.host_cpu_times() is None
    assert common.steal_pct((10, 1000), (13, 1200)) == 1.5
    assert common.steal_pct(None, (13, 1200)) is None and common.steal_pct((1, 5), (1, 5)) is None
    model = common.cpu_model()  # and on which CPU: the model /proc/cpuinfo names most, and its sockets
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        assert not names or model.startswith(max(set(names), key=names.count)), model
    assert model and "\n" not in model


def test_gpu_clocks_give_medians_and_the_shares_held_down():
    """bench's NVML sampler on a stand-in NVML: medians of the SM clock and power, and the share of
    samples at the power cap or slowed; without NVML, nothing (the row goes without)."""
    GpuClocks = _bench_common().GpuClocks

    class Nvml:
        NVML_CLOCK_SM = 1
        readings = iter([(1980, 500_000, 0), (1755, 690_000, 0x4), (1800, 700_000, 0x4 | 0x20),
                         (1980, 520_000, 0x1)] * 2)  # then no more: a sample NVML does not give is left out

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByIndex(self, index):
            return index

        def nvmlDeviceGetClockInfo(self, handle, kind):
            self.now = next(self.readings)
            return self.now[0]

        def nvmlDeviceGetPowerUsage(self, handle):
            return self.now[1]

        def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
            return self.now[2]

    clocks = GpuClocks(0, interval=0.001, nvml=Nvml()).start()
    deadline = time.monotonic() + 10
    while len(clocks.samples) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert clocks.stop() == {"sm_mhz": 1890, "watts": 605, "power_capped_pct": 50.0, "slowed_pct": 25.0,
                             "samples": 8}

    class Missing:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert GpuClocks(0, nvml=Missing()).start().stop() is None


def test_thread_cpu_names_each_threads_time_per_batch():
    """bench's per-thread CPU account: a thread that spins for a while counts under its name (its
    number left off), the training loop under its own; a thread started after start() counts whole."""
    ThreadCpu = _bench_common().ThreadCpu
    account = ThreadCpu().start()
    done, spun = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait(10)  # alive until stop() has read it

    worker = threading.Thread(target=spin, name="gdsdata-gather_3", daemon=True)
    worker.start()
    assert spun.wait(30)
    used = account.stop(per=3)
    done.set()
    worker.join()
    assert 80 <= used["gdsdata-gather"] <= 200, used  # ~300 ms over 3 batches, at the clock tick's grain
    assert list(used)[0] == "gdsdata-gather"  # the busiest first


def test_timeline_splits_the_steps_idle_time():
    """bench/timeline.py on a made-up trace of one step: the step's stream (7) busy 0-10, 12-20 and
    30-40 us, another stream's kernel at 10-11 (in the step's first gap), a copy at 20-25; the gaps:
    2 us (1 beside a kernel, 1 empty) and 10 us (5 beside the copy, 5 empty)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import timeline

    def k(stream, ts, dur, corr, cat="kernel"):
        return {"cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}

    events = [k(7, 0, 10, 1), k(7, 12, 8, 2), k(7, 30, 10, 3), k(9, 10, 1, 4), k(9, 20, 5, 5, "gpu_memcpy"),
              *({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
                 "args": {"correlation": c}} for ts, tid, c in ((-5, 1, 1), (10, 1, 2), (25, 1, 3), (5, 2, 4)))]
    r = timeline.analyse(events, steps=1)
    assert (r["step_kernels_busy_ms"], r["step_idle_ms"], r["idle_beside_other_kernels_ms"],
            r["idle_beside_copies_only_ms"], r["idle_gpu_empty_ms"]) == (0.028, 0.012, 0.001, 0.005, 0.006)
    assert r["other_kernels_busy_ms"] == 0.001 and r["other_kernels_beside_step_ms"] == 0.0
    assert r["launch_to_start_us"] == {"p10": 2, "p50": 5, "p90": 5}
    train = next(t for t in r["threads"] if t["thread"] == 1)
    assert train["kernels"] == 3 and train["on_step_stream"] == 3 and train["median_launch_us"] == 2
    other = next(t for t in r["threads"] if t["thread"] == 2)
    assert other["on_step_stream"] == 0.0


def test_the_training_client_gives_each_row_its_queues_and_refuses_unknown_inputs(monkeypatch):
    """bench/train.py: ``:queuesN`` on any input sets CUDA_DEVICE_MAX_CONNECTIONS for that row's
    process; other rows get the environment the bench was started in (not the 32 its own import of
    gdsdata set); an unknown input stops the run before any image is made."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import train

    assert [train._without_queues(n) for n in ("gdsdata:queues8", "dali:queues32", "raw:nocrc:queues4",
                                              "gdsdata:nocrc", "synthetic:queuesx")] == \
        ["gdsdata", "dali", "raw:nocrc", "gdsdata:nocrc", "synthetic:queuesx"]
    seen = {}

    def run(command, env, **kw):
        seen[command[command.index("--row") + 2]] = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
        return subprocess.CompletedProcess(command, 0, '{"hang": false}', "")

    monkeypatch.setattr(train.subprocess, "run", run)
    monkeypatch.setattr(train, "QUEUES", None)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # (as gdsdata's import in the bench sets it)
    args = argparse.Namespace(trace=None, count=1, epochs=1, workers=1, stall=1, profile=0, row_timeout=5)
    for source in ("synthetic", "dali:queues16", "gdsdata:queues8"):
        train.spawn(args, "resnet18", source, "current", ("s", "j", "r"))
    assert seen == {"synthetic": None, "dali:queues16": "16", "gdsdata:queues8": "8"}
    with pytest.raises(SystemExit):
        train.main(["--inputs", "synthetic,foo:queues2", "--models", ""])


def test_beside_lays_out_each_jpeg_s_planes_and_refuses_what_it_cannot_run(tmp_path, capsys):
    """bench/beside.py's placed decode rows: the planes nvJPEG writes for YUV output come from each
    JPEG's chroma subsampling as PIL reads it (4:4:4, 4:2:2, 4:2:0; a grayscale JPEG is passed over),
    one after another in one buffer; too few JPEGs, an unknown place or output, and a machine without
    CUDA each end the run with one line."""
    from PIL import Image

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import beside

    folder = tmp_path / "images" / "class_0000"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, mode, subsampling, size in (("a", "RGB", 0, (33, 21)), ("b", "L", -1, (16, 16)),
                                          ("c", "RGB", 1, (35, 19)), ("d", "RGB", 2, (17, 31))):
        pixels = rng.integers(0, 255, (size[1], size[0], 3 if mode == "RGB" else 1), dtype=np.uint8).squeeze()
        Image.fromarray(pixels, mode).save(folder / f"{name}.jpg", quality=90,
                                            **({"subsampling": subsampling} if subsampling >= 0 else {}))
    streams, shapes = beside.read_jpegs(str(tmp_path / "images"), 3)
    assert shapes == [(21, 33, (1, 1)), (19, 35, (2, 1)), (31, 17, (2, 2))]
    assert streams[0] == (folder / "a.jpg").read_bytes() and streams[2] == (folder / "d.jpg").read_bytes()
    planes, sizes = beside.plane_layout(shapes, "yuv")
    assert [list(pitch) for _, pitch in planes] == [[33, 35, 17], [33, 18, 9], [33, 18, 9]]
    assert list(sizes) == [3 * 33 * 21, 35 * 19 + 2 * 18 * 19, 17 * 31 + 2 * 9 * 16]
    assert [list(at) for at, _ in planes] == [[0, 2079, 3428], [693, 2744, 3955], [1386, 3086, 4099]]
    planes, sizes = beside.plane_layout(shapes, "rgb")
    assert len(planes) == 1 and list(planes[0][1]) == [99, 105, 51] and list(planes[0][0]) == [0, 2079, 4074]
    with pytest.raises(SystemExit, match="holds 3 RGB JPEGs, 4 needed"):
        beside.read_jpegs(str(tmp_path / "images"), 4)
    with pytest.raises(SystemExit):
        beside.main(["--places", "thread,gpu", "--out", str(tmp_path / "out")])
    assert "unknown place(s) or output(s): gpu" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert beside.main(["--out", str(tmp_path / "out"), "--dir", str(tmp_path)]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().out


def test_beside_drops_a_placed_row_whose_decode_fails_and_keeps_the_others(monkeypatch, capsys):
    """A placed decode row that fails (in its warm-up or in a pass) is said, recorded with its model,
    dropped from the passes and its decoder closed; a failure of a row of gdsdata's own path, or of
    the step, ends the run."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import beside

    class Decoder:
        closed = False

        def close(self):
            self.closed = True

    calls = []

    def rate(model, work, steps, images, labels):
        calls.append((work, steps))
        if work == "placed-fails-late" and steps == 7 and sum(c == (work, 7) for c in calls) == 2:
            raise beside.WorkFailed("RuntimeError: the decode failed")
        if work == "placed-fails-early":
            raise beside.WorkFailed("RuntimeError: NVJPEG_STATUS_ALLOCATOR_FAILURE")
        return 1000.0, 1.0

    monkeypatch.setattr(beside, "_Model", lambda name: name)
    monkeypatch.setattr(beside, "rate", rate)
    decoders = {"early": Decoder(), "late": Decoder(), "fine": Decoder()}
    modes = {"step alone": None, "early": "placed-fails-early", "late": "placed-fails-late", "fine": "placed-fine"}
    results = {"rows dropped": {}}
    elsewhere = dict(decoders)
    beside._model_rows("resnet18", 7, 3, modes, elsewhere, results, None, None)
    assert list(modes) == ["step alone", "fine"] and list(elsewhere) == ["fine"]
    assert decoders["early"].closed and decoders["late"].closed and not decoders["fine"].closed
    assert results["rows dropped"] == {"early": "resnet18: RuntimeError: NVJPEG_STATUS_ALLOCATOR_FAILURE",
                                       "late": "resnet18: RuntimeError: the decode failed"}
    assert set(results["resnet18"]) == {"step alone", "fine"}
    assert results["resnet18"]["fine"]["rates"] == [1000.0] * 3
    assert "early: dropped (RuntimeError: NVJPEG_STATUS_ALLOCATOR_FAILURE)" in capsys.readouterr().out
    monkeypatch.setattr(beside, "rate", lambda *a: (_ for _ in ()).throw(beside.WorkFailed("gdsdata's decode")))
    with pytest.raises(beside.WorkFailed):  # (not a placed row: the run ends)
        beside._model_rows("resnet18", 7, 3, {"decode": "own"}, {}, {"rows dropped": {}}, None, None)
