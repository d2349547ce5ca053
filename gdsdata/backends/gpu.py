"""The GPU path behind ``GDSDataset(device="cuda")``: plan -> reads into staging -> nvJPEG -> pixels,
along the ``LoadPath`` that ``gdsdata.io.path.resolve`` chose (``gdsdata doctor`` shows it)."""

import dataclasses
import logging

import numpy as np
import torch

from gdsdata import settings, stall
from gdsdata.batch import PixelBatch, Staged
from gdsdata.decode.gpu import GpuDecoder
from gdsdata.errors import GpuUnavailableError
from gdsdata.io import path as load_paths
from gdsdata.io.gpu import GpuReader, SlotPool
from gdsdata.io.plan import max_gap, plan_reads

log = logging.getLogger(__name__)


_queues_checked = False


def _check_cuda_queues():
    """Say once (a warning where it starves the decode) when CUDA runs with fewer hardware work queues
    than gdsdata asks for (settings.claim_cuda_queues)."""
    global _queues_checked
    if _queues_checked:
        return
    _queues_checked = True
    queues, why = settings.cuda_queues()
    if queues < settings.CUDA_DEFAULT_QUEUES:
        log.warning("CUDA runs %d hardware work queue(s) (%s): nvJPEG's decode waits behind a training step's "
                    "kernels and can feed it at a fraction of its rate; %d or more keep it fed "
                    "(docs/usage.md, \"CUDA's work queues\")", queues, why, settings.CUDA_DEFAULT_QUEUES)
    elif queues < settings.CUDA_QUEUES:
        log.info("CUDA runs %d hardware work queues (%s); gdsdata asks for %d where it can (%s)", queues, why,
                 settings.CUDA_QUEUES, "import gdsdata before CUDA starts" if why == settings.STARTED_FIRST else
                 f"CUDA_DEVICE_MAX_CONNECTIONS={settings.CUDA_QUEUES}")


class GpuBackend:
    """``verify``: True (checksums where the bytes are in host memory, pinned staging), "always"
    (also GPU staging: on the GPU, io/checksums.py), or False. ``config``: the dataset's snapshot of
    the settings."""

    def __init__(self, index, device: torch.device, verify, config):
        if not torch.cuda.is_available():
            raise GpuUnavailableError("device='cuda' was asked for, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.index = index
        self.device = device
        self.config = config
        machine = load_paths.probe_machine(device.index)
        self.path = load_paths.resolve(machine, config, all_raw=index.all_raw,
                                       shard_bytes=int(index.shards["size"].sum()), verify=verify)
        self.verify = {"gpu": "always", "host": True, "none": False}[self.path.checksums]
        self.reader = GpuReader(index, device, self.path.reads, config, copy=self.path.copy,
                                fallback=self.path.fallback or None)
        self.decoder = GpuDecoder(index, device, self.path.backend)
        self._slots = SlotPool(self.path.staging, device)
        self._check_stream = None  # the GPU checksums' stream (device staging)
        self._kernel_failed = False  # the CRC-32 kernel could not run here: checked through the host
        self._fallen_back = None  # load_path once reads fell back from mapped (built once, not per batch)
        log.info("GPU path on %s: %s (%s)", device, self.path.describe(), "; ".join(self.path.why))
        if not index.all_raw:
            _check_cuda_queues()

    @property
    def load_path(self) -> load_paths.LoadPath:
        """The path as it stands (``reads`` becomes the fallback engine if ``mapped`` gave up)."""
        if self.reader.engine == self.path.reads:
            return self.path
        if self._fallen_back is None or self._fallen_back.reads != self.reader.engine:
            self._fallen_back = dataclasses.replace(
                self.path, reads=self.reader.engine, copy="", fallback="",
                why=self.path.why + (f"reads {self.reader.engine}: CUDA could not register the shards for mapped",))
        return self._fallen_back

    def _plan(self, indices):
        return plan_reads(self.index.samples, indices, self.index.alignment,
                          max_gap(self.config, self.load_path.past_cache), self.config["max_read"])

    def window(self, indices, uses: int):
        """A ``Window`` over the samples ``indices`` for ``uses`` reads, or None (``GDSDataset.read_window``)."""
        return self.reader.window(self._plan(indices), uses)

    def read(self, indices, windows=()) -> Staged:
        """Storage -> staging: plan and issue the batch's reads, and prepare its decode on the host
        (``Staged.job``). Returns once the reads are done, or, for reads still in flight on a CUDA
        stream, with ``Staged.ready``: an event that ``decode`` waits for.
        ``windows``: from ``window()``, holding the batch's samples (else they are read)."""
        plan = self._plan(indices)
        slot = self._slots.acquire()
        try:
            staging, ready = self.reader.read(plan, slot, windows)
            if self.verify and ready is not None:
                stall.wait(ready, "waiting for a batch's reads to land before checking checksums")
            failed = self._verify(staging, plan, indices) if self.verify else {}
            job = self.decoder.prepare(staging, plan, indices)
        except BaseException:
            self._slots.release(slot, None)
            raise
        return Staged(list(indices), plan, staging, slot, failed, ready, job)

    def decode(self, staged: Staged, stream=None) -> PixelBatch:
        """Staging -> pixels on the GPU, queued on ``stream`` (default: the current one). Call
        ``batch.release(stream)`` once the pixels have been consumed."""
        stream = stream or torch.cuda.current_stream(self.device)
        try:
            batch = self.decoder.decode(staged.tensor, staged.job, stream, staged.ready)
        except BaseException:
            self._slots.release(staged.slot, stream)
            raise
        batch.errors.update(staged.failed)
        if batch.owned:  # staging was read by the decode alone
            self._slots.release(staged.slot, stream)
        else:
            batch.release_fn = lambda s, slot=staged.slot: self._slots.release(slot, s)
        return batch

    def release(self, staged: Staged):
        """Hand back the staging slot of a batch that will not be decoded (once its reads are done)."""
        self._slots.release(staged.slot, None, staged.ready)

    def load_batch(self, indices, stream=None) -> PixelBatch:
        return self.decode(self.read(indices), stream)

    def reserve_staging(self, count: int):
        self._slots.reserve(count)

    def _verify(self, staging, plan, indices) -> dict:
        from gdsdata.decode.cpu import check_batch

        if staging.is_cuda and load_paths.checksum_kernel() and not self._kernel_failed:  # the bytes never pass a CPU
            from gdsdata.io.checksums import crc32

            if self._check_stream is None:
                self._check_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._check_stream):
                got = torch.empty(len(indices), dtype=torch.int64, pin_memory=True)
                try:
                    sums = crc32(staging, plan.sample_offsets, plan.sample_lengths)
                except Exception as e:  # noqa: BLE001 - Triton could not build the kernel for this GPU
                    log.warning("the GPU's CRC-32 kernel failed (%s: %s): GPU staging is checked through a copy "
                                "to the host from now on", type(e).__name__, e)
                    self._kernel_failed = True
                    return check_batch(self.index, staging.cpu().numpy(), plan, indices)
                got.copy_(sums, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            stall.wait(done, "checking a batch's checksums on the GPU")
            expected = self.index.samples["crc32"][np.asarray(indices, np.int64)].astype(np.int64)
            mismatched = np.flatnonzero(got.numpy() != expected)
            return confirm_mismatches(self.index, staging, plan, indices, mismatched) if len(mismatched) else {}
        return check_batch(self.index, staging.cpu().numpy() if staging.is_cuda else staging.numpy(), plan, indices)

    def close(self):
        self._slots.close()
        self.reader.close()
        self.decoder.close()

    def __getstate__(self):
        raise TypeError("a GPU GDSDataset cannot be sent to DataLoader worker processes; use it in the "
                        "main process (num_workers=0) or gdsdata.Loader (its staging buffers and decoder are this "
                        "process's: neither it nor a Loader over it is pickled or copied; make another Loader "
                        "over the same dataset instead)")


def confirm_mismatches(index, staging: torch.Tensor, plan, indices, positions) -> dict:
    """The samples at ``positions`` failed the GPU's check where they sit in ``staging``: confirm
    on the host before calling them corrupt. Returns position -> ``CorruptSampleError`` for those
    whose stored bytes (read again from the shard) do not match their checksum. A sample whose
    bytes in staging pass the host's check is logged as the kernel's fault; one whose stored bytes
    are good but whose staged bytes are not (a fault in the transfer) is logged and staged again
    from the shard."""
    from gdsdata.decode.cpu import checksum_error, crc32
    from gdsdata.io.cpu import CpuReader

    failed = {}
    for k in (int(k) for k in positions):
        record = index.samples[int(indices[k])]
        name, expected = index.describe(int(indices[k])), int(record["crc32"])
        start, length = int(plan.sample_offsets[k]), int(plan.sample_lengths[k])
        if crc32(staging[start:start + length].cpu().numpy()) == expected:
            log.error("%s: the GPU's CRC-32 kernel disagreed with the host on the same staged bytes; "
                      "the host's check passed", name)
            continue
        reader = CpuReader(index)  # the shard opened and checked as every read does
        try:
            buffer, again = reader.read([int(indices[k])])
        finally:
            reader.close()
        stored = buffer[int(again.sample_offsets[0]):][:length]
        if len(stored) != length or crc32(stored) != expected:
            failed[k] = checksum_error(name)
            continue
        log.warning("%s: the staged bytes differed from the shard's, whose bytes are good (a fault in "
                    "the transfer to staging); staged again from the shard", name)
        staging[start:start + length].copy_(torch.from_numpy(stored.copy()))
        if staging.is_cuda:
            stall.wait(torch.cuda.current_stream(staging.device), "the copy of a sample staged again")
    return failed
