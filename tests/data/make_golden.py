#!/usr/bin/env python3
"""Rebuild tests/data/golden/ (only when FORMAT_VERSION changes on purpose).

The sources are tiny JPEGs that qualify for the GPU path, so they are stored byte for byte and the
packed bytes do not depend on the Pillow version that packs them.
"""

import hashlib
import io
import json
import os
import pathlib
import shutil
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
from make_images import make_image  # noqa: E402

GOLDEN = os.path.join(HERE, "golden")
SOURCES = {  # relative path -> (seed, mode, subsampling)
    "cat/a.jpg": (1, "RGB", 2),
    "cat/b.jpg": (2, "L", 2),
    "dog/c.jpg": (3, "RGB", 0),
    "dog/d.jpg": (4, "RGB", 1),
}


def main():
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from gdsdata.format.index import load
    from gdsdata.packing.packer import pack

    shutil.rmtree(GOLDEN, ignore_errors=True)
    src = os.path.join(GOLDEN, "src")
    for rel, (seed, mode, subsampling) in SOURCES.items():
        image = make_image(seed, seed % 2, 3.0, scale=0.08).convert(mode)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=85, subsampling=subsampling)
        os.makedirs(os.path.join(src, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(buffer.getvalue())
    out = os.path.join(GOLDEN, "ds")
    pack(src, out, workers=1, alignment=4096, shard_size=12288)
    index = load(out)
    expected = {
        "samples": [{name: int(index.samples[i][name]) for name in index.samples.dtype.names}
                    for i in range(len(index))],
        "paths": [index.path(i) for i in range(len(index))],
        "classes": index.classes,
        "shards": [{name: int(r[name]) for name in index.shards.dtype.names if name != "origin_id"}
                   for r in index.shards],
        "payload_sha256": [hashlib.sha256(pathlib.Path(os.path.join(src, index.path(i))).read_bytes()).hexdigest()
                           for i in range(len(index))],
    }
    with open(os.path.join(GOLDEN, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    os.unlink(os.path.join(out, "pack_report.json"))
    print(f"golden dataset: {len(index)} samples, {len(index.shards)} shards in {GOLDEN}")


if __name__ == "__main__":
    main()
