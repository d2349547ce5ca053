"""``gdsdata verify``: check every shard's and every sample's checksum, and that every sample decodes."""

from concurrent.futures import ThreadPoolExecutor

from gdsdata.format import index as index_io
from gdsdata import settings
from gdsdata.decode.cpu import check_crc, decode
from gdsdata.errors import GdsDataError
from gdsdata.io.cpu import CpuReader
from gdsdata.format.shards import cannot_read, data_crc32, unused_bytes_set
from gdsdata.progress import bar as progress_bar


def verify(root, *, decode_samples: bool = True, batch: int = 256, progress: bool = False) -> list:
    """Check a dataset (what ``gdsdata verify`` does): the index, every shard's and every sample's
    CRC-32, and (``decode_samples``) that every sample decodes on the CPU.

    Returns
    -------
    list of str
        One line per problem found, naming the shard or sample; empty when the dataset is sound.
    """
    before = index_io.stamp(root)  # (a dataset replaced while it is checked is said, not its shards "missing")
    index = index_io.load(root, shards=False)  # each shard checked below, a bad one said and the rest checked
    problems = []

    last_ends = index_io.last_sample_ends(index)

    def shard_crc(shard):
        """(the shard's CRC-32 or None, what made it unreadable, a line where the bytes of its header
        that hold nothing are not zero or None)."""
        problem = index_io.shard_problem(index, shard, int(last_ends[shard]))
        if problem is not None:
            return None, problem, None
        path = index.shard_path(shard)
        try:
            crc = data_crc32(path, index.alignment)
            slack = unused_bytes_set(path, index.alignment)
        except OSError as e:
            return None, cannot_read(path, e), None
        return crc, None, (f"{path}: its header's reserved bytes, or the padding after it, are not zero: damage "
                           f"outside every sample (reading is unaffected; packing again mends it)" if slack else None)

    with ThreadPoolExecutor(settings.get("cpu_threads")) as pool:
        unreadable = set()  # shards every sample of which is left unchecked (said once, for the shard)
        mismatched = {}  # shard whose checksum fails: where its line is in problems (said in full at the end)
        for shard, (record, (crc, problem, slack)) in enumerate(zip(index.shards, pool.map(shard_crc,
                                                                                    range(len(index.shards))))):
            if problem is not None:
                unreadable.add(shard)
                problems.append(f"{problem}: its samples are not checked")
            elif crc != int(record["crc32"]):
                mismatched[shard] = len(problems)
                problems.append(f"{index.shard_path(shard)}: shard checksum mismatch")
            if slack is not None:
                problems.append(slack)
        reader = CpuReader(index)

        def check(job):
            buffer, start, length, sample = job
            payload = buffer[start:start + length]
            name = index.describe(sample)
            found = []
            steps = (check_crc, decode) if decode_samples else (check_crc,)
            for step in steps:  # both a checksum mismatch and whether the sample still decodes, in one line
                try:
                    step(payload, index.samples[sample], name)
                except GdsDataError as e:
                    said = str(e)
                    found.append(said.removeprefix(f"{name}: ") if found and said.startswith(f"{name}: ") else said)
            return ["; ".join(found)] if found else []

        damaged = {}  # shard -> its samples with a problem
        bar = progress_bar(progress, total=len(index), unit="img", desc="verify")
        with bar:
            for first in range(0, len(index), batch):
                everything = range(first, min(first + batch, len(index)))
                indices = [i for i in everything if int(index.samples[i]["shard"]) not in unreadable]
                for buffer, plan, ids in _readable(reader, indices, problems, index, damaged):
                    jobs = [(buffer, int(o), int(n), i)
                            for o, n, i in zip(plan.sample_offsets, plan.sample_lengths, ids)]
                    for (_, _, _, sample), found in zip(jobs, pool.map(check, jobs)):
                        problems.extend(found)
                        if found:
                            damaged.setdefault(int(index.samples[sample]["shard"]), []).append(sample)
                bar.update(len(everything))
        reader.close()
    for shard, at in mismatched.items():  # where the damage is: in samples (said below), or only between them
        bad = damaged.get(shard)
        problems[at] += (f" (in sample{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))}"
                         f"{' ...' if len(bad) > 5 else ''}: below)" if bad else
                         " outside every sample (in the padding between samples): every sample of it passes its "
                         "checksum" + (" and decodes" if decode_samples else ""))
    index_io.still(root, before, "checked")
    return problems


def _readable(reader, indices, problems, index, damaged):
    """(buffer, plan, indices) for the samples ``indices`` that can be read: all at once, or where that
    fails (a read error: shards cut short or missing were said before), one by one, each that cannot
    be read a line of ``problems`` (and noted in ``damaged``, shard -> samples)."""
    if not indices:
        return []
    try:
        return [(*reader.read(indices), indices)]
    except (OSError, GdsDataError):
        pass
    parts = []
    for i in indices:
        try:
            parts.append((*reader.read([i]), [i]))
        except (OSError, GdsDataError) as e:  # (gdsdata's own error names the file and the reason already)
            problems.append(cannot_read(index.describe(i), e) if isinstance(e, OSError) else
                            f"{index.describe(i)}: {e}")
            damaged.setdefault(int(index.samples[i]["shard"]), []).append(i)
    return parts
