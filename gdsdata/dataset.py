"""``GDSDataset``: the public map-style Dataset over a packed folder, on the CPU or the GPU.

    ds = gdsdata.GDSDataset("/data/train.gds", device="cpu")
    image, label = ds[0]          # uint8 CHW RGB tensor, int
    batch = ds.__getitems__([3, 1, 4])  # what torch's DataLoader calls: one coalesced read per batch

Both devices share the index, the read planning and the public API; they differ in where the
staging buffer lives and who decodes (``reader_cpu``/``decode_cpu`` here, the GPU modules there).
"""

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import index as index_io
from . import settings
from .decode_cpu import check_crc, decode
from .errors import CorruptSampleError, GdsDataError
from .reader_cpu import CpuReader

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")


class _CpuBackend:
    def __init__(self, index, verify):
        self.index = index
        self.reader = CpuReader(index)
        self.verify = verify
        self._pool = None
        self._pool_pid = None

    def _executor(self):
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(settings.get("cpu_threads"), thread_name_prefix="gdsdata-decode")
            self._pool_pid = os.getpid()
        return self._pool

    def _decode_one(self, buffer, start, length, sample):
        record = self.index.samples[sample]
        payload = buffer[start:start + length]
        name = self.index.describe(sample)
        try:
            if self.verify:
                check_crc(payload, record, name)
            return torch.from_numpy(decode(payload, record, name)).permute(2, 0, 1)
        except CorruptSampleError as e:
            return e

    def load(self, indices):
        """Decoded CHW uint8 tensors for ``indices``; a failed sample comes back as its exception."""
        buffer, plan = self.reader.read(indices)
        jobs = zip(plan.sample_offsets.tolist(), plan.sample_lengths.tolist(), indices)
        if len(indices) == 1:
            return [self._decode_one(buffer, *next(jobs))]
        return list(self._executor().map(lambda job: self._decode_one(buffer, *job), jobs))

    def close(self):
        self.reader.close()
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None

    def __getstate__(self):
        return {"index": self.index, "verify": self.verify}

    def __setstate__(self, state):
        self.__init__(state["index"], state["verify"])


class GDSDataset(torch.utils.data.Dataset):
    """A packed dataset as a torch map-style Dataset.

    ``device``: "cpu", or "cuda"/"cuda:N" for the GPU path. ``on_error``: "raise" (default) raises
    ``CorruptSampleError`` naming the sample, its shard, offset and source path; "skip" replaces a
    bad sample by the next good one (deterministically) and counts it in ``skipped``.
    ``verify_checksums``: check each sample's CRC-32 as it loads (default: the setting).
    """

    def __init__(self, root, device="cpu", *, on_error="raise", verify_checksums=None):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        self.root = os.fspath(root)
        self.index = index_io.load(self.root)
        self.device = torch.device(device)
        self.on_error = on_error
        self.skipped = 0
        verify = settings.get("verify_checksums") if verify_checksums is None else bool(verify_checksums)
        if self.device.type == "cpu":
            self._backend = _CpuBackend(self.index, verify)
        elif self.device.type == "cuda":
            from .backend_gpu import GpuBackend

            self._backend = GpuBackend(self.index, self.device, verify)
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._labels = self.index.samples["label"].astype(np.int64)

    def __len__(self):
        return len(self.index)

    @property
    def classes(self):
        return self.index.classes

    @property
    def class_to_idx(self):
        return {name: i for i, name in enumerate(self.index.classes)}

    @property
    def targets(self):
        return self._labels.tolist()

    @property
    def meta(self):
        return dict(self.index.meta)

    def source(self, i) -> str:
        """The sample's path relative to the packed source folder."""
        return self.index.path(self._check(i))

    def _check(self, i):
        i = int(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        return i % n

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        indices = [self._check(i) for i in indices]
        images = self._backend.load(indices)
        for k, image in enumerate(images):
            if isinstance(image, GdsDataError):
                images[k] = self._replace(indices, k, image)
        return [(image, int(self._labels[i])) for image, i in zip(images, indices)]

    def _replace(self, indices, k, error):
        if self.on_error == "raise":
            raise error
        self.skipped += 1
        log.warning("%s; replaced by the next good sample", error)
        for step in range(1, len(self)):
            candidate = (indices[k] + step) % len(self)
            image = self._backend.load([candidate])[0]
            if not isinstance(image, GdsDataError):
                indices[k] = candidate
                return image
        raise CorruptSampleError(f"{self.root}: no sample of the dataset decodes") from error

    def close(self):
        """Release file descriptors, threads and (on the GPU) staging memory."""
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"GDSDataset({self.root!r}, device={str(self.device)!r}, samples={len(self)}, "
                f"classes={len(self.classes)})")
