"""Packing at scale: parts and merge, resume after SIGKILL, LMDB and tar sources."""

import io
import os
import random
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
from conftest import jpeg_bytes, photo, write_photos

from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io
from gdsdata.dataset import GDSDataset
from gdsdata.errors import FormatError, OutputExistsError, SourceError
from gdsdata.packing.merge import merge
from gdsdata.packing.packer import pack

SHARD = 120_000  # small shards: many shard boundaries in a small set


def samples_of(root):
    """Everything a dataset says about its samples, shard layout aside: path, label, codec fields,
    checksum, and the payload bytes themselves."""
    index = index_io.load(root)
    out = []
    for i in range(len(index)):
        r = index.samples[i]
        with open(index.shard_path(int(r["shard"])), "rb") as f:
            f.seek(int(r["offset"]))
            payload = f.read(int(r["length"]))
        out.append((index.path(i), int(r["label"]), int(r["width"]), int(r["height"]), int(r["codec"]),
                    int(r["components"]), int(r["subsampling"]), int(r["flags"]), int(r["crc32"]), payload))
    return index.classes, out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = tmp_path_factory.mktemp("scale_src")
    write_photos(str(src), 40, classes=4, start_seed=900)
    (src / "class1" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff nothing")
    (src / "class3" / "notes.txt").write_text("ignored")
    return str(src)


@pytest.fixture(scope="module")
def whole(source, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("whole") / "ds")
    pack(source, out, workers=2, shard_size=SHARD)
    return out


def test_four_parts_merged_equal_the_whole(source, whole, tmp_path):
    parts = []
    for k in range(4):
        part = str(tmp_path / f"part{k}")
        pack(source, part, workers=2, shard_size=SHARD, num_parts=4, part=k)
        parts.append(part)
    sizes = [len(index_io.load(p)) for p in parts]
    assert sum(sizes) == 40 and max(sizes) - min(sizes) <= 2  # 41 items split evenly, one of them bad
    merged = str(tmp_path / "merged")
    summary = merge(parts, merged)
    assert summary["shards_placed"] == ["hard-linked"]
    assert samples_of(merged) == samples_of(whole)
    ds = GDSDataset(merged)
    assert ds.meta["counts"]["skipped"] == 1 and len(ds.meta["merged_from"]) == 4
    shard = os.path.join(merged, fmt.shard_name(0))
    assert os.stat(shard).st_ino == os.stat(os.path.join(parts[0], fmt.shard_name(0))).st_ino  # not copied
    copied = str(tmp_path / "copied")
    merge(parts, copied, copy=True)
    assert samples_of(copied) == samples_of(whole)


def test_merge_refuses_parts_of_different_sources(whole, tmp_path):
    other = str(tmp_path / "other_src")
    write_photos(other, 4, classes=2)
    part = str(tmp_path / "other")
    pack(other, part, workers=1)
    with pytest.raises(SourceError, match="class list differs"):
        merge([whole, part], str(tmp_path / "m"))


def _pack_cmd(source, out, *extra):
    return [sys.executable, "-m", "gdsdata.cli", "pack", source, out, "--workers", "1", "--shard-size",
            str(SHARD), "-q", *extra]


def _wait_for_journals(out, proc, count=1):
    """Until the pack has finished ``count`` shards (or ended)."""
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        if os.path.isdir(out) and sum(n.endswith(fmt.JOURNAL_SUFFIX) for n in os.listdir(out)) >= count:
            return
        time.sleep(0.002)


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("kill_src"))
    write_photos(src, 160, classes=4, start_seed=2000)
    whole = str(tmp_path_factory.mktemp("kill_whole") / "ds")
    pack(src, whole, workers=1, shard_size=SHARD)
    return src, whole


def test_sigkill_at_random_points_then_resume(bigger, tmp_path):
    source, whole = bigger
    rng = random.Random(1234)
    reference = samples_of(whole)
    shards = len(index_io.load(whole).shards)
    interrupted = 0
    for attempt in range(8):
        out = str(tmp_path / f"killed{attempt}")
        proc = subprocess.Popen(_pack_cmd(source, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_journals(out, proc, rng.randint(1, shards - 2))  # a random point of the pack
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        finished = os.path.exists(os.path.join(out, fmt.INDEX_NAME))
        if not finished:  # never mistaken for a dataset
            interrupted += 1
            with pytest.raises(FormatError, match="not a finished gdsdata dataset.*--resume"):
                GDSDataset(out)
            resumed = subprocess.run(_pack_cmd(source, out, "--resume"), capture_output=True, text=True)
            assert resumed.returncode == 0, resumed.stderr
        assert samples_of(out) == reference, attempt
        assert not [n for n in os.listdir(out) if n.endswith((fmt.JOURNAL_SUFFIX, fmt.TMP_SUFFIX))]
        index, golden = index_io.load(out), index_io.load(whole)
        layout = ["size", "crc32", "num_samples"]
        assert np.array_equal(index.shards[layout], golden.shards[layout])  # the same shard bytes
    assert interrupted >= 6


def test_resume_refuses_other_options_and_finished_datasets(source, whole, bigger, tmp_path):
    with pytest.raises(OutputExistsError, match="already a finished dataset"):
        pack(source, whole, resume=True, shard_size=SHARD)
    out = str(tmp_path / "ds")
    proc = subprocess.Popen(_pack_cmd(bigger[0], out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_journals(out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(SourceError, match="other sources or options"):
        pack(bigger[0], out, resume=True, shard_size=SHARD * 2)


def test_lmdb_source(source, whole, tmp_path):
    pytest.importorskip("lmdb")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from make_lmdb import build

    db = str(tmp_path / "images.lmdb")
    build(source, db)
    out = str(tmp_path / "from_lmdb")
    result = pack(db, out, workers=2, shard_size=SHARD)
    classes, got = samples_of(out)
    want_classes, want = samples_of(whole)
    assert classes == want_classes and result.skipped and len(got) == len(want)
    assert [g[1:] for g in got] == [w[1:] for w in want]  # same labels and bytes; keys name the samples


def test_tar_source(tmp_path):
    shards = tmp_path / "wds"
    shards.mkdir()
    expected = []
    for t in range(2):
        with tarfile.open(shards / f"train-{t:04d}.tar", "w") as tar:
            for k in range(5):
                key = f"sample{t}{k:03d}"
                data = jpeg_bytes(photo(300 + 10 * t + k), quality=85)
                label = (t * 5 + k) % 3
                for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                expected.append((label, data))
    out = str(tmp_path / "ds")
    pack(str(shards), out, workers=1)
    classes, got = samples_of(out)
    assert classes == ["0", "1", "2"]
    assert sorted((g[1], g[-1]) for g in got) == sorted(expected)
    assert all(g[0].startswith("train-000") for g in got)


def torchvision_labels(root):
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(root)
    return {os.path.relpath(path, root): label for path, label in folder.samples}


def test_append_refuses_another_image_under_a_path_the_dataset_holds(tmp_path):
    src, other = tmp_path / "src", tmp_path / "other"
    write_photos(str(src), 6, classes=2, start_seed=700)
    write_photos(str(other), 6, classes=2, start_seed=900)  # the same names, other images
    (other / "class0" / "extra.jpg").write_bytes(jpeg_bytes(photo(950), quality=85))
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=1, shard_size=SHARD)
    index = open(os.path.join(out, fmt.INDEX_NAME), "rb").read()
    with pytest.raises(SourceError, match=r"already holds a different image under class0/.*--overwrite"):
        pack(str(other), out, workers=1, shard_size=SHARD, append=True)
    assert open(os.path.join(out, fmt.INDEX_NAME), "rb").read() == index  # untouched


def test_readers_never_write(whole):
    before = {n: (os.stat(os.path.join(whole, n)).st_mtime_ns, os.stat(os.path.join(whole, n)).st_size)
              for n in os.listdir(whole)}
    datasets = [GDSDataset(whole) for _ in range(3)]  # many readers at once
    for ds in datasets:
        ds.__getitems__(range(len(ds)))
    assert before == {n: (os.stat(os.path.join(whole, n)).st_mtime_ns, os.stat(os.path.join(whole, n)).st_size)
                      for n in os.listdir(whole)}
    assert np.all([len(ds) == len(datasets[0]) for ds in datasets])


def test_append_adds_new_images_and_classes(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 9, classes=3, start_seed=700)
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=1, shard_size=SHARD)
    before = samples_of(out)
    for k in range(3):  # new images in an old class and a new class "aardvark" that sorts first
        for folder in ("class1", "aardvark"):
            (src / folder).mkdir(exist_ok=True)
            (src / folder / f"new{k}.jpg").write_bytes(jpeg_bytes(photo(800 + k), quality=85))
    result = pack(str(src), out, workers=1, shard_size=SHARD, append=True)
    classes, after = samples_of(out)
    assert classes == ["aardvark", "class0", "class1", "class2"]  # ImageFolder's labels: the sorted names
    shifted = [(s[0], s[1] + 1) + s[2:] for s in before[1]]  # every old class sorts after "aardvark"
    assert after[:len(before[1])] == shifted and len(after) == len(before[1]) + 6
    assert {s[0]: s[1] for s in after[len(before[1]):]} == {
        **{f"aardvark/new{k}.jpg": 0 for k in range(3)}, **{f"class1/new{k}.jpg": 2 for k in range(3)}}
    assert result.packed == len(after) and result.new == 6 and result.relabeled == ["class0", "class1", "class2"]
    folder = torchvision_labels(str(src))  # the same labels as an ImageFolder of the grown source
    ds = GDSDataset(out)
    assert {ds.index.path(i): int(ds.index.samples[i]["label"]) for i in range(len(ds))} == folder
    index = open(os.path.join(out, fmt.INDEX_NAME), "rb").read()
    again = pack(str(src), out, workers=1, shard_size=SHARD, append=True)  # up to date: nothing written
    assert (again.new, again.packed, again.shards) == (0, len(after), result.shards)
    assert open(os.path.join(out, fmt.INDEX_NAME), "rb").read() == index
    GDSDataset(out).__getitems__(range(len(after)))
