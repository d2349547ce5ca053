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
