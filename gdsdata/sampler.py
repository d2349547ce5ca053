"""Which samples each rank reads, in which order, batch by batch; and how to resume mid-epoch.

Order of an epoch (the same on every rank, a pure function of seed and epoch):
- ``shuffle="full"``: a uniform permutation.
- ``shuffle="block"``: runs of ``block_size`` consecutive samples are permuted, then samples are
  shuffled within windows of ``window`` blocks. Reads stay mostly sequential (good for disks and
  network storage that suffer on random reads) while a batch still draws from ``window`` places
  across the dataset.
- ``shuffle=None``: dataset order.

Sharding: the epoch order is padded (``drop_last=False``: repeating its first samples) or cut
(``drop_last=True``) to a multiple of ``world_size``, and rank r takes the r-th contiguous share.
Every rank gets the same number of samples and batches, so DDP never waits on a rank that ran out.

Resume: the state is (epoch, the mask of samples delivered by earlier segments of the epoch, batches
done in this segment, and the world size, batch size and drop_last of this segment). Resumed with
the same world size, batch size and drop_last, every rank continues exactly where it stopped. With
other values, the samples not yet delivered are re-split over the new ranks as a new segment, so the
rest of the epoch still delivers every sample exactly once (a state taken after the old ranks' last
batch has nothing left: what their drop_last left out stays out).
"""

from dataclasses import dataclass

import numpy as np

SHUFFLES = ("full", "block", None)


@dataclass(frozen=True)
class ShardSpec:
    size: int  # samples in the dataset
    world_size: int = 1
    rank: int = 0
    batch_size: int = 1
    drop_last: bool = False
    shuffle: object = "full"
    seed: int = 0
    block_size: int = 64
    window: int = 16

    def __post_init__(self):
        if self.shuffle not in SHUFFLES:
            raise ValueError(f"shuffle must be 'full', 'block' or None, got {self.shuffle!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.batch_size < 1 or self.block_size < 1 or self.window < 1:
            raise ValueError("batch_size, block_size and window must be positive")
        if self.size < 1:
            raise ValueError("the dataset is empty")


def epoch_order(spec: ShardSpec, epoch: int) -> np.ndarray:
    """The whole epoch's sample order (before sharding)."""
    return _order(spec, epoch)[0]


def window_numbers(spec: ShardSpec, epoch: int):
    """``shuffle="block"``: for each sample of the dataset, the number of the shuffle window the
    epoch draws it in (windows numbered in epoch order); None for the other shuffles. A streaming
    Loader reads each window's samples together (``GDSDataset.read_window``)."""
    order, windows = _order(spec, epoch)
    if windows is None:
        return None
    numbers = np.empty(spec.size, np.int64)
    numbers[order] = windows
    return numbers


def _order(spec: ShardSpec, epoch: int):
    """(the epoch's order, each position's shuffle window or None)."""
    n = spec.size
    if spec.shuffle is None:
        return np.arange(n, dtype=np.int64), None
    rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, spec.seed >> 32, epoch])
    if spec.shuffle == "full":
        return rng.permutation(n).astype(np.int64), None
    starts = np.arange(0, n, spec.block_size)
    blocks = [np.arange(s, min(s + spec.block_size, n), dtype=np.int64) for s in rng.permutation(starts)]
    out = []
    for w in range(0, len(blocks), spec.window):
        window = np.concatenate(blocks[w:w + spec.window])
        out.append(window[rng.permutation(len(window))])
    return np.concatenate(out), np.repeat(np.arange(len(out)), [len(w) for w in out])


def _split(samples: np.ndarray, spec: ShardSpec) -> np.ndarray:
    """This rank's share of ``samples`` (padded or cut to a multiple of world_size)."""
    world = spec.world_size
    if spec.drop_last:
        per_rank = len(samples) // world
    else:
        per_rank = -(-len(samples) // world)
        missing = per_rank * world - len(samples)
        if missing:
            samples = np.concatenate([samples, np.resize(samples, missing)]) if len(samples) else samples
    return samples[spec.rank * per_rank:(spec.rank + 1) * per_rank]


def _batches(share: np.ndarray, spec: ShardSpec):
    full = len(share) // spec.batch_size * spec.batch_size
    batches = [share[i:i + spec.batch_size] for i in range(0, full, spec.batch_size)]
    if not spec.drop_last and full < len(share):
        batches.append(share[full:])
    return batches


def rank_batches(spec: ShardSpec, epoch: int, consumed=None):
    """This rank's batches (arrays of sample indices) for the epoch, leaving out the samples marked
    in ``consumed`` (a bool mask over the dataset: what earlier segments of the epoch delivered)."""
    order = epoch_order(spec, epoch)
    if consumed is not None:
        order = order[~consumed[order]]
    return _batches(_split(order, spec), spec)


def consumed_after(spec: ShardSpec, epoch: int, consumed, batches_done: int) -> np.ndarray:
    """The mask of samples delivered once every rank of ``spec`` took ``batches_done`` batches of
    the segment that started with ``consumed``."""
    mask = np.zeros(spec.size, bool) if consumed is None else consumed.copy()
    for rank in range(spec.world_size):
        for batch in rank_batches(ShardSpec(**{**spec.__dict__, "rank": rank}), epoch, consumed)[:batches_done]:
            mask[batch] = True
    return mask


def batches_per_epoch(spec: ShardSpec) -> int:
    """``len(_batches(_split(...)))`` without making them: a rank's share, then its batches."""
    if spec.drop_last:
        return spec.size // spec.world_size // spec.batch_size
    share = -(-spec.size // spec.world_size)  # (padded to a multiple of the world size)
    return -(-share // spec.batch_size)
