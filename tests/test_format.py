"""The format module against docs/format.md, and the golden dataset against both."""

import json
import os
import pathlib
import re
import shutil
import zlib

import numpy as np
import pytest

from gdsdata.format import layout as fmt
from gdsdata.format import index as index_io
from gdsdata.dataset import GDSDataset
from gdsdata.errors import FormatError, GdsDataError
from gdsdata.packing.packer import pack

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "..", "docs", "format.md")
GOLDEN = os.path.join(HERE, "data", "golden")
_TYPES = {"u8": "|u1", "u16": "<u2", "u32": "<u4", "u64": "<u8", "f32": "<f4"}  # numpy's dtype.str


def _doc_tables():
    """{dtype name: (declared size, [(offset, size, type, field)])} from the '### NAME (N bytes)' sections."""
    tables, current = {}, None
    with open(DOC, encoding="utf-8") as f:
        for line in f:
            heading = re.match(r"### (\w+) \((\d+) bytes\)", line)
            if heading:
                current = heading.group(1)
                tables[current] = (int(heading.group(2)), [])
            elif line.startswith("#"):
                current = None
            elif current and re.match(r"\| \d+ \|", line):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                tables[current][1].append((int(cells[0]), int(cells[1]), cells[2], cells[3]))
    return tables


@pytest.mark.parametrize("name", ["INDEX_HEADER", "SHARD_RECORD", "SAMPLE_RECORD", "SHARD_HEADER", "BOX_RECORD"])
def test_dtype_matches_the_documented_byte_table(name):
    dtype = getattr(fmt, name)
    size, rows = _doc_tables()[name]
    assert dtype.itemsize == size
    assert [row[3] for row in rows] == list(dtype.names)
    for offset, width, kind, field in rows:
        field_dtype, field_offset = dtype.fields[field][:2]
        assert field_offset == offset, field
        assert field_dtype.itemsize == width, field
        if kind in _TYPES:
            assert field_dtype.str == _TYPES[kind], field
        else:
            assert kind == "bytes" and field_dtype.kind in "SV", field
    assert offset + width == size  # the table covers the whole structure


def test_every_multibyte_field_is_little_endian():
    for dtype in (fmt.INDEX_HEADER, fmt.SHARD_RECORD, fmt.SAMPLE_RECORD, fmt.SHARD_HEADER, fmt.BOX_RECORD):
        for name in dtype.names:
            field = dtype.fields[name][0]
            if field.kind in "iu" and field.itemsize > 1:
                assert field.str.startswith("<"), name


def test_golden_dataset_reads_as_recorded():
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        expected = json.load(f)
    index = index_io.load(os.path.join(GOLDEN, "ds"))
    assert index.version == 2  # packed before the annotation table (version 3): still read
    assert index.classes == expected["classes"]
    assert [index.path(i) for i in range(len(index))] == expected["paths"]
    for i, want in enumerate(expected["samples"]):
        assert {name: int(index.samples[i][name]) for name in index.samples.dtype.names} == want
    for s, want in enumerate(expected["shards"]):
        record = index.shards[s]
        assert {name: int(record[name]) for name in index.shards.dtype.names if name != "origin_id"} == want
        assert bytes(record["origin_id"]) == index.dataset_id  # a packed (not merged) dataset
    ds = GDSDataset(os.path.join(GOLDEN, "ds"))
    for i in range(len(ds)):
        image, label = ds[i]
        assert tuple(image.shape) == (3, expected["samples"][i]["height"], expected["samples"][i]["width"])
        assert label == expected["samples"][i]["label"]


def test_packing_the_golden_sources_reproduces_the_golden_bytes(tmp_path):
    out = str(tmp_path / "ds")
    pack(os.path.join(GOLDEN, "src"), out, workers=1, alignment=4096, shard_size=12288)
    fresh = index_io.load(out)
    golden = index_io.load(os.path.join(GOLDEN, "ds"))
    assert np.array_equal(fresh.samples, golden.samples)
    same = [n for n in golden.shards.dtype.names if n != "origin_id"]  # the id is random per pack
    assert np.array_equal(fresh.shards[same], golden.shards[same])
    assert fresh.strings == golden.strings
    for s in range(len(golden.shards)):
        with open(fresh.shard_path(s), "rb") as a, open(golden.shard_path(s), "rb") as b:
            fa, fb = a.read(), b.read()
        assert fa[fmt.SHARD_HEADER.itemsize:] == fb[fmt.SHARD_HEADER.itemsize:]
        assert fa[:24] == fb[:24]  # header up to the dataset id


def _copy_golden(tmp_path):
    target = tmp_path / "ds"
    shutil.copytree(os.path.join(GOLDEN, "ds"), target)
    return target


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _rewrite_crc(index_path):
    raw = pathlib.Path(index_path).read_bytes()
    _patch(index_path, fmt.INDEX_HEADER.fields["body_crc32"][1],
           np.uint32(zlib.crc32(raw[fmt.INDEX_HEADER.itemsize:])).astype("<u4").tobytes())


def test_truncated_index_is_refused(tmp_path):
    target = _copy_golden(tmp_path)
    path = target / fmt.INDEX_NAME
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(FormatError, match=r"index\.gdsi.*(truncated|outside)"):
        index_io.load(target)
    path.write_bytes(b"")
    with pytest.raises(FormatError, match="truncated index"):
        index_io.load(target)


def test_foreign_index_is_refused(tmp_path):
    target = _copy_golden(tmp_path)
    (target / fmt.INDEX_NAME).write_bytes(b"PK\x03\x04" + bytes(400))
    with pytest.raises(FormatError, match="not a gdsdata index"):
        index_io.load(target)


def test_unknown_version_is_refused(tmp_path):
    target = _copy_golden(tmp_path)
    _patch(target / fmt.INDEX_NAME, 8, np.uint16(99).astype("<u2").tobytes())
    with pytest.raises(FormatError, match="format version 99"):
        index_io.load(target)


def test_a_shard_header_whose_version_differs_from_its_index_s_is_said_damaged(tmp_path):
    """The index is this gdsdata's, so a shard claiming another version has a damaged header (a
    flipped bit), not a newer gdsdata's format: said so, not "upgrade"."""
    target = _copy_golden(tmp_path)
    shard = index_io.load(target).shard_path(0)
    _patch(shard, fmt.SHARD_HEADER.fields["version"][1], np.uint16(3).astype("<u2").tobytes())
    with pytest.raises(FormatError, match="shard format version 3 where its index, which this gdsdata reads, has "
                                          "version 2 shards: a damaged shard header"):
        GDSDataset(str(target))[0]


def test_corrupt_index_body_is_refused(tmp_path):
    target = _copy_golden(tmp_path)
    _patch(target / fmt.INDEX_NAME, fmt.INDEX_HEADER.itemsize + 3, b"\xff")
    with pytest.raises(FormatError, match="checksum mismatch"):
        index_io.load(target)


def test_index_pointing_past_a_shard_end_is_refused(tmp_path):
    target = _copy_golden(tmp_path)
    path = target / fmt.INDEX_NAME
    golden = index_io.load(target)
    record = golden.samples.dtype.fields["length"][1]
    _patch(path, int(golden.samples.dtype.itemsize) + fmt.INDEX_HEADER.itemsize
           + len(golden.shards) * fmt.SHARD_RECORD.itemsize + record, np.uint32(1 << 20).astype("<u4").tobytes())
    _rewrite_crc(path)
    with pytest.raises(FormatError, match=r"sample 1 .*past the end of its shard"):
        index_io.load(target)


@pytest.mark.parametrize("key, value, kind", [("part", 3, "int, not dict"), ("detection", [], "list, not dict"),
                                             ("appended", 7, "int, not list"), ("options", "x", "str, not dict")])
def test_metadata_of_the_wrong_shape_is_refused_in_one_line(tmp_path, key, value, kind):
    """Metadata that is JSON but not of the shapes the index's readers use (a writer's bug, an edit)
    is refused when the index loads, not met as a traceback in inspect, merge or an append."""
    target = _copy_golden(tmp_path)
    golden = index_io.load(target)
    meta = {**golden.meta, key: value}
    index_io.write(str(target), golden.alignment, golden.dataset_id, golden.shards, golden.samples,
                   bytes(golden.strings), meta)
    with pytest.raises(FormatError, match=re.escape(f"corrupt index metadata (its {key!r} is {kind})")):
        index_io.load(target)


def test_truncated_foreign_and_missing_shards_are_refused(tmp_path):
    target = _copy_golden(tmp_path)
    shard = target / fmt.shard_name(1)
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(FormatError, match=r"shard-00001\.gds: 5000 bytes on disk"):
        index_io.load(target)
    shard.write_bytes(b"\0" * 10)
    with pytest.raises(FormatError, match=r"shard-00001\.gds: truncated shard"):
        index_io.load(target)
    shard.write_bytes(b"RIFF" + bytes(12284))
    with pytest.raises(FormatError, match="not a gdsdata shard"):
        index_io.load(target)
    shutil.copy(os.path.join(GOLDEN, "ds", fmt.shard_name(1)), shard)
    _patch(shard, 24, b"x" * 16)
    with pytest.raises(FormatError, match="belongs to another dataset"):
        index_io.load(target)
    shard.unlink()
    with pytest.raises(FormatError, match="shard file missing"):
        index_io.load(target)


def test_a_fifo_named_as_a_shard_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO blocks until something writes to it: a shard path that is one (or a folder)
    is refused in one line as the dataset opens, also by verify, never a reader stuck for good."""
    from gdsdata.commands.verify import verify

    target = _copy_golden(tmp_path)
    shard = target / fmt.shard_name(0)
    shard.unlink()
    os.mkfifo(shard)
    for check in (lambda: index_io.load(target), lambda: GDSDataset(str(target))):
        with pytest.raises(FormatError, match=re.escape(f"{shard}: a FIFO where a shard file belongs")):
            check()
    assert any(f"{shard}: a FIFO where a shard file belongs" in p for p in verify(str(target)))
    shard.unlink()
    shard.mkdir()
    with pytest.raises(FormatError, match=re.escape(f"{shard}: a folder where a shard file belongs")):
        index_io.load(target)


def test_a_shard_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    """A shard the process may not open (root ignores chmod 000, so the refusal is played here): as the
    dataset opens, and as a sample is read from an open dataset, gdsdata's error naming the file and
    the system's reason, not a bare PermissionError; verify lists it."""
    from gdsdata.commands.verify import verify

    target = _copy_golden(tmp_path)
    shard = str(target / fmt.shard_name(0))
    ds = GDSDataset(str(target))
    real = os.open

    def refused(path, *args, **kwargs):
        if os.fspath(path) == shard:
            raise PermissionError(13, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    line = f"{shard}: cannot be read (Permission denied)"
    with pytest.raises(GdsDataError, match=re.escape(line)):
        ds[0]
    with pytest.raises(FormatError, match=re.escape(line)):
        GDSDataset(str(target))
    assert verify(str(target)) == [f"{line}: its samples are not checked"]
    ds.close()


def test_a_read_error_of_an_open_shard_names_it(tmp_path, monkeypatch):
    """EIO from a failing drive while an open shard is read: gdsdata's error naming the file and the
    reason (a bare OSError before)."""
    target = _copy_golden(tmp_path)
    ds = GDSDataset(str(target))
    ds[0]  # the shard is open

    def failing(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(GdsDataError, match=re.escape(f"{target / fmt.shard_name(0)}: cannot be read (Input/output "
                                                     f"error)")):
        ds[1]
    ds.close()


def test_a_fifo_named_as_the_index_or_a_journal_is_refused_not_waited_on(tmp_path):
    """The index, a journal, a report or a data YAML that is a FIFO: one line naming it (readers,
    verify and a resume had waited on it for good); an overwrite replaces such a dataset."""
    from conftest import write_photos
    from gdsdata.commands.verify import verify

    photos_source = str(tmp_path / "src")
    write_photos(photos_source, 9)
    target = _copy_golden(tmp_path)
    index = target / fmt.INDEX_NAME
    index.unlink()
    os.mkfifo(index)
    said = re.escape(f"{index}: a FIFO where an index belongs")
    for check in (lambda: index_io.load(target), lambda: GDSDataset(str(target)), lambda: verify(str(target))):
        with pytest.raises(FormatError, match=said):
            check()
    assert pack(photos_source, str(target), workers=1, overwrite=True).packed == 9
    out = tmp_path / "stopped"
    pack(photos_source, str(out), workers=1, shard_size=65536)
    (out / fmt.INDEX_NAME).unlink()  # (as a pack stopped before its index leaves it)
    (out / fmt.REPORT_NAME).unlink()
    for name in sorted(os.listdir(out)):
        if name.startswith("shard-"):
            with open(out / (name + fmt.JOURNAL_SUFFIX), "w") as f:
                f.write("{}")
    journal = out / (fmt.shard_name(0) + fmt.JOURNAL_SUFFIX)
    journal.unlink()
    os.mkfifo(journal)
    with pytest.raises(FormatError, match=re.escape(f"{journal}: a FIFO where a journal belongs")):
        pack(photos_source, str(out), workers=1, shard_size=65536, resume=True)
