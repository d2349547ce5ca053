#!/usr/bin/env python3
"""Build the common "ImageFolder in LMDB" layout, as a baseline for benchmarks.

Keys are the sample index as 8 ASCII digits; each value is the pickle of (encoded image bytes,
label), in torchvision ImageFolder order. Two extra keys: b"__len__" (ASCII count) and b"__classes__"
(pickled class names).

    python tools/make_lmdb.py SRC OUT.lmdb
"""

import argparse
import os
import pickle
import sys

import lmdb

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gdsdata.packing.packer import scan  # noqa: E402


def build(src, out):
    classes, items, _ = scan(src)
    total = sum(os.path.getsize(os.path.join(src, rel)) for rel, _ in items)
    env = lmdb.open(out, map_size=int(total * 1.5) + (64 << 20), subdir=True, meminit=False, map_async=True)
    with env.begin(write=True) as txn:
        for i, (rel, label) in enumerate(items):
            with open(os.path.join(src, rel), "rb") as f:
                txn.put(f"{i:08d}".encode(), pickle.dumps((f.read(), label), protocol=pickle.HIGHEST_PROTOCOL))
        txn.put(b"__len__", str(len(items)).encode())
        txn.put(b"__classes__", pickle.dumps(classes))
    env.sync()
    env.close()
    return len(items)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("out")
    args = parser.parse_args()
    print(f"wrote {build(args.src, args.out)} images to {args.out}")


if __name__ == "__main__":
    main()
