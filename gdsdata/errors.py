"""The exceptions gdsdata raises. Each message names the file or sample and the reason."""


class GdsDataError(Exception):
    """Base class of every error gdsdata raises on purpose."""


class SourceError(GdsDataError):
    """The folder to pack is missing, empty or not an ImageFolder tree."""


class OutputExistsError(GdsDataError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


class FormatError(GdsDataError):
    """An index or shard file is truncated, foreign, of an unknown version or inconsistent."""


class CorruptSampleError(GdsDataError):
    """A stored sample fails its checksum or cannot be decoded."""


class SourceGoneError(SourceError):
    """The source's storage stopped answering while a pack read it (a dropped mount, a network down):
    not one file's fault, so the pack stops (resumable) rather than skip every file after it.
    ``what``: the file and the error; ``then``: what was kept and what to run, where known."""

    def __init__(self, what: str, then: str = None):
        super().__init__(what, then)
        self.what, self.then = what, then

    def __str__(self):
        return self.what if self.then is None else f"{self.what}; {self.then}"


class BadImageError(GdsDataError):
    """A source image cannot be packed (empty, truncated, not an image); packing skips it."""


class GpuUnavailableError(GdsDataError):
    """The GPU path was asked for but CUDA, kvikio, cupy or nvJPEG is missing (an install matter)."""


class GpuError(GdsDataError):
    """A CUDA or nvJPEG call failed while running (``NvjpegError`` is one)."""


class StallError(GdsDataError):
    """A Loader stage made no progress within the ``stall_timeout`` setting (a hung read or decode)."""


class BusyError(GdsDataError):
    """Another gdsdata process is writing the same dataset folder (one writer at a time)."""


class LockLost(BusyError):
    """A writer's lock file was removed or replaced while it wrote (``format.lock.lost``): another
    writer may have started on the same folder, so this one commits nothing and removes nothing."""

    def __init__(self, out, path, then: str):
        super().__init__(f"{out}: its lock file {path} was removed or replaced while this ran, so another "
                         f"gdsdata writer may have started on it; {then}")


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the ``gdsdata`` command (``timeout``, Slurm, ``docker stop``): it unwinds as
    Ctrl-C does (finished shards kept for ``--resume``, the rest removed), and exits 143."""


def install_hint(extra: str) -> str:
    """``pip install ...`` for one of gdsdata's extras, as its packages (gdsdata's own metadata's
    list): ``pip install 'gdsdata[cu13]'`` finds nothing where gdsdata came from a checkout. For
    ``gpu``, the CUDA extra of torch's major (cu13 where torch has none of 12 and 13)."""
    import re
    from importlib import metadata

    if extra == "gpu":
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        if major in ("12", "13"):
            extra, said = f"cu{major}", f"[cu{major}] extra, for this CUDA {major} torch"
        else:
            extra, said = "cu13", "[cu13] extra, for a CUDA 13 torch, or [cu12] for CUDA 12"
    else:
        said = f"[{extra}] extra"
    try:
        wanted = [r.split(";")[0].strip() for r in metadata.requires("gdsdata") or ()
                  if re.search(rf"""extra\s*==\s*["']{extra}["']""", r)]
    except metadata.PackageNotFoundError:  # (gdsdata imported from a tree that pip did not install)
        wanted = []
    if not wanted:  # (a source tree: its pyproject.toml names them)
        return f"pip install -e '.[{extra}]' in gdsdata's source tree (its {said})"
    return "pip install " + " ".join(f"'{w}'" for w in wanted) + f" (gdsdata's {said})"
