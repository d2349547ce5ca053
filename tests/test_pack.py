"""Packing real images of every kind, and loading them back through the CPU Dataset."""

import glob
import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import jpeg_bytes, mean_abs_diff, photo, pil_reference, write_photos
from PIL import Image

from gdsdata.format import layout as fmt
from gdsdata.dataset import GDSDataset
from gdsdata.errors import BadImageError, OutputExistsError, SourceError
from gdsdata.packing.prepare import PackOptions
from gdsdata.packing.merge import merge
from gdsdata.packing.packer import pack


def test_every_kind_loads_like_pil(kinds_dataset):
    src, expected, out, _ = kinds_dataset
    ds = GDSDataset(out)
    stored = {ds.source(i): i for i in range(len(ds))}
    assert set(stored) == {p for p, outcome in expected.items() if outcome in ("as_is", "converted")}
    for rel, i in stored.items():
        image, label = ds[i]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert ds.classes[label] == rel.split(os.sep)[0]
        mad = mean_abs_diff(image, pil_reference(os.path.join(src, rel)))
        converted = bool(ds.index.samples[i]["flags"] & fmt.FLAG_CONVERTED)
        assert converted == (expected[rel] == "converted"), rel
        assert mad <= (4 if converted else 1), (rel, mad)


def test_jpegs_that_qualify_are_stored_byte_for_byte(kinds_dataset):
    src, expected, out, _ = kinds_dataset
    ds = GDSDataset(out)
    for i in range(len(ds)):
        rel = ds.source(i)
        if expected[rel] != "as_is":
            continue
        record = ds.index.samples[i]
        with open(ds.index.shard_path(int(record["shard"])), "rb") as f:
            f.seek(int(record["offset"]))
            stored = f.read(int(record["length"]))
        with open(os.path.join(src, rel), "rb") as f:
            assert stored == f.read(), rel


def test_report_lists_skipped_and_ignored(kinds_dataset):
    _, expected, out, result = kinds_dataset
    with open(os.path.join(out, fmt.REPORT_NAME)) as f:
        report = json.load(f)
    skipped = {item["path"]: item["reason"] for item in report["skipped"]}
    assert set(skipped) == {p for p, o in expected.items() if o == "skipped"}
    assert "empty file" in skipped[os.path.join("rocks", "empty.jpg")]
    assert "not an image" in skipped[os.path.join("rocks", "text.jpg")]
    assert "truncated" in skipped[os.path.join("rocks", "truncated.jpg")]
    assert report["ignored"] == [os.path.join("rocks", "notes.txt")]
    assert report["status"] == "complete"
    assert report["packed"] == result.packed == sum(o in ("as_is", "converted") for o in expected.values())
    assert result.report_path == os.path.join(out, fmt.REPORT_NAME)


def test_labels_follow_imagefolder(kinds_dataset):
    _, _, out, _ = kinds_dataset
    ds = GDSDataset(out)
    assert ds.classes == ["animals", "plants", "rocks"]
    assert ds.class_to_idx == {"animals": 0, "plants": 1, "rocks": 2}
    for i in range(len(ds)):
        assert ds.targets[i] == ds.classes.index(ds.source(i).split(os.sep)[0])
    from torchvision.datasets import ImageFolder

    src = kinds_dataset[0]
    folder = {os.path.relpath(path, src): label for path, label in ImageFolder(src).samples}
    assert ds.samples == ds.imgs == [(ds.source(i), folder[ds.source(i)]) for i in range(len(ds))]


def test_index_records_gpu_properties(kinds_dataset):
    src, _, out, _ = kinds_dataset
    ds = GDSDataset(out)
    samples = ds.index.samples
    for i in range(len(ds)):
        rel = ds.source(i)
        image = ds[i][0]
        assert (int(samples[i]["height"]), int(samples[i]["width"])) == tuple(image.shape[1:])
        assert samples[i]["offset"] % 4096 == 0
        assert samples[i]["codec"] == fmt.CODEC_JPEG
        gray = rel.endswith(("gray.jpg", "gray.png", "sixteen_bit.png"))
        assert samples[i]["components"] == (1 if gray else 3), rel
        allowed = ((fmt.SUBSAMPLING_GRAY,) if gray
                   else (fmt.SUBSAMPLING_420, fmt.SUBSAMPLING_422, fmt.SUBSAMPLING_444))
        assert samples[i]["subsampling"] in allowed, rel
    by_name = {os.path.basename(ds.source(i)): samples[i] for i in range(len(ds))}
    assert by_name["baseline444.jpg"]["subsampling"] == fmt.SUBSAMPLING_444
    assert by_name["baseline422.jpeg"]["subsampling"] == fmt.SUBSAMPLING_422


def test_strict_stops_at_first_bad_file_and_leaves_no_dataset(kinds_source, tmp_path):
    src, _ = kinds_source
    out = str(tmp_path / "strict")
    with pytest.raises(BadImageError, match=r"(empty|truncated|not an image|decodes only with warnings)"):
        pack(src, out, strict=True, workers=1)
    assert not os.path.exists(os.path.join(out, fmt.INDEX_NAME))
    assert not [n for n in os.listdir(out) if n.endswith((".gds", fmt.TMP_SUFFIX))]
    with open(os.path.join(out, fmt.REPORT_NAME)) as f:
        assert json.load(f)["status"] == "failed"
    result = pack(src, out, workers=1)  # only a failed pack's report there: packing again needs no --overwrite
    assert os.path.exists(os.path.join(out, fmt.INDEX_NAME)) and result.packed > 0


def test_a_pack_stopped_while_a_worker_sends_its_result_still_exits(tmp_path):
    """A packing worker terminated halfway through sending its result (a pack stopped by --strict's
    error or Ctrl-C while work is in flight) leaves half a message in the pool's results pipe: the
    pool's thread, and the interpreter's exit that joins it, must not wait on the rest for good.
    The half message is written here by hand, so that the race is there every time."""
    import subprocess
    import sys

    script = tmp_path / "stop.py"
    script.write_text(f"""
import multiprocessing, os, struct, sys, time
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..")!r})
from gdsdata.packing.packer import _quiet_worker, _stop
pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"), initializer=_quiet_worker,
                           initargs=(os.getpid(),))
assert pool.submit(abs, -1).result() == 1
manager = pool._executor_manager_thread
os.write(pool._result_queue._writer.fileno(), struct.pack("!i", 1 << 16) + b"half a result")
time.sleep(0.5)  # the pool's thread now reads the half message
_stop(pool)
manager.join(20)
print("stuck" if manager.is_alive() else "ok", flush=True)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout, done.stderr[-2000:])


def test_jpegs_libjpeg_decodes_only_with_warnings_are_listed_with_the_warning(tmp_path, capsys):
    """A JPEG cut short (then closed) or with damaged entropy data decodes in PIL as libjpeg makes
    of it (gray, or noise, where data is missing): it is packed as PIL decodes it, as torchvision's
    ImageFolder would read it, but never without a word: the summary and the report list it."""
    from conftest import jpeg_bytes, photo

    from gdsdata.cli import main

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    whole = jpeg_bytes(photo(3), quality=90)
    (src / "whole.jpg").write_bytes(whole)
    (src / "cut.jpg").write_bytes(whole[:len(whole) * 2 // 3] + b"\xff\xd9")
    out = str(tmp_path / "ds")
    assert main(["pack", str(tmp_path / "src"), out, "-q"]) == 0
    said = capsys.readouterr().out
    assert "  1 JPEG(s) decode only with libjpeg's warnings (damaged or odd data): stored as PIL decodes them " \
           "(re-encoded), each with the warning:\n    a/cut.jpg: libjpeg: Corrupt JPEG data: premature end of data " \
           "segment; stored as PIL decodes it" in said, said
    with open(os.path.join(out, fmt.REPORT_NAME)) as f:
        assert json.load(f)["repaired"] == [{"path": "a/cut.jpg", "reason": "libjpeg: Corrupt JPEG data: premature "
                                             "end of data segment; stored as PIL decodes it"}]
    strict = str(tmp_path / "strict")
    assert main(["pack", str(tmp_path / "src"), strict, "-q", "--strict"]) == 1  # --strict: the first bad file
    assert capsys.readouterr().err == (
        f"gdsdata: error: {src / 'cut.jpg'}: libjpeg: Corrupt JPEG data: premature end of data segment: it decodes "
        f"only with warnings (without --strict: stored as PIL decodes it, listed under repaired)\n")
    assert not os.path.exists(os.path.join(strict, fmt.INDEX_NAME))


def test_max_side_resizes(tmp_path):
    src = str(tmp_path / "src")
    paths = write_photos(src, 4, classes=1, scale=1.0)
    out = str(tmp_path / "ds")
    pack(src, out, options=PackOptions(max_side=200), workers=1)
    ds = GDSDataset(out)
    for i, rel in enumerate(paths):
        image = ds[i][0]
        assert max(image.shape[1:]) == 200
        assert ds.index.samples[i]["flags"] & fmt.FLAG_RESIZED
        ref = pil_reference(os.path.join(src, rel))
        scale = 200 / max(ref.shape[:2])
        assert abs(image.shape[1] - ref.shape[0] * scale) <= 1


def test_shards_roll_over_and_payloads_are_aligned(photos_dataset):
    src, paths, out = photos_dataset
    ds = GDSDataset(out)
    assert len(ds.index.shards) > 1
    assert [ds.source(i) for i in range(len(ds))] == paths
    sizes = ds.index.shards["size"]
    assert all(os.path.getsize(os.path.join(out, fmt.shard_name(s))) == sizes[s] for s in range(len(sizes)))
    assert np.all(ds.index.samples["offset"] % ds.index.alignment == 0)


def test_existing_output_is_left_untouched(photos_dataset, tmp_path):
    src, _, out = photos_dataset
    before = {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
    with pytest.raises(OutputExistsError, match="--overwrite"):
        pack(src, out)
    assert before == {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    for overwrite in (False, True):  # never offered --overwrite, which would be refused
        with pytest.raises(OutputExistsError, match="did not write") as refused:
            pack(src, str(foreign), overwrite=overwrite)
        assert "--overwrite" not in str(refused.value) and "new or empty folder" in str(refused.value)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_overwrite_replaces_a_dataset(tmp_path):
    src = str(tmp_path / "src")
    write_photos(src, 6, classes=2)
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    first = GDSDataset(out).index.dataset_id
    pack(src, out, workers=1, overwrite=True)
    again = GDSDataset(out)
    assert again.index.dataset_id != first and len(again) == 6


@pytest.mark.parametrize("layout", ["missing", "file", "empty", "no_images"])
def test_bad_sources_are_named(tmp_path, layout):
    src = tmp_path / "src"
    if layout == "file":
        src.write_text("x")
    elif layout == "empty":
        src.mkdir()
    elif layout == "no_images":
        (src / "cls").mkdir(parents=True)
        (src / "cls" / "readme.md").write_text("x")
    with pytest.raises(SourceError, match=str(src)):
        pack(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_nothing_packable_leaves_no_dataset(tmp_path):
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    (src / "a.jpg").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(SourceError, match="none of its 1 image files"):
        pack(str(tmp_path / "src"), str(out))
    assert not (out / fmt.INDEX_NAME).exists()


def test_interrupted_pack_never_looks_finished(tmp_path, monkeypatch):
    """A crash after some shards were written leaves no index, so loading fails clearly."""
    from gdsdata.format import index as index_io
    from gdsdata.errors import FormatError

    src = str(tmp_path / "src")
    write_photos(src, 12, classes=2)
    out = str(tmp_path / "ds")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(index_io, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        pack(src, out, workers=1, shard_size=300_000)
    assert not os.path.exists(os.path.join(out, fmt.INDEX_NAME))
    with pytest.raises(FormatError, match="not a finished gdsdata dataset"):
        GDSDataset(out)


def test_raw_codec_stores_pixels(tmp_path):
    src = str(tmp_path / "src")
    paths = write_photos(src, 4, classes=2)
    out = str(tmp_path / "raw")
    pack(src, out, options=PackOptions(codec="raw", raw_size=64), workers=1)
    ds = GDSDataset(out)
    for i, rel in enumerate(paths):
        image = ds[i][0]
        assert min(image.shape[1:]) == 64
        assert ds.index.samples[i]["codec"] == fmt.CODEC_RAW
        assert ds.index.samples[i]["length"] == image.numel()


def test_public_pack_is_the_function():
    import gdsdata
    import gdsdata.packing.packer  # noqa: F401 - importing the module must not shadow the function

    assert callable(gdsdata.pack) and gdsdata.pack is gdsdata.packing.packer.pack


def test_a_multi_picture_jpeg_packs_its_first_picture_and_appends_beside_it(tmp_path):
    """A phone's .jpg holding a second picture (MPF): its first picture is stored (flagged as not the
    file byte for byte), and an append over the same folder takes it as the image it packed."""
    from PIL import Image

    src = tmp_path / "src"
    for name in ("cat", "dog"):
        (src / name).mkdir(parents=True)
    first, second = Image.new("RGB", (80, 60), (200, 30, 30)), Image.new("RGB", (80, 60), (30, 200, 30))
    first.save(src / "cat" / "phone.jpg", "MPO", save_all=True, append_images=[second])
    Image.new("RGB", (80, 60), (9, 9, 9)).save(src / "dog" / "a.jpg")
    out = str(tmp_path / "ds")
    pack(str(src), out, workers=1)
    ds = GDSDataset(out)
    k = [ds.source(i) for i in range(len(ds))].index(os.path.join("cat", "phone.jpg"))
    assert ds.index.samples[k]["flags"] & fmt.FLAG_CONVERTED
    assert int(ds.index.samples[k]["length"]) < os.path.getsize(src / "cat" / "phone.jpg")
    Image.new("RGB", (80, 60), (1, 2, 3)).save(src / "dog" / "b.jpg")
    assert pack(str(src), out, workers=1, append=True).new == 1 and len(GDSDataset(out)) == 3


def test_a_file_that_is_no_image_is_one_reason_also_after_ultralytics_is_imported(monkeypatch):
    """Ultralytics replaces PIL's Image.open, process-wide, with one that pip-installs a HEIF plugin
    when a file is no image: packing uses PIL's own and fetches nothing."""
    pytest.importorskip("ultralytics")
    from PIL import Image

    from gdsdata.packing.prepare import prepare

    original = Image.open
    try:
        import ultralytics.utils.checks as checks
        import ultralytics.utils.patches as patches

        Image.open = patches.image_open  # as importing it left it (a test may have put PIL's back since)
        monkeypatch.setattr(checks, "check_requirements", lambda *a, **k: pytest.fail("fetched a package"))
        with pytest.raises(BadImageError, match="not an image PIL can identify"):
            prepare(b"plain text, no image", PackOptions())
    finally:
        Image.open = original


def test_sixteen_bit_gray_images_keep_their_high_byte(tmp_path):
    """A 16-bit gray PNG or TIFF is stored as OpenCV reads it (each pixel's high byte), not as PIL's
    conversion gives it (clipped to white); 32-bit integer pixels within 8 bits stay as they are,
    beyond them (no scale known) the file is skipped with the reason, and so is one of 12 bits or
    fewer in 16 (its high bytes: 16 levels of gray or fewer, black under 256)."""
    values = (np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) * 21) % 65536
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(values.astype(np.uint16)).save(tmp_path / "src" / "a" / "sixteen.png")
    Image.fromarray(values.astype(np.uint16)).save(tmp_path / "src" / "a" / "sixteen.tif")
    Image.fromarray((values % 256).astype(np.int32), "I").save(tmp_path / "src" / "a" / "eight_in_i.tif")
    wide = values.astype(np.int32) * 2 - 70000
    Image.fromarray(wide, "I").save(tmp_path / "src" / "a" / "wide.tif")
    Image.fromarray((values % 1000).astype(np.int32), "I").save(tmp_path / "src" / "a" / "i32.tif")  # no known scale
    Image.fromarray((values % 4096).astype(np.uint16)).save(tmp_path / "src" / "a" / "twelve.png")  # 12 bits in 16
    Image.fromarray((values % 200).astype(np.uint16)).save(tmp_path / "src" / "a" / "dark.png")
    result = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1, options=PackOptions(codec="raw"))
    assert sorted((s["path"], s["reason"]) for s in result.skipped) == [
        ("a/dark.png", "16-bit pixels from 0 to 199: their high bytes, the 8-bit image OpenCV reads, hold 1 level(s) "
                       "(black); convert it to 8 bits with its own scale first"),
        ("a/i32.tif", "32-bit integer pixels from 0 to 999: no 8-bit image without choosing a scale (convert it "
                      "to 8 bits first)"),
        ("a/twelve.png", "16-bit pixels from 0 to 4095: their high bytes, the 8-bit image OpenCV reads, hold 16 "
                         "level(s); convert it to 8 bits with its own scale first"),
        ("a/wide.tif", f"32-bit integer pixels from -70000 to {wide.max()}: no 8-bit image without choosing a "
                       f"scale (convert it to 8 bits first)")]
    ds = GDSDataset(str(tmp_path / "ds"))
    expected = {"a/sixteen.png": values >> 8, "a/sixteen.tif": values >> 8, "a/eight_in_i.tif": values % 256}
    assert sorted(ds.source(i) for i in range(len(ds))) == sorted(expected)
    for i in range(len(ds)):
        image, _ = ds[i]
        assert (image.numpy() == expected[ds.source(i)].astype(np.uint8)).all(), ds.source(i)


def test_a_file_url_packs_the_folder_it_names(tmp_path):
    import urllib.parse

    write_photos(str(tmp_path / "my src"), 4, classes=2)
    url = "file://" + urllib.parse.quote(str(tmp_path / "my src"))
    result = pack(url, str(tmp_path / "ds"), workers=1)
    reference = pack(str(tmp_path / "my src"), str(tmp_path / "reference"), workers=1)
    assert result.packed == reference.packed == 4
    ds, ref = GDSDataset(str(tmp_path / "ds")), GDSDataset(str(tmp_path / "reference"))
    assert [ds.source(i) for i in range(4)] == [ref.source(i) for i in range(4)]
    assert all((ds[i][0] == ref[i][0]).all() for i in range(4))
    with pytest.raises(SourceError, match="a file:// URL of another host"):
        pack("file://elsewhere/data", str(tmp_path / "other"), workers=1)
    missing = "file://" + urllib.parse.quote(str(tmp_path / "no src"))  # named as given, as other URLs are
    with pytest.raises(SourceError, match=f"^{re.escape(missing)}: no such file or folder$"):
        pack(missing, str(tmp_path / "other"), workers=1)
    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(SourceError, match=re.escape(f"file://{tmp_path}/link: no such file or folder (a link to "
                                                    f"{tmp_path}/gone, which is not there)")):
        pack(f"file://{tmp_path}/link", str(tmp_path / "other"), workers=1)
    os.remove(tmp_path / "link")
    assert sorted(os.listdir(tmp_path)) == ["ds", "my src", "reference"]


def test_a_dataset_given_as_the_source_is_refused_naming_merge(tmp_path):
    write_photos(str(tmp_path / "src"), 4, classes=2)
    pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1)
    with pytest.raises(SourceError, match=f"{tmp_path / 'ds'}: a gdsdata dataset already, not images to pack "
                                          r"\(to join datasets or copy one: gdsdata merge"):
        pack(str(tmp_path / "ds"), str(tmp_path / "again"), workers=1)
    assert not os.path.exists(tmp_path / "again")


def test_float_pixels_pack_as_pil_converts_them_only_on_the_8_bit_scale(tmp_path):
    """32-bit float TIFFs ("F"): values on 0..255 are stored as PIL converts them (truncated); a 0..1
    image, which that conversion turns black, values beyond 0..255 and NaN are skipped with the
    reason, never stored as silently wrong pixels."""
    ramp = np.linspace(0, 250, 64 * 48, dtype=np.float32).reshape(48, 64)
    (tmp_path / "src" / "a").mkdir(parents=True)
    files = {"eight.tif": ramp, "unit.tif": ramp / 255, "wide.tif": ramp * 4 - 100, "mask.tif": (ramp > 99) * 1.0,
             "nan.tif": np.where(ramp > 99, np.nan, ramp), "zero.tif": ramp * 0}
    for name, values in files.items():
        Image.fromarray(values.astype(np.float32), "F").save(tmp_path / "src" / "a" / name)
    result = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1, options=PackOptions(codec="raw"))
    assert sorted((s["path"], s["reason"]) for s in result.skipped) == [
        ("a/mask.tif", "32-bit float pixels from 0 to 1 (a 0-1 scale?): an 8-bit image of them is black (convert it "
                       "to 8 bits first)"),
        ("a/nan.tif", "32-bit float pixels that are not all finite (NaN or infinity): no 8-bit image (convert it "
                      "to 8 bits first)"),
        ("a/unit.tif", "32-bit float pixels from 0 to 0.980392 (a 0-1 scale?): an 8-bit image of them is black "
                       "(convert it to 8 bits first)"),
        ("a/wide.tif", "32-bit float pixels from -100 to 900: no 8-bit image without choosing a scale (convert it "
                       "to 8 bits first)")]
    ds = GDSDataset(str(tmp_path / "ds"))
    assert [ds.source(i) for i in range(len(ds))] == ["a/eight.tif", "a/zero.tif"]
    for i in range(len(ds)):
        expected = np.asarray(Image.open(tmp_path / "src" / ds.source(i)).convert("RGB"))
        assert (ds[i][0].permute(1, 2, 0).numpy() == expected).all(), ds.source(i)


def test_an_unbounded_stall_timeout_packs_with_workers(tmp_path):
    """stall_timeout=inf turns the bound off (as for a Loader): the pool's waits are then unbounded,
    not an OverflowError from a wait of infinite seconds."""
    import gdsdata

    write_photos(str(tmp_path / "src"), 12, classes=2)
    with gdsdata.settings.set(stall_timeout=float("inf")):
        result = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=2)
    assert result.packed == 12 and not result.skipped


def test_the_automatic_choice_packs_with_worker_processes_also_on_one_core(tmp_path, monkeypatch):
    """Only an explicit workers=1 prepares images in the pack's own process (no stall bound there):
    the automatic choice on a machine with one usable core is still a pool, whose waits are bounded."""
    from gdsdata import settings
    from gdsdata.packing import packer

    write_photos(str(tmp_path / "src"), 4, classes=2)
    asked = []
    real = packer._results
    monkeypatch.setattr(settings, "usable_cores", lambda: 1)
    monkeypatch.setattr(packer, "_results", lambda jobs, workers: asked.append(workers) or real(jobs, workers))
    assert pack(str(tmp_path / "src"), str(tmp_path / "auto"), workers=0).packed == 4
    assert pack(str(tmp_path / "src"), str(tmp_path / "one"), workers=1).packed == 4
    assert asked == [2, 1]


def test_nested_folders_keep_imagefolder_s_sample_order(tmp_path):
    """Sample i is ImageFolder's sample i, also where folder names hold characters that sort before
    '/' (torchvision sorts os.walk's folders by their paths: c0/sub-1 before c0/sub/deeper)."""
    from torchvision.datasets import ImageFolder

    src = tmp_path / "src"
    for k, folder in enumerate(("c0", "c0/sub", "c0/sub/deeper", "c0/sub-1", "c0/sub.x", "c0/sub 2", "c1")):
        os.makedirs(src / folder, exist_ok=True)
        for name in ("b.jpg", "A.jpg"):
            Image.new("RGB", (8, 8), (k * 30, 0, 0)).save(src / folder / name)
    ds = GDSDataset(pack(str(src), str(tmp_path / "ds"), workers=1).out)
    theirs = [(os.path.relpath(path, src), label) for path, label in ImageFolder(str(src)).samples]
    assert ds.samples == theirs and len(theirs) == 14


def test_running_out_of_memory_converting_an_image_says_so(tmp_path, monkeypatch):
    """A MemoryError (whose message is empty) is reported as what it is, with the image's size."""
    from PIL import PngImagePlugin

    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.new("L", (40, 30)).save(tmp_path / "src" / "a" / "big.png")
    real = Image.Image.convert

    def convert(self, mode=None, *args, **kwargs):
        if isinstance(self, PngImagePlugin.PngImageFile) and mode == "RGB":
            raise MemoryError()
        return real(self, mode, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", convert)
    write_photos(str(tmp_path / "src"), 2, classes=1)
    result = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1)
    assert result.skipped == [{"path": "a/big.png", "reason": "out of memory converting its 40x30 L pixels to RGB"}]


def test_images_beside_the_class_folders_are_listed_as_ignored(tmp_path):
    """Files directly in SRC belong to no class (torchvision's ImageFolder leaves them out too): the
    report lists them as ignored instead of dropping them without a word."""
    write_photos(str(tmp_path / "src"), 3, classes=1)
    Image.new("RGB", (8, 8)).save(tmp_path / "src" / "stray.jpg")
    result = pack(str(tmp_path / "src"), str(tmp_path / "ds"), workers=1)
    assert result.packed == 3 and result.ignored == ["stray.jpg"]
    assert json.loads((tmp_path / "ds" / "pack_report.json").read_text())["ignored"] == ["stray.jpg"]


def _with_bad_files(root, photos=10, bad=3):
    """``photos`` good JPEGs and ``bad`` files that are no images, in class folders."""
    paths = write_photos(root, photos)
    for k in range(bad):
        with open(os.path.join(root, f"class{k % 3}", f"bad{k}.jpg"), "wb") as f:
            f.write(b"\xff\xd8\xff not a JPEG")
    return paths


def test_max_skipped_stops_a_pack_that_skips_more_and_keeps_one_that_does_not(tmp_path):
    """--max-skipped N (or P% of the files): past it the pack stops as --strict does (no dataset, a
    failed report listing what was skipped); within it the pack completes, each skipped file listed."""
    src = str(tmp_path / "src")
    paths = _with_bad_files(src)  # 13 files, 3 of them bad
    for limit in (2, "20%"):  # 20 % of 13: 2
        out = str(tmp_path / f"over-{limit}".replace("%", "pc"))
        with pytest.raises(BadImageError, match=rf"3 file\(s\) left out, more than --max-skipped "
                                                rf"{limit}.*allows; the last: class2/bad2.jpg: "):
            pack(src, out, max_skipped=limit, workers=1)
        assert sorted(os.listdir(out)) == [fmt.REPORT_NAME]
        with open(os.path.join(out, fmt.REPORT_NAME)) as f:
            report = json.load(f)
        assert report["status"] == "failed" and len(report["skipped"]) == 3
    for k, limit in enumerate((3, "25%", "3")):
        result = pack(src, str(tmp_path / f"within-{k}"), max_skipped=limit, workers=1)
        assert result.packed == len(paths) and sorted(s["path"] for s in result.skipped) == \
            [f"class{k}/bad{k}.jpg" for k in range(3)]
    for wrong in (-1, "x", "101%", "+2", "1e3", "nan%", 1.5, True):
        with pytest.raises((ValueError, TypeError)):
            pack(src, str(tmp_path / "never"), max_skipped=wrong)
    assert not os.path.exists(tmp_path / "never")


def test_max_skipped_counts_every_part_together_at_the_merge(tmp_path):
    src = str(tmp_path / "src")
    paths = _with_bad_files(src, photos=12, bad=4)
    parts = [str(tmp_path / f"part{k}") for k in range(2)]
    for k, part in enumerate(parts):
        pack(src, part, num_parts=2, part=k, workers=1, max_skipped="50%")  # (a part's share of its own files)
    out = str(tmp_path / "merged")
    with pytest.raises(BadImageError, match=r"part0, .*part1: 4 file\(s\) left out, more than "
                                            r"--max-skipped 3 allows; class0/bad0.jpg: .* \.\.\.$"):
        merge(parts, out, max_skipped=3)
    assert not os.path.exists(out)
    assert merge(parts, out, max_skipped="25%")["samples"] == len(paths)  # 25 % of 16: 4
    report = os.path.join(parts[1], fmt.REPORT_NAME)
    for damaged in ('{"skipped": 5}', '{"skipped": "abc"}', '{"skipped": [{"reason": "no path"}]}', "{"):
        with open(report, "w") as f:
            f.write(damaged)
        with pytest.raises(SourceError, match=r"no readable pack_report.json \(missing or damaged\) to count"):
            merge(parts, str(tmp_path / "merged2"), max_skipped=10)
    os.remove(report)
    with pytest.raises(SourceError, match="no readable pack_report.json"):
        merge(parts, str(tmp_path / "merged2"), max_skipped=10)
    assert not os.path.exists(tmp_path / "merged2")


def test_max_skipped_shares_are_exact_and_an_overwrite_past_it_keeps_the_dataset(tmp_path):
    from gdsdata.args import skips_allowed

    assert [skips_allowed(share, 100) for share in ("29%", "57%", "12.5%", "0%", "100%")] == [29, 57, 12, 0, 100]
    assert skips_allowed("58%", 50) == 29 and skips_allowed(7, 50) == 7 and skips_allowed(None, 50) is None
    src, good = str(tmp_path / "src"), str(tmp_path / "good")
    _with_bad_files(src)
    pack(src, good, workers=1, max_skipped=3)
    with open(os.path.join(good, fmt.REPORT_NAME)) as f:
        kept = f.read()
    with pytest.raises(BadImageError, match=r"allows; class0/bad0.jpg: [^(]*; class2/bad2.jpg: [^(]*$"):
        pack(src, good, workers=1, overwrite=True, max_skipped=2)  # (no report in OUT lists them: the line does)
    with open(os.path.join(good, fmt.REPORT_NAME)) as f:
        assert f.read() == kept
    assert len(GDSDataset(good)) == 10


def test_max_skipped_counts_files_the_listing_could_not_read(tmp_path):
    src = str(tmp_path / "src")
    _with_bad_files(src, bad=1)
    os.symlink(str(tmp_path / "gone.jpg"), os.path.join(src, "class1", "link.jpg"))  # listed, never readable
    out = str(tmp_path / "over")
    with pytest.raises(BadImageError, match=r"2 file\(s\) left out, more than --max-skipped 1 allows"):
        pack(src, out, workers=1, max_skipped=1)
    with open(os.path.join(out, fmt.REPORT_NAME)) as f:
        report = json.load(f)
    assert (len(report["unreadable"]), len(report["skipped"])) == (1, 1)
    result = pack(src, str(tmp_path / "within"), workers=1, max_skipped="17%")  # 17 % of 12 files: 2
    assert result.packed == 10 and len(result.unreadable) == 1
    # a part of several: what the listing left out is a share of the whole source's files (1 of 12), not
    # of the part's own (6), which its own skipped files are
    whole = str(tmp_path / "whole")
    _with_bad_files(whole, photos=11, bad=0)
    os.symlink(str(tmp_path / "gone.jpg"), os.path.join(whole, "class1", "link.jpg"))
    part = pack(whole, str(tmp_path / "part0"), workers=1, num_parts=2, part=0, max_skipped="9%")
    assert len(part.unreadable) == 1 and part.packed in (5, 6)
    with pytest.raises(BadImageError, match=r"1 file\(s\) left out, more than --max-skipped 8% \(0 of 12 files\)"):
        pack(whole, str(tmp_path / "part0-over"), workers=1, num_parts=2, part=0, max_skipped="8%")


def test_max_skipped_on_append_counts_only_files_the_dataset_did_not_leave_out_before(tmp_path):
    """An append tries again the files its dataset's report lists as skipped: under --max-skipped
    they count once (at the pack that first skipped them), not at each append."""
    src, out = str(tmp_path / "src"), str(tmp_path / "ds")
    _with_bad_files(src, photos=6, bad=2)
    pack(src, out, workers=1, max_skipped=2)
    result = pack(src, out, append=True, workers=1, max_skipped=0)  # nothing new: the same two bad files
    assert result.new == 0 and len(result.skipped) == 2
    with open(os.path.join(src, "class0", "zz_new_bad.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff broken")
    with open(os.path.join(src, "class1", "zz_new.jpg"), "wb") as f:
        f.write(jpeg_bytes(photo(500)))
    with pytest.raises(BadImageError, match=r"1 file\(s\) left out, more than --max-skipped 0 "
                                            r"allows; class0/zz_new_bad.jpg: "):
        pack(src, out, append=True, workers=1, max_skipped=0)
    assert len(GDSDataset(out)) == 6  # (the dataset as it was)
    result = pack(src, out, append=True, workers=1, max_skipped=1)
    assert result.new == 1 and len(GDSDataset(out)) == 7
    assert pack(src, out, append=True, workers=1, max_skipped=0).new == 0  # its report lists all three now
    held = sorted(glob.glob(os.path.join(src, "class1", "*.jpg")))[0]  # a file the dataset holds, gone since:
    os.remove(held)  # not left out of it (an append adds, it does not remove)
    os.symlink(str(tmp_path / "gone.jpg"), held)
    result = pack(src, out, append=True, workers=1, max_skipped=0)
    assert result.new == 0 and [item["path"] for item in result.unreadable] == [os.path.relpath(held, src)]
