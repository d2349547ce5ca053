"""Batched transforms on the CPU: torchvision's parameter semantics, determinism, exact resampling."""

import numpy as np
import pytest
import torch

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
    p = gdsdata.CenterCrop(224, 256).params(np.array([480, 300]), np.array([640, 300]))
    assert p.height.tolist() == [420, 262] and p.width.tolist() == [420, 262]
    assert p.top.tolist() == [30, 19] and p.left.tolist() == [110, 19] and not p.flip.any()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_output_matches_torch_crop_then_interpolate(layout):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((61, 90), (120, 47), (33, 33))]
    buffer = torch.from_numpy(np.concatenate([im.reshape(-1) for im in images]))
    offsets = np.cumsum([0] + [im.size for im in images[:-1]])
    heights, widths = [im.shape[0] for im in images], [im.shape[1] for im in images]
    t = gdsdata.RandomResizedCrop(40, seed=2, dtype="float32", layout=layout)
    p = t.params(heights, widths, [0, 1, 2])
    out = T.apply(t, buffer, offsets, heights, widths, [3, 3, 3], p)
    mean = torch.tensor(t.mean).view(3, 1, 1)
    std = torch.tensor(t.std).view(3, 1, 1)
    for k, im in enumerate(images):
        crop = torch.from_numpy(im[p.top[k]:p.top[k] + p.height[k], p.left[k]:p.left[k] + p.width[k]])
        ref = torch.nn.functional.interpolate(crop.permute(2, 0, 1)[None].float(), size=(40, 40),
                                              mode="bilinear", align_corners=False, antialias=False)[0]
        if p.flip[k]:
            ref = ref.flip(-1)
        ref = (ref - mean) / std
        got = out[k] if layout == "NCHW" else out[k].permute(2, 0, 1)
        assert torch.allclose(got, ref, atol=1e-4)


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        gdsdata.RandomResizedCrop(224, dtype="int8")
    with pytest.raises(ValueError, match="layout"):
        gdsdata.CenterCrop(224, layout="CHWN")
