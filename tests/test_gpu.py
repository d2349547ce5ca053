"""GPU path (run on a machine with CUDA: pytest -m gpu). Skipped cleanly elsewhere."""

import gc
import io
import json
import os
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import child_env, damaged_copy, loader_threads, mean_abs_diff, pil_reference, write_photos

import gdsdata
from gdsdata import settings
from gdsdata.errors import CorruptSampleError
from gdsdata.packing.prepare import PackOptions
from gdsdata.packing.packer import pack

pytestmark = pytest.mark.gpu

PATHS = [("host", "hardware"), ("device", "hardware"), ("host", "gpu_hybrid"), ("device", "gpu_hybrid")]
PATH_IDS = [f"{b}-{s}" for s, b in PATHS]


def copy_with(monkeypatch, copy):
    """Make the resolver see a driver with (``dma``) or without (``gather``) the batched copy."""
    import dataclasses

    from gdsdata.io import path

    real = path.probe_machine
    machine = real(torch.cuda.current_device())
    if copy == "dma" and not machine.batched_copy:
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    batched = machine.batched_copy if copy == "dma" else ""
    monkeypatch.setattr(path, "probe_machine", lambda index: dataclasses.replace(real(index), batched_copy=batched))


def packed_raw(tmp_path_factory, name, seed, **pack_args) -> str:
    """24 photos in 3 classes packed as raw pixels (shorter side 96)."""
    src = str(tmp_path_factory.mktemp(f"{name}_src"))
    write_photos(src, 24, classes=3, start_seed=seed)
    out = str(tmp_path_factory.mktemp(name) / "ds")
    pack(src, out, options=PackOptions(codec="raw", raw_size=96), workers=2, **pack_args)
    return out


@pytest.fixture(scope="module")
def raw_dataset(tmp_path_factory):
    return packed_raw(tmp_path_factory, "raw", 500, alignment=4096)


def stored_payload(ds, i) -> bytes:
    record = ds.index.samples[i]
    with open(ds.index.shard_path(int(record["shard"])), "rb") as f:
        f.seek(int(record["offset"]))
        return f.read(int(record["length"]))


@pytest.mark.parametrize("staging, backend", PATHS, ids=PATH_IDS)
def test_every_kind_decodes_on_the_gpu_like_pil(kinds_dataset, staging, backend):
    """Each stored bitstream, decoded by nvJPEG, against PIL decoding the same bitstream."""
    _, _, out, _ = kinds_dataset
    with settings.set(staging=staging, decode_backend=backend):
        ds = gdsdata.GDSDataset(out, device="cuda")
        batch = ds.__getitems__(range(len(ds)))
        for i, (image, label) in enumerate(batch):
            assert image.is_cuda and image.dtype == torch.uint8
            mad = mean_abs_diff(image.cpu(), pil_reference(io.BytesIO(stored_payload(ds, i))))
            assert mad <= 2, (ds.source(i), backend, mad)
        ds.close()


ENGINES = {"host": ["mmap", "kvikio"], "device": ["kvikio", "mapped"]}


@pytest.mark.parametrize("staging, backend, engine", [(s, b, e) for s, b in PATHS[:2] for e in ENGINES[s]])
def test_photos_decode_on_the_gpu_like_pil(photos_dataset, staging, backend, engine):
    src, paths, out = photos_dataset
    with settings.set(staging=staging, decode_backend=backend, io_engine=engine):
        ds = gdsdata.GDSDataset(out, device="cuda")
        for i, (image, _) in enumerate(ds.__getitems__(range(len(ds)))):
            assert mean_abs_diff(image.cpu(), pil_reference(os.path.join(src, paths[i]))) <= 2


@pytest.fixture(scope="module")
def raw_shards(tmp_path_factory):
    """Raw pixels in shards of a few samples each, so that batches span shards."""
    return packed_raw(tmp_path_factory, "raw_shards", 700, shard_size=160 << 10)


@pytest.mark.parametrize("staging, engine, threads", [("host", "mmap", 1), ("host", "mmap", 4), ("host", "kvikio", 1),
                                                      ("device", "kvikio", 1), ("device", "mapped:gather", 1),
                                                      ("device", "mapped:dma", 1), ("auto", "auto", 8)])
def test_raw_gpu_equals_cpu_exactly(raw_shards, monkeypatch, staging, engine, threads):
    engine, _, copy = engine.partition(":")
    if copy:
        copy_with(monkeypatch, copy)
    cpu = gdsdata.GDSDataset(raw_shards)
    assert len(cpu.index.shards) > 2
    with settings.set(staging=staging, io_engine=engine, max_gap=0, gather_threads=threads):
        gpu = gdsdata.GDSDataset(raw_shards, device="cuda")
        for order in ([5, 1, 2, 3, 20, 0], list(range(len(cpu)))[::-1]):
            for (a, la), (b, lb) in zip(cpu.__getitems__(order), gpu.__getitems__(order)):
                assert torch.equal(a, b.cpu()) and la == lb
        gpu.close()


@pytest.mark.parametrize("copy", ["dma", "gather"])
def test_mapped_loader_equals_cpu_over_epochs(raw_shards, monkeypatch, copy):
    """The mapped engine queues each batch's copy and hands on an event: with three batches read
    ahead into rotating staging slots, every epoch's pixels equal the CPU path's."""
    cpu = gdsdata.Loader(gdsdata.GDSDataset(raw_shards), 5, seed=4)
    copy_with(monkeypatch, copy)
    with settings.set(staging="device", io_engine="mapped"):
        ds = gdsdata.GDSDataset(raw_shards, device="cuda")
    assert ds.load_path.copy == copy and ds._backend.reader.maps.copy == copy
    gpu = gdsdata.Loader(ds, 5, seed=4, prefetch=3)
    for epoch in range(3):
        cpu.set_epoch(epoch)
        gpu.set_epoch(epoch)
        for (a, la), (b, lb) in zip(cpu, gpu):
            assert torch.equal(la, lb.cpu())
            assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))
    gpu.close()
    ds.close()


@pytest.mark.parametrize("entry", ["cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"])
def test_batched_copy_moves_every_range(entry):
    """Both driver entry points (CUDA 13's and 12.8's) copy scattered host ranges, pinned and
    registered, to their places in GPU memory."""
    from gdsdata._native.cuda import BatchCopy, _driver

    if getattr(_driver(), entry, None) is None:
        pytest.skip(f"this driver has no {entry}")
    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).pin_memory()
    device = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    srcs = np.array([0, 4096, 300000, 900000], np.uint64)
    sizes = np.array([4096, 8192, 123, 100000], np.uint64)
    dsts = np.array([500000, 0, 20000, 700000], np.uint64)
    stream = torch.cuda.Stream()
    BatchCopy(torch.cuda.current_device(), entry).copy(dsts + np.uint64(device.data_ptr()),
                                                       srcs + np.uint64(host.data_ptr()), sizes, stream.cuda_stream)
    stream.synchronize()
    expected = torch.zeros_like(host)
    for s, n, d in zip(srcs.tolist(), sizes.tolist(), dsts.tolist()):
        expected[d:d + n] = host[s:s + n]
    assert torch.equal(device.cpu(), expected)


def test_compat_mode_gathers_raw_datasets_on_the_gpu(raw_dataset, photos_dataset):
    """Automatic choice in compatibility mode: raw pixels through the mapped engine into GPU
    staging, JPEG bitstreams through pinned host staging."""
    raw, jpeg = gdsdata.GDSDataset(raw_dataset, device="cuda"), gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    if raw.load_path.io_mode != "compat":
        pytest.skip("the mapped engine is the automatic choice in compatibility mode only")
    assert (raw.load_path.reads, raw.load_path.staging) == ("mapped", "device")
    assert (jpeg.load_path.reads, jpeg.load_path.staging) == ("mixed", "host")
    raw.close()
    jpeg.close()


def test_mapped_shards_are_released_when_a_dataset_is_dropped_unclosed(raw_dataset):
    """CUDA keeps a registration until it is released; one left behind by a dataset that was never
    closed would make CUDA refuse the next mapping placed at the same address."""
    for _ in range(3):
        with settings.set(io_engine="mapped", staging="device"):
            ds = gdsdata.GDSDataset(raw_dataset, device="cuda")
        ds.__getitems__([0, 5, 2])
        registered = ds._backend.reader.maps._registered
        assert registered
        del ds
        gc.collect()
        assert not registered


def test_a_kvikio_dataset_dropped_without_close_gives_its_files_back_at_once(raw_shards):
    """The GPU reader's shard opener holds the index, not the reader: a dataset dropped without
    close() closes its kvikio file handles as it goes, not when the garbage collector runs."""
    gc.collect()
    gc.disable()
    try:
        with settings.set(io_engine="kvikio", staging="device", max_gap=0):
            first = gdsdata.GDSDataset(raw_shards, device="cuda")  # (CUDA's and kvikio's own descriptors)
            first.__getitems__([0, len(first) - 1])
            first.close()
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(5):
                ds = gdsdata.GDSDataset(raw_shards, device="cuda")
                ds.__getitems__([0, len(ds) - 1])  # (two shards open)
                del ds
            assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        gc.enable()


def test_automatic_mapped_engine_falls_back_to_kvikio(raw_dataset, monkeypatch, caplog):
    """Where CUDA cannot register the shards (a locked-memory limit, say), the automatic choice reads
    with kvikio into the same GPU staging and says why; an explicit io_engine=mapped raises."""
    from gdsdata.errors import GpuError
    from gdsdata.io.gpu import MappedShards

    def refuse(self, shard):
        raise GpuError(f"{self.index.shard_path(shard)}: CUDA cannot register the mapped shard (test)")

    monkeypatch.setattr(MappedShards, "device_pages", refuse)
    cpu, gpu = gdsdata.GDSDataset(raw_dataset), gdsdata.GDSDataset(raw_dataset, device="cuda")
    if gpu.load_path.reads != "mapped":
        pytest.skip("the mapped engine is the automatic choice in compatibility mode only")
    order = [3, 7, 1, 0]
    with caplog.at_level("WARNING", logger="gdsdata"):
        for (a, _), (b, _) in zip(cpu.__getitems__(order), gpu.__getitems__(order)):
            assert torch.equal(a, b.cpu())
    assert gpu.load_path.reads == "kvikio" and "CUDA cannot register" in caplog.text
    assert "could not register" in gpu.load_path.why[-1]
    gpu.close()
    with settings.set(io_engine="mapped"):
        explicit = gdsdata.GDSDataset(raw_dataset, device="cuda")
        with pytest.raises(GpuError, match="CUDA cannot register"):
            explicit.__getitems__(order)
        explicit.close()


def test_mixed_engine_reads_each_batch_its_way_and_equals_cpu(raw_dataset, monkeypatch):
    """Compatibility mode, raw pixels: a batch of scattered samples (reads of ~40 KB) goes through the
    page gather, the whole set in file order (one ~1 MB read) through kvikio; the threshold is
    lowered to 256 KiB so that the small test set has both kinds."""
    from gdsdata.io import gpu as reader_gpu

    monkeypatch.setattr(reader_gpu, "_KVIKIO_READ", 256 << 10)
    cpu = gdsdata.GDSDataset(raw_dataset)
    with settings.set(staging="host", io_engine="auto", max_gap=0):
        gpu = gdsdata.GDSDataset(raw_dataset, device="cuda")
    if gpu.load_path.io_mode != "compat":
        pytest.skip("the mixed engine is the automatic choice in compatibility mode")
    assert gpu.load_path.reads == "mixed"
    reader, used = gpu._backend.reader, []  # the engine's two ways, watched
    gather, use = reader.maps.gather, reader._files.use
    monkeypatch.setattr(reader.maps, "gather", lambda *a: used.append("gather") or gather(*a))
    monkeypatch.setattr(reader._files, "use", lambda *a: used.append("kvikio") or use(*a))
    for order, engine in (([5, 1, 20, 0, 9], "gather"), (list(range(len(cpu))), "kvikio")):
        used.clear()
        with settings.set(max_gap=0):
            for (a, la), (b, lb) in zip(cpu.__getitems__(order), gpu.__getitems__(order)):
                assert torch.equal(a, b.cpu()) and la == lb
        assert used and set(used) == {engine}
    gpu.close()


def test_kvikio_reads_small_samples_through_its_pool(raw_dataset, monkeypatch):
    """kvikio reads into GPU memory below its gds_threshold on the calling thread, one after
    another; gdsdata lowers the threshold to the alignment (unless KVIKIO_GDS_THRESHOLD is set)."""
    import kvikio.defaults

    monkeypatch.delenv("KVIKIO_GDS_THRESHOLD", raising=False)
    with kvikio.defaults.set({"gds_threshold": 1 << 20}):
        with settings.set(staging="device", io_engine="kvikio"):
            ds = gdsdata.GDSDataset(raw_dataset, device="cuda")
        assert kvikio.defaults.get("gds_threshold") == ds.index.alignment
        ds.close()


@pytest.mark.parametrize("transform", [
    gdsdata.RandomResizedCrop(64, dtype="uint8", layout="NHWC", seed=7),
    gdsdata.CenterCrop(64, dtype="uint8", layout="NHWC"),  # the resized image's centre: Resize(73) + CenterCrop(64)
    gdsdata.CenterCrop((40, 56), resize=120, dtype="uint8", antialias=False),  # enlarged, plain bilinear
], ids=["random", "centre", "centre-enlarged-bilinear"])
def test_resampled_gpu_batches_match_cpu_within_one(raw_dataset, transform):
    cpu = gdsdata.Loader(gdsdata.GDSDataset(raw_dataset), 8, transform=transform, seed=3)
    gpu = gdsdata.Loader(gdsdata.GDSDataset(raw_dataset, device="cuda"), 8, transform=transform, seed=3)
    for (a, la), (b, lb) in zip(cpu, gpu):
        assert torch.equal(la, lb.cpu())
        assert (a.int() - b.cpu().int()).abs().max() <= 1


def test_batch_transform_draws_on_the_gpu_repeat_and_leave_the_loop_s_own(photos_dataset):
    """A batch_transform drawing on the GPU's generator (noise, random erasing on the batch's device)
    draws the same run to run, and the loop's own GPU draws are those it makes without it."""
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")

    def noisy(images, labels):
        return images + torch.rand(images.shape, device=images.device), labels

    def run(batch_transform):
        torch.manual_seed(0)
        out, own = [], []
        for images, _ in gdsdata.Loader(ds, 16, transform=gdsdata.RandomResizedCrop(32, dtype="float32"),
                                        batch_transform=batch_transform):
            out.append(images.clone())
            own.append(torch.rand(4, device="cuda"))
        return out, torch.stack(own)

    first, own = run(noisy)
    again, _ = run(noisy)
    plain, plain_own = run(None)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], plain[0]) and torch.equal(own, plain_own)
    ds.close()


@pytest.mark.parametrize("antialias", [True, False])
def test_gpus_without_triton_resample_in_torch_as_the_cpu_does(raw_dataset, monkeypatch, antialias):
    """Without Triton the GPU path resamples with torch's interpolate, which on CUDA takes no uint8:
    in float32, rounded back, as torchvision v2 does; within one of the CPU path."""
    from gdsdata import transforms

    transform = gdsdata.RandomResizedCrop(64, dtype="uint8", layout="NHWC", seed=7, antialias=antialias)
    monkeypatch.setattr(transforms, "_TRITON", False)
    cpu = gdsdata.Loader(gdsdata.GDSDataset(raw_dataset), 8, transform=transform, seed=3)
    gpu = gdsdata.Loader(gdsdata.GDSDataset(raw_dataset, device="cuda"), 8, transform=transform, seed=3)
    for (a, la), (b, lb) in zip(cpu, gpu):
        assert b.is_cuda and torch.equal(la, lb.cpu())
        assert (a.int() - b.cpu().int()).abs().max() <= 1


def test_float16_gpu_batches_match_cpu(raw_dataset):
    transform = gdsdata.RandomResizedCrop(48, seed=1)
    cpu = next(iter(gdsdata.Loader(gdsdata.GDSDataset(raw_dataset), 12, transform=transform)))[0]
    gpu = next(iter(gdsdata.Loader(gdsdata.GDSDataset(raw_dataset, device="cuda"), 12, transform=transform)))[0]
    assert gpu.dtype == torch.float16 and gpu.shape == (12, 3, 48, 48)
    assert (cpu.float() - gpu.cpu().float()).abs().max() < 0.02


@pytest.mark.parametrize("staging, verify", [("host", False), ("device", True)])
def test_bad_sample_on_the_gpu(photos_dataset, tmp_path, staging, verify):
    """HARDWARE parses bitstreams on the host and reports a bad one; the device-bitstream backend
    parses nothing on the host, so there the checksum is what catches a damaged sample."""
    out = damaged_copy(photos_dataset[2], str(tmp_path / "ds"), 7, 2, b"\x00" * 600)
    ds = gdsdata.GDSDataset(out)
    with settings.set(decode_backend="hardware", staging=staging):
        gpu = gdsdata.GDSDataset(out, device="cuda", verify_checksums=verify)
        with pytest.raises(CorruptSampleError, match=r"sample 7 \("):
            gpu.__getitems__([6, 7, 8])
        skipping = gdsdata.GDSDataset(out, device="cuda", on_error="skip", verify_checksums=verify)
        batch = skipping.__getitems__([6, 7, 8])
        assert skipping.skipped == 1 and batch[1][1] == ds.targets[8]


def test_checksums_on_the_gpu_for_device_staging_by_default(raw_dataset, tmp_path):
    """Raw samples the GPU's copy engines move into GPU staging never pass a CPU: by default the
    CRC-32 kernel checks them there, every good sample passes and one damaged byte is named."""
    with settings.set(staging="device", io_engine="mapped"):
        good = gdsdata.GDSDataset(raw_dataset, device="cuda")
        assert good.load_path.staging == "device" and good.load_path.checksums == "gpu"
        seen = sum(len(images) for images, _ in gdsdata.Loader(good, 64, transform=gdsdata.CenterCrop(32)))
        assert seen == len(good)
        out = damaged_copy(raw_dataset, str(tmp_path / "ds"), 3, 100, b"\x00\x01\x02")
        bad = gdsdata.GDSDataset(out, device="cuda")
        with pytest.raises(CorruptSampleError, match=r"sample 3 \(.*checksum mismatch"):
            bad.__getitems__([2, 3, 4])


def test_the_gpu_s_wait_counts_a_gpu_left_idle_while_the_loop_waits_on_the_host(photos_dataset):
    """consumer_gpu_wait_s runs from the moment the work the loop had queued is done: a GPU with
    nothing to do while the loop waits for its first batch (the pipeline starting) waited that long
    (timed from the stream's own wait alone, it read about zero: the batch was ready by then)."""
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32))
    torch.cuda.synchronize()
    it = iter(loader)
    next(it)
    host = loader.stats()["consumer_wait_s"]
    torch.cuda.synchronize()
    next(it)  # (the first batch's events are harvested at the next)
    assert host > 0 and loader.stats()["consumer_gpu_wait_s"] >= 0.5 * host, (host, loader.stats())
    loader.close()
    ds.close()


def test_the_loader_times_how_long_the_loops_stream_waits_for_batches(photos_dataset):
    """consumer_gpu_wait_s: CUDA events from each request of the loop to the batch it gets."""
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32))
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, _ in loader:
            images.float().sum()
    torch.cuda.synchronize()
    next(iter(loader))  # the last epoch's events are harvested at the next batch
    stats = loader.stats()
    assert stats["consumer_gpu_wait_s"] >= 0 and stats["batches"] >= 2 * len(loader)
    loader.close()
    ds.close()


def test_loader_stops_its_thread_when_the_loop_breaks(photos_dataset):
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    loader = gdsdata.Loader(ds, 8, transform=gdsdata.RandomResizedCrop(32))
    for images, labels in loader:
        assert images.is_cuda and labels.is_cuda
        break
    gc.collect()  # also collects finished loaders of earlier tests, whose threads then wind down
    deadline = time.monotonic() + 5
    while loader_threads():
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
    loader.close()
    ds.close()


def test_loaders_sharing_a_dataset_decode_side_by_side(photos_dataset):
    """Three Loaders over one dataset, each left alive after its epoch (so each reads and decodes
    its next epoch ahead) while the next one runs: same pixels as one Loader alone, no hang (the
    nvJPEG state and the staging buffers are shared by the dataset)."""
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    reference = [[image.cpu() for image in images] for images, _ in gdsdata.Loader(ds, 8, shuffle=None)]
    alive = []
    for _ in range(3):
        loader = gdsdata.Loader(ds, 8, shuffle=None, prefetch=3)
        got = [[image.cpu() for image in images] for images, _ in loader]
        alive.append(loader)
        assert len(got) == len(reference)
        for a, b in zip(got, reference):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    for loader in alive:
        loader.close()
    ds.close()


def test_two_datasets_share_one_nvjpeg_decoder(photos_dataset):
    """Two datasets (a training and a validation set, say) decoding at the same time: one nvJPEG
    handle for both (the engines take one), the same pixels as each alone, the handle released by
    both once they are closed, and kept for the next dataset (creating one takes most of a second)."""
    from gdsdata.decode.gpu import _SharedDecoder

    def users(ds):
        shared = _SharedDecoder._open.get((ds.device.index, ds.load_path.backend))
        return 0 if shared is None else shared.users

    first = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    alone = [[image.cpu() for image in images] for images, _ in gdsdata.Loader(first, 8, shuffle=None)]
    first.close()
    before = users(first)
    a, b = (gdsdata.GDSDataset(photos_dataset[2], device="cuda") for _ in range(2))
    together = [[], []]
    for pair in zip(gdsdata.Loader(a, 8, shuffle=None), gdsdata.Loader(b, 8, shuffle=None)):
        for got, (images, _) in zip(together, pair):
            got.append([image.cpu() for image in images])
    assert users(a) == before + 2
    assert a._backend.decoder.shared is b._backend.decoder.shared
    for got in together:
        assert len(got) == len(alone)
        for x, y in zip(got, alone):
            assert all(torch.equal(p, q) for p, q in zip(x, y))
    shared = a._backend.decoder.shared
    a.close()
    b.close()
    assert users(a) == before
    with gdsdata.GDSDataset(photos_dataset[2], device="cuda") as again:
        next(iter(gdsdata.Loader(again, 8, shuffle=None)))
        assert again._backend.decoder.shared is shared


def test_batch_sizes_changing_on_one_nvjpeg_handle_decode_the_same_pixels(photos_dataset):
    """Loaders of growing then shrinking batch sizes, one after the other over one dataset (so on the
    process's one nvJPEG handle, re-initialised for each size): every image the same pixels."""
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")

    def pixels(batch):
        out, loader = [], gdsdata.Loader(ds, batch, shuffle=None, pixels=True)
        for images, _ in loader:
            out += [images.image(k).cpu() for k in range(len(images))]
        loader.close()  # no reading ahead into a next epoch
        return out

    small, large, again = pixels(4), pixels(12), pixels(4)
    assert len(small) == len(large) == len(again) == len(ds)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(small, large, again))
    ds.close()


@pytest.mark.parametrize("backend", ["hardware", "gpu_hybrid"])
def test_a_decode_never_writes_memory_that_work_queued_before_it_still_reads(photos_dataset, backend):
    """nvJPEG's hardware decode writes its output as the call is made, not in the order of the stream
    it is given (reported against torchvision and TorchCodec: H100, nvJPEG 12.3-13.2). Each round
    frees a tensor of a batch's decoded size whose sum is queued behind ~25 ms of GPU work on the
    caller's stream, then decodes a batch on that stream: the sum reads what the tensor held, and the
    pixels are those the batch decoded to before any of this."""
    with settings.set(decode_backend=backend):
        ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
        indices = list(range(16))
        reference = [image.cpu() for image, _ in ds.__getitems__(indices)]
        nbytes = sum(int(image.numel()) for image in reference)  # the decode's output: h x w x 3 each
        torch.cuda.synchronize()
        wrong = []
        for round in range(40):
            held = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(50_000_000)
            total = held.sum(dtype=torch.int64)  # queued behind the sleep
            del held  # its memory goes back to this stream's pool while the sum waits to read it
            images = [image for image, _ in ds.__getitems__(indices)]
            if total.item() != 7 * nbytes:
                wrong.append(f"round {round}: the queued sum read decoded pixels")
            if not all(torch.equal(a.cpu(), b) for a, b in zip(images, reference)):
                wrong.append(f"round {round}: pixels changed")
        ds.close()
    assert not wrong, wrong[:5]


@pytest.mark.parametrize("backend", ["hardware", "gpu_hybrid"])
def test_a_batch_read_on_another_stream_keeps_its_memory_till_that_stream_is_done(photos_dataset, backend):
    """``load_batch`` on one stream, its pixels read on another (said by ``batch.release(reader)``):
    no later decode gets the batch's memory before the reader's queued work has read it. Each round
    queues a copy of the pixels behind ~25 ms of GPU work on the reader, frees the batch, and decodes
    a batch of the same size: the copy holds the first batch's pixels."""
    with settings.set(decode_backend=backend):
        ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
        indices = list(range(16))
        decode, reader = torch.cuda.Stream(), torch.cuda.Stream()
        first, _ = ds.load_batch(indices, stream=decode)
        torch.cuda.synchronize()
        expected = first.buffer.cpu()
        first.release(None)
        del first
        wrong = []
        for round in range(20):
            batch, _ = ds.load_batch(indices, stream=decode)
            reader.wait_stream(decode)
            with torch.cuda.stream(reader):
                torch.cuda._sleep(50_000_000)
                seen = batch.buffer.clone()  # queued behind the sleep
            batch.release(reader)
            del batch
            other, _ = ds.load_batch(indices[::-1], stream=decode)  # the same size: the freed memory fits it
            torch.cuda.synchronize()
            if not torch.equal(seen.cpu(), expected):
                wrong.append(f"round {round}: a later decode wrote the pixels the reader was to read")
            other.release(None)
            del other
        ds.close()
    assert not wrong, wrong[:5]


def settled_gpu_memory():
    """GPU memory allocated once a Loader's threads, reading on into the next epochs, have filled
    their queues and wait (between epochs the batches in flight vary: 2.7-7.5 MB on the H200)."""
    time.sleep(0.3)
    last = None
    for _ in range(40):
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        if now == last:
            break
        last = now
        time.sleep(0.05)
    return last


def test_memory_is_flat_over_epochs(photos_dataset):
    ds = gdsdata.GDSDataset(photos_dataset[2], device="cuda")
    loader = gdsdata.Loader(ds, 16, transform=gdsdata.RandomResizedCrop(64))
    gpu, rss = [], []
    for epoch in range(20):
        loader.set_epoch(epoch)
        for images, _ in loader:
            pass
        del images
        gc.collect()
        gpu.append(settled_gpu_memory())
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    assert max(gpu[1:]) <= gpu[1] * 1.05 + (1 << 20)
    assert rss[-1] <= rss[1] * 1.05


def test_doctor_names_the_io_mode():
    from gdsdata.commands.doctor import report

    info = report()
    assert info["io mode"].split(":")[0] in ("gds", "compat")
    assert "nvjpeg" in info


_QUEUES = r"""
import ctypes, json, os, sys, time
{before}
import torch
import gdsdata

said = gdsdata.settings.cuda_queues()
torch.zeros(1, device="cuda")
driver = ctypes.CDLL("libcuda.so.1")
streams = []
for _ in range(32):  # made one after another (torch's pool makes its streams in turn with other priorities)
    handle = ctypes.c_void_p()
    assert driver.cuStreamCreate(ctypes.byref(handle), 1) == 0  # CU_STREAM_NON_BLOCKING
    streams.append(torch.cuda.ExternalStream(handle.value))


def seconds(count, cycles, each=2):  # `each` spinning single-thread kernels on each of `count` streams
    torch.cuda.synchronize()
    start = time.perf_counter()
    for stream in streams[:count]:
        with torch.cuda.stream(stream):
            for _ in range(each):
                torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - start


seconds(32, 1000)
cycles = 10_000_000
while seconds(1, cycles, 1) < 0.01:
    cycles *= 2
one = min(seconds(1, cycles, 1) for _ in range(3))
print(json.dumps({{"said": said, "together": 64 * one / min(seconds(32, cycles) for _ in range(3))}}))
"""
_DRIVER = "d = ctypes.CDLL('libcuda.so.1'); assert d.cuInit(0) == 0; "
_STARTS = {  # what the process does before `import gdsdata` -> the queues CUDA runs (None: as torch does it)
    "nothing": ("", 32),
    "the variable set to 8": ("os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '8'", 8),
    "the variable set to 32": ("os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '32'", 32),
    "torch's context": ("import torch; torch.zeros(1, device='cuda')", 8),
    "torch.cuda.is_available()": ("import torch; torch.cuda.is_available()", None),
    "torch.cuda.device_count()": ("import torch; torch.cuda.device_count()", None),
    "the driver started, no context": (_DRIVER, 8),
    "another library's context": (_DRIVER + "c = ctypes.c_void_p(); assert d.cuDevicePrimaryCtxRetain("
                                  "ctypes.byref(c), 0) == 0", 8),
}


def test_the_work_queues_gdsdata_says_are_those_cuda_runs():
    # two spinning kernels, one after the other, on each of 32 streams: with 32 hardware work queues the
    # streams run side by side (32 kernels at a time); with 8, four streams share a queue, and the
    # second kernel of one, waiting for its first, holds up the next stream's (about 13 at a time)
    env = child_env()
    for variable in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING"):
        env.pop(variable, None)
    found = {}
    for name, (before, _) in _STARTS.items():
        run = subprocess.run([sys.executable, "-c", _QUEUES.format(before=before)], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, f"{name}: {run.stderr[-2000:]}"
        found[name] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{name}: says {found[name]['said']}, {found[name]['together']:.1f} kernels ran together")
    for name, (_, queues) in _STARTS.items():
        together = found[name]["together"]
        ran = 32 if together > 24 else 8 if 9 < together < 17 else None
        assert found[name]["said"][0] == ran and queues in (None, ran), (name, found)
