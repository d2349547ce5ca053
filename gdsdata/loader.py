"""``Loader``: batches for a training loop, prefetched, sharded over ranks, resumable mid-epoch.

    loader = gdsdata.Loader(ds, batch_size=256, shuffle="full", seed=0,
                            transform=gdsdata.RandomResizedCrop(224))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:   # images: N x 3 x 224 x 224 float16 on ds.device
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

import logging
import queue
import threading
import time
import weakref
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import settings, stall
from . import transforms as T
from .batch import PixelBatch, upload
from .sampler import ShardSpec, batches_per_epoch, consumed_after, rank_batches

log = logging.getLogger(__name__)
_STOP_POLL_S = 0.1


def _distributed_rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Loader:
    """Iterates ``(images, labels)`` over a ``GDSDataset`` on its device.

    ``shuffle``: "full" (a seeded permutation per epoch), "block" (locality-friendly, see
    ``sampler``) or None. ``rank``/``world_size``: default from ``torch.distributed`` when it is
    initialised. ``drop_last``: drop the uneven tail (per rank and the last partial batch) instead of
    padding. ``transform``: a ``RandomResizedCrop`` or ``CenterCrop``; without one, images is a
    list of uint8 CHW tensors, or with ``pixels=True`` the ``PixelBatch`` itself (decoded pixels of
    every size in one buffer, for custom GPU transforms; valid until the next batch is asked for).
    """

    def __init__(self, dataset, batch_size, *, shuffle="full", seed=0, drop_last=False, transform=None,
                 prefetch=2, rank=None, world_size=None, block_size=64, window=16, pixels=False):
        if rank is None or world_size is None:
            detected_rank, detected_world = _distributed_rank()
            rank = detected_rank if rank is None else rank
            world_size = detected_world if world_size is None else world_size
        self.dataset = dataset
        self.spec = ShardSpec(len(dataset), world_size, rank, batch_size, drop_last, shuffle, seed,
                              block_size, window)
        self.transform = transform
        self.pixels = bool(pixels)
        if self.pixels and transform is not None:
            raise ValueError("pixels=True hands on decoded pixels; it takes no transform")
        self.prefetch = max(1, int(prefetch))
        self.epoch = 0
        self._consumed = None  # mask of samples delivered by earlier segments of this epoch
        self._done = 0  # batches delivered in the current segment
        self._active = None  # weak reference to the pass being iterated
        self._carry = None  # a pass that finished an epoch and already reads the next one

    # --- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int):
        """Start ``epoch`` from its beginning (as ``DistributedSampler.set_epoch``). After a full
        epoch the loader is already at the next one, whose first batches are being prefetched."""
        epoch = int(epoch)
        if epoch != self.epoch or self._done or self._consumed is not None:
            self.epoch = epoch
            self._consumed, self._done = None, 0

    def __len__(self):
        if self._consumed is None and self._done == 0:
            return batches_per_epoch(self.spec)
        return len(rank_batches(self.spec, self.epoch, self._consumed)) - self._done

    def state_dict(self) -> dict:
        consumed = None if self._consumed is None else np.packbits(self._consumed).tobytes()
        return {"epoch": self.epoch, "batches_done": self._done, "consumed": consumed,
                "size": self.spec.size, "seed": self.spec.seed, "shuffle": self.spec.shuffle,
                "block_size": self.spec.block_size, "window": self.spec.window,
                "world_size": self.spec.world_size, "batch_size": self.spec.batch_size,
                "drop_last": self.spec.drop_last}

    def load_state_dict(self, state: dict):
        self.close()
        for key in ("size", "seed", "shuffle", "block_size", "window"):
            if state[key] != getattr(self.spec, key):
                raise ValueError(f"cannot resume: the saved loader had {key}={state[key]!r}, this one has "
                                 f"{getattr(self.spec, key)!r}")
        consumed = None
        if state["consumed"] is not None:
            consumed = np.unpackbits(np.frombuffer(state["consumed"], np.uint8), count=self.spec.size).astype(bool)
        self.epoch = state["epoch"]
        same = all(state[k] == getattr(self.spec, k) for k in ("world_size", "batch_size", "drop_last"))
        if same:
            self._consumed, self._done = consumed, state["batches_done"]
        else:  # another topology: what the old ranks delivered is out, the rest is re-split
            old = ShardSpec(**{**self.spec.__dict__, "rank": 0, "world_size": state["world_size"],
                               "batch_size": state["batch_size"], "drop_last": state["drop_last"]})
            self._consumed = consumed_after(old, self.epoch, consumed, state["batches_done"])
            self._done = 0

    def indices(self):
        """The sample indices of this rank's remaining batches in the current epoch, one array per
        batch: what iterating will read (with ``on_error="skip"`` a bad sample is replaced)."""
        return rank_batches(self.spec, self.epoch, self._consumed)[self._done:]

    # --- iteration ----------------------------------------------------------------------------
    def __iter__(self):
        carry, self._carry = self._carry, None
        if carry is not None and carry.epoch == self.epoch and not self._done and self._consumed is None:
            self._active = weakref.ref(carry)  # the pipeline runs on into this epoch
            return carry
        if carry is not None:
            carry.close()
        self.close()
        active = _Prefetcher(self, self.epoch, self.indices())
        self._active = weakref.ref(active)  # a loop that breaks early drops the last reference
        return active

    def stats(self) -> dict:
        """Where the current pass (since the first epoch it served) spent its time: a
        ``PipelineStats`` as a dict, or None before iterating. The stage that is never blocked
        or idle is the one that sets the pace."""
        active = (self._active() if self._active is not None else None) or self._carry
        return None if active is None else asdict(active.stats)

    def close(self):
        """Stop the prefetch threads, if any (also those already reading the next epoch)."""
        for active in (self._active() if self._active is not None else None, self._carry):
            if active is not None:
                active.close()
        self._active = self._carry = None

    def _delivered(self, finished_epoch: bool, prefetcher=None):
        if finished_epoch:
            self.epoch += 1
            self._consumed, self._done = None, 0
            self._carry = prefetcher  # kept alive: it is reading the next epoch already
        else:
            self._done += 1



def _epochs(spec, first_epoch, first_batches):
    """What the I/O thread reads: the rest of this epoch, then whole epochs after it."""
    yield first_epoch, first_batches
    epoch = first_epoch + 1
    while True:
        yield epoch, rank_batches(spec, epoch)
        epoch += 1


class _BatchMaker:
    """What the decode and transform threads need of a Loader (and nothing that keeps the Loader
    alive)."""

    def __init__(self, loader):
        self.dataset, self.transform, self.pixels = loader.dataset, loader.transform, loader.pixels

    def decode(self, staged, stream, epoch):
        """Staged payloads -> a PixelBatch and its sample indices (after any replacement). Nothing
        else: on the GPU this thread keeps the JPEG engines fed."""
        return self.dataset.decode_staged(staged, stream)

    def finish(self, decoded, stream, epoch):
        """One decoded batch -> (images, labels): its transform, or with ``pixels=True`` the
        PixelBatch itself."""
        batch, indices = decoded
        labels = upload(torch.from_numpy(self.dataset._labels[indices]), self.dataset.device)
        if self.pixels:
            return batch, labels  # released by the consumer's next step
        if stream is not None and batch.owned:  # allocated on the decode stream; this one reads it last
            batch.buffer.record_stream(stream)
        if self.transform is not None:
            params = self.transform.params(batch.heights, batch.widths, indices, epoch)
            images = T.apply(self.transform, batch.buffer, batch.offsets, batch.heights, batch.widths,
                             batch.channels, params)
        else:
            images = [batch.image(k) for k in range(len(batch))]
        batch.release(stream)
        return images, labels


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
        if payload.slot is not None:
            dataset._backend.release(payload)
    elif kind == "decoded" or (kind == "batch" and isinstance(payload[0], PixelBatch)):
        payload[0].release(None)


@dataclass
class PipelineStats:
    """Host seconds the stages of a Loader pass spent since it began (``Loader.stats()``). GPU work
    is queued asynchronously: its time shows only where a host thread waits for it."""

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

    def add(self, field: str, seconds: float):
        setattr(self, field, getattr(self, field) + seconds)


def _read_ahead(dataset, epochs, q, stop, stats, activity):
    """The I/O thread: storage -> staging buffers, as far ahead as the queue allows, on into the
    next epochs (an "end" marker between epochs)."""
    try:
        for epoch, batches in epochs:
            for number, indices in enumerate(batches):
                if stop.is_set():
                    return
                activity.start(epoch, number)
                t0 = time.perf_counter()
                staged = dataset.read_staged(indices.tolist())
                t1 = time.perf_counter()
                activity.stop()
                handed = _put(q, stop, ("staged", staged, epoch, number, None))
                stats.read_s += t1 - t0
                stats.read_blocked_s += time.perf_counter() - t1
                if not handed:
                    _release(dataset, "staged", staged)
                    return
            if not _put(q, stop, ("end", None, epoch, None, None)):
                return
    except BaseException as e:  # noqa: BLE001 - handed on, raised by the consumer
        activity.stop()
        _put(q, stop, ("error", e, None, None, None))


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


class _Prefetcher:
    """The iterator of a pass: an I/O thread, a decode thread and a transform thread filling bounded
    queues, and clean shutdown. At the end of an epoch it stops iterating but its threads read on into the next
    epoch; the Loader keeps it and hands it out again for that epoch."""

    def __init__(self, loader: Loader, epoch, batches):
        # A weak reference: a Loader holds the pass it carries into the next epoch, and a cycle would
        # keep a dropped Loader's threads reading (and holding staging buffers) until the garbage
        # collector happened to run. The threads hold neither.
        self._loader = weakref.ref(loader)
        self.epoch = epoch  # the epoch whose batches come next
        self.cuda = loader.dataset.device.type == "cuda"
        self.device = loader.dataset.device
        self.queue = queue.Queue(maxsize=loader.prefetch)
        self.stop = threading.Event()
        # a CUDA stream per stage: the next batch's decode never queues behind this one's transform
        self.streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in (_DECODE, _TRANSFORM)]
        self.staged = queue.Queue(maxsize=2)
        self.decoded = queue.Queue(maxsize=1)
        self.held = None  # a PixelBatch handed to the consumer (pixels=True), released at the next step
        self.stats = PipelineStats()
        # The threads hold no reference to this object, so dropping the iterator stops them.
        self.dataset = loader.dataset
        maker = _BatchMaker(loader)
        # what each thread works on, for the stall watchdog (``stall.stalled``)
        self.activities = [stall.Activity(name) for name in ("read", _DECODE[0], _TRANSFORM[0])]
        self.threads = [
            threading.Thread(target=_read_ahead, name="gdsdata-read", daemon=True,
                             args=(loader.dataset, _epochs(loader.spec, epoch, batches), self.staged, self.stop,
                                   self.stats, self.activities[0])),
        ] + [threading.Thread(target=_stage, name=f"gdsdata-{step[0]}", daemon=True,
                              args=(step, work, loader.dataset, in_q, out_q, self.stop, stream, self.device,
                                    self.stats, activity))
             for step, work, in_q, out_q, stream, activity in zip(
                 (_DECODE, _TRANSFORM), (maker.decode, maker.finish), (self.staged, self.decoded),
                 (self.decoded, self.queue), self.streams, self.activities[1:])]
        for thread, activity in zip(self.threads, self.activities):
            activity.thread = thread
        passes = getattr(loader.dataset, "_passes", None)  # GDSDataset.close() stops its passes
        if passes is not None:
            passes.add(self)
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

    def __next__(self):
        if self.threads is None:
            raise StopIteration
        self._release_held()
        t0 = time.perf_counter()
        timeout = settings.get("stall_timeout")
        while True:
            try:
                kind, payload, _, _, event = self.queue.get(timeout=_STOP_POLL_S)
                self.stats.consumer_wait_s += time.perf_counter() - t0
                break
            except queue.Empty:
                if not self.threads[-1].is_alive() and self.queue.empty():
                    self.close()
                    raise RuntimeError("gdsdata prefetch thread stopped without a result") from None
                error = stall.stalled(self.activities, timeout)
                if error is not None:
                    log.error("%s", error)
                    self.close()
                    raise error
        if kind == "end":
            self.epoch += 1
            self._tell_loader(finished_epoch=True, prefetcher=self)
            raise StopIteration
        if kind == "error":
            self.close()
            raise payload
        images, labels = payload
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            if isinstance(images, PixelBatch):
                tensors = [images.buffer]
                self.held = images
            else:
                tensors = images if isinstance(images, list) else [images]
            for tensor in tensors:
                tensor.record_stream(current)
            labels.record_stream(current)
        elif isinstance(images, PixelBatch):
            self.held = images
        self.stats.batches += 1
        self._tell_loader(finished_epoch=False)
        return images, labels

    def close(self):
        if self.threads is None:
            return
        self.stop.set()
        self._release_held()
        me = threading.current_thread()  # the garbage collector may run this in a prefetch thread
        deadline = time.monotonic() + settings.get("stall_timeout")
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
