"""Packing on Ray and from object storage: a local Ray packs a source in parts, survives a killed
worker and gives the dataset a single process gives; a local S3 server (moto) serves a source that
packs into the dataset the same files give from disk."""

import glob
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest
from conftest import child_env, write_photos

from gdsdata.errors import BadImageError
from gdsdata.format.index import load
from gdsdata.packing.packer import pack
from gdsdata.commands.verify import verify

ROOT = os.path.join(os.path.dirname(__file__), "..")


def same_dataset(a, b):
    """Samples, labels and payload bytes equal (shard boundaries may differ: parts have their own)."""
    ia, ib = load(a), load(b)
    assert [ia.path(i) for i in range(len(ia))] == [ib.path(i) for i in range(len(ib))]
    assert ia.samples["label"].tolist() == ib.samples["label"].tolist()
    assert ia.samples["crc32"].tolist() == ib.samples["crc32"].tolist()
    assert ia.classes == ib.classes
    for i in range(len(ia)):
        assert payload(ia, i) == payload(ib, i)


def payload(index, i):
    record = index.samples[i]
    with open(index.shard_path(int(record["shard"])), "rb") as f:
        f.seek(int(record["offset"]))
        return f.read(int(record["length"]))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ray_src"))
    write_photos(root, 64, classes=4, start_seed=9000, scale=0.6)
    reference = str(tmp_path_factory.mktemp("ray_ref") / "ds")
    pack(root, reference, workers=1)
    return root, reference


@pytest.fixture(scope="module")
def kill_marker(tmp_path_factory):
    """Where the first Ray worker to finish a shard notes that it killed itself."""
    return str(tmp_path_factory.mktemp("ray_kill") / "killed")


@pytest.fixture(scope="module")
def local_ray(kill_marker):
    ray = pytest.importorskip("ray")

    def kill_after_first_journal():  # runs in each Ray worker as it starts (pickled by value)
        import os
        import signal

        from gdsdata.format import layout
        from gdsdata.packing import packer

        write_json = packer._write_json

        def write_then_die(path, payload):
            write_json(path, payload)
            if path.endswith(layout.JOURNAL_SUFFIX):
                try:
                    os.close(os.open(kill_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
                os.kill(os.getpid(), signal.SIGKILL)  # a worker killed between a finished shard and the next

        packer._write_json = write_then_die

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": kill_after_first_journal})
    yield ray
    ray.shutdown()


def test_a_local_ray_packs_in_parts_and_survives_a_killed_worker(source, local_ray, kill_marker, tmp_path):
    from gdsdata.packing.ray import pack_on_ray

    src, reference = source
    out = str(tmp_path / "ds")
    summary = pack_on_ray(src, out, num_parts=4, shard_size=64 * 1024, max_retries=5)
    assert os.path.exists(kill_marker), "no worker was killed: the test did not exercise a retry"
    assert summary["parts"] == 4 and summary["samples"] == 64
    assert summary["resumed_shards"] >= 1  # the killed part went on from the shard it had finished
    same_dataset(out, reference)
    assert verify(out) == []
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # the part folders are gone


def test_a_local_ray_packs_onto_shard_roots_and_the_dataset_owns_them(source, local_ray, tmp_path):
    """``--ray --shard-root``: each part writes its shards on the drives, the merge moves them into the
    dataset's own folders there (no part's folder is left on a drive), and an overwrite removes them.
    SRC and OUT as pathlib paths, as ``pack`` takes them (SRC's had failed with an AttributeError)."""
    from gdsdata.packing.ray import pack_on_ray

    src, reference = source
    out, drives = str(tmp_path / "ds"), [str(tmp_path / "drive0"), str(tmp_path / "drive1")]
    summary = pack_on_ray(pathlib.Path(src), pathlib.Path(out), num_parts=3, shard_size=64 * 1024,
                          shard_roots=drives)
    assert summary["shards_placed"] == ["moved on its drive"]
    same_dataset(out, reference)
    assert verify(out) == []
    for drive in drives:
        assert [f.split(".gdsdata-shards-")[0] for f in os.listdir(drive)] == ["ds"]
    assert sorted(os.listdir(tmp_path)) == ["drive0", "drive1", "ds"]
    pack(src, out, workers=1, overwrite=True)
    assert [f for d in drives for _, _, files in os.walk(d) for f in files] == []


def test_a_detection_source_packs_on_ray_with_its_boxes(local_ray, kill_marker, tmp_path, capsys):
    import numpy as np

    from gdsdata.packing.ray import pack_on_ray

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_detection import generate

    generate(str(tmp_path / "src"), 13, classes=3, seed=5, val=0.0)
    data = str(tmp_path / "src" / "yolo" / "data.yaml")
    images = sorted(glob.glob(str(tmp_path / "src" / "yolo" / "images" / "train" / "*")))
    last = os.path.splitext(os.path.basename(images[-1]))[0]  # (in the last part): a box clipped, the image
    with open(tmp_path / "src" / "yolo" / "labels" / "train" / f"{last}.txt", "w") as f:  # then found broken
        f.write("0 0.95 0.5 0.2 0.2\n")
    with open(images[-1], "wb") as f:
        f.write(b"\xff\xd8\xff not a JPEG")
    from PIL import Image  # images Ultralytics' training leaves out, which a Ray worker must leave out too:

    Image.new("RGB", (6, 6), (90, 20, 200)).save(images[0], format="JPEG")  # under 10 pixels a side
    Image.new("RGB", (64, 48), (20, 90, 200)).save(images[5], format="GIF")  # a GIF named .jpg
    single = pack(data, str(tmp_path / "single"), format="yolo", workers=1)
    summary = pack_on_ray(data, str(tmp_path / "ray"), num_parts=3, format="yolo")
    merged, single_index = load(summary["out"]), load(single.out)
    assert merged.task == "detect" and len(merged) == len(single_index) == 10
    assert np.array_equal(merged.boxes, single_index.boxes) and \
        np.array_equal(merged.box_start, single_index.box_start)
    report = json.loads(pathlib.Path(summary["out"], "pack_report.json").read_text())
    assert [entry["path"] for entry in report["skipped"]] == \
        [os.path.relpath(images[k], os.path.dirname(data)) for k in (0, 5, -1)]
    assert [entry["path"] for entry in report["skipped"]] == [entry["path"] for entry in single.skipped]
    assert report["labels"] == single.labels  # (not the clipped box of the image part 2 skipped, as one pack)
    assert all(entry["image"] != report["skipped"][0]["path"] for entry in report["labels"]["clipped"])
    coco = tmp_path / "src" / "coco"  # COCO from file:// URLs, its annotations' too, as a local pack takes them
    annotations = coco / "annotations" / "instances_train.json"
    local_coco = pack(str(coco / "train"), str(tmp_path / "coco-local"), format="coco", annotations=str(annotations),
                      workers=1)
    ray_coco = pack_on_ray(f"file://{coco / 'train'}", str(tmp_path / "coco-ray"), num_parts=2, format="coco",
                           annotations=f"file://{annotations}")
    assert np.array_equal(load(ray_coco["out"]).boxes, load(local_coco.out).boxes) and local_coco.packed == 13
    from gdsdata.cli import main  # the command says what the labels got wrong, as a local pack does

    assert main(["pack", "--format", "yolo", data, str(tmp_path / "cli"), "--ray", "--num-parts", "3", "-q"]) == 0
    said = capsys.readouterr().out
    assert f"  boxes: {len(single_index.boxes)}, images without objects (kept as negatives): " in said, said


def test_the_report_holds_every_part_s_skipped_files_as_a_local_pack_s(local_ray, tmp_path):
    """OUT/pack_report.json of ``pack --ray`` is a local pack's: the bad files of every part with
    their reasons, the ignored ones, the same fields and counts."""
    from gdsdata.packing.ray import pack_on_ray

    src = str(tmp_path / "src")
    write_photos(src, 24, classes=3, start_seed=700, scale=0.4)
    for k, name in enumerate(("a_broken.jpg", "m_broken.jpg", "zz_broken.jpg")):  # in different parts
        with open(os.path.join(src, f"class{k}", name), "wb") as f:
            f.write(b"\xff\xd8\xff nothing")
    with open(os.path.join(src, "class1", "notes.txt"), "w") as f:
        f.write("ignored")
    local = json.loads(pathlib.Path(pack(src, str(tmp_path / "local"), workers=1).report_path).read_text())
    summary = pack_on_ray(src, str(tmp_path / "ray"), num_parts=3, shard_size=64 * 1024)
    with open(os.path.join(tmp_path, "ray", "pack_report.json")) as f:
        report = json.load(f)
    assert report == summary["report"] and summary["report_path"] == str(tmp_path / "ray" / "pack_report.json")
    assert len(report["skipped"]) == summary["skipped"] == 3
    for key in ("skipped", "ignored", "unreadable", "special", "status", "classes", "packed", "converted",
                "resized", "empty_classes"):
        assert report[key] == local[key], key
    assert set(report) - set(local) == {"ray"} and report["ray"]["parts"] == 3
    assert report["shards"] == len(load(summary["out"]).shards) and report["packed"] == 24
    # --max-skipped counts every part's files together, before the merge: nothing written past it
    with pytest.raises(BadImageError, match=r"pack --ray of .*src: 3 file\(s\) left out, more than "
                                            r"--max-skipped 2 allows; class0/a_broken.jpg: "):
        pack_on_ray(src, str(tmp_path / "over"), num_parts=3, shard_size=64 * 1024, max_skipped=2)
    assert sorted(os.listdir(tmp_path)) == ["local", "ray", "src"]
    assert pack_on_ray(src, str(tmp_path / "within"), num_parts=3, max_skipped="12%")["samples"] == 24  # 3 of 27


def test_the_command_says_what_it_packed_as_a_local_pack_does(source, local_ray, tmp_path, capsys):
    from gdsdata.cli import main

    out = str(tmp_path / "ds")
    assert main(["pack", source[0], out, "--ray", "--num-parts", "2", "-q"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"packed 64 images in \d+ shard\(s\), [\d.]+ [KM]B into {re.escape(out)} in [\d.]+ s "
                        rf"\(\d+ images/s, Ray's start and stop included\): 2 part\(s\) on 2 CPU\(s\)", said[0]), said
    assert said[1] == "  stored as is: 64, converted: 0, resized: 0"
    assert said[-1] == f"  report: {os.path.join(out, 'pack_report.json')}"


def test_never_more_parts_than_images(local_ray, tmp_path, caplog):
    from gdsdata.packing.ray import pack_on_ray

    src = str(tmp_path / "src")
    write_photos(src, 2, classes=2, start_seed=800, scale=0.3)
    with caplog.at_level("WARNING", logger="gdsdata.packing.ray"):
        summary = pack_on_ray(src, str(tmp_path / "ds"), num_parts=3)
    assert summary["parts"] == 2 and summary["samples"] == 2
    assert "3 part(s) asked for, 2 image file(s) to pack: 2 part(s)" in caplog.text


@pytest.mark.slow
def test_a_part_stuck_on_an_image_is_packed_again_and_the_image_skipped_within_the_bound(tmp_path):
    """A part whose worker never finishes an image (a decoder that loops) is ended after
    stall_timeout without progress and packed again, each image in a worker process under the bound:
    the image that stalls is skipped with the reason, the rest packed, the report as a pack without
    Ray would give it. Never a hung ``pack --ray``. Here the part has finished no shard yet (it packs
    again from the start), the bound is set in the driver only (the parts take it from there), and
    the other part's worker dies once before its first shard (packed again from the start too)."""
    pytest.importorskip("ray")
    src, out = tmp_path / "src", str(tmp_path / "ds")
    write_photos(str(src), 40, classes=2, start_seed=950, scale=0.4)
    victim, crash = "class1/00021.jpg", "class0/00004.jpg"  # (class0: the even numbers, part 0; class1 part 1)
    marker = str(tmp_path / "crashed")
    script = f"""
import json, logging, sys
sys.path.insert(0, {ROOT!r})
import ray

def stuck_on_the_victim():  # in each Ray worker as it starts, and the pack workers it forks
    import os, threading
    from gdsdata.packing import packer
    real = packer._prepare_item
    def item(job):
        if job[0] == {victim!r}:
            threading.Event().wait()
        if job[0] == {crash!r} and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            os._exit(9)
        return real(job)
    packer._prepare_item = item

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
         runtime_env={{"worker_process_setup_hook": stuck_on_the_victim}})
import gdsdata
from gdsdata.packing.ray import pack_on_ray
with gdsdata.settings.set(stall_timeout=3):
    summary = pack_on_ray({str(src)!r}, {out!r}, num_parts=2)
print(json.dumps(summary["report"]["skipped"]), summary["samples"])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                          env=child_env())
    assert done.returncode == 0, done.stderr
    skipped, samples = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert samples == "39" and os.path.exists(marker)
    assert [(s["path"], s["reason"]) for s in json.loads(skipped)] == [
        (victim, "preparing it alone took longer than 3 s (the stall_timeout setting, GDSDATA_STALL_TIMEOUT)")]
    assert "WARNING gdsdata.packing.ray: part 1 of 2 made no progress for 3 s (the stall_timeout setting); packing " \
           "it again from the shards it finished, each image in a worker process under the bound" in done.stderr
    assert "WARNING gdsdata.packing.ray: part 0 of 2 failed (" in done.stderr
    assert "packing it again from the shards it finished (retry 1 of 3)" in done.stderr
    assert verify(out) == []
    assert sorted(os.listdir(tmp_path)) == ["crashed", "ds", "src"]


def test_the_watch_times_only_started_parts_and_a_part_stuck_twice_ends_the_pack():
    """Parts not started (no CPU free) or still listing are not timed; a part past the bound is
    ended once and handed back; packing with workers it has 20 bounds, then one line ends the pack."""
    import gdsdata
    from gdsdata.errors import GdsDataError
    from gdsdata.packing.ray import _Watch

    class FakeRay:
        class exceptions:
            GetTimeoutError = TimeoutError

        def __init__(self):
            self.cancelled, self.quiet = [], {}

        def get(self, status, timeout=None):
            return 10, dict(self.quiet), False

        def cancel(self, ref, force):
            self.cancelled.append((ref, force))

        def wait(self, refs, timeout=None):
            return refs, []

    class FakeCounter:
        class _Method:
            def remote(self, *args):
                return args

        status = forget = _Method()

    ray = FakeRay()
    with gdsdata.settings.set(stall_timeout=5):
        watch = _Watch(ray, FakeCounter(), 3)
    pending = {"a": 0, "b": 1, "c": 2}
    ray.quiet = {0: 4.0, 1: 6.0}  # part 2 not started
    assert watch.poll() == 10 and watch.stalled(pending) == [("b", 1)] and ray.cancelled == [("b", True)]
    pending = {"a": 0, "b2": 1, "c": 2}
    ray.quiet = {0: 1.0, 1: 99.0, 2: 0.5}
    watch.poll()
    assert watch.stalled(pending) == []  # (packing with workers: 20 bounds)
    ray.quiet[1] = 101.0
    watch.poll()
    with pytest.raises(GdsDataError, match=r"^part 1 of 3 made no progress for 101 s packing each image in a worker "
                                           r"process: the node rather than the images\?"):
        watch.stalled(pending)
    with gdsdata.settings.set(stall_timeout=0.01):  # no part ever started: the cluster runs none of them
        watch = _Watch(ray, FakeCounter(), 3)
    ray.quiet = {}
    import time

    time.sleep(0.15)
    with pytest.raises(GdsDataError, match=r"^no part of 3 started within 0 s: the Ray cluster runs none"):
        watch.poll()


def _ray_processes(mark):
    """Processes (Ray's, started by a command run with ``mark`` in its environment) still alive."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("when", ["ray-starting", "parts-packing"])
def test_sigterm_on_ray_unwinds_as_a_local_pack_and_leaves_no_process(when, tmp_path):
    """SIGTERM while the command's local Ray starts or while the parts pack: one line, exit 143, no
    dataset and no part folder, and none of Ray's processes left (they would outlive the command)."""
    import time
    import uuid

    pytest.importorskip("ray")
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc to find the command's processes")
    src, out, mark = str(tmp_path / "src"), str(tmp_path / "ds"), f"GDSDATA_TEST_{uuid.uuid4().hex}"
    write_photos(src, 40, classes=2, start_seed=600, scale=0.5)
    command = subprocess.Popen([sys.executable, "-m", "gdsdata", "pack", src, out, "--ray", "--num-parts", "4",
                                "-q", "--shard-size", "64K"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=child_env(**{mark: "1"}))
    deadline = time.time() + 120
    while command.poll() is None and time.time() < deadline:
        others = [pid for pid in _ray_processes(mark) if pid != command.pid]
        parts = [n for n in os.listdir(tmp_path) if ".gdsdata-parts-" in n]
        if (others and not parts) if when == "ray-starting" else \
                any(os.listdir(os.path.join(tmp_path, n)) for n in parts):
            break
        time.sleep(0.01)
    command.send_signal(signal.SIGTERM)
    _, err = command.communicate(timeout=120)
    lines = [line for line in err.splitlines()  # (Ray's notice, and its own log lines: "[date ...] file.cc:N: ...")
             if line and "Token authentication" not in line and not re.match(r"\[\d{4}-\d\d-\d\d .*\.cc:\d+:", line)]
    assert command.returncode == 143 and lines == [f"gdsdata: terminated (SIGTERM); {out} was not written"], err
    assert sorted(os.listdir(tmp_path)) == ["src"]
    deadline = time.time() + 30  # (Ray's processes go as shutdown returns; give the last a moment)
    while _ray_processes(mark) and time.time() < deadline:
        time.sleep(0.5)
    assert _ray_processes(mark) == []


def test_a_start_whose_processes_are_killed_under_it_is_left_and_the_rest_ended(monkeypatch):
    """SIGTERM to the whole process group (timeout, Slurm) while the local Ray starts ends Ray's
    processes too: the start would then wait a minute for its GCS before Ray ended the command (exit
    1, no word). Once a process the start made is gone, the rest are ended and the start left to
    itself: the signal unwinds at once, and no shutdown waits on what is gone."""
    import threading

    from gdsdata.errors import Terminated
    from gdsdata.packing import ray as ray_module

    never = threading.Event()

    class Starting:  # a start that never ends (its GCS is gone)
        def init(self, **kwargs):
            never.wait(60)

        def shutdown(self):
            pytest.fail("a shutdown would wait for the start")

    children = iter([{7}, {7, 101, 102}, {7, 101, 102}] + [{7, 102}] * 1000)  # Ray's (not 7), then one killed
    killed = []
    monkeypatch.setattr(ray_module, "_children", lambda: next(children))
    monkeypatch.setattr(ray_module.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    owner = ray_module._RayOwner(Starting(), None)
    timer = threading.Timer(0.5, lambda: signal.raise_signal(signal.SIGUSR1))

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGUSR1, terminated)
    try:
        timer.start()
        with pytest.raises(Terminated):
            owner.start()
        owner.stop(interrupted=True)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        never.set()
    assert owner.abandoned and set(killed) == {(102, signal.SIGKILL)}


def test_the_part_count_follows_size_and_cpus():
    from gdsdata.packing.ray import choose_parts

    assert choose_parts(64, 2) == 1
    assert choose_parts(100_000, 2) == 4
    assert choose_parts(100_000_000, 512) == 1024


def test_an_address_with_no_cluster_says_how_to_start_one():
    """Ray's own ConnectionError for an address with no cluster ("auto" outside one) tells of a
    --address flag gdsdata has none of: said in gdsdata's words."""
    from gdsdata.packing.ray import _RayOwner

    class NoCluster:
        def init(self, **kwargs):
            raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                                  "setting `--address` flag or `RAY_ADDRESS` environment variable.")

        def shutdown(self):
            pass

    class Refused(NoCluster):
        def init(self, **kwargs):
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379.")

    owner = _RayOwner(NoCluster(), "auto")
    with pytest.raises(ConnectionError) as said:
        owner.start()
    owner.stop()
    assert str(said.value) == ("--ray auto: no Ray cluster to join there (Could not find any running Ray instance); "
                               "start one (ray start --head) if none runs there and give its address "
                               "(ray://HEAD:10001), or give --ray no address to start a local Ray")
    owner = _RayOwner(Refused(), "10.0.0.1:6379")  # (one may run there and refuse this driver)
    with pytest.raises(ConnectionError) as said:
        owner.start()
    owner.stop()
    assert str(said.value).startswith("--ray 10.0.0.1:6379: cannot join the Ray cluster there (Failed to connect to "
                                      "Ray cluster at 10.0.0.1:6379); start one (ray start --head) if none runs there")


def test_no_address_starts_a_ray_of_its_own_unless_ray_address_names_one(monkeypatch):
    """--ray without an address: a local Ray over this machine (Ray's None would join a cluster that
    `ray start` left on this machine, of its CPUs only); RAY_ADDRESS, as Ray's commands take it, and
    an address given are joined."""
    from gdsdata.packing.ray import _RayOwner

    asked = []

    class Recorded:
        def init(self, address=None, **kwargs):
            asked.append(address)

        def shutdown(self):
            pass

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for address in (None, "auto", "ray://head:10001"):
        owner = _RayOwner(Recorded(), address)
        owner.start()
        owner.stop()
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    owner = _RayOwner(Recorded(), None)
    owner.start()
    owner.stop()
    assert asked == ["local", "auto", "ray://head:10001", None]


def test_without_ray_the_option_says_how_to_install(source, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from gdsdata.cli import main

    assert main(["pack", source[0], str(tmp_path / "ds"), "--ray", "-q"]) == 1


# --- object storage -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3(source):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="images")
    src = source[0]
    for folder, _, names in os.walk(src):
        for name in names:
            path = os.path.join(folder, name)
            client.upload_file(path, "images", "train/" + os.path.relpath(path, src))
    client.put_object(Bucket="images", Key="train/class0/README.txt", Body=b"not an image")
    yield env
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_source_on_s3_packs_into_the_dataset_its_files_give(source, s3, tmp_path):
    src, reference = source
    out = str(tmp_path / "ds")
    result = pack("s3://images/train", out, workers=2)
    assert result.packed == 64 and result.ignored == ["class0/README.txt"]
    same_dataset(out, reference)


def test_the_command_line_packs_from_s3(source, s3, tmp_path):
    out = str(tmp_path / "ds")
    done = subprocess.run([sys.executable, "-m", "gdsdata", "pack", "s3://images/train", out, "-q"],
                          capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    same_dataset(out, source[1])


def test_tar_shards_on_s3_are_fetched_and_packed(source, s3, tmp_path):
    import tarfile

    import boto3

    src, _ = source
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for k, name in enumerate(sorted(os.listdir(os.path.join(src, "class1")))[:5]):
            tar.add(os.path.join(src, "class1", name), arcname=f"s{k:03d}.jpg")
            label = tmp_path / f"s{k:03d}.cls"
            label.write_text("1")
            tar.add(label, arcname=f"s{k:03d}.cls")
    boto3.client("s3").upload_file(str(shard), "images", "wds/shard-0.tar")
    import tempfile

    fetched = set(glob.glob(os.path.join(tempfile.gettempdir(), "gdsdata-fetch-*")))
    result = pack("s3://images/wds", str(tmp_path / "ds"), workers=1)
    assert result.packed == 5
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "gdsdata-fetch-*"))) == fetched  # the copy removed


def test_an_append_from_s3_compares_the_listed_sizes(source, s3, tmp_path):
    import boto3

    from gdsdata.errors import SourceError

    src, _ = source
    out = str(tmp_path / "ds")
    pack(src, out, workers=1)
    assert pack("s3://images/train", out, workers=1, append=True).new == 0  # the same files: nothing new
    client = boto3.client("s3")
    client.create_bucket(Bucket="grown")
    first = sorted(os.listdir(os.path.join(src, "class0")))[0]
    for name in sorted(os.listdir(os.path.join(src, "class0")))[:2]:
        client.upload_file(os.path.join(src, "class0", name), "grown", f"train/class0/{name}")
    with open(os.path.join(src, "class1", sorted(os.listdir(os.path.join(src, "class1")))[0]), "rb") as f:
        client.put_object(Bucket="grown", Key=f"train/class0/{first}", Body=f.read())  # another image, same path
    with pytest.raises(SourceError, match=f"already holds a different image under class0/{first}"):
        pack("s3://grown/train", out, workers=1, append=True)
    assert verify(out) == []


def test_a_missing_bucket_is_one_line(s3, tmp_path):
    from gdsdata.cli import main

    assert main(["pack", "s3://no-such-bucket/train", str(tmp_path / "ds"), "-q"]) == 1


def test_an_lmdb_on_s3_is_fetched_and_packs_as_from_disk(source, s3, tmp_path):
    pytest.importorskip("lmdb")
    import boto3

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_lmdb import build

    src, _ = source
    local = str(tmp_path / "images.lmdb")
    build(src, local)
    client = boto3.client("s3")
    for name in os.listdir(local):
        client.upload_file(os.path.join(local, name), "images", f"lmdb/images.lmdb/{name}")
    from_s3, from_disk = str(tmp_path / "a"), str(tmp_path / "b")
    pack("s3://images/lmdb/images.lmdb", from_s3, workers=1)
    pack(local, from_disk, workers=1)
    same_dataset(from_s3, from_disk)
