"""Runtime knobs: one settings object, read from ``GDSDATA_*`` environment variables, scoped overrides.

    import gdsdata
    gdsdata.settings.get("cpu_threads")
    with gdsdata.settings.set(cpu_threads=4, max_gap=0):
        ...

Three settings choose the GPU path, one per decision (``auto`` lets ``gdsdata.io.path.resolve``
decide from the machine and the dataset; ``GDSDataset.load_path`` says what it chose and why):
``staging`` (where the bytes land), ``io_engine`` (who reads them), ``decode_backend`` (which nvJPEG
backend decodes them). The others size or bound the work.

A dataset takes a snapshot of the settings when it is built: changing them later does not touch a
dataset already open. ``cpu_threads`` sizes the process's one CPU pool (read whenever the pool is
made) and ``stall_timeout`` is read as each Loader pass and each pack starts.

| name | variable | default | meaning |
| --- | --- | --- | --- |
| cpu_threads | GDSDATA_CPU_THREADS | cores | threads decoding JPEGs and resampling on the CPU |
| io_threads | GDSDATA_IO_THREADS | 16 | threads of kvikio's reads (GPU path) |
| direct_depth | GDSDATA_DIRECT_DEPTH | 64 | direct reads (``io_engine=direct``) in flight at once: the requests the |
| | | | drive's queue holds; a batch's reads are cut into at least this many pieces |
| direct_ahead | GDSDATA_DIRECT_AHEAD | 134217728 | bytes of direct reads a Loader keeps in flight: it reads as |
| | | | many batches at once as that takes (2 to 8), so the drive's queue never drains between batches |
| gather_threads | GDSDATA_GATHER_THREADS | min(8, cores) | threads of the page gather (``mmap``, ``mixed``) |
| staging | GDSDATA_STAGING | auto | GPU path: device (GPU memory) or host (pinned) |
| io_engine | GDSDATA_IO_ENGINE | auto | GPU path reads: kvikio (CuFile.pread), mmap or mixed (page gather, per |
| | | | batch or always; pinned staging), mapped (the GPU copies from registered pages; device staging); |
| | | | both paths: direct (O_DIRECT past the page cache; auto picks it for shards over half the memory) |
| decode_backend | GDSDATA_DECODE_BACKEND | auto | nvJPEG: hardware (the JPEG engines) or gpu_hybrid (CUDA cores) |
| max_gap | GDSDATA_MAX_GAP | 262144 | largest hole (bytes) read through to join two neighbouring samples |
| | | | (reads past the page cache: at most 16 KiB, the holes' bytes coming from the drive) |
| max_read | GDSDATA_MAX_READ | 67108864 | largest single coalesced read (bytes) |
| verify_checksums | GDSDATA_VERIFY_CHECKSUMS | 1 | check every sample's CRC-32 where its bytes are: in host |
| | | | memory (CPU path, pinned staging), or GPU staging (a CRC-32 kernel; needs Triton); 0: never |
| stall_timeout | GDSDATA_STALL_TIMEOUT | 60 | seconds a Loader stage may spend on one batch before the |
| | | | training loop gets a ``StallError`` naming the stage, the batch and the call it is stuck in; |
| | | | a packing worker on an image (a chunk of 8: 8 times that) before each is prepared alone, and |
| | | | skipped if it stalls; a ``pack --ray`` part without an image before it is packed again |
| | | | that way; ``inf``: no bound |

``GDSDATA_NVJPEG_LIBRARY`` (read by ``nvjpeg.py`` when it loads the library) names libnvjpeg's path
when it does not come from NVIDIA's wheels.

``import gdsdata`` sets ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (CUDA's hardware work queues per
context; CUDA's default 8) when the environment does not set it and CUDA has not started yet (CUDA
reads it as its driver starts, which torch's context, ``torch.cuda.is_available()`` or another
library, CuPy or DALI, does; on Linux gdsdata asks a driver the process has loaded): beside
a training step on the same GPU, nvJPEG's decode then shares fewer queues with the step's kernels
(docs/design.md, "The GPU the step shares"). A value in the environment is kept; the GPU path warns
when it is below 8 (the decode starves behind the step's kernels). ``cuda_queues()`` says which.
"""

import contextlib
import ctypes
import difflib
import logging
import multiprocessing
import os
import sys
import threading
import types


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm job's or a container's cpuset),
    not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


_CORES = usable_cores()
_DEFAULTS = {
    "cpu_threads": _CORES,
    "io_threads": 16,
    "direct_depth": 64,
    "direct_ahead": 128 * 1024 * 1024,
    "io_engine": "auto",
    "gather_threads": min(8, _CORES),
    "max_gap": 256 * 1024,
    "max_read": 64 * 1024 * 1024,
    "staging": "auto",
    "decode_backend": "auto",
    "verify_checksums": True,
    "stall_timeout": 60.0,
}
_CHOICES = {
    "staging": ("auto", "device", "host"),
    "io_engine": ("auto", "kvikio", "mmap", "mixed", "mapped", "direct"),
    "decode_backend": ("auto", "hardware", "gpu_hybrid"),
}
_RENAMED = {  # earlier names, refused with the one that replaces them
    "gather_pool": "gather_threads (a thread count, at least 1)",
    "mapped_copy": "nothing: the mapped engine copies with the copy engines where the driver can",
}
_RENAMED_VALUES = {
    ("decode_backend", "hardware_device"): "decode_backend=hardware with staging=device",
    ("decode_backend", "gpu_hybrid_device"): "decode_backend=gpu_hybrid with staging=device",
}
_MOST_THREADS = 1024
# other GDSDATA_ variables that are no settings (not warned about as misspelled ones are)
_OTHER_VARIABLES = ("GDSDATA_NVJPEG_LIBRARY", "GDSDATA_COMMIT", "GDSDATA_FUZZ_EXAMPLES")
_lock = threading.Lock()
_BYTES = ("direct_ahead", "max_gap", "max_read")  # sizes: also as 512K, 128M, 1G
_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text) -> int:
    """'512M', '1G', '4096' (binary units, an optional trailing 'iB' or 'B') as bytes; ValueError
    for anything else."""
    raw = str(text).strip().lower().removesuffix("b").removesuffix("i")
    try:
        if raw and raw[-1] in _SIZE_UNITS:
            return int(float(raw[:-1]) * _SIZE_UNITS[raw[-1]])
        return int(raw)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 1G)") from None


def _parse(name, value):
    default = _DEFAULTS[name]
    if isinstance(default, bool):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
                raise ValueError(f"setting {name}: expected a boolean, got {value!r}")
            return lowered in ("1", "true", "on", "yes")
        return bool(value)
    if isinstance(default, float):
        try:
            number = float(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"setting {name}: expected a number of seconds, got {value!r}") from e
        if not number > 0:
            raise ValueError(f"setting {name}: must be positive, got {value!r}")
        return number
    if isinstance(default, int):
        try:
            number = parse_size(value) if name in _BYTES and isinstance(value, str) else int(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"setting {name}: expected {'a size' if name in _BYTES else 'an integer'}, "
                             f"got {value!r}") from e
        if name == "max_gap" and number < 0:
            raise ValueError(f"setting {name}: must be 0 or more, got {number}")
        if name != "max_gap" and number < 1:
            raise ValueError(f"setting {name}: must be at least 1, got {number}")
        if (name.endswith("threads") or name == "direct_depth") and number > _MOST_THREADS:  # (depth: as many
            # threads where native AIO is refused)
            what = "reads in flight" if name == "direct_depth" else "threads"
            raise ValueError(f"setting {name}: at most {_MOST_THREADS} {what}, got {number}")
        return number
    value = str(value).strip().lower()
    if (name, value) in _RENAMED_VALUES:
        raise ValueError(f"setting {name}={value} is gone: use {_RENAMED_VALUES[name, value]}")
    if value not in _CHOICES[name]:
        raise ValueError(f"setting {name}: expected one of {', '.join(_CHOICES[name])}, got {value!r}")
    return value


def _from_environment():
    for old, new in _RENAMED.items():
        if os.environ.get(f"GDSDATA_{old.upper()}"):
            logging.getLogger(__name__).warning("GDSDATA_%s is ignored: it is gone; use %s", old.upper(), new)
    if multiprocessing.parent_process() is None:  # (said once, not again by each DataLoader worker)
        _warn_unknown_variables()
    values, errors = dict(_DEFAULTS), []
    for name in _DEFAULTS:
        raw = os.environ.get(f"GDSDATA_{name.upper()}")
        if raw is not None and raw != "":
            try:
                values[name] = _parse(name, raw)
            except ValueError as e:
                errors.append(f"GDSDATA_{name.upper()}={raw!r}: {e}")
    return values, errors


def _warn_unknown_variables():
    """A ``GDSDATA_`` variable that is no setting (a misspelled one, say) logged as a warning, naming
    the setting it may have meant."""
    settings = sorted(f"GDSDATA_{name.upper()}" for name in _DEFAULTS)
    known = {*settings, *(f"GDSDATA_{name.upper()}" for name in _RENAMED), *_OTHER_VARIABLES}
    for variable in sorted(os.environ):
        if variable.startswith("GDSDATA_") and variable not in known and not variable.startswith("GDSDATA_TEST_"):
            close = difflib.get_close_matches(variable, settings, n=1, cutoff=0.8)
            logging.getLogger(__name__).warning("%s is no gdsdata setting, so it is ignored%s", variable,
                                                f" (did you mean {close[0]}?)" if close else "")


CUDA_QUEUES = 32  # the CUDA_DEVICE_MAX_CONNECTIONS gdsdata asks for
CUDA_DEFAULT_QUEUES = 8  # CUDA's own
SET_BY_GDSDATA = "set by gdsdata"
STARTED_FIRST = "CUDA's default: CUDA started before gdsdata was imported"
_cuda_queues = None  # (queues, who chose them), from claim_cuda_queues()


def _cuda_started() -> bool:
    """Whether CUDA has started in this process: torch's context, or the driver started (``cuInit``)
    by anything, ``torch.cuda.is_available()`` or another library (CuPy, DALI) included. CUDA reads
    ``CUDA_DEVICE_MAX_CONNECTIONS`` as its driver starts, before any context is made."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and (cuda.is_initialized() or cuda._is_in_bad_fork()):
            return True  # (a child forked from a process that had started CUDA: the driver is not asked there)
    except Exception:  # noqa: BLE001 - a torch still being imported
        pass
    return _driver_started()


def _driver_started() -> bool:
    """Whether the CUDA driver has started (Linux). It is asked only where the process has loaded it
    already: one that has not has not started it, and loading the driver into every process that
    imports gdsdata (a CPU-only pack too) would be needless."""
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except (OSError, AttributeError):  # not loaded (AttributeError: no RTLD_NOLOAD on this system)
        return False
    try:  # before cuInit every call but cuInit answers CUDA_ERROR_NOT_INITIALIZED, starting nothing
        return driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) == 0
    except AttributeError:  # a driver without the entry point: say nothing of it
        return False


def claim_cuda_queues():
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS`` to ``CUDA_QUEUES`` unless the environment sets it or CUDA
    has started (run by ``import gdsdata``; CUDA reads the variable as its driver starts)."""
    global _cuda_queues
    raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if raw is not None:
        _cuda_queues = _queues_of(raw)
    elif _cuda_started():
        _cuda_queues = (CUDA_DEFAULT_QUEUES, STARTED_FIRST)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(CUDA_QUEUES)
        _cuda_queues = (CUDA_QUEUES, SET_BY_GDSDATA)
    return _cuda_queues


def _queues_of(raw: str):
    try:
        return int(raw), "CUDA_DEVICE_MAX_CONNECTIONS in the environment"
    except ValueError:
        return CUDA_DEFAULT_QUEUES, f"CUDA's default (CUDA_DEVICE_MAX_CONNECTIONS={raw!r} is no number)"


def cuda_queues():
    """(hardware work queues of this process's CUDA context, who chose them): what ``import gdsdata``
    found or set, or the environment's value where the script changed it since (CUDA takes the
    value it finds when it starts)."""
    if _cuda_queues is None:
        return claim_cuda_queues()
    raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if _cuda_queues[1] == SET_BY_GDSDATA and raw != str(CUDA_QUEUES):
        return _queues_of(raw) if raw is not None else (CUDA_DEFAULT_QUEUES, "CUDA's default (the variable unset)")
    return _cuda_queues


# A bad variable is raised where the settings are first used, not while gdsdata is imported (where
# the command line could only show a traceback).
_values, _environment_errors = _from_environment()


def _check_environment():
    if _environment_errors:
        raise ValueError("; ".join(_environment_errors))


def get(name):
    _check_environment()
    if name not in _values:
        raise KeyError(f"unknown gdsdata setting {name!r}; known: {', '.join(sorted(_values))}")
    return _values[name]


def as_dict():
    _check_environment()
    return dict(_values)


def snapshot():
    """The settings now, as a read-only mapping (what a dataset keeps when it is built)."""
    _check_environment()
    return types.MappingProxyType(dict(_values))


@contextlib.contextmanager
def _restore(previous):
    try:
        yield
    finally:
        with _lock:
            _values.update(previous)


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """``owner.name`` is ``value`` for the block: another library's setting or function, looked up
    there by its callers (Ultralytics' dataset check, Ray's failure signal handler)."""
    held = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, held)


def set(**changes):  # noqa: A001 - mirrors kvikio.defaults.set
    """Change settings now; used as a context manager, restores them on exit."""
    for old in changes:
        if old in _RENAMED:
            raise KeyError(f"setting {old} is gone: use {_RENAMED[old]}")
    unknown = sorted(k for k in changes if k not in _values)
    if unknown:
        raise KeyError(f"unknown gdsdata setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_values))}")
    _check_environment()
    parsed = {k: _parse(k, v) for k, v in changes.items()}
    with _lock:
        previous = {k: _values[k] for k in parsed}
        _values.update(parsed)
    return _restore(previous)
