"""Detection packs: YOLO and COCO sources round-trip (every box equals the source within 1e-4 of the
image, labels equal, pixels as PIL reads the source), the two layouts of one set give the same
boxes, each kind of bad label is reported as the module says, parts merge, the bytes on disk follow
docs/format.md, and a detection dataset reads through torch's DataLoader or the Loader with a
detection transform (tests/test_detection_augment.py)."""

import json
import importlib.util
import os
import re
import pathlib
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import mean_abs_diff, pil_reference, resealed
from PIL import Image, features

import gdsdata
from gdsdata.cli import main as cli
from gdsdata.errors import FormatError, SourceError
from gdsdata.format import index as index_io
from gdsdata.format import layout as fmt
from gdsdata.packing.detection import label_path
from gdsdata.packing.packer import pack
from gdsdata.packing.prepare import PackOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from make_detection import generate  # noqa: E402


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("det_src"))
    generate(root, 24, classes=5, seed=3, val=0.25)
    return root


def yolo_boxes(path):
    """(labels, N x 4 XYXY fractions) from a label file, as written."""
    rows = np.loadtxt(path, ndmin=2) if os.path.getsize(path) else np.zeros((0, 5))
    cx, cy, w, h = rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4]
    return rows[:, 0].astype(int), np.clip(np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1), 0, 1)


def test_yolo_round_trip(synthetic, tmp_path):
    out = str(tmp_path / "ds")
    result = pack(os.path.join(synthetic, "yolo", "data.yaml"), out, format="yolo", workers=1)
    ds = gdsdata.GDSDataset(out)
    assert ds.task == "detect" and len(ds) == 18 and ds.classes[:2] == ["ellipse-0", "rectangle-1"]
    for name in ("samples", "imgs", "targets", "labels"):  # ImageFolder's: a label per image, which these lack
        with pytest.raises(AttributeError, match="is a detection dataset: its samples have boxes, not one label each"):
            getattr(ds, name)  # (not zeros, which a class count would take for class 0)
    assert result.boxes == len(ds.index.boxes) > 0
    for i in range(len(ds)):
        image_path = os.path.join(synthetic, "yolo", ds.source(i))
        labels, xyxy = yolo_boxes(label_path(image_path))
        image, target = ds[i]
        h, w = image.shape[1:]
        assert target["boxes"].dtype == torch.float32 and target["labels"].dtype == torch.int64
        assert target["labels"].tolist() == labels.tolist()
        assert np.abs(target["boxes"].numpy() / [w, h, w, h] - xyxy).max() < 1e-4
        assert mean_abs_diff(image, pil_reference(image_path)) <= 1
    val = pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "val"), format="yolo", split="val",
               workers=1)
    assert val.packed == 6


def test_a_detection_source_packed_as_classes_is_told_its_format(synthetic, tmp_path):
    """A YOLO folder or data YAML, or a COCO JSON, given without --format: one line saying which
    --format it needs, not a pack of classes named images and labels."""
    for source, said in (("yolo", "a YOLO dataset (images/ and labels/ with .txt labels), not an ImageFolder "
                                  "tree of classes: pass --format yolo"),
                         (os.path.join("yolo", "data.yaml"), "an Ultralytics data YAML needs --format yolo"),
                         (os.path.join("coco", "annotations", "instances_train.json"),
                          "COCO annotations need --format coco")):
        with pytest.raises(SourceError, match=re.escape(said)):
            pack(os.path.join(synthetic, source), str(tmp_path / "out"), allow_empty_classes=True, workers=1)
        assert not os.path.exists(tmp_path / "out")


def test_an_images_folder_packs_the_split_asked_for_and_never_two_splits_together(synthetic, tmp_path, capsys):
    images = os.path.join(synthetic, "yolo", "images")  # holds train/ and val/
    by_yaml = gdsdata.GDSDataset(pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "yaml"),
                                      format="yolo", split="val", workers=1).out)
    val = gdsdata.GDSDataset(pack(images, str(tmp_path / "val"), format="yolo", split="val", workers=1).out)
    assert len(val) == len(by_yaml) == 6
    assert [val.target(i)["boxes"].tolist() for i in range(6)] == \
        [by_yaml.target(i)["boxes"].tolist() for i in range(6)]
    alone = gdsdata.GDSDataset(pack(os.path.join(images, "val"), str(tmp_path / "alone"), format="yolo",
                                    workers=1).out)  # a split's own folder, no --split
    assert len(alone) == 6
    refused = {(images, None): "holds the folders of several splits (train, val); --split chooses the one to pack",
               (images, "test"): "no test folder (its split folders: train, val)",
               (os.path.join(images, "val"), "train"): "a folder of one split's images (no images/ or split "
                                                       "folders in it): --split does not apply"}
    for (src, split), message in refused.items():
        with pytest.raises(SourceError, match=re.escape(message)):
            pack(src, str(tmp_path / "refused"), format="yolo", split=split, workers=1)
        assert not os.path.exists(tmp_path / "refused")
    assert cli(["pack", "--format", "yolo", "--split", "train", os.path.join(images, "val"),
                str(tmp_path / "cli")]) == 1
    err = capsys.readouterr().err
    assert "--split does not apply" in err and "Traceback" not in err and not os.path.exists(tmp_path / "cli")


def test_a_yolo_folder_without_any_label_file_says_so_in_the_summary(synthetic, tmp_path, capsys):
    folder = tmp_path / "unlabelled"
    shutil.copytree(os.path.join(synthetic, "yolo", "images", "val"), folder)
    assert cli(["pack", "--format", "yolo", str(folder), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "images without objects (kept as negatives): 6" in out
    assert re.search(r"no labels: none of its 6 images has a label file .*; every image was packed "
                     r"without objects", out)


def test_a_split_packed_from_the_folder_takes_the_class_names_of_its_data_yaml(synthetic, tmp_path):
    folder = os.path.join(synthetic, "yolo")
    by_yaml = pack(os.path.join(folder, "data.yaml"), str(tmp_path / "yaml"), format="yolo", split="val", workers=1)
    by_folder = pack(folder, str(tmp_path / "folder"), format="yolo", split="val", workers=1)
    a, b = gdsdata.GDSDataset(by_yaml.out), gdsdata.GDSDataset(by_folder.out)
    assert a.classes == b.classes and a.classes[0] == "ellipse-0" and len(a) == len(b) == 6
    assert [a[i][1]["labels"].tolist() for i in range(len(a))] == [b[i][1]["labels"].tolist() for i in range(len(b))]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "notes.yaml").write_text("- a list, not a data YAML\n")  # other YAMLs there: left aside
    (copy / "empty.yml").write_text("")

    def classes(out):
        packed = pack(str(copy), str(tmp_path / out), format="yolo", split="val", workers=1)
        return gdsdata.GDSDataset(packed.out).classes

    assert classes("aside") == a.classes
    (copy / "other.yaml").write_text("names: [a, b, c, d, e]\n")  # a second one naming them otherwise: not guessed
    with pytest.raises(SourceError, match="give different class names; pack the one to use"):
        classes("refused")
    (copy / "other.yaml").unlink()
    (copy / "classes.txt").write_text("\n".join(f"n{k}" for k in range(5)))  # disagreeing with the YAML
    with pytest.raises(SourceError, match="classes.txt and the data YAML there name the classes otherwise"):
        classes("disagree")
    (copy / "classes.txt").write_text("\n".join(a.classes))
    assert classes("agree") == a.classes


def test_coco_round_trip_and_the_same_boxes_as_yolo(synthetic, tmp_path):
    coco = pack(os.path.join(synthetic, "coco", "train"), str(tmp_path / "coco"), format="coco",
                annotations=os.path.join(synthetic, "coco", "annotations", "instances_train.json"), workers=1)
    yolo = pack(os.path.join(synthetic, "yolo", "images", "train"), str(tmp_path / "yolo"), format="yolo", workers=1)
    a, b = gdsdata.GDSDataset(coco.out), gdsdata.GDSDataset(yolo.out)
    assert a.index.meta["detection"]["category_ids"] == [1, 2, 3, 4, 5]
    assert len(a) == len(b) and [a.source(i) for i in range(len(a))] == [os.path.basename(b.source(i))
                                                                          for i in range(len(b))]
    for i in range(len(a)):
        ta, tb = a.target(i), b.target(i)
        assert ta["labels"].tolist() == tb["labels"].tolist()
        assert torch.allclose(ta["boxes"], tb["boxes"], atol=0.05)  # pixels; the YOLO text has 6 decimals
        assert not ta["iscrowd"].any()
        assert "image_id" not in tb


def test_coco_image_ids_are_kept_through_parts_merge_and_letterbox_batches(synthetic, tmp_path, caplog):
    """What COCO's API evaluates by: each sample's image id, as torchvision's CocoDetection keeps it
    (``ds.ids``, ``target["image_id"]``), also after parts are merged and in Letterbox batches."""
    images, ann = os.path.join(synthetic, "coco", "train"), os.path.join(synthetic, "coco", "annotations",
                                                                          "instances_train.json")
    with open(ann) as f:
        data = json.load(f)
    shift = 10_000_000_000  # ids beyond 32 bits, unordered against the file names
    for record in data["images"]:
        record["id"] = shift - record["id"] * 7
    for a in data["annotations"]:
        a["image_id"] = shift - a["image_id"] * 7
    ann = str(tmp_path / "instances.json")
    with open(ann, "w") as f:
        json.dump(data, f)
    id_of = {record["file_name"]: record["id"] for record in data["images"]}
    whole = gdsdata.GDSDataset(pack(images, str(tmp_path / "whole"), format="coco", annotations=ann, workers=1).out)
    assert whole.ids == [id_of[whole.source(i)] for i in range(len(whole))] and len(set(whole.ids)) == len(whole)
    assert [whole.target(i)["image_id"] for i in range(len(whole))] == whole.ids
    moved = gdsdata.GDSDataset(whole.root, transforms=lambda image, target: (image, target))  # (v2 transforms')
    assert moved[1][1]["image_id"] == whole.ids[1] and set(moved[1][1]) == {"image_id", "boxes", "labels"}
    parts = [pack(images, str(tmp_path / f"p{k}"), format="coco", annotations=ann, workers=1, num_parts=2,
                  part=k).out for k in range(2)]
    merged = gdsdata.GDSDataset(gdsdata.merge(parts, str(tmp_path / "merged"))["out"])
    assert merged.ids == whole.ids
    again = pack(images, str(tmp_path / "again"), format="coco", annotations=ann, workers=1).out
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):  # each id twice: none names one image
        twice = gdsdata.GDSDataset(gdsdata.merge([whole.root, again], str(tmp_path / "twice"))["out"])
    assert not hasattr(twice, "ids") and "image_id" not in twice.target(0) and "image ids repeat" in caplog.text
    seen = []
    for _, targets in gdsdata.Loader(whole, 4, shuffle=False, transform=gdsdata.Letterbox(imgsz=64)):
        seen += [t["image_id"] for t in targets]
    assert seen == whole.ids[:len(seen)] and len(seen) == len(whole)
    yolo = gdsdata.GDSDataset(pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "y"), format="yolo",
                                   workers=1).out)
    assert not hasattr(yolo, "ids") and "image_id" not in yolo.target(0)
    damaged = str(tmp_path / "damaged")  # an id list that is not one id a sample: refused, not misread
    shutil.copytree(whole.root, damaged)
    index = whole.index
    meta = json.loads(json.dumps(index.meta))
    meta["detection"]["image_ids"].pop()
    index_io.write(damaged, index.alignment, index.dataset_id, index.shards, index.samples, bytes(index.strings), meta,
                   boxes=index.boxes, box_start=index.box_start)
    with pytest.raises(FormatError, match="its image ids are not one integer a sample"):
        gdsdata.GDSDataset(damaged)


def write_coco(root, images, annotations, categories):
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    for name, (w, h) in images.items():
        Image.new("RGB", (w, h), (90, 120, 150)).save(os.path.join(root, "images", name), quality=90)
    data = {"images": [{"id": k + 1, "file_name": name, "width": w, "height": h}
                       for k, (name, (w, h)) in enumerate(images.items())],
            "annotations": [dict(id=k + 1, **a) for k, a in enumerate(annotations)],
            "categories": [{"id": cid, "name": name} for cid, name in categories]}
    path = os.path.join(root, "instances.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path, os.path.join(root, "images")


def test_coco_ids_crowds_and_bad_annotations(tmp_path):
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (200, 100), "b.jpg": (64, 64), "c.jpg": (50, 40)}, [
        {"image_id": 1, "category_id": 9, "bbox": [10, 20, 30, 40]},
        {"image_id": 1, "category_id": 5, "bbox": [150, 50, 100, 100], "iscrowd": 1},  # reaches outside: clipped
        {"image_id": 1, "category_id": 9, "bbox": [10, 20, 30, 40]},  # the same again
        {"image_id": 1, "category_id": 7, "bbox": [0, 0, 5, 5]},  # no such category
        {"image_id": 1, "category_id": 5, "bbox": [20, 20, 0, 10]},  # no width
        {"image_id": 1, "category_id": 5, "bbox": [300, 20, 10, 10]},  # outside the image
        {"image_id": 8, "category_id": 5, "bbox": [0, 0, 5, 5]},  # no such image
        {"image_id": 3, "category_id": 5, "bbox": [0, 0, 5, 5]},
    ], [(9, "dog"), (5, "cat")])
    os.unlink(os.path.join(images, "c.jpg"))  # listed, missing
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    ds = gdsdata.GDSDataset(result.out)
    assert ds.classes == ["cat", "dog"] and ds.index.meta["detection"]["category_ids"] == [5, 9]
    assert len(ds) == 2  # b.jpg has no objects: a negative
    target = ds.target(0)
    assert target["labels"].tolist() == [1, 0]
    assert torch.allclose(target["boxes"], torch.tensor([[10.0, 20, 40, 60], [150, 50, 200, 100]]), atol=1e-3)
    assert target["iscrowd"].tolist() == [0, 1]
    assert len(ds.target(1)["boxes"]) == 0
    # Letterbox's torchvision targets keep the crowd box, flagged, as the dataset's own and COCO's evaluation;
    # Ultralytics' batches (training and evaluation) and YoloAugment's leave it out, as Ultralytics does
    (_, (first, second)), = gdsdata.Loader(ds, 2, shuffle=False, transform=gdsdata.Letterbox(imgsz=64))
    assert first["labels"].tolist() == [1, 0] and first["iscrowd"].tolist() == [0, 1] and first["iscrowd"].dtype == \
        torch.uint8
    scale = 64 / 200  # (200 x 100 -> 64 x 32, 16 rows of padding above)
    assert torch.allclose(first["boxes"], target["boxes"] * scale + torch.tensor([0, 16, 0, 16]), atol=1e-3)
    assert second["iscrowd"].tolist() == [] and len(second["boxes"]) == 0
    batch = next(iter(gdsdata.Loader(ds, 2, shuffle=False, transform=gdsdata.Letterbox(64, targets="ultralytics"))))
    assert batch["cls"].flatten().tolist() == [1]
    (_, (augmented, _)), = gdsdata.Loader(ds, 2, shuffle=False, transform=gdsdata.YoloAugment(64, mosaic=0.0,
                                                                                             scale=0.0, translate=0.0))
    assert "iscrowd" not in augmented and augmented["labels"].tolist() == [1]
    labels = result.labels
    assert labels["negatives"] == 1 and len(labels["clipped"]) == 1 and len(labels["duplicates"]) == 1
    assert labels["clipped"][0]["reason"] == ("box reaches outside the image: bbox [150, 50, 100, 100] clipped to "
                                              "bbox [150, 50, 50, 50]")  # (COCO's form, in the image's pixels)
    reasons = " | ".join(d["reason"] for d in labels["dropped"])
    assert "category id 7 is not in 'categories'" in reasons and "degenerate" in reasons and "outside" in reasons
    assert "image id 8 is not in 'images'" in labels["orphans"][0]["reason"]
    assert result.unreadable[0]["path"] == "c.jpg"
    report = json.loads(pathlib.Path(result.report_path).read_text())
    assert report["labels"]["duplicates"] == labels["duplicates"]


def test_coco_ids_as_its_api_matches_them_and_each_bad_annotation_with_its_own_reason(tmp_path):
    """An image id listed twice: the last record (COCO's API keeps it, and torchvision); an id that is
    text or not whole is no id; each annotation without a box (or with an iscrowd other than 0 or 1)
    says what it lacks, naming its image;
    a crowd region over an object is no repeat of it; --strict stops at a bad annotation."""
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48), "b.jpg": (64, 48), "d.jpg": (64, 48),
                                                     "e.jpg": (64, 48)}, [
        {"image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10]},
        {"image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10], "iscrowd": 1},  # a crowd region there too
        {"image_id": 2, "category_id": 1, "segmentation": [[1, 1, 9, 1, 9, 9]]},  # no bbox
        {"image_id": "2", "category_id": 1, "bbox": [2, 2, 5, 5]},  # text: names no image 2
        {"image_id": 2, "category_id": 1, "bbox": [1, 2, 3]},
        {"image_id": 2, "category_id": 1, "bbox": [3, 3, 5, 5], "iscrowd": "yes"},  # not 0 or 1
        {"image_id": 1, "category_id": 1, "bbox": [20, 20, 9, 9], "iscrowd": None}], [(1, "x")])  # null: 0
    data = json.loads(pathlib.Path(ann).read_text())
    data["images"][2]["id"] = 1  # d.jpg also claims id 1, after a.jpg: it is the one kept
    data["images"][3]["id"] = 4.5
    pathlib.Path(ann).write_text(json.dumps(data))
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    ds = gdsdata.GDSDataset(result.out)
    assert [ds.index.path(k) for k in range(len(ds))] == ["d.jpg", "b.jpg"]
    assert ds.target(0)["iscrowd"].tolist() == [0, 1, 0]  # (d.jpg holds image 1's annotations)
    bad = {d["path"]: d["reason"] for d in result.labels["bad_labels"]}
    assert "image id 1 is listed again (for d.jpg)" in bad["a.jpg"] and "4.5 is not an integer" in bad["e.jpg"]
    dropped = {d["label"]: d["reason"] for d in result.labels["dropped"]}
    assert dropped["annotation 3 (b.jpg)"] == "no bbox (a segmentation alone: gdsdata packs boxes)"
    assert dropped["annotation 4"] == "image_id: id '2' is not an integer"
    assert dropped["annotation 5 (b.jpg)"].startswith("bbox is not [x, y, w, h] numbers: [1, 2, 3]")
    assert dropped["annotation 6 (b.jpg)"] == 'iscrowd is "yes", not 0 or 1'
    with pytest.raises(SourceError, match=r"annotation 3 \(b.jpg\): no bbox .*\(--strict\)"):
        pack(images, str(tmp_path / "ds2"), format="coco", annotations=ann, workers=1, strict=True)


def test_a_coco_file_name_that_is_no_path_or_a_folder_is_said_so(tmp_path):
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48)}, [], [(1, "x")])
    data = json.loads(pathlib.Path(ann).read_text())
    data["images"] += [{"id": 2, "file_name": None, "width": 64, "height": 48},
                       {"id": 3, "file_name": "sub", "width": 64, "height": 48}]
    pathlib.Path(ann).write_text(json.dumps(data))
    os.makedirs(os.path.join(images, "sub"))
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    assert result.labels["bad_labels"] == [{"path": "image id 2", "reason": "file_name null is not a path"}]
    assert result.unreadable == [{"path": "sub", "reason": "listed in the annotations, a folder, not an image file"}]


def test_a_box_thinner_than_float32_tells_apart_is_dropped_and_the_pack_opens(tmp_path):
    ann, images = write_coco(str(tmp_path / "src"), {"w.jpg": (1000, 20)}, [
        {"image_id": 1, "category_id": 1, "bbox": [999.99999, 1, 5, 5]},
        {"image_id": 1, "category_id": 1, "bbox": [500, 1, 1e-5, 5]},
        {"image_id": 1, "category_id": 1, "bbox": [10, 1, 5, 5]}], [(1, "x")])
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    ds = gdsdata.GDSDataset(result.out)  # (a stored box of no width made the index refuse to open)
    assert torch.allclose(ds.target(0)["boxes"], torch.tensor([[10.0, 1, 15, 6]]), atol=1e-3)
    assert sum("float32" in d["reason"] for d in result.labels["dropped"]) == 2


def test_a_coco_image_listed_twice_keeps_its_first_record_s_boxes_and_reports_the_second(tmp_path):
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48), "b.jpg": (64, 48)}, [
        {"image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10]},
        {"image_id": 1, "category_id": 1, "bbox": [20, 20, 10, 10]},
        {"image_id": 3, "category_id": 1, "bbox": [5, 5, 5, 5]}], [(1, "x")])
    data = json.loads(pathlib.Path(ann).read_text())
    data["images"].append({"id": 3, "file_name": "a.jpg", "width": 64, "height": 48})  # a.jpg again
    pathlib.Path(ann).write_text(json.dumps(data))
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    ds = gdsdata.GDSDataset(result.out)
    assert [ds.index.path(k) for k in range(len(ds))] == ["a.jpg", "b.jpg"]
    assert torch.allclose(ds.target(0)["boxes"], torch.tensor([[1.0, 1, 11, 11], [20, 20, 30, 30]]), atol=1e-3)
    assert result.labels["negatives"] == 1 and ds.index.meta["detection"]["negatives"] == 1
    assert result.labels["bad_labels"] == [{"path": "a.jpg", "reason": "listed again as image id 3 (first as image "
                                                                       "id 1): this record and its 1 annotation(s) "
                                                                       "left out"}]


def test_a_coco_record_without_a_size_takes_the_file_s_own(tmp_path):
    anns = [{"image_id": k, "category_id": 1, "bbox": [8, 6, 20, 10]} for k in (1, 2, 3, 4)]
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48), "b.jpg": (64, 48), "c.jpg": (64, 48),
                                                     "d.jpg": (64, 48)}, anns, [(1, "x")])
    data = json.loads(pathlib.Path(ann).read_text())
    for record in data["images"][1:]:
        del record["width"], record["height"]  # b: no size (COCO's API and torchvision need none)
    data["images"][2]["width"] = 64  # c: a width alone
    pathlib.Path(ann).write_text(json.dumps(data))
    with open(os.path.join(images, "d.jpg"), "wb") as f:
        f.write(b"not an image")
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    ds = gdsdata.GDSDataset(result.out)
    assert [ds.index.path(k) for k in range(len(ds))] == ["a.jpg", "b.jpg"]
    for k in range(2):  # the same boxes as the record that gives its size
        assert torch.allclose(ds.target(k)["boxes"], torch.tensor([[8.0, 6, 28, 16]]), atol=1e-3)
    reasons = {r["path"]: r["reason"] for r in result.labels["bad_labels"]}
    assert reasons["c.jpg"] == ("its record gives width 64 and height null: two sizes in pixels, or neither "
                                "(the file's own size is then taken)")
    assert reasons["d.jpg"].startswith("no width and height in its record, and the file's own size cannot be read")
    assert len(reasons) == 2
    # a file declaring more pixels than PIL's bomb limit: its size is read (the pack's own limit then says why)
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    with open(os.path.join(images, "d.jpg"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    result = pack(images, str(tmp_path / "ds2"), format="coco", annotations=ann, workers=1)
    assert [r["path"] for r in result.labels["bad_labels"]] == ["c.jpg"]
    assert [r["path"] for r in result.skipped] == ["d.jpg"]
    assert result.skipped[0]["reason"].startswith("declares 20000x20000 = 400,000,000 pixels, over the limit")


def test_coco_image_of_another_size_than_annotated_is_left_out(tmp_path):
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48), "b.jpg": (64, 48)},
                             [{"image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10]}], [(1, "x")])
    Image.new("RGB", (48, 64)).save(os.path.join(images, "b.jpg"))  # turned since annotated
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    assert result.packed == 1
    assert result.skipped == [{"path": "b.jpg", "reason": (
        "the image is 48x64, its annotations were made for 64x48 (the same turned a quarter: COCO images are packed "
        "as stored, no EXIF orientation applied, as torchvision reads them)")}]


def yolo_tree(root, labels: dict, names=("a", "b"), sizes=None):
    """images/train/NAME.jpg with labels/train/NAME.txt holding ``labels[NAME]`` (None: no label file)."""
    for name, text in labels.items():
        os.makedirs(os.path.join(root, "images", "train"), exist_ok=True)
        os.makedirs(os.path.join(root, "labels", "train"), exist_ok=True)
        Image.new("RGB", (sizes or {}).get(name, (80, 60)), (40, 80, 120)).save(
            os.path.join(root, "images", "train", name + ".jpg"), quality=90)
        if text is not None:
            with open(os.path.join(root, "labels", "train", name + ".txt"), "w") as f:
                f.write(text)
    with open(os.path.join(root, "data.yaml"), "w") as f:
        f.write("path: .\ntrain: images/train\nnames: [" + ", ".join(names) + "]\n")
    return os.path.join(root, "data.yaml")


def test_max_skipped_counts_images_left_out_for_their_labels(tmp_path, capsys):
    """An image left out for its labels is a sample the dataset lacks, as a file that failed to decode
    is: --max-skipped counts it (part 0 of a --num-parts pack, which holds the source's label report),
    merge --max-skipped counts it from that report, and an append does not count it again."""
    from gdsdata.errors import BadImageError

    src = str(tmp_path / "src")
    yaml_path = yolo_tree(src, {**{f"good{k}": "0 0.5 0.5 0.2 0.2\n" for k in range(5)},
                                "words": "0 0.5 zero 0.1 0.1\n", "class": "7 0.5 0.5 0.1 0.1\n"})
    out = str(tmp_path / "over")
    for limit in (1, "25%"):  # 25 % of 7 files: 1
        with pytest.raises(BadImageError, match=r"2 file\(s\) left out, more than --max-skipped .*; the last: "
                                                r"images.train.words.jpg: labels.train.words.txt: line 1: not numbers"):
            pack(yaml_path, out, format="yolo", workers=1, max_skipped=limit)
        assert sorted(os.listdir(out)) == [fmt.REPORT_NAME]  # (the failed report lists them)
        report = json.loads(pathlib.Path(out, fmt.REPORT_NAME).read_text())
        assert report["status"] == "failed" and len(report["labels"]["left_out"]) == 2
    ds = str(tmp_path / "ds")
    assert pack(yaml_path, ds, format="yolo", workers=1, max_skipped="30%").packed == 5  # 30 % of 7: 2
    assert pack(yaml_path, ds, format="yolo", workers=1, append=True, max_skipped=0).new == 0  # counted before
    capsys.readouterr()
    assert cli(["pack", "--format", "yolo", yaml_path, ds, "--append", "--max-skipped", "0", "-q"]) == 0
    said = capsys.readouterr().out
    assert "holds the rest of" in said and "images left out for their labels: 2" in said, said
    parts = [str(tmp_path / f"part{k}") for k in range(2)]
    for k, part in enumerate(parts):
        pack(yaml_path, part, format="yolo", workers=1, num_parts=2, part=k)
    with pytest.raises(BadImageError, match=r"part0, .*part1: 2 file\(s\) left out, more .* allows; .*class.jpg: "):
        gdsdata.merge(parts, str(tmp_path / "merged"), max_skipped=1)
    assert not os.path.exists(tmp_path / "merged")
    assert gdsdata.merge(parts, str(tmp_path / "merged"), max_skipped=2)["samples"] == 5
    # an append whose only new image is left out for its labels stops too (the dataset as it was)
    yolo_tree(src, {"zbad": "0 0.5 zero 0.1 0.1\n"})
    with pytest.raises(BadImageError, match=r"1 file\(s\) left out, more than --max-skipped 0 allows; "
                                            r"images.train.zbad.jpg: "):
        pack(yaml_path, ds, format="yolo", workers=1, append=True, max_skipped=0)
    assert len(gdsdata.GDSDataset(ds)) == 5
    # an image the dataset holds whose labels are bad now: refused, as labels that give other boxes are
    yolo_tree(src, {"good0": "0 0.5 nothing 0.2 0.2\n", "new": "0 0.5 0.5 0.2 0.2\n"})
    with pytest.raises(SourceError, match=r"good0.jpg: its labels are bad now \(.*not numbers.*\), and .* holds it "
                                          r"with the boxes packed before"):
        pack(yaml_path, ds, format="yolo", workers=1, append=True)


def test_a_finished_resume_and_an_old_report_say_what_the_labels_left_out(tmp_path):
    """A resume of a finished pack gives its report's label report (part 1's: none, as it packed);
    a report written before ``left_out`` is counted by its bad labels, each image once."""
    src = str(tmp_path / "src")
    yaml_path = yolo_tree(src, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "0 0.5 0.5 0.2 0.2\n", "words": "0 x 0.5 0.1 0.1\n"})
    ds = str(tmp_path / "ds")
    packed = pack(yaml_path, ds, format="yolo", workers=1)
    again = pack(yaml_path, ds, format="yolo", workers=1, resume=True)
    assert again.finished_before and again.labels == packed.labels and len(again.labels["left_out"]) == 1
    part = str(tmp_path / "part1")
    pack(yaml_path, part, format="yolo", workers=1, num_parts=2, part=1)
    assert pack(yaml_path, part, format="yolo", workers=1, num_parts=2, part=1, resume=True).labels is None
    report = pathlib.Path(ds, fmt.REPORT_NAME)
    old = json.loads(report.read_text())
    del old["labels"]["left_out"]
    report.write_text(json.dumps(old))
    assert pack(yaml_path, ds, format="yolo", workers=1, append=True, max_skipped=0).new == 0


def test_max_skipped_counts_each_coco_image_left_out_once_and_not_those_packed(tmp_path):
    """A COCO image record left out (an id listed again, a file named twice) leaves its file out only
    where no other record names it; a file missing and named twice counts once."""
    from gdsdata.errors import BadImageError

    ann, images = write_coco(str(tmp_path / "src"), {name: (64, 48) for name in ("a.jpg", "b.jpg", "c.jpg",
                                                                                 "d.jpg", "e.jpg")}, [], [(1, "x")])
    data = json.loads(pathlib.Path(ann).read_text())
    data["images"] += [{"id": 6, "file_name": "a.jpg", "width": 64, "height": 48},  # a.jpg named again: packed
                       {"id": 2, "file_name": "c.jpg", "width": 64, "height": 48},  # id 2 again: b.jpg left out,
                       # c.jpg named twice (ids 2 and 3): packed
                       {"id": 7, "file_name": "d.jpg", "width": 64, "height": 48}]  # d.jpg named again, missing
    pathlib.Path(ann).write_text(json.dumps(data))
    os.unlink(os.path.join(images, "d.jpg"))
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1, max_skipped=2)
    assert sorted(entry["path"] for entry in result.labels["bad_labels"]) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]
    assert [entry["path"] for entry in result.labels["left_out"]] == ["b.jpg"]
    assert [entry["path"] for entry in result.unreadable] == ["d.jpg"]
    assert sorted(gdsdata.GDSDataset(result.out).index.path(k) for k in range(3)) == ["a.jpg", "c.jpg", "e.jpg"]
    with pytest.raises(BadImageError, match=r"2 file\(s\) left out, more than --max-skipped 1 allows"):
        pack(images, str(tmp_path / "ds1"), format="coco", annotations=ann, workers=1, max_skipped=1)


def test_yolo_bad_labels_are_reported_as_the_module_says(tmp_path):
    src = str(tmp_path / "src")
    yaml_path = yolo_tree(src, {
        "good": "0 0.5 0.5 0.2 0.2\n1 0.25 0.25 0.1 0.1\n0 0.5 0.5 0.2 0.2\n",  # the last line repeats the first
        "edge": "1 0.95 0.5 0.2 0.2\n0 1.01 0.5 0.005 0.2\n0 0.5 0.5 0 0.3\n",  # clipped, outside, degenerate
        "polygon": "1 0.1 0.1 0.3 0.1 0.3 0.4\n",  # a polygon: its bounding box
        "negative": "",
        "unlabelled": None,
        "words": "0 0.5 zero 0.1 0.1\n",
        "class": "7 0.5 0.5 0.1 0.1\n",
        "pixels": "0 320 240 50 50\n",
        "wide_polygon": "1 0.2 0.1 2.0 0.1 1.0 0.5\n",  # reaches x = 2: its box is 1.8 wide
    })
    with open(os.path.join(src, "labels", "train", "lost.txt"), "w") as f:
        f.write("0 0.5 0.5 0.1 0.1\n")
    result = pack(yaml_path, str(tmp_path / "ds"), format="yolo", workers=1)
    ds = gdsdata.GDSDataset(result.out)
    packed = {os.path.basename(ds.source(i)): i for i in range(len(ds))}
    assert set(packed) == {"good.jpg", "edge.jpg", "polygon.jpg", "negative.jpg", "unlabelled.jpg"}
    good = ds.target(packed["good.jpg"])
    assert good["labels"].tolist() == [0, 1]
    assert torch.allclose(good["boxes"], torch.tensor([[32.0, 24, 48, 36], [16, 12, 24, 18]]), atol=1e-3)
    edge = ds.target(packed["edge.jpg"])
    assert torch.allclose(edge["boxes"], torch.tensor([[68.0, 24, 80, 36]]), atol=1e-3)
    polygon = ds.target(packed["polygon.jpg"])
    assert torch.allclose(polygon["boxes"], torch.tensor([[8.0, 6, 24, 24]]), atol=1e-3)
    labels = result.labels
    assert labels["negatives"] == 2 and len(labels["duplicates"]) == 1 and len(labels["clipped"]) == 1
    assert sorted(d["reason"].split(":")[0] for d in labels["dropped"]) == ["box outside the image",
                                                                           "degenerate box (no width or height)"]
    bad = {d["path"]: d["reason"] for d in labels["bad_labels"]}
    assert "not numbers" in bad[os.path.join("images", "train", "words.jpg")]
    assert "class id 7 is not in the 2 names" in bad[os.path.join("images", "train", "class.jpg")]
    assert "coordinates up to 320, beyond the image" in bad[os.path.join("images", "train", "pixels.jpg")]
    assert bad[os.path.join("images", "train", "wide_polygon.jpg")].endswith(
        "line 1: the bounding box (cx cy w h) of its polygon, x 0.2 to 2, y 0.1 to 0.5, has coordinates up to 1.8, "
        "beyond the image: YOLO labels are fractions of its width and height (at most 1.01, as Ultralytics allows)")
    assert labels["orphans"] == [{"label": os.path.join("labels", "train", "lost.txt"),
                                  "reason": "a label file without an image"}]
    with pytest.raises(SourceError, match="class id 7 is not in the 2 names .*--strict"):
        pack(yaml_path, str(tmp_path / "strict"), format="yolo", workers=1, strict=True)


def test_yolo_images_are_turned_as_exif_says_and_coco_images_are_not(tmp_path):
    src = str(tmp_path / "src")
    yolo_tree(src, {"turned": "0 0.25 0.5 0.5 0.2\n"}, sizes={"turned": (80, 40)})
    path = os.path.join(src, "images", "train", "turned.jpg")
    stripes = Image.new("RGB", (80, 40), (0, 0, 0))
    stripes.paste((255, 255, 255), (0, 0, 40, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90 degrees clockwise (portrait 40x80)
    stripes.save(path, quality=95, exif=exif)
    result = pack(os.path.join(src, "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1)
    image, target = gdsdata.GDSDataset(result.out)[0]
    assert tuple(image.shape) == (3, 80, 40) and result.converted == 1
    from PIL import ImageOps

    turned = np.array(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    assert mean_abs_diff(image, turned) < 3
    ann, images = write_coco(str(tmp_path / "coco"), {"t.jpg": (80, 40)}, [], [(1, "x")])
    shutil.copy(path, os.path.join(images, "t.jpg"))
    coco = pack(images, str(tmp_path / "coco_ds"), format="coco", annotations=ann, workers=1)
    assert tuple(gdsdata.GDSDataset(coco.out)[0][0].shape) == (3, 40, 80)  # as torchvision's CocoDetection reads it


def test_parts_merge_into_the_single_pack(synthetic, tmp_path):
    data = os.path.join(synthetic, "yolo", "data.yaml")
    whole = gdsdata.GDSDataset(pack(data, str(tmp_path / "whole"), format="yolo", workers=1).out)
    parts = [pack(data, str(tmp_path / f"p{k}"), format="yolo", workers=1, num_parts=2, part=k).out for k in range(2)]
    merged = gdsdata.GDSDataset(gdsdata.merge(parts, str(tmp_path / "merged"))["out"])
    assert merged.task == "detect" and len(merged) == len(whole)
    assert np.array_equal(merged.index.boxes, whole.index.boxes)
    assert np.array_equal(merged.index.box_start, whole.index.box_start)
    assert merged.index.meta["detection"]["per_class_boxes"] == whole.index.meta["detection"]["per_class_boxes"]


def test_the_annotation_table_on_disk_follows_the_format(synthetic, tmp_path):
    out = pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1).out
    raw = pathlib.Path(os.path.join(out, fmt.INDEX_NAME)).read_bytes()
    header = np.frombuffer(raw, fmt.INDEX_HEADER, count=1)[0]
    index = index_io.load(out)
    assert header["version"] == 3 and header["num_boxes"] == len(index.boxes)
    at = int(header["annotations_offset"])
    assert at == int(header["meta_offset"]) + int(header["meta_size"])
    starts = np.frombuffer(raw, "<u8", count=len(index) + 1, offset=at)
    boxes = np.frombuffer(raw, fmt.BOX_RECORD, count=int(header["num_boxes"]), offset=at + starts.nbytes)
    assert at + starts.nbytes + boxes.nbytes == len(raw)
    assert starts[0] == 0 and starts[-1] == len(boxes) and np.array_equal(boxes, index.boxes)
    # a box that is not a box is refused, naming the sample
    damaged = bytearray(raw)
    x1 = at + starts.nbytes + fmt.BOX_RECORD.fields["x1"][1]
    damaged[x1:x1 + 4] = np.float32(-1).tobytes()
    copy = str(tmp_path / "damaged")
    shutil.copytree(out, copy)
    pathlib.Path(os.path.join(copy, fmt.INDEX_NAME)).write_bytes(resealed(damaged))
    with pytest.raises(FormatError, match=r"box 0 of sample 0 .* is not a box inside the image"):
        index_io.load(copy)


def test_a_detection_dataset_needs_a_detection_transform_and_reads_through_the_dataloader(synthetic, tmp_path):
    out = pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1).out
    ds = gdsdata.GDSDataset(out)
    with pytest.raises(TypeError, match="is a detection dataset: the Loader builds its batches with "
                                        "transform=gdsdata.YoloAugment"):
        gdsdata.Loader(ds, 4)
    images, targets = next(iter(torch.utils.data.DataLoader(ds, 4, collate_fn=gdsdata.collate)))
    assert len(images) == 4 and all(set(t) == {"boxes", "labels", "iscrowd"} for t in targets)
    with pytest.raises(TypeError, match="classification dataset"):
        gdsdata.GDSDataset(os.path.join(os.path.dirname(__file__), "data", "golden", "ds")).target(0)


def test_torchvision_v2_transforms_move_the_boxes_with_the_image(synthetic, tmp_path):
    """transforms= takes (image, target) as torchvision datasets' does, the boxes as BoundingBoxes, so
    that v2 transforms move them; transform= (the image alone) is refused on a detection dataset."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    out = pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1).out
    plain = gdsdata.GDSDataset(out)
    flips = gdsdata.GDSDataset(out, transforms=v2.RandomHorizontalFlip(p=1.0))
    crops = gdsdata.GDSDataset(out, transforms=v2.Compose([v2.RandomIoUCrop(trials=1000), v2.Resize((96, 128)),
                                                           v2.SanitizeBoundingBoxes()]))
    for i in range(4):
        image, target = plain[i]
        flipped, moved = flips[i]
        w = image.shape[-1]
        assert isinstance(flipped, tv_tensors.Image) and isinstance(moved["boxes"], tv_tensors.BoundingBoxes)
        assert torch.equal(flipped, image.flip(-1))
        assert torch.allclose(moved["boxes"], torch.stack([w - target["boxes"][:, 2], target["boxes"][:, 1],
                                                           w - target["boxes"][:, 0], target["boxes"][:, 3]], 1))
        assert torch.equal(moved["labels"], target["labels"]) and set(moved) == {"boxes", "labels"}
        torch.manual_seed(i)
        cropped, kept = crops[i]  # the same draws on the same image and boxes as torchvision's own pipeline
        torch.manual_seed(i)
        reference = v2.Compose(crops.transforms.transforms)(tv_tensors.Image(image), {"labels": target["labels"],
            "boxes": tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=tuple(image.shape[-2:]))})
        assert cropped.shape[-2:] == (96, 128) and torch.equal(cropped, reference[0])
        assert torch.equal(kept["boxes"], reference[1]["boxes"]) and torch.equal(kept["labels"], reference[1]["labels"])
        assert kept["boxes"].canvas_size == (96, 128)
    images, targets = next(iter(torch.utils.data.DataLoader(flips, 4, collate_fn=gdsdata.collate)))
    assert len(images) == 4 and all(isinstance(t["boxes"], tv_tensors.BoundingBoxes) for t in targets)
    with pytest.raises(ValueError, match=r"is a detection dataset: transform= changes the image alone, so a flip, "
                                         r"crop or resize would leave its boxes where they were; pass transforms="):
        gdsdata.GDSDataset(out, transform=v2.RandomHorizontalFlip(p=1.0))
    with pytest.raises(ValueError, match="pass transforms= .* or transform=/target_transform=, not both"):
        gdsdata.GDSDataset(out, transforms=v2.RandomHorizontalFlip(), target_transform=lambda t: t)
    with pytest.raises(ValueError, match=r"GDSDataset\(\.\.\., transforms=\)"):
        gdsdata.Loader(flips, 4, transform=gdsdata.YoloAugment(imgsz=64))


def test_a_detection_source_given_as_a_url_is_said_to_be_local_only(tmp_path):
    for args in (dict(format="yolo"), dict(format="coco", annotations="s3://bucket/det/instances.json")):
        with pytest.raises(SourceError, match=f"s3://bucket/det.*: --format {args['format']} packs from local files"):
            pack("s3://bucket/det", str(tmp_path / "ds"), workers=1, **args)


def test_the_command_line(synthetic, tmp_path, capsys):
    coco = os.path.join(synthetic, "coco")
    assert cli(["pack", "--format", "coco", os.path.join(coco, "annotations", "instances_train.json"),
                os.path.join(coco, "train"), str(tmp_path / "c"), "-q"]) == 0
    assert "boxes:" in capsys.readouterr().out
    assert cli(["inspect", str(tmp_path / "c")]) == 0
    said = capsys.readouterr().out
    assert "detection (coco):" in said and "in the stored images' pixels" not in said
    assert cli(["pack", "--format", "coco", os.path.join(coco, "annotations", "instances_train.json"),
                os.path.join(coco, "train"), str(tmp_path / "small"), "--max-side", "320", "-q"]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "small")]) == 0  # COCO's size classes: measured in smaller images
    assert "  (in the stored images' pixels: 18 images were downscaled at pack time, so their boxes count smaller " \
           "than in the annotated images)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:  # a usage error, as argparse's (exit status 2)
        cli(["pack", "--format", "coco", os.path.join(coco, "train"), str(tmp_path / "x"), "-q"])
    assert usage.value.code == 2 and "--format coco takes ANNOTATIONS.json IMAGES OUT" in capsys.readouterr().err
    assert cli(["pack", "--format", "yolo", "--split", "test", os.path.join(synthetic, "yolo", "data.yaml"),
                str(tmp_path / "y"), "-q"]) != 0
    err = capsys.readouterr().err
    assert "no split 'test' (the YAML has train, val; --split chooses)" in err and "Traceback" not in err


def test_a_yolo_class_id_too_large_without_names_leaves_its_image_out(tmp_path):
    src = str(tmp_path / "src")
    yolo_tree(src, {"a": "0 0.5 0.5 0.2 0.2\n1 0.2 0.2 0.1 0.1\n", "huge": "3000000000 0.5 0.5 0.1 0.1\n"})
    os.unlink(os.path.join(src, "data.yaml"))  # the folder alone: no names, the ids are the names
    result = pack(src, str(tmp_path / "ds"), format="yolo", workers=1)
    assert result.packed == 1 and gdsdata.GDSDataset(result.out).classes == ["0", "1"]
    [bad] = result.labels["bad_labels"]
    assert bad["path"] == os.path.join("images", "train", "huge.jpg")
    assert "class id 3000000000 is beyond 1048575, the largest without class names" in bad["reason"]
    with pytest.raises(SourceError, match=r"huge.txt: class id 3000000000 is beyond 1048575.*classes.txt.*--strict"):
        pack(src, str(tmp_path / "strict"), format="yolo", workers=1, strict=True)


def test_a_txt_split_of_one_images_folder_reports_no_other_split_s_labels_as_orphans(tmp_path):
    """Ultralytics' autosplit layout: one images/ folder, train and val lists of it; the labels of the
    val images are no orphans of the train split, a label with no image at all is."""
    root = str(tmp_path / "set")
    yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "1 0.25 0.25 0.1 0.1\n", "c": "0 0.5 0.5 0.1 0.1\n"})
    with open(os.path.join(root, "labels", "train", "lost.txt"), "w") as f:
        f.write("0 0.5 0.5 0.1 0.1\n")
    with open(os.path.join(root, "autosplit_train.txt"), "w") as f:
        f.write("./images/train/a.jpg\n")
    with open(os.path.join(root, "data.yaml"), "w") as f:
        f.write("path: .\ntrain: autosplit_train.txt\nnames: [a, b]\n")
    result = pack(os.path.join(root, "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1)
    assert result.packed == 1
    assert result.labels["orphans"] == [{"label": os.path.join("labels", "train", "lost.txt"),
                                         "reason": "a label file without an image"}]


def test_a_txt_split_list_resolves_its_lines_as_ultralytics_does(tmp_path, monkeypatch):
    """COCO's layout: coco/train2017.txt lists ./images/train2017/NAME.jpg, relative to the list's own
    folder; a line without ./ is a path from the current folder (ultralytics/data/base.py get_img_files)."""
    coco = str(tmp_path / "coco")
    yolo_tree(coco, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "1 0.25 0.25 0.1 0.1\n"})
    os.rename(os.path.join(coco, "images", "train"), os.path.join(coco, "images", "train2017"))
    os.rename(os.path.join(coco, "labels", "train"), os.path.join(coco, "labels", "train2017"))
    elsewhere = tmp_path / "elsewhere" / "images"
    elsewhere.mkdir(parents=True)
    Image.new("RGB", (80, 60), (90, 30, 60)).save(elsewhere / "c.jpg", quality=90)
    with open(os.path.join(coco, "train2017.txt"), "w", encoding="utf-8-sig") as f:  # a byte-order mark too
        f.write("./images/train2017/a.jpg\n./images/train2017/b.jpg\nimages/c.jpg\nimages/gone.jpg\n")
    with open(os.path.join(coco, "coco.yaml"), "w") as f:
        f.write("path: .\ntrain: train2017.txt\nnames: [a, b]\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = pack(os.path.join(coco, "coco.yaml"), str(tmp_path / "ds"), format="yolo", workers=1)
    ds = gdsdata.GDSDataset(result.out)
    assert sorted(os.path.basename(ds.source(i)) for i in range(len(ds))) == ["a.jpg", "b.jpg", "c.jpg"]
    labels = {os.path.basename(ds.source(i)): ds.target(i)["labels"].tolist() for i in range(len(ds))}
    assert labels == {"a.jpg": [0], "b.jpg": [1], "c.jpg": []}
    [missing] = result.unreadable
    assert missing["path"] == "images/gone.jpg"
    assert missing["reason"].startswith(f"line 4 of {os.path.join(coco, 'train2017.txt')}: no such file "
                                        f"{tmp_path / 'elsewhere' / 'images' / 'gone.jpg'} (a relative line")
    with pytest.raises(SourceError, match=r"images/gone.jpg: line 4 of .*--strict"):
        pack(os.path.join(coco, "coco.yaml"), str(tmp_path / "strict"), format="yolo", workers=1, strict=True)


def _yaml(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def _sources(out):
    ds = gdsdata.GDSDataset(out)
    return [ds.source(i) for i in range(len(ds))]


def test_a_relative_yaml_path_is_found_where_ultralytics_looks(tmp_path, monkeypatch):
    """Ultralytics' own YAMLs (``path: coco8``) name a folder of the current folder or of its
    datasets_dir setting, not of the YAML's folder: they pack as they train."""
    yolo_tree(str(tmp_path / "work" / "mini"), {"a": "0 0.5 0.5 0.2 0.2\n"})
    data = _yaml(str(tmp_path / "cfg" / "mini.yaml"), "path: mini\ntrain: images/train\nnames: [a, b]\n")
    monkeypatch.chdir(tmp_path / "work")
    assert pack(data, str(tmp_path / "ds1"), format="yolo", workers=1).packed == 1
    monkeypatch.chdir(tmp_path)  # now only Ultralytics' datasets_dir holds it
    for k, layout in enumerate(("Ultralytics/settings.json", "settings.json")):  # Ultralytics 8.4's, and before
        config = tmp_path / f"config{k}"
        _yaml(str(config / layout), json.dumps({"datasets_dir": str(tmp_path / "work")}))
        monkeypatch.setenv("YOLO_CONFIG_DIR", str(config))
        assert pack(data, str(tmp_path / f"ds2-{k}"), format="yolo", workers=1).packed == 1
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "none"))
    with pytest.raises(SourceError, match=r"mini.yaml: split 'train' \(images/train\): no such folder or file under "
                                          r"any of "):
        pack(data, str(tmp_path / "ds3"), format="yolo", workers=1)


def test_a_yaml_path_two_places_would_satisfy_is_refused(tmp_path, monkeypatch):
    """``path: .`` run from another dataset's folder: the YAML's folder and the current folder both
    hold images/train; Ultralytics would take the current one, the YAML's author likely meant its own."""
    data = yolo_tree(str(tmp_path / "one"), {"a": "0 0.5 0.5 0.2 0.2\n"})
    yolo_tree(str(tmp_path / "two"), {"b": "1 0.5 0.5 0.2 0.2\n"})
    monkeypatch.chdir(tmp_path / "two")
    with pytest.raises(SourceError, match=r"makes split 'train' other files in .*one than in .*two .*give path: "
                                          r"as an absolute folder"):
        pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    assert not os.path.exists(tmp_path / "ds")
    monkeypatch.chdir(tmp_path / "one")  # the same folder both ways: no doubt
    assert pack(data, str(tmp_path / "ds"), format="yolo", workers=1).packed == 1


def test_a_split_packs_in_ultralytics_order(tmp_path):
    """get_img_files sorts the split's paths as text: a subfolder's images come before a later name of
    the folder above, and a .txt list's lines are sorted too."""
    root = str(tmp_path / "set")
    yolo_tree(root, {"z": "0 0.5 0.5 0.2 0.2\n", "c": "1 0.5 0.5 0.2 0.2\n"})
    for sub in ("b", "y"):
        os.makedirs(os.path.join(root, "images", "train", sub))
        os.makedirs(os.path.join(root, "labels", "train", sub))
        Image.new("RGB", (40, 30)).save(os.path.join(root, "images", "train", sub, "m.jpg"))
    expected = ["images/train/b/m.jpg", "images/train/c.jpg", "images/train/y/m.jpg", "images/train/z.jpg"]
    assert _sources(pack(root, str(tmp_path / "folder"), format="yolo", workers=1).out) == expected
    listed = _yaml(os.path.join(root, "list.yaml"), "train: train.txt\nnames: [a, b]\n")
    _yaml(os.path.join(root, "train.txt"), "".join(f"./{p}\n" for p in reversed(expected)))
    assert _sources(pack(listed, str(tmp_path / "list"), format="yolo", workers=1).out) == expected


def test_absolute_split_entries_are_no_doubt_whatever_the_path(tmp_path, monkeypatch):
    """Ultralytics joins path and entry, an absolute entry wins: every candidate place of a relative
    path: gives the same files, so there is nothing to refuse."""
    yolo_tree(str(tmp_path / "data"), {"a": "0 0.5 0.5 0.2 0.2\n"})
    (tmp_path / "datasets" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for path in (".", "mine", "../datasets/coco8"):
        data = _yaml(str(tmp_path / "cfg" / "d.yaml"),
                     f"path: {path}\ntrain: {tmp_path / 'data' / 'images' / 'train'}\nnames: [a, b]\n")
        assert pack(data, str(tmp_path / "ds"), format="yolo", workers=1, overwrite=True).packed == 1, path


@pytest.mark.parametrize("value", ["[a]", "{a: 1}", "true", "2.5"])
def test_a_yaml_path_that_is_no_folder_name_is_one_line(tmp_path, value, capsys):
    data = yolo_tree(str(tmp_path / "set"), {"a": "0 0.5 0.5 0.2 0.2\n"})
    _yaml(data, f"path: {value}\ntrain: images/train\nnames: [a, b]\n")
    assert cli(["pack", "--format", "yolo", data, str(tmp_path / "ds"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "path: must be a folder" in err and "Traceback" not in err


def test_a_yaml_folder_named_by_a_number_is_a_folder(tmp_path, monkeypatch):
    yolo_tree(str(tmp_path / "2024"), {"a": "0 0.5 0.5 0.2 0.2\n"})
    data = _yaml(str(tmp_path / "d.yaml"), "path: 2024\ntrain: images/train\nnames: [a, b]\n")
    assert pack(data, str(tmp_path / "ds"), format="yolo", workers=1).packed == 1


def test_hidden_files_and_folders_are_not_images_of_a_split(tmp_path):
    """Ultralytics' glob("**/*.*") skips them: a notebook's checkpoint copies, macOS' ._ files."""
    root = str(tmp_path / "set")
    yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n"})
    hidden = os.path.join(root, "images", "train", ".ipynb_checkpoints")
    os.makedirs(hidden)
    Image.new("RGB", (40, 30)).save(os.path.join(hidden, "a-checkpoint.jpg"))
    with open(os.path.join(root, "images", "train", "._a.jpg"), "wb") as f:
        f.write(b"\x00\x05\x16\x07 AppleDouble")
    result = pack(root, str(tmp_path / "ds"), format="yolo", workers=1)
    assert _sources(result.out) == ["images/train/a.jpg"] and result.skipped == []


def test_a_yolo_split_takes_the_image_formats_ultralytics_takes(tmp_path):
    """Ultralytics' IMG_FORMATS: an .mpo (its first picture), .avif and .jp2 are images of the split,
    a .ppm is not; a .heic that PIL cannot open without pillow-heif is skipped, naming the plugin."""
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n"})
    images = os.path.join(root, "images", "train")
    first, second = Image.new("RGB", (80, 60), (200, 30, 30)), Image.new("RGB", (80, 60), (30, 200, 30))
    first.save(os.path.join(images, "m.mpo"), "MPO", save_all=True, append_images=[second])
    avif = features.check("avif")  # (a Pillow built with AVIF: 11.3 on)
    if avif:
        Image.new("RGB", (80, 60), (10, 20, 30)).save(os.path.join(images, "v.avif"))
    Image.new("RGB", (80, 60), (10, 20, 30)).save(os.path.join(images, "j.jp2"))
    Image.new("RGB", (80, 60)).save(os.path.join(images, "p.ppm"))
    with open(os.path.join(root, "labels", "train", "p.txt"), "w") as f:
        f.write("0 0.5 0.5 0.2 0.2\n")
    Image.new("RGB", (80, 60)).save(os.path.join(images, "g.jpg"), "GIF")  # a GIF by its content
    with open(os.path.join(images, "h.heic"), "wb") as f:
        f.write(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64))
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    assert _sources(result.out) == ["images/train/a.jpg", "images/train/j.jp2", "images/train/m.mpo"] + (
        ["images/train/v.avif"] if avif else [])
    assert result.ignored == [os.path.join("images", "train", "p.ppm")]
    assert result.labels["orphans"] == [{"label": os.path.join("labels", "train", "p.txt"), "reason": (
        "its image p.ppm has no image extension of Ultralytics' (ignored)")}]
    skipped = {d["path"]: d["reason"] for d in result.skipped}
    assert skipped[os.path.join("images", "train", "g.jpg")] == (
        "a GIF image by its content, not one of Ultralytics' image formats (it leaves such an image out)")
    ds = gdsdata.GDSDataset(result.out)
    mpo = _sources(result.out).index("images/train/m.mpo")
    assert ds[mpo][0].shape == (3, 60, 80) and abs(ds[mpo][0][:, 30, 40].int() - torch.tensor([200, 30, 30])).max() <= 3
    record = ds.index.samples[mpo]
    with open(ds.index.shard_path(int(record["shard"])), "rb") as f:
        f.seek(int(record["offset"]))
        stored = f.read(int(record["length"]))
    with open(os.path.join(images, "m.mpo"), "rb") as f:  # its first picture, stored as it is
        whole = f.read()
    assert len(stored) < len(whole) and whole.startswith(stored) and stored.endswith(b"\xff\xd9")
    if importlib.util.find_spec("pillow_heif") is None and importlib.util.find_spec("pi_heif") is None:
        assert skipped[os.path.join("images", "train", "h.heic")] == (
            "a HEIC/HEIF image: PIL reads it with the pillow-heif or pi-heif plugin (pip install pi-heif), neither "
            "installed")


YOLO_CASES = {  # name -> (label text, image size): the images Ultralytics keeps and leaves out
    "fine": ("0 0.5 0.5 0.2 0.2\n", (80, 60)),
    "negative": ("0 -0.05 0.5 0.2 0.2\n", (80, 60)),
    "slightly_negative": ("0 -0.005 0.5 0.2 0.2\n", (80, 60)),  # a centre within Ultralytics' -0.01
    "negative_width": ("0 0.5 0.5 -0.005 0.2\n", (80, 60)),
    "beyond": ("0 1.05 0.5 0.2 0.2\n", (80, 60)),
    "slightly_beyond": ("0 1.005 0.5 0.2 0.2\n", (80, 60)),  # within its 1.01
    "corner_beyond": ("0 0.95 0.5 0.2 0.2\n", (80, 60)),  # the box reaches out, its numbers do not
    "mixed": ("0 0.5 0.5 0.2 0.2\n1 0.1 0.1 0.3 0.1 0.3 0.4\n", (80, 60)),
    "polygon": ("1 0.1 0.1 0.3 0.1 0.3 0.4\n", (80, 60)),
    "tiny": ("0 0.5 0.5 0.2 0.2\n", (8, 8)),
    "thin": ("0 0.5 0.5 0.2 0.2\n", (40, 9)),
    "small": ("0 0.5 0.5 0.2 0.2\n", (10, 10)),
    "bom": ("\ufeff0 0.5 0.5 0.2 0.2\n", (80, 60)),  # UTF-8 with a byte-order mark
    "float32_bound": ("0 1.01000001 0.5 0.2 0.2\n", (80, 60)),  # 1.01 in float32, as Ultralytics holds it
    "point_among_polygons": ("0 0.1 0.1 0.3 0.1 0.3 0.4\n1 0.5 0.5\n", (80, 60)),  # a one-point polygon
    "six_values": ("0 0.5 0.5 0.2 0.2 0.1\n", (80, 60)),
    "even_polygon": ("0 0.1 0.1 0.3 0.1 0.3 0.4 0.5\n", (80, 60)),
}
YOLO_KEPT = {"fine", "slightly_negative", "slightly_beyond", "corner_beyond", "polygon", "small", "bom",
             "float32_bound", "point_among_polygons"}


def test_yolo_images_are_kept_and_left_out_as_ultralytics_does(tmp_path):
    root = str(tmp_path / "set")
    data = yolo_tree(root, {name: text for name, (text, _) in YOLO_CASES.items()},
                     sizes={name: size for name, (_, size) in YOLO_CASES.items()})
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    kept = {os.path.splitext(os.path.basename(p))[0] for p in _sources(result.out)}
    assert kept == YOLO_KEPT
    why = {os.path.splitext(os.path.basename(d["path"]))[0]: d["reason"]
           for d in result.labels["bad_labels"] + result.skipped}
    assert "negative coordinates (down to -0.05" in why["negative"] and "negative coordinates" in why["negative_width"]
    assert "coordinates up to 1.05, beyond the image" in why["beyond"]
    assert "boxes and polygons mixed" in why["mixed"]
    assert why["tiny"] == "the image is 8x8, under 10 pixels a side (Ultralytics leaves such an image out)"
    assert "40x9" in why["thin"]
    ds = gdsdata.GDSDataset(result.out)
    boxes = {os.path.splitext(os.path.basename(ds.source(i)))[0]: ds.target(i)["boxes"] for i in range(len(ds))}
    assert torch.allclose(boxes["slightly_negative"], torch.tensor([[0.0, 24, 7.6, 36]]), atol=1e-3)  # clipped
    assert torch.allclose(boxes["corner_beyond"], torch.tensor([[68.0, 24, 80, 36]]), atol=1e-3)


def test_yolo_size_rule_judges_the_source_not_the_downscaled_image(tmp_path):
    """Under 10 pixels a side in the file is left out also when --max-side or --size would shrink it."""
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"thin": "0 0.5 0.5 0.2 0.2\n", "wide": "0 0.5 0.5 0.2 0.2\n"},
                     sizes={"thin": (3000, 8), "wide": (3000, 12)})
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1, options=PackOptions(max_side=1000))
    assert _sources(result.out) == ["images/train/wide.jpg"]  # stored 1000x4, from 3000x12
    assert result.skipped[0]["reason"].startswith("the image is 3000x8, under 10 pixels a side")


def test_pose_labels_pack_their_boxes_as_ultralytics_detection_reads_them(tmp_path):
    root = str(tmp_path / "set")
    keypoints = " ".join(["0.5 0.5 2"] * 17)
    data = yolo_tree(root, {"person": f"0 0.5 0.5 0.2 0.2 {keypoints}\n"})
    with open(data, "a") as f:
        f.write("kpt_shape: [17, 3]\n")
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    boxes = gdsdata.GDSDataset(result.out).target(0)["boxes"]
    assert torch.allclose(boxes, torch.tensor([[32.0, 24, 48, 36]]), atol=1e-3)
    _yaml(data, "path: .\ntrain: images/train\nnames: [a, b]\nkpt_shape: 17\n")
    with pytest.raises(SourceError, match="kpt_shape: must be"):
        pack(data, str(tmp_path / "ds2"), format="yolo", workers=1)


def test_yolo_sources_name_a_missing_split_entry_and_an_unreadable_classes_txt(tmp_path):
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n"})
    _yaml(data, "path: .\ntrain: [images/train, images/gone]\nnames: [a, b]\n")
    with pytest.raises(SourceError, match=r"split 'train' \(images/gone\): no such folder or file under"):
        pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    with open(os.path.join(root, "classes.txt"), "wb") as f:
        f.write(b"caf\xe9\n")
    with pytest.raises(SourceError, match=r"classes.txt: cannot read the class names"):
        pack(root, str(tmp_path / "ds2"), format="yolo", workers=1)


def test_yolo_repeats_are_rows_repeated_as_ultralytics_compares_them(tmp_path):
    """Two distinct polygons sharing a class and a box are two objects (Ultralytics keeps both); a
    box row written twice is one; labels beside their images are no ignored files."""
    root = str(tmp_path / "set")
    os.makedirs(os.path.join(root, "data"))
    Image.new("RGB", (80, 60)).save(os.path.join(root, "data", "p.jpg"))
    Image.new("RGB", (80, 60)).save(os.path.join(root, "data", "b.jpg"))
    rows = {"p": "0 0.1 0.1 0.5 0.1 0.5 0.5\n0 0.1 0.1 0.5 0.5 0.1 0.5\n",
            "b": "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n"}
    for name, text in rows.items():
        with open(os.path.join(root, "data", name + ".txt"), "w") as f:
            f.write(text)
    data = _yaml(os.path.join(root, "d.yaml"), "train: data\nnames: [a]\n")
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    ds = gdsdata.GDSDataset(result.out)
    counts = {os.path.basename(ds.source(i)): len(ds.target(i)["boxes"]) for i in range(len(ds))}
    assert counts == {"p.jpg": 2, "b.jpg": 1} and len(result.labels["duplicates"]) == 1
    assert result.ignored == [] and result.labels["orphans"] == []
    utils = pytest.importorskip("ultralytics.data.utils")
    for name, count in (("p", 2), ("b", 1)):
        image, label = (os.path.join(root, "data", name + ext) for ext in (".jpg", ".txt"))
        assert len(utils.verify_image_label((image, label, "", False, 1, 0, 0, False))[1]) == count


def test_yolo_images_kept_are_those_ultralytics_verifies(tmp_path):
    """The same cases through Ultralytics' own check of an image and its labels (the reference)."""
    utils = pytest.importorskip("ultralytics.data.utils")
    root = str(tmp_path / "set")
    yolo_tree(root, {name: text for name, (text, _) in YOLO_CASES.items()},
              sizes={name: size for name, (_, size) in YOLO_CASES.items()})
    kept = set()
    for name in YOLO_CASES:
        image = os.path.join(root, "images", "train", name + ".jpg")
        label = os.path.join(root, "labels", "train", name + ".txt")
        if utils.verify_image_label((image, label, "", False, 2, 0, 0, False))[0] is not None:
            kept.add(name)
    assert kept == YOLO_KEPT


def test_a_yaml_with_nc_only_or_a_validation_key_reads_as_ultralytics_does(tmp_path):
    root = str(tmp_path / "set")
    yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "2 0.5 0.5 0.2 0.2\n"})
    data = _yaml(os.path.join(root, "nc.yaml"), "validation: images/train\nnc: '3'\n")  # (a string, as a number)
    result = pack(data, str(tmp_path / "ds"), format="yolo", split="val", workers=1)
    assert gdsdata.GDSDataset(result.out).classes == ["class_0", "class_1", "class_2"] and result.packed == 2
    _yaml(data, "train: images/train\nnc: 3\nnames: [a, b]\n")
    with pytest.raises(SourceError, match="names holds 2 classes, nc says 3"):
        pack(data, str(tmp_path / "ds2"), format="yolo", workers=1)


def test_negatives_in_the_report_are_the_images_kept_without_boxes(tmp_path):
    """An image listed without labels whose bytes do not decode is skipped: it is no negative kept."""
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n", "b": None, "c": None})
    with open(os.path.join(root, "images", "train", "c.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff nothing")
    result = pack(data, str(tmp_path / "ds"), format="yolo", workers=1)
    assert result.packed == 2 and len(result.skipped) == 1
    assert result.labels["negatives"] == 1 == gdsdata.GDSDataset(result.out).meta["detection"]["negatives"]
    more = str(tmp_path / "more")  # an append's report speaks of its own source, the dataset's meta of all
    appended = pack(yolo_tree(more, {"d": None, "e": "1 0.5 0.5 0.2 0.2\n"}), result.out, format="yolo", workers=1,
                    append=True)
    assert appended.labels["negatives"] == 1 and gdsdata.GDSDataset(result.out).meta["detection"]["negatives"] == 2


def test_a_txt_list_sorts_its_lines_as_ultralytics_holds_them(tmp_path, monkeypatch):
    """A relative line that is not ./ stays as written in Ultralytics' list, so it sorts before the
    absolute paths the ./ lines become."""
    root = str(tmp_path / "set")
    yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n"})
    yolo_tree(str(tmp_path / "other"), {"z": "1 0.5 0.5 0.2 0.2\n"})
    _yaml(os.path.join(root, "train.txt"), "./images/train/a.jpg\n../other/images/train/z.jpg\n")
    data = _yaml(os.path.join(root, "d.yaml"), "train: train.txt\nnames: [a, b]\n")
    monkeypatch.chdir(root)
    names = [os.path.basename(p) for p in _sources(pack(data, str(tmp_path / "ds"), format="yolo", workers=1).out)]
    assert names == ["z.jpg", "a.jpg"]


def test_a_yolo_split_without_any_label_file_is_warned_about(tmp_path, caplog):
    """A labels folder misnamed (``label/`` for ``labels/``) leaves every image without a label
    file: packed as negatives, as Ultralytics trains them, with a warning naming where the labels
    were looked for (none when some image has one)."""
    src = str(tmp_path / "src")
    yaml_path = yolo_tree(src, {"a": "0 0.5 0.5 0.2 0.2\n", "b": None})
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
        pack(yaml_path, str(tmp_path / "some"), format="yolo", workers=1)
    assert "has a label file" not in caplog.text
    os.rename(os.path.join(src, "labels"), os.path.join(src, "label"))
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
        result = pack(yaml_path, str(tmp_path / "none"), format="yolo", workers=1)
    assert result.labels["negatives"] == 2
    looked = os.path.join(src, "labels", "train", "a.txt")
    said = f"none of its 2 images has a label file ({looked} for {os.path.join(src, 'images', 'train', 'a.jpg')}"
    assert said in caplog.text and result.labels["no_label_file"].startswith(said)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):  # (the CLI shows warnings on stderr)
        assert cli(["pack", "--format", "yolo", yaml_path, str(tmp_path / "cli"), "-q"]) == 0
    assert said in caplog.text


def test_a_coco_pack_locks_naming_its_annotations_and_may_go_inside_its_images_folder(tmp_path, monkeypatch):
    """A second writer is told the COCO pack at work by its annotations JSON, not its images folder;
    the output may lie inside the images folder (the JSON lists the images, so the shards are never
    taken for some), where a folder of class folders refuses it."""
    import gdsdata.packing.packer as packer

    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48)},
                             [{"image_id": 1, "category_id": 1, "bbox": [1, 2, 10, 10]}], [(1, "dot")])
    held, real = [], packer.writer_lock
    monkeypatch.setattr(packer, "writer_lock", lambda out, what: held.append(what) or real(out, what))
    result = pack(images, os.path.join(images, "packed"), format="coco", annotations=ann, workers=1)
    assert held == [f"pack of {ann}"] and gdsdata.GDSDataset(result.out).target(0)["labels"].tolist() == [0]


def test_an_append_refuses_an_image_it_holds_whose_labels_changed(tmp_path):
    """--append adds the images the dataset does not hold; one it holds whose label file now gives
    other boxes is refused in one line (its new labels would be dropped unseen), the dataset left as
    it was; unchanged labels append as before."""
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n1 0.25 0.25 0.1 0.1\n", "b": ""})
    out = pack(data, str(tmp_path / "ds"), format="yolo", workers=1).out
    before = gdsdata.GDSDataset(out).index.fingerprint
    with open(os.path.join(root, "labels", "train", "b.txt"), "w") as f:
        f.write("1 0.5 0.5 0.1 0.1\n")
    with pytest.raises(SourceError, match=r"b.jpg: its labels give 1 box\(es\), not the 0 .* holds for it; "
                                          r"--append adds only .*--overwrite to take the new labels"):
        pack(data, out, format="yolo", workers=1, append=True)
    with open(os.path.join(root, "labels", "train", "a.txt"), "w") as f:  # as many boxes, one moved
        f.write("0 0.5 0.5 0.2 0.3\n1 0.25 0.25 0.1 0.1\n")
    with open(os.path.join(root, "labels", "train", "b.txt"), "w") as f:
        f.write("")
    with pytest.raises(SourceError, match=r"a.jpg: its labels give other boxes than the 2 .* holds for it"):
        pack(data, out, format="yolo", workers=1, append=True)
    assert gdsdata.GDSDataset(out).index.fingerprint == before
    with open(os.path.join(root, "labels", "train", "a.txt"), "w") as f:  # the same boxes, in another order
        f.write("1 0.25 0.25 0.1 0.1\n0 0.5 0.5 0.2 0.2\n")
    yolo_tree(root, {"c": "1 0.5 0.5 0.2 0.2\n"})
    assert pack(data, out, format="yolo", workers=1, append=True).new == 1


def test_repeated_class_names_are_warned_about_and_their_labels_kept_apart(tmp_path, caplog):
    root = str(tmp_path / "set")
    data = yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n1 0.2 0.2 0.1 0.1\n"})
    _yaml(data, "path: .\ntrain: images/train\nnames: [dog, dog, cat]\n")
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
        ds = gdsdata.GDSDataset(pack(data, str(tmp_path / "ds"), format="yolo", workers=1).out)
    assert "class names repeat ('dog' is class 0, 1): the labels stay apart, but class_to_idx keeps each name's " \
           "last" in caplog.text
    assert ds.classes == ["dog", "dog", "cat"] and ds.target(0)["labels"].tolist() == [0, 1]


def test_classes_named_by_their_ids_are_warned_about(tmp_path, caplog):
    """A YOLO folder with no names anywhere: its classes are the ids up to the largest used, with a
    warning that says so and how many of them no box uses (a stray id makes many)."""
    root = str(tmp_path / "set")
    os.unlink(yolo_tree(root, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "30 0.2 0.2 0.1 0.1\n"}))
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
        ds = gdsdata.GDSDataset(pack(root, str(tmp_path / "ds"), format="yolo", workers=1).out)
    assert ds.classes == [str(k) for k in range(31)]
    assert f"{root}: no class names (a data YAML's names or a classes.txt): 31 class(es) named by their ids 0..30, " \
           "29 of which no box uses" in caplog.text


def test_a_merge_of_a_detection_and_a_classification_dataset_says_so(synthetic, photos_dataset, tmp_path):
    from gdsdata.packing.merge import merge

    det = pack(os.path.join(synthetic, "yolo", "data.yaml"), str(tmp_path / "det"), format="yolo", workers=1).out
    with pytest.raises(SourceError, match=f"^{re.escape(photos_dataset[2])}: a classify dataset, {re.escape(det)} "
                                          f"is a detect dataset$"):
        merge([det, photos_dataset[2]], str(tmp_path / "m"))


def test_a_label_path_that_is_a_folder_or_a_fifo_is_that_image_s_problem(tmp_path):
    """A folder or a FIFO where an image's label file belongs: that image is left out with the reason
    (bad_labels) and the pack goes on, never waits on the FIFO."""
    src = str(tmp_path / "src")
    yaml_path = yolo_tree(src, {"a": "0 0.5 0.5 0.2 0.2\n", "b": None, "c": None})
    os.mkdir(os.path.join(src, "labels", "train", "b.txt"))
    os.mkfifo(os.path.join(src, "labels", "train", "c.txt"))
    result = pack(yaml_path, str(tmp_path / "ds"), format="yolo", workers=1)
    bad = {d["path"]: d["reason"] for d in result.labels["bad_labels"]}
    assert result.packed == 1 and sorted(bad) == ["images/train/b.jpg", "images/train/c.jpg"], bad
    assert "a folder where a label file belongs" in bad["images/train/b.jpg"]
    assert "a FIFO where a label file belongs" in bad["images/train/c.jpg"]


def test_a_data_yaml_that_is_a_fifo_is_said_so(tmp_path):
    """Given where the data YAML or the dataset folder goes, a FIFO is named as neither (opening it would
    wait for a writer; listing it failed as 'not a directory')."""
    fifo = str(tmp_path / "data.yaml")
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match=r"data.yaml: not a regular file or a folder: --format yolo takes a data "
                                          r"YAML or a folder"):
        pack(fifo, str(tmp_path / "ds"), format="yolo", workers=1)


def test_a_coco_file_without_annotations_is_warned_about(tmp_path, caplog, capsys):
    """A COCO file with images and no annotations (a test split's image_info file) packs every image
    without objects, as COCO's API reads it, with a warning saying so; one with annotations does not."""
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (64, 48), "b.jpg": (32, 32)},
                             [{"image_id": 1, "category_id": 1, "bbox": [1, 2, 10, 10]}], [(1, "dot")])
    with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
        pack(images, str(tmp_path / "some"), format="coco", annotations=ann, workers=1)
    assert "without objects" not in caplog.text
    for key, said in ((None, "no 'annotations' list"), ([], "an empty 'annotations' list")):
        data = json.load(open(ann))
        data.pop("annotations") if key is None else data.update(annotations=key)
        info = str(tmp_path / f"info-{said[:2]}.json")
        json.dump(data, open(info, "w"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="gdsdata.packing.detection"):
            result = pack(images, str(tmp_path / f"ds-{said[:2]}"), format="coco", annotations=info, workers=1)
        assert result.labels["negatives"] == 2 and result.labels["no_label_file"] == f"it lists 2 images and {said}"
        assert f"{info}: it lists 2 images and {said}: every image is packed without objects" in caplog.text
    capsys.readouterr()
    assert cli(["pack", "--format", "coco", info, images, str(tmp_path / "cli"), "-q"]) == 0
    assert f"no labels: it lists 2 images and {said}; every image was packed without objects" in capsys.readouterr().out


def test_an_image_left_out_takes_its_box_notes_with_it(tmp_path, capsys):
    """A COCO record whose size is the file's turned a quarter: the image is left out with that
    reason, and its box that lay outside the declared size is not also reported as dropped (it was
    checked against a size the image does not have); another image's dropped box still is."""
    ann, images = write_coco(str(tmp_path / "src"), {"a.jpg": (240, 320), "b.jpg": (64, 64)}, [
        {"image_id": 1, "category_id": 1, "bbox": [70, 250, 20, 60]},  # inside 240x320, outside 320x240
        {"image_id": 2, "category_id": 1, "bbox": [100, 100, 5, 5]},  # outside b.jpg
    ], [(1, "dot")])
    data = json.load(open(ann))
    data["images"][0].update(width=320, height=240)  # a.jpg's record turned a quarter
    json.dump(data, open(ann, "w"))
    result = pack(images, str(tmp_path / "ds"), format="coco", annotations=ann, workers=1)
    assert [s["path"] for s in result.skipped] == ["a.jpg"] and "turned a quarter" in result.skipped[0]["reason"]
    assert [d["label"] for d in result.labels["dropped"]] == ["annotation 2 (b.jpg)"]
    report = json.load(open(os.path.join(result.out, fmt.REPORT_NAME)))
    assert [d["label"] for d in report["labels"]["dropped"]] == ["annotation 2 (b.jpg)"]
    assert cli(["pack", "--format", "coco", ann, images, str(tmp_path / "cli"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "annotation 1 (a.jpg)" not in out and "annotation 2 (b.jpg)" in out and "turned a quarter" in out
