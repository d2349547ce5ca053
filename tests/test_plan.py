"""Read planning: every requested sample lands where the plan says, reads are aligned and bounded."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsdata.format import layout as fmt
from gdsdata.io.plan import plan_reads

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



def _greedy(samples, indices, alignment, max_gap, max_read):
    """The planner's rule, one sample at a time: (shard, offset, size) of each read, and where each
    requested sample lands."""
    indices = np.asarray(indices, np.int64)
    shard, offset = samples["shard"][indices].astype(np.int64), samples["offset"][indices].astype(np.int64)
    end = offset + samples["length"][indices].astype(np.int64)
    reads, placed, current, cursor = [], np.empty(len(indices), np.int64), None, 0

    def up(x):
        return -(-x // alignment) * alignment

    def flush():
        nonlocal cursor
        reads.append((current[0], current[1], up(current[2]) - current[1]))
        for k in current[3]:
            placed[k] = cursor + offset[k] - current[1]
        cursor += up(current[2]) - current[1]

    for k in np.lexsort((offset, shard)).tolist():
        if current is not None and current[0] == shard[k] and offset[k] - up(current[2]) <= max_gap \
                and up(max(end[k], current[2])) - current[1] <= max_read:
            current[2] = max(current[2], end[k])
            current[3].append(k)
            continue
        if current is not None:
            flush()
        current = [shard[k], offset[k] - offset[k] % alignment, end[k], [k]]
    flush()
    return reads, placed


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=40),
       per_shard=st.integers(1, 10), data=st.data(), alignment=st.sampled_from([512, 4096, 8192]),
       max_gap=st.sampled_from([0, 4096, 65536, 1 << 30]), max_read=st.sampled_from([4096, 65536, 1 << 30]))
def test_plan_follows_the_greedy_rule(lengths, per_shard, data, alignment, max_gap, max_read):
    """The whole-array planner makes exactly the reads of the one-sample-at-a-time rule."""
    samples = _layout(lengths, per_shard)
    indices = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=60))
    plan = plan_reads(samples, indices, alignment, max_gap, max_read)
    reads, placed = _greedy(samples, indices, alignment, max_gap, max_read)
    assert [(r.shard, r.offset, r.size) for r in plan.reads] == reads
    assert np.array_equal(plan.sample_offsets, placed)


def test_direct_reads_do_not_read_block_shuffled_holes_from_the_drive():
    """Block-shuffled batches of ~84 KB samples: joined across the general 256 KiB holes, a plan reads
    far more than the samples (free from the page cache, not from a drive); direct reads join only
    across holes of up to DIRECT_MAX_GAP and read about the samples' bytes."""
    from gdsdata import settings as gsettings
    from gdsdata.io.plan import DIRECT_MAX_GAP, max_gap
    from gdsdata.sampler import ShardSpec, epoch_order

    rng = np.random.default_rng(0)
    n, alignment = 4096, 4096
    lengths = rng.normal(84_000, 25_000, n).clip(20_000, 400_000).astype(np.int64)
    samples = np.zeros(n, fmt.SAMPLE_RECORD)
    samples["length"] = lengths
    samples["offset"] = np.r_[0, np.cumsum(-(-lengths // alignment) * alignment)[:-1]]
    order = epoch_order(ShardSpec(n, batch_size=256, shuffle="block"), 0)
    config = gsettings.snapshot()
    assert max_gap(config, past_cache=False) == config["max_gap"] == 256 << 10
    assert max_gap(config, past_cache=True) == DIRECT_MAX_GAP

    def amplification(gap):
        return sum(int(plan_reads(samples, order[b:b + 256], alignment, gap, 64 << 20).sizes.sum())
                   for b in range(0, n, 256)) / lengths.sum()

    assert amplification(max_gap(config, past_cache=False)) > 1.4
    assert amplification(max_gap(config, past_cache=True)) < 1.05
