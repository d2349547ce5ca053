"""One writer at a time per dataset folder, and whole datasets swapped in only when complete.

``writer_lock(out, what)`` holds an advisory ``flock`` on a small file beside ``out``
(``.NAME.gdsdata-lock`` in its parent) for the whole of a pack, append, resume, merge or overwrite;
a second writer gets ``BusyError`` naming the holder (its command, process and host, and since
when). The lock goes with the process: a writer killed with SIGKILL holds nothing. Readers take no
lock, but a merge holds each part's shared (``reader_lock``) while it links the part's shards: other
merges share it, a writer of the part is refused at once naming the merge. (``flock`` is advisory
and local: writers on different hosts of a network filesystem that does not forward it are not kept
apart.)

``aside(out)`` gives the folder a replacement is built in (a sibling, so that the swap is a rename
on one filesystem) and ``swap_in`` exchanges it with ``out`` in one step where the kernel has
``renameat2(RENAME_EXCHANGE)``, else with two renames; the old dataset stays whole until the new
one is. Only the holder of ``out``'s lock makes such folders, and their names carry its host and
process: the next writer of ``out`` removes those a writer killed outright left (with the shards
they hold on other drives), where that writer ran on the same host and is gone; if it was killed
between the two renames, so that ``out`` is missing, the complete replacement it left becomes
``out``, as it was about to.

A dataset packed onto several drives (``pack(shard_roots=)``) keeps its shards in a folder
``NAME.gdsdata-shards-ID`` on each drive (ID: the pack's dataset id) and a symbolic link to each in
its own folder; ``remove_dataset`` and ``remove_shards`` remove such shards with their links when
given that id, and nothing a link points to elsewhere (a merge's links to its parts' shards, whose
folders carry the parts' ids, stay the parts'; a renamed dataset still owns its shards). Each such
folder names the dataset folder that made it (``.gdsdata-owner``: its path, device and inode): a copy
of the dataset folder (``cp -a``, the same id, links to the same shards) removed or overwritten while
that folder still holds the dataset leaves them, with a warning naming their owner.
"""

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import threading
import time

from gdsdata.errors import BusyError, FormatError, GdsDataError, LockLost
from gdsdata.format.layout import JOURNAL_SUFFIX, TMP_SUFFIX, short_ident

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_TAGS = ("new", "old", "parts")  # the folders writers build aside: a replacement, a swapped-out dataset, Ray's parts
_HOST = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"
_HELD = set()  # the descriptors of the locks this process holds (a forked worker closes its copies)
_WRITING = {}  # lock file path -> the descriptors of this process's writer locks on it (two only once one went)


def _lock_path(out: str) -> str:
    """Beside the folder itself (its real path): a reader or writer given a symbolic link to it takes
    the lock every other one of it takes."""
    parent, name = os.path.split(os.path.realpath(out))
    return os.path.join(parent, f".{name}.gdsdata-lock")


@contextlib.contextmanager
def writer_lock(out, what: str):
    """Hold ``out``'s writer lock for the block, or raise ``BusyError`` at once."""
    fd, path = _take(os.fspath(out), exclusive=True)
    _WRITING.setdefault(path, []).append(fd)
    try:
        _sign(fd, what, reading=False)
        _clear_leftovers(os.fspath(out))
        yield
    finally:
        _WRITING[path].remove(fd)
        if not _WRITING[path]:
            del _WRITING[path]
        if _is_file_of(fd, path):  # (not another writer's, made after this one's was removed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        _HELD.discard(fd)
        os.close(fd)  # releases the lock


def lost(out) -> "str | None":
    """The path of ``out``'s lock file where this process holds ``out``'s writer lock but that file
    is no longer the one it locked (removed, or replaced: a user's ``rm``, a cleaner of dot files):
    another writer may then have taken a new one, so a writer commits nothing. None otherwise (also
    where this process holds no writer lock of ``out``)."""
    path = _lock_path(os.fspath(out))
    held = _WRITING.get(path, ())
    return path if any(not _is_file_of(fd, path) for fd in held) else None


def check_held(out, then: str):
    """Raise ``LockLost`` (its message ending in ``then``: what the writer leaves) where ``lost(out)``."""
    path = lost(out)
    if path is not None:
        raise LockLost(out, path, then)


def keep_if_lost(out, error: BaseException, then: str):
    """In a writer's error handler, before it removes anything it wrote in ``out``: where ``out``'s lock
    file went, those files may now be another writer's, so nothing is removed: ``error`` goes on as
    ``LockLost`` (itself where it is one, or where it is no ``Exception``: Ctrl-C, SIGTERM); else
    this returns."""
    if isinstance(error, LockLost):
        raise error
    path = lost(out)
    if path is None:
        return
    if not isinstance(error, Exception):
        raise error
    raise LockLost(out, path, f"{then} (what stopped it: {error})") from error


def _is_file_of(fd: int, path: str) -> bool:
    """Whether ``path`` is the file the descriptor ``fd`` has open."""
    try:
        here, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def reader_lock(dataset, what: str):
    """Keep writers off the finished dataset ``dataset`` for the block (a merge reading its parts):
    its writer lock held shared, so that other readers holding it go on and a writer (``pack
    --overwrite``, ``--append``, a merge into it) is refused at once, naming this reader; raises
    ``BusyError`` naming the writer if one holds it now. Where the lock file can neither be made nor
    opened (a folder this user cannot write) the block runs without it: the caller checks what it
    read (a merge, every shard's header). Readers that only load a dataset take no lock."""
    import fcntl

    try:
        fd, path = _take(os.fspath(dataset), exclusive=False, what=what)
    except OSError as e:
        log.info("%s: read without its writer lock (%s)", dataset, e.strerror or e)
        fd = None
    if fd is None:
        yield
        return
    try:
        _sign(fd, what, reading=True)
        yield
    finally:
        _HELD.discard(fd)
        try:  # the last reader out removes the file, as a writer does (another reader keeps it)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_file_of(fd, path):
                os.unlink(path)
        except OSError:
            pass
        os.close(fd)


def _take(out: str, exclusive: bool, what: str = "") -> "tuple[int, str]":
    """Lock ``out``'s lock file (``exclusive``: a writer; else a reader, ``what``) without waiting:
    the descriptor holding it, and the file's path; ``BusyError`` naming the holder."""
    import fcntl

    path = _lock_path(out)
    parent = os.path.dirname(path)
    waited = time.monotonic() + 0.5  # a reader leaving holds the lock whole for a moment, to remove the file
    while True:
        try:
            if exclusive:
                os.makedirs(parent, exist_ok=True)
            fd = _open_lock(path, exclusive)
        except OSError as e:  # the lock lives beside OUT: its folder must take new files
            if os.path.lexists(path):  # the lock file itself (another user's, a folder ...)
                raise OSError(e.errno, f"{path}, the lock file of {os.path.basename(os.path.abspath(out))}, cannot "
                                       f"be opened: {e.strerror or e} (left by another user's gdsdata? remove it "
                                       f"once no gdsdata uses that dataset)") from None
            why = ("it takes no new files (a filesystem such as /proc or /sys)"
                   if e.errno == errno.ENOENT and os.path.isdir(parent) else e.strerror or e)
            raise OSError(e.errno, f"cannot write in {parent}, the folder that holds "
                                   f"{os.path.basename(os.path.abspath(out))}: {why}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # (flock would fail on a FIFO with a bare EINVAL)
            os.close(fd)
            raise OSError(errno.EINVAL, f"{path}, the lock file of {os.path.basename(os.path.abspath(out))}, is not "
                                        f"a regular file: remove it")
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(fd)
            os.close(fd)
            if info.get("reading") and time.monotonic() < waited:  # (perhaps one leaving: try again)
                time.sleep(0.02)
                continue
            raise _busy(out, info, exclusive, what) from None
        if _is_file_of(fd, path):  # not a file a finished writer unlinked
            _HELD.add(fd)
            return fd, path
        os.close(fd)


def _open_lock(path: str, exclusive: bool) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        if exclusive:
            raise
        return os.open(path, os.O_RDONLY)  # another user's lock file: a shared lock needs no writing


def _busy(out, info: dict, exclusive: bool, what: str) -> BusyError:
    holder = _described(info) if info else "writer"
    if info.get("reading"):
        return BusyError(f"{out}: a gdsdata merge is reading it (the latest to start: {holder}); wait for the "
                         f"merges reading it to finish (no writer while a merge reads it)")
    if exclusive:
        return BusyError(f"{out}: another gdsdata {holder} is writing it; wait for it to finish "
                         f"(one writer at a time per dataset)")
    return BusyError(f"{out}: a gdsdata {holder} is writing it; wait for it to finish, then run the {what} again")


def _sign(fd: int, what: str, reading: bool):
    """Who holds the lock, for the next writer's ``BusyError`` and ``writing``."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"what": what, "pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                  "command": " ".join(sys.argv[:4]), **({"reading": True} if reading else {})})
                  .encode(), 0)
    except OSError:
        if not reading:
            raise


def writing(out) -> str | None:
    """Who is writing ``out`` now, in the words of ``BusyError`` ("pack of SRC (pid ... on HOST, since
    ...)"), or None: a writer of this host other than this process whose process runs and is the one
    that signed the lock (not a later process given a killed writer's pid), or one of another host
    (which cannot be checked). Takes no lock, so a writer starting meanwhile is never turned away."""
    from gdsdata.format.shards import open_regular  # (which imports this module)

    try:  # (a FIFO where the lock file belongs is refused, never waited on for a writer)
        with open(open_regular(_lock_path(os.fspath(out)), what="a lock file"), "rb") as f:
            info = json.loads(f.read(4096).decode() or "{}")
    except (OSError, ValueError, FormatError):
        return None
    if not isinstance(info, dict) or not info or info.get("reading"):
        return None  # (a merge reading a finished dataset writes nothing there)
    pid, host = info.get("pid"), info.get("host")
    if host == socket.gethostname() and (pid == os.getpid() or not isinstance(pid, int)
                                         or not _running(pid, info.get("since"))):
        return None  # this process, or a writer killed before it could remove the file (its pid perhaps reused)
    return _described(info)


def _started_after(fields: list, since) -> bool:
    """Whether the process of ``fields`` (``_stat``'s) started after ``since`` (``_sign``'s local time,
    to the second): then it is not the process that signed the lock. False where that cannot be told."""
    try:
        signed = time.mktime(time.strptime(since, "%Y-%m-%d %H:%M:%S"))
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # (field 22: clock ticks after boot)
    except (OSError, ValueError, TypeError, IndexError, StopIteration, OverflowError):
        return False
    return started > signed + 60  # (slack for the clock set forward meanwhile, which moves the boot time)


def drop_inherited_locks():
    """In a process forked from a writer: close its copies of the writer's lock descriptors, so that
    the lock goes with the writer (a ``flock`` stays held while any copy is open)."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _WRITING.clear()


def _holder(fd) -> dict:
    info = {}
    for _ in range(20):  # the holder writes who it is right after taking the lock
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            info = {}
        if info:
            break
        time.sleep(0.025)
    return info if isinstance(info, dict) else {}


def _described(info: dict) -> str:
    return f"{info.get('what', 'writer')} (pid {info.get('pid')} on {info.get('host')}, since {info.get('since')})"


def aside(out: str, tag: str) -> str:
    """A new empty sibling folder of ``out`` for a replacement to be built in (``tag``: one of
    ``_TAGS``), named for this host and process."""
    parent, name = os.path.split(os.path.realpath(out))
    path = os.path.join(parent, f".{name}.gdsdata-{tag}-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}")
    os.makedirs(path)
    return path


def _maker(entry: str, name: str) -> "tuple[str, str, int] | None":
    """(tag, host, process) of the folder ``entry`` that ``aside`` made for dataset ``name``; None
    for anything else (the lock file, a folder of an older version without the host, another
    dataset's: ``_HOST`` has no dash, so the name splits into exactly four fields)."""
    prefix = f".{name}.gdsdata-"
    if not entry.startswith(prefix):
        return None
    fields = entry[len(prefix):].split("-")
    if (len(fields) != 4 or fields[0] not in _TAGS or not fields[1] or not (fields[2].isascii() and fields[2].isdigit())
            or len(fields[2]) > 10 or len(fields[3]) != 8):
        return None
    return fields[0], fields[1], int(fields[2])


def _running(pid: int, since=None) -> bool:
    """Whether process ``pid`` of this host runs: not gone, and not a zombie (killed, not yet reaped by
    its parent: it holds no file and no lock); with ``since`` (when a lock was signed), also not a
    process that started after it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:  # no pid of this host: not known gone
        return True
    except PermissionError:  # another user's: it runs (its /proc entry tells the rest)
        pass
    try:
        fields = _stat(pid)
        if since is not None and _started_after(fields, since):
            return False
        if fields[0] not in (b"Z", b"X"):
            return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1  # (a main thread that ended beside running ones)
    except (OSError, IndexError):  # (not Linux, or gone meanwhile: the next look tells)
        return True


def _stat(pid: int) -> list:
    """The fields of ``/proc/PID/stat`` after the command (the state first: field 3)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:].split()


def _linked(folder: str) -> set:
    """The real paths of the files ``folder``'s links point to (its shards on other drives)."""
    try:
        names = os.listdir(folder)
    except OSError:  # (missing, or no folder: a part writer's lock file beside the parts)
        return set()
    return {os.path.realpath(os.path.join(folder, n)) for n in names if os.path.islink(os.path.join(folder, n))}


def _clear_leftovers(out: str):
    """What writers of ``out`` killed outright left beside it (their ``aside`` folders, with the shards
    those hold on other drives), for the holder of ``out``'s lock: removed where the writer ran on this
    host and is gone, else named in a warning. Where ``out`` is missing and the writer was killed
    between ``swap_in``'s two renames (its swapped-out dataset lies beside it), its complete
    replacement becomes ``out``; a swapped-out dataset is never removed while ``out`` is missing."""
    _clear_journals(out)
    parent, name = os.path.split(os.path.realpath(out))
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return
    found = [(entry, _maker(entry, name)) for entry in entries]
    found = [(os.path.join(parent, e), m) for e, m in found if m is not None]
    swapping = {(h, p) for _, (t, h, p) in found if t == "old"}  # swap_in's fallback was under way
    for path, (tag, host, pid) in found:
        if os.path.islink(path) or not os.path.isdir(path):
            log.warning("%s: not a folder gdsdata made; left alone", path)
            continue
        if host != _HOST or _running(pid):
            log.warning("%s: left by a gdsdata writer (process %d on %s) that may still run; remove it by hand "
                        "once none does", path, pid, host)
            continue
        missing = not os.path.lexists(out)
        if missing and tag == "old":  # the last complete dataset there is: never removed while out is missing
            log.warning("%s: %s is missing and this is the dataset it held before a writer (process %d) was "
                        "killed replacing it; left for you to rename back", path, out, pid)
            continue
        try:
            if missing and tag == "new" and (host, pid) in swapping and _index_id(path) is not None:
                os.rename(path, out)
                log.warning("%s: was missing; the complete dataset a writer killed while swapping it in left "
                            "(%s) is it now", out, path)
                continue
            keep = _linked(out)
            folders = [os.path.join(path, n) for n in sorted(os.listdir(path))] if tag == "parts" else [path]
            elsewhere = any(_linked(folder) for folder in folders)  # (shards on other drives: --shard-root)
            for folder in folders:
                remove_dataset(folder, dataset_owner(folder), keep)
            remove_quietly(path)
        except OSError as e:
            log.warning("%s: left by a gdsdata writer (process %d) killed before it finished; not removed (%s)",
                        path, pid, e)
            continue
        log.warning("%s: removed%s: left by a gdsdata writer (process %d) killed before it finished", path,
                    ", with its shards on other drives" if elsewhere else "", pid)


def _clear_journals(out: str):
    """Journals in a finished dataset (one with an index): an append killed after writing its index
    left them; nothing reads them there (a finished dataset does not resume)."""
    if _index_id(out) is None:
        return
    try:
        stale = [n for n in os.listdir(out) if n.endswith(JOURNAL_SUFFIX)]
    except OSError:
        return
    for n in stale:
        try:
            os.unlink(os.path.join(out, n))
        except OSError:
            pass
    if stale:
        log.warning("%s: removed %d journal(s) a killed writer left beside the finished dataset (its index "
                    "says what the dataset holds)", out, len(stale))


def swap_in(new: str, out: str, old_id: "bytes | None" = None):
    """Make the complete dataset ``new`` the folder ``out``, then remove what ``out`` held (with the
    shards on other drives of the dataset there, ``old_id``, but those ``new`` links to)."""
    if not os.path.exists(out):
        os.rename(new, out)
        return
    keep = _linked(new)
    done = False
    try:
        with deferred_signals():  # out is the old dataset or the new one whenever Ctrl-C or SIGTERM unwinds
            if _exchange(new, out):
                old = new  # the old dataset, now under the temporary name
            else:
                old = aside(out, "old")
                os.rmdir(old)
                os.rename(out, old)  # a reader opening the dataset in between finds no folder, never a mix
                os.rename(new, out)
            done = True
    except BaseException:
        if not done:  # no swap: the new dataset goes, the old one stays
            remove_dataset(new, dataset_owner(new))
        raise
    finally:
        if done:  # also when a signal that waited for the swap unwinds now
            remove_dataset(old, old_id, keep)


def _settable(handler):
    return handler if handler is not None else signal.SIG_DFL  # (None: a handler not set from Python)


@contextlib.contextmanager
def deferred_signals():
    """Ctrl-C and SIGTERM wait for the block (renames that must not be split) to end; then the
    handlers in place take each signal that came. In the main thread only, where Python runs
    signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    try:
        for sig in sigs:  # (what came between these two is in ``came`` too, or raised before the block)
            signal.signal(sig, lambda number, frame: came.append(number))
        yield
    finally:  # SIGINT's recorder goes last, so that a Ctrl-C here finds both handlers back
        try:
            signal.signal(signal.SIGTERM, _settable(previous[signal.SIGTERM]))
        finally:
            signal.signal(signal.SIGINT, _settable(previous[signal.SIGINT]))
    for sig in dict.fromkeys(came):
        handler = previous[sig]
        if callable(handler):
            handler(sig, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), sig)


def _exchange(a: str, b: str) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the call is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), b)


def remove_quietly(path: str):
    shutil.rmtree(path, ignore_errors=True)


SHARDS_TAG = ".gdsdata-shards-"


def shard_folder(root: str, name: str, dataset_id: bytes) -> str:
    """The folder on drive ``root`` that holds the shards a pack of dataset ``name`` (its folder's
    name) with id ``dataset_id`` writes there."""
    return os.path.join(os.path.abspath(root), f"{name}{SHARDS_TAG}{dataset_id.hex()}")


OWNER_NAME = ".gdsdata-owner"
_said_foreign = set()  # shard folders already warned about in this process


def identity(path_or_fd) -> tuple:
    """(device, inode) of a file or folder (a path or an open descriptor)."""
    status = os.stat(path_or_fd)
    return status.st_dev, status.st_ino


def make_shard_folder(folder: str, building: str, dataset_folder: str, dataset_id: bytes):
    """Make ``folder`` (a ``shard_folder``) for the dataset ``dataset_id`` being written in ``building``
    (the folder that becomes ``dataset_folder``, its final path), naming ``dataset_folder`` its owner.
    A copy of another folder that holds the dataset (an append to a ``cp -a`` copy) is refused: its
    shards would take names the other dataset's shards have there."""
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, OWNER_NAME)
    if os.path.exists(marker):
        owner = foreign_owner(folder, building, dataset_id)
        if owner is not None:
            raise GdsDataError(f"{dataset_folder}: a copy of the dataset {owner} (cp -a: its links lead to that "
                               f"dataset's shards in {folder}), where this write would put shards of its own; "
                               f"copy it with `gdsdata merge {owner} COPY --copy` and write to that")
        return
    device, inode = identity(building)
    tmp = f"{marker}.{os.getpid()}{TMP_SUFFIX}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"folder": os.path.realpath(dataset_folder), "device": device, "inode": inode}, f)
    os.replace(tmp, marker)


def foreign_owner(shards: str, dataset_folder: str, dataset_id: "bytes | None") -> "str | None":
    """The folder ``shards`` (a ``shard_folder``) names as its owner, where that is another dataset
    folder than ``dataset_folder`` holding the same dataset (a ``cp -a`` copy's links lead there too);
    else None: the folder names ``dataset_folder`` (by device and inode, or by its path now), names
    no folder (made before owners were recorded), or a folder that no longer holds that dataset (the
    dataset moved to another filesystem, whose copy then was its only one)."""
    try:
        with open(os.path.join(shards, OWNER_NAME), encoding="utf-8") as f:
            owner = json.load(f)
        if (owner["device"], owner["inode"]) == identity(dataset_folder):
            return None
        folder = str(owner["folder"])
        if not os.path.isdir(folder) or os.path.samefile(folder, dataset_folder):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    held = _index_id(folder)
    return folder if held is not None and dataset_id is not None and held == dataset_id else None


def drop_if_empty(shards: str):
    """Remove the shard folder ``shards`` where it holds no shard (the name of its owner alone); where
    it holds anything else, leave it whole (its owner's name guards a ``cp -a`` copy's shards)."""
    try:
        names = os.listdir(shards)
        if not all(name.startswith(OWNER_NAME) for name in names):  # (and one a writer killed as it named it)
            return
        for name in names:
            os.unlink(os.path.join(shards, name))
        os.rmdir(shards)
    except OSError:  # (gone already, or a shard written there meanwhile)
        pass


def _target(link: str) -> "str | None":
    if not os.path.islink(link):
        return None
    return os.path.join(os.path.dirname(link), os.readlink(link))


def owned_target(link: str, dataset_id: "bytes | None") -> "str | None":
    """The shard file the link ``link`` points to when the dataset (or pack) with id ``dataset_id``
    wrote it on another drive (in a ``shard_folder`` of that id); else None. A link still being
    written (``.tmp``: only the writer holding the folder's lock makes them) always is."""
    target = _target(link)
    if target is None:
        return None
    folder = os.path.basename(os.path.dirname(target))
    if link.endswith(TMP_SUFFIX) and SHARDS_TAG in folder:
        return target
    if dataset_id is None:
        return None
    # the second name: a folder an append or resume made before ids were read whole (``layout.ident``)
    names = (SHARDS_TAG + dataset_id.hex(), SHARDS_TAG + short_ident(dataset_id).hex())
    return target if folder.endswith(names) else None


def remove_shards(paths, dataset_id: "bytes | None", on_error=None):
    """Remove each shard (or journal, or link being written) of ``paths``, and, where it links to a
    shard the dataset with id ``dataset_id`` wrote on another drive, that shard (its temporary name
    too, and its folder once empty). Each shard folder's owner is read once, and the folders left
    empty are removed at the end (a listing of a folder per shard made the removal of a dataset of
    thousands of shards on other drives take minutes). ``on_error(path, error)``: an ``OSError`` that
    stopped a path's removal, after which the others go on (else the first one is raised)."""
    owners, emptied = {}, set()
    try:
        for path in paths:
            try:
                _remove_one(path, dataset_id, owners, emptied)
            except OSError as e:
                if on_error is None:
                    raise
                on_error(path, e)
    finally:
        for shards in emptied:
            drop_if_empty(shards)


def _remove_one(path, dataset_id, owners: dict, emptied: set):
    target = owned_target(path, dataset_id)
    doomed = [path]
    if target is not None:
        shards, links = os.path.dirname(target), os.path.dirname(path)
        if (shards, links) not in owners:
            owners[shards, links] = foreign_owner(shards, links, dataset_id)
        owner = owners[shards, links]
        if owner is not None:  # the link of a copy: the shards stay their owner's
            if shards not in _said_foreign:
                _said_foreign.add(shards)
                log.warning("%s: left in place: its shards are those of %s, which %s is a copy of (cp -a copies "
                            "the links, not the shards)", shards, owner, links)
            target = None
    if target is not None:
        final = target[:-len(TMP_SUFFIX)] if target.endswith(TMP_SUFFIX) else target
        doomed = [final, final + TMP_SUFFIX, path]
        emptied.add(shards)
    for p in doomed:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _index_id(folder: str) -> "bytes | None":
    from gdsdata.format.index import header_id  # (the index reads shard headers; shards import this module)

    return header_id(folder)


def dataset_owner(folder) -> "bytes | None":
    """The dataset id that owns the shards ``folder``'s links point to on other drives: its index's,
    or an unfinished pack's (its journals'); None where neither is readable."""
    owner = _index_id(folder)
    if owner is not None:
        return owner
    from gdsdata.format.shards import open_regular  # (which imports this module)

    try:
        journals = sorted(n for n in os.listdir(folder) if n.endswith(JOURNAL_SUFFIX))
        with open(open_regular(os.path.join(folder, journals[0]), what="a journal"), encoding="utf-8") as f:
            return bytes.fromhex(json.load(f)["dataset_id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, FormatError):
        return None


def remove_dataset(folder: str, dataset_id: "bytes | None", keep=()):
    """Remove the dataset folder ``folder`` with the shards the dataset (or pack) with id
    ``dataset_id`` wrote on other drives (None: those are not known, and stay), but those in
    ``keep`` (real paths another dataset links to); quietly, as ``remove_quietly``. Links to other
    datasets' shards (a merge's to its parts) leave those alone."""
    try:
        entries = os.listdir(folder)
    except OSError:
        entries = []
    doomed = []
    for entry in entries:
        target = owned_target(os.path.join(folder, entry), dataset_id)
        if target and os.path.realpath(target) not in keep:
            doomed.append(os.path.join(folder, entry))
    remove_shards(doomed, dataset_id)
    remove_quietly(folder)
