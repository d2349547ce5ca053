"""The GPU checksum kernel (gdsdata.io.checksums) computes zlib's CRC-32 of every sample in staging:
run by Triton's interpreter on the CPU in a process of its own (the interpreter is chosen when the
kernels are defined), for lengths around its chunk and word sizes."""

import os
import subprocess
import sys

import pytest

CHECK = """
import zlib
import numpy as np, torch
from gdsdata.io import checksums

rng = np.random.default_rng(0)
c = checksums.CHUNK
lengths = np.array([0, 1, 3, 4, 5, c - 1, c, c + 1, 2 * c, 3 * c + 7, 77, 5000, 4096 * 3 + 5])
offsets = np.zeros(len(lengths), np.int64)
pos = 0
for k, length in enumerate(lengths):
    offsets[k] = pos
    pos += (int(length) + 4095) // 4096 * 4096 + 4096
staging = torch.from_numpy(rng.integers(0, 256, pos, dtype=np.uint8))
got = checksums.crc32(staging, offsets, lengths)
assert got.dtype == torch.int64 and got.shape == (len(lengths),)
want = [zlib.crc32(staging[o:o + n].numpy().tobytes()) for o, n in zip(offsets, lengths)]
assert got.tolist() == want, (got.tolist(), want)
staging[int(offsets[9]) + 1000] ^= 1  # one flipped bit changes that sample's alone
again = checksums.crc32(staging, offsets, lengths).tolist()
assert [a != b for a, b in zip(again, want)] == [k == 9 for k in range(len(lengths))]
print("ok")
"""


def test_the_gpu_checksum_kernel_is_zlibs_crc32():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
