"""Turning a batch of sample indices into as few large, aligned reads as possible.

Shared by the CPU and GPU readers. Samples are grouped by shard and sorted by offset; neighbours
are joined into one read while the hole between them is at most ``max_gap`` bytes and the read stays
under ``max_read``. Every read starts and ends on ``alignment`` boundaries (shard payloads are aligned
at pack time, so this costs at most the padding of the last sample), which is what O_DIRECT and
GPUDirect Storage need.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Read:
    shard: int
    offset: int  # file offset, aligned
    size: int  # bytes, aligned
    buffer_offset: int  # where this read lands in the batch's staging buffer


@dataclass(frozen=True)
class Plan:
    reads: list  # [Read]
    sample_offsets: np.ndarray  # int64, per requested sample: its start in the staging buffer
    sample_lengths: np.ndarray  # int64, per requested sample: payload bytes
    total: int  # staging bytes needed


def _round_up(x, alignment):
    return -(-x // alignment) * alignment


def plan_reads(samples: np.ndarray, indices, alignment: int, max_gap: int, max_read: int) -> Plan:
    """Plan the reads for ``samples[indices]`` (a SAMPLE_RECORD array); duplicates are read once."""
    indices = np.asarray(indices, dtype=np.int64)
    shard = samples["shard"][indices].astype(np.int64)
    offset = samples["offset"][indices].astype(np.int64)
    length = samples["length"][indices].astype(np.int64)
    order = np.lexsort((offset, shard))
    sample_offsets = np.empty(len(indices), np.int64)
    reads = []
    cursor = 0  # staging-buffer position where the next read lands
    current = None  # [shard, start, end] of the read being grown
    members = []  # (position in request, file offset) of samples in the current read

    def flush():
        nonlocal cursor
        start, end = current[1], _round_up(current[2], alignment)
        reads.append(Read(current[0], start, end - start, cursor))
        for position, file_offset in members:
            sample_offsets[position] = cursor + file_offset - start
        cursor += end - start

    for position in order:
        s, o, n = int(shard[position]), int(offset[position]), int(length[position])
        end = o + n
        if current is not None and current[0] == s and o - _round_up(current[2], alignment) <= max_gap and \
                _round_up(max(end, current[2]), alignment) - current[1] <= max_read:
            current[2] = max(current[2], end)
            members.append((position, o))
            continue
        if current is not None:
            flush()
        start = o - o % alignment
        current = [s, start, end]
        members = [(position, o)]
    if current is not None:
        flush()
    return Plan(reads, sample_offsets, length, cursor)
