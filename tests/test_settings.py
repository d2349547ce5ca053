"""Settings: environment variables, scoped overrides, validation."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import stand_in_driver

from gdsdata import settings


def test_scoped_override_restores():
    before = settings.get("max_gap")
    with settings.set(max_gap=0, staging="host"):
        assert settings.get("max_gap") == 0 and settings.get("staging") == "host"
    assert settings.get("max_gap") == before and settings.get("staging") == "auto"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs CPU affinity and two cores")
def test_thread_counts_and_packing_workers_follow_the_cpu_affinity():
    # a Slurm job or container given one core of many: threads and workers for that core, not the machine's
    code = ("import os, json; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from gdsdata import settings; from gdsdata.commands.doctor import report; "
            "print(json.dumps([settings.get('cpu_threads'), settings.get('gather_threads'), settings.usable_cores(), "
            "report()['cpu cores']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    threads, gather, usable, said = json.loads(out)
    assert (threads, gather, usable) == (1, 1, 1) and said == f"1 of {os.cpu_count()} (this process's CPU affinity)"


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match="staging"):
        settings.set(staging="tape")
    with pytest.raises(KeyError, match="unknown gdsdata setting"):
        settings.set(colour="blue")
    for changes, said in ((dict(cpu_threads=0), "cpu_threads: must be at least 1, got 0"),
                          (dict(max_read=0), "max_read: must be at least 1, got 0"),
                          (dict(max_gap=-1), "max_gap: must be 0 or more, got -1"),
                          (dict(io_threads=100000), "io_threads: at most 1024 threads, got 100000")):
        with pytest.raises(ValueError, match=said):
            settings.set(**changes)
    with settings.set(max_gap=0):  # (no hole read through)
        assert settings.get("max_gap") == 0


def test_a_misspelled_variable_is_warned_about_not_ignored_silently():
    code = "import logging; logging.basicConfig(); import gdsdata; print(gdsdata.settings.get('cpu_threads'))"
    env = {"GDSDATA_CPU_THREAD": "3", "GDSDATA_NVJPEG_LIBRARY": "/x/libnvjpeg.so", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stderr.strip() == ("WARNING:gdsdata.settings:GDSDATA_CPU_THREAD is no gdsdata setting, so it is "
                                  "ignored (did you mean GDSDATA_CPU_THREADS?)")


def test_environment_variables_are_read():
    code = "import gdsdata; print(gdsdata.settings.get('io_threads'), gdsdata.settings.get('verify_checksums'))"
    env = {"GDSDATA_IO_THREADS": "7", "GDSDATA_VERIFY_CHECKSUMS": "yes", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "True"]


def test_a_dataset_keeps_the_settings_it_was_built_with(photos_dataset):
    """``ds.settings``: the snapshot taken when the dataset was built, read-only, unchanged by later
    settings, and carried to DataLoader workers (pickled)."""
    import pickle

    import gdsdata

    with settings.set(direct_ahead=12345, max_gap=4096):
        ds = gdsdata.GDSDataset(photos_dataset[2])
    with settings.set(direct_ahead=777):
        assert ds.settings["direct_ahead"] == 12345 and ds.settings["max_gap"] == 4096
    with pytest.raises(TypeError):
        ds.settings["max_gap"] = 1
    again = pickle.loads(pickle.dumps(ds))
    assert dict(again.settings) == dict(ds.settings)
    with pytest.raises(TypeError):
        again.settings["max_gap"] = 1
    again.close()
    ds.close()


def test_a_bad_environment_variable_is_one_line_not_an_import_failure():
    """``import gdsdata`` works with a bad GDSDATA_* variable; the first use of the settings raises
    naming the variable, and the command line prints that in one line and exits 1."""
    env = {**os.environ, "GDSDATA_IO_ENGINE": "bogus", "GDSDATA_DIRECT_AHEAD": "1X"}
    code = ("import gdsdata\ntry:\n    gdsdata.settings.snapshot()\nexcept ValueError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "GDSDATA_IO_ENGINE='bogus'" in out.stdout and "GDSDATA_DIRECT_AHEAD='1X'" in out.stdout
    done = subprocess.run([sys.executable, "-m", "gdsdata", "doctor"], env=env, capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("gdsdata: error: GDSDATA_") and "GDSDATA_IO_ENGINE='bogus'" in lines[0]


def test_a_bad_environment_variable_stops_a_pack_before_it_makes_out(tmp_path):
    from conftest import write_photos

    write_photos(str(tmp_path / "src"), 2, classes=1)
    env = {**os.environ, "GDSDATA_MAX_GAP": "-1"}
    done = subprocess.run([sys.executable, "-m", "gdsdata", "pack", str(tmp_path / "src"), str(tmp_path / "ds")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "GDSDATA_MAX_GAP" in done.stderr and done.stderr.count("\n") == 1
    assert not os.path.exists(tmp_path / "ds")


def test_thread_counts_and_the_direct_depth_are_bounded():
    with pytest.raises(ValueError, match="setting direct_depth: at most 1024 reads in flight, got 200000"):
        settings.set(direct_depth=200000)
    with pytest.raises(ValueError, match="setting io_threads: at most 1024 threads"):
        settings.set(io_threads=5000)
    with settings.set(direct_depth=1024):
        assert settings.get("direct_depth") == 1024


def test_byte_settings_take_sizes():
    with settings.set(direct_ahead="64M", max_gap="16K", max_read="1GiB"):
        assert (settings.get("direct_ahead"), settings.get("max_gap"), settings.get("max_read")) == (
            64 << 20, 16 << 10, 1 << 30)
    with pytest.raises(ValueError, match="expected a size"):
        settings.set(max_gap="lots")
    with pytest.raises(ValueError, match="expected an integer"):
        settings.set(io_threads="8M")


def _queues(code, **env):
    run = subprocess.run([sys.executable, "-c", code], env={"PATH": "", **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout)


def test_import_asks_cuda_for_32_work_queues_unless_told_otherwise():
    # CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when it makes its context: gdsdata sets it on import,
    # keeps the environment's, and leaves a CUDA that has already started alone (saying so)
    said = ("import json, os, gdsdata; print(json.dumps([os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), "
            "gdsdata.settings.cuda_queues()]))")
    assert _queues(said) == ["32", [32, "set by gdsdata"]]
    kept = [1, "CUDA_DEVICE_MAX_CONNECTIONS in the environment"]
    assert _queues(said, CUDA_DEVICE_MAX_CONNECTIONS="1") == ["1", kept]
    started = ("import sys, types; sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace("
               "is_initialized=lambda: True)); " + said)
    assert _queues(started) == [None, [8, "CUDA's default: CUDA started before gdsdata was imported"]]
    changed = said.replace("print(", "os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '2'; print(")  # (after import)
    assert _queues(changed) == ["2", [2, "CUDA_DEVICE_MAX_CONNECTIONS in the environment"]]


_DRIVER = r"""
int cuDeviceGetCount(int *count) { if (!STARTED) return 3; *count = 1; return 0; }  /* 3: not initialised */
"""


def _driver(tmp_path, name, started):
    """A stand-in for the CUDA driver, started (cuInit called) or not."""
    return stand_in_driver(tmp_path, name, _DRIVER, STARTED=int(started))


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                    reason="needs Linux and a C compiler")
def test_a_cuda_driver_started_before_import_keeps_cudas_default(tmp_path):
    # CUDA reads the variable as its driver starts (cuInit), which torch.cuda.is_available() or another
    # library (CuPy, DALI) may have done before gdsdata is imported without torch knowing: the driver
    # knows. gdsdata asks it only where something loaded it
    said = ("import json, os, gdsdata; print(json.dumps([os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), "
            "gdsdata.settings.cuda_queues()]))")
    for started, expected in ((False, ["32", [32, "set by gdsdata"]]),
                              (True, [None, [8, "CUDA's default: CUDA started before gdsdata was imported"]])):
        library = _driver(tmp_path, f"started{int(started)}", started)
        assert _queues(f"import ctypes; ctypes.CDLL({str(library)!r}); " + said) == expected, started
    # a driver on the library path that nothing loaded is neither loaded nor asked
    found = tmp_path / "found"
    found.mkdir()
    (found / "libcuda.so.1").symlink_to(_driver(tmp_path, "unloaded", True))
    loaded = said.replace("print(json.dumps([", "print(json.dumps(['libcuda' in open('/proc/self/maps').read(), ")
    assert _queues(loaded, LD_LIBRARY_PATH=str(found)) == [False, "32", [32, "set by gdsdata"]]


def test_the_gpu_path_warns_of_too_few_work_queues(monkeypatch, caplog):
    from gdsdata.backends import gpu

    for queues, level in ((1, "WARNING"), (8, "INFO"), (32, None)):
        monkeypatch.setattr(settings, "_cuda_queues", (queues, "CUDA_DEVICE_MAX_CONNECTIONS in the environment"))
        monkeypatch.setattr(gpu, "_queues_checked", False)
        caplog.clear()
        with caplog.at_level("INFO", logger="gdsdata.backends.gpu"):
            gpu._check_cuda_queues()
            gpu._check_cuda_queues()  # said once a process
        assert [r.levelname for r in caplog.records] == ([level] if level else [])
        if level:
            assert f"CUDA runs {queues} hardware work queue" in caplog.text
