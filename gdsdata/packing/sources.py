"""What ``gdsdata pack`` can read: an ImageFolder tree, an LMDB of encoded images, WebDataset-style
tar shards. Each source lists (classes, items, ignored); an item names a sample and where its bytes
come from. Folder items are read by the packing workers; LMDB and tar items are read here, in order.

Label conventions:
- folder: one subfolder per class; labels are the indices of the sorted folder names (as
  torchvision's ImageFolder).
- LMDB: the common folder-to-LMDB layout (``tools/make_lmdb.py`` writes it): keys are the sample
  index as ASCII digits, values ``pickle.dumps((encoded_bytes, label))``; optional keys
  ``__len__`` and ``__classes__`` (pickled list of distinct names, refused otherwise); a value of
  another layout (not a pair; a label that is not an integer: 1.5) is listed with the reason
  (``special``), one whose image is not bytes skipped with the reason. Values are unpickled: pack
  only LMDBs you trust. Keys name the samples; keys that are not UTF-8 are kept byte for byte, as folder names are.
- tar (WebDataset): files grouped by their name up to the first dot of the last path component;
  one image member (``.jpg .jpeg .png ...``) and a ``.cls`` member holding the integer label per
  sample. Class names are the labels as text. A sample's further image members (``x.png`` beside
  ``x.jpg``, a mask ``x.seg.png``) are skipped unopened, each named with the reason (``special``):
  the packed one is the first in the tar whose extension is an image extension alone, else the first.
  A sample with a ``.cls`` that is not an integer, or with a member twice (suffixes in lower case, as
  WebDataset's keys), is skipped and named.
- Without class names (tar, an LMDB without ``__classes__``) every id up to the largest becomes a
  class named by its number, so labels must be ``0 <= label < UNNAMED_LABELS`` (2**20): a stray
  huge id would otherwise make hundreds of millions of classes.
"""

import copy
import errno
import functools
import operator
import os
import pickle
import re
import stat
import tarfile
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from gdsdata.args import file_url_path
from gdsdata.errors import BadImageError, SourceError, SourceGoneError, install_hint
from gdsdata.format.layout import INDEX_NAME

# The extensions torchvision's ImageFolder accepts; other files are ignored, not reported as bad.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The extensions Ultralytics takes as images of a YOLO split (its IMG_FORMATS, 8.4), and the formats it accepts
# by their content (PIL's names, lower case): files with other extensions are no images of the split, files of
# other formats are left out with the reason. HEIC/HEIF need the pillow-heif or pi-heif plugin, AVIF a Pillow
# built with it (11.3 on).
YOLO_IMAGE_EXTENSIONS = (".avif", ".bmp", ".dng", ".heic", ".heif", ".jp2", ".jpeg", ".jpg", ".mpo", ".png", ".tif",
                         ".tiff", ".webp")
YOLO_IMAGE_FORMATS = frozenset(e[1:] for e in YOLO_IMAGE_EXTENSIONS) | {"jpeg2000"}
TAR_EXTENSIONS = (".tar", ".tar.gz", ".tgz")  # WebDataset shards, plain or gzipped

# Labels without class names become the classes 0..largest, named by their numbers: the bound keeps a
# stray huge id from making a list of hundreds of millions of names (gigabytes, then out of memory).
# 2**20 is far above the label sets in use (ImageNet-21k: 21,841 classes; with names, any count).
UNNAMED_LABELS = 2**20


def unnamed_label_problem(label: int, noun="label"):
    """Why ``label`` cannot be a class id without class names, or None."""
    if label < 0:
        return f"{noun} {label} is negative (labels are class indices, from 0)"
    if label >= UNNAMED_LABELS:
        return (f"{noun} {label} is beyond {UNNAMED_LABELS - 1}, the largest without class names (every id up to "
                f"the largest becomes a class named by its number)")
    return None


@dataclass(frozen=True)
class Item:
    rel: str  # how reports and the index name the sample
    label: int
    path: str = None  # a file the worker reads (folder sources)
    ref: object = None  # how the source finds the bytes otherwise (LMDB key, tar member)
    boxes: object = field(default=None, compare=False)  # detection sources: BOX_RECORD rows
    size: tuple = None  # (width, height) the annotations were made for (COCO), checked when packed
    image_id: int = None  # COCO's image id (kept in the index: evaluation with COCO's API needs it)


# read errors that say the storage is gone (a network filesystem's mount dropped, a network down), not
# that one file is bad: skipping would go on skipping every file after it into a dataset that looks whole
_STORAGE_GONE = {getattr(errno, name) for name in (
    "ENOTCONN", "ESTALE", "ETIMEDOUT", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "ENETRESET",
    "ECONNABORTED", "ECONNRESET", "ECONNREFUSED", "ENODEV", "ENOMEDIUM") if hasattr(errno, name)}


def storage_gone(error: OSError) -> bool:
    """Whether a read's error says the source's storage is gone rather than that the file is bad."""
    return error.errno in _STORAGE_GONE or isinstance(error, (ConnectionError, TimeoutError))


def gone(path: str, error: OSError, what: str = "file") -> SourceGoneError:
    """The error a pack stops with where a read of ``path`` (a file, a tar of samples) found the
    storage gone (``storage_gone``)."""
    return SourceGoneError(f"{display(path)}: cannot read: {error.strerror or error} (the source's storage, not "
                           f"this {what}: the pack stops rather than skip the {what}s after it)")


def display(name: str) -> str:
    """A path as reports print it: bytes that are not UTF-8 as \\xNN escapes, faithfully."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _inside(path: str, folder: str) -> bool:
    """Whether the real path ``path`` is ``folder`` or lies in it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class FolderSource:
    """An ImageFolder tree, scanned so that nothing is lost or invented: folders that cannot be
    read are reported (``unreadable``; fatal with ``strict``), links are followed but a folder is
    visited once (by device and inode, so a link loop cannot repeat samples), files that are not
    regular files are skipped unopened with a reason, names may hold any bytes (kept as they are:
    ``os.fsencode`` of the path), and an empty class folder is refused, as torchvision's
    ImageFolder does, unless ``allow_empty``."""

    def __init__(self, src, strict=False, allow_empty=False):
        self.root = src
        if not os.path.exists(src):
            raise SourceError(f"{display(src)}: no such folder")
        if not os.path.isdir(src):
            raise SourceError(f"{display(src)}: not a folder (expected one subfolder per class){_detection_hint(src)}")
        if os.path.isfile(os.path.join(src, INDEX_NAME)):
            raise SourceError(f"{display(src)}: a gdsdata dataset already, not images to pack (to join datasets or "
                              f"copy one: gdsdata merge DATASET ... OUT, --copy for copies of the shards)")
        self.items, self.ignored, self.unreadable, self.special = [], [], [], []
        try:
            entries = sorted(os.scandir(src), key=lambda e: e.name)
        except OSError as e:
            raise SourceError(f"{display(src)}: cannot list it ({e.strerror or e})") from e
        self.classes = [entry.name for entry in entries if _is_dir(entry)]
        # files beside the class folders belong to no class (ImageFolder leaves them out too): listed as ignored
        self.ignored.extend(display(entry.name) for entry in entries if not _is_dir(entry))
        if not self.classes:
            raise SourceError(f"{display(src)}: no class subfolders (expected the ImageFolder layout SRC/CLASS/IMAGE)")
        if {"images", "labels"} <= set(self.classes) and _holds_labels(os.path.join(src, "labels")):
            raise SourceError(f"{display(src)}: a YOLO dataset (images/ and labels/ with .txt labels), not an "
                              f"ImageFolder tree of classes: pass --format yolo")
        tops = {}
        for name in self.classes:  # two class names for one folder: ImageFolder would label its images twice
            try:
                info = os.stat(os.path.join(src, name))
            except OSError:
                continue
            first = tops.setdefault((info.st_dev, info.st_ino), name)
            if first != name:
                link, other = (first, name) if os.path.islink(os.path.join(src, first)) else (name, first)
                raise SourceError(f"{display(os.path.join(src, link))}: a link to class {display(other)}'s folder: "
                                  f"a class twice, whose images torchvision's ImageFolder would label both ways; "
                                  f"remove one of them")
        # a class folder inside another's (through a link): ImageFolder would label its images both ways
        reals = sorted((tuple(os.path.realpath(os.path.join(src, name)).split(os.sep)), name)
                       for name in tops.values())
        for (outer, first), (inner, second) in zip(reals, reals[1:]):
            if inner[:len(outer)] == outer:
                raise SourceError(f"{display(os.path.join(src, second))}: a link into class {display(first)}'s "
                                  f"folder: its images would be labelled both ways; remove one of them")
        # each class folder is its own, also where it is a link out of the source (``_walk`` refuses
        # links to folders of the source outside the class it walks)
        seen = dict(tops)
        for label, name in enumerate(self.classes):
            before, unreadable = len(self.items), len(self.unreadable)
            self._walk(os.path.join(src, name), label, seen)
            self.items[before:] = sorted(self.items[before:], key=lambda item: _imagefolder_key(item.rel))
            if len(self.items) == before and not allow_empty and len(self.unreadable) == unreadable:
                raise SourceError(f"{display(os.path.join(src, name))}: class folder with no image files "
                                  f"(torchvision's ImageFolder refuses such a tree; pass --allow-empty-classes to keep "
                                  f"it as a class without samples)")
        if strict and self.unreadable:
            raise SourceError(f"{self.unreadable[0]['path']}: {self.unreadable[0]['reason']} (--strict)")
        if not self.items:
            raise SourceError(f"{display(src)}: no image files in its {len(self.classes)} class folders "
                              f"(extensions: {' '.join(IMAGE_EXTENSIONS)})")

    def _walk(self, top, label, seen):
        """Depth-first, in sorted order, each real folder once, and none of the source's outside this
        class's folder (a link into another class's folder would label its images with this class)."""
        root, own = os.path.realpath(self.root), os.path.realpath(top)
        stack = [(top, own)]  # (folder, its real path: a subfolder's is its parent's and its name, unless a link)
        while stack:
            folder, real = stack.pop()
            rel_folder = os.path.relpath(folder, self.root)
            if _inside(real, root) and not _inside(real, own):
                self.unreadable.append({"path": display(rel_folder),
                                        "reason": f"a link to {display(os.path.relpath(real, root))}, outside its "
                                                  f"class's folder in the source: not read here"})
                continue
            try:
                info = os.stat(folder)
                key = (info.st_dev, info.st_ino)
                if seen.get(key, rel_folder) != rel_folder:
                    self.unreadable.append({"path": display(rel_folder),
                                            "reason": f"the same folder as {display(seen[key])} (a link loop or a "
                                                      f"second link to it): not read twice"})
                    continue
                seen[key] = rel_folder
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as e:
                self.unreadable.append({"path": display(rel_folder), "reason": f"cannot read: {e.strerror or e}"})
                continue
            subfolders = []
            for entry in entries:
                rel = os.path.join(rel_folder, entry.name)
                if _is_dir(entry):
                    subfolders.append((entry.path, _real_path(entry, real)))
                    continue
                if not entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    self.ignored.append(display(rel))
                    continue
                try:
                    mode = entry.stat(follow_symlinks=True).st_mode
                except OSError as e:
                    self.unreadable.append({"path": display(rel), "reason": f"cannot read: {e.strerror or e}"})
                    continue
                if not stat.S_ISREG(mode):
                    kind = next((what for test, what in _SPECIAL if test(mode)), "not a regular file")
                    self.special.append({"path": display(rel), "reason": f"{kind}, not a file: skipped unopened"})
                    continue
                self.items.append(Item(rel, label, path=entry.path))
            stack.extend(reversed(subfolders))

    def read(self, item):
        return None  # the worker reads item.path

    def close(self):
        pass


def _imagefolder_key(rel: str) -> tuple:
    """Where torchvision's ImageFolder puts a class's file: its folders sorted by their paths as text
    (``sorted(os.walk(...))``: ``a/b-1`` before ``a/b/c``, as '-' sorts before '/'), each folder's
    files by name."""
    return os.path.dirname(rel), os.path.basename(rel)


def _real_path(entry, parent_real: str) -> str:
    """The real path of a folder found in the folder whose real path is ``parent_real``: that and its
    name, unless it is a link (``realpath`` of every folder anew would resolve every folder above it
    again: 1,100 folders nested took 14 s to list)."""
    try:
        linked = entry.is_symlink()
    except OSError:
        linked = True
    return os.path.realpath(entry.path) if linked else os.path.join(parent_real, entry.name)


def _is_dir(entry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=True)
    except OSError:
        return False


def _closed_if_it_fails(init):
    """A source's ``__init__`` that closes what it had opened (tar files, an LMDB environment) when it
    raises: a refused source leaves no file open behind it in a process that goes on."""

    @functools.wraps(init)
    def opening(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.close()
            raise

    return opening


class LmdbSource:
    @_closed_if_it_fails
    def __init__(self, src):
        self.root, self.env = src, None
        try:
            import lmdb
        except ImportError:
            raise SourceError(f"{display(src)}: an LMDB; packing it needs the lmdb package "
                              f"(pip install lmdb)") from None

        try:
            self.env = lmdb.open(src, readonly=True, lock=False, readahead=False, subdir=os.path.isdir(src))
        except lmdb.Error as e:
            raise SourceError(f"{src}: cannot open as LMDB ({e})") from e
        # a data file shorter than its pages (cut short by a copy) would end the process with SIGBUS as it is read
        data = os.path.join(src, "data.mdb") if os.path.isdir(src) else src
        needed = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        if os.path.getsize(data) < needed:
            raise SourceError(f"{display(data)}: an LMDB cut short ({os.path.getsize(data):,} bytes, its pages take "
                              f"{needed:,})")
        self.items, self.ignored, self.special = [], [], []
        try:
            raw_classes = self._list()
        except lmdb.Error as e:
            raise SourceError(f"{display(src)}: a damaged LMDB ({' '.join(str(e).split())})") from None
        self.items.sort(key=lambda item: (len(item.rel), item.rel))  # numeric keys in numeric order
        if not self.items:
            raise SourceError(f"{src}: the LMDB holds no (image bytes, label) values")
        if raw_classes:
            self.classes = _lmdb_classes(src, raw_classes)
            bad = next((item for item in self.items if not 0 <= item.label < len(self.classes)), None)
            if bad is not None:
                raise SourceError(f"{display(src)}: key {display(bad.rel)} has label {bad.label}, outside the "
                                  f"{len(self.classes)} classes of __classes__ (0..{len(self.classes) - 1})")
        else:
            for item in self.items:
                problem = unnamed_label_problem(item.label)
                if problem is not None:
                    hint = "" if item.label < 0 else "; store the class names under __classes__ (a pickled list) " \
                                                     "to use more"
                    raise SourceError(f"{display(src)}: key {display(item.rel)}: {problem}{hint}")
            self.classes = [str(k) for k in range(max(item.label for item in self.items) + 1)]

    def _list(self):
        """Its (image bytes, label) values as items (the others listed in ``special`` with the reason);
        returns ``__classes__``'s value."""
        with self.env.begin() as txn:
            raw_classes = txn.get(b"__classes__")
            for key, value in txn.cursor():
                if key.startswith(b"__"):
                    continue
                rel = bytes(key).decode("utf-8", "surrogateescape")  # the key's bytes, whatever they are
                label, problem = _lmdb_label(value)
                if problem is not None:  # a value of another layout is reported, not fatal
                    self.special.append({"path": display(rel), "reason": f"{problem}: skipped"})
                    continue
                self.items.append(Item(rel, label, ref=bytes(key)))
        return raw_classes

    def read(self, item):
        import lmdb

        try:
            with self.env.begin() as txn:
                value = txn.get(item.ref)
        except lmdb.Error as e:
            raise SourceError(f"{display(self.root)}: a damaged LMDB ({' '.join(str(e).split())})") from None
        if value is None:
            raise BadImageError("its key is gone from the LMDB (changed since it was listed)")
        try:
            data, _ = pickle.loads(value)
        except Exception as e:  # noqa: BLE001 - whatever the value unpickles to, this sample is skipped
            raise BadImageError(f"cannot unpickle its value ({type(e).__name__}: {e})") from None
        try:
            return bytes(memoryview(data))
        except TypeError:
            raise BadImageError(f"its value holds {_a(type(data).__name__)} where the encoded image bytes go "
                                f"(values are pickle.dumps((image_bytes, label)))") from None

    def close(self):
        if self.env is not None:
            self.env.close()


def _lmdb_label(value) -> tuple:
    """(an LMDB value's label, None), or (None, why the value is not ``pickle.dumps((image_bytes,
    label))``)."""
    try:
        pair = pickle.loads(value)
    except Exception as e:  # noqa: BLE001 - whatever fails to unpickle is the same refusal
        return None, f"its value does not unpickle ({type(e).__name__}: {e})"
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        return None, f"its value unpickles to {_a(type(pair).__name__)}, not an (image bytes, label) pair"
    given = pair[1]
    if isinstance(given, (str, bytes)):
        label = _decimal(given)
        return (None, f"its label {given[:20]!r} is not an integer") if label is None else (label, None)
    try:
        return operator.index(given), None  # int (bool too), NumPy's and torch's integers
    except TypeError:
        pass
    try:
        number = float(given)  # floats, NumPy's and torch's scalars and one-value arrays
    except (TypeError, ValueError):
        return None, f"its label is {_a(type(given).__name__)}, not an integer"
    if not number.is_integer():  # 1.5 is no class index, nor 1
        return None, f"its label {given} is not an integer"
    return int(number), None


def _decimal(text):
    """The integer ``text`` (str or bytes) spells in ASCII digits, an optional sign and surrounding
    whitespace, else None: ``int()`` would also read "1_0" as 10 and other scripts' digits."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    text = text.strip()
    return int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else None


def _lmdb_classes(src, raw) -> list:
    """The class names under ``__classes__``: a pickled list (or tuple) of distinct names."""
    try:
        classes = pickle.loads(raw)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is the same refusal
        raise SourceError(f"{display(src)}: key __classes__: cannot unpickle it ({type(e).__name__}: {e})") from e
    if not isinstance(classes, (list, tuple)):
        what = _a(type(classes).__name__)
    else:
        odd = [name for name in classes if not isinstance(name, str)][:1]
        counts = {} if odd else Counter(classes)
        twice = next((name for name in classes if counts.get(name, 0) > 1), None)
        what = (f"a list holding {_a(type(odd[0]).__name__)} ({str(odd[0])[:40]})" if odd else
                f"the name {twice!r} twice" if twice is not None else None)
    if what is not None:
        raise SourceError(f"{display(src)}: key __classes__ holds {what}, not a list of distinct class names (str); "
                          f"store pickle.dumps([name, ...]), a name for each label")
    return [str(name) for name in classes]


def _a(noun) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _unended(tar) -> "str | None":
    """Why ``tar`` (its members listed) does not end as an archive ends, or None. tarfile stops
    listing, without a word, at the first header it cannot read after the first member, and at the
    end of a file cut on a block boundary: what follows its last member must be tar's end-of-archive
    blocks (zero bytes, a block at least), read to the end of the file so that a gzip stream's
    checksum is checked too. Bytes after those blocks are ignored as GNU tar ignores them (some
    writers leave garbage there), unless they start another archive (tars joined with cat)."""
    stream = tar.fileobj
    stream.seek(tar.offset)
    zeros = 0
    while (block := stream.read(tarfile.BLOCKSIZE)) and not block.strip(b"\0"):
        zeros += len(block)
    if not block:
        return None if zeros >= tarfile.BLOCKSIZE else \
            "the file ends without tar's end-of-archive blocks (cut short, or written without them)"
    if not zeros:
        return "bytes that are no tar header"
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:  # garbage after the end blocks
        while stream.read(1 << 20):
            pass
        return None
    return "another archive after its end-of-archive blocks (tars joined with cat? tar reads the first only)"


class TarSource:
    @_closed_if_it_fails
    def __init__(self, src):
        self.root, self.tars = src, {}
        self.ignored, self.special = [], []
        paths = [src] if os.path.isfile(src) else sorted(
            os.path.join(src, n) for n in os.listdir(src) if n.endswith(TAR_EXTENSIONS))
        for path in [p for p in paths if not os.path.isfile(p)]:  # (opening a FIFO would wait for a writer)
            paths.remove(path)
            self.special.append({"path": display(os.path.basename(path)),
                                 "reason": "named as a tar shard but not a regular file: skipped unopened"})
        if not paths:
            raise SourceError(f"{display(src)}: no tar shards ({' '.join(TAR_EXTENSIONS)})")
        samples = {}  # (tar, key) -> {"images": [member, ...], "cls": member, "suffixes": {suffix: count}}
        for path in paths:
            try:
                tar = self.tars[path] = tarfile.open(path)
                members = tar.getmembers()
                damage = _unended(tar)
            except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise SourceError(f"{display(path)}: not a readable tar file ({reason})") from None
            if damage is not None:
                last = f"after {display(members[-1].name)}" if members else "at its start"
                raise SourceError(f"{display(path)}: a damaged tar file: {damage} {last} (byte {tar.offset}); "
                                  f"{len(members)} member(s) before it are readable, the rest is not: packing it "
                                  f"would leave samples out unseen")
            for member in members:
                if not member.isfile():
                    continue
                folder, name = os.path.split(member.name)
                key, _, ext = name.partition(".")
                entry = samples.setdefault((path, os.path.join(folder, key)), {"images": [], "suffixes": {}})
                suffix = ext.lower()  # (WebDataset's keys: lower case; a member without one is none of a sample's)
                if suffix:
                    entry["suffixes"][suffix] = entry["suffixes"].get(suffix, 0) + 1
                if ("." + suffix).endswith(IMAGE_EXTENSIONS):
                    entry["images"].append(member)
                elif suffix == "cls":
                    entry["cls"] = member  # (a second one: the sample is refused below, as a suffix seen twice)
        self.items, labels = [], set()
        for (path, key), entry in samples.items():
            rel = f"{os.path.basename(path)}/{key}"
            if not entry["images"] or "cls" not in entry:
                self.ignored.append(display(rel))
                continue
            repeated = [suffix for suffix, count in entry["suffixes"].items() if count > 1]
            if repeated:  # (WebDataset fails on a sample with a member twice; extracting keeps the last one)
                self.special.append({"path": display(rel),
                                     "reason": f"sample {display(os.path.basename(key))} has more than one "
                                               f"{' and more than one '.join('.' + r for r in repeated)} member: "
                                               f"skipped unopened"})
                continue
            # the first image whose extension is an image extension alone ("jpg", not "seg.png"), else the first
            image = min(entry["images"], key=lambda member: "." in os.path.basename(member.name).partition(".")[2])
            for other in entry["images"]:
                if other is not image:
                    self.special.append({"path": display(f"{os.path.basename(path)}/{other.name}"),
                                         "reason": f"a second image of sample {display(os.path.basename(key))} "
                                                   f"({display(os.path.basename(image.name))} is packed): "
                                                   f"skipped unopened"})
            cls = entry["cls"]
            text = self.tars[path].extractfile(cls).read()
            label = _decimal(text)
            if label is None:
                self.special.append({"path": display(f"{os.path.basename(path)}/{cls.name}"),
                                     "reason": f"a label that is not an integer ({text[:20]!r}): its sample "
                                               f"skipped unopened"})
                continue
            problem = unnamed_label_problem(label)
            if problem is not None:
                raise SourceError(f"{display(src)}: {display(os.path.basename(path))}/{display(cls.name)}: "
                                  f"{problem}; WebDataset labels carry no class names, so they must lie in "
                                  f"0..{UNNAMED_LABELS - 1}")
            labels.add(label)
            rel = f"{os.path.basename(path)}/{image.name}"
            self.items.append(Item(rel, label, ref=(path, image)))
        if not self.items:
            raise SourceError(f"{src}: no samples with an image and a .cls label")
        self.classes = [str(k) for k in range(max(labels) + 1)]

    def read(self, item):
        path, member = item.ref
        try:
            return self.tars[path].extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            if isinstance(e, OSError) and storage_gone(e):
                raise gone(path, e, "sample") from None
            raise BadImageError(f"cannot read it from {display(os.path.basename(path))} "
                                f"({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None

    def close(self):
        for tar in self.tars.values():
            tar.close()


def local_path(src):
    """``src`` with a ``file://`` URL turned into the path it names (fsspec's local files are read
    as paths are; SourceError naming the URL where that path is missing); anything else as it is."""
    if not (isinstance(src, str) and src.startswith("file://")):
        return src
    path = file_url_path(src)
    if path is None:
        from urllib.parse import urlparse

        raise SourceError(f"{src}: a file:// URL of another host ({urlparse(src).netloc}); give a path this machine "
                          f"sees")
    if not os.path.exists(path):
        link = f" (a link to {os.readlink(path)}, which is not there)" if os.path.islink(path) else ""
        raise SourceError(f"{src}: no such file or folder{link}")
    return path


def is_url(src) -> bool:
    """Whether ``src`` names a source through fsspec (``s3://``, ``gs://``, ``az://``, ``http://``...)."""
    return isinstance(src, str) and "://" in src and not src.startswith("file://")


class RemoteFolderSource:
    """An ImageFolder tree on object storage or any fsspec filesystem: class folders under the URL,
    listed in parallel (a thread per class folder); items are URLs the packing workers read
    themselves. Credentials come from the usual environment of the filesystem (AWS_*, GOOGLE_*,
    AZURE_* ...)."""

    def __init__(self, url, allow_empty=False, threads=16):
        from concurrent.futures import ThreadPoolExecutor

        fs, root = _filesystem(url)
        self.root, self.fs, self._url = url, fs, url.rstrip("/")
        with remote_errors(url):
            entries = fs.ls(root, detail=True)
        self.classes = sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory")
        if not self.classes:
            raise SourceError(f"{url}: no class folders (expected the ImageFolder layout URL/CLASS/IMAGE)")
        base = root.rstrip("/")

        def listing(name):
            with remote_errors(f"{url.rstrip('/')}/{name}"):
                found = fs.find(f"{base}/{name}", detail=True)
                return sorted(found.items(), key=lambda entry: _imagefolder_key(entry[0]))

        with ThreadPoolExecutor(min(threads, len(self.classes))) as pool:
            found = list(pool.map(listing, self.classes))
        protocol = url.split("://", 1)[0]
        self.items, self.ignored, self.unreadable, self.special = [], [], [], []
        self.sizes = {}  # the listing's object sizes, by relative path (an append compares them)
        for label, (name, paths) in enumerate(zip(self.classes, found)):
            images = 0
            for path, info in paths:
                rel = os.path.relpath(path, base)
                if path.lower().endswith(IMAGE_EXTENSIONS):
                    self.items.append(Item(rel, label, path=path if "://" in path else f"{protocol}://{path}"))
                    self.sizes[rel] = info.get("size")
                    images += 1
                else:
                    self.ignored.append(rel)
            if not images and not allow_empty:
                raise SourceError(f"{url}/{name}: class folder with no image files (pass --allow-empty-classes "
                                  f"to keep it as a class without samples)")
        if not self.items:
            raise SourceError(f"{url}: no image files in its {len(self.classes)} class folders")

    def read(self, item):
        return None  # the worker reads item.path through fsspec

    def close(self):
        pass


def _filesystem(url):
    try:
        import fsspec
    except ImportError:
        raise SourceError(f"{url}: a URL; reading it needs fsspec and its filesystem ({install_hint('remote')}; "
                          f"gcsfs, adlfs for other stores)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise SourceError(f"{url}: no fsspec filesystem for it ({e})") from None


@contextmanager
def remote_errors(url, missing="no such folder", doing="cannot list it"):
    """Whatever a filesystem call raises, as a ``SourceError`` of one line naming ``url`` and the reason:
    ``missing`` (not found), access denied, the endpoint out of reach, else ``doing`` and the error."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - each fsspec filesystem raises its own kinds (botocore, aiohttp ...)
        raise SourceError(f"{url}: {_remote_reason(url, e, missing, doing)}") from e


def _remote_reason(url, e, missing, doing) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, FileNotFoundError):  # s3fs: the path alone for a missing prefix, else the server's words
        return missing if not text or text.strip("/") in url else f"{missing} ({text})"
    if isinstance(e, PermissionError):
        return f"access denied ({text})"
    chain = [e]  # the error and what it was raised from (a connection refused, a timeout ...)
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if any(isinstance(x, (ConnectionError, TimeoutError)) or "Connect" in type(x).__name__ or
           "Timeout" in type(x).__name__ for x in chain):
        root = chain[-1]
        cause = getattr(root, "strerror", None) or str(root)
        return f"cannot reach the endpoint: {text}" + (f" ({cause})" if root is not e and cause not in text else "")
    return f"{doing} ({type(e).__name__}: {text})"


def read_url(url) -> bytes:
    """A packing worker's read of one object (fsspec)."""
    fs, path = _filesystem(url)
    return fs.cat_file(path)


def _fetched(url, where) -> str:
    """Tar shards and LMDBs at a URL are fetched to a local folder first (both need seeks)."""
    from urllib.parse import unquote

    fs, path = _filesystem(url)
    local = os.path.join(where, os.path.basename(path.rstrip("/")) or "source")
    with remote_errors(url, missing="no such file or folder", doing="cannot fetch it"):
        if fs.isdir(path):  # file by file (an HTTP server's listing names the folder itself as a file too)
            root = path.rstrip("/")
            web = "http" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))
            for name in sorted(fs.find(root)):
                rel = name[len(root) + 1:] if name.startswith(root + "/") else ""
                parts = (unquote(rel) if web else rel).split("/")  # (links are URL-quoted: %2F is a "/")
                if any(part in ("", ".", "..") or "\\" in part for part in parts):
                    continue  # the folder itself, its parent, a link elsewhere (never a path out of ``local``)
                target = os.path.join(local, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                fs.get_file(name, target)
        else:
            fs.get(path, local)
    return local


def _detection_hint(path) -> str:
    """What a detection source given as a classification one needs (``--format``), if it looks like one."""
    if str(path).lower().endswith((".yaml", ".yml")):
        return "; an Ultralytics data YAML needs --format yolo"
    if str(path).lower().endswith(".json"):
        return "; COCO annotations need --format coco ANNOTATIONS.json IMAGES OUT"
    return ""


def _holds_labels(folder, most=1000) -> bool:
    """Whether ``folder`` (a YOLO dataset's labels/, or its split folders) holds .txt files; looks at
    ``most`` entries at most."""
    for seen, (_, _, files) in enumerate(os.walk(folder)):
        if any(name.endswith(".txt") for name in files):
            return True
        if seen >= most:
            break
    return False


def open_source(src, strict=False, allow_empty=False):
    """The source at ``src``: an LMDB (a folder holding data.mdb, or an .lmdb/.mdb file), tar shards
    (a .tar, .tar.gz or .tgz file, or a folder of them and no class folders), else an ImageFolder tree; a URL reads
    through fsspec (an ImageFolder tree in place; tar shards and LMDBs fetched to a temporary folder)."""
    if isinstance(src, Listing):
        return src
    if is_url(src):
        if src.rstrip("/").endswith(TAR_EXTENSIONS + (".lmdb", ".mdb")) or _remote_kind(src) != "folder":
            import shutil
            import tempfile

            where = tempfile.mkdtemp(prefix="gdsdata-fetch-")
            try:
                source = open_source(_fetched(src, where), strict, allow_empty)
            except BaseException:
                shutil.rmtree(where, ignore_errors=True)
                raise
            source.root = src
            close = source.close

            def close_and_remove():  # the fetched copy goes with the source: nothing left filling the disk
                try:
                    close()
                finally:
                    shutil.rmtree(where, ignore_errors=True)

            source.close = close_and_remove
            return source
        return RemoteFolderSource(src, allow_empty=allow_empty)
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, "data.mdb")) or (os.path.isfile(src) and src.endswith((".lmdb", ".mdb"))):
        return LmdbSource(src)
    if os.path.isfile(src) and src.endswith(TAR_EXTENSIONS):
        return TarSource(src)
    if os.path.isdir(src):
        entries = list(os.scandir(src))
        if entries and not any(e.is_dir() for e in entries) and any(e.name.endswith(TAR_EXTENSIONS) for e in entries):
            return TarSource(src)
    return FolderSource(src, strict=strict, allow_empty=allow_empty)


def _remote_kind(url) -> str:
    fs, path = _filesystem(url)
    with remote_errors(url):
        names = [os.path.basename(n.rstrip("/")) for n in fs.ls(path, detail=False)]
    if "data.mdb" in names:
        return "lmdb"
    if names and all(n.endswith(TAR_EXTENSIONS) for n in names):
        return "tar"
    return "folder"


class Listing:
    """A listed folder source (local or remote), to hand to workers elsewhere (Ray tasks) without
    listing it again: its classes and items, read the way the source reads them."""

    # what packing reads of a source beyond its classes and items, with the value where a source has none
    # (YOLO's min_side and image_formats: the images Ultralytics' training leaves out, left out here too)
    CARRIED = {"ignored": [], "task": "classify", "format": "", "report": None, "category_ids": None,
               "unreadable": [], "special": [], "min_side": 0, "image_formats": None}

    def __init__(self, source):
        self.root, self.classes, self.items = source.root, source.classes, source.items
        for name, default in self.CARRIED.items():
            setattr(self, name, getattr(source, name) if hasattr(source, name) else copy.copy(default))

    def read(self, item):
        return None

    def close(self):
        pass
