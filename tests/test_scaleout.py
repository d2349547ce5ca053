"""Packing at scale: parts and merge, resume after SIGKILL, LMDB and tar sources."""

import io
import json
import os
import pathlib
import random
import re
import shutil
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
from gdsdata.errors import BusyError, FormatError, OutputExistsError, SourceError
from gdsdata.packing.merge import merge
from gdsdata.packing.packer import pack
from gdsdata.packing.prepare import PackOptions
from gdsdata.commands.verify import verify

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
    # its pack_report.json is the whole pack's: the files left out, their reasons, the counts
    report = json.loads(pathlib.Path(summary["report_path"]).read_text())
    single = json.loads(pathlib.Path(whole, "pack_report.json").read_text())
    for key in ("source", "skipped", "ignored", "unreadable", "special", "repaired", "status", "classes", "packed",
                "converted", "resized", "empty_classes"):
        assert report[key] == single[key], key
    assert (report["shards"], report["bytes"]) == (len(ds.index.shards), int(ds.index.shards["size"].sum()))
    assert report["merge"]["parts"] == 4 and len(report["merge"]["seconds_of_parts"]) == 4
    assert summary["report_path"] == os.path.join(merged, "pack_report.json")
    # so an append to it counts under --max-skipped only what it leaves out itself (was: the parts' again)
    more = tmp_path / "more"
    shutil.copytree(source, more)
    for k in range(2):
        (more / "class0" / f"new_{k}.jpg").write_bytes(jpeg_bytes(photo(990 + k, label=0), quality=90))
    assert pack(str(more), merged, append=True, workers=1, max_skipped=0).new == 2
    # a merge of whole datasets writes none (their reports are of other packs)
    assert merge([whole], str(tmp_path / "one"))["report_path"] is None
    assert not os.path.exists(tmp_path / "one" / "pack_report.json")


def test_merge_refuses_parts_of_different_sources(whole, tmp_path):
    other = str(tmp_path / "other_src")
    write_photos(other, 4, classes=2)
    part = str(tmp_path / "other")
    pack(other, part, workers=1)
    with pytest.raises(SourceError, match="class list differs"):
        merge([whole, part], str(tmp_path / "m"))


def test_merge_joins_parts_of_other_shard_sizes_but_not_of_other_storage(source, whole, tmp_path):
    """Parts packed with other shard sizes (or pixel limits) hold the same samples: merged; a part
    whose images were stored otherwise (another quality) is refused, naming that option alone."""
    from gdsdata.packing.prepare import PackOptions

    parts = [str(tmp_path / f"p{k}") for k in range(3)]
    pack(source, parts[0], workers=1, num_parts=2, part=0, shard_size=SHARD)
    pack(source, parts[1], workers=1, num_parts=2, part=1, shard_size=2 * SHARD,
         options=PackOptions(max_pixels=10**9))
    pack(source, parts[2], workers=1, num_parts=2, part=1, shard_size=SHARD, options=PackOptions(quality=80))
    merged = merge(parts[:2], str(tmp_path / "m"))["out"]
    assert samples_of(merged) == samples_of(whole)
    with pytest.raises(SourceError, match=r"p2: packed with other options than .*p0 \(quality 80 against 95\); "):
        merge([parts[0], parts[2]], str(tmp_path / "m2"))


def test_merge_takes_each_dataset_once(source, whole, tmp_path, capsys):
    """The same folder twice (under any name), a copy (the same dataset id) or a dataset holding
    another's shards (merged from it) would give samples twice: one line naming both arguments."""
    from gdsdata.cli import main

    out = str(tmp_path / "m")
    alias = str(tmp_path / "alias")
    os.symlink(whole, alias)
    copy = str(tmp_path / "copy")
    shutil.copytree(whole, copy)
    for parts, said in (([whole, whole], f"{whole}: given twice;"),
                        ([whole, alias], f"{alias}: given twice (as {whole}: the same folder)"),
                        ([whole, copy], f"{copy}: the same dataset as {whole} (a copy")):
        with pytest.raises(SourceError, match=re.escape(said)):
            merge(parts, out)
        assert main(["merge", *parts, out, "-q"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err
        assert not os.path.exists(out)
    halves = [str(tmp_path / f"half{k}") for k in range(2)]
    for k, half in enumerate(halves):
        pack(source, half, workers=1, shard_size=SHARD, num_parts=2, part=k)
    both = str(tmp_path / "both")
    merge(halves, both)
    with pytest.raises(SourceError, match=re.escape(f"{halves[0]}: its shard-00000.gds is a shard {both} holds")):
        merge([both, halves[0]], out)


def test_merge_of_two_packs_of_one_source_says_their_files_come_twice(source, whole, tmp_path, caplog):
    """Two whole packs of one source (not a copy: their own ids), or a pack and an append of it, hold
    the same samples: merged, each of them twice, which a warning says (repeats may be meant: not
    refused); parts of one pack do not."""
    again = str(tmp_path / "again")
    pack(source, again, workers=1, shard_size=SHARD)
    with caplog.at_level("WARNING", logger="gdsdata"):
        merge([whole, again], str(tmp_path / "m"))
    said = [r.getMessage() for r in caplog.records if "the same samples" in r.getMessage()]
    assert said == [f"{whole} and {again} hold {len(index_io.load(whole))} of the same samples (the same file paths "
                    f"and stored bytes): the merged dataset holds each of them twice"]
    assert len(index_io.load(str(tmp_path / "m"))) == 2 * len(index_io.load(whole))
    caplog.clear()
    halves = [str(tmp_path / f"half{k}") for k in range(2)]
    for k, half in enumerate(halves):
        pack(source, half, workers=1, shard_size=SHARD, num_parts=2, part=k)
    with caplog.at_level("WARNING", logger="gdsdata"):
        merge(halves, str(tmp_path / "parts"))
    assert not [r for r in caplog.records if "the same samples" in r.getMessage()]
    caplog.clear()
    first = str(tmp_path / "first")  # a pack of one half, then the other appended: it holds half 1's files too
    extra = tmp_path / "extra"
    write_photos(str(extra), 4, classes=2, start_seed=900)
    pack(str(extra), first, workers=1, shard_size=SHARD)
    pack(source, first, workers=1, shard_size=SHARD, append=True)
    with caplog.at_level("WARNING", logger="gdsdata"):
        merge([first, whole], str(tmp_path / "appended"))
    said = [r.getMessage() for r in caplog.records if "the same samples" in r.getMessage()]
    assert said == [f"{first} and {whole} hold {len(index_io.load(whole))} of the same samples (the same file paths "
                    f"and stored bytes): the merged dataset holds each of them twice"]


def test_merge_of_datasets_holding_other_images_under_the_same_paths_says_so(tmp_path, caplog):
    """Two sources named alike (class0/00000.jpg in each, other pictures): merged, a path no longer
    names one image, which a warning says apart from the samples they share outright."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_photos(str(a), 6, classes=2, start_seed=100)
    shutil.copytree(a, b)
    for seed, name in enumerate(("class0/00000.jpg", "class1/00003.jpg")):  # two pictures replaced, four the same
        (b / name).write_bytes(jpeg_bytes(photo(700 + seed), quality=90))
    packs = [str(tmp_path / "a.gds"), str(tmp_path / "b.gds")]
    for src, out in zip((a, b), packs):
        pack(str(src), out, workers=1, shard_size=SHARD)

    def warned(parts, same, named):
        caplog.clear()
        with caplog.at_level("WARNING", logger="gdsdata"):
            merge(parts, str(tmp_path / f"merged-{len(os.listdir(tmp_path))}"))
        assert sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING") == [
            f"{parts[0]} and {parts[1]} hold {same} of the same samples (the same file paths and stored bytes): the "
            f"merged dataset holds each of them twice",
            f"{parts[0]} and {parts[1]} hold other images under {named} of the same file paths: in the merged "
            f"dataset such a path (ds.source(i), pack_report.json) names two images"]

    warned(packs, 4, 2)
    # datasets that hold a path twice themselves (merges): a path is counted where the images under it differ
    twice = [str(tmp_path / name) for name in ("aa", "ab")]
    merge([str(pack(str(a), str(tmp_path / f"{n}.gds"), workers=1).out) for n in ("a1", "a2")], twice[0])
    merge([str(pack(str(src), str(tmp_path / f"{n}.gds"), workers=1).out) for n, src in (("b1", a), ("b2", b))],
          twice[1])
    warned(twice, 6, 2)


@pytest.fixture
def halves(source, tmp_path):
    """A source packed in two parts, and the command that packs part 1 again (--overwrite)."""
    parts = [str(tmp_path / f"part{k}") for k in range(2)]
    for k, part in enumerate(parts):
        pack(source, part, workers=1, shard_size=SHARD, num_parts=2, part=k)
    return parts, lambda: pack(source, parts[1], workers=1, shard_size=SHARD, num_parts=2, part=1, overwrite=True)


def _when_loaded(monkeypatch, part, action):
    """Run ``action`` right after the merge has read ``part``'s index."""
    from gdsdata.packing import merge as merging

    load = merging.index_io.load

    def load_then_act(root, **options):
        index = load(root, **options)
        if os.fspath(root) == part:
            action()
        return index

    monkeypatch.setattr(merging.index_io, "load", load_then_act)


def test_a_part_cannot_be_packed_again_while_a_merge_reads_it(halves, tmp_path, monkeypatch):
    from gdsdata.format.lock import writer_lock

    parts, overwrite = halves
    out = str(tmp_path / "m")
    refused = []

    def try_overwrite():
        with pytest.raises(BusyError, match=re.escape(f"{parts[1]}: a gdsdata merge is reading it (the latest to "
                                                     f"start: merge into {out} (pid")) as e:
            overwrite()
        refused.append(str(e.value))

    _when_loaded(monkeypatch, parts[1], try_overwrite)
    assert merge(parts, out)["samples"] == 40 and refused
    assert "wait for the merges reading it to finish" in refused[0]
    assert verify(out) == [] and len(GDSDataset(out)) == 40
    assert sorted(os.listdir(tmp_path)) == ["m", "part0", "part1"]  # the parts' lock files went with the merge
    monkeypatch.undo()
    overwrite()  # free again once the merge is done
    with writer_lock(parts[0], "pack of somewhere"):  # a part being written: the merge stops at once, naming it
        with pytest.raises(BusyError, match=re.escape(f"{parts[0]}: a gdsdata pack of somewhere (pid")):
            merge(parts, str(tmp_path / "m2"), overwrite=True)
    assert not os.path.exists(tmp_path / "m2")


def test_a_part_given_through_a_link_is_locked_under_its_own_name(halves, tmp_path, monkeypatch):
    """The lock lives beside the dataset itself: a merge given a part by a symbolic link keeps the
    writer of the part's real folder off it as one given the folder does."""
    parts, overwrite = halves
    link = str(tmp_path / "link")
    os.symlink(parts[1], link)
    refused = []

    def try_overwrite():
        with pytest.raises(BusyError, match=re.escape(f"{parts[1]}: a gdsdata merge is reading it")) as e:
            overwrite()
        refused.append(str(e.value))

    _when_loaded(monkeypatch, link, try_overwrite)
    assert merge([parts[0], link], str(tmp_path / "m"))["samples"] == 40 and refused
    assert verify(str(tmp_path / "m")) == []


def test_resume_of_a_pack_begun_by_an_earlier_version_says_so(bigger, tmp_path):
    """Journals without the listing's digest (gdsdata before 2026-12-05) cannot show that the listing
    is the same: refused, saying why, not blamed on other sources or options."""
    import json

    out = str(tmp_path / "ds")
    proc = subprocess.Popen(_pack_cmd(bigger[0], out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_journals(out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if os.path.exists(os.path.join(out, fmt.INDEX_NAME)):
        pytest.skip("the pack finished before it was killed")
    for name in os.listdir(out):
        if name.endswith(fmt.JOURNAL_SUFFIX):
            with open(os.path.join(out, name)) as f:
                journal = json.load(f)
            del journal["signature"]["listing"]
            journal["signature"]["ends"] = ["class0/a.jpg", "class3/z.jpg"]
            with open(os.path.join(out, name), "w") as f:
                json.dump(journal, f)
    with pytest.raises(SourceError, match="begun by an earlier gdsdata.*pack again with --overwrite"):
        pack(bigger[0], out, resume=True, shard_size=SHARD)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_a_part_rewritten_where_the_lock_does_not_reach_fails_the_merge(halves, tmp_path, monkeypatch, existing):
    """A part packed again after the merge read its index (on another host, or where flock is not
    forwarded) has other shards under the same names: the merge checks each placed shard's header
    and leaves nothing (or the dataset it was to replace, as it was) instead of a dataset no reader
    can open."""
    import contextlib

    from gdsdata.packing import merge as merging

    parts, overwrite = halves
    out = str(tmp_path / "m")
    if existing:
        merge(parts, out)
        before = index_io.load(out).dataset_id
    monkeypatch.setattr(merging, "reader_lock", lambda part, what: contextlib.nullcontext())
    _when_loaded(monkeypatch, parts[1], overwrite)
    with pytest.raises(FormatError, match=re.escape(f"{parts[1]}: shard-00000.gds is not the shard its index "
                                                    f"recorded when the merge began (shard belongs to another "
                                                    f"dataset): the part was written meanwhile; merge again")):
        merge(parts, out, overwrite=existing)
    if existing:
        assert index_io.load(out).dataset_id == before and verify(out) == []
    else:
        assert not os.path.exists(out)
    assert sorted(os.listdir(tmp_path)) == sorted(["part0", "part1"] + (["m"] if existing else []))


def test_readers_share_the_lock_and_leave_no_file(tmp_path):
    from gdsdata.format import lock

    ds = str(tmp_path / "ds")
    os.makedirs(ds)
    with lock.reader_lock(ds, "merge into a"), lock.reader_lock(ds, "merge into b"):
        assert lock.writing(ds) is None  # a reader is no writer (inspect names none)
        with pytest.raises(BusyError, match=r"is reading it \(the latest to start: merge into b \(pid"):
            with lock.writer_lock(ds, "pack of x"):
                pass
    assert os.listdir(tmp_path) == ["ds"]
    with lock.writer_lock(ds, "pack of x"):
        with pytest.raises(BusyError, match=re.escape(f"{ds}: a gdsdata pack of x (pid")):
            with lock.reader_lock(ds, "merge into a"):
                pass
    assert os.listdir(tmp_path) == ["ds"]


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


def _killed_pack(src, out, until):
    """A pack of ``src`` killed (SIGKILL) once its finished shards' journals satisfy ``until`` (a list of
    them, in shard order); None where it finished first."""
    proc = subprocess.Popen(_pack_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, journals = time.time() + 60, []
    while proc.poll() is None and time.time() < deadline:
        names = sorted(n for n in os.listdir(out) if n.endswith(fmt.JOURNAL_SUFFIX)) if os.path.isdir(out) else []
        if len(names) > len(journals):
            try:
                journals = [json.load(open(os.path.join(out, n))) for n in names]
            except ValueError:  # (one being written: read again)
                continue
            if until(journals):
                break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return None if os.path.exists(os.path.join(out, fmt.INDEX_NAME)) else journals


@pytest.mark.parametrize("change", ["rewritten", "repaired"])
def test_a_resume_packs_again_what_changed_in_the_source_since_the_interrupted_pack(tmp_path, caplog, change):
    """A file rewritten in place after the pack was stopped (same name and label, other pixels), or a
    file the pack skipped as broken then repaired: the resume keeps the finished shards before the
    first one packed from (or skipping) a changed file and packs the rest again, so the dataset equals
    an uninterrupted pack of the source as it is now, never the old pixels under the file's name."""
    from PIL import Image

    src, out = str(tmp_path / "src"), str(tmp_path / "ds")
    write_photos(src, 160, classes=4, start_seed=2000)
    broken = os.path.join(src, "class0", "zz_broken.jpg")  # (last of the first class: an early shard skips it)
    with open(broken, "wb") as f:
        f.write(b"\xff\xd8\xff nothing")
    if change == "rewritten":  # a file of the second shard, with two more finished after it
        journals = _killed_pack(src, out, lambda js: len(js) >= 3)
        if journals is None:
            pytest.skip("the pack finished before it was killed")
        shard, rel = 1, journals[1]["paths"][0]
        changed = os.path.join(src, rel)
        before = os.stat(changed)
        Image.open(changed).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(changed, quality=90)
        os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # (a coarse clock: a newer time)
    else:  # the shard that skipped the broken file, and one more finished after it
        journals = _killed_pack(src, out, lambda js: len(js) >= 2 and bool(js[-2]["skipped"]))
        if journals is None or not journals[-1]["skipped"]:
            pytest.skip("the pack finished before it was killed")
        shard, rel = next(k for k, j in enumerate(journals) if j["skipped"]), "class0/zz_broken.jpg"
        shutil.copy(os.path.join(src, "class1", "00001.jpg"), broken)
    with caplog.at_level("WARNING", logger="gdsdata"):
        pack(src, out, resume=True, shard_size=SHARD, workers=1)
    assert f"{rel}: changed since the interrupted pack read it; packing again from {fmt.shard_name(shard)} on" \
        in caplog.text
    fresh = str(tmp_path / "fresh")
    pack(src, fresh, shard_size=SHARD, workers=1)
    assert samples_of(out) == samples_of(fresh)
    assert (rel == "class0/zz_broken.jpg") == ("class0/zz_broken.jpg" in [s[0] for s in samples_of(out)[1]])


def test_a_resume_of_a_finished_or_missing_pack_is_the_pack(source, whole, tmp_path):
    """``--resume`` as a retry wrapper passes it every time: a pack that finished, resumed with its
    source and options, is left as it is (and succeeds); with others it is refused; a pack that
    never began starts from nothing."""
    index = pathlib.Path(whole, fmt.INDEX_NAME).read_bytes()
    result = pack(source, whole, resume=True, shard_size=SHARD)
    assert (result.packed, result.new, result.resumed_shards) == (40, 0, 0)
    assert result.report_path == os.path.join(whole, fmt.REPORT_NAME)
    with open(result.report_path, encoding="utf-8") as f:
        assert result.skipped == json.load(f)["skipped"] and len(result.skipped) == 1  # (said again)
    assert pathlib.Path(whole, fmt.INDEX_NAME).read_bytes() == index
    for other, said in (({"shard_size": SHARD * 2}, f"shard_size {SHARD} then, {SHARD * 2} now"),
                        ({"shard_size": SHARD, "options": PackOptions(codec="raw", raw_size=64)},
                         "codec 'jpeg' then, 'raw' now; raw_size 0 then, 64 now")):
        with pytest.raises(OutputExistsError, match=re.escape(f"already a finished dataset, which differs from this "
                                                              f"pack: {said}; nothing to resume (pack with "
                                                              f"--overwrite to replace it)")):
            pack(source, whole, resume=True, **other)
    with pytest.raises(ValueError, match="resume keeps what an interrupted pack finished, overwrite replaces it"):
        pack(source, whole, resume=True, overwrite=True, shard_size=SHARD)
    fresh = str(tmp_path / "never-begun")
    result = pack(source, fresh, resume=True, workers=2, shard_size=SHARD)
    assert result.packed == 40 and result.new == 40 and samples_of(fresh) == samples_of(whole)
    assert verify(fresh) == []


def test_a_resume_of_a_finished_detection_pack_compares_its_boxes_and_class_names(tmp_path):
    """A finished YOLO pack resumed after its labels changed is refused, not kept with stale boxes:
    an edited label file, then a renamed class."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from make_detection import generate

    generate(str(tmp_path / "src"), 6, classes=3, seed=8, val=0.0)
    data, out = str(tmp_path / "src" / "yolo" / "data.yaml"), str(tmp_path / "det")
    pack(data, out, format="yolo", workers=1)
    assert pack(data, out, format="yolo", workers=1, resume=True).finished_before
    labels = sorted((tmp_path / "src" / "yolo" / "labels" / "train").iterdir())[0]
    held, names = labels.read_text(), pathlib.Path(data).read_text()
    changed = "the source changed since (files added, removed, renamed or relabelled, or other class names or boxes)"
    labels.write_text(held.replace(" 0.", " 0.0", 1))  # a box moved
    with pytest.raises(OutputExistsError, match=re.escape(changed)):
        pack(data, out, format="yolo", workers=1, resume=True)
    labels.write_text(held)
    pathlib.Path(data).write_text(names.replace("ellipse-0", "circle-0"))  # a class renamed
    with pytest.raises(OutputExistsError, match=re.escape(changed)):
        pack(data, out, format="yolo", workers=1, resume=True)


def test_a_resume_shows_its_check_of_the_finished_shards(source, whole, tmp_path, capsys):
    """A resume reads every finished shard whole before it goes on (their CRC-32 against the
    journals): long work on a large pack, shown as a bar when progress is on."""
    out = str(tmp_path / "ds")
    seen = []

    def interrupt(n):
        seen.extend([1] * n)
        if len(seen) == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(source, out, workers=1, shard_size=SHARD, on_progress=interrupt)
    journaled = [n for n in os.listdir(out) if n.endswith(fmt.JOURNAL_SUFFIX)]
    assert journaled
    capsys.readouterr()
    result = pack(source, out, workers=1, shard_size=SHARD, resume=True, progress=True)
    err = capsys.readouterr().err
    assert "check finished shards: 100%" in err and result.resumed_shards == len(journaled)
    assert samples_of(out) == samples_of(whole)


def test_ctrl_c_as_a_shard_s_journal_is_written_leaves_what_a_resume_keeps(source, whole, tmp_path, monkeypatch):
    """Ctrl-C after a shard is in place but before its journal is: that shard cannot be resumed, so
    it goes with the interrupted pack's other leftovers, and the report counts the shards kept."""
    import json

    import gdsdata.packing.packer as packer

    real, journals = packer._write_json, []

    def cut_short(path, payload):
        if path.endswith(fmt.JOURNAL_SUFFIX):
            journals.append(path)
            if len(journals) == 3:
                raise KeyboardInterrupt
        return real(path, payload)

    monkeypatch.setattr(packer, "_write_json", cut_short)
    out = str(tmp_path / "ds")
    with pytest.raises(KeyboardInterrupt):
        pack(source, out, workers=1, shard_size=SHARD)
    monkeypatch.setattr(packer, "_write_json", real)
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".gds")] == [fmt.shard_name(0), fmt.shard_name(1)]
    assert [n for n in names if n.endswith(fmt.JOURNAL_SUFFIX)] == [fmt.shard_name(k) + fmt.JOURNAL_SUFFIX
                                                                    for k in range(2)]
    with open(os.path.join(out, fmt.REPORT_NAME)) as f:
        report = json.load(f)
    assert report["status"] == "interrupted" and report["finished_shards"] == 2
    assert pack(source, out, workers=1, shard_size=SHARD, resume=True).resumed_shards == 2
    assert samples_of(out) == samples_of(whole)


def test_resume_refuses_other_options(bigger, tmp_path):
    out = str(tmp_path / "ds")
    proc = subprocess.Popen(_pack_cmd(bigger[0], out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_journals(out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(SourceError, match=re.escape(f"the interrupted pack differs from this one: shard_size {SHARD} "
                                                    f"then, {SHARD * 2} now; resume it with its source and options")):
        pack(bigger[0], out, resume=True, shard_size=SHARD * 2)


def test_resume_refuses_a_listing_changed_between_its_ends(bigger, tmp_path):
    """The same count of files, the same first and last, one renamed in the middle: the journals'
    samples are not the first of the new listing, so going on would pack some twice and lose others."""
    src = str(tmp_path / "src")
    shutil.copytree(bigger[0], src)
    out = str(tmp_path / "ds")
    proc = subprocess.Popen(_pack_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_journals(out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if os.path.exists(os.path.join(out, fmt.INDEX_NAME)):
        pytest.skip("the pack finished before it was killed")
    middle = sorted(os.listdir(os.path.join(src, "class1")))[0]
    os.rename(os.path.join(src, "class1", middle), os.path.join(src, "class1", "renamed-" + middle))
    with pytest.raises(SourceError, match=re.escape("differs from this one: the source changed since (files added, "
                                                    "removed, renamed or relabelled, or other class names or boxes)")):
        pack(src, out, resume=True, shard_size=SHARD)


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


def write_tar(path, samples):
    """A WebDataset tar shard of (key, JPEG bytes, label) samples."""
    with tarfile.open(path, "w") as tar:
        for key, data, label in samples:
            for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def test_tar_source(tmp_path):
    shards = tmp_path / "wds"
    shards.mkdir()
    expected = []
    for t in range(2):
        samples = [(f"sample{t}{k:03d}", jpeg_bytes(photo(300 + 10 * t + k), quality=85), (t * 5 + k) % 3)
                   for k in range(5)]
        write_tar(shards / f"train-{t:04d}.tar", samples)
        expected += [(label, data) for _, data, label in samples]
    out = str(tmp_path / "ds")
    pack(str(shards), out, workers=1)
    classes, got = samples_of(out)
    assert classes == ["0", "1", "2"]
    assert sorted((g[1], g[-1]) for g in got) == sorted(expected)
    assert all(g[0].startswith("train-000") for g in got)


def test_a_damaged_tar_shard_stops_the_pack_rather_than_leave_samples_out_unseen(tmp_path):
    """tarfile lists a tar cut on a block boundary, or one with a damaged header after its first
    member, as far as it can, without a word: the pack says the shard is damaged instead of packing
    part of it (a tar.gz whose stream is damaged too)."""
    import gzip

    samples = [(f"s{k:03d}", jpeg_bytes(photo(700 + k), quality=85), k % 2) for k in range(5)]
    whole = tmp_path / "whole.tar"
    write_tar(whole, samples)
    data = whole.read_bytes()
    with tarfile.open(whole) as tar:
        third = tar.getmembers()[4].offset  # the header of the third sample's image
    cut, broken = tmp_path / "cut", tmp_path / "broken"
    cut.mkdir(), broken.mkdir()
    (cut / "a.tar").write_bytes(data[:third])  # cut on a block boundary
    (broken / "a.tar").write_bytes(data[:third] + b"\x13" * 512 + data[third + 512:])  # a header damaged
    said = {}
    for folder in (cut, broken):
        with pytest.raises(SourceError) as e:
            pack(str(folder), str(tmp_path / f"ds-{folder.name}"), workers=1)
        said[folder.name] = str(e.value)
    assert said["cut"] == (f"{cut / 'a.tar'}: a damaged tar file: the file ends without tar's end-of-archive blocks "
                           f"(cut short, or written without them) after s001.cls (byte {third}); 4 member(s) before it "
                           f"are readable, the rest is not: packing it would leave samples out unseen")
    assert said["broken"].startswith(f"{broken / 'a.tar'}: a damaged tar file: bytes that are no tar header after "
                                     f"s001.cls (byte {third})")
    packed = gzip.compress(data)
    middle = len(packed) // 2
    gz = tmp_path / "gz"
    gz.mkdir()
    (gz / "a.tar.gz").write_bytes(packed[:middle] + bytes(b ^ 0x5A for b in packed[middle:middle + 200]) +
                                  packed[middle + 200:])
    with pytest.raises(SourceError, match=re.escape(str(gz / "a.tar.gz")) + ": (a damaged tar file|not a readable "
                                                                           "tar file)"):
        pack(str(gz), str(tmp_path / "ds-gz"), workers=1)
    pack(str(whole), str(tmp_path / "ds"), workers=1)  # (the whole one packs)
    junk = tmp_path / "junk"  # garbage after the end blocks, as some writers leave: ignored, as GNU tar does
    junk.mkdir()
    (junk / "a.tar").write_bytes(data + bytes(range(256)) * 4)
    assert pack(str(junk), str(tmp_path / "ds-junk"), workers=1).packed == 5
    joined = tmp_path / "joined"  # two tars joined with cat: tar (and tarfile) read the first only
    joined.mkdir()
    (joined / "a.tar").write_bytes(data + data)
    with pytest.raises(SourceError, match="another archive after its end-of-archive blocks"):
        pack(str(joined), str(tmp_path / "ds-joined"), workers=1)
    os.mkfifo(cut / "b.tar")  # a FIFO named as a shard beside a whole one: left out unopened, with the reason
    (cut / "a.tar").write_bytes(data)
    result = pack(str(cut), str(tmp_path / "ds-fifo"), workers=1)
    assert result.packed == 5 and result.special == [
        {"path": "b.tar", "reason": "named as a tar shard but not a regular file: skipped unopened"}]


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
    index = pathlib.Path(os.path.join(out, fmt.INDEX_NAME)).read_bytes()
    with pytest.raises(SourceError, match=r"already holds a different image under class0/.*--overwrite"):
        pack(str(other), out, workers=1, shard_size=SHARD, append=True)
    assert pathlib.Path(os.path.join(out, fmt.INDEX_NAME)).read_bytes() == index  # untouched


def test_an_append_from_tar_shards_keeps_their_label_numbers(tmp_path):
    """Labels 0..9 sort as names too ("0" < ... < "9"): appending labels 10 and 11 must not sort
    "10" before "2" (a tar's labels are its own numbers, not folder names)."""
    shards = tmp_path / "wds"
    shards.mkdir()
    write_tar(shards / "a.tar", [(f"s{k}", jpeg_bytes(photo(400 + k), quality=85), k) for k in range(9)])
    out = str(tmp_path / "ds")
    pack(str(shards), out, workers=1)
    before = samples_of(out)
    write_tar(shards / "b.tar", [(f"t{k}", jpeg_bytes(photo(420 + k), quality=85), k) for k in (2, 9, 10)])
    result = pack(str(shards), out, workers=1, append=True)
    classes, after = samples_of(out)
    assert classes == [str(k) for k in range(11)] and result.relabeled == []  # (not "10" before "9" either)
    assert after[:9] == before[1]
    assert {s[0]: s[1] for s in after[9:]} == {"b.tar/t2.jpg": 2, "b.tar/t9.jpg": 9, "b.tar/t10.jpg": 10}


def test_an_append_to_a_merge_that_holds_a_path_twice(tmp_path):
    """Two datasets of the same file names merged hold each path twice; an append of either source
    compares each file with any sample of its path."""
    one, two = tmp_path / "one", tmp_path / "two"
    write_photos(str(one), 4, classes=2, start_seed=500)
    write_photos(str(two), 4, classes=2, start_seed=600)
    parts = [str(tmp_path / "d1"), str(tmp_path / "d2")]
    pack(str(one), parts[0], workers=1)
    pack(str(two), parts[1], workers=1)
    out = str(tmp_path / "merged")
    merge(parts, out)
    (one / "class0" / "new.jpg").write_bytes(jpeg_bytes(photo(700), quality=85))
    assert pack(str(one), out, workers=1, append=True).new == 1
    assert pack(str(two), out, workers=1, append=True).new == 0


def test_a_part_of_bad_files_only_is_an_empty_part_and_the_merge_takes_the_rest(tmp_path):
    """As one pack skips bad files, so do parts: a part whose files all fail packs empty (its report
    lists them) rather than failing, which would leave a --ray job or a merge without it."""
    src = tmp_path / "src"
    paths = write_photos(str(src), 6, classes=2, start_seed=20)
    for rel in paths[3:]:  # the second half: part 1
        (src / rel).write_bytes(b"\xff\xd8 not a JPEG")
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    results = [pack(str(src), part, num_parts=2, part=k, workers=1) for k, part in enumerate(parts)]
    assert [(r.packed, r.shards, len(r.skipped)) for r in results] == [(3, 1, 0), (0, 0, 3)]
    out = str(tmp_path / "merged")
    assert merge(parts, out)["samples"] == 3
    reference = str(tmp_path / "whole")
    pack(str(src), reference, workers=1)
    assert samples_of(out)[1] == samples_of(reference)[1]


def test_parts_of_bad_files_only_merge_into_nothing_but_an_error(tmp_path):
    src = tmp_path / "src"
    for rel in write_photos(str(src), 4, classes=2, start_seed=30):
        (src / rel).write_bytes(b"\xff\xd8 not a JPEG")
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    for k, part in enumerate(parts):
        pack(str(src), part, num_parts=2, part=k, workers=1)
    with pytest.raises(SourceError, match=r"none of the 2 parts holds an image: every file failed to decode \(class"):
        merge(parts, str(tmp_path / "m"))
    assert not os.path.exists(tmp_path / "m")


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
    index = pathlib.Path(os.path.join(out, fmt.INDEX_NAME)).read_bytes()
    again = pack(str(src), out, workers=1, shard_size=SHARD, append=True)  # up to date: nothing written
    assert (again.new, again.packed, again.shards) == (0, len(after), result.shards)
    assert pathlib.Path(os.path.join(out, fmt.INDEX_NAME)).read_bytes() == index
    GDSDataset(out).__getitems__(range(len(after)))
