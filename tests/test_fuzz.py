"""Fuzzing: mutated index, shard and image bytes get the project's own errors, never a crash or
another exception. GDSDATA_FUZZ_EXAMPLES sets the examples per target (CI: 200; `make fuzz`: 25,000
per target, 100,000 in all)."""

import os
import shutil

import numpy as np
import pytest
from conftest import jpeg_bytes, photo, png_bytes, resealed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io
from gdsdata.errors import BadImageError, FormatError
from gdsdata.packing.jpeg import NotJpeg, probe
from gdsdata.packing.prepare import PackOptions, prepare
from gdsdata.format.shards import read_header

EXAMPLES = int(os.environ.get("GDSDATA_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden", "ds")


@st.composite
def mutated(draw, seed: bytes):
    """Seed bytes with random flips, overwrites, truncation, insertion or extension."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "extend", "zero"]))
        if not data:
            data += draw(st.binary(min_size=1, max_size=64))
            continue
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "extend":
            data += draw(st.binary(min_size=1, max_size=256))
        else:
            data[at:at + 16] = bytes(len(data[at:at + 16]))
    return bytes(data)


@pytest.fixture(scope="module")
def golden_copy(tmp_path_factory):
    target = tmp_path_factory.mktemp("fuzz") / "ds"
    shutil.copytree(GOLDEN, target)
    return target


def _with_crc(data: bytes) -> bytes:
    """The same bytes with the checksums recomputed, so the structural checks behind them run."""
    return resealed(data)


INDEX_SEED = open(os.path.join(GOLDEN, fmt.INDEX_NAME), "rb").read()


@FUZZ
@given(data=mutated(INDEX_SEED), fix_crc=st.booleans())
def test_index_parser(golden_copy, data, fix_crc):
    (golden_copy / fmt.INDEX_NAME).write_bytes(_with_crc(data) if fix_crc else data)
    try:
        index = index_io.load(golden_copy)
    except FormatError:
        return
    for i in range(len(index)):
        index.describe(i)  # what error messages use must work on anything load accepted


SHARD_SEED = open(os.path.join(GOLDEN, fmt.shard_name(0)), "rb").read(fmt.SHARD_HEADER.itemsize)


@FUZZ
@given(data=mutated(SHARD_SEED))
def test_shard_header_parser(tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "fuzz-shard.gds"
    path.write_bytes(data)
    header = np.frombuffer(SHARD_SEED, fmt.SHARD_HEADER)[0]
    try:
        read_header(str(path), int(header["shard_index"]), bytes(header["dataset_id"]), int(header["alignment"]))
    except FormatError:
        pass


JPEG_SEED = jpeg_bytes(photo(5, scale=0.15), quality=80)
PNG_SEED = png_bytes(photo(6, scale=0.15).convert("RGBA"))


@FUZZ
@given(data=mutated(JPEG_SEED))
def test_jpeg_probe(data):
    try:
        probe(data)
    except NotJpeg:
        pass


@FUZZ
@given(data=st.one_of(mutated(JPEG_SEED), mutated(PNG_SEED)), codec=st.sampled_from(["jpeg", "raw"]))
def test_packer_on_mutated_images(data, codec):
    import simplejpeg

    try:
        prepared = prepare(data, PackOptions(codec=codec))
    except BadImageError:
        return
    if prepared.codec == fmt.CODEC_JPEG:  # whatever is stored decodes, at the recorded size
        pixels = simplejpeg.decode_jpeg(prepared.payload, colorspace="RGB", strict=True)
        assert pixels.shape[:2] == (prepared.height, prepared.width)
        assert probe(prepared.payload).gpu_ready
    else:
        assert len(prepared.payload) == prepared.width * prepared.height * prepared.components
