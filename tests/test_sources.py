"""The packing sources on hostile or unusual input: LMDB keys and values, tar shards, fsspec URLs.
Each case packs what it can and names what it cannot, in one line, before anything is written."""

import pickle

import pytest
from conftest import jpeg_bytes, photo

from gdsdata.format import index as index_io
from gdsdata.packing.packer import pack
from gdsdata.packing.sources import open_source


def write_lmdb(path, entries, classes=None):
    """An LMDB of ``entries`` (key bytes -> value bytes, or -> (image bytes, label) to pickle)."""
    lmdb = pytest.importorskip("lmdb")
    env = lmdb.open(path, map_size=64 << 20, subdir=True)
    with env.begin(write=True) as txn:
        for key, value in entries.items():
            txn.put(key, value if isinstance(value, bytes) else pickle.dumps(value))
        if classes is not None:
            txn.put(b"__classes__", pickle.dumps(classes))
    env.close()
    return path


def packed(out):
    """(class names, {sample path bytes: (label, payload)}) of a dataset."""
    index = index_io.load(out)
    samples = {}
    for k, row in enumerate(index.samples):
        with open(index.shard_path(int(row["shard"])), "rb") as f:
            f.seek(int(row["offset"]))
            samples[index.path(k).encode("utf-8", "surrogateescape")] = (int(row["label"]), f.read(int(row["length"])))
    return index.classes, samples


# --- LMDB ---------------------------------------------------------------------------------------
def test_lmdb_keys_that_are_not_utf8_stay_distinct_and_keep_their_labels(tmp_path):
    a, b = jpeg_bytes(photo(1)), jpeg_bytes(photo(2))
    db = write_lmdb(str(tmp_path / "keys.lmdb"), {b"\xff1": (a, 0), b"\xfe1": (b, 1), b"2": (a, 1)},
                    classes=["cat", "dog"])
    result = pack(db, str(tmp_path / "ds"), workers=1)
    assert result.packed == 3
    classes, samples = packed(result.out)
    assert classes == ["cat", "dog"]
    assert samples == {b"\xff1": (0, a), b"\xfe1": (1, b), b"2": (1, a)}  # the keys' own bytes name them
    names = sorted(item.rel for item in open_source(db).items)
    assert [n.encode("utf-8", "surrogateescape") for n in names] == [b"2", b"\xfe1", b"\xff1"]
