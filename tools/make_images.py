#!/usr/bin/env python3
"""Generate a photographic-looking image set in the ImageFolder layout (OUT/CLASS/NNNNNN.jpg).

The images are meant to stress a data loader the way ImageNet does, not to be learnable: smooth
random illumination and colour fields, a few soft-edged objects, texture at several scales and
sensor-like noise, at ImageNet-like sizes (about 500x375, varying aspect ratios) and file sizes
(about 100 KB at the default noise and quality). Each class has its own palette. Deterministic for a
given seed.

    python tools/make_images.py OUT --count 10000 --classes 100
"""

import argparse
import io
import multiprocessing
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SIZES = [(500, 375), (375, 500), (500, 333), (500, 400), (640, 480), (400, 300), (500, 500), (350, 467)]


def _smooth_field(rng, width, height, cells, channels):
    small = rng.random((cells, cells, channels), dtype=np.float32)
    image = Image.fromarray((small * 255).astype(np.uint8).squeeze())
    return np.asarray(image.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)


def make_image(seed: int, label: int, noise: float, scale: float = 1.0) -> Image.Image:
    rng = np.random.default_rng(seed)
    width, height = SIZES[rng.integers(len(SIZES))]
    width, height = max(16, int(width * scale)), max(16, int(height * scale))
    palette = np.random.default_rng(label).random((2, 3), dtype=np.float32)
    base = _smooth_field(rng, width, height, 4, 3) / 255.0
    tint = palette[0] * base + palette[1] * (1 - base)
    light = _smooth_field(rng, width, height, 3, 1)[..., None] / 255.0
    texture = (_smooth_field(rng, width, height, 24, 3) - 127.5) * 0.35
    pixels = tint * (0.45 + 0.75 * light) * 255.0 + texture
    canvas = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        w, h = rng.integers(width // 10, width // 2), rng.integers(height // 10, height // 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        box = [int(x0), int(y0), int(x0 + w), int(y0 + h)]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    canvas = canvas.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.6, 1.6))))
    pixels = np.asarray(canvas, dtype=np.float32)
    pixels += rng.normal(0.0, noise, size=pixels.shape).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _write(job):
    path, seed, label, noise, quality, scale = job
    image = make_image(seed, label, noise, scale)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    return len(buffer.getvalue())


def generate(out, count, classes, seed=0, noise=15.0, quality=92, scale=1.0, workers=0, progress=False):
    """Write ``count`` JPEGs spread over ``classes`` class folders; returns the total bytes."""
    jobs = []
    for i in range(count):
        label = i % classes
        folder = os.path.join(out, f"class_{label:04d}")
        os.makedirs(folder, exist_ok=True)
        jobs.append((os.path.join(folder, f"{i:06d}.jpg"), seed * 1_000_003 + i, label, noise, quality, scale))
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        sizes = list(map(_write, jobs))
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            sizes = []
            for n, size in enumerate(pool.imap(_write, jobs, chunksize=16), 1):
                sizes.append(size)
                if progress and n % 1000 == 0:
                    print(f"  {n}/{count} images", file=sys.stderr)
    return sum(sizes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to create (ImageFolder layout)")
    parser.add_argument("--count", type=int, default=1000, help="number of images (default 1000)")
    parser.add_argument("--classes", type=int, default=10, help="number of class folders (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=15.0, help="sensor noise sigma (bigger files; default 15)")
    parser.add_argument("--quality", type=int, default=92, help="JPEG quality (default 92)")
    parser.add_argument("--scale", type=float, default=1.0, help="scale the ImageNet-like sizes")
    parser.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")
    args = parser.parse_args(argv)
    total = generate(args.out, args.count, args.classes, args.seed, args.noise, args.quality,
                     args.scale, args.workers, progress=True)
    print(f"wrote {args.count} images ({total / args.count / 1e3:.0f} KB mean) to {args.out}")


if __name__ == "__main__":
    main()
