"""How the nvJPEG handle is created (CPU test: a stand-in library records the calls). The hardware
backends are never created with nvJPEG's pipeline on: pipelined, the decoder hung beside training."""

import ctypes

import pytest

from gdsdata._native import nvjpeg
from gdsdata.errors import GpuUnavailableError


class FakeLibrary:
    path = "libnvjpeg-stand-in.so"

    def __init__(self, accepts):
        self.accepts = accepts  # flags value -> status
        self.created, self.destroyed = [], 0

    def nvjpegCreateEx(self, backend, dev_alloc, pinned_alloc, flags, handle):
        self.created.append((backend, flags))
        return self.accepts(backend, flags)

    def nvjpegDestroy(self, handle):
        self.destroyed += 1
        return 0


def create(backend, accepts):
    decoder = nvjpeg.BatchedDecoder.__new__(nvjpeg.BatchedDecoder)
    decoder.lib, decoder.handle = FakeLibrary(accepts), ctypes.c_void_p()
    interpolated = decoder._create(backend)
    return decoder.lib, interpolated


@pytest.mark.parametrize("backend", ["hardware", "hardware_device"])
def test_hardware_handles_are_created_with_the_pipeline_off(backend):
    lib, interpolated = create(backend, lambda b, flags: 0)
    (_, flags), = lib.created
    assert flags & nvjpeg.FLAG_HW_DECODE_NO_PIPELINE
    assert flags & nvjpeg.FLAG_ENABLE_MEMORY_POOLS and interpolated


def test_optional_flags_are_dropped_but_never_the_pipeline_flag():
    lib, interpolated = create("hardware", lambda b, flags: 0 if flags == nvjpeg.FLAG_HW_DECODE_NO_PIPELINE else 2)
    assert not interpolated
    assert all(flags & nvjpeg.FLAG_HW_DECODE_NO_PIPELINE for _, flags in lib.created)


def test_a_library_that_only_pipelines_is_refused_with_a_clear_error():
    with pytest.raises(GpuUnavailableError, match="NO_PIPELINE"):
        create("hardware", lambda b, flags: 0 if flags == 0 else 2)


def test_a_gpu_without_engines_is_an_nvjpeg_error():
    """What the automatic choice takes as 'no hardware decoder' (then the CUDA backend)."""
    with pytest.raises(nvjpeg.NvjpegError):
        create("hardware", lambda b, flags: 9)


def test_cuda_backends_take_no_pipeline_flag():
    lib, _ = create("gpu_hybrid", lambda b, flags: 0)
    (_, flags), = lib.created
    assert not flags & nvjpeg.FLAG_HW_DECODE_NO_PIPELINE
