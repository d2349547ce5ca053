"""Ultralytics' YOLO trainer fed by gdsdata: its ``DetectionTrainer`` with batches from ``gdsdata.Loader``.

    from gdsdata.yolo import DetectionTrainer

    trainer = DetectionTrainer("/data/det-train.gds", "/data/det-val.gds",
                               overrides={"model": "yolo11n.yaml", "epochs": 100, "imgsz": 640, "batch": 64})
    trainer.train()

Everything else is Ultralytics' own: the model, the loss, the optimiser and its schedule, EMA, AMP,
validation (mAP) and checkpoints. The training batches are ``YoloAugment`` batches built with the
run's hyper-parameters (``mosaic``, ``degrees``, ``translate``, ``scale``, ``shear``, ``fliplr``,
``flipud``, ``hsv_*``, ``seed``) on the training device, the mosaic turned off when Ultralytics
closes it (``close_mosaic``); validation batches are rectangular ``Letterbox`` batches in aspect-ratio
order, as Ultralytics validates (``Letterbox(rect=True)`` at the model's largest stride). Arguments these batches do not
follow (``perspective``, ``mixup``, ``cutmix``, ``copy_paste``, ``bgr``, ``single_cls``,
``fraction``, ``classes``, ``rect``) are refused unless at their defaults, and so is AutoBatch. The class
names come from the packed dataset, so ``data`` is not needed; the checkpoints record as their ``data``
the data YAML both packs were made from (where Ultralytics finds its splits from here), so that
Ultralytics' ``YOLO("best.pt").val()`` validates on that YAML's val split with its own pipeline
(else give it ``data=``).
Several GPUs (``device="0,1,2,3"``) train as Ultralytics' own DDP does: it launches one process a
GPU through ``torch.distributed.run`` (carrying the packs' paths to them), each rank takes its share
of every epoch's order, and validation gives each rank a contiguous run of the rectangular batches
(Ultralytics' ``ContiguousDistributedSampler``; before its 8.4, rank 0 validates the whole set),
their statistics gathered on rank 0. A script launched by ``torchrun`` trains the same way when
its ``device`` names every GPU of the job. Needs the ``ultralytics`` package (and, for
DDP, ``cloudpickle``, which Ultralytics' launch uses).
"""

import copy
import dataclasses
import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from gdsdata.dataset import GDSDataset
from gdsdata.settings import swapped
from gdsdata.loader import Loader
from gdsdata.transforms.detection import Letterbox, YoloAugment

try:
    from ultralytics.cfg import DEFAULT_CFG
    from ultralytics.engine import validator as _validator_module
    from ultralytics.models.yolo.detect import DetectionTrainer as _UltralyticsTrainer
    from ultralytics.models.yolo.detect import DetectionValidator as _UltralyticsValidator
except ImportError as e:  # pragma: no cover - exercised without ultralytics
    raise ImportError("gdsdata.yolo needs Ultralytics: pip install ultralytics") from e

log = logging.getLogger(__name__)
_HYP = ("mosaic", "degrees", "translate", "scale", "shear", "fliplr", "flipud", "hsv_h", "hsv_s", "hsv_v", "seed")
# Ultralytics arguments these batches do not follow: refused unless at the value they follow
_CARRIED = "gdsdata_packs"  # the argument that carries the packs' paths to Ultralytics' DDP processes
_UNSUPPORTED = {"perspective": 0.0, "mixup": 0.0, "cutmix": 0.0, "copy_paste": 0.0, "bgr": 0.0,
                "single_cls": False, "fraction": 1.0, "classes": None, "rect": False}


class _Samples:
    """The sampler Ultralytics asks about: how many samples an epoch has, their order, ``set_epoch``."""

    def __init__(self, batches):
        self._batches = batches

    def __len__(self):  # (this rank's share: the order padded to a multiple of the ranks, as DistributedSampler's)
        spec = self._batches.loader.spec
        return min(len(self._batches) * spec.batch_size, -(-spec.size // spec.world_size))

    def __iter__(self):
        if not len(self._batches):
            return iter(())
        return (int(i) for batch in self._batches.loader.indices() for i in batch)

    def set_epoch(self, epoch):
        self._batches.loader.set_epoch(epoch)


class _DatasetView:
    """``train_loader.dataset`` as Ultralytics uses it: its length, image files, labels (the objects
    per image it sizes ``max_det`` by) and ``close_mosaic``, which turns the mosaic off from the next
    pass on."""

    def __init__(self, batches):
        self._batches = batches
        self.mosaic = True

    @property
    def _ds(self):
        return self._batches.loader._data

    def __len__(self):
        return len(self._ds)

    @property
    def im_files(self):
        return [self._ds.source(i) for i in range(len(self._ds))]

    @property
    def labels(self):
        starts = self._ds.index.box_start
        return [{"cls": np.zeros((int(starts[i + 1] - starts[i]), 1), np.float32)} for i in range(len(self._ds))]

    def close_mosaic(self, hyp=None):
        self.mosaic = False
        transform = self._batches.loader.transform
        if isinstance(transform, YoloAugment) and transform.mosaic:
            self._batches.rebuild(dataclasses.replace(transform, mosaic=0.0))


class Batches:
    """What Ultralytics' trainer and validator use of a DataLoader, over a ``gdsdata.Loader`` whose
    transform gives Ultralytics' batch dict: ``len``, iteration, ``batch_size``, ``drop_last``,
    ``num_workers``, ``sampler``, ``dataset``, ``reset()`` and ``close()``. ``make(transform)``
    builds the Loader; ``epoch``: a callable giving the trainer's epoch, which each pass follows
    (resumed runs draw as uninterrupted ones); ``empty``: a DDP rank's share of the validation
    batches that holds none (no batch, no sample; the dataset still the whole one)."""

    num_workers = 0

    def __init__(self, make, transform, epoch=None, empty=False):
        self._make, self._empty = make, empty
        self.loader = make(transform)
        self.batch_size = self.loader.spec.batch_size
        self.drop_last = self.loader.spec.drop_last
        self.dataset = _DatasetView(self)
        self.sampler = _Samples(self)
        self._epoch = epoch

    def rebuild(self, transform):
        """The same Loader with another transform, at the same epoch (the old one closed)."""
        old, self.loader = self.loader, self._make(transform)
        self.loader.set_epoch(old.epoch)
        old.close()

    def __len__(self):
        return 0 if self._empty else len(self.loader)

    def __iter__(self):
        if self._empty:
            return
        if self._epoch is not None and self.loader.epoch != self._epoch():
            self.loader.set_epoch(self._epoch())
        yield from self.loader

    def reset(self):
        """Ultralytics calls this after ``close_mosaic``: the next pass starts its epoch afresh anyway."""

    def close(self):
        self.loader.close()
        self.loader._data.close()


def _launches_ddp(trainer) -> bool:
    """Whether Ultralytics' ``train()`` launches DDP processes: several devices, and not a DDP
    process itself (its ``ddp``; worked out as its versions before 8.3.200 do where it has none)."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None:
        return bool(ddp)
    device = trainer.args.device
    count = len(device) if isinstance(device, (tuple, list)) else \
        len(device.split(",")) if isinstance(device, str) and device else 1
    return count > 1 and "LOCAL_RANK" not in os.environ


def contiguous_share(total: int, batch_size: int, rank: int, world_size: int) -> "tuple[int, int]":
    """The samples ``[start, end)`` of ``total`` (in validation order) that ``rank`` validates:
    whole batches, the first ``batches % world_size`` ranks one more (unit batches where one batch
    spans them all), as Ultralytics' ``ContiguousDistributedSampler`` splits them."""
    batch_size = 1 if batch_size >= total else batch_size
    batches = -(-total // batch_size)
    base, extra = divmod(batches, world_size)
    first = rank * base + min(rank, extra)
    last = first + base + (1 if rank < extra else 0)
    return min(first * batch_size, total), min(last * batch_size, total)


class DetectionValidator(_UltralyticsValidator):
    """Ultralytics' validator over gdsdata batches. Validating a saved model (the trainer's final
    evaluation of ``best.pt``), Ultralytics re-reads the dataset from its YAML; a packed dataset has
    none, so during that call the dataset check answers with the trainer's dataset description."""

    def __init__(self, data, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gds_data = data

    def __call__(self, trainer=None, model=None):
        if trainer is not None:
            return super().__call__(trainer=trainer, model=model)
        with swapped(_validator_module, "check_det_dataset", lambda *args, **kwargs: dict(self._gds_data)):
            return super().__call__(trainer=trainer, model=model)


def _amp_without_download(check):
    """Ultralytics' ``check_amp`` where the YOLO model it would download is not to be had: its own
    answers (off on the CPU and on the GPUs it lists), its "offline" answer in place of the comparison."""
    import ultralytics

    def offline(*args, **kwargs):
        raise ConnectionError("gdsdata fetches nothing at run time")

    def check_amp(model):
        with swapped(ultralytics, "YOLO", offline):
            return check(model)

    return check_amp


def _usable_yaml(yaml) -> bool:
    """Whether Ultralytics finds the splits of the data YAML ``yaml`` from here as it stands (its own
    check, with nothing downloaded: neither the dataset nor the font the check fetches)."""
    if not os.path.isfile(yaml):
        return False
    from ultralytics.data import utils

    try:
        with swapped(utils, "check_font", lambda *args, **kwargs: None):
            utils.check_det_dataset(yaml, autodownload=False)
    except Exception:  # noqa: BLE001 - whatever Ultralytics makes of it, the packs are what trains
        return False
    return True


def _checked_cfg(cfg, overrides):
    """Ultralytics' own reading of the arguments (unknown keys, types, values) as its trainer does it
    first; an unknown key is a ``ValueError`` naming it (and the keys it resembles), without the
    command-line help Ultralytics logs beside it."""
    from ultralytics.cfg import get_cfg
    from ultralytics.utils import LOGGER

    level = LOGGER.level
    LOGGER.setLevel(logging.WARNING)
    try:
        return get_cfg(cfg, overrides)
    except SyntaxError as e:
        raise ValueError(" ".join(str(e).split())) from None
    finally:
        LOGGER.setLevel(level)


class DetectionTrainer(_UltralyticsTrainer):
    """Ultralytics' ``DetectionTrainer`` with batches from the packed datasets ``train`` and ``val``
    (``gdsdata pack --format yolo|coco``). ``overrides``: Ultralytics' arguments (``model``,
    ``epochs``, ``imgsz``, ``batch``, ``device``, hyper-parameters ...)."""

    def __init__(self, train=None, val=None, cfg=DEFAULT_CFG, overrides=None, _callbacks=None):
        overrides = dict(overrides or {})
        carried = overrides.pop(_CARRIED, None)  # a DDP rank: the packs, from the launching trainer (``train``)
        if carried is not None:
            train, val = carried["train"], carried["val"]
        if train is None or val is None:
            raise TypeError("DetectionTrainer needs the train and val datasets: DetectionTrainer(train, val, ...)")
        self.gds_roots = {"train": str(train), "val": str(val)}
        sources = []
        for mode, root in self.gds_roots.items():
            probe = GDSDataset(root)
            sources.append(probe.meta.get("source"))
            if probe.task != "detect":
                raise TypeError(f"{root} (the {mode} dataset) is a classification dataset; DetectionTrainer trains "
                                f"and validates on detection datasets")
            if mode == "train":
                self._names = dict(enumerate(probe.classes))
            elif list(self._names.values()) != list(probe.classes):  # mAP per class would compare other classes
                raise ValueError(f"{root} (the val dataset) has the classes {probe.classes[:5]}..., the train dataset "
                                 f"{list(self._names.values())[:5]}...: pack both from the same names")
            probe.close()
        self._gds_batches = {}
        # what the checkpoints record as their data: the data YAML both packs came from, where Ultralytics still
        # finds its splits, so that its own YOLO("best.pt").val() validates on the val split; else the train pack
        if "data" not in overrides:
            yaml = sources[0] if sources[0] == sources[1] and str(sources[0]).endswith((".yaml", ".yml")) else None
            usable = yaml is not None and _usable_yaml(yaml)
            overrides["data"] = yaml if usable else self.gds_roots["train"]
            if yaml is not None and not usable:
                log.warning("the checkpoints name %s as their data: Ultralytics does not find the splits of %s "
                            "from here (a relative path: is read from the current folder), so validating them "
                            "with YOLO(...).val() needs data=", self.gds_roots["train"], sources[0])
        args = _checked_cfg(cfg, overrides)  # refused before Ultralytics' trainer makes its run folder
        odd = {name: getattr(args, name) for name, value in _UNSUPPORTED.items()
               if getattr(args, name, value) not in (value,)}
        if odd:
            raise ValueError(f"gdsdata batches do not follow {', '.join(f'{k}={v!r}' for k, v in odd.items())}: "
                             f"leave {'them' if len(odd) > 1 else 'it'} at Ultralytics' default")
        if args.batch < 1:
            raise ValueError(f"batch={args.batch}: Ultralytics' AutoBatch sizes its own dataset; "
                             f"give a batch size")
        super().__init__(cfg, overrides, _callbacks)

    def train(self):
        """Ultralytics' training; with several GPUs its DDP launch, whose processes rebuild this
        trainer from its arguments: the packs' paths ride along with them for the launch."""
        if not _launches_ddp(self):
            return super().train()
        setattr(self.args, _CARRIED, dict(self.gds_roots))
        try:
            return super().train()
        finally:
            delattr(self.args, _CARRIED)

    def _setup_train(self, *args, **kwargs):
        """Ultralytics' set-up, its AMP check without the YOLO model that check downloads to compare
        float32 and AMP outputs (gdsdata fetches nothing at run time): the check's list of GPUs where
        AMP fails still turns it off; elsewhere it says the comparison was skipped, and AMP is on
        wherever ``amp`` is (``amp=False`` turns it off)."""
        from ultralytics.engine import trainer as module

        with swapped(module, "check_amp", _amp_without_download(module.check_amp)):
            return super()._setup_train(*args, **kwargs)

    def get_dataset(self):
        return {"train": self.gds_roots["train"], "val": self.gds_roots["val"], "names": self._names,
                "nc": len(self._names), "channels": 3}

    def get_dataloader(self, dataset_path, batch_size=16, rank=0, mode="train"):
        previous = self._gds_batches.pop(mode, None)
        if previous is not None:  # Ultralytics rebuilds the loaders after an out-of-memory retry
            previous.close()
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        ds = GDSDataset(self.gds_roots[mode], device=device)
        if mode == "train":  # the mosaic switched off by Ultralytics' close_mosaic (_DatasetView)
            hyp = {name: getattr(self.args, name) for name in _HYP}
            hyp["seed"] = int(hyp["seed"])
            transform = YoloAugment(imgsz=self.args.imgsz, targets="ultralytics", **hyp)
        else:  # Ultralytics' validation batches: rectangles, the images in aspect-ratio order
            model = getattr(self.model, "module", self.model)
            stride = max(int(model.stride.max()), 32) if hasattr(model, "stride") else 32
            transform = Letterbox(imgsz=self.args.imgsz, targets="ultralytics", rect=True, stride=stride)
        # a DDP rank (Ultralytics passes rank -1 for a loader of the whole dataset: its older versions validate
        # on rank 0 alone, and so does its calibration)
        shared = rank != -1 and dist.is_initialized() and getattr(self, "world_size", dist.get_world_size()) > 1
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
        ranks = {"rank": rank, "world_size": world_size}  # training: each rank its share of the epoch's order
        order, empty = None, False
        if mode != "train":  # a contiguous run of the batches a rank, every image once (Ultralytics' DDP validation)
            order = Letterbox.rect_order(ds)
            start, end = contiguous_share(len(order), batch_size, rank, world_size)
            empty = start == end  # (fewer batches than ranks: this one validates none, and still gathers)
            order, ranks = (order if empty else order[start:end]), {"rank": 0, "world_size": 1}

        def make(transform):
            return Loader(ds, batch_size, shuffle=mode == "train", seed=int(self.args.seed), transform=transform,
                          drop_last=False, indices=order, **ranks)

        batches = self._gds_batches[mode] = Batches(make, transform, (lambda: self.epoch) if mode == "train" else None,
                                                    empty=empty)
        return batches

    def get_validator(self):
        return DetectionValidator(self.data, self.test_loader, save_dir=self.save_dir, args=copy.copy(self.args),
                                  _callbacks=self.callbacks)

    def plot_training_labels(self):
        """Ultralytics plots its own dataset's label statistics here; ``gdsdata inspect`` shows them."""

    def __repr__(self):
        return f"gdsdata.yolo.DetectionTrainer({self.gds_roots['train']!r}, {self.gds_roots['val']!r})"

