"""The packing sources on hostile or unusual input: LMDB keys and values, tar shards, fsspec URLs.
Each case packs what it can and names what it cannot, in one line, before anything is written."""

import io
import os
import pickle
import socket
import subprocess
import sys
import tarfile
from contextlib import contextmanager

import pytest
from conftest import child_env, jpeg_bytes, photo, png_bytes

from gdsdata.cli import main as cli
from gdsdata.errors import BadImageError, SourceError
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


# --- labels without class names -----------------------------------------------------------------
def write_tar(path, members):
    """A tar of ``members`` (name -> bytes, or (name, bytes) pairs: a name may repeat), in that order."""
    with tarfile.open(path, "w") as tar:
        for name, payload in (members.items() if isinstance(members, dict) else members):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return str(path)


@pytest.mark.parametrize("label", [-1, 2**20, 300_000_000, 4_000_000_000])
def test_a_tar_label_outside_the_unnamed_range_is_refused_before_anything_is_written(tmp_path, label):
    image = jpeg_bytes(photo(3))
    shard = write_tar(tmp_path / "train-0.tar", {"a.jpg": image, "a.cls": b"1", "b.jpg": image,
                                                 "b.cls": str(label).encode()})
    out = tmp_path / "ds"
    with pytest.raises(SourceError) as caught:
        pack(shard, str(out), workers=1)
    message = str(caught.value)
    assert message.startswith(f"{shard}: train-0.tar/b.cls: label {label}") and "\n" not in message
    assert ("negative" if label < 0 else "beyond 1048575") in message
    assert not out.exists()  # refused while listing: no shard, no journal


def test_an_lmdb_label_outside_the_unnamed_range_is_refused_and_names_let_it_be(tmp_path):
    image = jpeg_bytes(photo(4))
    db = write_lmdb(str(tmp_path / "huge.lmdb"), {b"0": (image, 0), b"1": (image, 300_000_000)})
    with pytest.raises(SourceError, match=r"huge.lmdb: key 1: label 300000000 is beyond 1048575, .*__classes__"):
        open_source(db)
    db = write_lmdb(str(tmp_path / "negative.lmdb"), {b"0": (image, 0), b"1": (image, -3)})
    with pytest.raises(SourceError, match=r"negative.lmdb: key 1: label -3 is negative"):
        open_source(db)
    db = write_lmdb(str(tmp_path / "named.lmdb"), {b"0": (image, 0), b"1": (image, 3)}, classes=["a", "b"])
    with pytest.raises(SourceError, match=r"named.lmdb: key 1 has label 3, outside the 2 classes of __classes__"):
        open_source(db)


def open_files() -> list:
    """The files this process holds open (a descriptor closed meanwhile by another thread: left out)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return names


def test_a_refused_source_leaves_no_file_open(tmp_path):
    """Tar shards opened before a later one is refused, and an LMDB whose labels are refused, are
    closed with the error, also while the error is kept (its traceback holds the half-made source:
    IPython keeps the last one): a process that goes on keeps no descriptor."""
    image = jpeg_bytes(photo(7))
    shards = tmp_path / "shards"
    shards.mkdir()
    write_tar(shards / "train-0.tar", {"a.jpg": image, "a.cls": b"0"})
    (shards / "train-1.tar").write_bytes(b"not a tar file at all" * 40)
    db = write_lmdb(str(tmp_path / "bad.lmdb"), {b"0": (image, 0), b"1": (image, -3)})
    for src, refused in ((str(shards), "train-1.tar: not a readable tar file"), (db, "label -3 is negative")):
        try:
            open_source(src)
        except SourceError as e:
            kept = e
        assert refused in str(kept)
        assert kept.__traceback__ is not None and [f for f in open_files() if str(tmp_path) in f] == [], src


def test_lmdb_values_of_another_shape_are_skipped_with_the_reason(tmp_path, capsys):
    image = jpeg_bytes(photo(5))
    db = write_lmdb(str(tmp_path / "odd.lmdb"), {b"0": (image, 0), b"1": ("notbytes", 0), b"2": (None, 1),
                                                 b"3": (5, 1)})
    result = pack(db, str(tmp_path / "ds"), workers=1)
    assert result.packed == 1
    reasons = {entry["path"]: entry["reason"] for entry in result.skipped}
    assert sorted(reasons) == ["1", "2", "3"]
    assert reasons["1"].startswith("its value holds a str where the encoded image bytes go")
    assert reasons["2"].startswith("its value holds a NoneType where")
    with pytest.raises(BadImageError, match=r"odd.lmdb/1: its value holds a str where the encoded image bytes go"):
        pack(db, str(tmp_path / "strict"), workers=1, strict=True)


def test_an_lmdb_cut_short_or_damaged_is_one_line_not_a_crash(tmp_path, capsys):
    """A data.mdb cut short (a copy that stopped) would end the pack with SIGBUS as its pages are
    read; a damaged one raised lmdb's own error: each is one line and exit status 1."""
    image = jpeg_bytes(photo(6))
    db = write_lmdb(str(tmp_path / "db.lmdb"), {str(k).encode(): (image, k % 2) for k in range(40)})
    data = os.path.join(db, "data.mdb")
    whole = open(data, "rb").read()
    with open(data, "wb") as f:
        f.write(whole[:len(whole) // 2])
    assert cli(["pack", db, str(tmp_path / "cut"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gdsdata: error: {data}: an LMDB cut short (") and len(err.strip().splitlines()) == 1, err
    with open(data, "wb") as f:  # every page past the meta pages overwritten
        f.write(whole[:8192] + bytes(range(256)) * ((len(whole) - 8192) // 256) + whole[8192 + (len(whole) - 8192)
                                                                                      // 256 * 256:])
    assert cli(["pack", db, str(tmp_path / "damaged"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gdsdata: error: {db}: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("classes, what", [(5, "an int"), (["a", 3], "a list holding an int (3)"),
                                           (["a", None], "a list holding a NoneType (None)"),
                                           (["a", "a"], "the name 'a' twice")])
def test_lmdb_class_names_that_are_not_a_list_of_names_are_refused_in_one_line(tmp_path, capsys, classes, what):
    db = write_lmdb(str(tmp_path / "names.lmdb"), {b"0": (jpeg_bytes(photo(6)), 0)}, classes=classes)
    assert cli(["pack", db, str(tmp_path / "ds"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err == (f"gdsdata: error: {db}: key __classes__ holds {what}, not a list of distinct class names "
                   f"(str); store pickle.dumps([name, ...]), a name for each label\n")


# --- tar shards ---------------------------------------------------------------------------------
def test_a_tar_sample_with_two_images_packs_one_and_names_the_other(tmp_path):
    jpg, png, mask = jpeg_bytes(photo(7)), png_bytes(photo(8)), png_bytes(photo(9))
    shard = write_tar(tmp_path / "train-0.tar", {"a.png": png, "a.jpg": jpg, "a.cls": b"0",
                                                 "b.seg.png": mask, "b.jpg": jpg, "b.cls": b"1"})
    result = pack(shard, str(tmp_path / "ds"), workers=1)
    assert result.packed == 2
    _, samples = packed(result.out)
    assert sorted(samples) == [b"train-0.tar/a.png", b"train-0.tar/b.jpg"]  # the first plain image of each
    assert samples[b"train-0.tar/b.jpg"] == (1, jpg)
    assert result.special == [
        {"path": "train-0.tar/a.jpg", "reason": "a second image of sample a (a.png is packed): skipped unopened"},
        {"path": "train-0.tar/b.seg.png", "reason": "a second image of sample b (b.jpg is packed): skipped unopened"}]


def test_a_tar_label_that_is_not_an_integer_is_named_with_the_reason(tmp_path):
    jpg = jpeg_bytes(photo(7))
    shard = write_tar(tmp_path / "train-0.tar", {"a.jpg": jpg, "a.cls": b"0", "b.jpg": jpg, "b.cls": b"dog",
                                                 "c.jpg": jpg, "c.cls": b"1_0", "d.jpg": jpg, "d.cls": b"1\n"})
    result = pack(shard, str(tmp_path / "ds"), workers=1)
    assert result.packed == 2 and result.ignored == []
    assert result.special == [  # int() reads "1_0" as 10
        {"path": "train-0.tar/b.cls", "reason": "a label that is not an integer (b'dog'): its sample skipped unopened"},
        {"path": "train-0.tar/c.cls", "reason": "a label that is not an integer (b'1_0'): its sample skipped unopened"}]
    assert packed(result.out)[1][b"train-0.tar/d.jpg"][0] == 1


def test_a_tar_sample_with_a_member_twice_is_named_not_packed(tmp_path):
    """Extracting the tar keeps the last of two .cls (or two a.jpg), WebDataset refuses the shard:
    neither is the one to trust, so the sample is left out with the reason. Suffixes are compared in
    lower case, as WebDataset's keys are."""
    jpg = jpeg_bytes(photo(7))
    shard = write_tar(tmp_path / "train-0.tar", [("a.jpg", jpg), ("a.cls", b"0"), ("b.jpg", jpg), ("b.cls", b"1"),
                                                 ("b.cls", b"2"), ("c.jpg", jpg), ("c.JPG", jpg), ("c.cls", b"1"),
                                                 ("d.jpg", jpg), ("d.CLS", b"1"), ("d", b"x"), ("d", b"y")])
    result = pack(shard, str(tmp_path / "ds"), workers=1)
    assert result.packed == 2 and result.ignored == []
    assert sorted(packed(result.out)[1]) == [b"train-0.tar/a.jpg", b"train-0.tar/d.jpg"]  # (.CLS: WebDataset's .cls)
    assert result.special == [
        {"path": "train-0.tar/b", "reason": "sample b has more than one .cls member: skipped unopened"},
        {"path": "train-0.tar/c", "reason": "sample c has more than one .jpg member: skipped unopened"}]


@pytest.mark.parametrize("name", ["train-0.tar.gz", "train-0.tgz"])
def test_a_folder_of_gzipped_tar_shards_is_a_tar_source(tmp_path, name):
    shards = tmp_path / "wds"
    shards.mkdir()
    image = jpeg_bytes(photo(10))
    with tarfile.open(shards / name, "w:gz") as tar:
        for member, payload in (("a.jpg", image), ("a.cls", b"2")):
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    result = pack(str(shards), str(tmp_path / "ds"), workers=1)
    classes, samples = packed(result.out)
    assert classes == ["0", "1", "2"] and samples == {f"{name}/a.jpg".encode(): (2, image)}


# --- fsspec URLs --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()  # a filesystem of another module's server would be reused
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="errors")  # (moto's buckets are one store per process: a name of this module's own)
    client.put_object(Bucket="errors", Key="train/a/x.jpg", Body=jpeg_bytes(photo(11)))
    yield env
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("url, reason", [
    ("s3://errors/nope", "no such folder"),
    ("s3://no-such-bucket/train", "no such folder (The specified bucket does not exist)"),
    ("s3://errors/nope.tar", "no such file or folder (The specified key does not exist.)"),
])
def test_a_missing_url_is_one_line_naming_it_and_the_reason(s3, tmp_path, capsys, url, reason):
    assert cli(["pack", url, str(tmp_path / "ds"), "-q"]) == 1
    assert capsys.readouterr().err == f"gdsdata: error: {url}: {reason}\n"


def test_an_endpoint_out_of_reach_is_one_line_naming_the_url(tmp_path):
    pytest.importorskip("s3fs")
    env = child_env(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
                    AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_MAX_ATTEMPTS="1")  # no retries: fast
    done = subprocess.run([sys.executable, "-m", "gdsdata", "pack", "s3://images/train", str(tmp_path / "ds"), "-q"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("gdsdata: error: s3://images/train: cannot reach the endpoint: ")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_an_lmdb_value_of_another_layout_is_named_with_the_reason_not_truncated(tmp_path):
    import numpy as np

    image = jpeg_bytes(photo(12))
    db = write_lmdb(str(tmp_path / "float.lmdb"), {b"1": (image, 0.9), b"2": (image, 1.5), b"3": (image, 1.0),
                                                   b"4": (image, 0), b"5": (image, np.int64(1)), b"6": (image, " 1 "),
                                                   b"7": (image, "1_0"), b"8": (image, None), b"9": [image],
                                                   b"10": (image, np.array(1.0)), b"11": (image, "+0")},
                    classes=["a", "b"])
    source = open_source(db)
    assert [(item.rel, item.label) for item in source.items] == [("3", 1), ("4", 0), ("5", 1), ("6", 1), ("10", 1),
                                                                 ("11", 0)]
    assert source.ignored == []
    assert source.special == [
        {"path": "1", "reason": "its label 0.9 is not an integer: skipped"},
        {"path": "2", "reason": "its label 1.5 is not an integer: skipped"},
        {"path": "7", "reason": "its label '1_0' is not an integer: skipped"},
        {"path": "8", "reason": "its label is a NoneType, not an integer: skipped"},
        {"path": "9", "reason": "its value unpickles to a list, not an (image bytes, label) pair: skipped"}]
    source.close()
    result = pack(db, str(tmp_path / "ds"), workers=1)
    assert result.packed == 6 and [entry["path"] for entry in result.special] == ["1", "2", "7", "8", "9"]


@contextmanager
def served(folder):
    """``folder`` over HTTP (Python's own server, which lists folders as HTML links); its URL."""
    import functools
    import http.server
    import threading

    pytest.importorskip("aiohttp")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_an_image_folder_served_over_http_packs_as_from_disk(tmp_path):
    """fsspec's HTTP filesystem lists whole URLs (an object store's listing gives bare paths)."""
    from conftest import write_photos

    src = tmp_path / "src"
    write_photos(str(src), 6, classes=2, start_seed=40)
    with served(src) as url:
        result = pack(url + "/", str(tmp_path / "web"), workers=1)
    pack(str(src), str(tmp_path / "disk"), workers=1)
    assert result.packed == 6 and packed(str(tmp_path / "web")) == packed(str(tmp_path / "disk"))


def test_a_fetched_folder_never_writes_outside_its_temporary_folder(tmp_path, monkeypatch):
    """A server's listing is the server's to write: a link that unquotes to an absolute path or
    climbs out ("%2Ftmp%2Fx", "..%2Fx") is not fetched; the folder's own files are, URL-unquoted."""
    from gdsdata.packing import sources

    got = []

    class Listing:
        protocol = ("http", "https")

        def isdir(self, path):
            return True

        def find(self, root):
            return [root, root + "/data.mdb", root + "/a%20b/lock.mdb", root + "/%2Ftmp%2Fescaped",
                    root + "/..%2F..%2Fescaped", root + "/sub/..", "http://elsewhere/x"]

        def get_file(self, name, target):
            got.append((name.rsplit("/db", 1)[-1], os.path.relpath(target, tmp_path)))

    monkeypatch.setattr(sources, "_filesystem", lambda url: (Listing(), url))
    assert sources._fetched("http://host/db", str(tmp_path)) == str(tmp_path / "db")
    assert got == [("/a%20b/lock.mdb", "db/a b/lock.mdb"), ("/data.mdb", "db/data.mdb")]


def test_a_folder_of_tar_shards_and_an_lmdb_served_over_http_pack_as_from_disk(tmp_path):
    """Both are fetched first, file by file (the server's listing names the folder itself too, and
    names are URL-quoted there)."""
    jpg = jpeg_bytes(photo(7))
    web = tmp_path / "web"
    (web / "wds").mkdir(parents=True)
    write_tar(web / "wds" / "train 0.tar", {"a.jpg": jpg, "a.cls": b"0"})
    write_tar(web / "wds" / "train-1.tar", {"b.jpg": jpg, "b.cls": b"1"})
    write_lmdb(str(web / "train.lmdb"), {b"1": (jpg, 0), b"2": (jpg, 1)})
    with served(web) as url:
        tars = pack(url + "/wds/", str(tmp_path / "tars"), workers=1)
        lmdb = pack(url + "/train.lmdb", str(tmp_path / "lmdb"), workers=1)
    assert tars.packed == 2 and packed(tars.out) == packed(pack(str(web / "wds"), str(tmp_path / "t"), workers=1).out)
    assert lmdb.packed == 2 and packed(lmdb.out) == packed(pack(str(web / "train.lmdb"), str(tmp_path / "l"),
                                                                workers=1).out)
