"""Batched transforms on the CPU: torchvision's parameter semantics, determinism, exact resampling."""

import os

import numpy as np
import pytest
import torch
from conftest import needs_triton_interpreter, release

import gdsdata
from gdsdata import transforms as T


def test_random_resized_crop_parameters_follow_torchvision():
    t = gdsdata.RandomResizedCrop(224, seed=3)
    rng = np.random.default_rng(0)
    heights, widths = rng.integers(200, 900, 5000), rng.integers(200, 900, 5000)
    p = t.params(heights, widths, np.arange(5000), epoch=1)
    assert np.all((p.top >= 0) & (p.left >= 0) & (p.top + p.height <= heights) & (p.left + p.width <= widths))
    area = p.height * p.width / (heights * widths)
    ratio = p.width / p.height
    assert area.min() > 0.07 and area.max() <= 1.0
    assert ratio.min() > 0.74 and ratio.max() < 1.35
    assert 0.47 < p.flip.mean() < 0.53
    # torchvision's own get_params on these 5,000 sizes: median area 0.341, 10th-90th percentile
    # 0.13-0.68 (large targets are rejected more often than small ones)
    assert 0.31 < np.median(area) < 0.37
    assert 0.11 < np.percentile(area, 10) < 0.15 and 0.64 < np.percentile(area, 90) < 0.72


def test_parameters_are_a_function_of_seed_epoch_and_sample():
    t = gdsdata.RandomResizedCrop(224, seed=5)
    h, w = np.full(10, 480), np.full(10, 640)
    whole = t.params(h, w, np.arange(10), epoch=2)
    part = t.params(h[:3], w[:3], np.array([7, 8, 9]), epoch=2)  # another batch, same samples
    assert np.array_equal(whole.top[7:], part.top) and np.array_equal(whole.flip[7:], part.flip)
    other = t.params(h, w, np.arange(10), epoch=3)
    assert not np.array_equal(whole.top, other.top)


def test_center_crop_geometry():
    """torchvision's Resize(256) (the shorter side to 256, the longer truncated: 640 x 256 / 480 =
    341.3 -> 341) of the whole image, then CenterCrop(224)'s block: half the difference, rounded half
    to even (58.5 -> 58)."""
    p = gdsdata.CenterCrop(224, 256).params(np.array([480, 300]), np.array([640, 300]))
    assert p.top.tolist() == [0, 0] and p.left.tolist() == [0, 0] and not p.flip.any()
    assert p.height.tolist() == [480, 300] and p.width.tolist() == [640, 300]
    assert p.resized_height.tolist() == [256, 256] and p.resized_width.tolist() == [341, 256]
    assert p.out_top.tolist() == [16, 16] and p.out_left.tolist() == [58, 16]


def _images():
    rng = np.random.default_rng(1)
    return _batch([rng.integers(0, 256, (h, w, c), dtype=np.uint8) for h, w, c in
                   ((61, 90, 3), (120, 47, 3), (33, 33, 1), (300, 410, 3))])


def _batch(images):
    """HWC uint8 ``images`` as a batch: (images, flat buffer, offsets, heights, widths, channels)."""
    buffer = torch.from_numpy(np.concatenate([im.reshape(-1) for im in images]))
    offsets = np.cumsum([0] + [im.size for im in images[:-1]])
    return images, buffer, offsets, [im.shape[0] for im in images], [im.shape[1] for im in images], \
        [im.shape[2] for im in images]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("size", [40, (30, 52)])
def test_output_equals_torchvision_v2_resized_crop(layout, antialias, size):
    """uint8 crop + resize exactly as torchvision v2's resized_crop (0.24 on; earlier releases round
    some pixels one level apart), then flip, to_dtype, normalize."""
    import torchvision
    from torchvision.transforms.v2 import functional as F

    apart = 0 if release(torchvision) >= (0, 24) else 1

    images, buffer, offsets, heights, widths, chans = _images()
    t = gdsdata.RandomResizedCrop(size, seed=2, dtype="float32", layout=layout, antialias=antialias)
    p = t.params(heights, widths, [0, 1, 2, 3])
    out = T.apply(t, buffer, offsets, heights, widths, chans, p)
    raw = T.apply(gdsdata.RandomResizedCrop(size, seed=2, dtype="uint8", layout=layout, antialias=antialias),
                  buffer, offsets, heights, widths, chans, p)
    assert out.shape == ((4, 3, *t.output_size) if layout == "NCHW" else (4, *t.output_size, 3))
    mean = [m / 255 for m in t.mean]
    std = [s / 255 for s in t.std]
    for k, im in enumerate(images):
        chw = torch.from_numpy(im).permute(2, 0, 1).expand(3, -1, -1)
        ref = F.resized_crop(chw.contiguous(), int(p.top[k]), int(p.left[k]), int(p.height[k]), int(p.width[k]),
                             list(t.output_size), antialias=antialias)
        if p.flip[k]:
            ref = F.horizontal_flip(ref)
        got_u8 = raw[k] if layout == "NCHW" else raw[k].permute(2, 0, 1)
        assert (got_u8.int() - ref.int()).abs().max() <= apart, (k, (got_u8.int() - ref.int()).abs().max())
        ref = F.normalize(F.to_dtype(got_u8 if apart else ref, torch.float32, scale=True), mean, std)
        got = out[k] if layout == "NCHW" else out[k].permute(2, 0, 1)
        assert torch.allclose(got, ref, atol=1e-4)


def test_dtype_follows_the_device_by_default():
    images, buffer, offsets, heights, widths, chans = _images()
    t = gdsdata.RandomResizedCrop(24)
    out = T.apply(t, buffer, offsets, heights, widths, chans, t.params(heights, widths, [0, 1, 2, 3]))
    assert out.dtype == torch.float32  # float16 on the GPU
    assert T.output_dtype(t, "cuda") == torch.float16


@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("size, resize, shapes", [
    (224, 256, [(256, 259), (259, 256), (256, 261), (256, 256)]),  # at its resize: 35 -> 18, 37 -> 18 (to even)
    (32, None, [(61, 90), (120, 47), (300, 410), (37, 37)]),  # shrunk, the odd sizes' edges between pixels
    (8, 256, [(16, 16), (3, 1)]),  # far under its resize: enlarged 16 and 256 times
    ((24, 40), 44, [(50, 70), (70, 50)]),  # a rectangle
])
def test_center_crop_is_torchvision_s_resize_and_center_crop_to_the_bit(size, resize, shapes, antialias):
    """On the CPU, CenterCrop's pixels are those of torchvision v2's Resize(resize) + CenterCrop(size)
    on the uint8 image, bit for bit, also where an edge of the block falls between source pixels;
    a gray image's one channel fills all three. (torchvision before 0.24 rounds some pixels one level
    apart.)"""
    import torchvision
    from torchvision.transforms import v2

    apart = 0 if release(torchvision) >= (0, 24) else 1

    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (*shape, 3 if k % 3 else 1), dtype=np.uint8) for k, shape in enumerate(shapes)]
    t = gdsdata.CenterCrop(size, resize=resize, dtype="uint8", antialias=antialias)
    _, buffer, offsets, heights, widths, chans = _batch(images)
    out = T.apply(t, buffer, offsets, heights, widths, chans, t.params(heights, widths))
    reference = v2.Compose([v2.Resize(t.resize, antialias=antialias), v2.CenterCrop(size)])
    for k, image in enumerate(images):
        want = reference(torch.from_numpy(image).permute(2, 0, 1)).expand(3, -1, -1)
        assert (out[k].int() - want.int()).abs().max() <= apart, (shapes[k], chans[k])


def test_crop_params_made_for_another_output_size_are_refused():
    """CenterCrop's parameters place its block inside the resized image; applied with a larger
    output they would read past it: one clear error, on every path, not zeros or a shape error."""
    images, buffer, offsets, heights, widths, chans = _images()
    small, large = gdsdata.CenterCrop(16, resize=20), gdsdata.CenterCrop(24, resize=30)
    with pytest.raises(ValueError, match="outside it"):
        T.apply(large, buffer, offsets, heights, widths, chans, small.params(heights, widths))


def test_center_crop_of_an_odd_shape_resizes_only_the_window_its_block_covers(monkeypatch):
    """Past WHOLE_LIMIT pixels resized (an aspect over 256:1 at resize 256: a 1 x 20,000 image would
    make a 5 million x 256 one) the CPU path resizes only the source window under the centre block,
    rounded to whole pixels: near torchvision's pixels, at the cost of the block alone."""
    from torchvision.transforms import v2

    asked = []
    interpolate = torch.nn.functional.interpolate
    monkeypatch.setattr(torch.nn.functional, "interpolate", lambda x, size, **kw: asked.append(size) or
                        interpolate(x, size=size, **kw))
    monkeypatch.setattr(T, "WHOLE_LIMIT", 100 * 100)
    yy, xx = np.mgrid[0:90, 0:300]
    image = np.stack([(yy * 2 + xx) % 256, (xx * 3) % 256, (yy * 5) % 256], -1).astype(np.uint8)  # smooth ramps
    t = gdsdata.CenterCrop(64, resize=80, dtype="uint8")
    out = T.apply(t, torch.from_numpy(image.reshape(-1).copy()), [0], [90], [300], [3], t.params([90], [300]))[0]
    assert asked == [(64, 64)]  # not the 80 x 266 image
    want = v2.Compose([v2.Resize(80), v2.CenterCrop(64)])(torch.from_numpy(image).permute(2, 0, 1))
    assert (out.int() - want.int()).abs().float().mean() < 3


def test_center_crop_of_a_photograph_is_torchvision_s_to_the_bit():
    """Ultralytics' bus photograph (1080 x 810: Resize(256) makes it 341 x 256, CenterCrop(224) starts
    at row round(58.5) = 58 of that, between source pixels), normalised float32 as a CPU model takes
    it: torchvision's Resize + CenterCrop + ToDtype + Normalize, to float32 rounding (before
    torchvision 0.24, within a level)."""
    import torchvision
    from torchvision.transforms import v2

    ultralytics = pytest.importorskip("ultralytics")
    from PIL import Image

    bus = os.path.join(os.path.dirname(ultralytics.__file__), "assets", "bus.jpg")
    image = np.array(Image.open(bus).convert("RGB"))  # (writable: torch takes it as it is)
    t = gdsdata.CenterCrop(224, resize=256)
    out = T.apply(t, torch.from_numpy(image.reshape(-1).copy()), [0], [1080], [810], [3], t.params([1080], [810]))[0]
    ref = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.ToDtype(torch.float32),
                      v2.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)])(torch.from_numpy(image).permute(2, 0, 1))
    level = 1 / min(T.IMAGENET_STD)  # one uint8 level, normalised
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-5 if release(torchvision) >= (0, 24)
                                                         else level + 1e-5, rtol=0)


def test_a_buffer_that_is_a_view_resamples_its_own_pixels():
    """A batch's pixels handed in as a slice of a larger tensor (a staging buffer's window, a user's
    own transform under pixels=True): the crops are taken from the view, not its storage's start."""
    images, buffer, offsets, heights, widths, chans = _images()
    padded = torch.cat([torch.randint(0, 256, (1001,), dtype=torch.uint8), buffer])[1001:]
    strided = torch.stack([buffer, torch.zeros_like(buffer)], 1)[:, 0]  # every other byte of its storage
    for t in (gdsdata.RandomResizedCrop(24, seed=4, dtype="uint8"), gdsdata.CenterCrop(16, resize=20, dtype="uint8")):
        p = t.params(heights, widths, [0, 1, 2, 3])
        expected = T.apply(t, buffer, offsets, heights, widths, chans, p)
        for view in (padded, strided):
            assert torch.equal(T.apply(t, view, offsets, heights, widths, chans, p), expected)


def test_center_crop_resizes_to_its_size_over_0_875_by_default():
    """torchvision's ImageNet evaluation ratio, whatever the size (a fixed 256 cropped 32 px out of
    the middle of a 256 px image, and refused 288)."""
    assert [gdsdata.CenterCrop(size).resize for size in (224, 32, 288, (160, 224))] == [256, 37, 329, 256]
    assert gdsdata.CenterCrop(224) == gdsdata.CenterCrop(224, resize=256)


def test_transforms_made_with_lists_are_tuples_equal_and_hashable():
    """torchvision takes scale=[0.08, 1.0] and size=[96]: so do they, kept as tuples (frozen, hashable)."""
    t = gdsdata.RandomResizedCrop([96], scale=[0.08, 1], ratio=np.array([0.75, 4 / 3]))
    assert t == gdsdata.RandomResizedCrop((96,), scale=(0.08, 1.0), ratio=(0.75, 4 / 3))
    assert hash(t) == hash(gdsdata.RandomResizedCrop((96,), scale=(0.08, 1.0), ratio=(0.75, 4 / 3)))
    assert t.output_size == (96, 96) and t.scale == (0.08, 1.0)
    with pytest.raises(TypeError, match=r"scale must be a \(low, high\) pair"):
        gdsdata.RandomResizedCrop(96, scale=0.5)
    for bad in ("12", bytearray(b"12"), ("0.08", "1"), (0.1, float("inf"))):
        with pytest.raises(TypeError, match=r"scale must be a \(low, high\) pair of finite numbers"):
            gdsdata.RandomResizedCrop(96, scale=bad)
    with pytest.raises(TypeError, match=r"ratio must be a \(low, high\) pair"):
        gdsdata.RandomResizedCrop(96, ratio=(1, 2, 3))
    assert hash(gdsdata.CenterCrop([224], mean=[1, 2, 3], std=[4, 5, 6])) == \
        hash(gdsdata.CenterCrop((224,), mean=(1, 2, 3), std=(4, 5, 6)))


def test_center_crop_refuses_a_resize_under_its_size():
    """torchvision's Resize(100) + CenterCrop(224) pads the crop with zeros; the one-pass CenterCrop
    says so rather than give other pixels."""
    with pytest.raises(ValueError, match="pad"):
        gdsdata.CenterCrop(224, resize=100)
    with pytest.raises(ValueError, match="pad"):
        gdsdata.CenterCrop((224, 112), resize=200)
    gdsdata.CenterCrop(224, resize=224)


@pytest.mark.parametrize("make", [gdsdata.RandomResizedCrop, gdsdata.CenterCrop])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(std=(0, 1, 1)), ValueError, "std holds a zero"),
    (dict(std=(0.0, 58.0, 57.0)), ValueError, "std holds a zero"),
    (dict(std=(58.0, 57.0)), ValueError, "std must hold 3 finite values"),
    (dict(std=(58.0, float("inf"), 57.0)), ValueError, "std must hold 3 finite values"),
    (dict(mean=(124.0, float("nan"), 104.0)), ValueError, "mean must hold 3 finite values"),
    (dict(mean=(1, 2, 3, 4)), ValueError, "mean must hold 3"),
    (dict(mean="rgb"), TypeError, "mean must be 3 numbers"),
    (dict(std=58.0), TypeError, "std must be 3 numbers"),
    # one of the pair None beside a value of the caller's own would drop that value unsaid
    (dict(mean=(100, 100, 100), std=None), ValueError, r"mean=\(100.0, 100.0, 100.0\) given with std=None"),
    (dict(mean=None, std=(2, 2, 2)), ValueError, r"std=\(2.0, 2.0, 2.0\) given with mean=None"),
])
def test_mean_and_std_are_checked_when_made(make, kwargs, error, match):
    """As torchvision's Normalize checks them: not at the first batch, in the Loader's thread."""
    with pytest.raises(error, match=match):
        make(16, **kwargs)


def test_mean_and_std_of_any_sequence_are_kept_as_floats():
    t = gdsdata.CenterCrop(16, mean=[1, 2, 3], std=np.array([4, 5, 6]))
    assert t.mean == (1.0, 2.0, 3.0) and t.std == (4.0, 5.0, 6.0) and hash(t) == hash(gdsdata.CenterCrop(
        16, mean=(1, 2, 3), std=(4, 5, 6)))
    assert gdsdata.RandomResizedCrop(16, mean=None, std=None).std is None
    for t in (gdsdata.RandomResizedCrop(16, mean=None), gdsdata.CenterCrop(16, std=None)):
        assert gdsdata.transforms._norm(t, torch.float32) == ((1.0,) * 3, (0.0,) * 3)  # beside the other's
        # default, one None skips normalisation


@pytest.mark.parametrize("make", [gdsdata.RandomResizedCrop, gdsdata.CenterCrop])
def test_mean_and_std_on_the_0_1_scale_are_warned_about(make, caplog):
    """torchvision's ImageNet values (for images scaled to 0-1) given to a transform of 0-255 pixels
    would train on values of about -2 to 1100: said when made."""
    with caplog.at_level("WARNING", logger="gdsdata.transforms"):
        make(16, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    assert "both look like values on the 0-1 scale" in caplog.text and "IMAGENET_MEAN" in caplog.text
    for half, which in (({"mean": (0.485, 0.456, 0.406)}, "the mean looks"),  # the other left at its 0-255 default
                        ({"std": (0.229, 0.224, 0.225)}, "the std looks")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="gdsdata.transforms"):
            make(16, **half)
        assert f"{which} like values on the 0-1 scale" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdsdata.transforms"):
        make(16)
        make(16, mean=(0, 0, 0), std=(1, 1, 1))  # the pixels as they are, said outright
        make(16, mean=(124, 116, 104), std=(1, 1, 1))  # the mean subtracted alone (Caffe's way)
        make(16, mean=(0, 0, 0), std=(255, 255, 255))  # 0-1, as ToDtype(scale=True) gives
        make(16, mean=None, std=None)
    assert caplog.text == ""


def test_center_crop_of_a_rectangle():
    p = gdsdata.CenterCrop((224, 112), 256).params(np.array([512]), np.array([1024]))
    assert (p.resized_height[0], p.resized_width[0]) == (256, 512) and (p.out_top[0], p.out_left[0]) == (16, 200)


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        gdsdata.RandomResizedCrop(224, dtype="int8")
    with pytest.raises(ValueError, match="layout"):
        gdsdata.CenterCrop(224, layout="CHWN")
    with pytest.raises(TypeError, match="size"):
        gdsdata.RandomResizedCrop((32, 48, 3))
    with pytest.raises(TypeError, match="size"):
        gdsdata.RandomResizedCrop(22.4)
    with pytest.raises(ValueError, match="scale"):
        gdsdata.RandomResizedCrop(224, scale=(1.0, 0.5))
    with pytest.raises(TypeError, match="antialias"):
        gdsdata.RandomResizedCrop(224, antialias="yes")
    with pytest.raises(ValueError, match="seed"):
        gdsdata.RandomResizedCrop(224, seed=-1)
    for flag in (True, np.bool_(True)):  # a bool is no integer here
        with pytest.raises(ValueError, match="seed"):
            gdsdata.RandomResizedCrop(224, seed=flag)
        with pytest.raises(ValueError, match="resize"):
            gdsdata.CenterCrop(1, resize=flag)
        with pytest.raises(TypeError, match="size"):
            gdsdata.CenterCrop(flag)
    assert gdsdata.CenterCrop(np.int64(224), resize=np.int32(256)).output_size == (224, 224)
    shape = np.array([300]), np.array([400]), np.array([7])
    for seed in (np.uint8(3), np.int64(3)):  # a numpy integer seed draws what the same int does
        got = gdsdata.RandomResizedCrop(224, seed=seed).params(*shape, epoch=np.int64(2))
        want = gdsdata.RandomResizedCrop(224, seed=3).params(*shape, epoch=2)
        fields = ("top", "left", "height", "width", "flip")
        assert all(np.array_equal(getattr(got, f), getattr(want, f)) for f in fields)


def test_the_gpu_kernels_compute_what_the_cpu_path_does(tmp_path):
    """The Triton kernels (plain and antialiased bilinear) run in Triton's interpreter on the CPU:
    within one level of the CPU path, which rounds to uint8 before normalising; RandomResizedCrop's
    windows, and CenterCrop's block of the whole image resized (shrunk, and enlarged)."""
    import subprocess
    import sys

    needs_triton_interpreter()
    script = tmp_path / "kernels.py"
    script.write_text(f"""
import itertools, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..")!r})
import numpy as np, torch, gdsdata
from gdsdata import transforms as T
from gdsdata.transforms.kernels import resample
rng = np.random.default_rng(1)
everything = [rng.integers(0, 256, s, dtype=np.uint8) for s in ((61, 90, 3), (120, 47, 3), (33, 33, 1))]
cases = ((24, "float32", "NCHW"), ((20, 36), "float32", "NCHW"), (80, "uint8", "NHWC"))
crops = (lambda size, **kw: gdsdata.RandomResizedCrop(size, seed=2, **kw),  # (seed 2 flips two of the three)
         lambda size, **kw: gdsdata.CenterCrop(size, resize=None, **kw),
         lambda size, **kw: gdsdata.CenterCrop(size, resize=max(T._pair(size)) + 3, **kw))
for images, aa, (size, dtype, layout), crop in itertools.product((everything, everything[:2]), (True, False), cases,
                                                                   crops):
    # a batch with a gray image, and an all-RGB one (whose channels the row pass reads at fixed offsets)
    buffer = torch.from_numpy(np.concatenate([im.reshape(-1) for im in images]))
    offsets = np.cumsum([0] + [im.size for im in images[:-1]])
    h, w, c = ([im.shape[k] for im in images] for k in range(3))
    t = crop(size, dtype=dtype, antialias=aa, mean=None, std=None, layout=layout)
    p = t.params(h, w, list(range(len(images))))
    ref = T.apply(t, buffer, offsets, h, w, c, p).float()
    meta = T.table(offsets, h, w, c, p, t.output_size)
    out = torch.empty(ref.shape, dtype=getattr(torch, dtype))
    if dtype == "float32":
        out.fill_(float("nan"))
    resample(buffer, meta, out, t.output_size, (1.0,) * 3, (0.0,) * 3, layout == "NCHW", aa)
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() <= 1.0, (aa, size, (out.float() - ref).abs().max())
print("ok")
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_cpu_normalisation_image_by_image_is_torch_s_to_the_bit(dtype, layout):
    """float32 on the CPU is converted and normalised an image at a time on the CPU threads: the
    same values, bit for bit, as converting the uint8 batch and normalising it with torch."""
    images, buffer, offsets, heights, widths, chans = _images()  # one of them gray
    t = gdsdata.RandomResizedCrop(40, seed=2, dtype=dtype, layout=layout)
    p = t.params(heights, widths, [0, 1, 2, 3])
    got = T.apply(t, buffer, offsets, heights, widths, chans, p)
    levels = T.apply(gdsdata.RandomResizedCrop(40, seed=2, dtype="uint8"), buffer, offsets, heights, widths, chans, p)
    ref = levels.to(getattr(torch, dtype)).mul_(torch.tensor([1 / s for s in t.std], dtype=getattr(torch, dtype))
                                                .view(1, 3, 1, 1))
    ref = ref.add_(torch.tensor([-m / s for m, s in zip(t.mean, t.std)], dtype=getattr(torch, dtype)).view(1, 3, 1, 1))
    assert torch.equal(got, ref if layout == "NCHW" else ref.permute(0, 2, 3, 1))
