"""Data safety under hostile conditions: concurrent writers, decompression bombs, dead workers,
hostile source trees, bit flips, a dataset replaced under a reader, merge sets, a full disk, Ctrl-C,
corrupted states, many shards under a low descriptor limit. One test (or a few) per class of fault;
the racy ones repeat many more times under ``pytest -m heavy`` (deselected by default: run before
calling a change to them done)."""

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import child_env, jpeg_bytes, photo, write_photos

import gdsdata
from gdsdata.format import layout as fmt
from gdsdata.errors import (BusyError, CorruptSampleError, FormatError, GdsDataError, SourceError)
from gdsdata.format.index import load
from gdsdata.format.lock import OWNER_NAME
from gdsdata.packing.merge import merge
from gdsdata.packing.packer import pack
from gdsdata.commands.verify import verify

ROOT = os.path.join(os.path.dirname(__file__), "..")
HEAVY = pytest.mark.heavy


def trials(light: int, heavy: int):
    """Trial numbers: ``light`` of them in every run, up to ``heavy`` under ``-m heavy``."""
    return [*range(light), *(pytest.param(k, marks=HEAVY) for k in range(light, heavy))]


def cli(*args, env=None, timeout=300, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "gdsdata", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(**(env or {})),
                            **kwargs)


def run_cli(*args, timeout=300, **kwargs):
    process = cli(*args, **kwargs)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def one_line(err):
    """The one line a command said of what ended it (the warning that the test's shard roots share
    this machine's one file system left aside)."""
    lines = [line for line in err.strip().splitlines() if line and "shard roots on one device" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def samples_of(root):
    index = load(root)
    return sorted(index.path(i) for i in range(len(index)))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("safety_src"))
    write_photos(root, 48, classes=3, start_seed=3000)
    return root


# --- concurrent writers ---------------------------------------------------------------------
@pytest.mark.parametrize("trial", trials(3, 20))
def test_two_packs_into_one_out_never_break_the_winner(src, tmp_path, trial):
    out = str(tmp_path / "ds")
    first, second = cli("pack", src, out, "-q", "--workers", "2"), cli("pack", src, out, "-q", "--workers", "2")
    results = [(p.wait(120), *p.communicate()) for p in (first, second)]
    winners = [r for r in results if r[0] == 0]
    assert len(winners) >= 1
    for code, _, err in results:
        if code:
            line = one_line(err)
            assert "another gdsdata pack" in line or "holds a gdsdata dataset" in line
    assert samples_of(out) == sorted(os.path.relpath(os.path.join(d, f), src)
                                     for d, _, fs in os.walk(src) for f in fs)
    assert verify(out) == []


def test_a_second_writer_is_refused_naming_the_holder(src, tmp_path):
    from gdsdata.format.lock import writer_lock

    out = str(tmp_path / "ds")
    with writer_lock(out, "pack of somewhere"):
        with pytest.raises(BusyError, match=r"another gdsdata pack of somewhere \(pid \d+ on .*since"):
            pack(src, out, workers=1)
        code, _, err = run_cli("pack", src, out, "-q")
        assert code == 1 and "another gdsdata pack of somewhere" in one_line(err)
    assert not os.path.exists(out) or not os.listdir(out)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, fmt.shard_name(0) + fmt.TMP_SUFFIX), "wb").close()  # as a pack underway has it
    with writer_lock(out, "pack of somewhere"):  # inspect names the writer, not --resume or --overwrite
        code, _, err = run_cli("inspect", out)
        assert code == 1 and "a gdsdata pack of somewhere (pid" in one_line(err) and "wait for it" in err
    assert "--resume" in one_line(run_cli("inspect", out)[2])  # no writer: an unfinished pack
    pack(src, out, workers=1, overwrite=True)  # free again once the holder is done


def test_inspect_names_no_writer_that_is_itself_or_dead(src, tmp_path):
    from gdsdata.format import lock

    out = str(tmp_path / "ds")
    os.makedirs(out)
    with lock.writer_lock(out, "append of somewhere"):  # this process: not "another" writer
        assert lock.writing(out) is None
        with pytest.raises(FormatError, match="an image folder"):
            load(out)
    with open(lock._lock_path(out), "w") as f:  # what a SIGKILLed writer leaves: its pid is gone
        json.dump({"what": "pack of x", "pid": _dead_pid(), "host": __import__("socket").gethostname()}, f)
    assert lock.writing(out) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tells zombies and reused pids by /proc")
def test_inspect_names_a_writer_only_while_it_holds_the_lock(tmp_path):
    """A writer killed but not yet reaped (a zombie: a container whose first process reaps nothing)
    holds no lock, nor does a live process that started after a killed writer signed its lock file
    (the pid reused): neither is named as writing, so inspect and GDSDataset say the pack is
    unfinished."""
    from gdsdata.format import lock

    out = str(tmp_path / "ds")
    os.makedirs(out)
    open(os.path.join(out, fmt.shard_name(0) + fmt.TMP_SUFFIX), "wb").close()  # as a pack underway has it
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from gdsdata.format.lock import writer_lock
with writer_lock({out!r}, "pack of somewhere"):
    print("held", flush=True)
    time.sleep(120)
"""], stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock.writing(out).startswith(f"pack of somewhere (pid {holder.pid} on ")
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while lock._running(holder.pid) and time.monotonic() < deadline:  # (a zombie till reaped below)
            time.sleep(0.01)
        assert os.path.exists(lock._lock_path(out)) and lock.writing(out) is None
        code, _, err = run_cli("inspect", out)
        assert code == 1 and "--resume" in one_line(err) and "is writing" not in err
    finally:
        holder.kill()
        holder.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # a lock file a killed writer signed 5 minutes ago, naming a live process started since (its pid reused)
        host = __import__("socket").gethostname()
        for ago, named in ((300, False), (-5, True)):  # (signed after it started: it may be the writer)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - ago))
            with open(lock._lock_path(out), "w") as f:
                json.dump({"what": "pack of x", "pid": sleeper.pid, "host": host, "since": since}, f)
            assert (lock.writing(out) is not None) is named, (ago, lock.writing(out))
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_signals_wait_for_a_deferred_block_then_unwind(sig):
    from gdsdata.errors import Terminated
    from gdsdata.format.lock import deferred_signals

    previous = signal.signal(signal.SIGTERM, lambda number, frame: (_ for _ in ()).throw(Terminated()))
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_signals():
                os.kill(os.getpid(), sig)
                time.sleep(0.05)  # (a handler would have run by now)
                done.append(True)
        assert done == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("shard_roots", [False, True], ids=["one-folder", "shard-roots"])
def test_an_append_stopped_while_its_index_is_written_leaves_nothing_of_it(src, tmp_path, monkeypatch, shard_roots):
    import gdsdata.packing.packer as packer

    drives = [str(tmp_path / "d0"), str(tmp_path / "d1")] if shard_roots else []
    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_roots=drives)

    def files():
        return {os.path.join(d, f): open(os.path.join(d, f), "rb").read()
                for root in [out, *drives] for d, _, names in os.walk(root) for f in names}

    before = files()
    more = tmp_path / "more"
    write_photos(str(more), 30, classes=1, start_seed=6500)
    os.rename(more / "class0", more / "fresh")
    real_write = packer.index_io.write

    def interrupted(folder, *args, **kwargs):  # the index half written when Ctrl-C comes
        open(os.path.join(folder, fmt.INDEX_NAME + fmt.TMP_SUFFIX), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(packer.index_io, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(str(more), out, workers=1, append=True, shard_size=100_000, shard_roots=drives)
    assert files() == before and verify(out) == []
    monkeypatch.setattr(packer.index_io, "write", real_write)
    assert pack(str(more), out, workers=1, append=True, shard_roots=drives).new == 30 and verify(out) == []


def test_an_append_into_a_folder_made_read_only_says_its_own_error_not_its_clean_up_s(src, tmp_path, monkeypatch,
                                                                                        caplog):
    """The folder turned read-only under an append: the write that failed is what is said (with "the
    dataset there is unchanged"), not the removal of what it wrote, which fails the same way."""
    import gdsdata.format.lock as lock
    import gdsdata.packing.packer as packer

    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    more = tmp_path / "more"
    write_photos(str(more), 6, classes=1, start_seed=6600)
    os.rename(more / "class0", more / "fresh")

    def read_only(folder, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(folder, fmt.INDEX_NAME + fmt.TMP_SUFFIX))

    def removal(path, *args):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(packer.index_io, "write", read_only)
    monkeypatch.setattr(lock, "_remove_one", removal)
    with caplog.at_level("WARNING", logger="gdsdata"), pytest.raises(OSError) as raised:
        pack(str(more), out, workers=1, append=True)
    assert str(raised.value).startswith(f"[Errno {errno.EROFS}] Read-only file system while writing the index of "
                                        f"{out}; the dataset there is unchanged"), raised.value
    assert "left behind, it cannot be removed (Read-only file system)" in caplog.text


def test_ctrl_c_between_the_swaps_two_renames_waits_for_the_second(src, tmp_path, monkeypatch):
    """Where the atomic exchange is not available (NFS), an overwrite's swap is two renames: an
    interrupt between them waits, so OUT is never left without a dataset."""
    from gdsdata.format import lock

    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    monkeypatch.setattr(lock, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(a, b):
        real_rename(a, b)
        if os.path.abspath(a) == out:  # the old dataset moved aside: the new one not yet in place
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)

    monkeypatch.setattr(lock.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        pack(src, out, workers=1, overwrite=True, shard_size=200_000)
    monkeypatch.setattr(lock.os, "rename", real_rename)
    assert len(load(out)) == 48 and verify(out) == []  # the new dataset (smaller shards) in place
    assert len(load(out).shards) > 1


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.3, *(pytest.param(d, marks=HEAVY)
                                                   for d in (0.0, 0.05, 0.15, 0.25, 0.4))])
def test_an_append_stopped_by_sigterm_leaves_the_dataset_as_it_was(src, tmp_path, delay):
    more = tmp_path / "more"
    write_photos(str(more / "new"), 240, classes=2, start_seed=6000, scale=1.0)
    for k in range(2):  # classes of their own: every file new to the dataset
        os.rename(more / "new" / f"class{k}", more / "new" / f"fresh{k}")
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    held = len(load(out))
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    process = cli("pack", str(more / "new"), out, "--append", "-q", "--workers", "2", "--shard-size", "200000",
                  start_new_session=True)
    lock = tmp_path / ".ds.gdsdata-lock"
    deadline = time.monotonic() + 60
    while not lock.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    after = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    if after == before:
        assert process.returncode == 143 and one_line(err).endswith(f"{out} is as it was"), err
    else:  # it came once the append was complete
        assert len(load(out)) == held + 240 and not [n for n in after if "journal" in n or n.endswith(".tmp")]
        assert process.returncode in (0, 143, -signal.SIGTERM)
    assert verify(out) == []


def test_a_pack_stopped_before_its_first_shard_leaves_a_folder_packed_again_without_overwrite(src, tmp_path):
    out = tmp_path / "ds"
    for status in ("interrupted", "failed"):
        out.mkdir()
        (out / fmt.REPORT_NAME).write_text(json.dumps({"status": status, "finished_shards": 0}))
        code, _, err = run_cli("inspect", str(out))
        assert code == 1 and f"stopped before it wrote a shard: {fmt.REPORT_NAME} says why" in one_line(err)
        pack(src, str(out), workers=1)
        assert verify(str(out)) == []
        shutil.rmtree(out)


def test_a_folder_that_takes_no_new_files_is_named_as_such(src, tmp_path, monkeypatch):
    """Where OUT's folder refuses new files (read-only, immutable), the error names that folder, not the
    writer lock gdsdata keeps there."""
    from gdsdata.format import lock

    real_open = os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".gdsdata-lock"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lock.os, "open", refuse)
    with pytest.raises(OSError) as caught:
        pack(src, str(tmp_path / "ro" / "o.gds"), workers=1)
    assert str(caught.value) == (f"[Errno 1] cannot write in {tmp_path / 'ro'}, the folder that holds o.gds: "
                                 f"Operation not permitted") and caught.value.filename is None


@pytest.mark.parametrize("trial", trials(2, 12))
def test_two_appends_never_lose_images(src, tmp_path, trial):
    appends = []
    for tag in ("a", "b"):
        root = tmp_path / f"more-{tag}"
        for k in range(12):
            (root / f"class{k % 3}").mkdir(parents=True, exist_ok=True)
            (root / f"class{k % 3}" / f"{tag}{k:03d}.jpg").write_bytes(jpeg_bytes(photo(7000 + k + 100 * trial)))
        appends.append(str(root))
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    runs = [cli("pack", root, out, "--append", "-q", "--workers", "1") for root in appends]
    results = [(p.wait(120), *p.communicate()) for p in runs]
    held = set(samples_of(out))
    for root, (code, _, err) in zip(appends, results):
        mine = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
        if code == 0:
            assert mine <= held, "an append that exited 0 lost images"
        else:
            assert "another gdsdata append" in one_line(err)
    assert any(code == 0 for code, _, _ in results)
    assert verify(out) == []


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _left_by(out, tag, pid) -> str:
    """The folder name ``lock.aside`` gives a writer ``pid`` of this host."""
    from gdsdata.format import lock

    parent, name = os.path.split(out)
    return os.path.join(parent, f".{name}.gdsdata-{tag}-{lock._HOST}-{pid}-0123abcd")


def test_a_writer_clears_what_killed_writers_of_its_dataset_left_and_spares_live_ones(src, tmp_path, caplog):
    from gdsdata.format.lock import writer_lock

    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    dead, live = _left_by(out, "new", _dead_pid()), _left_by(out, "new", os.getpid())
    pack(src, dead, workers=1)  # a complete replacement its writer never swapped in
    parts = _left_by(out, "parts", _dead_pid())
    os.makedirs(os.path.join(parts, "part-0"))
    open(os.path.join(parts, ".part-1.gdsdata-lock"), "w").close()  # (a part's writer's lock file, beside the parts)
    os.makedirs(live)
    other = str(tmp_path / ".dsx.gdsdata-new-host-1-0123abcd")  # another dataset's
    os.makedirs(other)
    with caplog.at_level("WARNING", logger="gdsdata.format.lock"), writer_lock(out, "test"):
        pass
    assert [n for n in os.listdir(tmp_path) if n.startswith(".ds.gdsdata-")] == [os.path.basename(live)]
    assert os.path.isdir(other)
    assert any(os.path.basename(live) in r.getMessage() and "may still run" in r.getMessage() for r in caplog.records)
    assert verify(out) == []  # the dataset, untouched


def test_the_command_line_says_what_it_cleared(src, tmp_path):
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    left = _left_by(out, "new", _dead_pid())
    os.makedirs(left)
    done = subprocess.run([sys.executable, "-m", "gdsdata.cli", "pack", src, out, "--overwrite", "--workers", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert os.path.basename(left) in done.stderr and "removed" in done.stderr
    assert "other drives" not in done.stderr  # (it held no links to shards elsewhere)
    assert not os.path.exists(left) and verify(out) == []


def test_a_pack_killed_outright_leaves_no_worker_holding_its_lock(src, tmp_path):
    """Its workers (forked, so holding copies of the lock's descriptor) end with it, and hold no
    lock meanwhile: the next writer goes ahead at once."""
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    marker = f"gdsdata-killed-pack-{os.getpid()}-{random.getrandbits(32)}"
    script = (f"import os, signal  # {marker}\n"
              f"from gdsdata.packing.packer import pack\n"
              f"seen = []\n"
              f"def progress(n):\n"
              f"    seen.extend([1] * n)\n"
              f"    if len(seen) == 3:\n"
              f"        os.kill(os.getpid(), signal.SIGKILL)\n"
              f"pack({src!r}, {out!r}, workers=2, overwrite=True, on_progress=progress)\n")
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == \
        -signal.SIGKILL

    def left():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == []
    pack(src, out, workers=1, overwrite=True)  # not refused: no process holds the lock
    assert verify(out) == []


def test_journals_left_in_a_finished_dataset_go_with_its_next_writer(src, tmp_path):
    from gdsdata.format.lock import writer_lock

    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    stale = os.path.join(out, fmt.shard_name(0) + fmt.JOURNAL_SUFFIX)  # an append killed after its index
    with open(stale, "w") as f:
        json.dump({"dataset_id": "00" * 16}, f)
    with writer_lock(out, "test"):
        pass
    assert not os.path.exists(stale) and verify(out) == []


def test_a_writer_finishes_the_swap_a_killed_writer_began(src, tmp_path):
    """Killed between ``swap_in``'s two renames (where the kernel has no atomic exchange): ``out`` is
    missing, the complete new dataset and the old one beside it; the next writer puts the new one in
    place and removes the old."""
    from gdsdata.format.index import header_id
    from gdsdata.format.lock import remove_quietly, writer_lock

    out = str(tmp_path / "ds")
    pid = _dead_pid()
    new, old = _left_by(out, "new", pid), _left_by(out, "old", pid)
    pack(src, new, workers=1)
    pack(src, old, workers=1)
    new_id = header_id(new)
    with writer_lock(out, "test"):
        pass
    assert verify(out) == [] and header_id(out) == new_id
    assert not os.path.exists(new) and not os.path.exists(old)
    remove_quietly(out)  # removed by hand, and a complete replacement a writer never swapped in beside it:
    stale = _left_by(out, "new", _dead_pid())  # it does not come back
    pack(src, stale, workers=1)
    with writer_lock(out, "test"):
        pass
    assert not os.path.exists(out) and not os.path.exists(stale)


def test_overwrite_keeps_the_old_dataset_when_the_new_pack_fails(src, tmp_path):
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    before = samples_of(out)
    empty_src = tmp_path / "nothing"
    (empty_src / "a").mkdir(parents=True)
    (empty_src / "a" / "x.jpg").write_bytes(b"not an image at all")
    with pytest.raises(SourceError):
        pack(str(empty_src), out, overwrite=True, workers=1)
    with pytest.raises(ValueError, match="alignment"):
        pack(src, out, overwrite=True, alignment=1000)
    assert samples_of(out) == before and verify(out) == []
    assert not [n for n in os.listdir(tmp_path) if ".gdsdata-" in n]  # nothing of the failed build left


def test_overwrite_swaps_in_a_complete_dataset(src, tmp_path):
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    old_id = load(out).dataset_id
    pack(src, out, overwrite=True, workers=1, shard_size=1 << 20)
    assert load(out).dataset_id != old_id and verify(out) == []
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_a_dataset_replaced_under_a_reader_raises(src, tmp_path):
    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=200_000)
    ds = gdsdata.GDSDataset(out)
    ds.__getitems__([0])  # shard 0 opened before the replacement
    pack(src, out, overwrite=True, workers=1, shard_size=200_000)
    image, _ = ds[1]  # still from the old, open shard: the old pixels
    with pytest.raises(FormatError, match="replaced or rewritten while open"):
        ds[len(ds) - 1]  # a shard opened after the replacement
    ds.close()


def test_a_dataset_replaced_while_it_is_verified_or_inspected_is_said_so(src, tmp_path, monkeypatch):
    """An overwrite into fewer shards swaps in while verify or inspect checks the old index's shards:
    one line saying the dataset changed meanwhile, neither the old shards "missing" nor success."""
    from gdsdata.commands.info import info
    from gdsdata.format import index as index_io

    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=200_000)
    assert len(load(out).shards) > 1
    real = index_io.last_sample_ends

    def replaced_meanwhile(index):
        pack(src, out, overwrite=True, workers=1)  # one shard
        return real(index)

    monkeypatch.setattr(index_io, "last_sample_ends", replaced_meanwhile)
    changed = f"{out}: the dataset changed while it was being "
    with pytest.raises(FormatError, match=re.escape(changed + "checked (a pack --overwrite, --append or merge")):
        verify(out)
    with pytest.raises(FormatError, match=re.escape(changed + "inspected")):
        info(out)
    monkeypatch.setattr(index_io, "last_sample_ends", real)
    assert verify(out) == [] and info(out)["problems"] == []
    run = subprocess.run([sys.executable, "-m", "gdsdata", "verify", out], capture_output=True, text=True,
                         env=child_env(), timeout=120)
    assert run.returncode == 0, run.stderr


# --- decompression bombs, dead workers ---------------------------------------------------------
def bomb(width=65500, height=65500) -> bytes:
    """A small baseline JPEG whose frame header declares ``width`` x ``height``."""
    data = bytearray(jpeg_bytes(photo(1, scale=0.1), quality=50))
    at = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, at + 5, height, width)
    return bytes(data)


def test_bombs_are_refused_before_decoding_under_a_memory_limit(tmp_path):
    src = tmp_path / "src"
    for k in range(16):
        (src / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{k % 2}" / f"bomb{k}.jpg").write_bytes(bomb())
    (src / "c0" / "fine.jpg").write_bytes(jpeg_bytes(photo(2, scale=0.3)))
    (src / "c1" / "fine.jpg").write_bytes(jpeg_bytes(photo(3, scale=0.3)))
    out = str(tmp_path / "ds")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", limit + "from gdsdata.cli import main; import sys; "
                           f"sys.exit(main(['pack', {str(src)!r}, {out!r}, '--workers', '2', '-q']))"],
                          capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 60
    report = json.load(open(os.path.join(out, fmt.REPORT_NAME)))
    reasons = {item["path"]: item["reason"] for item in report["skipped"]}
    assert len(reasons) == 16 and all("65500x65500" in r and "--max-pixels" in r for r in reasons.values())
    assert len(load(out)) == 2


def test_the_pixel_limit_applies_to_every_codec(tmp_path):
    from PIL import Image

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (400, 300)).save(src / "a" / "big.png")
    (src / "a" / "big.jpg").write_bytes(jpeg_bytes(photo(4, scale=1.5)))
    (src / "a" / "small.jpg").write_bytes(jpeg_bytes(photo(5, scale=0.2)))
    result = pack(str(src), str(tmp_path / "ds"), workers=1, options=gdsdata.PackOptions(max_pixels=100_000))
    skipped = {item["path"]: item["reason"] for item in result.skipped}
    assert set(skipped) == {"a/big.png", "a/big.jpg"} and all("over the limit" in r for r in skipped.values())


def test_a_worker_killed_mid_pack_becomes_one_skipped_file(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 30, classes=2, start_seed=50)
    victim = sorted(os.listdir(src / "class1"))[3]
    out = str(tmp_path / "ds")
    script = (f"import os, signal, sys; sys.path.insert(0, {ROOT!r}); import gdsdata.packing.packer as p\n"
              "real = p._prepare_item\n"
              f"def item(job):\n    if job[0].endswith({victim!r}): os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(job)\n"
              "p._prepare_item = item\n"
              f"r = p.pack({str(src)!r}, {out!r}, workers=2)\n"
              "print(r.packed, r.skipped)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("29 ")
    assert f"class1/{victim}" in done.stdout and "killed by SIGKILL" in done.stdout
    assert verify(out) == []


def test_a_pool_that_breaks_between_waits_loses_no_chunk_and_keeps_the_order(monkeypatch):
    """A worker killed while the pack reads the next items (a tar source, say) breaks the pool before
    the next ``submit``, which then raises: that chunk is redone like those the broken pool held, in
    source order (it had ended the pack with a traceback). A worker process that cannot start is one
    line."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    import gdsdata.packing.packer as packer

    monkeypatch.setattr(packer, "_prepare_chunk", lambda batch: [(job, "pool", None, None) for job in batch])
    monkeypatch.setattr(packer, "_isolated", lambda job, context, bound: (job, "alone", None, None))

    class Pool:
        def __init__(self, breaks_at):
            self.calls, self.breaks_at = 0, breaks_at

        def submit(self, call, batch):
            self.calls += 1
            if self.calls > self.breaks_at:
                raise BrokenProcessPool("A child process terminated abruptly")
            future = Future()
            if self.calls == self.breaks_at:  # the chunk whose worker died
                future.set_exception(BrokenProcessPool("A child process terminated abruptly"))
            else:
                future.set_result(call(batch))
            return future

        def shutdown(self, wait=True, cancel_futures=False):
            pass

    pools = iter([Pool(breaks_at=2), Pool(breaks_at=10**9)])
    got = list(packer._ordered(lambda: next(pools), range(40), window=32, context=None, bound=1, chunk=8))
    assert [job for job, *_ in got] == list(range(40))
    assert [job for job, how, *_ in got if how == "alone"] == list(range(8, 16))  # the dead worker's chunk

    class NoProcesses(Pool):  # (a worker process could not start: out of memory, or of processes)
        def submit(self, call, batch):
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    with pytest.raises(GdsDataError, match=r"^cannot start a packing worker process: Resource temporarily "
                                           r"unavailable \(fewer --workers, or free memory\)$"):
        list(packer._ordered(lambda: NoProcesses(0), range(40), window=32, context=None, bound=1, chunk=8))


def _pack_with_stuck_items(tmp_path, stuck: str, timeout="2", prelude=""):
    """``pack(workers=2)`` in a child whose workers hang for good on the items ``stuck`` (a Python
    expression of ``job``) names, ``stall_timeout`` at ``timeout`` seconds; ``prelude``: code the
    child runs first."""
    src = tmp_path / "src"
    write_photos(str(src), 30, classes=2, start_seed=50)
    out = str(tmp_path / "ds")
    script = (f"import sys, threading; sys.path.insert(0, {ROOT!r}); import gdsdata.packing.packer as p\n{prelude}"
              "real = p._prepare_item\n"
              f"def item(job):\n    if {stuck}: threading.Event().wait()\n"
              "    return real(job)\n"
              "p._prepare_item = item\n"
              f"sys.argv = ['gdsdata', 'pack', {str(src)!r}, {out!r}, '--workers', '2', '-q']\n"
              "from gdsdata.cli import run\nrun()\n")  # (the command's own exit)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=child_env(GDSDATA_STALL_TIMEOUT=timeout))
    return src, out, done, time.monotonic() - started


def test_a_worker_stuck_on_one_item_ends_as_that_item_skipped_within_the_bound(tmp_path):
    """A packing worker that never gives its chunk back (a decoder that loops, a lock a fork left
    held) is ended after stall_timeout; its items are redone one per process and the one that
    still stalls alone is skipped with the reason, the rest packed: never a hung pack."""
    victim = "class1/00007.jpg"  # (write_photos names them by number)
    src, out, done, took = _pack_with_stuck_items(tmp_path, f"job[0] == {victim!r}")
    assert done.returncode == 0, done.stderr
    assert took < 60  # the bound (2 s) an image for the chunk, then 2 s for each image alone
    assert verify(out) == []
    report = json.loads((tmp_path / "ds" / "pack_report.json").read_text())
    assert report["packed"] == 29
    assert [(s["path"], s["reason"]) for s in report["skipped"]] == [
        (victim, "preparing it alone took longer than 2 s (the stall_timeout setting, GDSDATA_STALL_TIMEOUT)")]


def test_a_worker_stopped_outright_is_killed_and_the_pack_exits(tmp_path):
    """A worker stopped (SIGSTOP, a frozen cgroup) takes no SIGTERM until it runs again: it is killed
    outright, so that neither the pack nor the interpreter's exit waits for it (they did for good)."""
    victim = "class1/00007.jpg"
    stop = "__import__('os').kill(__import__('os').getpid(), __import__('signal').SIGSTOP)"
    src, out, done, took = _pack_with_stuck_items(tmp_path, f"job[0] == {victim!r} and {stop} is None")
    assert done.returncode == 0, done.stderr
    assert took < 60
    report = json.loads((tmp_path / "ds" / "pack_report.json").read_text())
    assert report["packed"] == 29 and [s["path"] for s in report["skipped"]] == [victim]


def test_a_worker_even_sigkill_does_not_end_yet_leaves_the_command_free_to_exit(tmp_path):
    """A worker in an uninterruptible wait in the kernel (a dead NFS server) ends only when the kernel
    lets it: the command says its result and exits (the interpreter's exit waited for it). Played by
    a stopped worker whose SIGKILL is not sent."""
    pid_file = tmp_path / "stopped.pid"
    stop = (f"(open({str(pid_file)!r}, 'w').write(str(__import__('os').getpid())) and "
            "__import__('os').kill(__import__('os').getpid(), __import__('signal').SIGSTOP))")
    prelude = "import multiprocessing.process as mp\nmp.BaseProcess.kill = lambda self: None\n"
    try:
        src, out, done, took = _pack_with_stuck_items(tmp_path, f"job[0] == 'class1/00007.jpg' and {stop} is None",
                                                      prelude=prelude)
        assert done.returncode == 0 and took < 90, done.stderr
        assert json.loads((tmp_path / "ds" / "pack_report.json").read_text())["packed"] == 29
    finally:
        for pid in pid_file.read_text().split() if pid_file.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_workers_that_stall_on_every_item_end_the_pack_in_one_line(tmp_path):
    """Workers stuck whatever they prepare are the machine's trouble, not the images': the pack
    stops with one line (not 30 items each skipped after the bound), and leaves no dataset."""
    src, out, done, took = _pack_with_stuck_items(tmp_path, "True", timeout="1")
    assert done.returncode == 1 and took < 60
    said = done.stderr.strip().splitlines()  # the warning as the worker is ended, then the error
    assert said[0] == "WARNING gdsdata.packing.packer: a packing worker gave nothing back for 8 s (8 images); " \
                      "preparing them one by one"
    assert said[1].startswith("gdsdata: error: packing workers make no progress: class0/"), done.stderr
    assert said[1].endswith("GDSDATA_STALL_TIMEOUT raises the bound; --workers 1 packs in this process)")
    assert len(said) == 2 and "Traceback" not in done.stderr
    assert not os.path.exists(os.path.join(out, "index.gdsi"))


# --- hostile source trees ---------------------------------------------------------------------
def test_unreadable_folders_are_reported_and_fatal_with_strict(tmp_path, monkeypatch):
    import gdsdata.packing.sources as sources

    src = tmp_path / "src"
    write_photos(str(src), 12, classes=2, start_seed=70)
    (src / "class1" / "sub").mkdir()
    (src / "class1" / "sub" / "x.jpg").write_bytes(jpeg_bytes(photo(71)))
    real = os.scandir

    def scandir(path):  # root ignores chmod 000, so the refusal is played here
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(sources.os, "scandir", scandir)
    result = pack(str(src), str(tmp_path / "ds"), workers=1)
    assert result.unreadable == [{"path": "class1/sub", "reason": "cannot read: Permission denied"}]
    assert json.load(open(tmp_path / "ds" / fmt.REPORT_NAME))["unreadable"] == result.unreadable
    with pytest.raises(SourceError, match="class1/sub: cannot read: Permission denied \\(--strict\\)"):
        pack(str(src), str(tmp_path / "strict"), workers=1, strict=True)


def test_a_link_loop_neither_repeats_nor_mislabels(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 5, classes=2, start_seed=80)
    os.symlink("..", src / "class0" / "loop")
    os.symlink(str(src / "class1"), src / "class0" / "other")
    result = pack(str(src), str(tmp_path / "ds"), workers=1)
    ds = gdsdata.GDSDataset(str(tmp_path / "ds"))
    assert [(ds.source(i), ds.targets[i]) for i in range(len(ds))] == [
        ("class0/00000.jpg", 0), ("class0/00002.jpg", 0), ("class0/00004.jpg", 0), ("class1/00001.jpg", 1),
        ("class1/00003.jpg", 1)]  # (class1's images had come through the loop, labelled class0)
    assert [(item["path"], item["reason"]) for item in result.unreadable] == [
        ("class0/loop", "a link to ., outside its class's folder in the source: not read here"),
        ("class0/other", "a link to class1, outside its class's folder in the source: not read here")]
    deep = tmp_path / "deep"  # a link into a subfolder of another class, and a class that is one
    write_photos(str(deep), 4, classes=2, start_seed=90)
    (deep / "class1" / "sub").mkdir()
    for name in ("00001.jpg", "00003.jpg"):
        os.rename(deep / "class1" / name, deep / "class1" / "sub" / name)
    os.symlink("../class1/sub", deep / "class0" / "in")
    result = pack(str(deep), str(tmp_path / "deep-ds"), workers=1)
    ds = gdsdata.GDSDataset(str(tmp_path / "deep-ds"))
    assert [(ds.source(i), ds.targets[i]) for i in range(len(ds))] == [
        ("class0/00000.jpg", 0), ("class0/00002.jpg", 0), ("class1/sub/00001.jpg", 1), ("class1/sub/00003.jpg", 1)]
    os.symlink("class1/sub", deep / "alias")
    with pytest.raises(SourceError, match="alias: a link into class class1's folder"):
        pack(str(deep), str(tmp_path / "alias-ds"), workers=1)


def test_links_deep_in_nested_folders_are_caught_as_at_the_top(tmp_path):
    """Folders nested 300 deep (their real paths are followed down the tree, not resolved anew at each
    folder): the image at the bottom is listed, a loop and a link into another class there are not
    followed."""
    src = tmp_path / "src"
    write_photos(str(src), 2, classes=2, start_seed=95)
    bottom = src / "class0"
    for _ in range(300):
        bottom = bottom / "n"
    bottom.mkdir(parents=True)
    os.rename(src / "class0" / "00000.jpg", bottom / "deep.jpg")
    os.symlink("../../..", bottom / "up")
    os.symlink(str(src / "class1"), bottom / "other")
    result = pack(str(src), str(tmp_path / "ds"), workers=1)
    ds = gdsdata.GDSDataset(str(tmp_path / "ds"))
    chain = "/".join(["class0"] + ["n"] * 300)
    assert [(ds.source(i), ds.targets[i]) for i in range(len(ds))] == [(f"{chain}/deep.jpg", 0),
                                                                       ("class1/00001.jpg", 1)]
    assert [(item["path"], item["reason"]) for item in result.unreadable] == [
        (f"{chain}/other", "a link to class1, outside its class's folder in the source: not read here"),
        (f"{chain}/up", f"the same folder as {'/'.join(['class0'] + ['n'] * 297)} (a link loop or a second link "
                        f"to it): not read twice")]


def test_two_class_names_for_one_folder_are_refused(tmp_path):
    """A class folder that is a link to another class's folder: ImageFolder would label its images
    both ways; the pack stops naming both (it had kept the second as a class without samples)."""
    src = tmp_path / "src"
    write_photos(str(src), 2, classes=1, start_seed=85)
    os.symlink("class0", src / "alias")
    with pytest.raises(SourceError, match=r"alias: a link to class class0's folder"):
        pack(str(src), str(tmp_path / "ds"), workers=1)


def test_special_files_named_like_images_are_skipped_unopened(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 4, classes=1, start_seed=90)
    os.mkfifo(src / "class0" / "pipe.jpg")
    os.symlink("/dev/zero", src / "class0" / "zero.jpg")
    t0 = time.monotonic()
    result = pack(str(src), str(tmp_path / "ds"), workers=2)
    assert time.monotonic() - t0 < 60 and result.packed == 4
    kinds = {item["path"]: item["reason"] for item in result.special}
    assert "a FIFO" in kinds["class0/pipe.jpg"] and "a character device" in kinds["class0/zero.jpg"]


def test_names_that_are_not_utf8_are_kept_byte_for_byte(tmp_path):
    src = tmp_path / "src"
    weird_class = os.fsdecode(b"caf\xe9")  # latin-1, not UTF-8
    os.makedirs(src / weird_class)
    (src / "plain").mkdir()
    name = os.fsdecode(b"img-\xff\xfe.jpg")
    (src / weird_class / name).write_bytes(jpeg_bytes(photo(95)))
    (src / "plain" / "ok.jpg").write_bytes(jpeg_bytes(photo(96)))
    (src / "plain" / os.fsdecode(b"notes-\xff.txt")).write_bytes(b"not an image")
    code, out, err = run_cli("pack", str(src), str(tmp_path / "ds"), "-q")
    assert code == 0, err
    ds = gdsdata.GDSDataset(str(tmp_path / "ds"))
    assert os.fsencode(ds.classes[0]) == b"caf\xe9"
    path = next(ds.source(i) for i in range(len(ds)) if ds.targets[i] == 0)
    assert os.fsencode(path) == b"caf\xe9/img-\xff\xfe.jpg"
    assert os.path.exists(src / path)  # the stored name finds the file again
    report = json.load(open(tmp_path / "ds" / fmt.REPORT_NAME))
    assert report["ignored"] == ["plain/notes-\\xff.txt"]


def test_empty_class_folders_are_refused_as_torchvision_does(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 4, classes=2, start_seed=97)
    (src / "zzz-empty").mkdir()
    with pytest.raises(SourceError, match="zzz-empty: class folder with no image files.*--allow-empty-classes"):
        pack(str(src), str(tmp_path / "ds"), workers=1)
    pack(str(src), str(tmp_path / "ds"), workers=1, allow_empty_classes=True)
    assert gdsdata.GDSDataset(str(tmp_path / "ds")).classes == ["class0", "class1", "zzz-empty"]


def test_out_inside_src_is_refused(src, tmp_path):
    with pytest.raises(SourceError, match="inside the source folder"):
        pack(src, os.path.join(src, "packed"), workers=1)
    assert not os.path.exists(os.path.join(src, "packed"))
    os.symlink(os.path.dirname(src), tmp_path / "via")  # both named through one link
    linked = str(tmp_path / "via" / os.path.basename(src))
    with pytest.raises(SourceError, match="inside the source folder"):
        pack(linked, os.path.join(linked, "packed"), workers=1)
    assert not os.path.exists(os.path.join(src, "packed"))


def test_broken_sources_give_one_line(tmp_path):
    bad_tar = tmp_path / "bad.tar"
    bad_tar.write_bytes(b"\x00" * 100 + b"garbage" * 1000)
    code, _, err = run_cli("pack", str(bad_tar), str(tmp_path / "ds"), "-q")
    assert code == 1 and "not a readable tar file" in one_line(err)


# --- silently wrong pixels ------------------------------------------------------------------------
@pytest.mark.parametrize("flips", [20, pytest.param(400, marks=HEAVY)])
@pytest.mark.parametrize("codec", ["jpeg", "raw"])
def test_every_bit_flip_is_caught_by_default(tmp_path, codec, flips):
    src = tmp_path / "src"
    write_photos(str(src), 6, classes=2, start_seed=110)
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=1, options=gdsdata.PackOptions(codec=codec, raw_size=48 if codec == "raw" else 0))
    index = load(out)
    rng = random.Random(7)
    for trial in range(flips):
        k = rng.randrange(len(index))
        record = index.samples[k]
        at = int(record["offset"]) + rng.randrange(int(record["length"]))
        path = index.shard_path(int(record["shard"]))
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        ds = gdsdata.GDSDataset(out)
        with pytest.raises(CorruptSampleError, match=f"sample {k} .*checksum mismatch"):
            ds[k]
        ds.close()
        with open(path, "r+b") as f:  # put it back for the next trial
            f.seek(at)
            f.write(bytes([byte]))


# --- merge ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parts(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    made = [str(root / f"p{k}") for k in range(3)]
    for k, out in enumerate(made):
        pack(src, out, workers=1, num_parts=3, part=k)
    other = str(root / "other-of-2")
    pack(src, other, workers=1, num_parts=2, part=1)
    return made, other


def test_merge_refuses_incomplete_repeated_or_foreign_parts(parts, tmp_path):
    (p0, p1, p2), other = parts
    with pytest.raises(SourceError, match="part 1 of 3 is missing"):
        merge([p0, p2], str(tmp_path / "a"))
    with pytest.raises(SourceError, match="given twice; merge takes each dataset once"):
        merge([p0, p0, p1, p2], str(tmp_path / "b"))
    with pytest.raises(SourceError, match="different --num-parts"):
        merge([p0, p1, p2, other], str(tmp_path / "c"))
    merged = merge([p2, p0, p1], str(tmp_path / "d"))  # any order: put in part order
    assert merged["samples"] == 48 and verify(str(tmp_path / "d")) == []


# --- a full disk -----------------------------------------------------------------------------------
class SmallDisk(type(__import__("pathlib").Path())):
    def grow(self):
        subprocess.run(["mount", "-o", "remount,size=16m", str(self)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 400 KB tmpfs (needs the right to mount; CI's machine has it), grown by ``grow()``."""
    where = SmallDisk(tmp_path / "disk")
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


def test_a_full_disk_names_the_file_and_the_pack_resumes(src, small_disk, tmp_path):
    out = str(small_disk / "ds")
    code, _, err = run_cli("pack", src, out, "-q", "--workers", "1", "--shard-size", "100000")
    assert code == 1
    line = one_line(err)
    assert out in line and "No space left on device while writing" in line and ".gds" in line and "--resume" in line
    names = os.listdir(out)
    assert fmt.INDEX_NAME not in names and not [n for n in names if n.endswith(fmt.TMP_SUFFIX)]
    report = json.load(open(os.path.join(out, fmt.REPORT_NAME)))
    assert report["status"] == "failed" and report["finished_shards"] >= 1
    small_disk.grow()
    pack(src, out, resume=True, workers=1, shard_size=100_000)
    reference = str(tmp_path / "reference")
    pack(src, reference, workers=1, shard_size=100_000)
    assert load(out).samples["crc32"].tolist() == load(reference).samples["crc32"].tolist()
    assert verify(out) == []


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("error", [OSError(errno.ENOTCONN, "Transport endpoint is not connected"),
                                   ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")],
                         ids=["mount-dropped", "network"])
def test_a_source_whose_storage_goes_away_stops_the_pack_and_it_resumes(src, tmp_path, monkeypatch, workers, error):
    """A dropped network mount mid-pack fails every read after it: not each file's fault, so the pack
    stops in one line naming the file and keeps its finished shards for --resume (skipping would go
    on into a dataset that looks whole with the rest of the files left out); a file that is itself
    unreadable (EIO, EACCES) is still skipped with its reason."""
    from gdsdata.errors import SourceGoneError
    from gdsdata.packing import packer

    out, calls, read = str(tmp_path / "ds"), [], packer._read_regular

    def drops(path):
        calls.append(path)
        if len(calls) > 20:  # (in a worker: its own count, past 20 of its reads)
            raise error
        return read(path)

    monkeypatch.setattr(packer, "_read_regular", drops)
    with pytest.raises(SourceGoneError, match=r"\.jpg: cannot read: .*(not connected|reset by peer) \(the source's "
                                              r"storage, not this file: the pack stops rather than skip the files "
                                              r"after it\); \d+ finished shard\(s\) kept: once it answers again, "
                                              r"run the same command with --resume"):
        pack(src, out, workers=workers, shard_size=100_000)
    assert fmt.INDEX_NAME not in os.listdir(out)
    monkeypatch.undo()
    pack(src, out, resume=True, workers=1, shard_size=100_000)
    reference = str(tmp_path / "reference")
    pack(src, reference, workers=1, shard_size=100_000)
    assert load(out).samples["crc32"].tolist() == load(reference).samples["crc32"].tolist()


def test_a_tar_source_whose_storage_goes_away_stops_the_pack(tmp_path, monkeypatch):
    """Tar shards (read in the pack's own process) on a mount that drops: the pack stops in one line
    naming the tar, as for a folder's files, rather than skip every sample after it."""
    import io
    import tarfile

    from gdsdata.errors import SourceGoneError

    tar_path = str(tmp_path / "shard-000.tar")
    with tarfile.open(tar_path, "w") as tar:
        for k in range(12):
            for name, data in ((f"{k:04d}.jpg", jpeg_bytes(photo(k))), (f"{k:04d}.cls", str(k % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    real, reads = tarfile.TarFile.extractfile, []

    def extractfile(self, member):
        reads.append(member)
        if str(getattr(member, "name", member)).endswith(".jpg") and len(reads) > 17:  # (past the labels' reads)
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(self, member)

    monkeypatch.setattr(tarfile.TarFile, "extractfile", extractfile)
    with pytest.raises(SourceGoneError, match=r"shard-000.tar: cannot read: Stale file handle \(the source's storage"):
        pack(tar_path, str(tmp_path / "ds"), workers=1)


def test_a_file_that_could_not_be_read_is_packed_by_a_resume_once_it_is_back(src, tmp_path, monkeypatch, caplog):
    """A file the pack skipped as unreadable (an I/O error), put back before the interrupted pack is
    resumed (its change time moves): the resume packs again from the shard that skipped it."""
    from gdsdata.packing import packer

    out, read = str(tmp_path / "ds"), packer._read_regular
    names = sorted(os.path.join(dirpath, n) for dirpath, _, files in os.walk(src) for n in files)
    bad, last = names[3], names[-2]

    def flaky(path):
        if path == bad:
            raise OSError(errno.EIO, "Input/output error")
        if path == last:
            raise KeyboardInterrupt  # (stopped there: finished shards and journals stay)
        return read(path)

    monkeypatch.setattr(packer, "_read_regular", flaky)
    with pytest.raises(KeyboardInterrupt):
        pack(src, out, workers=1, shard_size=100_000)
    monkeypatch.undo()
    os.utime(bad)  # put back (a restore, a chmod: the change time moves)
    with caplog.at_level("WARNING", logger="gdsdata"):
        result = pack(src, out, resume=True, workers=1, shard_size=100_000)
    assert f"{bad}: changed since the interrupted pack read it" in caplog.text and not result.skipped
    reference = str(tmp_path / "reference")
    pack(src, reference, workers=1, shard_size=100_000)
    assert load(out).samples["crc32"].tolist() == load(reference).samples["crc32"].tolist()


def test_a_file_that_cannot_be_read_is_skipped_with_its_reason(src, tmp_path, monkeypatch):
    from gdsdata.packing import packer

    read = packer._read_regular

    def bad_sector(path):
        if path.endswith("00004.jpg"):
            raise OSError(errno.EIO, "Input/output error")
        return read(path)

    monkeypatch.setattr(packer, "_read_regular", bad_sector)
    result = pack(src, str(tmp_path / "ds"), workers=1)
    skipped = [(s["path"], s["reason"]) for s in result.skipped]
    assert skipped == [("class1/00004.jpg", "cannot read: Input/output error")]


def test_a_full_disk_while_the_index_is_written_names_the_dataset_and_the_pack_resumes(src, tmp_path, monkeypatch):
    from gdsdata.format import index as index_io

    out, written = str(tmp_path / "ds"), index_io.write

    def full(folder, *args, **kwargs):
        with open(os.path.join(folder, fmt.INDEX_NAME + fmt.TMP_SUFFIX), "wb") as f:  # an index cut short
            f.write(b"GDS")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index_io, "write", full)
    with pytest.raises(OSError) as caught:
        pack(src, out, workers=1, shard_size=100_000)
    said = caught.value.strerror
    assert said.startswith("No space left on device while writing the index of") and out in said and "--resume" in said
    names = os.listdir(out)
    assert fmt.INDEX_NAME not in names and not [n for n in names if n.endswith(fmt.TMP_SUFFIX)]
    assert json.load(open(os.path.join(out, fmt.REPORT_NAME)))["status"] == "failed"
    monkeypatch.setattr(index_io, "write", written)
    assert pack(src, out, resume=True, workers=1, shard_size=100_000).resumed_shards >= 1 and verify(out) == []


def test_a_full_disk_as_a_journal_is_written_names_the_journal(src, tmp_path, monkeypatch, capsys):
    """A write error carries no file name ("No space left on device" alone): the line names the file
    being written, a shard's journal here, and the pack resumes."""
    from gdsdata.packing import packer

    out, dump = str(tmp_path / "ds"), json.dump

    def full(payload, f, **kwargs):
        if f.name.endswith(fmt.JOURNAL_SUFFIX + fmt.TMP_SUFFIX) and "shard-00001" in f.name:
            raise OSError(28, "No space left on device")
        return dump(payload, f, **kwargs)

    from gdsdata.cli import main

    monkeypatch.setattr(packer.json, "dump", full)
    assert main(["pack", src, out, "-q", "--workers", "1", "--shard-size", "100000"]) == 1
    err = capsys.readouterr().err
    journal = os.path.join(out, fmt.shard_name(1) + fmt.JOURNAL_SUFFIX)
    assert f"No space left on device while writing {journal}; 1 finished shard(s) kept" in one_line(err)
    monkeypatch.setattr(packer.json, "dump", dump)
    assert pack(src, out, resume=True, workers=1, shard_size=100_000).resumed_shards == 1 and verify(out) == []


@pytest.mark.parametrize("append", [False, True])
def test_an_interrupt_as_the_index_is_written_waits_for_the_report_that_describes_it(src, tmp_path, monkeypatch,
                                                                                   append):
    """Ctrl-C or SIGTERM right after the index went in place: the report is written before it acts
    (an append's report still described the dataset before it, a pack's was missing)."""
    from gdsdata.packing import packer

    out, real_write = str(tmp_path / "ds"), packer.index_io.write
    if append:
        pack(src, out, workers=1)
    more = tmp_path / "more"
    write_photos(str(more), 5, classes=1, start_seed=6700)
    os.rename(more / "class0", more / "fresh")

    def interrupted(*args, **kwargs):
        real_write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (a handler would have run by now)

    monkeypatch.setattr(packer.index_io, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(str(more), out, workers=1, append=append)
    report = json.loads(open(os.path.join(out, fmt.REPORT_NAME)).read())
    assert report["status"] == "complete" and report["packed"] == len(load(out)) and verify(out) == []
    assert report.get("appended") == (5 if append else None)
    if not append:  # killed outright between the two (SIGKILL): a resume says so, not "is the disk full?"
        os.unlink(os.path.join(out, fmt.REPORT_NAME))
        code, said, _ = run_cli("pack", str(more), out, "--resume", "--workers", "1")
        assert code == 0 and "report: none (missing or unreadable: the pack that finished the dataset may have been " \
            "stopped before writing it)" in said


def test_a_report_that_cannot_be_written_leaves_a_complete_dataset(src, tmp_path, monkeypatch):
    from gdsdata.packing import packer

    out, dump = str(tmp_path / "ds"), json.dump

    def full(payload, f, **kwargs):
        if payload.get("status") == "complete":  # the report, once the index is in place
            f.write("{")  # cut short by the full disk
            raise OSError(28, "No space left on device")
        return dump(payload, f, **kwargs)

    monkeypatch.setattr(packer.json, "dump", full)
    result = pack(src, out, workers=1, shard_size=100_000)
    assert result.report_path == "" and result.packed == len(load(out)) and verify(out) == []
    assert sorted(os.listdir(out)) == sorted([fmt.INDEX_NAME] + [fmt.shard_name(k) for k in range(result.shards)])


def test_a_full_disk_during_merge_copy_leaves_no_truncated_shard(parts, small_disk):
    (p0, p1, p2), _ = parts
    out = str(small_disk / "m")
    code, _, err = run_cli("merge", p0, p1, p2, out, "--copy", "-q")
    assert code == 1
    line = one_line(err)
    assert "while copying" in line and "--resume" not in line
    assert not os.path.exists(out)  # built aside: nothing of it is left to fill the disk
    assert not os.listdir(small_disk)


def test_a_full_disk_during_overwrite_keeps_the_old_dataset(src, small_disk):
    out = str(small_disk / "ds")
    few = small_disk.parent / "few"
    write_photos(str(few), 6, classes=2, start_seed=8000)
    pack(str(few), out, workers=1)
    before = samples_of(out)
    code, _, err = run_cli("pack", src, out, "-q", "--overwrite", "--workers", "1")
    assert code == 1 and "No space left on device" in one_line(err)
    assert samples_of(out) == before and verify(out) == []
    assert sorted(os.listdir(small_disk)) == ["ds"]


def test_a_full_shard_drive_names_its_file_and_the_pack_resumes(src, tmp_path):
    """Shards on two drives (``--shard-root``), one of which fills: one line naming the shard on that
    drive, finished shards kept on both; after room is made the pack resumes to what one pack gives."""
    small = SmallDisk(tmp_path / "small")
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        out, drives = str(tmp_path / "ds"), [str(small / "a"), str(tmp_path / "b")]
        roots = [arg for d in drives for arg in ("--shard-root", d)]
        code, _, err = run_cli("pack", src, out, "-q", "--workers", "1", "--shard-size", "60000", *roots)
        assert code == 1
        line = one_line(err)
        assert "No space left on device while writing" in line and str(small) in line and "--resume" in line
        assert fmt.INDEX_NAME not in os.listdir(out)
        small.grow()
        pack(src, out, resume=True, workers=1, shard_size=60_000, shard_roots=drives)
        reference = str(tmp_path / "reference")
        pack(src, reference, workers=1, shard_size=60_000)
        assert load(out).samples["crc32"].tolist() == load(reference).samples["crc32"].tolist()
        assert verify(out) == []
        leftovers = [f for d in drives for _, _, files in os.walk(d) for f in files if f.endswith(fmt.TMP_SUFFIX)]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


# --- Ctrl-C -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bigger_src(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sigint_src"))
    write_photos(root, 480, classes=4, start_seed=4000, scale=1.0)
    return root


@pytest.mark.parametrize("how", ["entry point", "python -m gdsdata"])
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(how):
    """Before ``gdsdata.cli`` (which puts the command's own handler in place) has been imported: the
    ``gdsdata`` command (its entry point in pyproject.toml, called as pip's script calls it) and
    ``python -m gdsdata``, with that import stopped as Ctrl-C stops it."""
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        module, function = tomllib.load(f)["project"]["scripts"]["gdsdata"].split(":")
    start = (f"from {module} import {function}\nsys.exit({function}())\n" if how == "entry point" else
             "import runpy\nrunpy.run_module('gdsdata', run_name='__main__')\n")
    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def stopped(name, *args, **kwargs):\n"
            "    if name == 'gdsdata.cli':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = stopped\n" + start)
    done = subprocess.run([sys.executable, "-c", code, "pack", "a", "b"], capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert done.returncode == 130 and done.stderr == "gdsdata: interrupted while starting; nothing was written\n"


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5, *(pytest.param(d, marks=HEAVY)
                                                   for d in (0.05, 0.1, 0.3, 0.4, 0.7, 1.0, 1.5, 2.0))])
@pytest.mark.parametrize("spread", [False, True], ids=["one-folder", "shard-roots"])
def test_sigint_at_any_point_exits_130_in_one_line_and_resumes(bigger_src, tmp_path, delay, spread):
    _stop_and_resume(bigger_src, tmp_path, delay, spread, signal.SIGINT, 130, "interrupted")


@pytest.mark.parametrize("delay", [0.2, 0.5, *(pytest.param(d, marks=HEAVY) for d in (0.0, 0.1, 1.0))])
def test_sigterm_to_the_process_group_unwinds_as_ctrl_c_and_exits_143(bigger_src, tmp_path, delay):
    """``timeout``, Slurm and ``docker stop`` send SIGTERM, the first two to the whole process group
    (the packing workers too): one line, exit 143, finished shards kept for --resume, no worker left."""
    _stop_and_resume(bigger_src, tmp_path, delay, True, signal.SIGTERM, 143, "terminated (SIGTERM)", group=True)


def _stop_and_resume(src, tmp_path, delay, spread, sig, code, said, group=False):
    out = str(tmp_path / "ds")
    drives = [str(tmp_path / "drive0"), str(tmp_path / "drive1")] if spread else []
    roots = [arg for d in drives for arg in ("--shard-root", d)]
    process = cli("pack", src, out, "-q", "--workers", "2", "--shard-size", "1000000", *roots,
                  start_new_session=group)
    lock = tmp_path / ".ds.gdsdata-lock"
    deadline = time.monotonic() + 60
    while not lock.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the pack is running (it holds its lock): not the interpreter starting
    time.sleep(delay)
    if group:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)
    _, err = process.communicate(timeout=30)
    if os.path.exists(os.path.join(out, fmt.INDEX_NAME)):  # finished before the signal, or as it came
        assert process.returncode in (0, code, -sig) and verify(out) == []
        return
    assert process.returncode == code, err
    assert said in one_line(err)
    time.sleep(0.2)
    assert not [p for p in subprocess.run(["pgrep", "-f", f"gdsdata pack {src}"], capture_output=True,
                                          text=True).stdout.split()]
    if os.path.exists(os.path.join(out, fmt.INDEX_NAME)):
        return
    if os.path.isdir(out):  # else the signal came before anything was written
        pack(src, out, resume=True, workers=2, shard_size=1_000_000, shard_roots=drives)
    else:
        pack(src, out, workers=2, shard_size=1_000_000, shard_roots=drives)
    assert len(load(out)) == 480 and verify(out) == []
    on_drives = sorted(os.path.basename(f) for d in drives for _, _, files in os.walk(d) for f in files
                       if f != OWNER_NAME or files == [OWNER_NAME])  # (a shard folder left empty fails)
    assert on_drives == (sorted(n for n in os.listdir(out) if n.endswith(".gds")) if spread else [])


# --- readers: closing, descriptors, skips ---------------------------------------------------------
def test_closing_the_dataset_under_a_running_loader_raises_in_the_loop(src, tmp_path):
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    ds = gdsdata.GDSDataset(out)
    loader = gdsdata.Loader(ds, 4)
    it = iter(loader)
    next(it)
    threading.Thread(target=ds.close).start()
    time.sleep(0.5)
    with pytest.raises(GdsDataError, match="dataset was closed while it was reading"):
        for _ in it:
            pass


def test_thousands_of_shards_under_a_low_descriptor_limit(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 300, classes=2, start_seed=5000, scale=0.3)
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=2, shard_size=8192, alignment=4096)  # about one sample per shard
    assert len(load(out).shards) >= 290
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); import gdsdata, os; "
            f"ds = gdsdata.GDSDataset({out!r}); n = sum(len(y) for _, y in gdsdata.Loader(ds, 32)); "
            "print(n, len(os.listdir('/proc/self/fd')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert done.returncode == 0, done.stderr
    count, fds = map(int, done.stdout.split())
    assert count == 300 and fds < 64


def test_a_dropped_dataset_gives_its_descriptors_back(src, tmp_path):
    import gc

    out = str(tmp_path / "ds")
    pack(src, out, workers=1, shard_size=200_000)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        ds = gdsdata.GDSDataset(out)
        ds.__getitems__(range(len(ds)))
        del ds
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_skipping_is_linear_and_counted_per_epoch(tmp_path):
    src = tmp_path / "src"
    write_photos(str(src), 120, classes=2, start_seed=6000, scale=0.3)
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=2)
    index = load(out)
    for k in range(20, 100):  # a long run of bad samples: each probed once, not once per sample before it
        record = index.samples[k]
        with open(index.shard_path(int(record["shard"])), "r+b") as f:
            f.seek(int(record["offset"]))
            f.write(b"\x00" * 64)
    ds = gdsdata.GDSDataset(out, on_error="skip")
    probes = {"n": 0}
    real = ds._backend.load_batch

    def counted(indices, stream=None):
        probes["n"] += 1
        return real(indices, stream)

    ds._backend.load_batch = counted
    loader = gdsdata.Loader(ds, 16, shuffle=False)
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == 120
    assert loader.skipped == {0: 80}
    assert probes["n"] < 2 * 120  # linear in the bad samples
    list(loader)
    assert loader.skipped == {0: 80, 1: 80}


def test_an_overwrite_leaves_a_folder_put_in_out_s_place_meanwhile(tmp_path):
    """OUT moved away while an overwrite builds its replacement, and a folder of the user's put there
    (a ``mv``): the swap would have deleted it. It stays; the new dataset stays complete aside, named."""
    from gdsdata.errors import OutputExistsError
    from gdsdata.packing import packer

    src = tmp_path / "src"
    write_photos(str(src), 4, classes=2, start_seed=120)
    out = tmp_path / "ds"
    pack(str(src), str(out), workers=1)

    def build(folder):
        result = pack(str(src), folder, workers=1)
        out.rename(tmp_path / "moved")
        out.mkdir()
        (out / "precious.txt").write_text("my only copy")
        return result

    with pytest.raises(OutputExistsError, match="replaced by another folder while this ran") as caught:
        packer.into(str(out), True, build)
    assert os.listdir(out) == ["precious.txt"] and verify(str(tmp_path / "moved")) == []
    kept = str(caught.value).split("the new dataset is complete in ")[1].split(": move it")[0]
    assert os.path.dirname(kept) == str(tmp_path) and verify(kept) == []
    with pytest.raises(OutputExistsError, match="files gdsdata did not write"):  # the next writer of OUT ...
        pack(str(src), str(out), workers=1, overwrite=True)
    assert verify(kept) == []  # ... leaves it

    def removed(folder):  # OUT removed meanwhile: the new dataset takes its place
        result = pack(str(src), folder, workers=1)
        shutil.rmtree(tmp_path / "moved")
        return result

    packer.into(str(tmp_path / "moved"), True, removed)
    assert verify(str(tmp_path / "moved")) == []


def test_a_pack_whose_folder_is_removed_under_it_writes_no_index(tmp_path):
    """``rm -rf OUT`` (or a shard removed) while a pack writes: it fails naming the shard that is gone,
    rather than finish with exit 0 and an index of shards that are not there."""
    src = tmp_path / "src"
    write_photos(str(src), 12, classes=2, start_seed=130)
    out = tmp_path / "ds"
    first = out / fmt.shard_name(0)

    def remove(_):
        if first.exists() and (out / fmt.shard_name(1)).exists():
            first.unlink()

    with pytest.raises(GdsDataError, match="gone before the pack could finish"):
        pack(str(src), str(out), workers=1, shard_size=65536, on_progress=remove)
    assert not (out / fmt.INDEX_NAME).exists()


def test_a_lock_file_that_is_not_a_file_is_named(tmp_path):
    """The writer lock beside OUT as a FIFO or a folder: one line naming it (a bare "Invalid
    argument" had named nothing, and a folder blamed the parent folder)."""
    from gdsdata.format.lock import _lock_path

    src = tmp_path / "src"
    write_photos(str(src), 2, classes=1, start_seed=140)
    out = str(tmp_path / "ds")
    lock = _lock_path(out)
    os.mkfifo(lock)
    with pytest.raises(OSError, match=f"{lock}, the lock file of ds, is not a regular file: remove it"):
        pack(str(src), out, workers=1)
    os.makedirs(out)  # opening a folder without an index asks the lock who writes it: never waiting on the FIFO
    opened = []

    def open_it():
        with pytest.raises(FormatError, match="no index") as caught:
            gdsdata.GDSDataset(out)
        opened.append(caught.value)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(30)
    assert opened, "opening the dataset waited on the FIFO"
    os.rmdir(out)
    os.unlink(lock)
    os.mkdir(lock)
    with pytest.raises(OSError, match=f"{lock}, the lock file of ds, cannot be opened: Is a directory"):
        pack(str(src), out, workers=1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_inside_library_code_leaves_no_ignored_exception_traceback(tmp_path, sig):
    """Ctrl-C or SIGTERM can land inside the standard library's code (multiprocessing's
    ``Finalize.__init__`` cut short, whose finaliser then fails): what Python reports only as
    "Exception ignored in ..." goes to the debug log, so the command still says one line."""
    script = tmp_path / "stop.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from gdsdata import cli

        cli._COMMAND_PID = os.getpid()
        signal.signal(signal.SIGTERM, cli._terminate)
        signal.signal(signal.SIGINT, cli._interrupt)

        class HalfMade:  # as a Finalize whose __init__ the signal cut short
            def __del__(self):
                raise AttributeError("'Finalize' object has no attribute '_key'")

        try:
            half = HalfMade()
            os.kill(os.getpid(), {int(sig)})
            time.sleep(10)
        except KeyboardInterrupt as e:
            del half
            print(type(e).__name__)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == [
        "Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_write_error_other_than_a_full_disk_does_not_advise_freeing_space(src, tmp_path, monkeypatch, capsys):
    """A journal that cannot be written for another reason (its folder made read-only, a file removed
    under the pack) keeps the finished shards and says to resume once that is put right, not to free
    space; a full disk still says so."""
    from gdsdata.cli import main
    from gdsdata.packing import packer

    dump = json.dump
    for number, reason, advice in ((30, "Read-only file system", "once that is put right, run the same command"),
                                   (28, "No space left on device", "free space, then run the same command")):
        out = str(tmp_path / f"ds{number}")

        def failing(payload, f, number=number, reason=reason, **kwargs):
            if f.name.endswith(fmt.JOURNAL_SUFFIX + fmt.TMP_SUFFIX) and "shard-00001" in f.name:
                raise OSError(number, reason)
            return dump(payload, f, **kwargs)

        monkeypatch.setattr(packer.json, "dump", failing)
        assert main(["pack", src, out, "-q", "--workers", "1", "--shard-size", "100000"]) == 1
        said = one_line(capsys.readouterr().err)
        assert f"{reason} while writing" in said and f"1 finished shard(s) kept: {advice} with --resume" in said
        assert (number == 28) == ("free space" in said)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_writer_whose_lock_file_went_commits_nothing(src, parts, tmp_path, monkeypatch, how):
    """The lock file beside OUT removed (a user's rm, a cleaner of dot files) or replaced by another
    writer's while a pack or merge runs: another writer may have started on OUT, so nothing is
    committed. In place, no index (a pack's finished shards stay for --resume); an overwrite leaves
    the dataset there as it was and the new one complete beside it. A writer never removes a lock
    file it does not hold."""
    import gdsdata.packing.merge as merging
    import gdsdata.packing.packer as packing
    from gdsdata.format.lock import _lock_path

    def taking(module, name):
        """``module.name`` that first removes (or replaces) the lock file of the ``out`` being written."""
        real = getattr(module, name)

        def call(*args, **kwargs):
            os.unlink(lock)
            if how == "replaced":
                with open(lock, "w") as f:
                    f.write("{}")
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
        return real

    def said(lock):
        return re.escape(f"its lock file {lock} was removed or replaced while this ran, so another gdsdata writer "
                         f"may have started on it")

    def after_it(out):  # (a replacement, another writer's, is its own: left)
        assert os.path.exists(lock) == (how == "replaced")
        if how == "replaced":
            os.unlink(lock)

    out = str(tmp_path / "ds")
    lock = _lock_path(out)
    real = taking(packing, "report_complete")
    with pytest.raises(BusyError, match=said(lock)
                       + re.escape("; no index written, and nothing removed: its finished shards stay for pack "
                                   "--resume")):
        pack(src, out, workers=1)
    assert not os.path.exists(os.path.join(out, fmt.INDEX_NAME))
    after_it(out)
    monkeypatch.setattr(packing, "report_complete", real)
    resumed = pack(src, out, workers=1, resume=True)
    assert resumed.resumed_shards == resumed.shards and resumed.new == 0 and verify(out) == []
    before = load(out).dataset_id

    taking(packing, "report_complete")
    with pytest.raises(BusyError, match=re.escape(f"{out}: ") + said(lock)
                       + re.escape("; it is left as it is, and the new dataset is complete in ")) as caught:
        pack(src, out, workers=1, overwrite=True)
    kept = re.search(r"complete in (\S+): move it", str(caught.value)).group(1)
    assert load(out).dataset_id == before and verify(out) == []
    assert load(kept).dataset_id != before and len(load(kept)) == 48 and verify(kept) == []
    after_it(out)
    monkeypatch.setattr(packing, "report_complete", real)

    merged = str(tmp_path / "merged")
    lock = _lock_path(merged)
    real_merge = taking(merging, "_merge_into")
    with pytest.raises(BusyError, match=said(lock)
                       + re.escape("; no index written, and what it placed there stays: merge again with --overwrite")):
        merge(parts[0], merged)
    assert not os.path.exists(os.path.join(merged, fmt.INDEX_NAME)) and os.listdir(merged)
    after_it(merged)
    monkeypatch.setattr(merging, "_merge_into", real_merge)
    merge(parts[0], merged, overwrite=True)
    assert len(load(merged)) == 48 and verify(merged) == []


def _lock_file_goes_after_the_first_journal(monkeypatch, out) -> str:
    """Make the lock file of a pack into ``out`` go (a user's rm) once its first shard's journal is
    written; returns the lock file's path."""
    import gdsdata.packing.packer as packing
    from gdsdata.format.lock import _lock_path

    lock, real = _lock_path(out), packing._write_json

    def write_json(path, what):
        if fmt.JOURNAL_SUFFIX in os.path.basename(path) and os.path.exists(lock):
            os.unlink(lock)
        return real(path, what)
    monkeypatch.setattr(packing, "_write_json", write_json)
    return lock


def test_a_pack_whose_lock_file_went_names_no_shard_after(src, tmp_path, monkeypatch):
    """In place, a pack whose lock file went mid-pack stops before its next shard takes its name
    (another writer may be writing shards of the same names): the shards before stay, with their
    journals, for --resume."""
    out = str(tmp_path / "ds")
    lock = _lock_file_goes_after_the_first_journal(monkeypatch, out)
    with pytest.raises(BusyError, match=re.escape(f"its lock file {lock} was removed or replaced")):
        pack(src, out, workers=1, shard_size=100_000)
    monkeypatch.undo()
    names = sorted(os.listdir(out))
    assert fmt.shard_name(0) in names and fmt.shard_name(1) not in names and fmt.INDEX_NAME not in names, names
    resumed = pack(src, out, workers=1, shard_size=100_000, resume=True)
    assert resumed.resumed_shards == 1 < resumed.shards and resumed.packed == 48 and verify(out) == []


def test_a_pack_that_fails_after_its_lock_file_went_removes_nothing(src, tmp_path, monkeypatch):
    """A pack in place that fails for another reason once its lock file went removes none of what it
    wrote (another writer may be writing the same names now): the failure goes on as ``LockLost``,
    naming what stopped it, and the shards stay for --resume."""
    from gdsdata.format.shards import ShardWriter

    out = str(tmp_path / "ds")
    lock = _lock_file_goes_after_the_first_journal(monkeypatch, out)
    real_add = ShardWriter.add

    def add(self, payload):  # then a failure that removes what the pack wrote where the lock is intact
        if not os.path.exists(lock):
            raise GdsDataError("a failure of its own")
        return real_add(self, payload)
    monkeypatch.setattr(ShardWriter, "add", add)
    with pytest.raises(BusyError, match=re.escape("nothing removed: its finished shards stay for pack --resume, "
                                                  "once no other gdsdata writes it (what stopped it: a failure of "
                                                  "its own)")):
        pack(src, out, workers=1, shard_size=100_000)
    assert {fmt.shard_name(0), fmt.shard_name(0) + fmt.JOURNAL_SUFFIX} <= set(os.listdir(out))
    monkeypatch.undo()
    resumed = pack(src, out, workers=1, shard_size=100_000, resume=True)
    assert resumed.resumed_shards == 1 and resumed.packed == 48 and verify(out) == []
