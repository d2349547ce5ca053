"""Ultralytics' YOLO trainer fed by gdsdata: its ``DetectionTrainer`` with batches from ``gdsdata.Loader``.

    from gdsdata.yolo import DetectionTrainer

    trainer = DetectionTrainer("/data/det-train.gds", "/data/det-val.gds",
                               overrides={"model": "yolo11n.yaml", "epochs": 100, "imgsz": 640, "batch": 64})
    trainer.train()

Everything else is Ultralytics' own: the model, the loss, the optimiser and its schedule, EMA, AMP,
validation (mAP) and checkpoints. The training batches are ``YoloAugment`` batches built with the
run's hyper-parameters (``mosaic``, ``close_mosaic``, ``degrees``, ``translate``, ``scale``,
``shear``, ``fliplr``, ``flipud``, ``hsv_*``, ``seed``) on the training device; validation batches are
``Letterbox`` batches. The class names come from the packed dataset, so ``data`` is not needed.
Ultralytics' own DDP (it re-launches the trainer from its module path with its own arguments) is not
offered: one process per run. Needs the ``ultralytics`` package.
"""

import copy

import torch

from gdsdata.dataset import GDSDataset
from gdsdata.loader import Loader
from gdsdata.transforms.detection import Letterbox, YoloAugment

try:
    from ultralytics.cfg import DEFAULT_CFG
    from ultralytics.engine import validator as _validator_module
    from ultralytics.models.yolo.detect import DetectionTrainer as _UltralyticsTrainer
    from ultralytics.models.yolo.detect import DetectionValidator as _UltralyticsValidator
except ImportError as e:  # pragma: no cover - exercised without ultralytics
    raise ImportError("gdsdata.yolo needs Ultralytics: pip install ultralytics") from e

_HYP = ("mosaic", "close_mosaic", "degrees", "translate", "scale", "shear", "fliplr", "flipud", "hsv_h", "hsv_s",
        "hsv_v", "seed")


class _Samples:
    """The sampler Ultralytics' trainer asks about: how many samples an epoch has, and ``set_epoch``."""

    def __init__(self, batches):
        self._batches = batches

    def __len__(self):
        spec = self._batches.loader.spec
        return min(len(self._batches.loader) * spec.batch_size, spec.size)

    def set_epoch(self, epoch):
        self._batches.loader.set_epoch(epoch)


class _DatasetView:
    """``train_loader.dataset`` as Ultralytics uses it: its length, image files and the mosaic switch
    (``YoloAugment`` turns the mosaic off itself at the same epoch as Ultralytics' ``close_mosaic``)."""

    def __init__(self, ds):
        self._ds = ds
        self.mosaic = True

    def __len__(self):
        return len(self._ds)

    @property
    def im_files(self):
        return [self._ds.source(i) for i in range(len(self._ds))]

    def close_mosaic(self, hyp=None):
        self.mosaic = False


class Batches:
    """What Ultralytics' trainer and validator use of a DataLoader, over a ``gdsdata.Loader`` whose
    transform gives Ultralytics' batch dict: ``len``, iteration, ``batch_size``, ``drop_last``,
    ``num_workers``, ``sampler``, ``dataset``, ``reset()`` and ``close()``. ``epoch``: a callable
    giving the trainer's epoch, which each pass follows (resumed runs draw as uninterrupted ones)."""

    num_workers = 0

    def __init__(self, loader: Loader, epoch=None):
        self.loader = loader
        self.batch_size = loader.spec.batch_size
        self.drop_last = loader.spec.drop_last
        self.dataset = _DatasetView(loader.dataset)
        self.sampler = _Samples(self)
        self._epoch = epoch

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self._epoch is not None and self.loader.epoch != self._epoch():
            self.loader.set_epoch(self._epoch())
        yield from self.loader

    def reset(self):
        """Ultralytics calls this after ``close_mosaic``: the next pass starts its epoch afresh anyway."""

    def close(self):
        self.loader.close()


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
        check = _validator_module.check_det_dataset
        _validator_module.check_det_dataset = lambda *args, **kwargs: dict(self._gds_data)
        try:
            return super().__call__(trainer=trainer, model=model)
        finally:
            _validator_module.check_det_dataset = check


class DetectionTrainer(_UltralyticsTrainer):
    """Ultralytics' ``DetectionTrainer`` with batches from the packed datasets ``train`` and ``val``
    (``gdsdata pack --format yolo|coco``). ``overrides``: Ultralytics' arguments (``model``,
    ``epochs``, ``imgsz``, ``batch``, ``device``, hyper-parameters ...)."""

    def __init__(self, train, val, cfg=DEFAULT_CFG, overrides=None, _callbacks=None):
        self.gds_roots = {"train": str(train), "val": str(val)}
        probe = GDSDataset(self.gds_roots["train"])
        if probe.task != "detect":
            raise TypeError(f"{train} is a classification dataset; DetectionTrainer trains on detection datasets")
        self._names = dict(enumerate(probe.classes))
        overrides = dict(overrides or {})
        overrides.setdefault("data", self.gds_roots["train"])
        super().__init__(cfg, overrides, _callbacks)

    def get_dataset(self):
        return {"train": self.gds_roots["train"], "val": self.gds_roots["val"], "names": self._names,
                "nc": len(self._names), "channels": 3}

    def get_dataloader(self, dataset_path, batch_size=16, rank=0, mode="train"):
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        ds = GDSDataset(self.gds_roots[mode], device=device)
        if mode == "train":
            hyp = {name: getattr(self.args, name) for name in _HYP}
            hyp["seed"] = int(hyp["seed"])
            transform = YoloAugment(imgsz=self.args.imgsz, epochs=self.epochs, targets="ultralytics", **hyp)
        else:
            transform = Letterbox(imgsz=self.args.imgsz, targets="ultralytics")
        loader = Loader(ds, batch_size, shuffle=mode == "train", seed=int(self.args.seed), transform=transform,
                        drop_last=False, rank=0, world_size=1)
        return Batches(loader, epoch=(lambda: self.epoch) if mode == "train" else None)

    def get_validator(self):
        return DetectionValidator(self.data, self.test_loader, save_dir=self.save_dir, args=copy.copy(self.args),
                                  _callbacks=self.callbacks)

    def plot_training_labels(self):
        """Ultralytics plots its own dataset's label statistics here; ``gdsdata inspect`` shows them."""

    def __repr__(self):
        return f"gdsdata.yolo.DetectionTrainer({self.gds_roots['train']!r}, {self.gds_roots['val']!r})"

