"""Smoke-run every benchmark pipeline that can run on a CPU, at tiny size (the numbers mean nothing)."""

import json
import os
import subprocess
import sys

import pytest

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
