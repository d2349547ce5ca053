"""How the nvJPEG handle is created and a batch's crop windows set (CPU test: a stand-in library
records the calls). The hardware backends are never created with nvJPEG's pipeline on: pipelined,
the decoder hung beside training."""

import ctypes

import numpy as np
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


class WindowLibrary:
    """nvJPEG's decode-parameter calls, recorded."""

    path, windows = "libnvjpeg (fake)", True

    def __init__(self):
        self.params, self.rois, self.destroyed = [], [], []

    def nvjpegDecodeParamsCreate(self, handle, out):
        self.params.append(1000 + len(self.params))
        out._obj.value = self.params[-1]
        return 0

    def nvjpegDecodeParamsSetOutputFormat(self, params, fmt):
        assert fmt == nvjpeg.OUTPUT_RGBI
        return 0

    def nvjpegDecodeParamsSetROI(self, params, x, y, width, height):
        self.rois.append((params, x, y, width, height))
        return 0

    def nvjpegDecodeParamsDestroy(self, params):
        self.destroyed.append(params)

    def nvjpegJpegStateDestroy(self, state):
        pass

    def nvjpegDestroy(self, handle):
        pass


def test_crop_windows_are_set_per_image_on_parameters_made_once():
    """Each image's window goes to nvJPEG as (x, y, width, height) on a parameter handle of its own,
    created at the first batch that needs it, reused by later batches and destroyed with the decoder."""
    decoder = nvjpeg.BatchedDecoder.__new__(nvjpeg.BatchedDecoder)
    decoder.lib, decoder.handle, decoder.state = WindowLibrary(), ctypes.c_void_p(1), ctypes.c_void_p()
    decoder.backend, decoder.windows, decoder._params = "hardware", True, np.zeros(0, np.uint64)
    first = decoder._window_params([[10, 20, 30, 40], [1, 2, 3, 4]])  # (top, left, height, width)
    assert first.tolist() == [1000, 1001]
    assert decoder.lib.rois == [(1000, 20, 10, 40, 30), (1001, 2, 1, 4, 3)]
    again = decoder._window_params([[5, 6, 7, 8]])
    assert again.tolist() == [1000] and len(decoder.lib.params) == 2
    decoder.close()
    assert decoder.lib.destroyed == [1000, 1001]
    decoder.windows = False
    with pytest.raises(ValueError, match="whole images only"):
        decoder._window_params([[0, 0, 1, 1]])
