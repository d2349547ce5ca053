"""Read planning: every requested sample lands where the plan says, reads are aligned and bounded."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsdata import format as fmt
from gdsdata.plan import plan_reads

ALIGN = 4096


def _layout(lengths, per_shard):
    samples = np.zeros(len(lengths), fmt.SAMPLE_RECORD)
    offset, shard, count = ALIGN, 0, 0
    for i, n in enumerate(lengths):
        if count == per_shard:
            offset, shard, count = ALIGN, shard + 1, 0
        samples[i]["shard"], samples[i]["offset"], samples[i]["length"] = shard, offset, n
        offset += -(-n // ALIGN) * ALIGN
        count += 1
    return samples


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=40),
       per_shard=st.integers(1, 10), data=st.data(),
       max_gap=st.sampled_from([0, 4096, 65536, 1 << 30]), max_read=st.sampled_from([4096, 65536, 1 << 30]))
def test_plan_places_every_sample(lengths, per_shard, data, max_gap, max_read):
    samples = _layout(lengths, per_shard)
    indices = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=60))
    plan = plan_reads(samples, indices, ALIGN, max_gap, max_read)
    # Simulate the reads over synthetic shard contents and check each sample's bytes.
    def byte(shard, pos):
        return (pos * 7 + shard * 13) % 251
    staging = np.full(plan.total, 255, np.uint16)
    for read in plan.reads:
        assert read.offset % ALIGN == 0 and read.size % ALIGN == 0 and read.size > 0
        positions = np.arange(read.offset, read.offset + read.size)
        staging[read.buffer_offset:read.buffer_offset + read.size] = byte(read.shard, positions)
        single = any(
            samples[i]["shard"] == read.shard and samples[i]["offset"] == read.offset
            and -(-int(samples[i]["length"]) // ALIGN) * ALIGN >= read.size for i in indices)
        assert read.size <= max_read or single
    assert sum(r.size for r in plan.reads) == plan.total
    for k, i in enumerate(indices):
        start, n = plan.sample_offsets[k], plan.sample_lengths[k]
        assert n == samples[i]["length"]
        expected = byte(int(samples[i]["shard"]), np.arange(samples[i]["offset"], samples[i]["offset"] + n))
        assert np.array_equal(staging[start:start + n], expected)


def test_neighbours_coalesce_into_one_read():
    samples = _layout([5000] * 8, per_shard=8)
    plan = plan_reads(samples, [3, 0, 1, 2], ALIGN, max_gap=0, max_read=1 << 30)
    assert len(plan.reads) == 1 and plan.reads[0].size == 4 * 8192
    gappy = plan_reads(samples, [0, 2, 4], ALIGN, max_gap=0, max_read=1 << 30)
    assert len(gappy.reads) == 3
    bridged = plan_reads(samples, [0, 2, 4], ALIGN, max_gap=8192, max_read=1 << 30)
    assert len(bridged.reads) == 1

