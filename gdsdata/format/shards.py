"""Writing shard files (aligned payloads, written under a temporary name, in the dataset folder or on
other drives with a link to each) and checking their headers."""

import logging
import mmap
import os
import stat
import zlib

import numpy as np

from gdsdata.format import layout as fmt
from gdsdata.format.lock import drop_if_empty, make_shard_folder, shard_folder
from gdsdata.errors import FormatError

log = logging.getLogger(__name__)
_ZEROS = bytes(1 << 16)


def _pad(size: int, alignment: int) -> int:
    return (-size) % alignment


def _symlink(target, path):
    """``path`` a symbolic link to ``target``, in place of whatever a killed writer left there."""
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


class ShardWriter:
    """Appends payloads to ``shard-NNNNN.gds``, each at an aligned offset; rolls to a new shard
    past ``shard_size`` bytes. A shard is renamed to its final name only once it is complete.

    With ``roots`` (folders on other drives) shard k is written to ``roots[(k + root_offset) %
    len(roots)]`` (a part of a pack starts at its own root, so that parts of a shard or two still
    spread over every drive once merged), in the
    pack's ``lock.shard_folder`` there (``owner``: the dataset folder ``out_dir`` becomes, whose name
    it carries and which it names as its owner; default ``out_dir``), and ``out_dir`` links
    to it: ``shard-k.gds.tmp`` while it is written (until its journal is), ``shard-k.gds`` once it
    is complete."""

    def __init__(self, out_dir, alignment, shard_size, dataset_id: bytes, first_shard: int = 0,
                 first_sample: int = 0, on_close=None, roots=(), owner=None, root_offset: int = 0, before_close=None):
        if alignment < 64 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two of at least 64, got {alignment}")
        self.out_dir = str(out_dir)
        self.alignment = alignment
        self.shard_size = shard_size
        self.dataset_id = dataset_id
        self.next_shard = first_shard
        self.records = []  # one SHARD_RECORD row per shard finished by this writer
        self.samples_written = first_sample
        self.on_close = on_close  # called with each finished shard's index and record
        self.before_close = before_close  # called before a shard takes its final name (may raise: it stays .tmp)
        self.aborted = False  # abort() dropped a shard that was being written
        self.roots = [os.path.abspath(os.fspath(r)) for r in roots]
        self.root_offset = root_offset
        self.owner = os.path.abspath(os.fspath(owner or self.out_dir))
        self._file = None
        self._link = None

    def _put(self, data):
        try:
            self._file.write(data)
        except OSError as e:  # name the file: "No space left on device" alone says nothing of where
            raise OSError(e.errno, e.strerror, self._path + fmt.TMP_SUFFIX) from e

    def _write(self, data):
        self._put(data)
        self._crc = zlib.crc32(data, self._crc)  # the shard's CRC covers everything after the header block
        self._size += len(data)

    def _write_zeros(self, count):
        while count:
            chunk = _ZEROS[:min(count, len(_ZEROS))]
            self._write(chunk)
            count -= len(chunk)

    def _open(self):
        index = self.next_shard
        self._path = os.path.join(self.out_dir, fmt.shard_name(index))
        self._link = None
        try:
            if self.roots:  # on a drive of its own: out_dir links to it while it is written (so that a
                # crash leaves nothing there that out_dir does not name), then by its own name
                folder = shard_folder(self.roots[(index + self.root_offset) % len(self.roots)],
                                      os.path.basename(self.owner), self.dataset_id)
                make_shard_folder(folder, self.out_dir, self.owner, self.dataset_id)
                self._path, self._link = os.path.join(folder, fmt.shard_name(index)), self._path
                _symlink(self._path + fmt.TMP_SUFFIX, self._link + fmt.TMP_SUFFIX)
            self._file = open(self._path + fmt.TMP_SUFFIX, "wb")
        except OSError as e:
            raise OSError(e.errno, e.strerror, e.filename or self._path + fmt.TMP_SUFFIX) from e
        self._index = index
        self.next_shard += 1
        self._put(bytes(self.alignment))  # header block, rewritten at close (outside the shard's CRC)
        self._crc = 0
        self._size = self.alignment
        self._count = 0
        self._first = self.samples_written

    def add(self, payload) -> tuple:
        """Store one payload; returns (shard index, offset)."""
        if self._file is not None and self._count and self._size + len(payload) > self.shard_size:
            self.close_shard()
        if self._file is None:
            self._open()
        offset = self._size
        self._write(payload)
        self._write_zeros(_pad(self._size, self.alignment))
        self._count += 1
        self.samples_written += 1
        return self._index, offset

    def close_shard(self):
        if self._file is None:
            return
        header = np.zeros((), fmt.SHARD_HEADER)
        header["magic"] = fmt.SHARD_MAGIC
        header["version"] = fmt.SHARD_VERSION
        header["alignment"] = self.alignment
        header["shard_index"] = self._index
        header["num_samples"] = self._count
        header["dataset_id"] = self.dataset_id
        head = header.tobytes() + bytes(self.alignment - fmt.SHARD_HEADER.itemsize)
        try:
            self._file.seek(0)
            self._file.write(head)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror, self._path + fmt.TMP_SUFFIX) from e
        self._file.close()
        self._file = None
        if self.before_close is not None:
            self.before_close()
        os.replace(self._path + fmt.TMP_SUFFIX, self._path)
        if self._link is not None:  # the dataset's name for it, made in one step
            temporary = self._link + ".link" + fmt.TMP_SUFFIX
            _symlink(self._path, temporary)
            os.replace(temporary, self._link)
        record = (self._size, self._first, self._count, self._crc, self.dataset_id, self._index, 0)
        self.records.append(record)
        if self.on_close is not None:
            self.on_close(self._index, record)
        if self._link is not None:  # its journal is written: the link to it while it was written goes
            os.unlink(self._link + fmt.TMP_SUFFIX)
        log.debug("wrote %s: %d samples, %d bytes", self._path, self._count, self._size)

    def abort(self):
        if self._file is not None:
            self.aborted = True
            try:
                self._file.close()
            except OSError:  # buffered bytes that do not fit on a full disk
                pass
            self._file = None
            for path in (self._path, self._link):
                try:
                    if path is not None:
                        os.unlink(path + fmt.TMP_SUFFIX)
                except FileNotFoundError:
                    pass
            if self._link is not None:  # its folder on the other drive, where that holds no other shard (a pack
                # stopped at its first shard there, then packed from the start under another id, would leave it)
                drop_if_empty(os.path.dirname(self._path))


def open_regular(path, flags=os.O_RDONLY, what="a shard file") -> int:
    """``os.open`` of a file that must be a regular one: a FIFO, a device or a folder named as a
    shard (or ``what`` the file is) is refused (``FormatError`` naming it) rather than waited on for
    good (opening a FIFO blocks until something writes to it). Checked before the open (no O_NONBLOCK
    on the open itself: with it, a file under another's lease, a Samba oplock or an NFS delegation,
    fails instead of waiting for the lease to break) and again after it."""
    _regular(path, os.stat(path).st_mode, what)
    fd = os.open(path, flags)
    try:
        _regular(path, os.fstat(fd).st_mode, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _regular(path, mode, what):
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise FormatError(f"{path}: {kind} where {what} belongs")


def data_crc32(path, alignment: int, chunk=1 << 22) -> int:
    """CRC-32 of a shard's bytes after its header block (what SHARD_RECORD.crc32 stores)."""
    crc = 0
    with open(open_regular(path), "rb") as f:
        f.seek(alignment)
        while True:
            block = f.read(chunk)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _read_head(path, nbytes: int) -> bytes:
    """The first ``nbytes`` (at most a page) of a file, read past the page cache where the
    filesystem allows (O_DIRECT), else read without readahead and dropped from the cache again:
    opening a dataset of many shards leaves none of their pages cached, which matters when the
    dataset streams (``io.direct``)."""
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_DIRECT)
    except (FileNotFoundError, FormatError):
        raise
    except (OSError, AttributeError):
        fd = None
    if fd is not None:
        try:
            page = mmap.mmap(-1, mmap.PAGESIZE)  # page aligned, as O_DIRECT needs
            return page[:min(os.preadv(fd, [page], 0), nbytes)]
        except OSError:  # the device wants larger alignment than a page: read it the other way
            pass
        finally:
            os.close(fd)
    fd = open_regular(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        head = os.pread(fd, nbytes, 0)
        os.posix_fadvise(fd, 0, mmap.PAGESIZE, os.POSIX_FADV_DONTNEED)
        return head
    finally:
        os.close(fd)


def cannot_read(what, error: Exception) -> str:
    """One line: ``what`` (a file, a sample) could not be read, and the system's reason."""
    return f"{what}: cannot be read ({getattr(error, 'strerror', None) or error})"


def dangling(path) -> str:
    """Where a missing shard is a link (a pack onto several drives): where it points, which is not there."""
    try:
        return f": a link to {os.readlink(path)}, which is not there (its drive not mounted?)"
    except OSError:
        return ""


def read_header(path, expected_index: int, dataset_id: bytes, alignment: int, num_samples: int = None):
    """Check one shard's header against the index (``num_samples``: the count the index records for
    it, where known); raises ``FormatError`` naming the file."""
    try:
        raw = _read_head(path, fmt.SHARD_HEADER.itemsize)
    except FileNotFoundError as e:
        raise FormatError(f"{path}: shard file missing{dangling(path)} (the dataset is incomplete)") from e
    except OSError as e:  # (EACCES, EIO...)
        raise FormatError(cannot_read(path, e)) from e
    if len(raw) < fmt.SHARD_HEADER.itemsize:
        raise FormatError(f"{path}: truncated shard ({len(raw)} bytes, shorter than its header)")
    header = np.frombuffer(raw, fmt.SHARD_HEADER)[0]
    if header["magic"] != fmt.SHARD_MAGIC:
        raise FormatError(f"{path}: not a gdsdata shard (bad magic)")
    if header["version"] != fmt.SHARD_VERSION:
        raise FormatError(f"{path}: shard format version {header['version']} where its index, which this "
                          f"gdsdata reads, has version {fmt.SHARD_VERSION} shards: a damaged shard header "
                          f"(gdsdata verify names every damaged sample; pack again)")
    if fmt.ident(header["dataset_id"]) != dataset_id:
        raise FormatError(f"{path}: shard belongs to another dataset (its id differs from the one the index "
                          f"records for it)")
    if header["shard_index"] != expected_index or header["alignment"] != alignment:
        raise FormatError(f"{path}: shard header says index {header['shard_index']}, alignment "
                          f"{header['alignment']}; the index expects {expected_index}, {alignment}")
    if num_samples is not None and int(header["num_samples"]) != num_samples:
        raise FormatError(f"{path}: shard header says {header['num_samples']} samples, the index records "
                          f"{num_samples} (a damaged header)")
    return header


def unused_bytes_set(path, alignment: int) -> bool:
    """Whether a shard's bytes that hold nothing are other than zero: its header's reserved fields
    and the padding after the header up to ``alignment`` (damage the shard's data checksum, which
    begins at ``alignment``, does not cover, and reading does not notice). ``verify`` says so."""
    with open(open_regular(path), "rb") as f:
        head = f.read(alignment)
    header = fmt.SHARD_HEADER
    reserved = [(header.fields[name][1], header.fields[name][0].itemsize) for name in ("reserved0", "reserved")]
    return any(head[at:at + size].strip(b"\0") for at, size in reserved) or bool(head[header.itemsize:].strip(b"\0"))


def check_opened(head: bytes, path, index, shard: int):
    """Check the first bytes of a shard file just opened against the index the reader holds: a
    dataset replaced while it was open (packed again with ``--overwrite``) has shards of another id,
    and reading them under the old index would hand out other images' pixels under the old labels."""
    record = index.shards[shard]
    if len(head) >= fmt.SHARD_HEADER.itemsize:
        header = np.frombuffer(head[:fmt.SHARD_HEADER.itemsize], fmt.SHARD_HEADER)[0]
        if (header["magic"] == fmt.SHARD_MAGIC and fmt.ident(header["dataset_id"]) == fmt.ident(record["origin_id"])
                and header["shard_index"] == int(record["origin_index"])):
            return
    raise FormatError(replaced_while_open(path))


def replaced_while_open(path) -> str:
    """What a reader says of a shard path that names another file than the one its index described."""
    return (f"{path}: not the shard this dataset's index was loaded with (the dataset was replaced or rewritten "
            f"while open): open the dataset again")
