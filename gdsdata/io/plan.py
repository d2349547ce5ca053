"""Turning a batch of sample indices into as few large, aligned reads as possible.

Shared by the CPU and GPU readers. Samples are grouped by shard and sorted by offset; neighbours
are joined into one read while the hole between them is at most ``max_gap`` bytes and the read stays
under ``max_read``. Every read starts and ends on ``alignment`` boundaries (shard payloads are aligned
at pack time, so this costs at most the padding of the last sample), which is what O_DIRECT and
GPUDirect Storage need.

The plan is computed with whole-array numpy operations (no Python step per sample): it runs on the
I/O thread of every batch, beside the decode thread, and both need the interpreter.
"""

import functools
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
    shards: np.ndarray  # int64, per read: its shard
    offsets: np.ndarray  # int64, per read: file offset, aligned
    sizes: np.ndarray  # int64, per read: bytes, aligned
    buffer_offsets: np.ndarray  # int64, per read: where it lands in the batch's staging buffer
    sample_offsets: np.ndarray  # int64, per requested sample: its start in the staging buffer
    sample_lengths: np.ndarray  # int64, per requested sample: payload bytes
    total: int  # staging bytes needed

    def pages(self, alignment: int) -> np.ndarray:
        """For each alignment-sized page of the staging buffer, the number of the shard page that
        lands there (reads are whole pages at aligned offsets, in staging-buffer order)."""
        counts = self.sizes // alignment
        first = np.cumsum(counts) - counts
        return np.arange(int(counts.sum())) + np.repeat(self.offsets // alignment - first, counts)

    @functools.cached_property
    def reads(self) -> list:
        """The reads as ``Read`` records, in staging-buffer order."""
        return [Read(*r) for r in zip(self.shards.tolist(), self.offsets.tolist(), self.sizes.tolist(),
                                      self.buffer_offsets.tolist())]


# The largest hole that reads past the page cache (``io_engine=direct``, cuFile with GDS) read through to join two
# samples: those bytes come from the drive, where the page cache gives them for a memory copy
# (docs/design.md: what holes cost block-shuffled batches).
DIRECT_MAX_GAP = 16 << 10


def max_gap(config, past_cache: bool) -> int:
    """The hole a plan may read through: the ``max_gap`` setting, at most ``DIRECT_MAX_GAP`` for
    reads that bypass the page cache (``LoadPath.past_cache``)."""
    return min(config["max_gap"], DIRECT_MAX_GAP) if past_cache else config["max_gap"]


def _round_up(x, alignment):
    return -(-x // alignment) * alignment


def plan_reads(samples: np.ndarray, indices, alignment: int, max_gap: int, max_read: int) -> Plan:
    """Plan the reads for ``samples[indices]`` (a SAMPLE_RECORD array); duplicates are read once."""
    indices = np.asarray(indices, dtype=np.int64)
    length = samples["length"][indices].astype(np.int64)
    if not len(indices):
        empty = np.zeros(0, np.int64)
        return Plan(empty, empty, empty, empty, empty, length, 0)
    shard = samples["shard"][indices].astype(np.int64)
    offset = samples["offset"][indices].astype(np.int64)
    order = np.lexsort((offset, shard))
    s, o = shard[order], offset[order]
    # the furthest byte reached so far within the shard (samples of a shard do not overlap, but a
    # sample asked for twice ends where it ended before)
    reach = np.maximum.accumulate(s << 48 | (o + length[order])) & ((1 << 48) - 1)
    aligned_reach = _round_up(reach, alignment)
    # a read ends before a sample of another shard, or one beyond the allowed hole
    cut = np.ones(len(o), bool)
    cut[1:] = (s[1:] != s[:-1]) | (o[1:] - aligned_reach[:-1] > max_gap)
    first = np.flatnonzero(cut)
    last = np.r_[first[1:], len(o)] - 1
    starts = o[first] - o[first] % alignment
    too_long = np.flatnonzero(aligned_reach[last] - starts > max_read)
    if len(too_long):  # split those greedily: each read takes samples while it stays under max_read
        extra = []
        for g in too_long.tolist():
            lo, hi = int(first[g]), int(last[g]) + 1
            while True:
                start = int(o[lo] - o[lo] % alignment)
                end = max(lo, lo + int(np.searchsorted(aligned_reach[lo:hi], start + max_read, "right")) - 1)
                if end + 1 >= hi:
                    break
                extra.append(end + 1)
                lo = end + 1
        cut[extra] = True
        first = np.flatnonzero(cut)
        last = np.r_[first[1:], len(o)] - 1
        starts = o[first] - o[first] % alignment
    sizes = aligned_reach[last] - starts
    buffer_offsets = np.cumsum(sizes) - sizes
    read_of = np.cumsum(cut) - 1  # the read of each sorted sample
    sample_offsets = np.empty(len(indices), np.int64)
    sample_offsets[order] = buffer_offsets[read_of] + o - starts[read_of]
    return Plan(s[first], starts, sizes, buffer_offsets, sample_offsets, length, int(sizes.sum()))
