"""The GPU checksum kernel (gdsdata.io.checksums) computes zlib's CRC-32 of every sample in staging:
run by Triton's interpreter on the CPU in a process of its own (the interpreter is chosen when the
kernels are defined), for lengths around its chunk and word sizes."""

import os
import subprocess
import sys

from conftest import needs_triton_interpreter

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
    needs_triton_interpreter()
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_a_gpu_mismatch_is_confirmed_on_the_host_before_a_sample_is_called_corrupt(photos_dataset, tmp_path, caplog):
    """``confirm_mismatches`` (the GPU check's second opinion; staging here is a CPU tensor): bytes
    that pass the host's check are the kernel's fault, staged bytes that differ from good stored
    bytes are staged again, and only stored bytes that fail are a CorruptSampleError."""
    import logging

    import numpy as np
    import torch

    from conftest import damaged_copy
    from gdsdata.backends.gpu import confirm_mismatches
    from gdsdata.errors import CorruptSampleError
    from gdsdata.format.index import load
    from gdsdata.io.cpu import CpuReader

    _, _, root = photos_dataset
    index = load(root)
    indices = [4, 9, 17]
    buffer, plan = CpuReader(index).read(indices)
    staging = torch.from_numpy(buffer.copy())
    with caplog.at_level(logging.WARNING, logger="gdsdata"):
        assert confirm_mismatches(index, staging, plan, indices, [0]) == {}
        assert "kernel disagreed" in caplog.text
        start, length = int(plan.sample_offsets[1]), int(plan.sample_lengths[1])
        staging[start + 10] ^= 0xFF
        assert confirm_mismatches(index, staging, plan, indices, [1]) == {}
        assert "fault in the transfer" in caplog.text
        assert np.array_equal(staging[start:start + length].numpy(), buffer[start:start + length])
    bad = damaged_copy(root, str(tmp_path / "ds"), 17, 50, b"\x00\x01\x02")
    bad_index = load(bad)
    damaged, plan = CpuReader(bad_index).read(indices)
    failed = confirm_mismatches(bad_index, torch.from_numpy(damaged.copy()), plan, indices, [2])
    assert list(failed) == [2] and isinstance(failed[2], CorruptSampleError)
    assert "sample 17 (" in str(failed[2]) and "checksum mismatch" in str(failed[2])
