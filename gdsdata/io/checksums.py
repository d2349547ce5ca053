"""CRC-32 of a batch's samples where they sit in GPU staging: the check of bytes that never pass a CPU.

The same CRC-32 as ``zlib.crc32`` (reflected, polynomial 0xEDB88320, pre- and post-inverted), in
two launches for the whole batch:

1. ``_chunks``: every sample's bytes cut into chunks of ``CHUNK`` bytes; one lane per full chunk
   runs the CRC register over it from zero, four bytes a step (slicing-by-4 tables);
2. ``_combine``: one lane per sample joins its chunks in order (the register is linear over GF(2):
   the state after a chunk is the state before it shifted by the chunk's length, a fixed 32 x 32 bit
   matrix for a full chunk, XOR the chunk's own register) and runs the bytes after the last full
   chunk one at a time.

Samples start at aligned offsets in staging (the dataset's alignment), so the four-byte loads are
aligned. The CPU reference is ``zlib.crc32``; tests run the kernels in Triton's interpreter.
"""

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from gdsdata.batch import upload

CHUNK = 1024
_BLOCK = 128
_POLY = 0xEDB88320


@functools.lru_cache(maxsize=None)
def _tables() -> np.ndarray:
    """The slicing-by-4 tables, [4, 256] uint32: T0 the byte table, Tk[i] = T(k-1)[i] shifted one byte."""
    t = np.zeros((4, 256), np.uint64)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t.astype(np.uint32)


@functools.lru_cache(maxsize=None)
def _shift_columns(nbytes: int) -> np.ndarray:
    """Columns of the matrix that advances a CRC register over ``nbytes`` zero bytes: column b is
    where bit b of the register ends up (32 uint32)."""
    t0 = [int(v) for v in _tables()[0]]
    out = []
    for b in range(32):
        state = 1 << b
        for _ in range(nbytes):
            state = t0[state & 0xFF] ^ (state >> 8)
        out.append(state)
    return np.array(out, np.uint32)


@triton.jit
def _entry(tables, index):
    return tl.load(tables + index).to(tl.uint32, bitcast=True)


@triton.jit
def _step4(crc, word, tables):
    x = crc ^ word
    return (_entry(tables, 768 + (x & 0xFF)) ^ _entry(tables, 512 + ((x >> 8) & 0xFF))
            ^ _entry(tables, 256 + ((x >> 16) & 0xFF)) ^ _entry(tables, x >> 24))


# Counts that change from batch to batch are not specialised on (Triton would compile a variant for
# each divisibility it sees, seconds of CPU each time, mid-epoch).
@triton.jit(do_not_specialize=["count"])
def _chunks(words, starts, count, tables, out, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Lane j: the register over the CHUNK bytes from word ``starts[j]``, from zero."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < count
    start = tl.load(starts + j, mask=mask, other=0)
    crc = tl.zeros([BLOCK], tl.uint32)
    for k in range(0, WORDS):
        word = tl.load(words + start + k, mask=mask, other=0).to(tl.uint32, bitcast=True)
        crc = _step4(crc, word, tables)
    tl.store(out + j, crc.to(tl.int32, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["count", "most_chunks"])
def _combine(data, offsets, lengths, first, chunk_crcs, columns, tables, out, count,
             most_chunks, CHUNK_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """Lane i: sample i's CRC-32 from its full chunks' registers and its last bytes."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < count
    length = tl.load(lengths + i, mask=mask, other=0)
    full = length // CHUNK_BYTES
    base = tl.load(first + i, mask=mask, other=0)
    ones = tl.full([BLOCK], -1, tl.int32).to(tl.uint32, bitcast=True)
    state = ones
    none = tl.zeros([BLOCK], tl.uint32)
    for j in range(0, most_chunks):
        live = mask & (j < full)
        shifted = tl.zeros([BLOCK], tl.uint32)
        for b in tl.static_range(32):
            shifted ^= tl.where(((state >> b) & 1) != 0, _entry(columns, b), none)
        chunk = tl.load(chunk_crcs + base + j, mask=live, other=0).to(tl.uint32, bitcast=True)
        state = tl.where(live, shifted ^ chunk, state)
    tail = tl.load(offsets + i, mask=mask, other=0) + full * CHUNK_BYTES
    rest = length - full * CHUNK_BYTES
    for t in range(0, CHUNK_BYTES):
        live = mask & (t < rest)
        byte = tl.load(data + tail + t, mask=live, other=0).to(tl.uint32)
        nxt = _entry(tables, (state ^ byte) & 0xFF) ^ (state >> 8)
        state = tl.where(live, nxt, state)
    tl.store(out + i, (state ^ ones).to(tl.int32, bitcast=True), mask=mask)


@functools.lru_cache(maxsize=None)
def _device_tables(device: torch.device):
    """The byte tables and a full chunk's shift matrix on ``device``, uploaded once."""
    tables = torch.from_numpy(_tables().view(np.int32).ravel().copy()).to(device)
    columns = torch.from_numpy(_shift_columns(CHUNK).view(np.int32).copy()).to(device)
    return tables, columns


def crc32(staging: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """CRC-32 (as ``zlib.crc32``) of ``staging[offsets[k]:offsets[k] + lengths[k]]`` for every k, as
    an int64 tensor on the staging's device, queued on the current stream. ``staging`` is a flat
    uint8 tensor whose length and ``offsets`` are multiples of 4.

    Only per-sample arrays leave the host; the per-chunk table is built on the device (a host
    array as long as the chunks would be copied by torch's intra-op threads, whose wait after
    each copy costs every core CPU time)."""
    device = staging.device
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    n = len(offsets)
    full = lengths // CHUNK
    first = np.zeros(n, np.int64)
    np.cumsum(full[:-1], out=first[1:])
    total = int(full.sum())
    tables, columns = _device_tables(device)
    rows = np.zeros((5, n + n % 2), np.int64)  # even rows: each 16-byte aligned (one Triton variant)
    rows[:, :n] = offsets, lengths, first, (offsets - first * CHUNK) // 4, full
    per_sample = upload(torch.from_numpy(rows), device)
    chunk_crcs = torch.empty(max(total, 1), dtype=torch.int32, device=device)
    if total:  # chunk j of the batch starts at word (offset - first * CHUNK) / 4 of its sample + j * CHUNK / 4
        starts = torch.repeat_interleave(per_sample[3], per_sample[4], output_size=total)
        starts += torch.arange(0, total * (CHUNK // 4), CHUNK // 4, dtype=torch.int64, device=device)
        _chunks[(triton.cdiv(total, _BLOCK),)](staging.view(torch.int32), starts, total, tables, chunk_crcs,
                                                WORDS=CHUNK // 4, BLOCK=_BLOCK)
    out = torch.empty(n, dtype=torch.int32, device=device)
    _combine[(triton.cdiv(n, _BLOCK),)](staging, per_sample[0], per_sample[1], per_sample[2], chunk_crcs, columns,
                                        tables, out, n, int(full.max()) if n else 0, CHUNK_BYTES=CHUNK, BLOCK=_BLOCK)
    return out.to(torch.int64) & 0xFFFFFFFF
