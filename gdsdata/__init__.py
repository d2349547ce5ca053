"""gdsdata: feed GPUs from disk. Pack an image folder once into aligned shards, then load it on the
GPU (cuFile/kvikio reads, nvJPEG hardware decode) or on the CPU through one Dataset API."""

__version__ = "0.1.0"

from . import settings  # noqa: E402
from .errors import (  # noqa: E402
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
    "GpuError", "GpuUnavailableError", "Loader", "OutputExistsError", "PackOptions", "SourceError", "StallError",
    "pack", "settings",
    "RandomResizedCrop", "CenterCrop", "PixelBatch", "collate", "LoadPath",
]
_LAZY = {  # name -> module; torch is imported only when these are used, so `gdsdata pack` starts fast
    "GDSDataset": "dataset", "Loader": "loader", "pack": "packer", "PackOptions": "normalize",
    "RandomResizedCrop": "transforms", "CenterCrop": "transforms", "PixelBatch": "batch", "collate": "batch",
    "LoadPath": "load_path",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'gdsdata' has no attribute {name!r}")
