"""``gdsdata verify``: check every shard's and every sample's checksum, and that every sample decodes."""

import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from gdsdata.format import index as index_io
from gdsdata import settings
from gdsdata.decode.cpu import check_crc, decode
from gdsdata.errors import GdsDataError
from gdsdata.io.cpu import CpuReader
from gdsdata.format.shards import data_crc32


def verify(root, *, decode_samples: bool = True, batch: int = 256, progress: bool = False) -> list:
    """Check a dataset (what ``gdsdata verify`` does): the index, every shard's and every sample's
    CRC-32, and (``decode_samples``) that every sample decodes on the CPU.

    Returns
    -------
    list of str
        One line per problem found, naming the shard or sample; empty when the dataset is sound.
    """
    index = index_io.load(root)
    problems = []
    with ThreadPoolExecutor(settings.get("cpu_threads")) as pool:
        shard_crcs = pool.map(lambda s: data_crc32(index.shard_path(s), index.alignment), range(len(index.shards)))
        for shard, (record, crc) in enumerate(zip(index.shards, shard_crcs)):
            if crc != int(record["crc32"]):
                problems.append(f"{index.shard_path(shard)}: shard checksum mismatch")
        reader = CpuReader(index)

        def check(job):
            buffer, start, length, sample = job
            payload = buffer[start:start + length]
            name = index.describe(sample)
            found = []
            steps = (check_crc, decode) if decode_samples else (check_crc,)
            for step in steps:  # report both a checksum mismatch and whether the sample still decodes
                try:
                    step(payload, index.samples[sample], name)
                except GdsDataError as e:
                    found.append(str(e))
            return found

        bar = tqdm(total=len(index), unit="img", desc="verify", disable=not progress, file=sys.stderr)
        with bar:
            for first in range(0, len(index), batch):
                indices = list(range(first, min(first + batch, len(index))))
                buffer, plan = reader.read(indices)
                jobs = [(buffer, int(o), int(n), i)
                        for o, n, i in zip(plan.sample_offsets, plan.sample_lengths, indices)]
                problems.extend(p for found in pool.map(check, jobs) for p in found)
                bar.update(len(indices))
        reader.close()
    return problems


