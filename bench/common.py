"""Helpers every benchmark shares: the system block, timing with warm-up and medians, CPU cost."""

import glob
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _commit() -> str:
    """The checkout's commit, with "+changes" where its tracked files differ from it (then the
    figures are not that commit's)."""
    here = os.path.dirname(__file__)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=here).returncode
    except OSError:
        return "unknown"
    return (head + ("+changes" if changed == 1 else "")) if head else "unknown"


def system_block() -> dict:
    from gdsdata.commands.doctor import report

    info = report()
    info["commit"] = os.environ.get("GDSDATA_COMMIT") or _commit()
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    info["cpu model"] = cpu_model()
    info["host speed"] = host_speed()
    return info


def cpu_model() -> str:
    """The host's CPU (``model name`` of /proc/cpuinfo, else lscpu's) and its sockets, to tell the
    hosts of runs on the same kind of GPU apart; "unknown" where neither names it."""
    models, sockets = {}, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    models[value] = models.get(value, 0) + 1
                elif key == "physical id":
                    sockets.add(value)
    except OSError:
        return "unknown"
    if not models:  # (arm64: /proc/cpuinfo names no model; lscpu does)
        try:
            said = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            said = ""
        models = {line.split(":", 1)[1].strip(): 1 for line in said.splitlines() if line.startswith("Model name:")}
    if not models:
        return "unknown"
    name = max(models, key=models.get)
    return f"{name}, {len(sockets)} socket(s)" if sockets else name


def host_cpu_times():
    """The 'cpu' line of /proc/stat: (steal, total) jiffies, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_pct(before, after):
    """The share (%) of the host's CPU time its hypervisor took between two ``host_cpu_times``, or
    None where /proc/stat gives none."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 2)


# NVML's reasons for holding the clocks down (nvmlClocksEventReason*): the power cap, and the slowdowns
_POWER_CAP, _SLOWDOWN = 0x4, 0x8 | 0x20 | 0x40 | 0x80  # (hardware, software thermal, hardware thermal, power brake)


class GpuClocks:
    """The GPU's SM clock (MHz), its power draw (W) and NVML's reasons for holding its clocks down,
    sampled every ``interval`` seconds on a thread between ``start()`` and ``stop()``: so that a row
    run at lower clocks (the power cap, heat) can be told from one that lost to its input pipeline.
    ``stop()`` gives the medians and the shares (%) of samples at the power cap or slowed down, or
    None where NVML (nvidia-ml-py) is missing or does not answer."""

    def __init__(self, device=0, interval=0.1, nvml=None):
        self.device, self.interval, self.samples = device, interval, []
        self._stop, self._thread = threading.Event(), None
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self.nvml, self.handle = nvml, nvml.nvmlDeviceGetHandleByIndex(device)
        except Exception:  # noqa: BLE001 - no NVML: the row goes without clocks
            self.nvml = self.handle = None

    def _sample(self):
        nvml = self.nvml
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return (nvml.nvmlDeviceGetClockInfo(self.handle, nvml.NVML_CLOCK_SM),
                nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000, reasons(self.handle))

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(self._sample())
            except Exception:  # noqa: BLE001 - a sample NVML did not give is left out
                pass

    def start(self):
        if self.handle is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        if not self.samples:
            return None
        clocks, watts, reasons = zip(*self.samples)
        share = lambda bits: round(100 * sum(1 for r in reasons if r & bits) / len(reasons), 1)  # noqa: E731
        return {"sm_mhz": statistics.median(clocks), "watts": round(statistics.median(watts)),
                "power_capped_pct": share(_POWER_CAP), "slowed_pct": share(_SLOWDOWN), "samples": len(reasons)}


class ThreadCpu:
    """The CPU time each thread of this process used between ``start()`` and ``stop()``
    (``/proc/self/task``, Linux), by thread name with its number left off (``gdsdata-gather_3`` counts
    as ``gdsdata-gather``; native threads by their kernel name): which of the training thread and the
    input pipeline's threads took the host's time. ``stop(per)`` gives milliseconds per ``per`` items
    (batches), the busiest first; None where ``/proc`` has no per-thread times."""

    def __init__(self):
        self.before = None

    @staticmethod
    def _read():
        names = {t.native_id: t.name for t in threading.enumerate()}
        names[threading.main_thread().native_id] = "training loop"
        times = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 1:].split()
            name = names.get(int(tid), comm).rstrip("0123456789").rstrip("_-") or comm
            times[int(tid)] = (name, int(rest[11]) + int(rest[12]))  # utime + stime, clock ticks
        return times

    def start(self):
        try:
            self.before = self._read()
        except OSError:
            self.before = None
        return self

    def stop(self, per: int):
        if self.before is None or not per:
            return None
        try:
            now = self._read()
        except OSError:
            return None
        tick_ms, by_name = 1000 / os.sysconf("SC_CLK_TCK"), {}
        for tid, (name, ticks) in now.items():
            used = ticks - self.before.get(tid, (name, 0))[1]
            by_name[name] = by_name.get(name, 0) + used * tick_ms / per
        return {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0}


def host_speed() -> str:
    """How fast this host's CPUs run now, to tell runs on a busy or slow host apart: one thread's
    memory copy (GB/s, best of 5 over 64 MiB), a pure Python loop (million iterations a second), the
    1-minute load average, and the share of CPU time the hypervisor stole while they ran."""
    import numpy as np

    before = host_cpu_times()
    src, dst = np.ones(64 << 20, np.uint8), np.empty(64 << 20, np.uint8)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    t0, total = time.perf_counter(), 0
    for i in range(1_000_000):
        total += i
    loops = 1.0 / (time.perf_counter() - t0)
    steal = steal_pct(before, host_cpu_times())
    steal = "n/a" if steal is None else f"{steal:.1f} %"
    return (f"copy {src.nbytes / best / 1e9:.1f} GB/s (1 thread), Python {loops:.0f} M loops/s, "
            f"load {os.getloadavg()[0]:.1f}, steal {steal}")


def begin(parser, argv=None):
    """A benchmark's start: its arguments parsed, its --out folder made, the system block printed.
    Returns (args, system block)."""
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    system = system_block()
    print_system_block(system)
    return args, system


def print_system_block(info: dict):
    print("== system ==")
    for key, value in info.items():
        print(f"{key:>22}: {value}")


def cpu_seconds() -> float:
    """CPU seconds of this process, its live children (persistent DataLoader workers) and its
    reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


@dataclass
class Result:
    name: str
    images: int
    seconds: list = field(default_factory=list)  # one per timed run
    cpu_seconds: list = field(default_factory=list)
    bytes: int = 0
    first_batch_s: float = None  # time to the first batch of the first (warm-up) epoch, where measured
    note: str = ""
    epochs_per_run: int = 1
    stages: list = field(default_factory=list)  # Loader rows: per epoch, seconds and stage ms per batch

    @property
    def median_s(self):
        return statistics.median(self.seconds)

    @property
    def images_per_s(self):
        return self.images / self.median_s

    @property
    def bytes_per_s(self):
        return self.bytes / self.median_s

    @property
    def spread(self):
        """(min, max) images/s over the timed runs."""
        return self.images / max(self.seconds), self.images / min(self.seconds)

    @property
    def cpu_per_1k(self):
        return statistics.median(self.cpu_seconds) / self.images * 1000

    def row(self, reference=None):
        low, high = self.spread
        ratio = f"{self.images_per_s / reference.images_per_s:6.2f}x" if reference else "      "
        return (f"{self.name:<50} {self.images_per_s:>10.0f} {low:>8.0f}-{high:<8.0f} {ratio} "
                f"{self.cpu_per_1k:>9.2f} {self.bytes_per_s / 1e9:>7.2f}")

    def to_dict(self):
        d = asdict(self)
        d.update(images_per_s=self.images_per_s, cpu_s_per_1k=self.cpu_per_1k, spread=self.spread)
        return d


HEADER = f"{'pipeline':<50} {'images/s':>10} {'(min-max)':^17} {'ratio':>7} {'CPU-s/1k':>9} {'GB/s':>7}"


def measure(name, epoch_fn, images, *, runs=3, warmup=1, nbytes=0, note="", min_seconds=0.0) -> Result:
    """Run ``epoch_fn`` (which loads ``images`` images) warmup+runs times; time the last ``runs``.
    With ``min_seconds``, a timed run is as many back-to-back epochs as one more untimed epoch after
    the warm-up says fill that time (a 0.25 s epoch is too short to time: one stall decides it; the
    warm-up itself is no guide, it pays for compiling kernels); ``images`` and ``bytes`` then count
    all of them and ``epochs_per_run`` says how many."""
    result = Result(name, images, bytes=nbytes, note=note)
    repeat = 1
    for i in range(warmup + runs):
        if i == warmup and warmup and min_seconds:  # (no warm-up: a cold run, one epoch)
            t0 = time.perf_counter()
            epoch_fn()
            repeat = max(1, math.ceil(min_seconds / (time.perf_counter() - t0)))
            result.images, result.bytes, result.epochs_per_run = images * repeat, nbytes * repeat, repeat
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(repeat):
            first = epoch_fn()
        elapsed = time.perf_counter() - t0
        if i == 0 and isinstance(first, float):
            result.first_batch_s = first
        if i >= warmup:
            result.seconds.append(elapsed)
            result.cpu_seconds.append(cpu_seconds() - cpu0)
    return result


def stage_ms(stats, since=None) -> dict:
    """A Loader's stage times (``Loader.stats()``, optionally minus an earlier snapshot) as
    milliseconds per batch."""
    if since is not None and since["batches"] <= stats["batches"]:  # else a new pass began: no delta
        stats = {k: v - since[k] for k, v in stats.items()}
    batches = max(1, stats["batches"])
    return {k[:-2]: round(v / batches * 1000, 2) for k, v in stats.items() if k.endswith("_s")}


def print_stages(stats, indent="      "):
    """The Loader's own account of a batch: milliseconds per batch in each stage."""
    print(f"{indent}ms per batch: " + ", ".join(f"{k} {v:.2f}" for k, v in stage_ms(stats).items()), flush=True)


def print_table(results, reference=None):
    print(HEADER)
    for r in results:
        print(r.row(reference))


def write_json(path, system, results):
    with open(path, "w") as f:
        json.dump({"system": system, "results": [r.to_dict() for r in results]}, f, indent=2, default=str)


def chart(results, path, title):
    """A horizontal bar chart of images/s (log scale, min-max error bars) from result dicts
    (``Result.to_dict()`` or a results JSON); gdsdata's rows in green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results][::-1]
    rates = [r["images_per_s"] for r in results][::-1]
    low = [r["images_per_s"] - r["spread"][0] for r in results][::-1]
    high = [r["spread"][1] - r["images_per_s"] for r in results][::-1]
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(results) + 1.5))
    bars = ax.barh(names, rates, xerr=[low, high], color=["#76b900" if n.startswith("gdsdata") else "#888888"
                                                          for n in names])
    for bar, rate in zip(bars, rates):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {rate:,.0f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=max(rates) * 3)  # room for the largest bar's label
    ax.set_xlabel("images/s, log scale (median; bars: min-max)")
    ax.set_title(title, fontsize=9, loc="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def image_set(folder, count, classes, **options) -> str:
    """``folder`` holding ``count`` generated photographic JPEGs in ``classes`` class folders
    (``tools/make_images.py``; ``options``: its ``noise``, ``quality``, ``scale``, ``progress``), made
    once: a marker beside the folder (not in it, where packing would list it) says it is whole, and a
    folder without one is made again from empty. Returns ``folder``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    from make_images import generate

    folder = os.path.normpath(folder)
    parent, name = os.path.split(folder)
    marker = os.path.join(parent, f".{name}.complete-{count}")
    if not os.path.exists(marker):
        for old in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.complete-*")):
            os.remove(old)  # (another count's)
        shutil.rmtree(folder, ignore_errors=True)
        print(f"generating {count} photographic test images in {folder}", flush=True)
        t0 = time.perf_counter()
        total = generate(folder, count, classes=classes, **options)
        open(marker, "w").close()
        print(f"generated {count} images, mean {total / count / 1e3:.0f} KB, in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return folder


# --- the GPU benchmarks' shared pieces ---------------------------------------------------------
def warm(paths):
    """Read ``paths`` into the page cache, after writing back every dirty page: freshly generated and
    packed data would otherwise be written back by the kernel (after its 30 s expiry) during the
    first timed rows."""
    os.sync()
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def evict(paths):
    """Drop ``paths`` from the page cache (written back first; ``POSIX_FADV_DONTNEED``): a cold start
    for those files without the root that ``/proc/sys/vm/drop_caches`` needs."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches(paths=()) -> str:
    """A cold page cache: all of it dropped where permitted ("drop_caches"), else ``paths`` evicted
    ("evicted"; nothing without paths: "")."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        evict(paths)
        return "evicted" if paths else ""


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a private mapping that touches none)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if not size:
        return 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del anchor
        return sum(v & 1 for v in vec)
    finally:
        mm.close()


def page_cache_bytes() -> int:
    """The host's page cache (``Cached`` in /proc/meminfo), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def shard_paths(ds):
    return [ds.index.shard_path(s) for s in range(len(ds.index.shards))]


def kvikio_pread_epoch(paths, threads):
    """The I/O ceiling: one plain kvikio pread of each whole file into GPU memory, per epoch."""
    import kvikio
    import kvikio.defaults
    import torch

    kvikio.defaults.set({"num_threads": threads})
    sizes = [os.path.getsize(p) for p in paths]
    buffer = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")
    files = [kvikio.CuFile(p, "r") for p in paths]

    def epoch():
        for f, size in zip(files, sizes):
            f.pread(buffer[:size], size, 0).get()
        torch.cuda.synchronize()

    return epoch, sum(sizes)


def loader_epoch(ds, transform, shuffle="full", batch=256):
    """One epoch of a ``gdsdata.Loader`` over ``ds`` per call (random-resized-crop batches with
    ``transform``, else decoded pixels), GPU work included; returns the time to the first batch.
    ``epoch.stages`` gets, per epoch, its seconds and the Loader's stage times (ms per batch);
    ``epoch.loader`` is the Loader and ``epoch.close`` stops its read-ahead."""
    import torch

    import gdsdata

    loader = gdsdata.Loader(ds, batch, transform=transform, shuffle=shuffle, prefetch=3, pixels=transform is None)
    sync = torch.cuda.synchronize if ds.device.type == "cuda" else (lambda: None)
    state = {"epoch": 0}

    def epoch():
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        before = loader.stats()
        t0 = time.perf_counter()
        first = None
        for _ in loader:
            if first is None:
                sync()
                first = time.perf_counter() - t0
        sync()
        seconds = time.perf_counter() - t0
        epoch.stages.append({"seconds": round(seconds, 4), **stage_ms(loader.stats(), before)})
        return first

    epoch.loader, epoch.close = loader, loader.close
    epoch.stages = []
    return epoch


def shown_rate(images_per_s: float) -> str:
    """A rate as printed: whole images/s, with two decimals under 10 (a slow CPU run is not 0)."""
    return f"{images_per_s:.0f}" if images_per_s >= 10 else f"{images_per_s:.2f}"


def interleaved(pipelines: dict, modes, rounds, measure, wanted=lambda name, model: True) -> list:
    """Every (mode, pipeline) row once a round, a warm-up round then ``rounds`` timed ones, each row
    printed as it ends: ``measure(make, model)`` gives (images/s, CPU-seconds per 1,000 images); a
    row that fails is said and left out. Returns per row the medians over the timed rounds
    (``pipeline``, ``mode``, ``images_per_s``, ``cpu_s_per_1k``, ``rates``), modes in order."""
    import traceback

    results = {}
    for round_ in range(1 + rounds):
        for mode, model in modes:
            for name, make in pipelines.items():
                if not wanted(name, model):
                    continue
                try:
                    rate, cpu = measure(make, model)
                except Exception:  # noqa: BLE001
                    print(f"{name} {mode}: FAILED\n{traceback.format_exc()}")
                    continue
                if round_:
                    results.setdefault((name, mode), []).append((rate, cpu))
                print(f"  round {round_}{' (warm-up)' if not round_ else ''}: {name:<12} {mode:<24} "
                      f"{shown_rate(rate):>8} images/s  {cpu:6.2f} CPU-s/1k", flush=True)
    return [{"pipeline": name, "mode": mode, "images_per_s": statistics.median(r for r, _ in runs),
             "cpu_s_per_1k": statistics.median(c for _, c in runs), "rates": [r for r, _ in runs]}
            for (name, mode), runs in results.items()]


def build_pipelines(builders: dict, names, *args) -> dict:
    """name -> what ``builders[name](*args)`` returns, for each of ``names``; a peer that is not
    installed or fails to build is said and left out (one failing must not hide the others)."""
    import traceback

    pipelines = {}
    for name in names:
        try:
            pipelines[name] = builders[name](*args)
        except ImportError as e:
            print(f"{name}: not installed ({e}); skipped")
        except Exception:  # noqa: BLE001
            print(f"{name}: FAILED to build\n{traceback.format_exc()}")
    return pipelines
