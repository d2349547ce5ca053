"""``GDSDataset``: the public map-style Dataset over a packed folder, on the CPU or the GPU.

    ds = gdsdata.GDSDataset("/data/train.gds", device="cpu")
    image, label = ds[0]          # uint8 CHW RGB tensor, int
    batch = ds.__getitems__([3, 1, 4])  # what torch's DataLoader calls: one coalesced read per batch

Both devices share the index, the read planning and the public API; they differ in where the
staging buffer lives and who decodes (``reader_cpu``/``decode_cpu`` here, the GPU modules there).
"""

import functools
import logging
import os
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gdsdata.format import index as index_io
from gdsdata.format import layout as fmt
from gdsdata import settings, stall
from gdsdata.args import is_integer
from gdsdata.backends.cpu import CpuBackend
from gdsdata.batch import PixelBatch, Staged
from gdsdata.errors import CorruptSampleError

if TYPE_CHECKING:
    from gdsdata.io.direct import Window
    from gdsdata.io.path import LoadPath

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")
SAMPLE_TRANSFORMS = ("transform", "target_transform", "transforms")  # what ds[i] applies, the Loader does not


class GDSDataset(torch.utils.data.Dataset):
    """A packed dataset as a torch map-style Dataset, on the CPU or the GPU.

    Parameters
    ----------
    root : str or os.PathLike
        The dataset folder (``gdsdata pack SRC root``).
    device : str or torch.device
        "cpu", or "cuda" / "cuda:N" for the GPU path (cuFile reads, nvJPEG decode).
    transform : callable, optional
        Applied to each image (a uint8 CHW tensor) by ``ds[i]`` and ``__getitems__``, as
        torchvision datasets do: torchvision v2 transforms and other callables; for torch's
        ``DataLoader``. ``gdsdata.Loader`` refuses a dataset opened with one (it applies its own
        ``transform=`` and ``batch_transform=`` to whole batches).
        A detection dataset refuses it (``ValueError``): a flip or crop of the image alone would leave
        its boxes where they were; pass ``transforms=``.
    target_transform : callable, optional
        Applied to each label, likewise by ``ds[i]`` and not by ``gdsdata.Loader``.
    transforms : callable, optional
        ``(image, target) -> (image, target)``, as torchvision datasets' ``transforms``: torchvision
        v2 transforms move a detection target's boxes with the image. For a detection dataset
        ``ds[i]`` hands it the image as a ``tv_tensors.Image`` and the boxes as
        ``tv_tensors.BoundingBoxes`` (XYXY, the image's size; torchvision needed) beside their
        ``labels`` (``iscrowd`` left out, as torchvision's ``wrap_dataset_for_transforms_v2`` does:
        ``target(i)`` has it). Not with ``transform=`` or ``target_transform=``;
        ``gdsdata.Loader`` refuses it too.
    on_error : str
        "raise" (default): a bad sample raises ``CorruptSampleError`` naming it, its shard, offset and
        source path; "skip": it is replaced by the next good one, deterministically, and counted in
        ``skipped``.
    verify_checksums : bool, optional
        Check each sample's CRC-32 as it loads. Default (the ``verify_checksums`` setting, on):
        where the bytes are, in host memory (the CPU path, the GPU path's pinned staging) or in GPU
        staging (a CRC-32 kernel on the GPU, where Triton is installed); True: also without Triton,
        through a copy to the host; False: never.

    Attributes
    ----------
    settings : Mapping
        The ``gdsdata.settings`` the dataset was built with (read-only; later changes do not reach
        it). ``load_path`` says which path they led to.

    Notes
    -----
    ``gdsdata.Loader`` (batched, prefetched, on the device) is the fast way to train; with torch's
    ``DataLoader`` use ``collate_fn=gdsdata.collate`` when image sizes differ.
    """

    def __init__(self, root: str | os.PathLike, device: str | torch.device = "cpu", *,
                 transform: Callable | None = None, target_transform: Callable | None = None,
                 transforms: Callable | None = None, on_error: str = "raise", verify_checksums: bool | None = None):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        for name, value in zip(SAMPLE_TRANSFORMS, (transform, target_transform, transforms)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a callable, got {type(value).__name__}")
        if transforms is not None and (transform is not None or target_transform is not None):
            raise ValueError("pass transforms= (image, target together) or transform=/target_transform=, not both "
                             "(as torchvision datasets take them)")
        self.transform, self.target_transform, self.transforms = transform, target_transform, transforms
        self.root = os.fspath(root)
        self.index = index_io.load(self.root)
        if transform is not None and self.index.task == "detect":
            raise ValueError(f"{self.root} is a detection dataset: transform= changes the image alone, so a flip, "
                             f"crop or resize would leave its boxes where they were; pass transforms=, which takes "
                             f"(image, target) and moves the boxes with the image (torchvision v2 transforms do)")
        if transforms is not None and self.index.task == "detect":
            _tv_tensors(self.root)  # torchvision is needed: said now, not at the first sample
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):  # torch's list of every device type it knows, in a traceback
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N', a torch.device), got {device!r}") \
                from None
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.on_error = on_error
        self.skipped = 0  # samples replaced (on_error="skip") in the batches decoded since the dataset was opened
        self._bad, self._good = set(), set()  # samples found bad, and good replacements
        self._replaced = {}  # bad sample -> the good one read in its place (on_error="skip")
        self._book = threading.Lock()  # the replacement bookkeeping: read, decode and user threads share it
        self._passes = weakref.WeakSet()  # Loader passes reading from this dataset (close() stops them)
        config = settings.snapshot()  # a dataset keeps the settings it was built with
        self.settings = config
        verify = config["verify_checksums"] if verify_checksums is None else (
            "always" if verify_checksums else False)
        if self.device.type == "cpu":
            self._backend = CpuBackend(self.index, verify, config)
        elif self.device.type == "cuda":
            from gdsdata.backends.gpu import GpuBackend  # imports CUDA-only libraries

            self._backend = GpuBackend(self.index, self.device, verify, config)
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._labels = self.index.samples["label"].astype(np.int64)
        self._labels.flags.writeable = False

    def __len__(self) -> int:
        return len(self.index)

    @property
    def classes(self) -> list[str]:
        return self.index.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.index.classes)}

    @property
    def targets(self) -> list[int]:
        """Every sample's label, as torchvision's ImageFolder has them. Classification datasets only."""
        return self._one_label_each().tolist()

    @functools.cached_property
    def samples(self) -> list[tuple[str, int]]:
        """Every sample's (source path, label), as torchvision's ImageFolder lists them; the paths are
        relative to the packed source folder (``source(i)``). Classification datasets only."""
        return list(zip((self.index.path(i) for i in range(len(self))), self._one_label_each().tolist()))

    @property
    def imgs(self) -> list[tuple[str, int]]:
        """``samples`` (ImageFolder's other name for them)."""
        return self.samples

    @functools.cached_property
    def ids(self) -> list[int]:
        """COCO's image id of every sample, in sample order, as torchvision's ``CocoDetection.ids``
        (a pack of COCO annotations only)."""
        if self.index.image_ids is None:
            raise AttributeError(f"{self.root} holds no COCO image ids (it was not packed from COCO annotations)")
        return list(self.index.image_ids)

    @property
    def labels(self) -> np.ndarray:
        """Every sample's label as an int64 array (read-only). Classification datasets only."""
        return self._one_label_each()

    def _one_label_each(self) -> np.ndarray:
        """The labels; a detection dataset has none of one per sample (its records hold 0): an
        AttributeError, not zeros that a class count or a balanced sampler would take for classes."""
        if self.index.task != "classify":
            raise AttributeError(f"{self.root} is a detection dataset: its samples have boxes, not one label each "
                                 f"(ds.target(i); boxes per class: gdsdata inspect)")
        return self._labels

    @property
    def load_path(self) -> "LoadPath":
        """How this dataset's samples travel from storage to pixels, and why (a ``LoadPath``)."""
        return self._backend.load_path

    @property
    def fingerprint(self) -> str:
        """The dataset's identity (its pack id and index checksum): what a Loader state is valid for."""
        return self.index.fingerprint

    @property
    def legacy_fingerprint(self) -> str:
        """``fingerprint`` as gdsdata gave it before ids were read whole (see ``Index``)."""
        return self.index.legacy_fingerprint

    @property
    def meta(self) -> dict:
        return dict(self.index.meta)

    def source(self, i: int) -> str:
        """The sample's path relative to the packed source folder.

        Parameters
        ----------
        i : int
            The sample's index (negative counts from the end).
        """
        return self.index.path(self._check(i))

    def _check(self, i):
        if isinstance(i, slice):
            raise TypeError("GDSDataset takes one sample index, not a slice (as torch datasets do); for a range "
                            "use [ds[i] for i in range(...)] or torch.utils.data.Subset(ds, range(...))")
        if not is_integer(i) and not (isinstance(i, torch.Tensor) and i.ndim == 0 and not i.is_floating_point()
                                      and i.dtype != torch.bool):
            raise TypeError(f"sample index must be an integer, got {i!r} ({type(i).__name__})")
        i = int(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        return i % n

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    @property
    def task(self) -> str:
        """"classify" (a label per image) or "detect" (boxes per image: ``ds[i]`` gives a target dict)."""
        return self.index.task

    def target(self, i: int) -> dict:
        """Sample i's objects as torchvision's detection models take them: ``{"boxes": float32 [K, 4]
        XYXY in pixels of the decoded image, "labels": int64 [K], "iscrowd": uint8 [K]}``, on the
        dataset's device; a pack of COCO annotations adds ``"image_id"`` (COCO's, an int, as
        torchvision's ``CocoDetection`` wrapped for v2 gives it). Detection datasets only. Labels
        are 0 to ``len(classes) - 1``, as Ultralytics numbers them (COCO's category ids are in
        ``meta["detection"]["category_ids"]``); torchvision's detection models keep label 0 for
        the background: add 1 for them, with one class more.

        Parameters
        ----------
        i : int
            The sample's index (negative counts from the end).
        """
        i = self._check(i)
        if self.task != "detect":
            raise TypeError(f"{self.root} is a classification dataset: ds.labels[i] is its label")
        rows = self.index.sample_boxes(i)
        record = self.index.samples[i]
        scale = np.array([record["width"], record["height"]] * 2, np.float32)
        corners = np.stack([rows[k] for k in ("x0", "y0", "x1", "y1")], axis=1).astype(np.float32) \
            if len(rows) else np.zeros((0, 4), np.float32)
        target = {"boxes": torch.from_numpy(corners * scale).to(self.device),
                  "labels": torch.from_numpy(rows["label"].astype(np.int64)).to(self.device),
                  "iscrowd": torch.from_numpy((rows["flags"] & fmt.BOX_CROWD).astype(np.uint8)).to(self.device)}
        if self.index.image_ids is not None:
            target["image_id"] = self.index.image_ids[i]
        return target

    def __getitems__(self, indices):
        """[(image, label)] for ``indices``: uint8 CHW RGB tensors on the dataset's device; for a
        detection dataset [(image, target)] (``target(i)``)."""
        indices = [self._check(i) for i in indices]
        with stall.bounded(self.settings["stall_timeout"]):  # (its waits: as this dataset's settings bound them)
            batch, indices = self.load_batch(indices)
            images = [batch.image(k) for k in range(len(batch))]
            batch.release(self._stream())
        out = []
        detect = self.task == "detect"
        for image, i in zip(images, indices):
            label = self.target(i) if detect else int(self._labels[i])
            if self.transforms is not None:
                if detect:
                    image, label = _as_tv_tensors(image, label, self.root)
                image, label = self.transforms(image, label)
            if self.transform is not None:
                image = self.transform(image)
            if self.target_transform is not None:
                label = self.target_transform(label)
            out.append((image, label))
        return out

    def load_batch(self, indices: Sequence[int], stream: torch.cuda.Stream | None = None) -> PixelBatch:
        """Decoded pixels of a batch, bad samples raised or replaced per ``on_error``.

        Parameters
        ----------
        indices : sequence of int
            The samples.
        stream : torch.cuda.Stream, optional
            GPU path: the stream the decode is queued on (default: the current one).

        Returns
        -------
        (PixelBatch, list of int)
            The pixels, and which sample each position finally holds (a replacement's index where
            ``on_error="skip"`` replaced one).
        """
        return self.decode_staged(self.read_staged(indices), stream)

    def read_window(self, samples: Sequence[int], uses: int) -> "Window | None":
        """Where reads go past the page cache (``load_path.reads == "direct"``), a window over
        ``samples`` for ``read_staged``: their joint plan, read at once when first needed (a shuffle
        window's samples: whole blocks, a few large reads), from which ``uses`` batches are then
        copied. None where reads go through the page cache.

        Parameters
        ----------
        samples : sequence of int
            The samples the window holds.
        uses : int
            How many ``read_staged`` calls will draw from it (its buffer is reused after the last).

        Returns
        -------
        Window or None
            For ``read_staged(indices, windows=[...])``.
        """
        window = getattr(self._backend, "window", None)
        if window is None or self.load_path.reads != "direct" or not len(samples):
            return None
        return window([self._replaced.get(int(i), int(i)) for i in samples], uses)

    def read_staged(self, indices: Sequence[int], windows: Sequence["Window"] = ()) -> Staged:
        """The storage half of ``load_batch``: the batch's payloads in a staging buffer. With
        ``on_error="skip"`` the replacement of a bad sample is decided here, where reads are planned:
        samples already found bad are read as their replacements, and samples whose checksums fail
        as they are read get theirs before decode (``Staged.asked`` keeps what was asked for).

        Parameters
        ----------
        indices : sequence of int
            The samples.
        windows : sequence of Window, optional
            From ``read_window``, each counting this read as one of its uses: the batch's samples
            are copied from them (a batch they do not wholly hold, with a replacement's sample, is
            read).

        Returns
        -------
        Staged
            The payloads in a staging buffer, for ``decode_staged`` (or ``release_staged``).
        """
        asked = list(indices)
        read = self._backend.read if not windows else lambda planned: self._backend.read(planned, windows)
        if self.on_error != "skip":
            return read(asked)
        planned = [self._replaced.get(i, i) for i in asked]
        staged = read(planned)
        if staged.failed:
            try:
                for k in sorted(staged.failed):
                    planned[k] = self._replacement(planned[k], staged.failed[k])
            finally:
                self.release_staged(staged)
            staged = self._backend.read(planned)
        staged.asked = asked
        return staged

    def decode_staged(self, staged: Staged, stream: torch.cuda.Stream | None = None) -> tuple[PixelBatch, list]:
        """The decode half of ``load_batch``: ``staged`` (from ``read_staged``) decoded on ``stream``;
        returns what ``load_batch`` returns."""
        indices = list(staged.indices)
        batch = self._backend.decode(staged, stream)
        for k in sorted(batch.errors):  # found only by decoding: replaced here the first time, at planning after
            error = batch.errors[k]
            if self.on_error == "raise":
                batch.release(stream or self._stream())
                raise error
            indices[k] = self._replacement(indices[k], error)
        asked = staged.indices if staged.asked is None else staged.asked
        replaced = sum(a != b for a, b in zip(asked, indices))
        if replaced:  # counted once a batch is decoded, whichever stage replaced its samples
            with self._book:
                self.skipped += replaced
        if batch.errors:
            batch.release(stream or self._stream())
            return self._backend.load_batch(indices, stream), indices
        return batch, indices

    def release_staged(self, staged: Staged) -> None:
        """Hand back the staging buffer of a batch from ``read_staged`` that will not be decoded."""
        if staged.slot is not None:
            self._backend.release(staged)

    def reserve_staging(self, count: int) -> None:
        """A Loader pass may hold ``count`` batches from ``read_staged`` at once (its queue depths):
        the GPU path keeps that many staging buffers before it waits for the GPU to finish with one."""
        reserve = getattr(self._backend, "reserve_staging", None)
        if reserve is not None:
            reserve(count)

    def register_pass(self, active):
        """A Loader pass reading from this dataset: ``close()`` stops it."""
        self._passes.add(active)

    def _replacement(self, index, error):
        """The next sample after ``index`` that decodes, remembered as its replacement. Samples found
        bad are remembered, so a run of bad samples is probed once, not once per sample before it
        (linear, not quadratic)."""
        with self._book:
            self._bad.add(index)
            self._good.discard(index)  # a replacement that turned bad since
        log.warning("%s; replaced by the next good sample", error)
        for step in range(1, len(self)):
            candidate = (index + step) % len(self)
            if candidate in self._bad:
                continue
            if candidate in self._good:
                return self._remember(index, candidate)
            probe = self._backend.load_batch([candidate])
            probe.release(self._stream())
            if not probe.errors:
                with self._book:
                    self._good.add(candidate)
                return self._remember(index, candidate)
            with self._book:
                self._bad.add(candidate)
        raise CorruptSampleError(f"{self.root}: no sample of the dataset decodes") from error

    def _remember(self, bad, good) -> int:
        """``good`` is read in place of ``bad`` from now on, also where ``bad`` stood in for another."""
        with self._book:
            for sample, instead in list(self._replaced.items()):
                if instead == bad:
                    self._replaced[sample] = good
            self._replaced[bad] = good
        return good

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def close(self) -> None:
        """Stop any Loader still reading from this dataset, then release file descriptors, threads
        and (on the GPU) staging memory. The process's nvJPEG decoder stays for the next dataset
        (creating one is slow) and is destroyed at exit."""
        while True:
            try:
                passes = list(self._passes)
                break
            except RuntimeError:  # a Loader started a pass on another thread meanwhile: look again
                continue
        for active in passes:
            active.close(reason=f"GDSDataset({self.root!r}).close()")
        self._backend.close()

    def __getstate__(self):  # DataLoader workers get the dataset, not the Loaders over it
        with self._book:
            state = {k: v for k, v in self.__dict__.items() if k not in ("_passes", "_book")}
            state.update(_bad=set(self._bad), _good=set(self._good), _replaced=dict(self._replaced),
                         settings=dict(self.settings))
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("transforms", None)  # (pickled before transforms= was taken)
        self.settings = types.MappingProxyType(state.get("settings") or dict(settings.snapshot()))
        self._passes = weakref.WeakSet()
        self._book = threading.Lock()
        self._labels.flags.writeable = False  # (a pickled array comes back writeable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"GDSDataset({self.root!r}, device={str(self.device)!r}, samples={len(self)}, "
                f"classes={len(self.classes)})")


def _tv_tensors(root):
    """torchvision's ``tv_tensors``, which a detection dataset's ``transforms=`` is handed."""
    try:
        from torchvision import tv_tensors
    except ImportError:
        raise ImportError(f"{root}: transforms= on a detection dataset hands it tv_tensors.BoundingBoxes, "
                          f"which need torchvision 0.16 or newer (pip install torchvision)") from None
    return tv_tensors


def _as_tv_tensors(image, target, root):
    """The image and target as torchvision v2 transforms move them together: the image a
    ``tv_tensors.Image``, the boxes ``tv_tensors.BoundingBoxes`` (XYXY on the image's size) and their
    labels; not ``iscrowd``, which ``SanitizeBoundingBoxes`` would leave unfiltered beside them (as
    torchvision's ``wrap_dataset_for_transforms_v2`` leaves it out)."""
    tv_tensors = _tv_tensors(root)
    boxes = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=tuple(image.shape[-2:]))
    kept = {"image_id": target["image_id"]} if "image_id" in target else {}
    return tv_tensors.Image(image), {**kept, "boxes": boxes, "labels": target["labels"]}

