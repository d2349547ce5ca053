"""Settings: environment variables, scoped overrides, validation."""

import subprocess
import sys

import pytest

from gdsdata import settings


def test_scoped_override_restores():
    before = settings.get("max_gap")
    with settings.set(max_gap=0, staging="host"):
        assert settings.get("max_gap") == 0 and settings.get("staging") == "host"
    assert settings.get("max_gap") == before and settings.get("staging") == "auto"


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match="staging"):
        settings.set(staging="tape")
    with pytest.raises(KeyError, match="unknown gdsdata setting"):
        settings.set(colour="blue")
    with pytest.raises(ValueError, match="positive"):
        settings.set(cpu_threads=0)


def test_environment_variables_are_read():
    code = "import gdsdata; print(gdsdata.settings.get('io_threads'), gdsdata.settings.get('verify_checksums'))"
    env = {"GDSDATA_IO_THREADS": "7", "GDSDATA_VERIFY_CHECKSUMS": "yes", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "True"]


def test_assist_threads_auto_leaves_cores_and_shares_them_among_gpu_processes(monkeypatch):
    from gdsdata.decode_assist import assist_threads
    from gdsdata.errors import GpuUnavailableError

    monkeypatch.setattr("gdsdata.nvjpeg_host.native_loop", lambda: None)  # as where the native loop was built
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert settings.get("assist_threads") == 0 and assist_threads() == 0  # off by default

    def missing():
        raise GpuUnavailableError("not built")

    with settings.set(assist_threads="auto"):
        assert assist_threads() == 12  # 16 cores, one GPU process: four left to the Loader
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
        assert assist_threads() == 0  # two cores a process: none to spare
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert assist_threads() == 4
        with settings.set(assist_threads=3):
            assert assist_threads() == 3
        with pytest.raises(ValueError, match="assist_threads"):
            settings.set(assist_threads="many")
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        monkeypatch.setattr("gdsdata.nvjpeg_host.native_loop", missing)
        assert assist_threads() == 0  # no native loop: the engines alone


def test_assist_share_balances_the_measured_rates():
    from gdsdata.decode_assist import ENGINE_RATE, SLOTS, THREAD_RATE, DecodeAssist

    assist = DecodeAssist(12, 7, device=None)
    share = assist.share(256)
    # both parts take about as long: engines (256 - share) / (7 x ENGINE_RATE), threads share / (12 x THREAD_RATE)
    assert abs((256 - share) / (7 * ENGINE_RATE) - share / (12 * THREAD_RATE)) < 1 / (12 * THREAD_RATE)
    assert share == 52
    assist.thread_rate = assist.engine_rate / 1000  # threads measured far slower: one image each, to keep measuring
    assert assist.share(256) == 12
    assist.thread_rate = assist.engine_rate * 10  # far faster: as many as their slots hold
    assert assist.share(256) == 12 * (SLOTS // 2)
    assert assist.share(12) == 0 and assist.share(13) == 12  # a batch no larger than the threads: engines alone
    assist.close()
