"""The GPU path behind ``GDSDataset(device="cuda")``: plan -> kvikio reads -> nvJPEG -> pixels.

Choosing the path (``gdsdata doctor`` shows the choice):
- GPUDirect Storage available: bitstreams go storage -> GPU staging -> nvJPEG HARDWARE_DEVICE, no
  host copy at all.
- kvikio compatibility mode (no GDS): pinned host staging and nvJPEG HARDWARE (the device-bitstream
  path would only add a copy there).
- A GPU without JPEG engines: the CUDA (GPU_HYBRID) backends instead.
``GDSDATA_STAGING`` and ``GDSDATA_DECODE_BACKEND`` override either choice.
"""

import functools
import logging

import torch

from gdsdata import settings
from gdsdata import stall
from gdsdata.batch import PixelBatch, Staged
from gdsdata.decode.gpu import GpuDecoder
from gdsdata.io.path import LoadPath
from gdsdata.errors import GpuUnavailableError
from gdsdata.io.plan import plan_reads
from gdsdata.io.gpu import GpuReader, SlotPool, choose_engine, mapped_suits

log = logging.getLogger(__name__)
_SLOTS = 6  # staging buffers: batches being read, queued for decode, decoding, queued for and in the
# transform (raw samples used in place), and held by the consumer


@functools.lru_cache(maxsize=None)
def _has_hardware_decoder(device_index: int) -> bool:
    """Whether the GPU has nvJPEG's hardware engines: probed once per device and process (the probe
    creates and destroys a hardware decoder)."""
    from gdsdata._native.nvjpeg import BatchedDecoder, NvjpegError

    try:
        BatchedDecoder("hardware").close()
        return True
    except NvjpegError:
        return False


def choose_path(gds: bool, prefer_mapped: bool = False):
    """(staging, nvJPEG backend) from the settings and what the machine has. In compatibility mode
    JPEG datasets stage in pinned host memory; raw datasets that fit in memory stage on the GPU,
    copied there by the ``mapped`` engine (``prefer_mapped``)."""
    staging, backend = settings.get("staging"), settings.get("decode_backend")
    if backend != "auto":
        wanted = "device" if backend.endswith("_device") else "host"
        if staging not in ("auto", wanted):
            raise ValueError(f"decode backend {backend} takes bitstreams from {wanted} memory, but "
                             f"staging={staging} was asked for")
        return wanted, backend
    if staging == "auto":  # io_engine=mapped gathers into GPU memory
        staging = "device" if gds or prefer_mapped or settings.get("io_engine") == "mapped" else "host"
    engines = _has_hardware_decoder(torch.cuda.current_device())
    family = "hardware" if engines else "gpu_hybrid"
    return staging, family + ("_device" if staging == "device" else "")


class GpuBackend:
    """``verify``: True (checksums where the bytes are in host memory, pinned staging), "always"
    (also GPU staging, through a copy to the host), or False."""

    def __init__(self, index, device: torch.device, verify):
        if not torch.cuda.is_available():
            raise GpuUnavailableError("device='cuda' was asked for, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        from gdsdata.commands.doctor import io_mode

        self.index = index
        self.device = device
        self.verify = verify
        self.io_mode, self.io_reason = io_mode()
        prefer_mapped = self.io_mode == "compat" and settings.get("io_engine") == "auto" and mapped_suits(index)
        self.staging_kind, self.backend = choose_path(self.io_mode == "gds", prefer_mapped)
        engine = choose_engine(self.staging_kind, self.io_mode, prefer_mapped)
        # an automatic ``mapped`` that CUDA cannot register falls back to kvikio (same GPU staging)
        self.reader = GpuReader(index, device, engine, fallback="kvikio" if prefer_mapped else None)
        self.decoder = GpuDecoder(index, device, self.backend)
        self._slots = SlotPool(self.staging_kind, device, _SLOTS)
        if verify is True and self.staging_kind == "device":
            self.verify = False  # the bytes never pass a CPU; verify_checksums=True asks for the copy
            log.info("GPU staging: checksums are not checked (GDSDataset(verify_checksums=True) checks them "
                     "through a copy to the host)")
        log.info("GPU path on %s: I/O %s (%s), reads %s, staging %s, nvJPEG %s", device, self.io_mode,
                 self.io_reason, self.engine, self.staging_kind, self.backend)

    @property
    def engine(self) -> str:
        return self.reader.engine

    @property
    def load_path(self) -> LoadPath:
        return LoadPath(str(self.device), self.io_mode, self.io_reason, self.engine, self.staging_kind,
                        f"nvJPEG {self.backend}", "all" if self.verify == "always" else
                        "host-staged" if self.verify else "none")

    def read(self, indices) -> Staged:
        """Storage -> staging: plan and issue the batch's reads, and prepare its decode on the host
        (``Staged.job``). Returns once the reads are done, or, for reads still in flight on a CUDA
        stream, with ``Staged.ready``: an event that ``decode`` makes its stream wait for."""
        plan = plan_reads(self.index.samples, indices, self.index.alignment,
                          settings.get("max_gap"), settings.get("max_read"))
        slot = self._slots.acquire()
        try:
            staging, ready = self.reader.read(plan, slot)
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
        if staged.ready is not None:
            stream.wait_event(staged.ready)
        try:
            batch = self.decoder.decode(staged.tensor, staged.job, stream)
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

    def _verify(self, staging, plan, indices) -> dict:
        from gdsdata.decode.cpu import check_crc
        from gdsdata.errors import CorruptSampleError

        host = staging.cpu().numpy() if staging.is_cuda else staging.numpy()
        failed = {}
        for k, i in enumerate(indices):
            start, length = int(plan.sample_offsets[k]), int(plan.sample_lengths[k])
            try:
                check_crc(host[start:start + length], self.index.samples[i], self.index.describe(i))
            except CorruptSampleError as e:
                failed[k] = e
        return failed

    def close(self):
        self._slots.close()
        self.reader.close()
        self.decoder.close()

    def __getstate__(self):
        raise TypeError("a GPU GDSDataset cannot be sent to DataLoader worker processes; use it in the "
                        "main process (num_workers=0) or gdsdata.Loader")


