"""The CPU path behind ``GDSDataset(device="cpu")``: storage -> host buffer (``io.cpu``) ->
libjpeg-turbo on the cpu_threads pool (``decode.cpu``) -> one flat arena of pixels."""

import numpy as np
import torch

from gdsdata import stall
from gdsdata.batch import PixelBatch, Staged
from gdsdata.decode.cpu import check_batch, decode, run_parallel
from gdsdata.errors import CorruptSampleError
from gdsdata.io.cpu import CpuReader
from gdsdata.io.path import cpu_path


class CpuBackend:
    """Storage -> host buffer (``reader_cpu``) -> libjpeg-turbo in a thread pool -> one flat arena."""

    def __init__(self, index, verify, config):
        self.index = index
        self.config = config
        self.load_path = cpu_path(verify, config, shard_bytes=int(index.shards["size"].sum()))
        self.reader = CpuReader(index, config=config, direct=self.load_path.reads == "direct")
        self.verify = verify

    def window(self, indices, uses: int):
        """A ``Window`` over the samples ``indices`` for ``uses`` reads, or None (``GDSDataset.read_window``)."""
        return self.reader.window(self.reader.plan(indices), uses)

    def read(self, indices, windows=()) -> Staged:
        """Storage -> host buffer, each sample's CRC-32 checked there (failures in ``Staged.failed``,
        so that a replacement is read before decode). ``windows``: from ``window()``."""
        buffer, plan = self.reader.read(indices, windows)
        failed = check_batch(self.index, buffer, plan, indices) if self.verify else {}
        return Staged(list(indices), plan, buffer, None, failed)

    def load_batch(self, indices, stream=None) -> PixelBatch:
        return self.decode(self.read(indices), stream)

    def decode(self, staged: Staged, stream=None) -> PixelBatch:
        indices, buffer, plan = staged.indices, staged.tensor, staged.plan
        records = self.index.samples[np.asarray(indices, dtype=np.int64)]
        heights = records["height"].astype(np.int64)
        widths = records["width"].astype(np.int64)
        sizes = heights * widths * 3
        offsets = np.zeros(len(indices), np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        arena = np.empty(int(sizes.sum()), np.uint8)
        errors = dict(staged.failed)  # checksums that failed as the batch was read
        starts, lengths = plan.sample_offsets.tolist(), plan.sample_lengths.tolist()
        ends = (offsets + sizes).tolist()
        begins = offsets.tolist()

        def decode_one(k):
            if k in staged.failed:
                return
            try:
                decode(buffer[starts[k]:starts[k] + lengths[k]], records[k], lambda: self.index.describe(indices[k]),
                       out=arena[begins[k]:ends[k]])
            except CorruptSampleError as e:
                errors[k] = e

        with stall.native("CPU decode (libjpeg-turbo) on the cpu_threads pool"):
            run_parallel(decode_one, len(indices))
        return PixelBatch(torch.from_numpy(arena), offsets, heights, widths, np.full(len(indices), 3),
                          errors, owned=True)

    def close(self):
        self.reader.close()

    def __getstate__(self):
        return {"index": self.index, "verify": self.verify, "config": dict(self.config)}

    def __setstate__(self, state):
        self.__init__(state["index"], state["verify"], state["config"])
