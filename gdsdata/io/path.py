"""``LoadPath``: how a dataset's samples travel from storage to pixels, and why, as one frozen value.

``GDSDataset.load_path`` gives it; ``gdsdata doctor DATASET`` prints it; benchmarks label their
rows with ``describe()``.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPath:
    """The path a dataset's samples take.

    Attributes
    ----------
    device : str
        "cpu", or the CUDA device ("cuda:0").
    io_mode : str
        "gds" (cuFile reads into GPU memory), "compat" (kvikio's compatibility mode: host bounce
        buffers), "unavailable" (no kvikio) or "cpu".
    io_reason : str
        Why, as cuFile or the machine says it.
    reads : str
        Who reads the bytes: "preadv" (CPU path), "kvikio", "mmap" (a page gather from memory maps),
        "mixed" (per batch, one or the other), "mapped" (the GPU copies from registered pages).
    staging : str
        Where the bytes land: "host" (pinned memory on the GPU path) or "device".
    decoder : str
        Who decodes JPEGs: "libjpeg-turbo" or "nvJPEG <backend>".
    checksums : str
        Which samples have their CRC-32 checked as they load: "all", "host-staged" or "none".
    """

    device: str
    io_mode: str
    io_reason: str
    reads: str
    staging: str
    decoder: str
    checksums: str

    def describe(self) -> str:
        return (f"io={self.io_mode} reads={self.reads} staging={self.staging} "
                f"decode={self.decoder.replace(' ', ':')} checksums={self.checksums}")
