"""The one place the load path is chosen: ``resolve`` turns what the machine offers (``Machine``),
what the dataset holds and the settings into a frozen ``LoadPath``: how samples travel from
storage to pixels, and why.

``GDSDataset.load_path`` gives the dataset's; ``gdsdata doctor`` prints it (for a dataset, or for
JPEG and raw datasets on this machine); the GPU backend builds its reader and decoder from it.

The automatic choices:
- GPUDirect Storage: kvikio reads into GPU staging, nvJPEG decodes from there (``hardware_device``):
  no host copy at all.
- kvikio's compatibility mode (no GDS): JPEG bitstreams stage in pinned host memory, read per batch
  by the page gather (many small reads) or kvikio (a few large ones): the ``mixed`` engine; nvJPEG's
  hardware backend takes them from there. Raw datasets that fit in half the host's memory stage on
  the GPU, copied from registered page-cache pages by the GPU (``mapped``; kvikio if CUDA refuses to
  register them).
- No kvikio: the page gather into pinned staging.
- A GPU without JPEG engines: nvJPEG's CUDA backend (``gpu_hybrid``).
"""

import functools
import os
from dataclasses import dataclass, field

from gdsdata.errors import GpuUnavailableError


@dataclass(frozen=True)
class Machine:
    """What a machine offers the GPU path.

    Attributes
    ----------
    device : str
        The CUDA device ("cuda:0").
    io_mode : str
        "gds", "compat" (kvikio's compatibility mode) or "unavailable" (no kvikio).
    io_reason : str
        Why, as cuFile or the machine says it.
    jpeg_engines : bool
        Whether the GPU has nvJPEG's hardware decode engines.
    batched_copy : str
        The driver's batched copy entry point ("cuMemcpyBatchAsync_v2"), or "" without one.
    host_memory : int
        Bytes of host memory.
    cupy : bool
        Whether cupy is installed (the ``mapped`` engine registers pages through it).
    triton : bool
        Whether Triton is installed (the CRC-32 kernel that checks GPU staging, ``io.checksums``).
    """

    device: str
    io_mode: str
    io_reason: str
    jpeg_engines: bool
    batched_copy: str
    host_memory: int
    cupy: bool
    triton: bool = True


@functools.lru_cache(maxsize=None)
def checksum_kernel() -> bool:
    """Whether the GPU's CRC-32 kernel can run here (``io.checksums`` imports: Triton is installed)."""
    try:
        import gdsdata.io.checksums  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def probe_machine(device_index: int) -> Machine:
    """Probe the machine once per device and process (creating a hardware decoder tells whether
    the GPU has JPEG engines)."""
    from gdsdata._native.cuda import entry_point
    from gdsdata._native.nvjpeg import BatchedDecoder, NvjpegError
    from gdsdata.commands.doctor import io_mode

    import torch

    mode, reason = io_mode()
    try:
        with torch.cuda.device(device_index):
            BatchedDecoder("hardware").close()
        engines = True
    except (NvjpegError, GpuUnavailableError):  # no engines, or an nvJPEG that cannot drive them safely
        engines = False
    try:
        import cupy  # noqa: F401
        have_cupy = True
    except ImportError:
        have_cupy = False
    return Machine(f"cuda:{device_index}", mode, reason, engines, entry_point() or "",
                   host_memory(), have_cupy, checksum_kernel())


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
        "mixed" (per batch, one or the other), "mapped" (the GPU copies from registered pages),
        "direct" (O_DIRECT past the page cache: datasets larger than memory; ``io.direct``).
    staging : str
        Where the bytes land: "host" (pinned memory on the GPU path) or "device".
    decoder : str
        Who decodes JPEGs: "libjpeg-turbo" or "nvJPEG <backend>".
    checksums : str
        Where every sample's CRC-32 is checked as it loads: "host" (in host memory: the CPU path,
        pinned staging), "gpu" (GPU staging: a CRC-32 kernel) or "none".
    copy : str
        How ``mapped`` reads move: "dma" (the copy engines) or "gather" (the SMs); "" otherwise.
    fallback : str
        The engine that takes over if CUDA cannot register the shards of an automatic ``mapped``.
    why : tuple of str
        One line per decision, in the order taken.
    past_cache : bool
        (A property.) Whether the reads bypass the page cache: ``direct``, or cuFile with GDS.
    """

    device: str
    io_mode: str
    io_reason: str
    reads: str
    staging: str
    decoder: str
    checksums: str
    copy: str = ""
    fallback: str = ""
    why: tuple = field(default=(), compare=False)

    @property
    def backend(self) -> str:
        """The nvJPEG backend ("hardware_device", ...), or "" on the CPU path."""
        return self.decoder.split(" ", 1)[1] if self.decoder.startswith("nvJPEG ") else ""

    @property
    def past_cache(self) -> bool:
        """Whether reads bypass the page cache (``direct``, or cuFile with GDS): every byte they
        cover, holes included, comes from the drive."""
        return self.reads == "direct" or (self.reads == "kvikio" and self.io_mode == "gds")

    def describe(self) -> str:
        """The path in one line, as the bench and ``doctor`` print it, e.g.
        ``io=compat reads=mixed staging=host decode=nvJPEG:hardware checksums=host``."""
        reads = f"{self.reads}:{self.copy}" if self.copy else self.reads
        return (f"io={self.io_mode} reads={reads} staging={self.staging} "
                f"decode={self.decoder.replace(' ', ':')} checksums={self.checksums}")


def host_memory() -> int:
    """Bytes of memory this process may use: the host's, or its cgroup's limit where lower (a
    container's page cache counts against that limit)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            memory = min(memory, int(value))
    return memory


def _streams(shard_bytes: int, memory: int) -> bool:
    """Whether a dataset is read past the page cache when the engine is automatic: its shards are
    more than half the host's memory, so an epoch could not stay cached beside the training process."""
    return shard_bytes > memory // 2


def _stream_why(shard_bytes: int, memory: int) -> str:
    return (f"reads direct: the shards ({shard_bytes / 2**30:.1f} GiB) are more than half the host's memory "
            f"({memory / 2**30:.1f} GiB): O_DIRECT reads past the page cache")


def cpu_path(verify, config=None, shard_bytes: int = 0, memory: int = None) -> LoadPath:
    """The CPU path: preadv into host memory (``direct``: past the page cache, for ``io_engine=direct``
    or, automatically, shards larger than half the host's memory), libjpeg-turbo; checksums on every
    sample unless off. Other ``io_engine`` choices are the GPU path's and leave it as it is."""
    engine = "auto" if config is None else config["io_engine"]
    memory = host_memory() if memory is None else memory
    if engine == "direct":
        reads, why = "direct", ("reads direct: the io_engine setting (GDSDATA_IO_ENGINE)",)
    elif engine == "auto" and _streams(shard_bytes, memory):
        reads, why = "direct", (_stream_why(shard_bytes, memory),)
    elif engine == "auto":
        reads, why = "preadv", ("reads preadv: the page cache keeps the shards for the next epoch",)
    else:  # a GPU path's engine: the CPU path reads through the page cache, as that engine would
        reads, why = "preadv", (f"reads preadv: io_engine={engine} is a GPU path's engine; the CPU path reads "
                                f"through the page cache with preadv",)
    forced = [f"{name}={config[name]}" for name in ("staging", "decode_backend")
              if config is not None and config.get(name, "auto") != "auto"]
    if forced:  # said where the path is shown (doctor), not left to look as if they were followed
        why += (f"{' and '.join(forced)}: the GPU path's setting{'s' if len(forced) > 1 else ''}; the CPU path "
                f"stages in host memory and decodes with libjpeg-turbo",)
    return LoadPath("cpu", "cpu", "the CPU path", reads, "host", "libjpeg-turbo", "host" if verify else "none",
                    why=why)


def resolve(machine: Machine, config, *, all_raw: bool, shard_bytes: int, verify=True) -> LoadPath:
    """The GPU path for a dataset on ``machine`` under the settings ``config`` (a mapping: the
    dataset's snapshot of ``gdsdata.settings``).

    Parameters
    ----------
    machine : Machine
        What the machine offers (``probe_machine``).
    config : Mapping
        ``staging``, ``io_engine`` and ``decode_backend``: "auto" or a forced choice.
    all_raw : bool
        Whether every sample of the dataset is raw pixels (nothing for nvJPEG to decode).
    shard_bytes : int
        The size of the dataset's shards together.
    verify : bool or "always"
        ``True`` (the default setting): check every sample's CRC-32 where its bytes are, in host
        memory (pinned staging) or on the GPU (GPU staging: a CRC-32 kernel, where Triton is
        installed); ``"always"``: also without Triton, through a copy to the host; ``False``: never.

    Raises
    ------
    ValueError
        For forced settings that cannot go together (one line naming them).
    GpuUnavailableError
        For a forced choice the machine does not have.
    """
    staging, engine, family = config["staging"], config["io_engine"], config["decode_backend"]
    why = []
    if engine in ("mmap", "mixed", "direct") and staging == "device":
        raise ValueError(f"io_engine={engine} reads into host memory only; device staging needs kvikio or mapped")
    if engine == "mapped" and staging == "host":
        raise ValueError("io_engine=mapped gathers into GPU memory only; it needs staging=device")
    if engine in ("kvikio", "mixed") and machine.io_mode == "unavailable":
        raise GpuUnavailableError(f"io_engine={engine} needs kvikio: {machine.io_reason}")
    if engine == "mapped" and not machine.cupy:
        raise GpuUnavailableError("io_engine=mapped needs cupy (pip install cupy-cuda13x or cupy-cuda12x)")
    fits = not _streams(shard_bytes, machine.host_memory)
    prefer_mapped = (machine.io_mode == "compat" and engine == "auto" and staging != "host" and all_raw
                     and fits and machine.cupy)

    if staging == "auto":
        if engine in ("mmap", "mixed", "direct"):
            staging = "host"
            why.append(f"staging host (pinned): io_engine={engine} reads into host memory")
        elif machine.io_mode == "gds":
            staging = "device"
            why.append("staging device: GPUDirect Storage reads straight into GPU memory")
        elif engine == "mapped":
            staging = "device"
            why.append("staging device: io_engine=mapped copies into GPU memory")
        elif prefer_mapped:
            staging = "device"
            why.append("staging device: raw pixels that fit in half the host's memory, copied by the GPU "
                       "from registered page-cache pages")
        else:
            staging = "host"
            why.append("staging host (pinned): without GPUDirect Storage, bitstreams decode from pinned memory"
                       if machine.io_mode == "compat" else "staging host (pinned): kvikio is not installed")
    else:
        why.append(f"staging {staging}: the staging setting (GDSDATA_STAGING)")

    fallback = ""
    if engine == "auto":
        if staging == "host" and not fits:
            engine = "direct"
            why.append(_stream_why(shard_bytes, machine.host_memory))
        elif staging == "host":
            engine = {"unavailable": "mmap", "compat": "mixed"}.get(machine.io_mode, "kvikio")
            why.append({"mmap": "reads mmap: the page gather (no kvikio)",
                        "mixed": "reads mixed: many small reads through the page gather, a few large ones "
                                 "through kvikio",
                        "kvikio": "reads kvikio"}[engine])
        elif prefer_mapped:
            engine, fallback = "mapped", "kvikio"
            why.append("reads mapped (kvikio if CUDA cannot register the shards)")
        else:
            if machine.io_mode == "unavailable":
                raise GpuUnavailableError(f"staging=device needs kvikio or io_engine=mapped: {machine.io_reason}")
            engine = "kvikio"
            why.append("reads kvikio into GPU memory")
    else:
        why.append(f"reads {engine}: the io_engine setting (GDSDATA_IO_ENGINE)")
    copy = ("dma" if machine.batched_copy else "gather") if engine == "mapped" else ""
    if copy == "dma":
        why.append(f"mapped copies: the copy engines ({machine.batched_copy})")
    elif copy == "gather":
        why.append("mapped copies: the SMs gather (no batched copy in this driver)")

    if family == "auto":
        family = "hardware" if machine.jpeg_engines else "gpu_hybrid"
        why.append("decode: nvJPEG's hardware engines" if machine.jpeg_engines else
                   "decode: nvJPEG on CUDA cores (this GPU has no JPEG engines)")
    else:
        if family == "hardware" and not machine.jpeg_engines:
            raise GpuUnavailableError("decode_backend=hardware: this GPU has no JPEG hardware engines")
        why.append(f"decode: {family}: the decode_backend setting (GDSDATA_DECODE_BACKEND)")
    backend = family + ("_device" if staging == "device" else "")

    if verify and staging == "host":
        checksums = "host"
    elif verify == "always" or (verify and machine.triton):
        checksums = "gpu"
        why.append("checksums: on the GPU, where GPU staging holds the bytes (a CRC-32 kernel)" if machine.triton
                   else "checksums: GPU staging copied to the host for them (Triton is not installed)")
    else:
        checksums = "none"
        if verify:
            why.append("checksums: none on GPU staging (Triton is not installed, and the bytes never pass "
                       "a CPU; GDSDataset(verify_checksums=True) checks them through a copy to the host)")
    return LoadPath(machine.device, machine.io_mode, machine.io_reason, engine, staging, f"nvJPEG {backend}",
                    checksums, copy, fallback, tuple(why))
