"""The load path resolver: every machine, dataset and setting combination gives the path the design
describes (docs/design.md), forced choices that cannot go together are refused in one line, and a
dataset keeps the settings it was built with."""

import dataclasses

import pytest

import gdsdata
from gdsdata import settings
from gdsdata.errors import GpuUnavailableError
from gdsdata.io.path import LoadPath, Machine, cpu_path, resolve

GiB = 1 << 30
COMPAT = Machine("cuda:0", "compat", "no nvidia_fs", jpeg_engines=True, batched_copy="cuMemcpyBatchAsync_v2",
                 host_memory=64 * GiB, cupy=True)
GDS = dataclasses.replace(COMPAT, io_mode="gds", io_reason="GDS driver")
NO_KVIKIO = dataclasses.replace(COMPAT, io_mode="unavailable", io_reason="kvikio not installed")
NO_ENGINES = dataclasses.replace(COMPAT, jpeg_engines=False)


def path(machine=COMPAT, raw=False, size=GiB, verify=True, **forced):
    config = dict(settings.snapshot(), staging="auto", io_engine="auto", decode_backend="auto")
    config.update(forced)
    return resolve(machine, config, all_raw=raw, shard_bytes=size, verify=verify)


def triple(p: LoadPath):
    return p.staging, p.reads, p.backend


@pytest.mark.parametrize("machine, raw, size, expected", [
    (GDS, False, GiB, ("device", "kvikio", "hardware_device")),  # GDS: no host copy at all
    (GDS, True, GiB, ("device", "kvikio", "hardware_device")),
    (COMPAT, False, GiB, ("host", "mixed", "hardware")),  # compat: bitstreams from pinned memory
    (COMPAT, True, GiB, ("device", "mapped", "hardware_device")),  # raw pixels that fit: the GPU copies
    (COMPAT, True, 40 * GiB, ("host", "direct", "hardware")),  # more than half the host's memory: streamed
    (COMPAT, False, 40 * GiB, ("host", "direct", "hardware")),
    (NO_KVIKIO, False, 40 * GiB, ("host", "direct", "hardware")),
    (GDS, False, 40 * GiB, ("device", "kvikio", "hardware_device")),  # GDS reads past the page cache itself
    (dataclasses.replace(COMPAT, cupy=False), True, GiB, ("host", "mixed", "hardware")),
    (NO_KVIKIO, False, GiB, ("host", "mmap", "hardware")),  # pinned staging still works without kvikio
    (NO_ENGINES, False, GiB, ("host", "mixed", "gpu_hybrid")),  # no JPEG engines: CUDA cores
])
def test_the_automatic_path(machine, raw, size, expected):
    p = path(machine, raw, size)
    assert triple(p) == expected
    assert p.io_mode == machine.io_mode and p.device == "cuda:0"
    extra = (p.reads == "mapped") + (p.staging == "device")  # the copy; no checksums on GPU staging
    assert len(p.why) == 3 + extra and all(isinstance(line, str) and line for line in p.why)


def test_mapped_copies_with_the_copy_engines_where_the_driver_can():
    p = path(raw=True)
    assert (p.reads, p.copy, p.fallback) == ("mapped", "dma", "kvikio")
    assert "reads=mapped:dma" in p.describe()
    old_driver = path(dataclasses.replace(COMPAT, batched_copy=""), raw=True)
    assert old_driver.copy == "gather" and any("SMs" in line for line in old_driver.why)
    forced = path(raw=True, io_engine="mapped")
    assert forced.fallback == ""  # a forced engine never falls back
    assert path().copy == "" and path().fallback == ""


@pytest.mark.parametrize("forced, expected", [
    ({"staging": "device"}, ("device", "kvikio", "hardware_device")),
    ({"staging": "host"}, ("host", "mixed", "hardware")),
    ({"decode_backend": "gpu_hybrid"}, ("host", "mixed", "gpu_hybrid")),
    ({"decode_backend": "gpu_hybrid", "staging": "device"}, ("device", "kvikio", "gpu_hybrid_device")),
    ({"io_engine": "kvikio"}, ("host", "kvikio", "hardware")),
    ({"io_engine": "mmap"}, ("host", "mmap", "hardware")),
    ({"io_engine": "mapped"}, ("device", "mapped", "hardware_device")),
])
def test_one_setting_per_decision(forced, expected):
    """(Also on a GDS machine, where the page gather engines still take pinned staging.)"""
    p = path(**forced)
    if forced.get("io_engine") in ("mmap", "mixed"):
        assert triple(path(GDS, **forced))[:2] == ("host", forced["io_engine"])
    assert triple(p) == expected
    assert any("GDSDATA_" in line for line in p.why)


def test_a_raw_dataset_with_host_staging_forced_keeps_the_page_gather():
    assert triple(path(raw=True, staging="host")) == ("host", "mixed", "hardware")


@pytest.mark.parametrize("forced, message", [
    ({"io_engine": "mmap", "staging": "device"}, "io_engine=mmap reads into host memory only"),
    ({"io_engine": "mixed", "staging": "device"}, "device staging needs kvikio or mapped"),
    ({"io_engine": "mapped", "staging": "host"}, "io_engine=mapped gathers into GPU memory only"),
])
def test_forced_choices_that_cannot_go_together_are_refused(forced, message):
    with pytest.raises(ValueError, match=message):
        path(**forced)


def test_forced_choices_the_machine_lacks_say_what_is_missing():
    with pytest.raises(GpuUnavailableError, match="no JPEG hardware engines"):
        path(NO_ENGINES, decode_backend="hardware")
    with pytest.raises(GpuUnavailableError, match="io_engine=kvikio needs kvikio: kvikio not installed"):
        path(NO_KVIKIO, io_engine="kvikio")
    with pytest.raises(GpuUnavailableError, match="staging=device needs kvikio"):
        path(NO_KVIKIO, staging="device")
    with pytest.raises(GpuUnavailableError, match="needs cupy"):
        path(dataclasses.replace(COMPAT, cupy=False), io_engine="mapped")


@pytest.mark.parametrize("machine, verify, expected", [
    (COMPAT, True, "host"),  # pinned staging: checked on the host
    (GDS, True, "gpu"),  # GPU staging: the bytes never pass a CPU, a kernel checks them there
    (dataclasses.replace(GDS, triton=False), True, "none"),  # ... which needs Triton
    (dataclasses.replace(GDS, triton=False), "always", "gpu"),  # ... unless asked for: through the host
    (COMPAT, False, "none"),
])
def test_checksums_follow_the_staging(machine, verify, expected):
    p = path(machine, verify=verify)
    assert p.checksums == expected
    assert any("checksums" in line for line in p.why) == (bool(verify) and p.staging == "device")


def test_the_cpu_path():
    assert cpu_path(True) == LoadPath("cpu", "cpu", "the CPU path", "preadv", "host", "libjpeg-turbo", "host")
    assert cpu_path(False).checksums == "none" and cpu_path(True).backend == ""
    # the GPU path's own settings change nothing here, and the path says so
    with settings.set(staging="device", decode_backend="hardware"):
        path = cpu_path(True, settings.snapshot())
    assert (path.staging, path.decoder) == ("host", "libjpeg-turbo")
    assert path.why[-1] == ("staging=device and decode_backend=hardware: the GPU path's settings; the CPU path "
                            "stages in host memory and decodes with libjpeg-turbo")
    assert not any("GPU path's setting" in line for line in cpu_path(True, settings.snapshot()).why)


def test_removed_settings_name_their_replacement():
    with pytest.raises(ValueError, match="decode_backend=hardware with staging=device"):
        settings.set(decode_backend="hardware_device")
    with pytest.raises(KeyError, match="gather_threads"):
        settings.set(gather_pool=2)
    with pytest.raises(ValueError, match="gather_threads: must be at least 1"):
        settings.set(gather_threads=0)


def test_a_dataset_keeps_the_settings_it_was_built_with(photos_dataset):
    """Changing settings around a live dataset changes nothing of it (a snapshot is taken when it is built)."""
    from gdsdata.io.plan import plan_reads

    _, _, root = photos_dataset
    with settings.set(max_gap=0):
        ds = gdsdata.GDSDataset(root)
    every_other = list(range(0, len(ds), 2))  # holes between the samples

    def reads(max_gap):
        plan = plan_reads(ds.index.samples, every_other, ds.index.alignment, max_gap, settings.get("max_read"))
        return [(r.shard, r.offset, r.size) for r in plan.reads]

    assert len(reads(0)) > len(reads(1 << 20))
    with settings.set(max_gap=1 << 20):
        live = ds._backend.reader.plan(every_other)
        assert [(r.shard, r.offset, r.size) for r in live.reads] == reads(0)
    with pytest.raises(TypeError):
        ds._backend.reader.config["max_gap"] = 1  # read-only
    ds.close()
