"""Detection batches (gdsdata.YoloAugment, gdsdata.Letterbox) against Ultralytics' own transforms:
for the same draws, Ultralytics' Mosaic, RandomPerspective, RandomFlip and RandomHSV (fed the images
its load_image would give) produce the same boxes and labels as the Loader's batches, and pixels
within interpolation differences; the letterbox against PIL; draws a pure function of (seed,
epoch, index), so batches repeat and resume exactly; close_mosaic; Ultralytics' batch dict."""

import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import needs_triton_interpreter
from PIL import Image

import gdsdata
from gdsdata.format import layout as fmt
from gdsdata.packing.packer import pack
from gdsdata.transforms import uniforms
from gdsdata.transforms import detection as D

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from make_detection import generate  # noqa: E402

S = 192  # output side: small, so that the CPU renders quickly


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("aug_src"))
    generate(root, 16, classes=5, seed=11, val=0.0)
    out = str(tmp_path_factory.mktemp("aug") / "ds")
    pack(os.path.join(root, "yolo", "data.yaml"), out, format="yolo", workers=1)
    return out


def batches(ds, transform, n=None, **loader_args):
    loader = gdsdata.Loader(ds, 4, transform=transform, **loader_args)
    out = []
    for k, batch in enumerate(loader):
        out.append(batch)
        if n is not None and k + 1 == n:
            break
    return out


def source_xyxy(ds, i):
    rows = ds.index.sample_boxes(i)
    rows = rows[(rows["flags"] & fmt.BOX_CROWD) == 0]
    return np.stack([rows[k] for k in ("x0", "y0", "x1", "y1")], 1).astype(np.float64), rows["label"].astype(int)


def test_letterbox_places_boxes_and_pixels_as_ultralytics_letterbox(det):
    ds = gdsdata.GDSDataset(det)
    (images, targets), = batches(ds, gdsdata.Letterbox(imgsz=S), n=1, shuffle=False)
    assert images.shape == (4, 3, S, S) and images.dtype == torch.uint8
    for k in range(4):
        image, _ = ds[k]
        h0, w0 = image.shape[1:]
        r = S / max(h0, w0)
        h, w = min(int(np.ceil(h0 * r)), S), min(int(np.ceil(w0 * r)), S)  # load_image
        left, top = int(round((S - w) / 2 - 0.1)), int(round((S - h) / 2 - 0.1))  # LetterBox, centred
        xyxy, labels = source_xyxy(ds, k)
        expected = xyxy * [w, h, w, h] + [left, top, left, top]
        assert targets[k]["labels"].tolist() == labels.tolist()
        assert np.abs(targets[k]["boxes"].numpy() - expected).max() < 1e-3
        # what maps them back to the source image's pixels, as evaluation in the source frame needs them
        assert targets[k]["orig_size"].tolist() == [h0, w0]
        rh, rw, pw, ph = targets[k]["ratio_pad"].tolist()
        back = (targets[k]["boxes"].numpy() - [pw, ph, pw, ph]) / [rw, rh, rw, rh]
        assert np.abs(back - xyxy * [w0, h0, w0, h0]).max() < 1e-2
        resized = np.asarray(Image.fromarray(image.permute(1, 2, 0).numpy()).resize((w, h), Image.BILINEAR))
        reference = np.full((S, S, 3), 114, np.uint8)
        reference[top:top + h, left:left + w] = resized
        got = images[k].permute(1, 2, 0).numpy().astype(int)
        assert np.abs(got - reference).mean() < 6, np.abs(got - reference).mean()
        assert (got[:top] == 114).all() and (got[top + h:] == 114).all()


def test_rectangular_letterbox_batches_are_ultralytics_validation_batches(tmp_path):
    """Letterbox(rect=True) over ``Letterbox.rect_order``, unshuffled, against Ultralytics' own
    validation dataset (``YOLODataset(rect=True)``, its collate): the same images in each batch, each
    batch's rectangle, the boxes, ``ori_shape``/``ratio_pad``, and the pixels within a level (both
    resize bilinearly, OpenCV in fixed point)."""
    _ultralytics()
    from ultralytics.data.dataset import YOLODataset

    root = str(tmp_path / "src")
    generate(root, 16, classes=5, seed=11, val=0.0)  # 5 aspect ratios, ties among them
    out = pack(os.path.join(root, "yolo", "data.yaml"), str(tmp_path / "ds"), format="yolo", workers=1).out
    ds = gdsdata.GDSDataset(out)
    theirs = YOLODataset(img_path=os.path.join(root, "yolo", "images", "train"), imgsz=S, batch_size=4,
                         augment=False, rect=True, stride=32, pad=0.5, data={"names": dict(enumerate(ds.classes)),
                                                                            "channels": 3})
    loader = gdsdata.Loader(ds, 4, shuffle=False, indices=gdsdata.Letterbox.rect_order(ds),
                            transform=gdsdata.Letterbox(imgsz=S, rect=True, stride=32, targets="ultralytics"))
    shapes = set()
    for k, mine in enumerate(loader):
        ref = YOLODataset.collate_fn([theirs[i] for i in range(4 * k, 4 * k + 4)])
        assert [os.path.basename(name) for name in mine["im_file"]] == [os.path.basename(f) for f in ref["im_file"]]
        assert mine["img"].shape == ref["img"].shape
        assert [list(shape) for shape in mine["resized_shape"]] == [list(shape) for shape in ref["resized_shape"]]
        shapes.add(tuple(mine["img"].shape[2:]))
        assert mine["ori_shape"] == tuple(ref["ori_shape"])
        for a, b in zip(mine["ratio_pad"], ref["ratio_pad"]):
            assert np.allclose(a[0], b[0]) and tuple(a[1]) == tuple(b[1])
        assert mine["batch_idx"].tolist() == ref["batch_idx"].tolist() and mine["cls"].equal(ref["cls"])
        assert np.abs(mine["bboxes"].numpy() - ref["bboxes"].numpy()).max() < 1e-3
        diff = np.abs(mine["img"].numpy().astype(int) - ref["img"].numpy().astype(int))  # OpenCV's fixed point
        assert diff.max() <= 1 and diff.mean() < 0.15, (diff.max(), diff.mean())
    assert len(shapes) > 2  # batches of other rectangles, not squares
    loader.close()


def test_rect_order_of_a_subset_orders_the_subset_s_positions(tmp_path):
    """A validation split made with ``random_split`` (a Subset) ordered by aspect ratio: positions in the
    Subset, which the Loader over that Subset reads as the same images as the dataset's own order
    restricted to the split."""
    root = str(tmp_path / "src")
    generate(root, 16, classes=5, seed=11, val=0.0)
    ds = gdsdata.GDSDataset(pack(os.path.join(root, "yolo", "data.yaml"), str(tmp_path / "ds"), format="yolo",
                                 workers=1).out)
    val = torch.utils.data.Subset(torch.utils.data.Subset(ds, list(range(15, -1, -1))), [1, 3, 4, 8, 9, 12, 14])
    order = gdsdata.Letterbox.rect_order(val)
    assert sorted(order.tolist()) == list(range(7))
    base = [15 - [1, 3, 4, 8, 9, 12, 14][k] for k in order]  # the samples of ds they are
    ratios = [ds.index.samples["height"][i] / ds.index.samples["width"][i] for i in base]
    assert ratios == sorted(ratios)
    loader = gdsdata.Loader(val, 7, shuffle=False, indices=order,
                            transform=gdsdata.Letterbox(imgsz=S, rect=True, targets="ultralytics"))
    assert [os.path.basename(f) for f in next(iter(loader))["im_file"]] == \
        [os.path.basename(ds.source(i)) for i in base]
    with pytest.raises(TypeError, match="Letterbox.rect_order takes a gdsdata.GDSDataset or a torch Subset of one"):
        gdsdata.Letterbox.rect_order(list(range(4)))
    assert len(gdsdata.Letterbox.rect_order(torch.utils.data.Subset(ds, []))) == 0
    loader.close()
    ds.close()


_PIL_OPEN = Image.open


def _ultralytics():
    """Ultralytics' transforms. Importing Ultralytics replaces ``PIL.Image.open`` for the whole
    process (to fetch a HEIF plugin when a file is not an image); PIL's own is put back, so the
    other tests see PIL as users without Ultralytics do."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    augment = pytest.importorskip("ultralytics.data.augment")
    from ultralytics.utils.instance import Instances

    Image.open = _PIL_OPEN
    return augment, Instances


class _Draws:
    """Stands in for ``random`` / ``np.random`` inside Ultralytics' transforms: hands out the values
    gdsdata drew, in the order Ultralytics asks for them."""

    def __init__(self):
        self.values = []

    def __call__(self, *args, **kwargs):
        return self.values.pop(0)


def ultralytics_batch(ds, t, indices, epoch, monkeypatch):
    """What Ultralytics' transforms make of the outputs ``indices`` with gdsdata's draws."""
    import cv2

    augment, Instances = _ultralytics()

    def load(i):  # BaseDataset.load_image (augment: INTER_LINEAR) + its labels
        image, _ = ds[i]
        im = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
        h0, w0 = im.shape[:2]
        h, w = D.load_size(h0, w0, t.imgsz)
        if (h, w) != (h0, w0):
            im = cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)
        xyxy, labels = source_xyxy(ds, i)
        xywh = np.stack([(xyxy[:, 0] + xyxy[:, 2]) / 2, (xyxy[:, 1] + xyxy[:, 3]) / 2, xyxy[:, 2] - xyxy[:, 0],
                         xyxy[:, 3] - xyxy[:, 1]], 1).astype(np.float32)
        return {"img": im, "ori_shape": (h0, w0), "resized_shape": (h, w), "im_file": str(i),
                "cls": labels.astype(np.float32)[:, None],
                "instances": Instances(xywh, np.zeros((0, 1000, 2), np.float32), bbox_format="xywh",
                                       normalized=True)}

    class Dataset:
        cache, data = None, {}

        def get_image_and_label(self, i):
            return load(i)

    uniform, rand, np_uniform = _Draws(), _Draws(), _Draws()
    monkeypatch.setattr(augment.random, "uniform", uniform)
    monkeypatch.setattr(augment.random, "random", rand)
    monkeypatch.setattr(augment.np.random, "uniform", np_uniform)
    mosaic = augment.Mosaic(Dataset(), imgsz=t.imgsz, p=t.mosaic)
    affine = augment.RandomPerspective(degrees=t.degrees, translate=t.translate, scale=t.scale, shear=t.shear,
                                       perspective=0.0, size=(t.imgsz, t.imgsz))
    hsv = augment.RandomHSV(hgain=t.hsv_h, sgain=t.hsv_s, vgain=t.hsv_v)
    flips = [augment.RandomFlip(direction="vertical", p=t.flipud), augment.RandomFlip(direction="horizontal",
                                                                                        p=t.fliplr)]
    read = t.sources(indices, epoch, np.arange(len(ds)))
    partners = [[read[m] for m in members[1:]] for members in t.members(indices, epoch)]
    out = []
    for i, mates in zip(indices, partners):
        u = uniforms(t.seed, epoch, [i], D._DRAWS)[0]
        hsv_u = uniforms(t.seed ^ 0x5BD1E995, epoch, [i], D._HSV_DRAWS)[0]
        s = t.imgsz
        labels = load(i)
        if mates:
            monkeypatch.setattr(mosaic, "get_indexes", lambda mates=mates: list(mates))
            uniform.values = [0.0, s / 2 + u[5] * s, s / 2 + u[4] * s]  # p check, yc, xc
            labels = mosaic(labels)
        uniform.values = [0.0, 0.0, (2 * u[6] - 1) * t.degrees, 1 - t.scale + 2 * t.scale * u[7],
                          (2 * u[8] - 1) * t.shear, (2 * u[9] - 1) * t.shear,
                          0.5 - t.translate + 2 * t.translate * u[10], 0.5 - t.translate + 2 * t.translate * u[11]]
        labels = affine(labels)
        np_uniform.values = [2 * hsv_u - 1]
        labels = hsv(labels)
        rand.values = [u[13], u[12]]
        for flip in flips:
            labels = flip(labels)
        instances = labels["instances"]
        instances.convert_bbox("xyxy")
        out.append((labels["img"], instances.bboxes.copy(), labels["cls"].reshape(-1).astype(int)))
    return out


@pytest.mark.parametrize("case", ["defaults", "mosaic", "no-mosaic", "rotate-shear"])
def test_training_batches_are_what_ultralytics_makes_of_the_same_draws(det, monkeypatch, case):
    """Boxes and labels equal Ultralytics' (Ultralytics' float32 matrices: within 0.05 px). Pixels
    (HSV off but for "defaults", whose HSV test is the next one) within what one resampling instead
    of two makes of these noisy images: 8x8 block means within 2 levels on average."""
    ds = gdsdata.GDSDataset(det)
    off = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
    options = {"defaults": {}, "mosaic": off, "no-mosaic": {"mosaic": 0.0, **off},
               "rotate-shear": {"degrees": 10.0, "shear": 5.0, **off}}[case]
    t = gdsdata.YoloAugment(imgsz=S, seed=5, **options)
    loader = gdsdata.Loader(ds, 4, transform=t, shuffle=False)
    (images, targets), = [b for b, _ in zip(loader, range(1))]
    reference = ultralytics_batch(ds, t, list(range(4)), 0, monkeypatch)
    boxes = 0
    for k, (img, xyxy, labels) in enumerate(reference):
        assert targets[k]["labels"].tolist() == labels.tolist()
        assert targets[k]["boxes"].shape == xyxy.shape
        assert np.abs(targets[k]["boxes"].numpy() - xyxy).max(initial=0) < 0.05
        boxes += len(labels)
        if case != "defaults":
            mine = torch.nn.functional.avg_pool2d(images[k:k + 1].float(), 8)
            theirs = torch.nn.functional.avg_pool2d(torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float(), 8)
            assert (mine - theirs).abs().mean() < 2, (k, (mine - theirs).abs().mean())
    assert boxes > 0


KERNEL_CASES = {"mosaic": dict(seed=3), "affine": dict(seed=4, mosaic=0.0, degrees=15.0, shear=3.0),
                "letterbox": None, "rectangular letterbox": dict(rect=True, stride=16),
                "float16": dict(seed=5, dtype="float16")}


def compare_kernel(det, device, imgsz):
    """The GPU kernel (``kernels.sample_detection``) against the CPU path (``render`` on the CPU), on
    the same decoded bytes, for each of KERNEL_CASES: nearly always equal, under 0.1 % of the values
    more than a level apart (a fused multiply-add on the GPU moves a value across a rounding edge,
    and HSV's hue quantisation can carry such a level to a few), a mean difference under 0.05 levels."""
    from gdsdata.transforms.kernels import sample_detection

    ds = gdsdata.GDSDataset(det)
    indices = [0, 5, 9, 14]
    for name, kwargs in KERNEL_CASES.items():
        t = gdsdata.Letterbox(imgsz=imgsz, **kwargs or {}) if kwargs is None or "rect" in kwargs else \
            gdsdata.YoloAugment(imgsz=imgsz, **kwargs)
        batch, read = ds.load_batch(t.sources(indices, 0, np.arange(len(ds))))
        boxes, labels, _ = D.source_boxes(ds.index, read)
        plan = D.plan(t, batch.heights, batch.widths, boxes, labels, indices, 0)
        cpu = D.render(t, batch.buffer, batch.offsets, batch.channels, plan)
        dtype = torch.uint8 if t.dtype is None else getattr(torch, t.dtype)
        mine = sample_detection(batch.buffer.to(device), batch.offsets, batch.channels, plan, t.pad,
                                bool((plan.hsv != 1).any()), dtype)
        assert mine.shape == cpu.shape and mine.dtype == cpu.dtype and mine.device.type == device, name
        diff = (mine.cpu().float() - cpu.float()).abs() * (255 if dtype.is_floating_point else 1)
        assert (diff > 1.01).float().mean() < 1e-3 and diff.mean() < 0.05, (name, diff.max(), diff.mean())


def test_the_gpu_kernel_computes_what_the_cpu_path_does(det):
    """Run by Triton's interpreter on the CPU, in a process of its own (the interpreter is chosen
    when the kernels are defined)."""
    needs_triton_interpreter()
    here = os.path.dirname(__file__)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_detection_augment as t; " \
           f"t.compare_kernel({det!r}, 'cpu', 64)"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
def test_the_gpu_kernel_on_a_gpu_computes_what_the_cpu_path_does(det):
    compare_kernel(det, "cuda", S)


def test_hsv_jitter_is_ultralytics_lookup_tables(monkeypatch):
    augment, _ = _ultralytics()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1, 3, 40, 40)).astype(np.float32)
    gains = np.array([1.012, 0.55, 1.3])
    mine = D._hsv(torch.from_numpy(image), torch.tensor(gains[None], dtype=torch.float32)).numpy()
    monkeypatch.setattr(augment.np.random, "uniform", lambda *a, **k: (gains - 1) / [0.015, 0.7, 0.4])
    labels = {"img": np.ascontiguousarray(image[0].transpose(1, 2, 0)[..., ::-1].astype(np.uint8))}  # BGR
    theirs = augment.RandomHSV(0.015, 0.7, 0.4)(labels)["img"][..., ::-1].transpose(2, 0, 1)
    diff = np.abs(mine[0] - theirs.astype(np.float32))
    assert diff.mean() < 0.5 and np.percentile(diff, 99) <= 2, (diff.mean(), diff.max())


def test_batches_are_a_function_of_seed_epoch_and_index_and_resume_exactly(det):
    ds = gdsdata.GDSDataset(det)
    t = gdsdata.YoloAugment(imgsz=96, seed=1)
    first = batches(ds, t)
    again = batches(ds, t)
    for (a, ta), (b, tb) in zip(first, again):
        assert torch.equal(a, b) and all(torch.equal(x["boxes"], y["boxes"]) for x, y in zip(ta, tb))
    loader = gdsdata.Loader(ds, 4, transform=t)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = list(it)
    resumed = gdsdata.Loader(ds, 4, transform=t)
    resumed.load_state_dict(state)
    for (a, ta), (b, tb) in zip(rest, resumed):
        assert torch.equal(a, b) and all(torch.equal(x["boxes"], y["boxes"]) for x, y in zip(ta, tb))
    other = gdsdata.Loader(ds, 4, transform=t)
    other.set_epoch(1)
    assert not torch.equal(next(iter(other))[0], first[0][0])


def test_close_mosaic_turns_the_mosaic_off_for_the_last_epochs(det):
    t = gdsdata.YoloAugment(imgsz=96, epochs=5, close_mosaic=2)
    assert [t.mosaic_on(e) for e in range(5)] == [True, True, True, False, False]
    assert len(t.sources([0, 1], 2, np.arange(16))) == 8 and t.sources([0, 1], 3, np.arange(16)) == [0, 1]
    assert t.members([0, 1], 3) == [[0], [1]]


def test_a_mosaic_takes_its_partners_from_its_batch():
    """As Ultralytics takes them from the images it loaded last: a batch reads nothing more."""
    t = gdsdata.YoloAugment(imgsz=96, seed=9)
    batch = [3, 8, 1, 12, 5, 7]
    assert t.sources(batch, 0, np.arange(16)) == batch
    for k, members in enumerate(t.members(batch, 0)):
        assert members[0] == k and len(members) == 4 and k not in members[1:]
        assert all(0 <= m < len(batch) for m in members)


def test_the_ultralytics_batch_dict_holds_the_same_boxes(det):
    ds = gdsdata.GDSDataset(det)
    (images, targets), = batches(ds, gdsdata.YoloAugment(imgsz=96, seed=2), n=1, shuffle=False)
    batch, = batches(ds, gdsdata.YoloAugment(imgsz=96, seed=2, targets="ultralytics"), n=1, shuffle=False)
    assert torch.equal(batch["img"], images)
    assert batch["batch_idx"].tolist() == [k for k, t in enumerate(targets) for _ in range(len(t["labels"]))]
    assert batch["cls"][:, 0].long().tolist() == torch.cat([t["labels"] for t in targets]).tolist()
    xyxy = torch.cat([t["boxes"] for t in targets]) / 96
    cxcywh = torch.stack([(xyxy[:, 0] + xyxy[:, 2]) / 2, (xyxy[:, 1] + xyxy[:, 3]) / 2, xyxy[:, 2] - xyxy[:, 0],
                          xyxy[:, 3] - xyxy[:, 1]], 1)
    assert torch.allclose(batch["bboxes"], cxcywh, atol=1e-6)
    assert len(batch["ori_shape"]) == 4 and batch["resized_shape"][0] == (96, 96)
    for k, (ori, ratio) in enumerate(zip(batch["ori_shape"], batch["ratio_pad"])):  # as Ultralytics' training
        h0, w0 = ds[k][0].shape[1:]  # labels: the image's own size and its load_image ratios
        r = 96 / max(h0, w0)
        assert ori == (h0, w0) and ratio == (min(math.ceil(h0 * r), 96) / h0, min(math.ceil(w0 * r), 96) / w0)
    floats, _ = batches(ds, gdsdata.YoloAugment(imgsz=96, seed=2, dtype="float32"), n=1, shuffle=False)[0]
    assert floats.dtype == torch.float32 and torch.allclose(floats * 255, images.float(), atol=1e-3)
    assert gdsdata.YoloAugment(imgsz=96, dtype=torch.float16).dtype == "float16"  # torch's dtypes, as the crops take
    assert gdsdata.Letterbox(96, dtype=torch.float32).dtype == "float32"


def test_wrong_transforms_and_options_get_one_clear_error(det):
    ds = gdsdata.GDSDataset(det)
    with pytest.raises(TypeError, match="is a detection dataset"):
        gdsdata.Loader(ds, 4)
    with pytest.raises(TypeError, match="is a detection dataset"):
        gdsdata.Loader(ds, 4, transform=gdsdata.RandomResizedCrop(64))
    golden = gdsdata.GDSDataset(os.path.join(os.path.dirname(__file__), "data", "golden", "ds"))
    with pytest.raises(TypeError, match="classification dataset"):
        gdsdata.Loader(golden, 2, transform=gdsdata.YoloAugment())
    for bad, match in (({"imgsz": 33}, "imgsz"), ({"mosaic": 1.5}, "probability"), ({"targets": "coco"}, "targets"),
                       ({"scale": 1.0}, "scale"), ({"epochs": 0}, "epochs"), ({"dtype": "int8"}, "dtype"),
                       ({"seed": True}, "seed"), ({"close_mosaic": 1.0}, "close_mosaic"), ({"pad": True}, "pad")):
        with pytest.raises(ValueError, match=match):
            gdsdata.YoloAugment(**bad)
    numpy_ints = gdsdata.YoloAugment(imgsz=np.int64(64), seed=np.int64(3), epochs=np.int32(5), close_mosaic=np.int8(1))
    assert numpy_ints.mosaic_on(3) and not numpy_ints.mosaic_on(4)  # numpy integers are integers, as for the Loader
    random.random()  # the module's own random stays usable after the patched tests


@pytest.mark.gpu
@pytest.mark.parametrize("transform", [gdsdata.YoloAugment(imgsz=S, seed=6), gdsdata.Letterbox(imgsz=S)],
                         ids=["augment", "letterbox"])
def test_gpu_detection_batches_equal_the_cpu_batches(det, transform):
    """The same batches on the GPU as on the CPU: boxes and labels equal, pixels within a level
    where nvJPEG's and libjpeg-turbo's decodes agree (mean absolute difference under 2)."""
    cpu = batches(gdsdata.GDSDataset(det), transform, n=2, shuffle=False)
    gpu = batches(gdsdata.GDSDataset(det, device="cuda"), transform, n=2, shuffle=False)
    for (ci, ct), (gi, gt) in zip(cpu, gpu):
        assert gi.is_cuda and gi.shape == ci.shape and gi.dtype == torch.uint8
        for a, b in zip(ct, gt):
            assert torch.equal(a["labels"], b["labels"].cpu())
            assert torch.allclose(a["boxes"], b["boxes"].cpu(), atol=1e-4)
        assert (gi.cpu().float() - ci.float()).abs().mean() < 2


def test_a_classification_batch_transform_may_return_dict_labels():
    """Only a detection Loader of Ultralytics' form hands on a bare dict."""
    golden = gdsdata.GDSDataset(os.path.join(os.path.dirname(__file__), "data", "golden", "ds"))
    loader = gdsdata.Loader(golden, 2, transform=gdsdata.CenterCrop(32), batch_transform=lambda im, y: (im, {"y": y}))
    images, labels = next(iter(loader))
    assert images.shape == (2, 3, 32, 32) and set(labels) == {"y"}


def test_a_detection_loader_says_what_it_takes(det, caplog):
    """A detection dataset opened with torchvision transforms= is refused naming the detection
    Loader's own transforms (not the classification crops it would refuse next); Letterbox(rect=True)
    shuffled is warned about, with the order Ultralytics' rect batches use."""
    ds = gdsdata.GDSDataset(det, transforms=lambda image, target: (image, target))
    with pytest.raises(ValueError, match=r"opened with GDSDataset\(..., transforms=\).*the Loader applies its own "
                                         r"transform=gdsdata.YoloAugment\(...\) \(training\) or gdsdata.Letterbox"):
        gdsdata.Loader(ds, 4, transform=gdsdata.Letterbox(S))
    ds.close()
    ds = gdsdata.GDSDataset(det)
    with caplog.at_level("WARNING", logger="gdsdata.loader"):
        gdsdata.Loader(ds, 4, shuffle=False, indices=gdsdata.Letterbox.rect_order(ds),
                       transform=gdsdata.Letterbox(S, rect=True))
        gdsdata.Loader(ds, 4, transform=gdsdata.Letterbox(S))
    assert "rect" not in caplog.text
    with caplog.at_level("WARNING", logger="gdsdata.loader"):
        gdsdata.Loader(ds, 4, transform=gdsdata.Letterbox(S, rect=True))
    assert "shuffle=False" in caplog.text and "rect_order" in caplog.text
    loader = gdsdata.Loader(ds, 4, transform=gdsdata.Letterbox(S))  # set to one between epochs: said at the pass
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdsdata.loader"):
        for _ in range(2):  # (once, not at each epoch, also for one made afresh each epoch)
            loader.transform = gdsdata.Letterbox(S, rect=True)
            next(iter(loader))
    assert caplog.text.count("rect_order") == 1
    loader.close()
    ds.close()
