"""``Loader``: batches for a training loop, prefetched, sharded over ranks, resumable mid-epoch.

    loader = gdsdata.Loader(ds, batch_size=256, shuffle=True, transform=gdsdata.RandomResizedCrop(224))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:   # images: N x 3 x 224 x 224, float16 on the GPU, float32 on the CPU
            ...
    state = loader.state_dict()         # save with the checkpoint; load_state_dict() resumes

Three background threads prepare up to ``prefetch`` batches ahead: one reads (storage -> staging
buffers), one decodes, one transforms. On the GPU the last two each work on a CUDA stream of their
own, each batch handed on with an event: reading batch k+2, decoding batch k+1 and transforming it
overlap the training step on batch k, and a decode never waits behind a transform. The consumer's
stream waits on the batch's event before it touches it, and the batch's memory is recorded as used
by that stream. Breaking out of the loop, an exception, or ``close()`` stops the threads and frees
their buffers.
"""

import atexit
import collections
import hashlib
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from gdsdata import settings
from gdsdata.args import count, is_integer
from gdsdata import stall
from gdsdata import transforms as T
from gdsdata.batch import PixelBatch, upload
from gdsdata.dataset import SAMPLE_TRANSFORMS
from gdsdata.errors import GdsDataError, StallError
from gdsdata.transforms import detection as D
from gdsdata.sampler import ShardSpec, batches_per_epoch, consumed_after, rank_batches, window_numbers

DETECTION_TRANSFORMS = (D.YoloAugment, D.Letterbox)
_OWN_TRANSFORMS = (T.RandomResizedCrop, T.CenterCrop, *DETECTION_TRANSFORMS)

log = logging.getLogger(__name__)
_STOP_POLL_S = 0.1
_COPY_SHIFT = 40  # a repeated sample's crop is drawn for its index + copies * 2**40 (indices stay below that)
_MAX_OVERLAP = 8  # batches a streaming Loader reads at once, at most (``direct_ahead``)


def _distributed_rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _qualified(thing) -> str:
    """``thing``'s type by its module's public path (torchvision.transforms.v2.RandomResizedCrop, not
    RandomResizedCrop, a name gdsdata's own class shares)."""
    kind = type(thing)
    module = kind.__module__ or ""
    if module.startswith("torchvision.transforms.v2."):
        module = "torchvision.transforms.v2"
    elif module.startswith("torchvision.transforms."):
        module = "torchvision.transforms"
    return kind.__qualname__ if module in ("builtins", "__main__", "") else f"{module}.{kind.__qualname__}"


def _no_group_under_a_launcher(rank, world_size):
    """Without a process group: a world size above 1 given alone (every process would be rank 0) and,
    in a process a launcher started as one of several (``WORLD_SIZE`` above 1: torchrun, Accelerate,
    Lightning), no world size at all are refused: the Loader would read every sample in every process,
    as one of rank 0's shares. (``rank=0`` alone or ``world_size=1`` alone elsewhere: rank 0 of 1.)"""
    if world_size is None:
        launched = os.environ.get("WORLD_SIZE", "").strip()
        if launched.isdigit() and int(launched) > 1:
            raise ValueError(f"WORLD_SIZE={launched} in the environment (one of several processes a launcher such "
                             f"as torchrun started) but no torch.distributed process group is initialised (not "
                             f"yet, or no longer): to read this rank's share, make the Loader after "
                             f"torch.distributed.init_process_group(); to read every sample (an evaluation on one "
                             f"rank), give rank=0, world_size=1")
    if rank is None and world_size is not None and world_size > 1:
        raise ValueError(f"world_size={world_size} given without rank=, and no torch.distributed process group is "
                         f"initialised: give rank= and world_size= both")


class _PassSetting:
    """A Loader attribute the next pass is built with: every assignment (of the same object too, a
    transform changed in place) counts in the Loader's ``_version``, so that the pass already reading
    the next epoch, built before it, gives way (``Loader.__iter__``); but an equal value that cannot
    change in place (``_same_pass``: gdsdata's own transforms, None, a bool, a number) does not: a loop
    that makes its transform afresh each epoch keeps the read-ahead."""

    def __init__(self, doc, convert=None):
        self.__doc__, self._convert = doc, convert

    def __set_name__(self, owner, name):
        self._slot = "_" + name

    def __get__(self, loader, owner=None):
        return self if loader is None else getattr(loader, self._slot)

    def __set__(self, loader, value):
        value = value if self._convert is None else self._convert(value)
        held = getattr(loader, self._slot, _UNSET)
        setattr(loader, self._slot, value)
        if not _same_pass(held, value):
            loader._version += 1


_UNSET = object()


def _same_pass(held, value) -> bool:
    """Whether ``value`` builds the same pass as ``held``: an equal None, bool, number or string, or
    an equal gdsdata transform (frozen: it cannot change in place). Any other object, the held one
    too (changed in place, then assigned again), builds a new pass."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(held) is type(value) and held == value
    if held is value or type(held) is not type(value) or not isinstance(value, _OWN_TRANSFORMS):
        return False
    try:
        return bool(held == value)
    except Exception:  # noqa: BLE001 - fields that do not compare (an array given as scale=): a new pass
        return False


class Loader:
    """Iterates ``(images, labels)`` over a ``GDSDataset`` on its device, as torch's DataLoader does
    (with torchdata ``StatefulDataLoader``'s resume).

    Parameters
    ----------
    dataset : GDSDataset or torch.utils.data.Subset of one
        What to read; a Subset (``random_split`` gives those) reads only its samples. A dataset
        opened with ``transform=``, ``target_transform=`` or ``transforms=`` (applied per sample by
        ``ds[i]``) is refused with ``ValueError``: the Loader's own ``transform`` and
        ``batch_transform`` apply.
    batch_size : int
        Samples per batch.
    shuffle : bool or str
        True or "full": a seeded permutation per epoch (the default; torch's DataLoader defaults to
        False); "block": locality-friendly runs of ``block_size`` samples shuffled within windows of
        ``window`` blocks (``sampler``); False or None: dataset order.
    seed : int
        The epoch orders are functions of (seed, epoch); the crops and flips are functions of the
        transform's own ``seed``, the epoch and the sample (``RandomResizedCrop(seed=)``).
    drop_last : bool
        Drop the uneven tail (per rank, and the last partial batch) instead of padding it.
    transform : RandomResizedCrop or CenterCrop, optional
        The crop done inside the pipeline, on the dataset's device. Without one, ``images`` is a
        list of uint8 CHW tensors of each image's size.
    batch_transform : callable, optional
        ``batch_transform(images, labels) -> (images, labels)`` on each batch after the crop, as the
        loop takes it (its thread and CUDA stream), with torch's random generators seeded for the
        batch: torchvision v2 transforms, CutMix or MixUp, kornia (``lambda x, y: (aug(x), y)``),
        anything torch-like. Its draws repeat run to run and on a resume, and leave the loop's own.
    indices : sequence of int, optional
        Read only these samples of ``dataset`` (as ``torch.utils.data.Subset``).
    prefetch : int
        Batches prepared ahead of the training loop.
    rank, world_size : int, optional
        This process's share under DDP; by default from ``torch.distributed`` when initialised
        (then a Loader reads its rank's share: for an evaluation on one rank that should see
        every sample, pass ``rank=0, world_size=1``). One given alone takes the other from the
        process group, as DistributedSampler does (rank 0 of 1 without one; a world size above 1
        then needs its rank). In a process a launcher started as one of several (``WORLD_SIZE``
        above 1), a Loader made without a process group and without ``world_size`` is refused.
    pixels : bool
        Hand on the decoded ``PixelBatch`` itself (every image's pixels in one buffer), for custom
        GPU transforms; valid until the next batch is asked for.

    Notes
    -----
    ``len(loader)`` is the number of batches of an epoch for this rank. Each ``iter(loader)`` starts
    a pass at the beginning of the current epoch, except right after ``load_state_dict``, where it
    continues at the saved batch (``batches_left()`` says how many remain). One pass runs at a time:
    a new ``iter(loader)`` or ``load_state_dict`` ends the iterator before it, whose next ``next()``
    raises ``RuntimeError`` (torch's DataLoader would run both). After a full epoch the
    loader is at the next one (``epoch``), whose first batches are already being read; ``set_epoch``
    picks an epoch explicitly.
    """

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool | str | None = True, *, seed: int = 0,
                 drop_last: bool = False, transform=None, batch_transform: Callable | None = None,
                 indices: Sequence[int] | None = None, prefetch: int = 2, rank: int | None = None,
                 world_size: int | None = None, block_size: int = 64, window: int = 16, pixels: bool = False,
                 **dataloader_arguments):
        _no_dataloader_arguments(dataloader_arguments)
        self._given = dataset  # ``dataset``: as given (a Subset stays one: len(loader.dataset) counts its samples)
        self._version = 0  # counts assignments of transform, batch_transform, pixels, prefetch
        dataset, self._indices = _source(dataset, indices)
        self._copies = _copies(self._indices)
        _no_sample_transforms(dataset)
        batch_size = count("batch_size", batch_size)
        seed = count("seed", seed, minimum=0)
        if seed >= 2**63:
            raise ValueError(f"seed must be below 2**63, got {seed}")
        found = ""  # where a rank or world size not given came from, for the error below
        rank = None if rank is None else count("rank", rank, minimum=0)
        world_size = None if world_size is None else count("world_size", world_size)
        if rank is None or world_size is None:
            grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
            if not grouped:
                _no_group_under_a_launcher(rank, world_size)
            detected_rank, detected_world = _distributed_rank()
            found = " (found in torch.distributed's process group)" if grouped else \
                " (world_size not given, and no torch.distributed process group is initialised: give rank= and " \
                "world_size= both)"
            rank = detected_rank if rank is None else rank
            world_size = detected_world if world_size is None else world_size
        if rank >= world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}{found}")
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        self._data = dataset  # the GDSDataset read
        size = len(dataset) if self._indices is None else len(self._indices)
        self.spec = ShardSpec(size, world_size, rank, batch_size, bool(drop_last), _shuffle(shuffle), seed,
                              count("block_size", block_size), count("window", window))
        if len(self) == 0:  # (torch's DataLoader says nothing; a loop over it then silently does nothing)
            log.warning("this Loader yields no batch an epoch: %d sample(s), world_size %d, batch_size %d, "
                        "drop_last=%s", size, world_size, batch_size, bool(drop_last))
        _check_transforms(dataset, transform, batch_transform, pixels)
        self.transform, self.batch_transform, self.pixels, self.prefetch = transform, batch_transform, pixels, prefetch
        self._rect_warned = None  # the Letterbox(rect=True) last warned about (said once, not each epoch)
        self._warn_rect()
        self.epoch = 0
        self._consumed = None  # mask of samples delivered by earlier segments of this epoch
        self._done = 0  # batches delivered in the current segment
        self._resume = False  # a state was loaded: the next pass continues it
        self._active = None  # weak reference to the pass being iterated
        self._carry = None  # a pass that finished an epoch and already reads the next one
        self._next_epoch = None  # set_epoch's epoch, set while a pass ran: the next pass reads it
        self._fingerprint = None
        self._last_stats = None  # the PipelineStats of the last pass
        self.skipped = {}  # epoch -> bad samples replaced (on_error="skip") in the batches delivered

    # --- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read ``epoch`` (as ``DistributedSampler.set_epoch``). Setting the epoch
        a loaded state is in keeps the resume; another epoch starts from its beginning.

        Parameters
        ----------
        epoch : int
            The epoch number (0 or more): with the seeds it fixes the order, crops and flips.
        """
        self._next_epoch = count("epoch", epoch, minimum=0)
        active = self._running()
        if active is None or active is self._carry:
            self._take_next_epoch()  # (a pass mid-epoch reads on; as DistributedSampler's, the next pass takes it)

    def _running(self):
        """The pass being iterated, while it can still deliver (not ended by an error, a stall or
        ``close()``; its iterator may live on in a traceback), else None."""
        active = self._active() if self._active is not None else None
        return active if active is not None and active.threads is not None else None

    def _take_next_epoch(self):
        """Apply the epoch that ``set_epoch`` set, at once or, set during a pass, once it is over."""
        if self._next_epoch is not None:
            epoch, self._next_epoch = self._next_epoch, None
            if epoch != self.epoch:
                self.epoch = epoch
                self._consumed, self._done, self._resume = None, 0, False

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return batches_per_epoch(self.spec)

    # what the next pass is built with; each may be set between epochs (a pass reading ahead made with
    # what was there before gives way): reassign a transform changed in place (loader.batch_transform = m)
    transform = _PassSetting("The crop done inside the pipeline (``RandomResizedCrop``, ``CenterCrop``; "
                             "detection: ``YoloAugment``, ``Letterbox``).")
    batch_transform = _PassSetting("``(images, labels) -> (images, labels)`` on each batch after the crop.")
    pixels = _PassSetting("Whether batches are the decoded ``PixelBatch`` itself.", bool)
    prefetch = _PassSetting("Batches prepared ahead of the training loop.", lambda value: count("prefetch", value))

    @property
    def dataset(self):
        """The dataset the Loader was given (a Subset stays one), as torch's ``DataLoader.dataset``."""
        return self._given

    @dataset.setter
    def dataset(self, value):
        raise ValueError("a Loader's dataset is set when it is made: make a new Loader for another dataset")

    @property
    def batch_size(self) -> int:
        """Samples per batch (torch's ``DataLoader.batch_size``)."""
        return self.spec.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the uneven tail is dropped (torch's ``DataLoader.drop_last``)."""
        return self.spec.drop_last

    def batches_left(self) -> int:
        """Batches the pass being iterated (or, after ``load_state_dict``, the next one) still delivers;
        with no pass under way (none yet, the loop broke out of it, or it ended in an error), the
        next pass's: a whole epoch, since each ``iter()`` starts the epoch again (``state_dict``
        keeps where the broken pass stood)."""
        if self._running() is None and not self._resume:
            return len(self)
        return len(rank_batches(self.spec, self.epoch, self._consumed)) - self._done

    def state_dict(self) -> dict:
        """Where the epoch stands (the same on every rank): save it with the checkpoint.

        Returns
        -------
        dict
            The epoch, the batches delivered (by the pass started last), which samples were
            consumed, and what the state is valid for (the dataset's fingerprint, size, seed,
            shuffle, world size, batch size); plain Python values, so ``torch.save`` and ``json``
            take it.
        """
        consumed = None if self._consumed is None else np.packbits(self._consumed).tobytes().hex()  # (json takes str)
        return {"version": _STATE_VERSION, "dataset": self._dataset_fingerprint(), "epoch": self.epoch,
                "batches_done": self._done, "consumed": consumed, "size": self.spec.size,
                "seed": self.spec.seed, "shuffle": self.spec.shuffle, "block_size": self.spec.block_size,
                "window": self.spec.window, "world_size": self.spec.world_size,
                "batch_size": self.spec.batch_size, "drop_last": self.spec.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` (from ``state_dict``) stood: the next pass resumes there. With
        another world size, batch size or drop_last, the samples the old ranks had not yet delivered
        are split over the new ones, so the epoch still delivers each sample once.

        Parameters
        ----------
        state : dict
            What ``state_dict`` returned, on this dataset. A state of another dataset, a corrupted
            one or one out of range raises ``ValueError`` (``TypeError`` for what is not a dict)
            saying why.
        """
        self._end_passes("loader.load_state_dict() ended it: the next iter(loader) resumes at the loaded state")
        self._next_epoch = None
        fingerprints = {self._dataset_fingerprint(), self._dataset_fingerprint(legacy=True)}
        state = _checked_state(state, self.spec, fingerprints)
        consumed = None
        if state["consumed"] is not None:
            consumed = np.unpackbits(np.frombuffer(state["consumed"], np.uint8), count=self.spec.size).astype(bool)
        same = all(state[k] == getattr(self.spec, k) for k in ("world_size", "batch_size", "drop_last"))
        old = ShardSpec(**{**self.spec.__dict__, "rank": 0, "world_size": state["world_size"],
                           "batch_size": state["batch_size"], "drop_last": state["drop_last"]})
        left = len(rank_batches(old, state["epoch"], consumed))  # the epoch's batches a rank had, as it was split
        if state["batches_done"] > left:
            raise ValueError(f"cannot resume: the state says {state['batches_done']} batches of the epoch were "
                             f"delivered, but it has {left}" + ("" if same else f" (at world size "
                                                                 f"{state['world_size']}, batch size "
                                                                 f"{state['batch_size']})"))
        if same:
            self._consumed, self._done = consumed, state["batches_done"]
        else:  # another topology: what the old ranks delivered is out, the rest is re-split
            if state["batches_done"] == left:
                # the old ranks' epoch was over: what its drop_last left out is not delivered now
                self._consumed = np.ones(self.spec.size, bool)
            else:
                self._consumed = consumed_after(old, state["epoch"], consumed, state["batches_done"])
            self._done = 0
        self.epoch = state["epoch"]
        self._resume = True

    def _dataset_fingerprint(self, legacy=False) -> str:
        """What a state is valid for: the dataset's identity and the samples this loader reads
        (``legacy``: as states saved before ids were read whole have it)."""
        if legacy:
            return self._digest(getattr(self._data, "legacy_fingerprint", self._data.fingerprint))
        if self._fingerprint is None:
            self._fingerprint = self._digest(self._data.fingerprint)
        return self._fingerprint

    def _digest(self, identity: str) -> str:
        digest = hashlib.blake2b(identity.encode(), digest_size=16)
        if self._indices is not None:
            digest.update(self._indices.tobytes())
        return digest.hexdigest()

    def indices(self) -> list[np.ndarray]:
        """The dataset indices of this rank's batches still to come in the current epoch (after
        ``load_state_dict``: of the resumed pass), one array per batch: what iterating reads (with
        ``on_error="skip"`` a bad sample is replaced)."""
        if not self._resume and self._running() is None:
            return self._mapped(rank_batches(self.spec, self.epoch))
        return self._mapped(rank_batches(self.spec, self.epoch, self._consumed)[self._done:])

    def _mapped(self, batches):
        return _mapped(batches, self._indices)

    def _warn_rect(self):
        """Warn of a ``Letterbox(rect=True)`` in a shuffled Loader (at construction, and at the pass
        after ``loader.transform`` is set to one)."""
        transform = self.transform
        if isinstance(transform, D.Letterbox) and transform.rect and self.spec.shuffle and \
                transform != self._rect_warned:  # (one made afresh each epoch with the same arguments: said once)
            self._rect_warned = transform
            log.warning("Letterbox(rect=True) pads each batch to the rectangle its images need: shuffled, a batch "
                        "mixes shapes and pads most of them (Ultralytics turns shuffle off for rect); pass "
                        "indices=gdsdata.Letterbox.rect_order(dataset), shuffle=False")

    # --- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        _check_transforms(self._data, self.transform, self.batch_transform, self.pixels)  # (perhaps set since)
        self._warn_rect()
        self._take_next_epoch()
        if not self._resume:  # a new pass starts its epoch from the beginning
            self._consumed, self._done = None, 0
        self._resume = False
        carry = self._carry
        if carry is not None and carry.epoch == self.epoch and not self._done and self._consumed is None and \
                carry.threads is not None and carry.version == self._version:
            # (a pass stopped by GDSDataset.close(), or made before a transform, batch_transform, pixels or
            # prefetch was set, is not carried on: the epoch starts afresh with what the Loader holds now)
            self._carry = None
            self._active = weakref.ref(carry)  # the pipeline runs on into this epoch
            self._last_stats = carry.stats
            return _EpochIterator(carry)
        self._end_passes("a new iter(loader) replaced it: a Loader runs one pass at a time, and each iter() "
                         "starts the epoch again; peek before the loop, or with a second Loader")
        active = _Prefetcher(self, self.epoch, rank_batches(self.spec, self.epoch, self._consumed)[self._done:])
        self._active = weakref.ref(active)  # a loop that breaks early drops the last reference
        self._last_stats = active.stats  # kept after the pass is gone
        return _EpochIterator(active)

    def stats(self) -> dict:
        """Where the last pass (since the first epoch it served) spent its time: a ``PipelineStats``
        as a dict, or None before the first pass. The stage that is never blocked or idle is the one
        that sets the pace."""
        return None if self._last_stats is None else asdict(self._last_stats)

    def __getattr__(self, name):
        """A torch DataLoader attribute the Loader has not (``loader.sampler.set_epoch(epoch)``, say):
        an AttributeError that says what the Loader does instead."""
        if name in _DATALOADER_ONLY:
            hint = "loader.set_epoch(epoch) does what DistributedSampler.set_epoch does; " \
                if name in ("sampler", "batch_sampler") else ""
            raise AttributeError(f"gdsdata.Loader has no {name} (a torch DataLoader attribute): {hint}"
                                 f"{_DATALOADER_ONLY[name]}")
        raise AttributeError(f"'Loader' object has no attribute {name!r}")

    def close(self) -> None:
        """Stop the prefetch threads, if any (also those already reading the next epoch). A loop still
        running over the Loader gets ``RuntimeError`` from its next ``next()`` rather than an epoch
        that ends early as if it were complete."""
        self._end_passes("loader.close() stopped it before the epoch's end")

    def __enter__(self):
        """``with Loader(...) as loader:`` closes it at the end of the block (the dataset stays open)."""
        return self

    def __exit__(self, *exc):
        self.close()

    def _end_passes(self, why=None):
        """Stop the passes this Loader holds; with ``why`` (another pass replaces them) their next
        ``next()`` raises ``RuntimeError`` saying so instead of ending the loop quietly."""
        for active in (self._active() if self._active is not None else None, self._carry):
            if active is not None:
                active.close(replaced=why)
        self._active = self._carry = None

    def _delivered(self, finished_epoch: bool, prefetcher=None, replaced=0):
        if replaced:
            self.skipped[self.epoch] = self.skipped.get(self.epoch, 0) + replaced
        if finished_epoch:
            self.epoch += 1
            self._consumed, self._done = None, 0
            self._carry = prefetcher  # kept alive: it is reading the next epoch already
            self._take_next_epoch()  # (another epoch than it reads: the next iter() starts that one)
        else:
            self._done += 1

    def __getstate__(self):
        """What ``pickle`` and ``copy.deepcopy`` take: the settings and where the epoch stands, not a
        pass's threads (as torch's DataLoader leaves its iterator out: the copy's next ``iter()``
        starts a pass of its own). A GPU dataset is not copied (``TypeError``), nor a Loader over it."""
        state = self.__dict__.copy()
        state["_active"] = state["_carry"] = None
        return state

    def __repr__(self):
        of = "" if self._indices is None else f" of {len(self._data)}"  # (a Subset's)
        return (f"Loader({self._data!r}, batch_size={self.spec.batch_size}, shuffle={self.spec.shuffle!r}, "
                f"samples={self.spec.size}{of}, rank={self.spec.rank}/{self.spec.world_size})")


def _check_transforms(dataset, transform, batch_transform, pixels):
    """Refuse what the Loader cannot build ``dataset``'s batches with: at construction, and at each
    pass (``transform`` and ``batch_transform`` may be set between epochs)."""
    detect = getattr(dataset, "task", "classify") == "detect"
    if detect and not isinstance(transform, DETECTION_TRANSFORMS):
        raise TypeError(f"{getattr(dataset, 'root', 'this dataset')} is a detection dataset: the Loader builds "
                        f"its batches with transform=gdsdata.YoloAugment(...) (training) or "
                        f"gdsdata.Letterbox(...) (evaluation), got {type(transform).__name__}")
    if detect and (batch_transform is not None or pixels):
        raise ValueError("a detection Loader takes no batch_transform or pixels=True")
    if not detect and isinstance(transform, DETECTION_TRANSFORMS):
        raise TypeError(f"{type(transform).__name__} builds detection batches; "
                        f"{getattr(dataset, 'root', 'this dataset')} is a classification dataset")
    if not detect and transform is not None and not isinstance(transform, (T.RandomResizedCrop, T.CenterCrop)):
        raise TypeError(
            f"transform= takes gdsdata.RandomResizedCrop or gdsdata.CenterCrop (the crop done inside the "
            f"pipeline), got {_qualified(transform)}; pass torchvision v2 transforms and other callables as "
            f"batch_transform=(images, labels) -> (images, labels), after the crop, or per sample as "
            f"GDSDataset(..., transform=) with torch's DataLoader")
    if batch_transform is not None and not callable(batch_transform):
        raise TypeError(f"batch_transform must be a callable (images, labels) -> (images, labels), got "
                        f"{type(batch_transform).__name__}")
    if pixels and (transform is not None or batch_transform is not None):
        raise ValueError("pixels=True hands on decoded pixels; it takes no transform or batch_transform")


_STATE_VERSION = 3  # 3: the mask of delivered samples as hex (2: bytes, still read)
_MAX_RANKS = 1 << 16  # a saved world size beyond this (and the samples) is taken for a damaged state
_STATE_KEYS = {"epoch": int, "batches_done": int, "size": int, "seed": int, "block_size": int, "window": int,
               "world_size": int, "batch_size": int, "drop_last": bool}


def _checked_state(state, spec, fingerprints) -> dict:
    """``state`` checked against this loader (one clear line for anything foreign or corrupted)."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict takes the dict that Loader.state_dict() returned, got "
                        f"{type(state).__name__}")
    missing = [k for k in (*_STATE_KEYS, "shuffle", "consumed") if k not in state]
    if missing:
        raise ValueError(f"cannot resume: the state lacks {', '.join(missing)} (not a gdsdata Loader state)")
    version = state.get("version", 1)
    if not is_integer(version) or version > _STATE_VERSION:
        raise ValueError(f"cannot resume: the state has version {version!r}, this gdsdata reads states up to version "
                         f"{_STATE_VERSION} (saved by a newer gdsdata? upgrade it)")
    for key, kind in _STATE_KEYS.items():
        value = state[key]
        if not (isinstance(value, (bool, np.bool_)) if kind is bool else is_integer(value)):
            raise ValueError(f"cannot resume: the state's {key} is {value!r}, not {kind.__name__}")
        if kind is int and value < 0:
            raise ValueError(f"cannot resume: the state's {key} is {value}, below 0")
    if state.get("dataset") is not None and state["dataset"] not in fingerprints:
        raise ValueError("cannot resume: the state was saved by a Loader over another dataset or other samples "
                         "(its fingerprint differs)")
    for key in ("size", "seed", "shuffle", "block_size", "window"):
        if state[key] != getattr(spec, key):
            raise ValueError(f"cannot resume: the saved loader had {key}={state[key]!r}, this one has "
                             f"{getattr(spec, key)!r}")
    consumed = state["consumed"]
    if isinstance(consumed, str):  # hex (bytes in states saved before 2026-12-05)
        try:
            consumed = bytes.fromhex(consumed)
        except ValueError:
            consumed = b""  # (not hex: refused just below, as a mask that does not fit)
        state = {**state, "consumed": consumed}
    if consumed is not None and (not isinstance(consumed, (bytes, bytearray)) or len(consumed) != -(-spec.size // 8)):
        raise ValueError(f"cannot resume: the state's mask of delivered samples does not fit {spec.size} samples")
    if state["world_size"] == 0 or state["batch_size"] == 0:
        raise ValueError("cannot resume: the state's world_size and batch_size must be positive")
    if state["world_size"] > max(spec.size, spec.world_size, _MAX_RANKS):  # (re-splitting loops over old ranks)
        raise ValueError(f"cannot resume: the state's world_size {state['world_size']} is more than the dataset's "
                         f"{spec.size} samples and {_MAX_RANKS} ranks (a damaged state?)")
    return state


def _shuffle(shuffle):
    if shuffle is True:
        return "full"
    if shuffle is False or shuffle is None:
        return None
    if isinstance(shuffle, str) and shuffle in ("full", "block"):
        return shuffle
    raise ValueError(f"shuffle must be True, False, 'full', 'block' or None, got {shuffle!r}")


# What the Loader uses of a dataset (GDSDataset has it all): its device, length, labels and identity,
# and the two halves of loading a batch, which the pipeline runs on different threads.
_PROTOCOL = ("device", "__len__", "labels", "fingerprint", "read_staged", "decode_staged", "release_staged")


def unwrapped(dataset, indices=None) -> tuple:
    """(the dataset under any torch Subsets, nested too; the positions in it of ``indices``, positions
    in ``dataset``, or of the Subsets' samples, unchecked against its length; None: all of it)."""
    picked = None
    if indices is not None:
        picked = _index_array(indices, "indices")
    while isinstance(dataset, torch.utils.data.Subset):
        outer = _index_array(dataset.indices, "Subset.indices")
        if picked is not None:
            _in_range(picked, len(outer), "indices")
        picked = outer if picked is None else outer[picked]
        dataset = dataset.dataset
    return dataset, picked


def _source(dataset, indices):
    """(GDSDataset, indices or None) from a dataset, a torch Subset of one (nested too) and ``indices``."""
    from gdsdata.dataset import GDSDataset

    dataset, picked = unwrapped(dataset, indices)
    if not isinstance(dataset, GDSDataset) and not all(hasattr(dataset, a) for a in _PROTOCOL):
        raise TypeError(f"gdsdata.Loader reads a gdsdata.GDSDataset or a torch Subset of one, got "
                        f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    if picked is not None:
        picked = _in_range(picked, len(dataset), "indices") % len(dataset)
        if not len(picked):
            raise ValueError("indices is empty: a Loader needs at least one sample")
    return dataset, picked


# torch DataLoader arguments a Loader has no use for, and what it does instead
_DATALOADER_ONLY = {
    "num_workers": "its own I/O, decode and transform threads do the work of DataLoader workers",
    "persistent_workers": "its threads run on from one epoch into the next by themselves",
    "worker_init_fn": "it starts no worker processes",
    "multiprocessing_context": "it starts no worker processes",
    "pin_memory": "batches come on the dataset's device: GDSDataset(root, device='cuda')",
    "pin_memory_device": "batches come on the dataset's device: GDSDataset(root, device='cuda')",
    "prefetch_factor": "prefetch= sets the batches ready ahead (default 2)",
    "timeout": "every wait is bounded by the stall_timeout setting (GDSDATA_STALL_TIMEOUT)",
    "in_order": "batches always come in order",
    "generator": "seed= and the epoch fix the order, crops and flips",
    "sampler": "shuffle= and seed= set the order, indices= (or a Subset) the samples, and DDP ranks are found "
               "in torch.distributed; a sampler that draws anew each epoch (WeightedRandomSampler) needs torch's "
               "DataLoader over the GDSDataset",
    "batch_sampler": "batch_size=, drop_last= and shuffle= make the batches",
    "collate_fn": "batches come stacked (transform=) or as lists of images; batch_transform=(images, labels) -> "
                  "(images, labels) changes them",
}


# their DataLoader defaults, which ask for nothing (code ported from a DataLoader keeps them)
_DATALOADER_DEFAULTS = {"num_workers": 0, "persistent_workers": False, "pin_memory": False, "pin_memory_device": "",
                        "timeout": 0, "in_order": True}


def _at_default(name, value) -> bool:
    """``value`` is the DataLoader's default for ``name`` (any number equal to it, as the DataLoader
    takes ``timeout=0.0`` or ``pin_memory=0``; None where that is the default)."""
    if name not in _DATALOADER_DEFAULTS:
        return value is None
    default = _DATALOADER_DEFAULTS[name]
    if isinstance(default, str):
        return value == default
    return isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)) and value == default


def _no_dataloader_arguments(given: dict):
    """A torch DataLoader argument gets one line saying what the Loader does instead, unless it is
    the DataLoader's default (or None where that is None); any other unknown keyword, Python's own
    TypeError."""
    for name in given:
        if name not in _DATALOADER_ONLY:
            raise TypeError(f"Loader.__init__() got an unexpected keyword argument {name!r}")
    given = {name: value for name, value in given.items() if not _at_default(name, value)}
    if given:
        name = next(iter(given))
        raise TypeError(f"Loader takes no {name}= (a torch DataLoader argument): {_DATALOADER_ONLY[name]}; "
                        f"docs/usage.md, 'torch habit -> gdsdata'")


def _no_sample_transforms(dataset):
    """A dataset opened with per-sample transforms is refused: ``ds[i]`` applies them, the Loader's
    pipeline does not, and training on untransformed batches would go unnoticed."""
    given = [name for name in SAMPLE_TRANSFORMS if getattr(dataset, name, None) is not None]
    if given:
        own = ("its own transform=gdsdata.YoloAugment(...) (training) or gdsdata.Letterbox(...) (evaluation), "
               "which moves the boxes with the pixels" if getattr(dataset, "task", "classify") == "detect" else
               "its own transform= (gdsdata.RandomResizedCrop or CenterCrop) and batch_transform=(images, labels) "
               "-> (images, labels)")
        raise ValueError(
            f"{getattr(dataset, 'root', 'the dataset')} was opened with GDSDataset(..., {'=, '.join(given)}=), which "
            f"ds[i] applies per sample but gdsdata.Loader does not: the Loader applies {own} to whole batches; open "
            f"the dataset without them and pass the Loader its transform, or keep them and read the dataset with "
            f"torch's DataLoader")


def _index_array(values, name) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D sequence of integers, got {array.dtype} of shape {array.shape}")
    return array.astype(np.int64)


def _in_range(picked, n, name):
    if len(picked) and (picked.min() < -n or picked.max() >= n):
        bad = picked[(picked < -n) | (picked >= n)][0]
        raise IndexError(f"{name} holds {bad}, out of range for {n} samples")
    return picked


def _mapped(batches, indices):
    """Batches of positions in a Loader's samples as dataset indices (``indices``: a subset's, or
    None where they are the same)."""
    return batches if indices is None else [indices[b] for b in batches]


def _epochs(spec, first_epoch, first_batches, indices=None, copies=None):
    """What the I/O thread reads: the rest of this epoch, then whole epochs after it, as (epoch, the
    batches' dataset indices, their positions in the Loader's samples, each batch's ``copies`` or
    None): ``indices`` maps positions to the dataset's samples (a subset), None where they are the
    same; ``copies`` (``_copies``) tells the repeats of a draw with repeats apart."""
    epoch, batches = first_epoch, first_batches
    while True:
        yield epoch, _mapped(batches, indices), batches, None if copies is None else [copies[b] for b in batches]
        epoch += 1
        batches = rank_batches(spec, epoch)


def _batch_seed(seed: int, epoch: int, rank: int, number: int) -> int:
    """The torch seed a batch's ``batch_transform`` runs under."""
    return int(T.uniforms(seed ^ 0x6A09E667F3BCC908, epoch, [(rank << 32) | number], 1)[0, 0] * 2**53)


def _copies(indices):
    """For each of a Loader's samples, how many of the samples before it are the same dataset
    sample (``indices=`` drawn with repeats, as a WeightedRandomSampler draws), or None where none
    repeats. A crop is drawn from the sample's index and this count, so each copy gets its own."""
    if indices is None:
        return None
    order = np.argsort(indices, kind="stable")
    ranked = indices[order]
    first = np.r_[True, ranked[1:] != ranked[:-1]]
    if first.all():
        return None
    copies = np.empty(len(indices), np.int64)
    copies[order] = np.arange(len(ranked)) - np.maximum.accumulate(np.where(first, np.arange(len(ranked)), 0))
    return copies


class _BatchMaker:
    """What the decode and transform threads need of a Loader (and nothing that keeps the Loader
    alive)."""

    def __init__(self, loader):
        self.dataset, self.transform, self.pixels = loader._data, loader.transform, loader.pixels
        self.detect = isinstance(loader.transform, DETECTION_TRANSFORMS)
        # the mosaic partners of a batch under 4 images are drawn from the samples the Loader reads
        self.population = (np.arange(len(loader._data)) if loader._indices is None else loader._indices) \
            if self.detect else None

    def sources(self, indices, epoch):
        """What the I/O thread reads for a batch: the batch, and the mosaic partners of a detection batch."""
        return self.transform.sources(indices, epoch, self.population) if self.detect else indices

    def decode(self, staged, stream, epoch):
        """Staged payloads -> a PixelBatch, its sample indices (after any replacement) and the
        batch's own samples. Nothing else: on the GPU this thread keeps the JPEG engines fed."""
        batch, indices = self.dataset.decode_staged(staged, stream)
        asked = staged.indices if staged.asked is None else staged.asked
        return batch, indices, sum(a != b for a, b in zip(asked, indices)), staged.outputs, staged.copies

    def finish(self, decoded, stream, epoch):
        """One decoded batch -> (images, labels): its transform, or with ``pixels=True`` the
        PixelBatch itself; a detection batch -> (images, targets) or Ultralytics' batch dict."""
        batch, indices, replaced, outputs, copies = decoded
        if stream is not None and batch.owned and (self.detect or not self.pixels):
            batch.buffer.record_stream(stream)  # this stream reads it last
        if self.detect:
            # a Letterbox's torchvision targets keep COCO's crowd boxes, flagged (as ds.target(i) and COCO's
            # evaluation take them); training batches and Ultralytics' leave them out
            crowds = isinstance(self.transform, D.Letterbox) and self.transform.targets == "torchvision"
            boxes, labels, flags = D.source_boxes(self.dataset.index, indices, crowds)
            plan = D.plan(self.transform, batch.heights, batch.widths, boxes, labels, outputs, epoch)
            images = D.render(self.transform, batch.buffer, batch.offsets, batch.channels, plan)
            batch.release(stream)
            names = [self.dataset.source(int(i)) for i in indices[:len(outputs)]] \
                if self.transform.targets == "ultralytics" else None
            ids = self.dataset.index.image_ids
            ids = [ids[int(i)] for i in indices[:len(outputs)]] if ids is not None else None
            return images, D.batch_form(self.transform, plan, images, names, ids, flags if crowds else None), replaced
        labels = upload(torch.from_numpy(self.dataset.labels[indices]), self.dataset.device)
        if self.pixels:
            return batch, labels, replaced  # released by the consumer's next step
        if self.transform is not None:
            keys = indices if copies is None else np.asarray(indices, np.int64) + (copies << _COPY_SHIFT)
            params = self.transform.params(batch.heights, batch.widths, keys, epoch)
            images = T.apply(self.transform, batch.buffer, batch.offsets, batch.heights, batch.widths,
                             batch.channels, params)
        else:
            images = [batch.image(k) for k in range(len(batch))]
        batch.release(stream)
        return images, labels, replaced


def _tensors(value) -> list:
    """The tensors in a batch's images or labels (a tensor, or lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _put(q, stop, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_STOP_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _release(dataset, kind, payload):
    """Hand back what a queued item holds that would otherwise wait for a consumer: the staging slot
    of a staged batch, or the buffer of a decoded one (raw samples used in their staging slot)."""
    if kind == "staged":
        dataset.release_staged(payload)
    elif kind == "decoded" or (kind == "batch" and isinstance(payload[0], PixelBatch)):
        payload[0].release(None)


@dataclass
class PipelineStats:
    """Host seconds the stages of a Loader pass spent since it began (``Loader.stats()``). GPU work
    is queued asynchronously: its time shows only where a host thread waits for it, and in
    ``consumer_gpu_wait_s``, the time the training loop's stream stood idle on the GPU for want of
    a batch: from the moment the work it had queued when it asked for the batch was done until the
    batch's decode and transform were (CUDA events; a GPU left idle while the loop waited on the
    host counts, a loop ahead of its GPU waits on the host alone)."""

    batches: int = 0  # batches handed to the training loop
    read_s: float = 0.0  # I/O thread: planning and reading batches into staging buffers
    read_blocked_s: float = 0.0  # I/O thread: waiting to hand a staged batch on (decode is behind)
    decode_s: float = 0.0  # decode thread: queuing decodes and label uploads
    decode_idle_s: float = 0.0  # decode thread: waiting for a staged batch (reads are behind)
    decode_blocked_s: float = 0.0  # decode thread: waiting to hand a batch on (transforms are behind)
    transform_s: float = 0.0  # transform thread: crop parameters and queuing the transform
    transform_idle_s: float = 0.0  # transform thread: waiting for a decoded batch (decode is behind)
    transform_blocked_s: float = 0.0  # transform thread: waiting to hand a batch on (the loop is behind)
    consumer_wait_s: float = 0.0  # the training loop waiting for its next batch
    consumer_gpu_wait_s: float = 0.0  # the loop's CUDA stream idle on the GPU for want of a batch
    read_bytes: int = 0  # bytes the batches' reads covered (the holes they read through included)

    def add(self, field: str, seconds: float):
        setattr(self, field, getattr(self, field) + seconds)


def _read_ahead(dataset, epochs, q, stop, stats, activity, sources, overlap=1, windows=None):
    """The I/O thread: storage -> staging buffers, as far ahead as the queue allows, on into the
    next epochs (an "end" marker between epochs). ``sources(indices, epoch)``: what a batch reads.
    ``overlap`` > 1: that many batches read at once, on threads of their own, handed on in order
    (streaming reads: the drive's queue stays full from one batch to the next); ``windows``: the
    Loader's ShardSpec where each shuffle window is read at once (``_EpochWindows``)."""
    if overlap > 1:
        return _read_overlapped(dataset, epochs, q, stop, stats, activity, sources, overlap, windows)
    try:
        for epoch, batches, _, copies in epochs:
            for number, indices in enumerate(batches):
                if stop.is_set():
                    return
                activity.start(epoch, number)
                t0 = time.perf_counter()
                indices = indices.tolist()
                staged = dataset.read_staged(sources(indices, epoch))
                staged.outputs, staged.copies = indices, None if copies is None else copies[number]
                t1 = time.perf_counter()
                activity.stop()
                if not _hand_on(dataset, q, stop, stats, staged, epoch, number, t0, t1):
                    return
            if not _put(q, stop, ("end", None, epoch, None, None)):
                return
    except BaseException as e:  # noqa: BLE001 - handed on, raised by the consumer
        activity.stop()
        _put(q, stop, ("error", e, None, None, None))


def _read_overlap(dataset, batch_size: int) -> int:
    """Batches the I/O thread reads at once: for streaming reads (``reads=direct``: every byte from
    the drive, whose queue would drain between one batch's last read and the next batch's first) as
    many as keep the ``direct_ahead`` setting's bytes in flight, 2 to 8; else one (reads from the
    page cache, or kvikio's own threads)."""
    path = getattr(dataset, "load_path", None)
    if getattr(path, "reads", None) != "direct":
        return 1
    config = getattr(dataset, "settings", None) or settings.snapshot()
    lengths = dataset.index.samples["length"]
    batch_bytes = max(1, int(lengths.mean() * batch_size)) if len(lengths) else 1
    return min(_MAX_OVERLAP, max(2, -(-config["direct_ahead"] // batch_bytes)))


def _windowed(dataset, spec) -> bool:
    """Whether a Loader reads each shuffle window at once (``_EpochWindows``): streaming reads of
    block-shuffled batches smaller than a window (a batch of a window or more reads whole blocks by
    itself)."""
    return spec.shuffle == "block" and spec.window * spec.block_size > spec.batch_size \
        and getattr(getattr(dataset, "load_path", None), "reads", None) == "direct" and hasattr(dataset, "read_window")


class _EpochWindows:
    """The shuffle windows of one epoch of this rank's batches (streaming reads, block shuffle):
    each run of consecutive samples that the epoch draws from one window (``sampler.window_numbers``
    of their ``positions`` in the Loader's samples) becomes one ``GDSDataset.read_window``, and a
    batch is filled from the windows its samples lie in (two where it straddles the end of one:
    batch sizes that do not divide a window, DDP shares, resumed epochs). Calling it with a batch's
    number gives that batch's windows; the window after them is planned then too and queued on
    ``loads``, so that the drive reads it while these are copied out. ``stats.read_bytes`` counts
    the windows' reads (their batches' are copies)."""

    def __init__(self, dataset, spec, epoch, batches, positions, loads, stats):
        lengths = np.array([len(b) for b in batches], np.int64)
        self.samples = np.concatenate(batches) if len(batches) else np.zeros(0, np.int64)
        numbers = window_numbers(spec, epoch)[np.concatenate(positions) if len(positions) else self.samples]
        starts = np.flatnonzero(np.r_[True, numbers[1:] != numbers[:-1]]) if len(numbers) else numbers
        self.bounds = np.r_[starts, len(self.samples)]
        ends = np.cumsum(lengths)
        self.first = np.searchsorted(starts, ends - lengths, "right") - 1  # each batch's first and last run
        self.last = np.searchsorted(starts, ends - 1, "right") - 1
        marks = np.zeros(len(starts) + 1, np.int64)
        np.add.at(marks, self.first, 1)
        np.add.at(marks, self.last + 1, -1)
        self.uses = np.cumsum(marks[:-1])  # the batches drawing from each run
        self.dataset, self.loads, self.stats, self.made = dataset, loads, stats, {}

    def __call__(self, number: int) -> list:
        first, last = int(self.first[number]), int(self.last[number])
        for run in range(first, min(last + 2, len(self.uses))):
            if run not in self.made:
                lo, hi = int(self.bounds[run]), int(self.bounds[run + 1])
                window = self.dataset.read_window(self.samples[lo:hi], int(self.uses[run]))
                if window is not None:
                    # (a failure stays with the window: its batches raise it)
                    self.loads.submit(_bounded_by(self.dataset, window.load_ahead))
                    self.stats.read_bytes += int(window.plan.total)
                self.made[run] = window
        for run in [r for r in self.made if r < first]:  # windows no batch still to come draws from
            del self.made[run]
        return [self.made[r] for r in range(first, last + 1) if self.made[r] is not None]

    def abandon(self):
        """The pass stopped: the windows planned ahead are not read."""
        for window in self.made.values():
            if window is not None:
                window.abandon()


def _hand_on(dataset, q, stop, stats, staged, epoch, number, t0, t1, counted=True) -> bool:
    """Queue a staged batch read from ``t0`` to ``t1`` for decode (False: the pass stopped, the
    batch's staging handed back). ``counted``: its reads go into ``stats.read_bytes`` (not a batch
    copied from windows, whose reads are counted)."""
    handed = _put(q, stop, ("staged", staged, epoch, number, None))
    stats.read_s += t1 - t0
    if counted:
        stats.read_bytes += int(getattr(staged.plan, "total", 0))
    stats.read_blocked_s += time.perf_counter() - t1
    if not handed:
        _release(dataset, "staged", staged)
    return handed


class _Reading:
    """A batch read on a read-ahead thread: its future, that thread once it has started (the stall
    watchdog looks there for the native call the batch waits in), and when the read began."""

    def __init__(self, pool, dataset, planned, outputs, copies=None, windows=()):
        self.dataset, self.planned, self.outputs, self.windows = dataset, planned, outputs, windows
        self.copies = copies
        self.thread, self.started = None, None
        self.future = pool.submit(_bounded_by(dataset, self._run))  # (its waits: as the pass's threads')

    def _run(self):
        self.thread, self.started = threading.current_thread(), time.monotonic()
        if self.windows:
            staged = self.dataset.read_staged(self.planned, windows=self.windows)
        else:
            staged = self.dataset.read_staged(self.planned)
        staged.outputs, staged.copies = self.outputs, self.copies
        return staged


def _read_overlapped(dataset, epochs, q, stop, stats, activity, sources, overlap, windows=None):
    """``_read_ahead`` with ``overlap`` batches in flight on as many threads; with ``windows`` (the
    Loader's ShardSpec) each shuffle window read at once, on a thread of its own (``_EpochWindows``)."""
    from concurrent import futures

    from gdsdata.threads import DaemonPool

    pool = loads = None
    planned = collections.deque(maxlen=2)  # _EpochWindows of this epoch and the last (both may have batches pending)
    pending = collections.deque()  # (epoch, number, _Reading), or (epoch, None, None) for an epoch's end marker
    own = activity.thread

    def hand_on_first() -> bool:
        epoch, number, reading = pending.popleft()
        if reading is None:
            return _put(q, stop, ("end", None, epoch, None, None))
        activity.start(epoch, number)
        t0 = time.perf_counter()
        while not futures.wait([reading.future], _STOP_POLL_S).done:
            if stop.is_set():  # to the finally at once: what is still to be read is dropped there
                pending.appendleft((epoch, number, reading))
                activity.stop()
                activity.thread = own
                return False
            activity.thread = reading.thread or own
            if reading.started is not None:  # the stall bound counts from when the read began
                activity.since = reading.started
        staged = reading.future.result()  # a failed read raises here, in order
        t1 = time.perf_counter()
        activity.stop()
        activity.thread = own
        return _hand_on(dataset, q, stop, stats, staged, epoch, number, t0, t1, counted=not reading.windows)

    def hand_on_ready() -> bool:
        """Hand on what is done at the head of ``pending``, and wait for the head while
        ``overlap`` batches are in flight."""
        while pending:
            head = pending[0][2]
            if head is not None and not head.future.done() and \
                    sum(reading is not None for _, _, reading in pending) < overlap:
                return True
            if not hand_on_first():
                return False
        return True

    try:
        pool = DaemonPool(overlap, "gdsdata-read-ahead")
        loads = DaemonPool(1, "gdsdata-window") if windows is not None else None
        for epoch, batches, positions, copies in epochs:
            batches = list(batches)
            shared = _EpochWindows(dataset, windows, epoch, batches, positions, loads, stats) \
                if windows is not None else None
            planned.append(shared)
            for number, indices in enumerate(batches):
                if stop.is_set():
                    return
                indices = indices.tolist()
                pending.append((epoch, number, _Reading(pool, dataset, sources(indices, epoch), indices,
                                                        None if copies is None else copies[number],
                                                        shared(number) if shared is not None else ())))
                if not hand_on_ready():
                    return
            pending.append((epoch, None, None))
            if not hand_on_ready():
                return
    except BaseException as e:  # noqa: BLE001 - handed on, raised by the consumer
        activity.stop()
        activity.thread = own
        _put(q, stop, ("error", e, None, None, None))
    finally:  # no read still writing into a staging buffer once this thread ends; theirs handed back
        for shared in planned:  # first: the batches still to be read are dropped, their windows not read
            if shared is not None:
                shared.abandon()
        for _, _, reading in pending:
            if reading is not None:
                try:
                    _release(dataset, "staged", reading.future.result())
                except BaseException:  # noqa: BLE001, S110 - a read that failed holds nothing
                    pass
        if pool is not None:
            pool.shutdown()
        if loads is not None:  # a window read under way ends before the dataset may close its files
            loads.shutdown(wait_s=_stall_timeout(dataset))


def _stall_timeout(dataset) -> float:
    """A pass's stall bound: the lower of its dataset's setting (a dataset keeps the settings it was
    built with) and the one in force now (``settings.set`` around the loop)."""
    return stall.bound(_kept_bound(dataset))


def _kept_bound(dataset):
    return (getattr(dataset, "settings", None) or {}).get("stall_timeout")


def _bounded_by(dataset, target):
    """``target`` with the waits of the thread that runs it (GPU events, nvJPEG's lock) bounded as
    the pass's stall bound is (``_stall_timeout``)."""
    kept = _kept_bound(dataset)

    def run(*args):
        with stall.bounded(kept):
            return target(*args)

    return run


# The stages after the I/O thread: (name, the kind of item it takes, the kind it hands on).
_DECODE, _TRANSFORM = ("decode", "staged", "decoded"), ("transform", "decoded", "batch")


def _stage(step, work, dataset, in_q, out_q, stop, stream, device, stats, activity):
    """A pipeline thread: each item of ``in_q`` of the kind ``step`` takes goes through ``work`` on
    this thread's CUDA stream (after the event of the stage before) and on to ``out_q`` with the
    event that ends this stream's work so far; "end" and "error" markers pass through. Its host
    seconds go to ``stats`` under the step's name: working, idle (the stage before is behind),
    blocked (the next is); ``activity`` says which batch it works on, for the stall watchdog."""
    name, takes, gives = step
    try:
        if stream is not None:
            torch.cuda.set_device(device)
            torch.cuda.set_stream(stream)  # this thread's current stream from now on
        idle_since = time.perf_counter()
        while not stop.is_set():
            try:
                kind, payload, epoch, number, event = in_q.get(timeout=_STOP_POLL_S)
            except queue.Empty:
                continue
            t0 = time.perf_counter()
            stats.add(f"{name}_idle_s", t0 - idle_since)
            if kind != takes:
                if not _put(out_q, stop, (kind, payload, epoch, number, None)) or kind == "error":
                    return
                idle_since = time.perf_counter()
                continue
            activity.start(epoch, number)
            if event is not None:
                stream.wait_event(event)
            result = work(payload, stream, epoch)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            activity.stop()
            t1 = time.perf_counter()
            handed = _put(out_q, stop, (gives, result, epoch, number, event))
            idle_since = time.perf_counter()
            stats.add(f"{name}_s", t1 - t0)
            stats.add(f"{name}_blocked_s", idle_since - t1)
            if not handed:
                _release(dataset, gives, result)
                return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
        activity.stop()
        _put(out_q, stop, ("error", e, None, None, None))


_LIVE = weakref.WeakSet()  # passes whose threads may be running
_EXIT_GRACE_S = 5.0


def _close_at_exit():
    """Stop every Loader pass before the interpreter finalises: a daemon thread still inside a torch
    call when Python tears itself down makes torch call std::terminate (exit status 134). Bounded: a
    thread stuck in a call is left behind after a few seconds."""
    for active in list(_LIVE):
        try:
            active.close(grace=_EXIT_GRACE_S)
        except Exception:  # noqa: BLE001 - at exit, nothing more to do
            pass
    cpu = sys.modules.get("gdsdata.decode.cpu")  # the CPU work those passes gave the shared pool
    if cpu is not None:
        cpu.drain(_EXIT_GRACE_S)
    decoders = sys.modules.get("gdsdata.decode.gpu")  # then the GPU decoders no dataset uses
    if decoders is not None:
        decoders.close_idle()


atexit.register(_close_at_exit)


class _EpochIterator:
    """What ``iter(loader)`` hands out: one epoch of a pass. Once it has ended it stays ended, as a
    Python iterator does (``next()`` raises ``StopIteration`` again), while the pass it drew from
    reads on into the next epoch for the next ``iter()``. Holds the pass: dropping the iterator
    mid-epoch stops the pass's threads. A batch whose making raised (a corrupt sample, an error in a
    transform) is skipped by the ``next()`` after the error, which goes on with the epoch's next
    batch, as torch's DataLoader does (not after a stall, a ``set_epoch``, nor once another pass
    replaced this one)."""

    __slots__ = ("_pass", "_ended", "_failed", "__weakref__")

    def __init__(self, prefetcher):
        self._pass, self._ended, self._failed = prefetcher, False, False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Batches per epoch for this rank, as ``len()`` of a DataLoader's iterator."""
        loader = self._pass._loader()
        return len(loader) if loader is not None else 0

    def __next__(self):
        if self._ended:
            raise StopIteration
        if self._failed:
            self._failed = False
            try:
                self._pass = self._pass.after_failure()
            except BaseException:  # (StopIteration too; a pass that could not be made ends the iterator)
                self._ended = True
                raise
        try:
            return self._pass.__next__()
        except StopIteration:
            self._ended = True
            raise
        except Exception as e:
            loader = self._pass._loader()
            if loader is not None:
                self._pass.failed_at = (loader.epoch, loader._done)
            self._failed = not isinstance(e, StallError) and self._pass.can_go_on()
            raise

    def __getattr__(self, name):  # the pass's stats, close() ... (not its private or special names)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._pass, name)


class _Prefetcher:
    """The iterator of a pass: an I/O thread, a decode thread and a transform thread filling bounded
    queues, and clean shutdown. At the end of an epoch it stops iterating but its threads read on into the next
    epoch; the Loader keeps it and hands it out again for that epoch."""

    def __init__(self, loader: Loader, epoch, batches, stats=None):  # batches: positions in the Loader's samples
        # A weak reference: a Loader holds the pass it carries into the next epoch, and a cycle would
        # keep a dropped Loader's threads reading (and holding staging buffers) until the garbage
        # collector happened to run. The threads hold neither.
        self._loader = weakref.ref(loader)
        self.version = loader._version  # the Loader's settings it was built with
        self.epoch = epoch  # the epoch whose batches come next
        self.cuda = loader._data.device.type == "cuda"
        self.device = loader._data.device
        self.whole_dict = (isinstance(loader.transform, DETECTION_TRANSFORMS)
                           and loader.transform.targets == "ultralytics")  # the batch is one dict
        self.queue = queue.Queue(maxsize=loader.prefetch)
        self.stop = threading.Event()
        self._closing = threading.RLock()  # one close() at a time: the loop's own, another thread's, the GC's
        # a CUDA stream per stage: the next batch's decode never queues behind this one's transform
        self.streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in (_DECODE, _TRANSFORM)]
        self.staged = queue.Queue(maxsize=2)
        self.decoded = queue.Queue(maxsize=1)
        self.held = None  # a PixelBatch handed to the consumer (pixels=True), released at the next step
        self.gpu_waits = collections.deque()  # (before, after) events around the loop stream's waits
        self.closed_by = None  # why the dataset closed this pass under a running loop
        self.replaced = None  # why the Loader ended this pass for another (a new iter(), a loaded state)
        self.failed_at = None  # (epoch, batches done) where a batch of this pass raised
        self.stats = PipelineStats() if stats is None else stats
        self.batch_transform, self.seed, self.rank = loader.batch_transform, loader.spec.seed, loader.spec.rank
        self.first = (epoch, loader._done)  # the batches delivered of the epoch it starts in, before it
        # The threads hold no reference to this object, so dropping the iterator stops them.
        self.dataset = loader._data
        maker = _BatchMaker(loader)
        # what each thread works on, for the stall watchdog (``stall.stalled``)
        self.activities = [stall.Activity(name) for name in ("read", _DECODE[0], _TRANSFORM[0])]
        overlap = _read_overlap(loader._data, loader.spec.batch_size)
        windowed = not maker.detect and _windowed(loader._data, loader.spec)  # (mosaic partners: anywhere)
        self.threads = [
            threading.Thread(target=_bounded_by(loader._data, _read_ahead), name="gdsdata-read", daemon=True,
                             args=(loader._data, _epochs(loader.spec, epoch, batches, loader._indices, loader._copies),
                                   self.staged,
                                   self.stop, self.stats, self.activities[0], maker.sources, overlap,
                                   loader.spec if windowed else None)),
        ] + [threading.Thread(target=_bounded_by(loader._data, _stage), name=f"gdsdata-{step[0]}", daemon=True,
                              args=(step, work, loader._data, in_q, out_q, self.stop, stream, self.device,
                                    self.stats, activity))
             for step, work, in_q, out_q, stream, activity in zip(
                 (_DECODE, _TRANSFORM), (maker.decode, maker.finish), (self.staged, self.decoded),
                 (self.decoded, self.queue), self.streams, self.activities[1:])]
        for thread, activity in zip(self.threads, self.activities):
            activity.thread = thread
        reserve = getattr(loader._data, "reserve_staging", None)
        if reserve is not None:  # staged batches this pass can hold at once: in flight, queued for decode,
            # decoding, queued for the transform, transforming (and with pixels=True those handed on)
            reserve(overlap + self.staged.maxsize + 1 + self.decoded.maxsize + 1
                    + (self.queue.maxsize + 1 if loader.pixels else 0))
        register = getattr(loader._data, "register_pass", None)  # GDSDataset.close() stops its passes
        if register is not None:
            register(self)
        _LIVE.add(self)
        for thread in self.threads:
            thread.start()

    def __iter__(self):
        return self

    def _tell_loader(self, **progress):
        loader = self._loader()
        if loader is not None:
            loader._delivered(**progress)

    def _release_held(self):
        if self.held is not None:
            self.held.release(torch.cuda.current_stream(self.device) if self.cuda else None)
            self.held = None

    def _closed(self):
        """Raise what ends a closed pass's ``next()``: why it was closed under the loop, else the end."""
        if self.closed_by is not None:
            raise GdsDataError(f"the Loader's dataset was closed while it was reading ({self.closed_by})")
        if self.replaced is not None:
            raise RuntimeError(f"this gdsdata Loader iterator has ended: {self.replaced}")
        raise StopIteration

    def __next__(self):
        if self.threads is None:
            self._closed()
        with self._closing:  # (a close() from another thread releases it too: once)
            self._release_held()
        t0 = time.perf_counter()
        # the GPU's side of the wait begins once the work the loop queued so far is done: timed from here,
        # it counts a GPU left idle while this thread waits for the batch, not only the stream's own wait
        asked = self._gpu_mark() if self.cuda else None
        timeout = _stall_timeout(self.dataset)
        waited = stall.Waited(_STOP_POLL_S)
        while True:
            try:
                kind, payload, _, number, event = self.queue.get(timeout=_STOP_POLL_S)
                self.stats.consumer_wait_s += time.perf_counter() - t0
                break
            except queue.Empty:
                threads = self.threads
                if threads is None or self.stop.is_set():  # closed by another thread meanwhile (loader.close(),
                    with self._closing:  # the dataset's close()): once its close() is done, why
                        self._closed()
                if not threads[-1].is_alive() and self.queue.empty():
                    self.close()
                    raise GdsDataError("gdsdata Loader: its transform thread stopped without a result") from None
                # a stall: this loop has waited the bound (of running time: not while the process was
                # stopped, after which the stages carry on) with a stage on one batch as long
                error = stall.stalled(self.activities, timeout) if waited.poll() >= timeout else None
                if error is not None:
                    log.error("%s", error)
                    self.close()
                    raise error from None
        if kind == "end":
            self.epoch += 1
            self._tell_loader(finished_epoch=True, prefetcher=self)
            raise StopIteration
        if kind == "error":
            self.close()
            raise payload
        images, labels, replaced = payload
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            self._time_gpu_wait(current, event, asked)
            if isinstance(images, PixelBatch):
                tensors = [images.buffer]
                self.held = images
            else:
                tensors = _tensors(images) + _tensors(labels)
            for tensor in tensors:
                tensor.record_stream(current)
        elif isinstance(images, PixelBatch):
            self.held = images
        if self.batch_transform is not None:
            try:
                images, labels = self._batch_transformed(images, labels, number)
            except BaseException:
                self.close()
                raise
        self.stats.batches += 1
        self._tell_loader(finished_epoch=False, replaced=replaced)
        if self.whole_dict:  # Ultralytics' batch dict holds the images too
            return labels
        return images, labels

    def can_go_on(self) -> bool:
        """Whether the epoch can go on past the batch this pass failed on: its Loader holds it still
        (no other pass replaced it, the dataset was not closed under it)."""
        loader = self._loader()
        return (self.closed_by is None and self.replaced is None and loader is not None
                and loader._active is not None and loader._active() is self
                and (self.failed_at is None or self.failed_at == (loader.epoch, loader._done)))

    def after_failure(self) -> "_Prefetcher":
        """A pass for the rest of the epoch after the batch this one failed on, which is skipped;
        ``StopIteration`` where that was the epoch's last batch."""
        loader = self._loader()
        if not self.can_go_on():
            raise StopIteration
        rest = rank_batches(loader.spec, loader.epoch, loader._consumed)[loader._done + 1:]
        if not len(rest):
            loader._delivered(finished_epoch=False)
            loader._delivered(finished_epoch=True)
            raise StopIteration
        loader._done += 1  # (the batch that failed: counted, as a resume skips it)
        try:
            after = _Prefetcher(loader, loader.epoch, rest, self.stats)
        except BaseException:
            loader._done -= 1
            raise
        loader._active = weakref.ref(after)
        loader._last_stats = after.stats
        return after

    def _batch_transformed(self, images, labels, number):
        """``batch_transform`` on a batch, in the training loop's thread and stream, with torch's
        random generators (the CPU's and this GPU's) seeded for the batch (the Loader's seed, the
        epoch, the rank, the batch's number in the epoch) and given back as they were: its draws
        (MixUp's, CutMix's) repeat run to run and on a resume, and leave the loop's own draws
        (dropout, say) as they would be without it."""
        number += self.first[1] if self.epoch == self.first[0] else 0  # (its number in the whole epoch)
        seed = _batch_seed(self.seed, self.epoch, self.rank, number)
        devices = [torch.cuda.current_device() if self.device.index is None else self.device.index] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            for device in devices:
                torch.cuda.default_generators[device].manual_seed(seed)
            out = self.batch_transform(images, labels)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"batch_transform must return (images, labels), got {type(out).__name__}; wrap a "
                            f"transform of images alone as lambda images, labels: (t(images), labels)")
        return out

    def _gpu_mark(self):
        """A timing event recorded on the loop's stream now (None when the timing is far behind)."""
        while self.gpu_waits and self.gpu_waits[0][1].query():
            before, after = self.gpu_waits.popleft()
            self.stats.consumer_gpu_wait_s += before.elapsed_time(after) / 1000
        if len(self.gpu_waits) >= 64:  # far behind: stop timing rather than hold events
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def _time_gpu_wait(self, stream, event, asked):
        """Make ``stream`` wait for ``event``, timing on the GPU how long it stands still from ``asked``
        (``_gpu_mark`` when the loop asked for the batch) until the batch is ready (added to the stats
        once the events have completed)."""
        stream.wait_event(event)
        if asked is not None:
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self.gpu_waits.append((asked, after))

    def close(self, reason=None, grace=None, replaced=None):
        """Stop the threads, waiting for them at most ``grace`` seconds (default: the stall_timeout
        setting); with ``reason`` (the dataset was closed under the loop) or ``replaced`` (the Loader
        started another pass) the next ``next()`` raises instead of ending the epoch quietly."""
        with self._closing:  # (a second close() finds the first's work done)
            self._close(reason, grace, replaced)

    def _close(self, reason, grace, replaced):
        if self.threads is None:
            return
        self.closed_by, self.replaced = reason, replaced
        self.stop.set()
        self._release_held()
        me = threading.current_thread()  # the garbage collector may run this in a prefetch thread
        deadline = time.monotonic() + (_stall_timeout(self.dataset) if grace is None else grace)
        while True:  # drain while the threads wind down: a thread may wait for a slot or a place
            self._drain()
            alive = [t for t in self.threads if t.is_alive() and t is not me]
            if not alive or time.monotonic() > deadline:
                break
            alive[0].join(timeout=_STOP_POLL_S)
        self._drain()
        stuck = [t.name for t in self.threads if t.is_alive() and t is not me]
        self.threads = None
        if stuck:  # inside a call that does not return (a hung decode): left behind, daemon threads
            log.error("gdsdata Loader closed with %s still inside a call that has not returned; left "
                      "behind", ", ".join(stuck))
            return
        for stream in self.streams:
            if stream is not None:
                stall.wait(stream, "the GPU work of a closing Loader pass")

    def _drain(self):
        """Hand back the staging slots and buffers of batches that will never be consumed."""
        for q in (self.staged, self.decoded, self.queue):
            while True:
                try:
                    kind, payload, _, _, _ = q.get_nowait()
                except queue.Empty:
                    break
                _release(self.dataset, kind, payload)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
