"""``gdsdata doctor``: what this machine offers the data path. Every benchmark prints it first.

Reports the GPU, driver and CUDA, kvikio and whether cuFile runs GPUDirect Storage or kvikio's
compatibility mode (and why), nvJPEG and its hardware engines, and the thread counts gdsdata uses.
"""

import os
import platform

from gdsdata import __version__
from gdsdata import settings


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
        return "unavailable", f"kvikio not installed ({e.name}); pip install 'gdsdata[cu12]' or '[cu13]'"
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


def _nvjpeg_block():
    try:
        from gdsdata._native.nvjpeg import library_info
    except ImportError as e:
        return {"nvjpeg": f"unavailable ({e})"}
    try:
        return library_info()
    except Exception as e:  # noqa: BLE001 - doctor reports, never fails
        return {"nvjpeg": f"unavailable ({e})"}


def mapped_copy() -> str:
    """How the ``mapped`` engine moves bytes here (``mapped_copy``), in words."""
    from gdsdata._native.cuda import entry_point
    from gdsdata.io.gpu import mapped_copy as resolved

    if resolved() == "dma":
        return f"the copy engines ({entry_point() or 'cuMemcpyBatchAsync: missing from this driver'})"
    return "the SMs gather"


def auto_reads(mode: str) -> str:
    """What ``io_engine=auto`` does in I/O mode ``mode`` (with ``staging=auto``), in words."""
    if mode == "gds":
        return "kvikio into GPU memory"
    if mode == "compat":
        from gdsdata.io.gpu import mapped_limit

        return (f"raw datasets up to {mapped_limit() / 1e9:.0f} GB: GPU staging, {mapped_copy()} from registered "
                f"page-cache pages; others: pinned staging, page gather or kvikio per batch")
    return "page gather into pinned staging"


def report() -> dict:
    info = {
        "gdsdata": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu cores": os.cpu_count(),
    }
    info.update(_torch_block())
    if "gpu" in info and not str(info["gpu"]).startswith("none"):
        info.update(_kvikio_block())
        info.update(_nvjpeg_block())
    info["cpu decode threads"] = settings.get("cpu_threads")
    info["io threads"] = settings.get("io_threads")
    info["io engine"] = settings.get("io_engine")
    if info["io engine"] == "auto" and "io mode" in info:
        info["io engine"] = f"auto ({auto_reads(info['io mode'].split(':')[0])})"
    info["staging"] = settings.get("staging")
    info["decode backend"] = settings.get("decode_backend")
    return info
