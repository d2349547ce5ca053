"""The command line: one clear line and a non-zero exit for every error, never a traceback."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import write_photos

import gdsdata
from gdsdata.format import layout as fmt


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "gdsdata.cli", *args], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def run_on_a_terminal(*args):
    """run(), with stderr a terminal (a pseudo-terminal read as it is written)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (no columns: an empty bar)
    chunks = []

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # (the terminal closed: all was read)
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "gdsdata.cli", *args], stdout=subprocess.PIPE, stderr=slave,
                          text=True, timeout=300)
    os.close(slave)
    reader.join(30)
    os.close(master)
    return proc.returncode, proc.stdout, b"".join(chunks).decode(errors="replace")


def assert_one_line_error(rc, err, *needles):
    assert rc == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("gdsdata: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def small_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("cli_src")
    write_photos(str(src), 9, classes=3)
    (src / "class0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 nope")
    return str(src)


def test_pack_inspect_verify(small_src, tmp_path):
    out = str(tmp_path / "ds")
    rc, stdout, err = run("pack", small_src, out, "--workers", "2", "--shard-size", "256K")
    assert rc == 0, err
    assert "packed 9 images" in stdout and "skipped 1 file" in stdout and "broken.jpg" in stdout
    assert os.path.join(out, fmt.REPORT_NAME) in stdout
    rc, stdout, _ = run("inspect", out)
    assert rc == 0 and "9 samples, 3 classes" in stdout and "overhead" in stdout
    rc, stdout, _ = run("inspect", out, "--json")
    info = json.loads(stdout)
    assert info["samples"] == 9 and info["codecs"] == {"jpeg": 9} and info["alignment"] == 4096
    rc, stdout, _ = run("verify", out, "-q")
    assert rc == 0 and "every sample decodes" in stdout


def test_output_cut_short_by_its_reader_is_no_error(small_src, tmp_path):
    """``gdsdata inspect DS | head -1``: the reader goes after one line; the rest goes nowhere, quietly."""
    out = str(tmp_path / "ds")
    assert run("pack", small_src, out)[0] == 0
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-m", "gdsdata.cli", "inspect", out], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        assert "error" not in err and "Traceback" not in err, err


def test_errors_are_one_line(small_src, tmp_path):
    assert_one_line_error(*run("pack", str(tmp_path / "missing"), str(tmp_path / "o"))[::2], "no such folder")
    out = str(tmp_path / "ds")
    assert run("pack", small_src, out, "-q")[0] == 0
    assert_one_line_error(*run("pack", small_src, out, "-q")[::2], "--overwrite")
    assert_one_line_error(*run("pack", small_src, os.path.join(out, "sub"), "-q")[::2], "inside the dataset")
    assert not os.path.exists(os.path.join(out, "sub"))
    assert_one_line_error(*run("pack", small_src, str(tmp_path / "s"), "--strict", "-q")[::2], "broken.jpg")
    assert_one_line_error(*run("pack", small_src, str(tmp_path / "m"), "--max-skipped", "0", "-q")[::2],
                          "1 file(s) left out, more than --max-skipped 0 allows; the last: class0/broken.jpg")
    assert run("pack", small_src, str(tmp_path / "m1"), "--max-skipped", "10%", "-q")[0] == 0  # 1 of 10 files
    for k in range(2):  # the parts' reports counted together by merge --max-skipped (nothing written past it)
        assert run("pack", small_src, str(tmp_path / f"p{k}"), "--num-parts", "2", "--part", str(k), "-q")[0] == 0
    parts = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    assert_one_line_error(*run("merge", *parts, str(tmp_path / "pm"), "--max-skipped", "0", "-q")[::2],
                          "1 file(s) left out, more than --max-skipped 0 allows; class0/broken.jpg: ")
    assert not os.path.exists(tmp_path / "pm")
    assert_one_line_error(*run("inspect", small_src)[::2], "not a finished gdsdata dataset")
    assert_one_line_error(*run("inspect", os.path.join(out, fmt.shard_name(0)))[::2], "a file, not a dataset folder")
    for option, value, said in (("--quality", "0", "0 is outside 1..100"), ("--workers", "-3", "-3 is outside 0..4096"),
                                ("--shard-size", "0", "'0' is no size (at least 1 byte)"),
                                ("--num-parts", "0", "0 is below 1"), ("--max-side", "x", "'x' is not an integer"),
                                ("--max-skipped", "5x", "'5x' is neither a count of files (10) nor a share of them "
                                                        "(0.5%)"), ("--max-skipped", "-1", "-1 is below 0"),
                                ("--max-skipped", "200%", "200% is over 100%")):
        rc, _, err = run("pack", small_src, str(tmp_path / "q"), option, value)  # a usage error, as argparse's
        assert rc == 2 and err == f"gdsdata pack: error: argument {option}: {said} (see gdsdata pack --help)\n"
    for command in ("info", "inspect"):  # (info: inspect's alias, named as typed)
        assert run(command)[2] == (f"gdsdata {command}: error: the following arguments are required: DATASET "
                                   f"(see gdsdata {command} --help)\n")
    rc, _, err = run("pack", small_src, str(tmp_path / "q"), "--max-skipped=-5%")  # (-5% alone reads as an option)
    assert rc == 2 and err == "gdsdata pack: error: argument --max-skipped: -5% is below 0 (see gdsdata pack --help)\n"
    assert not os.path.exists(tmp_path / "q")
    with open(os.path.join(out, fmt.INDEX_NAME), "r+b") as f:
        f.truncate(100)
    assert_one_line_error(*run("verify", out)[::2], "truncated index")


def test_an_empty_path_is_a_usage_error_not_the_current_folder(small_src, tmp_path, monkeypatch):
    """``gdsdata pack "$SRC" "$OUT"`` with a variable unset: os.path makes "" the current folder,
    which would be packed, or written into."""
    monkeypatch.chdir(tmp_path)
    said = 'an empty path (a shell variable left unset?); name the folder, "." for the current one'
    for command, args, name in (("pack", (small_src, ""), "SRC OUT"), ("pack", ("", "o"), "SRC OUT"),
                                ("pack", (small_src, "o", "--shard-root", ""), "--shard-root"),
                                ("merge", ("", "o"), "PARTS"), ("merge", ("p", ""), "OUT"),
                                ("inspect", ("",), "DATASET"), ("verify", ("",), "DATASET"),
                                ("doctor", ("",), "DATASET")):
        rc, _, err = run(command, *args)
        assert rc == 2 and err == f"gdsdata {command}: error: argument {name}: {said} (see gdsdata {command} --help)\n"
    assert os.listdir(tmp_path) == []
    for call in (lambda: gdsdata.pack(small_src, ""), lambda: gdsdata.pack("", "o"),
                 lambda: gdsdata.pack(small_src, "o", shard_roots=[""]), lambda: gdsdata.merge(["p"], "")):
        with pytest.raises(ValueError, match="is an empty path"):
            call()
    assert os.listdir(tmp_path) == []


def test_an_out_given_as_a_url_is_refused_not_made_a_local_folder_named_after_it(small_src, tmp_path,
                                                                                 monkeypatch):
    """``gdsdata pack SRC s3://bucket/ds`` would otherwise write ``./s3:/bucket/ds`` and exit 0."""
    monkeypatch.chdir(tmp_path)
    said = "out is a URL; a dataset is written to a local or mounted folder (cuFile reads its shards there)"
    for command, args in (("pack", (small_src, "s3://bucket/ds")), ("pack", (small_src, "memory://ds", "--append")),
                          ("merge", (small_src, "gs://bucket/ds"))):
        rc, out, err = run(command, *args, "-q")
        assert (rc, out, err) == (1, "", f"gdsdata: error: {args[1]}: {said}\n")
    local = str(tmp_path / "ds")
    assert run("pack", small_src, f"file://{local}")[2] == \
        f"gdsdata: error: file://{local}: {said}: give the path, {local}\n"
    assert os.listdir(tmp_path) == []
    rc, _, err = run("pack", small_src, "ds", "--shard-root", "s3://bucket/roots", "-q")  # (nor a shard root)
    assert (rc, err) == (1, "gdsdata: error: s3://bucket/roots: a shard root is a URL; a dataset is written to a "
                            "local or mounted folder (cuFile reads its shards there)\n")
    for call in (lambda: gdsdata.pack(small_src, "s3://bucket/ds"), lambda: gdsdata.merge([small_src], "az://c/ds"),
                 lambda: gdsdata.pack(small_src, pathlib.Path("s3://bucket/ds"))):  # (a Path keeps "s3:/bucket")
        with pytest.raises(ValueError, match="is a URL"):
            call()
    assert os.listdir(tmp_path) == []


def test_verify_names_bad_samples(small_src, tmp_path):
    out = str(tmp_path / "ds")
    assert run("pack", small_src, out, "-q")[0] == 0
    with open(os.path.join(out, fmt.shard_name(0)), "r+b") as f:
        f.seek(4096 + 3)
        f.write(b"\0" * 400)
    rc, _, err = run("verify", out, "-q")
    assert rc == 1 and "Traceback" not in err
    assert "bad: " in err and "sample 0 (class0/" in err and "problem(s)" in err
    shard = os.path.join(out, fmt.shard_name(0))
    os.truncate(shard, 5000)  # cut short: inspect still says what the index holds, and which shard is damaged
    rc, stdout, err = run("info", out)  # (inspect's other name)
    assert rc == 1 and stdout.startswith(f"{os.path.abspath(out)}: 9 samples, ") and "Traceback" not in err
    first, last = err.splitlines()
    assert first.startswith(f"bad: {shard}: 5000 bytes on disk, the index records ") and first.endswith(
        "(truncated or replaced shard)")
    assert last == f"gdsdata: 1 shard(s) of {out} are damaged, so it does not open (gdsdata verify checks every sample)"


def test_verify_checks_each_dataset_it_is_given(small_src, tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    assert run("pack", small_src, good, "-q")[0] == 0 and run("pack", small_src, bad, "-q")[0] == 0
    with open(os.path.join(bad, fmt.shard_name(0)), "r+b") as f:
        f.seek(4096 + 3)
        f.write(b"\0" * 400)
    missing = str(tmp_path / "missing")
    rc, stdout, err = run("verify", bad, missing, good, "-q")  # every one checked, whatever came before
    assert rc == 1 and "Traceback" not in err
    assert stdout == f"{good}: all checksums match and every sample decodes\n"
    assert f"problem(s) in {bad}" in err and f"gdsdata: error: {missing}" in err
    assert run("verify", good, good, "-q")[0] == 0


def test_usage_errors_exit_2_in_one_line():
    rc, _, err = run("pack")
    assert rc == 2 and err.strip().count("\n") == 0 and "required" in err and "gdsdata pack --help" in err
    rc, _, err = run("pack", "a", "b", "--shard-size", "lots")
    assert rc == 2 and err.strip().count("\n") == 0 and "not a size" in err
    rc, _, err = run("pack", "a", "b", "--bogus")  # said by the command it was given to
    assert rc == 2 and err.strip() == "gdsdata pack: error: unrecognized arguments: --bogus (see gdsdata pack --help)"
    rc, _, err = run("--bogus", "pack", "a", "b")  # given to gdsdata itself
    assert rc == 2 and err.strip() == "gdsdata: error: unrecognized arguments: --bogus (see gdsdata --help)"


def test_doctor_reports_the_cpu_path():
    rc, stdout, _ = run("doctor", "--json")
    info = json.loads(stdout)
    assert rc == 0 and "torch" in info
    cores = info["cpu cores"]  # (the cores this process may use, and the machine's where fewer)
    assert cores == os.cpu_count() or cores.endswith(f"of {os.cpu_count()} (this process's CPU affinity)")
    assert "half the host's memory" in info["streaming"]
    if info["gpu"].startswith("none"):  # which of the GPU path's packages are here
        assert [part.split()[0].split("-")[0] for part in info["gpu packages"].split("; ")] == [
            "kvikio", "cupy", "nvjpeg" if "nvjpeg not installed" in info["gpu packages"] else "nvidia"]


def test_doctor_says_when_the_io_engine_setting_decides_streaming():
    from gdsdata import settings
    from gdsdata.commands.doctor import report

    with settings.set(io_engine="direct"):
        assert report()["streaming"].startswith("every dataset is read past the page cache")
    with settings.set(io_engine="mmap"):
        assert "(mmap) picks every dataset's reads" in report()["streaming"]


def test_the_pack_summary_names_what_it_ignored_and_a_part_s_empty_classes(tmp_path):
    """A stray file beside the class folders is named, not only counted; a part whose share of the
    source holds none of a class says that the class is empty in this part, not in the source."""
    src = tmp_path / "src"
    write_photos(str(src), 6, classes=2)
    (src / "notes.txt").write_text("not an image")
    rc, stdout, err = run("pack", str(src), str(tmp_path / "ds"), "-q")
    assert rc == 0 and "ignored 1 file(s) or sample(s) holding no labelled image" in stdout, err
    assert "a .cls): notes.txt (pack_report.json lists them)" in stdout and "hold no sample" not in stdout
    rc, stdout, err = run("pack", str(src), str(tmp_path / "p0"), "--num-parts", "2", "--part", "0", "-q")
    assert rc == 0 and "1 class(es) hold no sample in this part (other parts may hold them): class1" in stdout, \
        stdout + err


def test_parts_merge_append_and_resume_from_the_command_line(small_src, tmp_path):
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    for k, part in enumerate(parts):
        rc, stdout, err = run("pack", small_src, part, "--num-parts", "2", "--part", str(k), "-q")
        assert rc == 0, err
    merged = str(tmp_path / "merged")
    rc, stdout, err = run_on_a_terminal("merge", *parts, merged)
    assert rc == 0 and "merged 2 dataset(s)" in stdout and "9 samples" in stdout, err
    assert "link: 100%" in err  # the progress bar on a terminal (copying may take long); -q hides it
    rc, stdout, err = run("merge", *parts, str(tmp_path / "logged"))  # in a log file: a line as it starts and ends
    lines = err.splitlines()
    assert rc == 0 and "merged 2 dataset(s)" in stdout and "\r" not in err, err
    assert lines[0].startswith("link:   0%") and lines[-1].startswith("link: 100%") and len(lines) <= 3, err
    rc, stdout, err = run("merge", *parts, str(tmp_path / "copied"), "--copy", "-q")
    assert rc == 0 and "merged 2 dataset(s)" in stdout and err == "", err
    rc, stdout, err = run("-q", "merge", *parts, str(tmp_path / "quiet"), "--copy")  # -q before the command too
    assert rc == 0 and "merged 2 dataset(s)" in stdout and err == "", err
    assert run("inspect", merged, "-v")[0] == 0  # and -v after it
    from gdsdata.cli import build_parser

    for argv in (["-v", "-q", "verify", merged], ["verify", merged, "-q", "-v"], ["-q", "info", merged, "-v"]):
        parsed = build_parser().parse_args(argv)
        assert parsed.verbose and parsed.quiet, argv
    parsed = build_parser().parse_args(["verify", merged])
    assert not parsed.verbose and not parsed.quiet
    assert "merged from 2 part(s)" in run("inspect", merged)[1]
    assert "part 1 of 2" in run("inspect", parts[1])[1]
    assert_one_line_error(*run("merge", *parts, merged)[::2], "--overwrite")
    leftover = tmp_path / "leftover"  # what an interrupted merge leaves: --overwrite, never --resume (merge has none)
    leftover.mkdir()
    (leftover / fmt.shard_name(0)).write_bytes(b"")
    said = assert_one_line_error(*run("merge", *parts, str(leftover))[::2], "--overwrite")
    assert "--resume" not in said
    # the one file left to add is the broken one: nothing appended, it is listed, the dataset untouched
    index = pathlib.Path(os.path.join(merged, fmt.INDEX_NAME)).read_bytes()
    rc, stdout, err = run("pack", small_src, merged, "--append", "-q")
    assert rc == 0 and stdout.startswith(f"nothing to append: {merged} holds the rest of {small_src} already"), err
    assert "skipped 1 file(s), each with its reason" in stdout
    assert pathlib.Path(os.path.join(merged, fmt.INDEX_NAME)).read_bytes() == index
    assert run("verify", merged, "-q")[0] == 0
    extra = str(tmp_path / "extra")
    write_photos(extra, 3, classes=1, start_seed=900)
    os.rename(os.path.join(extra, "class0"), os.path.join(extra, "zebra"))  # a new class: every file new
    rc, stdout, err = run("pack", extra, merged, "--append", "-q")
    assert rc == 0 and stdout.startswith("appended 3 images in ") and "now holds 12 images in" in stdout, err
    rc, stdout, err = run("pack", extra, merged, "--append", "-q")  # up to date: says so, succeeds, writes nothing
    assert rc == 0 and stdout.startswith(f"nothing to append: {merged} holds every image of {extra} already"), err
    assert run("verify", merged, "-q")[0] == 0
    assert_one_line_error(*run("pack", small_src, merged, "--resume", "-q")[::2], "already a finished dataset")
    rc, _, err = run("pack", small_src, str(tmp_path / "x"), "--num-parts", "2", "--part", "2")
    assert rc == 2 and err == ("gdsdata pack: error: --part 2 is not one of the 2 part(s) (0..1) (see gdsdata pack "
                               "--help)\n")


def test_pack_resume_is_safe_to_repeat(small_src, tmp_path):
    """A retry wrapper that always passes --resume: the first run packs (nothing to resume), the
    next says the pack is finished and succeeds, one with other options is refused in one line."""
    out = str(tmp_path / "ds")
    rc, stdout, err = run("pack", small_src, out, "--resume", "-q")
    assert rc == 0 and stdout.startswith("packed 9 images in 1 shard(s)"), err
    assert f"{out}: nothing to resume (no finished shard of an interrupted pack there): packing from the start" in err
    index = pathlib.Path(out, fmt.INDEX_NAME).read_bytes()
    rc, stdout, err = run("pack", small_src, out, "--resume", "-q")
    assert rc == 0 and stdout.startswith(f"nothing to resume: {out} is finished, packed from {small_src} with these "
                                         f"options (9 images in 1 shard(s), "), err
    assert f"  report: {os.path.join(out, fmt.REPORT_NAME)}" in stdout
    assert "skipped 1 file" in stdout and "broken.jpg" in stdout  # (what the pack left out, said again)
    assert pathlib.Path(out, fmt.INDEX_NAME).read_bytes() == index
    assert_one_line_error(*run("pack", small_src, out, "--resume", "--shard-size", "64K", "-q")[::2],
                          "already a finished dataset, which differs from this pack: shard_size 1073741824 then, "
                          "65536 now; nothing to resume")
    rc, _, err = run("pack", small_src, out, "--resume", "--overwrite")
    assert rc == 2 and "--resume keeps what an interrupted pack finished, --overwrite replaces it" in err


def test_pack_resume_never_touches_a_folder_of_other_files(small_src, tmp_path):
    """--resume into a folder of the user's (a mistyped OUT): refused in one line, as a plain pack
    and --overwrite refuse it, every file left as it was, also those named like gdsdata's own files
    but not quite (thesis.tmp, lab.journal, shard-2024.gds)."""
    out = tmp_path / "mine"
    out.mkdir()
    files = {"notes.txt": b"important", "thesis.tmp": b"draft", "lab.journal": b"log", "shard-2024.gds": b"data"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    for extra in ((), ("--overwrite",)):
        rc, _, err = run("pack", small_src, str(out), "--resume" if not extra else extra[0], "-q")
        assert_one_line_error(rc, err, "holds files gdsdata did not write", "left untouched")
    rc, _, err = run("pack", small_src, str(out), "-q")
    assert_one_line_error(rc, err, "holds files gdsdata did not write")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


def test_pack_refuses_an_empty_part_and_a_raw_size_for_jpegs(small_src, tmp_path):
    said = assert_one_line_error(*run("pack", small_src, str(tmp_path / "x"), "--num-parts", "40", "--part", "0")[::2],
                                 "would hold no image")
    assert "at most 10 parts" in said  # (one of its 10 image files cannot be decoded: a part can still hold it)
    for args, said in ((("--size", "64"), "--size (the shorter side of raw pixels) goes with --codec raw"),
                       (("--alignment", "1000"), "--alignment 1000 is not a power of two of at least 64"),
                       (("--part", "1"), "--part goes with --num-parts N"),
                       (("--ray", "--resume"), "--ray packs every part itself"),
                       (("--append", "--overwrite"), "--append goes with none of --resume, --overwrite"),
                       (("--split", "val"), "--split picks a split of a YOLO dataset (--format yolo); a folder of "
                                            "class folders has none: give the split's own folder as SRC"),
                       (("--num-parts", "3"), "--num-parts 3 packs one part a run: give --part K (0..2) on each "
                                              "machine and join them with gdsdata merge, or --ray")):
        rc, _, err = run("pack", small_src, str(tmp_path / "y"), *args)  # usage errors: exit 2, one line
        assert rc == 2 and err.startswith(f"gdsdata pack: error: {said}") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_an_append_that_sorts_new_classes_first_says_which_labels_changed(small_src, tmp_path):
    out, extra = str(tmp_path / "ds"), str(tmp_path / "extra")
    assert run("pack", small_src, out, "-q")[0] == 0
    write_photos(extra, 2, classes=1, start_seed=900)
    os.rename(os.path.join(extra, "class0"), os.path.join(extra, "aardvark"))
    rc, stdout, err = run("pack", extra, out, "--append", "-q")
    assert rc == 0 and "got a new label (class0, class1" in stdout, err


def test_doctor_shows_how_a_dataset_loads(small_src, tmp_path):
    out = str(tmp_path / "ds")
    assert run("pack", small_src, out, "-q")[0] == 0
    code, printed, _ = run("doctor", out, "--device", "cpu")
    assert code == 0
    assert "reads: preadv" in printed and "decoder: libjpeg-turbo" in printed and "checksums: host" in printed


def test_a_class_left_without_samples_is_said(tmp_path):
    """Every file of a class skipped: the pack goes on (each file named), and the summary says the class
    holds no sample."""
    src = tmp_path / "src"
    write_photos(str(src), 2, classes=1, start_seed=950)
    (src / "broken").mkdir()
    (src / "broken" / "a.jpg").write_bytes(b"\xff\xd8\xff not a JPEG")
    rc, stdout, err = run("pack", str(src), str(tmp_path / "ds"), "-q")
    assert rc == 0 and "skipped 1 file(s)" in stdout, err
    assert "1 class(es) hold no sample: broken" in stdout


def test_an_append_stores_its_images_as_the_dataset_did(small_src, tmp_path):
    """--append without options takes the dataset's (its images downscaled and re-encoded as the
    first pack's were, the recorded options unchanged); other options are refused in one line,
    the dataset left as it was (one dataset of mixed sizes or codecs would otherwise pass verify)."""
    from gdsdata.format.index import load

    out, extra = str(tmp_path / "ds"), str(tmp_path / "extra")
    assert run("pack", small_src, out, "--max-side", "40", "--quality", "80", "-q")[0] == 0
    write_photos(extra, 3, classes=1, start_seed=700)
    before = load(out).fingerprint
    rc, _, err = run("pack", extra, out, "--append", "--codec", "raw", "-q")
    assert rc == 1 and err.startswith(f"gdsdata: error: {out}: packed with codec='jpeg'; appending with "
                                      f"codec='raw' would store its new images otherwise"), err
    assert load(out).fingerprint == before
    rc, stdout, err = run("pack", extra, out, "--append", "-q")
    assert rc == 0, err
    index = load(out)
    assert index.meta["options"]["max_side"] == 40 and index.meta["options"]["quality"] == 80
    assert max(int(r["width"]) for r in index.samples) <= 40 and max(int(r["height"]) for r in index.samples) <= 40
    assert run("pack", extra, out, "--append", "--max-side", "40", "-q")[0] == 0  # the same: fine (nothing new)
    from gdsdata.errors import SourceError
    from gdsdata.packing.packer import pack
    from gdsdata.packing.prepare import PackOptions

    write_photos(extra, 5, classes=1, start_seed=700)  # 00003 and 00004: the first held already
    with pytest.raises(SourceError, match="packed with max_side=40, quality=80; appending with max_side=0, "
                                          "quality=95"):
        pack(extra, out, options=PackOptions(), append=True)
    assert pack(extra, out, append=True).new == 1 and load(out).meta["options"]["max_side"] == 40


def test_names_that_are_not_utf8_pass_a_strict_output_encoding(tmp_path):
    """PYTHONIOENCODING=utf-8 (set in many containers) makes stdout strict: a class or file name whose
    bytes are not UTF-8 is still printed (as the bytes it is), and a finished pack, an inspect and a
    verify exit 0 rather than fail on their own summary."""
    src = tmp_path / "src"
    write_photos(str(src), 4, classes=1)
    os.makedirs(os.path.join(os.fsencode(src), b"cl\xffass"))
    with open(os.path.join(os.fsencode(src), b"cl\xffass", b"x\xfe.jpg"), "wb") as f:
        f.write((src / "class0" / "00000.jpg").read_bytes())
    out = os.path.join(os.fsencode(tmp_path), b"out\xff.gds")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    said = {}
    for args in (["pack", os.fsencode(src), out, "-q"], ["inspect", out], ["verify", out]):
        proc = subprocess.run([sys.executable, "-m", "gdsdata.cli", *args], capture_output=True, env=env, timeout=300)
        assert proc.returncode == 0, (args[0], proc.stdout[-2000:], proc.stderr[-2000:])
        said[args[0]] = proc.stdout
    assert b"cl\xffass" in said["inspect"]  # the class's name, as its bytes


def test_a_file_name_with_a_newline_or_an_escape_stays_on_its_line(tmp_path):
    """A name's control characters are printed escaped: an error stays one line, a summary's entry
    too, and a terminal's escape sequence is not sent to the terminal (the report keeps the name)."""
    src = tmp_path / "src"
    write_photos(str(src), 4, classes=1)
    (src / "class0" / "bad\ninjected: fake line.jpg").write_bytes(b"\xff\xd8\xff nope")
    (src / "class0" / "red\x1b[31m.jpg").write_bytes(b"\xff\xd8\xff nope")
    rc, stdout, _ = run("pack", str(src), str(tmp_path / "ds"), "-q")
    assert rc == 0 and "    class0/bad\\ninjected: fake line.jpg: " in stdout and "\x1b" not in stdout
    assert "class0/red\\x1b[31m.jpg: " in stdout
    rc, _, err = run("pack", str(src), str(tmp_path / "strict"), "--strict", "-q")
    assert rc == 1 and err.count("\n") == 1 and "bad\\ninjected: fake line.jpg" in err, err


def test_progress_in_a_log_file_is_plain_lines_at_most_once_an_interval(capsys, monkeypatch):
    from gdsdata import progress

    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.05)
    with progress.bar(True, total=30, unit="img", desc="pack") as bar:  # stderr captured: not a terminal
        for _ in range(3):
            time.sleep(0.06)
            bar.update(10)
        bar.update(0)  # (within the interval: no line)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and lines[0].startswith("pack:   0%|") and lines[-1].startswith("pack: 100%|")
    assert [line.split("|")[2].split()[0] for line in lines[1:4]] == ["10/30", "20/30", "30/30"], err
    with progress.bar(False, total=30) as bar:
        bar.update(30)
    assert capsys.readouterr().err == ""


def test_progress_that_cannot_be_written_stops_and_the_work_goes_on(monkeypatch):
    """A log collector gone (stderr a broken pipe): the lines stop, nothing is raised."""
    from gdsdata import progress

    class Gone:
        def isatty(self):
            return False

        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Gone())
    with progress.bar(True, total=3, desc="pack") as bar:
        bar.update(3)


def test_install_hints_name_the_extras_packages_which_pip_finds_from_a_checkout_too():
    from importlib import metadata

    from gdsdata.errors import install_hint

    try:
        metadata.requires("gdsdata")
    except metadata.PackageNotFoundError:  # (imported from a tree pip did not install: the extra's name)
        assert install_hint("ray") == "pip install -e '.[ray]' in gdsdata's source tree (its [ray] extra)"
        return
    assert install_hint("ray") == "pip install 'ray[client]>=2.40' (gdsdata's [ray] extra)"
    assert install_hint("remote") == "pip install 'fsspec>=2023.1' 's3fs>=2023.1' (gdsdata's [remote] extra)"
    assert install_hint("cu12").startswith("pip install 'kvikio-cu12>=26.10' 'cupy-cuda12x>=13' 'nvidia-nvjpeg-cu12")
    assert install_hint("gpu").startswith("pip install 'kvikio-cu1")
    packages = json.loads(run("doctor", "--json")[1]).get("gpu packages", "")  # (a CPU machine's line)
    if "not installed" in packages:  # what to install for the GPU path, after the list
        assert ", for a GPU: pip install 'kvikio-cu1" in packages, packages
