"""What ``gdsdata pack`` can read: an ImageFolder tree, an LMDB of encoded images, WebDataset-style
tar shards. Each source lists (classes, items, ignored); an item names a sample and where its bytes
come from. Folder items are read by the packing workers; LMDB and tar items are read here, in order.

Label conventions:
- folder: one subfolder per class; labels are the indices of the sorted folder names (as
  torchvision's ImageFolder).
- LMDB: the common folder-to-LMDB layout (``tools/make_lmdb.py`` writes it): keys are the sample
  index as ASCII digits, values ``pickle.dumps((encoded_bytes, label))``; optional keys
  ``__len__`` and ``__classes__`` (pickled list of names). Values are unpickled: pack only LMDBs you
  trust.
- tar (WebDataset): files grouped by their name up to the first dot of the last path component;
  one image member (``.jpg .jpeg .png ...``) and a ``.cls`` member holding the integer label per
  sample. Class names are the labels as text.
"""

import os
import pickle
import tarfile
from dataclasses import dataclass

from .errors import SourceError

# The extensions torchvision's ImageFolder accepts; other files are ignored, not reported as bad.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class Item:
    rel: str  # how reports and the index name the sample
    label: int
    path: str = None  # a file the worker reads (folder sources)
    ref: object = None  # how the source finds the bytes otherwise (LMDB key, tar member)


class FolderSource:
    def __init__(self, src):
        self.root = src
        if not os.path.exists(src):
            raise SourceError(f"{src}: no such folder")
        if not os.path.isdir(src):
            raise SourceError(f"{src}: not a folder (expected one subfolder per class)")
        self.classes = sorted(entry.name for entry in os.scandir(src) if entry.is_dir())
        if not self.classes:
            raise SourceError(f"{src}: no class subfolders (expected the ImageFolder layout SRC/CLASS/IMAGE)")
        self.items, self.ignored = [], []
        for label, name in enumerate(self.classes):
            for root, _, names in sorted(os.walk(os.path.join(src, name), followlinks=True)):
                for fname in sorted(names):
                    path = os.path.join(root, fname)
                    rel = os.path.relpath(path, src)
                    if fname.lower().endswith(IMAGE_EXTENSIONS):
                        self.items.append(Item(rel, label, path=path))
                    else:
                        self.ignored.append(rel)
        if not self.items:
            raise SourceError(f"{src}: no image files in its {len(self.classes)} class folders "
                              f"(extensions: {' '.join(IMAGE_EXTENSIONS)})")

    def read(self, item):
        return None  # the worker reads item.path

    def close(self):
        pass


class LmdbSource:
    def __init__(self, src):
        import lmdb

        self.root = src
        try:
            self.env = lmdb.open(src, readonly=True, lock=False, readahead=False, subdir=os.path.isdir(src))
        except lmdb.Error as e:
            raise SourceError(f"{src}: cannot open as LMDB ({e})") from e
        self.items, self.ignored, labels = [], [], set()
        with self.env.begin() as txn:
            raw_classes = txn.get(b"__classes__")
            for key, value in txn.cursor():
                if key.startswith(b"__"):
                    continue
                try:
                    _, label = pickle.loads(value)
                    label = int(label)
                except Exception:  # noqa: BLE001 - a value of another layout is reported, not fatal
                    self.ignored.append(key.decode("utf-8", "replace"))
                    continue
                labels.add(label)
                self.items.append(Item(key.decode("utf-8", "replace"), label, ref=bytes(key)))
        self.items.sort(key=lambda item: (len(item.rel), item.rel))  # numeric keys in numeric order
        self.classes = (pickle.loads(raw_classes) if raw_classes
                        else [str(k) for k in range(max(labels, default=-1) + 1)])
        if not self.items:
            raise SourceError(f"{src}: the LMDB holds no (image bytes, label) values")
        bad = [item.rel for item in self.items if not 0 <= item.label < len(self.classes)]
        if bad:
            raise SourceError(f"{src}: key {bad[0]} has a label outside the {len(self.classes)} classes")

    def read(self, item):
        with self.env.begin() as txn:
            data, _ = pickle.loads(txn.get(item.ref))
        return bytes(data)

    def close(self):
        self.env.close()


class TarSource:
    def __init__(self, src):
        self.root = src
        paths = [src] if os.path.isfile(src) else sorted(
            os.path.join(src, n) for n in os.listdir(src) if n.endswith((".tar", ".tar.gz", ".tgz")))
        if not paths:
            raise SourceError(f"{src}: no .tar shards")
        self.tars = {}
        samples = {}  # (tar, key) -> {"image": member, "cls": member}
        self.ignored = []
        for path in paths:
            try:
                tar = self.tars[path] = tarfile.open(path)
                members = tar.getmembers()
            except (tarfile.TarError, OSError) as e:
                raise SourceError(f"{path}: not a readable tar file ({e})") from e
            for member in members:
                if not member.isfile():
                    continue
                folder, name = os.path.split(member.name)
                key, _, ext = name.partition(".")
                entry = samples.setdefault((path, os.path.join(folder, key)), {})
                if ("." + ext.lower()).endswith(IMAGE_EXTENSIONS):
                    entry["image"] = member
                elif ext == "cls":
                    entry["cls"] = member
        self.items, labels = [], set()
        for (path, key), entry in samples.items():
            rel = f"{os.path.basename(path)}/{key}"
            if "image" not in entry or "cls" not in entry:
                self.ignored.append(rel)
                continue
            try:
                label = int(self.tars[path].extractfile(entry["cls"]).read().decode().strip())
            except ValueError:
                self.ignored.append(rel)
                continue
            labels.add(label)
            rel = f"{os.path.basename(path)}/{entry['image'].name}"
            self.items.append(Item(rel, label, ref=(path, entry["image"])))
        if not self.items:
            raise SourceError(f"{src}: no samples with an image and a .cls label")
        self.classes = [str(k) for k in range(max(labels) + 1)]

    def read(self, item):
        path, member = item.ref
        return self.tars[path].extractfile(member).read()

    def close(self):
        for tar in self.tars.values():
            tar.close()


def open_source(src):
    """The source at ``src``: an LMDB (a folder holding data.mdb, or an .lmdb/.mdb file), tar shards
    (a .tar file, or a folder of them and no class folders), else an ImageFolder tree."""
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, "data.mdb")) or (os.path.isfile(src) and src.endswith((".lmdb", ".mdb"))):
        return LmdbSource(src)
    if os.path.isfile(src) and src.endswith((".tar", ".tar.gz", ".tgz")):
        return TarSource(src)
    if os.path.isdir(src):
        entries = list(os.scandir(src))
        if entries and not any(e.is_dir() for e in entries) and any(e.name.endswith(".tar") for e in entries):
            return TarSource(src)
    return FolderSource(src)
