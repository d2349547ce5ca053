"""JPEG header probing: what qualifies for the GPU engines, and why not."""

import pytest
from conftest import jpeg_bytes, photo

from gdsdata.format import layout as fmt
from gdsdata.packing.jpeg import NotJpeg, probe


@pytest.mark.parametrize("subsampling, expected", [(0, fmt.SUBSAMPLING_444), (1, fmt.SUBSAMPLING_422),
                                                   (2, fmt.SUBSAMPLING_420)])
def test_baseline_qualifies(subsampling, expected):
    image = photo(1)
    info = probe(jpeg_bytes(image, quality=80, subsampling=subsampling))
    assert info.gpu_ready and info.reason == ""
    assert (info.width, info.height, info.components, info.subsampling) == (*image.size, 3, expected)


def test_gray_qualifies():
    info = probe(jpeg_bytes(photo(2).convert("L")))
    assert info.gpu_ready and info.components == 1 and info.subsampling == fmt.SUBSAMPLING_GRAY


def test_progressive_and_cmyk_do_not():
    progressive = probe(jpeg_bytes(photo(3), progressive=True))
    assert not progressive.gpu_ready and "progressive" in progressive.reason
    cmyk = probe(jpeg_bytes(photo(3).convert("CMYK")))
    assert not cmyk.gpu_ready and "4 components" in cmyk.reason


def test_restart_markers_and_stuffed_bytes_are_walked():
    info = probe(jpeg_bytes(photo(4), quality=100, restart_marker_blocks=1))
    assert info.gpu_ready


@pytest.mark.parametrize("data, message", [
    (b"", "start-of-image"),
    (b"\x89PNG\r\n", "start-of-image"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF", "runs past the end"),
])
def test_malformed_streams(data, message):
    with pytest.raises(NotJpeg, match=message):
        probe(data)


def test_truncated_entropy_data():
    data = jpeg_bytes(photo(5))
    with pytest.raises(NotJpeg, match="truncated|end"):
        probe(data[: len(data) // 2])
