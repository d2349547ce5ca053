"""Ultralytics' trainer fed by gdsdata (gdsdata.yolo.DetectionTrainer): a YOLO model built from its
model YAML (no weights downloaded) trains on the CPU (and on a GPU, marked gpu) through Ultralytics'
own loop, with the mosaic closed for the last epoch, validates each epoch on rectangular Letterbox batches and
evaluates best.pt at the end; the batches it consumed are Ultralytics' batch dicts with every field
its loss and validator read."""

import os
import sys

import pytest
import torch
from PIL import Image

import gdsdata
from gdsdata.packing.packer import pack
from gdsdata.transforms import detection as D

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from make_detection import generate  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("yolo_src"))
    generate(root, 12, classes=3, seed=21, val=0.34)
    out = tmp_path_factory.mktemp("yolo")
    data = os.path.join(root, "yolo", "data.yaml")
    return (pack(data, str(out / "train"), format="yolo", workers=1).out,
            pack(data, str(out / "val"), format="yolo", split="val", workers=1).out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("0", marks=pytest.mark.gpu)])
def test_ultralytics_trains_and_validates_on_gdsdata_batches(packed, tmp_path, monkeypatch, device):
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    pytest.importorskip("ultralytics")
    from gdsdata.yolo import DetectionTrainer

    Image.open = opener  # Ultralytics replaces PIL's opener for the whole process (tests/test_detection_augment.py)
    train, val = packed
    seen = []
    trainer = DetectionTrainer(train, val, overrides={
        "model": "yolov8n.yaml", "epochs": 2, "close_mosaic": 1, "imgsz": 64, "batch": 4, "device": device,
        "workers": 0, "plots": False, "amp": False, "pretrained": False, "project": str(tmp_path), "name": "run",
        "exist_ok": True})
    original = trainer.preprocess_batch

    def preprocess(batch):
        seen.append({k: (tuple(v.shape) if isinstance(v, torch.Tensor) else len(v)) for k, v in batch.items()})
        return original(batch)

    monkeypatch.setattr(trainer, "preprocess_batch", preprocess)
    from ultralytics.engine import trainer as module

    import ultralytics

    amp_checks = []  # Ultralytics' AMP check runs where its YOLO model cannot be loaded (downloaded)
    monkeypatch.setattr(module, "check_amp", lambda model: amp_checks.append(ultralytics.YOLO.__name__) or False)
    trainer.args.amp = True
    trainer.train()
    assert amp_checks == ["offline"]
    assert (tmp_path / "run" / "weights" / "best.pt").exists()
    assert set(trainer.metrics) >= {"metrics/mAP50(B)", "metrics/mAP50-95(B)"}
    assert len(seen) == 2 * 2  # 8 training images, batch 4, two epochs
    assert all(s["img"][1:] == (3, 64, 64) and s["im_file"] == s["img"][0] for s in seen)
    assert trainer.train_loader.loader.dataset.device.type == ("cpu" if device == "cpu" else "cuda")
    assert trainer.train_loader.loader.transform.mosaic == 0.0  # closed by Ultralytics for the last epoch
    assert list(trainer.train_loader.sampler) and len(trainer.train_loader.dataset.labels) == 8
    assert trainer.data["names"] == dict(enumerate(gdsdata.GDSDataset(train).classes))
    validation = trainer.test_loader.loader  # Ultralytics' validation batches: rectangles in aspect-ratio order
    assert validation.transform.rect and validation.transform.stride == 32
    val_ds = gdsdata.GDSDataset(val)
    order = gdsdata.Letterbox.rect_order(val_ds)
    for k, batch in enumerate(trainer.test_loader):
        sizes = val_ds.index.samples[order[k * 8:k * 8 + 8]]
        assert batch["img"].shape[2:] == D.rect_shape(sizes["height"], sizes["width"], 64, 32)
    if device == "cpu":  # the checkpoint names the packs' data YAML: Ultralytics' own val() finds the val split
        from ultralytics import YOLO

        assert trainer.args.data == gdsdata.GDSDataset(val).meta["source"]
        try:
            metrics = YOLO(str(tmp_path / "run" / "weights" / "best.pt")).val(imgsz=64, batch=4, device="cpu",
                                                                               plots=False, project=str(tmp_path))
        finally:
            Image.open = opener
        assert "metrics/mAP50-95(B)" in metrics.results_dict


def test_settings_the_batches_do_not_follow_are_refused(packed, tmp_path, photos_dataset, monkeypatch, caplog):
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    pytest.importorskip("ultralytics")
    from gdsdata.yolo import DetectionTrainer

    Image.open = opener
    common = {"model": "yolov8n.yaml", "imgsz": 64, "device": "cpu", "project": str(tmp_path), "name": "r"}
    with pytest.raises(ValueError, match="mixup=0.5"):
        DetectionTrainer(*packed, overrides={**common, "mixup": 0.5})
    with pytest.raises(ValueError, match="rect=True"):  # square mosaic batches, not rectangular ones
        DetectionTrainer(*packed, overrides={**common, "rect": True})
    with pytest.raises(ValueError, match="batch=-1: Ultralytics' AutoBatch"):
        DetectionTrainer(*packed, overrides={**common, "batch": -1})
    with pytest.raises(ValueError, match=r"^'mosaik' is not a valid YOLO argument. Similar arguments are i.e. "
                                         r"\['mosaic=1.0'\].$"):  # in one line, not with Ultralytics' whole CLI help
        DetectionTrainer(*packed, overrides={**common, "mosaik": 0.5})
    assert not os.path.exists(tmp_path / "r")  # each refused before Ultralytics made a run folder
    with pytest.raises(TypeError, match="the val dataset.*classification"):  # at once, not after the model is built
        DetectionTrainer(packed[0], photos_dataset[2], overrides=common)
    root = str(tmp_path / "other")
    generate(root, 4, classes=2, seed=5, val=0.5)  # other class names: mAP per class would mean nothing
    other = pack(os.path.join(root, "yolo", "data.yaml"), str(tmp_path / "other.gds"), format="yolo", split="val",
                 workers=1).out
    with pytest.raises(ValueError, match="the val dataset\\) has the classes"):
        DetectionTrainer(packed[0], other, overrides=common)
    from ultralytics.data import utils

    fetched = []  # Ultralytics' dataset check fetches a font: not while the trainer looks at the YAML
    monkeypatch.setattr(utils, "check_font", lambda *args, **kwargs: fetched.append(args))
    assert DetectionTrainer(*packed, overrides=common).args.data == gdsdata.GDSDataset(packed[0]).meta["source"]
    assert not fetched
    data = os.path.join(root, "yolo", "data.yaml")
    with open(data) as f:
        text = "path: .\n" + "".join(line for line in f if not line.startswith("path:"))
    with open(data, "w") as f:  # "path: ." is not where Ultralytics looks from here (it reads it from the current
        f.write(text)           # folder, gdsdata from the YAML's): the checkpoints name the train pack
    unfound = pack(data, str(tmp_path / "other-train.gds"), format="yolo", workers=1).out
    other = pack(data, str(tmp_path / "other-val.gds"), format="yolo", split="val", workers=1).out
    with caplog.at_level("WARNING", logger="gdsdata.yolo"):
        assert DetectionTrainer(unfound, other, overrides=common).args.data == unfound
    assert "Ultralytics does not find the splits of" in caplog.text and "needs data=" in caplog.text
    with pytest.raises(ValueError, match="AutoBatch"):
        DetectionTrainer(*packed, overrides={**common, "batch": -1})


def test_the_amp_check_never_loads_the_model_it_would_download():
    """Ultralytics' check_amp compares a YOLO model's float32 and AMP outputs, downloading the model;
    gdsdata's wrapper gives it the "offline" answer instead (its GPU list still applies before)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    ultralytics = pytest.importorskip("ultralytics")
    from gdsdata.yolo import _amp_without_download

    Image.open = opener
    held = ultralytics.YOLO

    def check(model):  # Ultralytics' check_amp past its CPU and GPU-list answers
        try:
            from ultralytics import YOLO

            YOLO("yolo26n.pt")
        except ConnectionError:
            return "skipped, as offline"
        return "downloaded and compared"

    assert _amp_without_download(check)(None) == "skipped, as offline"
    assert ultralytics.YOLO is held



def test_validation_shares_are_ultralytics_contiguous_ones():
    """Each DDP rank validates the run of whole batches Ultralytics' ContiguousDistributedSampler
    gives it (the rectangles stay those of the whole validation order, every image once)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    pytest.importorskip("ultralytics")
    from ultralytics.data.build import ContiguousDistributedSampler

    from gdsdata.yolo import contiguous_share

    Image.open = opener
    for total in (1, 2, 7, 8, 64, 100, 1001):
        for batch in (1, 3, 8, 32, 2000):
            for world in (1, 2, 3, 8):
                if total < world:
                    continue
                shares = [contiguous_share(total, batch, rank, world) for rank in range(world)]
                theirs = [list(ContiguousDistributedSampler(range(total), world, batch, rank)) for rank in range(world)]
                assert [list(range(*share)) for share in shares] == theirs, (total, batch, world)


_RANK_SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from PIL import Image
opener = Image.open
from gdsdata.yolo import DetectionTrainer
Image.open = opener
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=rank, world_size=2)
trainer = DetectionTrainer({train!r}, {val!r}, overrides={{"model": "yolov8n.yaml", "imgsz": 64, "batch": 4,
    "device": "cpu", "project": {project!r}, "name": f"r{{rank}}", "plots": False}})
trainer.world_size = 2  # (Ultralytics' own count, from device="0,1" on a GPU machine)
trainer.epoch = 0
got = {{}}
for mode, batch, given in (("train", 2, rank), ("val", 1, rank), ("val", 3, rank), ("val", 4, -1)):
    batches = trainer.get_dataloader(None, batch_size=batch, rank=given, mode=mode)
    got[f"{{mode}}{{batch}}"] = [list(b["im_file"]) for b in batches]
    got[f"{{mode}}{{batch}}-len"] = [len(batches), len(batches.sampler)]
    batches.close()
print(json.dumps(got))
dist.destroy_process_group()
"""


def test_ddp_ranks_train_on_their_shares_and_validate_on_contiguous_batches(packed, tmp_path):
    """Two ranks (gloo on the CPU, as torchrun starts them): each trains on its half of the same
    epoch order, and validates on its contiguous run of the rectangular validation batches; over
    the ranks every image once."""
    import json
    import subprocess

    from conftest import child_env

    pytest.importorskip("ultralytics")
    train, val = packed
    script = _RANK_SCRIPT.format(root=os.path.join(os.path.dirname(__file__), ".."), rendezvous=tmp_path / "rdv",
                                 train=train, val=val, project=str(tmp_path))
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env(YOLO_OFFLINE="1"))
             for rank in range(2)]
    outs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    ds_train, ds_val = gdsdata.GDSDataset(train), gdsdata.GDSDataset(val)
    images = [[f for b in g["train2"] for f in b] for g in got]
    assert [len(i) for i in images] == [4, 4] and [g["train2-len"] for g in got] == [[2, 4], [2, 4]]
    assert sorted(images[0] + images[1]) == sorted(ds_train.source(i) for i in range(len(ds_train)))
    order = [ds_val.source(int(i)) for i in gdsdata.Letterbox.rect_order(ds_val)]
    assert len(order) == 4
    assert got[0]["val1"] + got[1]["val1"] == [[f] for f in order]  # two batches of one each
    assert got[0]["val3"] == [order[:3]] and got[1]["val3"] == [order[3:]]  # whole batches: 3, then the last one
    assert [g["val3-len"] for g in got] == [[1, 3], [1, 1]]
    assert got[0]["val4"] == got[1]["val4"] == [order]  # rank -1: the whole set (Ultralytics before 8.4: on rank 0)


def test_a_rank_with_no_validation_batch_still_validates_none(packed):
    """More ranks than validation batches: Ultralytics' split leaves the last ranks none, and they
    still take part in gathering the statistics: no batch, no sample, the dataset the whole one."""
    from gdsdata.yolo import Batches

    train, val = packed
    ds = gdsdata.GDSDataset(val)
    batches = Batches(lambda transform: gdsdata.Loader(ds, 2, shuffle=False, transform=transform, rank=0,
                                                       world_size=1),
                      gdsdata.Letterbox(imgsz=64, targets="ultralytics"), empty=True)
    assert len(batches) == 0 and list(batches) == [] and len(batches.sampler) == 0 and list(batches.sampler) == []
    assert len(batches.dataset) == len(ds) == 4
    batches.close()


def test_ddp_is_launched_as_ultralytics_launches_it_also_where_it_does_not_say():
    """Ultralytics before 8.3.200 has no ``trainer.ddp``: gdsdata works it out as those versions do."""
    import types

    from gdsdata.yolo import _launches_ddp

    def trainer(device, **more):
        return types.SimpleNamespace(args=types.SimpleNamespace(device=device), **more)

    assert _launches_ddp(trainer("0,1")) and _launches_ddp(trainer([0, 1]))
    assert not _launches_ddp(trainer("0")) and not _launches_ddp(trainer("cpu")) and not _launches_ddp(trainer(""))
    assert not _launches_ddp(trainer("0,1", ddp=False)) and _launches_ddp(trainer("0", ddp=True))
    os.environ["LOCAL_RANK"] = "0"
    try:
        assert not _launches_ddp(trainer("0,1"))  # a DDP process itself
    finally:
        del os.environ["LOCAL_RANK"]


def test_ultralytics_ddp_launch_rebuilds_the_trainer_with_its_packs(packed, tmp_path, monkeypatch):
    """With several GPUs Ultralytics launches its DDP processes from a file of its own that rebuilds
    the trainer from its class and arguments alone: the packs' paths ride along, and the process
    trains (here one CPU process stands for the ranks torch.distributed.run would start)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    pytest.importorskip("ultralytics")
    pytest.importorskip("cloudpickle")
    from ultralytics.engine import trainer as module

    from gdsdata.yolo import DetectionTrainer

    Image.open = opener
    real = module.generate_ddp_command
    launched = []

    def one_process(trainer):  # Ultralytics' file, run by one Python rather than torch.distributed.run
        cmd, file = real(trainer)
        launched.append(open(file).read())
        return [sys.executable, file], file

    monkeypatch.setattr(module, "generate_ddp_command", one_process)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.join(os.path.dirname(__file__), ".."),
                                                     os.environ.get("PYTHONPATH", "")]))
    trainer = DetectionTrainer(*packed, overrides={
        "model": "yolov8n.yaml", "epochs": 1, "imgsz": 64, "batch": 4, "device": "cpu", "workers": 0, "plots": False,
        "amp": False, "pretrained": False, "val": False, "project": str(tmp_path), "name": "run", "exist_ok": True})
    trainer.ddp = True  # (Ultralytics' own answer for device="0,1" on a GPU machine)
    trainer.train()
    assert len(launched) == 1 and "trainer.train()" in launched[0]
    assert (tmp_path / "run" / "weights" / "last.pt").exists()  # trained by the process the file started
    assert not hasattr(trainer.args, "gdsdata_packs")  # (carried for the launch only: not in checkpoints)
    ckpt = torch.load(tmp_path / "run" / "weights" / "last.pt", weights_only=False)
    assert "gdsdata_packs" not in ckpt["train_args"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_ultralytics_ddp_trains_on_two_gpus(packed, tmp_path, monkeypatch):
    """device="0,1": Ultralytics' own DDP launch (torch.distributed.run, NCCL), each rank on its GPU
    with its share of the batches, validation gathered on rank 0, checkpoints written."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    opener = Image.open
    pytest.importorskip("ultralytics")
    pytest.importorskip("cloudpickle")
    from gdsdata.yolo import DetectionTrainer

    Image.open = opener
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.join(os.path.dirname(__file__), ".."),
                                                     os.environ.get("PYTHONPATH", "")]))
    trainer = DetectionTrainer(*packed, overrides={
        "model": "yolov8n.yaml", "epochs": 2, "close_mosaic": 1, "imgsz": 64, "batch": 4, "device": "0,1",
        "workers": 0, "plots": False, "amp": False, "pretrained": False, "project": str(tmp_path), "name": "run",
        "exist_ok": True})
    assert trainer.ddp
    trainer.train()
    weights = tmp_path / "run" / "weights"
    assert (weights / "best.pt").exists() and (weights / "last.pt").exists()
    rows = (tmp_path / "run" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and "metrics/mAP50-95(B)" in rows[0]  # a header, then each epoch's validation
