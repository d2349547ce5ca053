#!/usr/bin/env python3
"""Generate a synthetic detection set, written in both the Ultralytics YOLO and the COCO layouts.

Each image is a photographic-looking background (``make_images.make_image``) with objects pasted
on it: textured, soft-lit ellipses, rectangles and triangles, one class per shape and palette. The
object count per image and the object sizes follow COCO's statistics roughly (about 7 objects per
image, some images without any; about 41 % small objects under 32x32 pixels, 34 % medium, 25 %
large), at COCO-like image sizes (mostly 640 px on the longer side, a few 819). Objects may overlap and may reach
the image border (their boxes are clipped to it). Deterministic for a given seed.

    python tools/make_detection.py OUT --count 1000 --classes 8

writes

    OUT/yolo/data.yaml                     train, val, names (paths relative to the YAML's folder)
    OUT/yolo/images/{train,val}/NNNNNN.jpg
    OUT/yolo/labels/{train,val}/NNNNNN.txt  class cx cy w h, normalised
    OUT/coco/annotations/instances_{train,val}.json
    OUT/coco/{train,val}/NNNNNN.jpg         the same images

``--val`` sets the fraction of images in the val split (default 0.1).
"""

import argparse
import io
import json
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_images import make_image  # noqa: E402

SHAPES = ("ellipse", "rectangle", "triangle")
NEGATIVE_FRACTION = 0.01  # COCO train2017: about 1 % of the images have no annotated objects


def _object_size(rng, width, height):
    """A box size (w, h) in pixels: small, medium or large in COCO's proportions."""
    kind = rng.choice(3, p=[0.41, 0.34, 0.25])
    area = {0: rng.uniform(8 ** 2, 32 ** 2), 1: rng.uniform(32 ** 2, 96 ** 2),
            2: rng.uniform(96 ** 2, 0.4 * width * height)}[int(kind)]
    aspect = float(np.exp(rng.normal(0.0, 0.5)))
    w = max(4.0, min(width, np.sqrt(area * aspect)))
    h = max(4.0, min(height, area / w))
    return w, h


def make_sample(seed: int, classes: int):
    """(image, [(class, x0, y0, x1, y1) in pixels, clipped to the image])."""
    rng = np.random.default_rng(seed)
    image = make_image(seed, int(rng.integers(1000)), 12.0, scale=1.28).convert("RGB")
    width, height = image.size
    count = 0 if rng.random() < NEGATIVE_FRACTION else int(min(40, rng.geometric(1 / 7.3)))
    boxes = []
    for _ in range(count):
        label = int(rng.integers(classes))
        w, h = _object_size(rng, width, height)
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        x0, y0 = cx - w / 2, cy - h / 2
        palette = np.random.default_rng(10_000 + label).integers(0, 256, (2, 3))
        patch = Image.new("RGB", (max(1, round(w)), max(1, round(h))), tuple(int(v) for v in palette[0]))
        mask = Image.new("L", patch.size, 0)
        draw = ImageDraw.Draw(mask)
        shape = SHAPES[label % len(SHAPES)]
        pw, ph = patch.size
        if shape == "ellipse":
            draw.ellipse([0, 0, pw - 1, ph - 1], fill=255)
        elif shape == "rectangle":
            draw.rectangle([0, 0, pw - 1, ph - 1], fill=255)
        else:
            draw.polygon([(pw / 2, 0), (pw - 1, ph - 1), (0, ph - 1)], fill=255)
        stripes = ImageDraw.Draw(patch)
        for k in range(0, pw + ph, max(3, (pw + ph) // 12)):
            stripes.line([(k, 0), (k - ph, ph)], fill=tuple(int(v) for v in palette[1]), width=2)
        image.paste(patch, (round(x0), round(y0)), mask.filter(ImageFilter.GaussianBlur(0.8)))
        # the box of what was pasted (the shape's extent in the patch, clipped to the image)
        px0, py0 = round(x0), round(y0)
        x0c, y0c = max(0, px0), max(0, py0)
        x1c, y1c = min(width, px0 + pw), min(height, py0 + ph)
        if x1c - x0c >= 2 and y1c - y0c >= 2:
            boxes.append((label, float(x0c), float(y0c), float(x1c), float(y1c)))
    return image, boxes


def generate(out, count, classes, seed=0, val=0.1, quality=90):
    names = [f"{SHAPES[k % len(SHAPES)]}-{k}" for k in range(classes)]
    splits = {"train": [], "val": []}
    for i in range(count):
        splits["val" if i >= count * (1 - val) else "train"].append(i)
    for split, ids in splits.items():
        for folder in (f"yolo/images/{split}", f"yolo/labels/{split}", f"coco/{split}", "coco/annotations"):
            os.makedirs(os.path.join(out, folder), exist_ok=True)
        coco = {"images": [], "annotations": [],
                "categories": [{"id": k + 1, "name": name} for k, name in enumerate(names)]}
        for i in ids:
            image, boxes = make_sample(seed + i, classes)
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=quality)
            name = f"{i:06d}.jpg"
            for folder in (f"yolo/images/{split}", f"coco/{split}"):
                with open(os.path.join(out, folder, name), "wb") as f:
                    f.write(buffer.getvalue())
            width, height = image.size
            with open(os.path.join(out, f"yolo/labels/{split}", f"{i:06d}.txt"), "w") as f:
                for label, x0, y0, x1, y1 in boxes:
                    f.write(f"{label} {(x0 + x1) / 2 / width:.6f} {(y0 + y1) / 2 / height:.6f} "
                            f"{(x1 - x0) / width:.6f} {(y1 - y0) / height:.6f}\n")
            coco["images"].append({"id": i + 1, "file_name": name, "width": width, "height": height})
            for label, x0, y0, x1, y1 in boxes:
                coco["annotations"].append({"id": len(coco["annotations"]) + 1, "image_id": i + 1,
                                            "category_id": label + 1, "bbox": [x0, y0, x1 - x0, y1 - y0],
                                            "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
        with open(os.path.join(out, "coco/annotations", f"instances_{split}.json"), "w") as f:
            json.dump(coco, f)
    with open(os.path.join(out, "yolo", "data.yaml"), "w") as f:
        # no path: the YAML's own folder, for Ultralytics (which reads a relative path: from the current
        # folder) and gdsdata alike, wherever the set is moved
        f.write("train: images/train\nval: images/val\nnames:\n")
        f.writelines(f"  {k}: {name}\n" for k, name in enumerate(names))
    return {split: len(ids) for split, ids in splits.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=float, default=0.1, help="fraction of the images in the val split")
    args = parser.parse_args(argv)
    counts = generate(args.out, args.count, args.classes, args.seed, args.val)
    print(f"{args.out}: {counts['train']} train and {counts['val']} val images, YOLO (yolo/) and COCO (coco/) layouts")


if __name__ == "__main__":
    main()
