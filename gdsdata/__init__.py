"""gdsdata: feed GPUs from disk. Pack an image folder once into aligned shards, then load it on the
GPU (cuFile/kvikio reads, nvJPEG hardware decode) or on the CPU through one Dataset API."""

__version__ = "0.1.0"

from . import settings  # noqa: E402
from .errors import (  # noqa: E402
    BadImageError,
    CorruptSampleError,
    FormatError,
    GdsDataError,
    GpuUnavailableError,
    OutputExistsError,
    SourceError,
)

__all__ = [
    "BadImageError", "CorruptSampleError", "FormatError", "GDSDataset", "GdsDataError",
    "GpuUnavailableError", "OutputExistsError", "PackOptions", "SourceError", "pack", "settings",
]


def __getattr__(name):
    # torch is imported only when the Dataset is used, so `gdsdata pack` starts quickly.
    if name == "GDSDataset":
        from .dataset import GDSDataset

        return GDSDataset
    if name == "pack":
        from .pack import pack

        return pack
    if name == "PackOptions":
        from .normalize import PackOptions

        return PackOptions
    raise AttributeError(f"module 'gdsdata' has no attribute {name!r}")
