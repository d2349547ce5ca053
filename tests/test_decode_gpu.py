"""The host side of GPU decoding that runs anywhere: how a batch is cut into nvJPEG calls."""

import pytest

from gdsdata.decode_gpu import MAX_CALL_IMAGES, call_parts


@pytest.mark.parametrize("n", [1, 16, 255, 256, 257, 300, 512, 513, 1024, 2000])
def test_a_batch_is_cut_into_equal_calls_of_at_most_the_limit(n):
    parts = call_parts(n)
    sizes = [p.stop - p.start for p in parts]
    assert parts[0].start == 0 and parts[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))  # contiguous, in order
    assert max(sizes) <= MAX_CALL_IMAGES and max(sizes) - min(sizes) <= 1
    assert len(parts) == -(-n // MAX_CALL_IMAGES)  # no more calls than needed


def test_a_steady_batch_size_keeps_one_call_size():
    """Batches of 512 (two Loader batches of 256 decoded together) take two calls of 256, so the
    nvJPEG state is not re-initialised between them."""
    assert [p.stop - p.start for p in call_parts(512)] == [256, 256]
    assert [p.stop - p.start for p in call_parts(256)] == [256]
