"""gdsdata: feed GPUs from disk. Pack an image folder once into aligned shards, then load it on the
GPU (cuFile/kvikio reads, nvJPEG hardware decode) or on the CPU through one Dataset API."""

__version__ = "0.1.0"

from gdsdata import settings  # noqa: E402

settings.claim_cuda_queues()  # before CUDA starts: see settings
from gdsdata.errors import (  # noqa: E402
    BadImageError,
    BusyError,
    CorruptSampleError,
    FormatError,
    GdsDataError,
    GpuError,
    GpuUnavailableError,
    OutputExistsError,
    SourceError,
    StallError,
)

__all__ = [
    "BadImageError", "BusyError", "CorruptSampleError", "FormatError", "GDSDataset", "GdsDataError",
    "GpuError", "GpuUnavailableError", "Loader", "OutputExistsError", "PackOptions", "PackResult", "SourceError",
    "StallError",
    "pack", "merge", "verify", "info", "settings",
    "RandomResizedCrop", "CenterCrop", "YoloAugment", "Letterbox", "PixelBatch", "collate", "LoadPath",
]
_LAZY = {  # name -> module; torch is imported only when these are used, so `gdsdata pack` starts fast
    "GDSDataset": "dataset", "Loader": "loader", "pack": "packing.packer", "PackResult": "packing.packer",
    "PackOptions": "packing.prepare",
    "RandomResizedCrop": "transforms", "CenterCrop": "transforms", "YoloAugment": "transforms.detection",
    "Letterbox": "transforms.detection", "PixelBatch": "batch", "collate": "batch",
    "LoadPath": "io.path", "merge": "packing.merge", "verify": "commands.verify", "info": "commands.info",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'gdsdata' has no attribute {name!r}")
