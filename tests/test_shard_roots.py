"""Shards spread over several drives (``pack(shard_roots=)``, ``gdsdata pack --shard-root``): shard k
on root k mod N, a link to each in the dataset folder; the same samples and pixels as one folder;
failed, interrupted, resumed, overwritten and merged packs leave nothing behind and lose nothing."""

import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import write_photos

import gdsdata
from gdsdata.format import layout as fmt
from gdsdata.format.lock import OWNER_NAME
from gdsdata.errors import BadImageError, GdsDataError, OutputExistsError
from gdsdata.packing.packer import pack

SHARD = 40_000  # a few photos a shard: 12 photos (about 14 KB each) make several shards


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("roots_src"))
    write_photos(folder, 12, classes=2)
    return folder


def roots(tmp_path, n=2):
    return [str(tmp_path / f"drive{k}") for k in range(n)]


def shard_files(root):
    return sorted(n for n in os.listdir(root) if n.endswith(".gds"))


def remote_files(drives):
    """The files on the drives, but the name of its owner in a shard folder that holds shards (in one
    left without any, it is what is left)."""
    return sorted(os.path.join(d, f) for drive in drives if os.path.isdir(drive)
                  for d, _, files in os.walk(drive) for f in files if f != OWNER_NAME or files == [OWNER_NAME])


def spread_parts(src, tmp_path, drives, n=2):
    """``src`` packed in ``n`` parts onto ``drives``."""
    parts = [str(tmp_path / f"part{k}") for k in range(n)]
    for k, part in enumerate(parts):
        pack(src, part, workers=1, shard_size=SHARD, shard_roots=drives, num_parts=n, part=k)
    return parts


def linked(out):
    """The real paths of the shards ``out`` links to."""
    return sorted(os.path.realpath(os.path.join(out, n)) for n in shard_files(out))


def batches(out, **loader):
    ds = gdsdata.GDSDataset(out)
    return [(x.clone(), y.clone()) for x, y in gdsdata.Loader(ds, 4, seed=1, **loader)]


def interrupted_pack(src, out, drives, after, **kwargs):
    """``pack`` onto ``drives`` that Ctrl-C stops after ``after`` images."""
    seen = []

    def interrupt(n):
        seen.extend([1] * n)  # (called with 0 as the images start)
        if len(seen) == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, on_progress=interrupt, **kwargs)


def killed_pack(src, out, drives, after, **kwargs):
    """``pack`` onto ``drives`` in a process SIGKILLed after ``after`` images."""
    import signal
    import subprocess
    import sys

    script = (f"import os, signal, sys; sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r})\n"
              f"from gdsdata.packing.packer import pack\n"
              f"seen = []\n"
              f"def progress(n):\n"
              f"    seen.extend([1] * n)\n"
              f"    if len(seen) == {after}:\n"
              f"        os.kill(os.getpid(), signal.SIGKILL)\n"
              f"pack({src!r}, {out!r}, workers=1, shard_size={SHARD}, shard_roots={drives!r}, on_progress=progress,\n"
              f"     **{kwargs!r})\n")
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == \
        -signal.SIGKILL


def test_shards_go_round_the_roots_and_read_as_one_folder(src, tmp_path):
    drives = roots(tmp_path, 3)
    plain, spread = str(tmp_path / "plain"), str(tmp_path / "spread")
    pack(src, plain, workers=1, shard_size=SHARD)
    result = pack(src, spread, workers=1, shard_size=SHARD, shard_roots=drives)
    assert result.shards >= 3
    for k, name in enumerate(shard_files(spread)):
        link = os.path.join(spread, name)
        target = os.readlink(link)
        assert os.path.islink(link) and os.path.dirname(os.path.dirname(target)) == drives[k % 3]
        assert os.path.basename(os.path.dirname(target)).startswith("spread.gdsdata-shards-")
    with open(os.path.join(spread, fmt.REPORT_NAME)) as f:
        assert json.load(f)["shard_roots"] == drives
    crop = gdsdata.RandomResizedCrop(32, seed=2)
    for (a, la), (b, lb) in zip(batches(plain, transform=crop), batches(spread, transform=crop), strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    for io_engine in ("auto", "direct"):  # the page cache and past it
        with gdsdata.settings.set(io_engine=io_engine):
            ds = gdsdata.GDSDataset(spread)
        assert torch.equal(ds[5][0], gdsdata.GDSDataset(plain)[5][0])
    from gdsdata.commands.info import info
    where = info(spread)["shard_folders"]
    assert len(where["folders"]) == 3 and sum(where["folders"].values()) == result.shards
    assert gdsdata.verify(spread) == []
    opened = gdsdata.GDSDataset(spread)
    on_drive_1 = next(i for i in range(len(opened)) if opened.index.samples["shard"][i] == 1)
    os.rename(drives[1], drives[1] + "-away")  # a drive not mounted: the error says where the link points
    target = os.readlink(os.path.join(spread, shard_files(spread)[1]))
    said = re.escape(f"a link to {target}, which is not there (its drive not mounted?)")
    with pytest.raises(gdsdata.FormatError, match=f"shard-00001.gds: shard file missing: {said}"):
        gdsdata.GDSDataset(spread)
    with pytest.raises(gdsdata.FormatError, match=f"shard-00001.gds: missing, gone since the dataset was opened: "
                                                  f"{said}"):
        opened[on_drive_1]


def test_a_failed_pack_removes_its_shards_from_every_root(tmp_path):
    from conftest import jpeg_bytes, photo

    source = tmp_path / "src"
    write_photos(str(source), 8, classes=1)
    (source / "class0" / "zz_broken.jpg").write_bytes(jpeg_bytes(photo(1))[:2000])
    drives = roots(tmp_path)
    with pytest.raises(BadImageError):
        pack(str(source), str(tmp_path / "ds"), workers=1, shard_size=SHARD, strict=True, shard_roots=drives)
    assert remote_files(drives) == [] and shard_files(tmp_path / "ds") == []


def test_an_interrupted_pack_resumes_onto_its_roots(src, tmp_path):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    interrupted_pack(src, out, drives, 9)
    kept = shard_files(out)
    assert kept and not os.path.exists(os.path.join(out, fmt.INDEX_NAME))
    assert all(os.path.exists(os.path.join(out, n)) for n in kept)  # links to finished shards
    result = pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, resume=True)
    assert result.resumed_shards == len(kept)
    assert len(remote_files(drives)) == result.shards  # nothing of the interrupted shard left over
    assert gdsdata.verify(out) == [] and len(gdsdata.GDSDataset(out)) == 12


def test_a_pack_stopped_in_its_first_shard_leaves_nothing_on_the_roots(src, tmp_path):
    """Stopped before any shard was finished: no shard folder stays on a drive (the resume packs from
    the start, under another dataset id, and would leave the first one's folder behind)."""
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    interrupted_pack(src, out, drives, 2)  # (the first image is in shard 0, being written on drive 0)
    assert shard_files(out) == [] and all(os.listdir(d) == [] for d in drives if os.path.isdir(d))
    result = pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, resume=True)
    assert result.resumed_shards == 0
    folders = sorted(os.path.join(d, f) for d in drives for f in os.listdir(d))
    assert len(folders) == len(drives) and all(len(os.listdir(f)) > 1 for f in folders)  # shards and their owner
    assert remote_files(drives) == linked(out) and gdsdata.verify(out) == []


def test_a_shard_folder_is_dropped_only_where_its_owner_name_is_all_it_holds(tmp_path, monkeypatch):
    """``drop_if_empty`` (after a stopped shard, on every abort): a folder that holds a shard keeps
    its owner's name, whichever the listing gives first (without it a ``cp -a`` copy's removal would
    take the original's shards)."""
    from gdsdata.format.lock import drop_if_empty

    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(real(path)))  # the owner's name first
    folder = tmp_path / "drive0" / "ds.gdsdata-shards-00"
    folder.mkdir(parents=True)
    (folder / OWNER_NAME).write_text("{}")
    (folder / "shard-00001.gds").write_bytes(b"x")
    drop_if_empty(str(folder))
    assert sorted(real(folder)) == [OWNER_NAME, "shard-00001.gds"]
    (folder / "shard-00001.gds").unlink()
    (folder / (OWNER_NAME + ".123.tmp")).write_text("{}")  # (one a writer killed as it named the owner left)
    drop_if_empty(str(folder))
    assert not folder.exists()


def test_appended_images_go_to_the_roots_too(tmp_path):
    source, drives, out = tmp_path / "src", roots(tmp_path), str(tmp_path / "ds")
    write_photos(str(source), 6, classes=2)
    pack(str(source), out, workers=1, shard_size=SHARD, shard_roots=drives)
    before = remote_files(drives)
    from conftest import jpeg_bytes, photo

    (source / "class0" / "extra.jpg").write_bytes(jpeg_bytes(photo(999), quality=90))
    pack(str(source), out, workers=1, shard_size=SHARD, shard_roots=drives, append=True)
    assert set(before) < set(remote_files(drives))
    assert gdsdata.verify(out) == [] and len(gdsdata.GDSDataset(out)) == 7


def test_an_overwrite_removes_the_old_shards_from_the_roots(src, tmp_path):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives)
    old = remote_files(drives)
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    new = remote_files(drives)
    assert new and not set(old) & set(new)  # every old shard gone, the new ones in their own folders
    assert gdsdata.verify(out) == []
    pack(src, out, workers=1, shard_size=SHARD, overwrite=True)  # back into one folder
    assert remote_files(drives) == [] and gdsdata.verify(out) == []


def test_an_overwrite_reads_and_lists_each_shard_folder_once_not_once_a_shard(src, tmp_path, monkeypatch):
    """Removing a dataset's shards from the roots reads each folder's owner and lists the folder (to
    remove it once empty) once: a listing a shard made the removal of thousands of shards quadratic."""
    import gdsdata.format.lock as lock

    drives, out = roots(tmp_path), str(tmp_path / "ds")
    assert pack(src, out, workers=1, shard_size=SHARD // 2, shard_roots=drives).shards >= 6
    old = remote_files(drives)
    calls = {"owner": [], "listed": []}

    def counting(key, real):
        def counted(folder, *args):
            calls[key].append(folder)
            return real(folder, *args)
        return counted

    monkeypatch.setattr(lock, "foreign_owner", counting("owner", lock.foreign_owner))
    monkeypatch.setattr(lock, "drop_if_empty", counting("listed", lock.drop_if_empty))
    pack(src, out, workers=1, shard_size=SHARD, overwrite=True)  # into one folder: the roots' shards go
    assert remote_files(drives) == [] and gdsdata.verify(out) == []
    folders = {os.path.dirname(f) for f in old}
    assert len(folders) == 2
    assert sorted(calls["owner"]) == sorted(folders) and sorted(calls["listed"]) == sorted(folders), calls


def test_parts_spread_their_shards_over_the_roots_once_merged(src, tmp_path):
    """Each part starts at a root of its own: parts of one shard each (pack --ray's) still use every
    drive once merged, where each part's first shard had gone to the first root."""
    drives = roots(tmp_path, 2)
    parts = [str(tmp_path / f"part{k}") for k in range(4)]
    for k, part in enumerate(parts):
        assert pack(src, part, workers=1, shard_roots=drives, num_parts=4, part=k).shards == 1
    merged = str(tmp_path / "merged")
    gdsdata.merge(parts, merged)
    from gdsdata.commands.info import info
    assert sorted(info(merged)["shard_folders"]["folders"].values()) == [2, 2]
    assert gdsdata.verify(merged) == []


def test_a_merge_and_its_parts_own_their_shards_apart(src, tmp_path):
    """A merge gives each part's shard a name of its own (a hard link) in the merged dataset's folders
    on the same drive: overwriting the parts leaves the merged dataset whole, overwriting the merged
    dataset leaves the parts whole, and each removes only its own names."""
    drives = roots(tmp_path)
    parts = spread_parts(src, tmp_path, drives)
    theirs = remote_files(drives)
    merged = str(tmp_path / "merged")
    assert gdsdata.merge(parts, merged)["shards_placed"] == ["hard-linked on its drive"]
    for part in parts:
        pack(src, part, workers=1, shard_size=SHARD, overwrite=True)  # into one folder: their shards go
    assert gdsdata.verify(merged) == [] and len(gdsdata.GDSDataset(merged)) == 12
    assert not set(theirs) & set(remote_files(drives))
    for k, part in enumerate(parts):
        pack(src, part, workers=1, shard_size=SHARD, shard_roots=drives, num_parts=2, part=k, overwrite=True)
    gdsdata.merge(parts, merged, overwrite=True)  # the old merged dataset's names go, the parts' stay
    pack(src, merged, workers=1, shard_size=SHARD, overwrite=True)
    assert all(gdsdata.verify(p) == [] for p in parts)
    assert [f for f in remote_files(drives) if "merged.gdsdata-shards-" in f] == []


def test_a_merge_killed_outright_leaves_nothing_on_the_drives_after_the_next_writer(src, tmp_path):
    import signal
    import subprocess
    import sys

    drives = roots(tmp_path)
    parts = spread_parts(src, tmp_path, drives)
    theirs = remote_files(drives)
    merged = str(tmp_path / "merged")
    gdsdata.merge(parts, merged)
    ours = linked(merged)
    script = (f"import os, signal, sys; sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r})\n"
              f"import gdsdata\n"
              f"link, made = os.link, []\n"
              f"def dying_link(*args, **kwargs):\n"
              f"    made.append(link(*args, **kwargs))\n"
              f"    if len(made) == 2:\n"
              f"        os.kill(os.getpid(), signal.SIGKILL)\n"
              f"os.link = dying_link\n"
              f"gdsdata.merge({parts!r}, {merged!r}, overwrite=True)\n")
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == \
        -signal.SIGKILL
    assert set(remote_files(drives)) > set(theirs) | set(ours)  # the killed merge's names on the drives
    gdsdata.merge(parts, merged, overwrite=True)
    ours = linked(merged)
    assert sorted(remote_files(drives)) == sorted(set(theirs) | set(ours))
    assert gdsdata.verify(merged) == [] and all(gdsdata.verify(p) == [] for p in parts)
    fresh = str(tmp_path / "fresh")  # killed merging into a new folder: what it left is known as a merge's
    assert subprocess.run([sys.executable, "-c", script.replace(repr(merged), repr(fresh))], capture_output=True,
                          timeout=120).returncode == -signal.SIGKILL
    with pytest.raises(gdsdata.FormatError, match="an unfinished merge: merge again with --overwrite"):
        gdsdata.GDSDataset(fresh)
    gdsdata.merge(parts, fresh, overwrite=True)
    assert sorted(remote_files(drives)) == sorted(set(theirs) | set(ours) | set(linked(fresh)))
    assert gdsdata.verify(fresh) == []


def test_bad_roots_are_refused(src, tmp_path):
    out = str(tmp_path / "ds")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="must be a folder"):
        pack(src, out, shard_roots=[str(tmp_path / "file")])
    with pytest.raises(OutputExistsError, match="outside the dataset folder"):
        pack(src, out, shard_roots=[os.path.join(out, "inner")])
    with pytest.raises(ValueError, match=f"{tmp_path / 'a'}: named twice as a shard root"):
        pack(src, out, shard_roots=[str(tmp_path / "a"), str(tmp_path / "a")])
    assert not os.path.exists(out) or not os.listdir(out)


def test_roots_on_one_device_are_warned_about(src, tmp_path, caplog):
    """Roots that share a file system (a drive not mounted: its mount point's folder on the root
    file system) pack as asked, with a warning that their reads do not add up."""
    roots = [str(tmp_path / "nvme0" / "gds"), str(tmp_path / "nvme1" / "gds")]  # (made: one device here)
    with caplog.at_level("WARNING", logger="gdsdata.packing.packer"):
        assert pack(src, str(tmp_path / "ds"), workers=1, shard_roots=roots).packed
    assert f"shard roots on one device: {roots[0]}, {roots[1]}; their reads do not add up" in caplog.text


def test_the_command_line_spreads_shards_and_inspect_shows_where(src, tmp_path):
    import subprocess
    import sys

    def run(*args):
        done = subprocess.run([sys.executable, "-m", "gdsdata.cli", *args], capture_output=True, text=True,
                              timeout=300)
        return done.returncode, done.stdout, done.stderr

    drives, out = roots(tmp_path), str(tmp_path / "ds")
    rc, _, err = run("pack", src, out, "-q", "--workers", "1", "--shard-size", str(SHARD), "--shard-root", drives[0],
                     "--shard-root", drives[1])
    assert rc == 0, err
    rc, printed, err = run("inspect", out)
    assert rc == 0, err
    assert "shards in 2 folder(s) on 1 device(s)" in printed and "drive0" in printed and "drive1" in printed
    assert np.all([os.path.islink(os.path.join(out, n)) for n in shard_files(out)])


def test_a_merge_named_as_its_parts_never_removes_their_shards(src, tmp_path):
    """Ownership goes by the pack's id, not the folder's name: a merged ``ds`` over parts named ``ds``
    (in other folders) leaves their shards alone when it is overwritten."""
    drives = roots(tmp_path)
    parts = [str(tmp_path / f"p{k}" / "ds") for k in range(2)]
    for k, part in enumerate(parts):
        pack(src, part, workers=1, shard_size=SHARD, shard_roots=drives, num_parts=2, part=k)
    merged = str(tmp_path / "m" / "ds")
    gdsdata.merge(parts, merged)
    pack(src, merged, workers=1, shard_size=SHARD, overwrite=True)
    gdsdata.merge(parts, merged, overwrite=True)
    assert all(gdsdata.verify(p) == [] for p in parts + [merged])


def test_a_renamed_dataset_still_owns_its_shards(src, tmp_path):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives)
    renamed = str(tmp_path / "renamed")
    os.rename(out, renamed)
    assert gdsdata.verify(renamed) == []
    pack(src, renamed, workers=1, shard_size=SHARD, overwrite=True)
    assert remote_files(drives) == []


def test_a_pack_killed_in_its_first_shard_leaves_nothing_on_the_drives(src, tmp_path):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    killed_pack(src, out, drives, 2)  # the first image is in shard 0
    assert any(f.endswith(fmt.TMP_SUFFIX) for f in remote_files(drives))  # killed inside shard 0
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, resume=True)
    assert gdsdata.verify(out) == []
    assert remote_files(drives) == linked(out)


def test_a_ray_merge_that_fails_leaves_nothing_on_the_drives(src, tmp_path, monkeypatch):
    from gdsdata.format.lock import remove_dataset
    from gdsdata.packing import merge
    from gdsdata.packing.packer import dataset_owner

    drives = roots(tmp_path)
    parts = [str(tmp_path / "parts" / f"part-{k}") for k in range(2)]
    for k, part in enumerate(parts):
        pack(src, part, workers=1, shard_size=SHARD, shard_roots=drives, num_parts=2, part=k)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge.index_io, "write", full)
    with pytest.raises(OSError):
        merge.merge_checked(parts, str(tmp_path / "ds"), adopt=True)
    for part in parts:  # as pack --ray removes its parts
        remove_dataset(part, dataset_owner(part))
    assert remote_files(drives) == [] and not os.path.exists(tmp_path / "ds")


def test_roots_inside_the_source_or_through_a_link_into_out_are_refused(src, tmp_path):
    out = str(tmp_path / "ds")
    with pytest.raises(OutputExistsError, match="inside the source folder"):
        pack(src, out, shard_roots=[os.path.join(src, "drive")])
    os.makedirs(os.path.join(out, "inner"))
    os.symlink(os.path.join(out, "inner"), tmp_path / "alias")
    with pytest.raises(OutputExistsError, match="outside the dataset folder"):
        pack(src, str(tmp_path / "ds"), shard_roots=[str(tmp_path / "alias")], overwrite=True)
    assert not os.path.exists(os.path.join(src, "drive"))


def test_merging_a_dataset_over_the_one_it_came_from_keeps_both(src, tmp_path):
    drives = roots(tmp_path)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    pack(src, x, workers=1, shard_size=SHARD, shard_roots=drives)
    os.symlink(x, tmp_path / "alias")
    with pytest.raises(gdsdata.errors.SourceError, match="merged into itself"):
        gdsdata.merge([str(tmp_path / "alias")], x, overwrite=True)
    gdsdata.merge([x], y)
    gdsdata.merge([y], x, overwrite=True)
    assert gdsdata.verify(x) == [] and gdsdata.verify(y) == []


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_overwrite_that_fails_at_its_index_leaves_the_drives_as_they_were(src, tmp_path, monkeypatch, failure):
    from gdsdata.format import index as index_io

    drives, out = roots(tmp_path), str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives)
    before = remote_files(drives)
    real = index_io.write

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(index_io, "write", fail)
    with pytest.raises(type(failure)):
        pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    monkeypatch.setattr(index_io, "write", real)
    assert remote_files(drives) == before and gdsdata.verify(out) == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ds.gdsdata-new")]


def test_a_resume_whose_first_shard_is_damaged_removes_the_interrupted_packs_shards(src, tmp_path):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    interrupted_pack(src, out, drives, 10)
    first = os.path.realpath(os.path.join(out, "shard-00000.gds"))
    with open(first, "r+b") as f:  # shard 0 no longer matches its journal: nothing can be kept
        f.seek(5000)
        f.write(b"\xff" * 16)
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, resume=True)
    assert gdsdata.verify(out) == []
    assert remote_files(drives) == linked(out)


def test_a_killed_overwrite_leaves_the_dataset_whole_and_the_next_writer_clears_what_it_left(src, tmp_path,
                                                                                            caplog):
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives)
    crop = gdsdata.RandomResizedCrop(32, seed=3, dtype="uint8")
    before = batches(out, transform=crop)
    killed_pack(src, out, drives, 9, overwrite=True)
    assert gdsdata.verify(out) == []  # the old dataset, untouched
    left = [n for n in os.listdir(tmp_path) if n.startswith(".ds.gdsdata-new-")]
    assert len(left) == 1
    assert remote_files(drives) != linked(out)  # the killed pack's shards on the drives
    with caplog.at_level("WARNING", logger="gdsdata.format.lock"):
        pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    assert any(left[0] in r.getMessage() and "removed, with its shards on other drives" in r.getMessage()
               for r in caplog.records)
    assert gdsdata.verify(out) == []
    assert not [n for n in os.listdir(tmp_path) if ".gdsdata-new-" in n]
    assert remote_files(drives) == linked(out)  # nothing of the killed pack, nothing of the replaced dataset
    for (x, y), (x2, y2) in zip(before, batches(out, transform=crop), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_link_to_a_dataset_is_overwritten_where_it_points(src, tmp_path):
    drives, real = roots(tmp_path), str(tmp_path / "real")
    pack(src, real, workers=1, shard_size=SHARD, shard_roots=drives)
    os.symlink(real, tmp_path / "alias")
    pack(src, str(tmp_path / "alias"), workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    assert os.path.islink(tmp_path / "alias") and gdsdata.verify(str(tmp_path / "alias")) == []
    assert remote_files(drives) == linked(real)


def test_a_copy_of_the_folder_overwritten_or_removed_leaves_the_shards_of_the_dataset_it_copied(src, tmp_path,
                                                                                                  caplog):
    """``cp -a`` copies the links, not the shards: overwriting the copy (the same dataset id, links to
    the same shards) removed the original's shards; they stay, with a warning naming their owner. A
    renamed dataset still owns its own."""
    import shutil

    from gdsdata.format.lock import remove_dataset
    from gdsdata.format import index as index_io

    drives, original = roots(tmp_path), str(tmp_path / "ds")
    pack(src, original, workers=1, shard_size=SHARD, shard_roots=drives)
    copy = str(tmp_path / "elsewhere" / "ds")  # the same name in another folder: the same shard folders
    shutil.copytree(original, copy, symlinks=True)
    other = tmp_path / "other"
    write_photos(str(other), 6, classes=2, start_seed=4400)
    with caplog.at_level("WARNING", logger="gdsdata"):
        pack(str(other), copy, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    assert gdsdata.verify(original) == [] and gdsdata.verify(copy) == []
    said = [r.getMessage() for r in caplog.records if "left in place" in r.getMessage()]
    assert len(said) == len(drives) and all(f"are those of {original}, which " in m for m in said), said
    assert sorted(remote_files(drives)) == sorted(linked(original) + linked(copy))
    backup = str(tmp_path / "backup" / "ds")  # a copy appended to: its shards would be named as the original's
    shutil.copytree(original, backup, symlinks=True)
    more = tmp_path / "more"
    write_photos(str(more), 3, classes=1, start_seed=4500)
    os.rename(more / "class0", more / "fresh")
    with pytest.raises(GdsDataError, match=re.escape(f"{backup}: a copy of the dataset {original} (cp -a: its links "
                                                     f"lead to that dataset's shards in ")):
        pack(str(more), backup, workers=1, shard_size=SHARD, shard_roots=drives, append=True)
    assert gdsdata.verify(original) == [] and gdsdata.verify(backup) == []
    pack(str(more), original, workers=1, shard_size=SHARD, shard_roots=drives, append=True)
    assert gdsdata.verify(original) == []
    second = str(tmp_path / "second")  # a copy removed, as the next writer removes a killed writer's folders
    shutil.copytree(original, second, symlinks=True)
    remove_dataset(second, index_io.header_id(second))
    assert gdsdata.verify(original) == []
    os.rename(original, tmp_path / "renamed")  # the owner renamed: still the owner
    pack(str(other), str(tmp_path / "renamed"), workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    assert sorted(remote_files(drives)) == sorted(linked(str(tmp_path / "renamed")) + linked(copy))
    moved = str(tmp_path / "moved" / "elsewhere")  # moved as mv moves it to another filesystem: copied, then removed
    shutil.copytree(str(tmp_path / "renamed"), moved, symlinks=True)
    shutil.rmtree(tmp_path / "renamed")
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdsdata"):
        pack(src, moved, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)
    assert sorted(remote_files(drives)) == sorted(linked(moved) + linked(copy)) and "left in place" not in caplog.text


def test_a_dataset_id_ending_in_a_zero_byte_still_owns_its_shards(src, tmp_path, monkeypatch):
    """numpy reads a 16-byte id field without its trailing zero bytes: one id in 256 ends in one, and
    its shards on other drives must still be found as its own (overwrite and removal take them)."""
    from gdsdata.format import index as index_io

    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: real(n - 1) + b"\0" if n == 16 else real(n))
    drives, out = roots(tmp_path), str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives)
    first = index_io.load(out).dataset_id
    assert len(first) == 16 and first.endswith(b"\0") and gdsdata.verify(out) == []
    pack(src, out, workers=1, shard_size=SHARD, shard_roots=drives, overwrite=True)  # the first one's shards go
    assert index_io.load(out).dataset_id != first and gdsdata.verify(out) == []
    assert remote_files(drives) == linked(out)


def test_what_an_id_ending_in_a_zero_byte_left_before_it_was_read_whole_is_still_its_own(src, tmp_path, monkeypatch):
    """Before ids were read whole, such a dataset's id lost its zero bytes: Loader states saved then
    carry a fingerprint of the short id, and an append then put shards in a folder named for it."""
    import hashlib

    from gdsdata.format.lock import SHARDS_TAG, owned_target

    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: real(n - 3) + b"\1\0\0" if n == 16 else real(n))  # two zeros
    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=SHARD)
    ds = gdsdata.GDSDataset(out)
    short = ds.index.dataset_id.rstrip(b"\0")
    assert len(short) == 14
    loader = gdsdata.Loader(ds, 4, seed=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    old = hashlib.blake2b(f"{short.hex()}-{ds.index.body_crc32:08x}".encode(), digest_size=16).hexdigest()
    assert state["dataset"] != old
    resumed = gdsdata.Loader(gdsdata.GDSDataset(out), 4, seed=1)
    resumed.load_state_dict({**state, "dataset": old})  # a state saved before the fix resumes
    assert len(list(resumed)) == len(list(gdsdata.Loader(ds, 4, seed=1))) - 1
    folder = tmp_path / "drive0" / f"ds{SHARDS_TAG}{short.hex()}"  # a folder named for the short id
    folder.mkdir(parents=True)
    (folder / "shard-00009.gds").write_bytes(b"x")
    os.symlink(str(folder / "shard-00009.gds"), str(tmp_path / "link.gds"))
    assert owned_target(str(tmp_path / "link.gds"), ds.index.dataset_id) == str(folder / "shard-00009.gds")
    assert owned_target(str(tmp_path / "link.gds"), real(16)) is None
