"""``gdsdata doctor``: what this machine offers the data path. Every benchmark prints it first.

Reports the GPU, driver and CUDA, kvikio and whether cuFile runs GPUDirect Storage or kvikio's
compatibility mode (and why), nvJPEG and its hardware engines, and the thread counts gdsdata uses.
"""

import os
import platform
from dataclasses import asdict

from gdsdata import __version__
from gdsdata import settings
from gdsdata.errors import GdsDataError, install_hint
from gdsdata.io.path import host_memory


def _torch_block():
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    info = {"torch": torch.__version__}
    if not torch.cuda.is_available():
        info["gpu"] = "none (CPU path)"
        return info
    props = torch.cuda.get_device_properties(0)
    info["gpu"] = f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    info["cuda runtime (torch)"] = torch.version.cuda
    queues, why = settings.cuda_queues()
    info["cuda work queues"] = f"{queues} ({why})"
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - the driver version is informative only
        pass
    return info


def io_mode():
    """(mode, reason): how kvikio reads on this machine: "gds", "compat" or "unavailable"."""
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except ImportError as e:
        return "unavailable", f"kvikio not installed ({e.name}); {install_hint('gpu')}"
    if kvikio.defaults.is_compat_mode_preferred():
        try:
            gds = bool(kvikio.cufile_driver.get("is_gds_available"))
        except Exception:  # noqa: BLE001 - older drivers lack the property
            gds = False
        why = ("cuFile reports GDS unavailable (no nvidia_fs kernel module or unsupported filesystem)"
               if not gds else "KVIKIO_COMPAT_MODE asks for it")
        return "compat", why
    return "gds", "cuFile GPUDirect Storage driver is available"


def _kvikio_block():
    info = {}
    try:
        import kvikio

        info["kvikio"] = kvikio.__version__
    except ImportError:
        info["kvikio"] = "not installed"
    mode, why = io_mode()
    info["io mode"] = f"{mode}: {why}"
    return info


# the GPU path's packages, one per CUDA major (pyproject's cu12 / cu13 extras)
_GPU_PACKAGES = {"kvikio": ("kvikio-cu13", "kvikio-cu12"), "cupy": ("cupy-cuda13x", "cupy-cuda12x"),
                 "nvjpeg": ("nvidia-nvjpeg", "nvidia-nvjpeg-cu12")}


def _gpu_packages() -> str:
    """Which of the GPU path's packages are installed (their distributions' versions)."""
    from importlib import metadata

    found = []
    for name, distributions in _GPU_PACKAGES.items():
        versions = []
        for distribution in distributions:
            try:
                versions.append(f"{distribution} {metadata.version(distribution)}")
            except metadata.PackageNotFoundError:
                pass
        found.append(", ".join(versions) if versions else f"{name} not installed")
    missing = any("not installed" in line for line in found)
    return "; ".join(found) + (f", for a GPU: {install_hint('gpu')}" if missing else "")


def _nvjpeg_block():
    try:
        from gdsdata._native.nvjpeg import library_info
    except ImportError as e:
        return {"nvjpeg": f"unavailable ({e})"}
    try:
        return library_info()
    except Exception as e:  # noqa: BLE001 - doctor reports, never fails
        return {"nvjpeg": f"unavailable ({e})"}


def path_fields(path, prefix="  ") -> dict:
    """A ``LoadPath`` as report lines: its fields, then one line per decision."""
    fields = {f"{prefix}{k.replace('_', ' ')}": v for k, v in asdict(path).items() if k != "why" and v != ""}
    fields.update({f"{prefix}why {k + 1}": line for k, line in enumerate(path.why)})
    return fields


def automatic_paths() -> dict:
    """What the settings choose on this machine for a JPEG dataset and a raw one that fit in
    memory, and for one larger than half of it (``gdsdata.io.path.resolve``, the resolver datasets
    use)."""
    import torch

    from gdsdata.io.path import probe_machine, resolve

    try:
        machine = probe_machine(torch.cuda.current_device())
    except GdsDataError as e:  # doctor reports, never fails
        return {"path": f"unavailable ({e})"}
    info = {}
    for kind, raw, size in (("JPEG", False, 0), ("raw", True, 0), ("over half the memory", False, machine.host_memory)):
        try:
            info[f"path ({kind} datasets)"] = resolve(machine, settings.snapshot(), all_raw=raw,
                                                      shard_bytes=size).describe()
        except (ValueError, GdsDataError) as e:
            info[f"path ({kind} datasets)"] = f"refused: {e}"
    return info


def _cores() -> str | int:
    """The cores this process may use, and the machine's where it may use fewer (a cpuset)."""
    usable, machine = settings.usable_cores(), os.cpu_count() or 1
    return usable if usable == machine else f"{usable} of {machine} (this process's CPU affinity)"


def report() -> dict:
    info = {
        "gdsdata": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu cores": _cores(),
    }
    info.update(_torch_block())
    if "gpu" in info and not str(info["gpu"]).startswith("none"):
        info.update(_kvikio_block())
        info.update(_nvjpeg_block())
    else:  # what the GPU path would need here, found without loading any CUDA library
        info["gpu packages"] = _gpu_packages()
    info["cpu decode threads"] = settings.get("cpu_threads")
    info["io threads"] = settings.get("io_threads")
    info["gather threads"] = settings.get("gather_threads")
    for name in ("staging", "io_engine", "decode_backend"):
        info[name.replace("_", " ")] = settings.get(name)
    engine = settings.get("io_engine")
    if engine == "direct":
        info["streaming"] = "every dataset is read past the page cache (the io_engine setting: direct)"
    elif engine != "auto":
        info["streaming"] = f"the io_engine setting ({engine}) picks every dataset's reads, whatever its size"
    else:
        info["streaming"] = (f"datasets whose shards exceed {host_memory() / 2 / 2**30:.1f} GiB (half the host's "
                             f"memory) are read past the page cache (reads=direct)")
    if "io mode" in info:
        info.update(automatic_paths())
    return info
