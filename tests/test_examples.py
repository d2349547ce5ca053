"""The example users copy runs as documented: train, checkpoint, resume mid-epoch, evaluate; under
torchrun too (on the CPU here, gloo)."""

import os
import subprocess
import sys

import pytest
from conftest import child_env, write_photos

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_imagenet.py")


def _run(args, tmp_path, torchrun=0, code=0):
    env = child_env(OMP_NUM_THREADS="1")
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    done = subprocess.run(prefix + [EXAMPLE] + args, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout if code == 0 else done.stderr


@pytest.mark.slow
def test_train_checkpoint_resume_and_evaluate(photos_dataset, tmp_path):
    _, _, out = photos_dataset
    ckpt = str(tmp_path / "ckpt.pt")
    common = ["--train", out, "--val", out, "--arch", "resnet18", "--epochs", "2", "--batch-size", "8",
              "--size", "32", "--checkpoint", ckpt, "--log-every", "1", "--checkpoint-every", "2"]
    first = _run(common + ["--max-steps", "3"], tmp_path)
    assert "step 3/14" in first
    second = _run(common, tmp_path)  # resumes from the checkpoint written after step 3
    assert "resumed at step 3 (epoch 0)" in second
    assert "step 4/14" in second and "step 14/14" in second
    assert "validation top-1" in second
    done = _run([*common, "--epochs", "1"], tmp_path)  # (the last --epochs counts) already past its end
    assert "the checkpoint is at step 14, after 2 epochs: --epochs 1 leaves nothing to train" in done
    assert "stopped at step 14/14 (epoch 2)" in done
    src, _, _ = photos_dataset
    from gdsdata.packing.packer import pack

    other = str(tmp_path / "other")
    pack(src, other, workers=1, shard_size=300_000)  # the same images, another dataset: not this checkpoint's
    said = _run([*common[:1], other, *common[2:]], tmp_path, code=1)
    assert said.startswith(f"cannot resume from {ckpt}: the state was saved by a Loader over another dataset"), said
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said
    evaluated = _run([*common[:1], other, *common[2:], "--batch-size", "4", "--evaluate"], tmp_path)
    assert f"{ckpt} (step 14): validation top-1 " in evaluated and " loss " not in evaluated  # the model alone
    last = second.split("epoch 1: validation top-1 ")[1].split()[0]
    assert evaluated.split("validation top-1 ")[1].split()[0] == last
    at = common.index("--size")  # without --size: at the size it trained at (32), not the default 224
    unsized = _run([*common[:1], other, *common[2:at], *common[at + 2:], "--evaluate"], tmp_path)
    assert unsized.split("validation top-1 ")[1].split()[0] == last and "going on at" not in unsized
    larger = _run([*common[:1], other, *common[2:at], "--size", "48", *common[at + 2:], "--evaluate"], tmp_path)
    assert "the checkpoint trained at --size 32; going on at --size 48" in larger
    for args, expected in (([*common[:5], "resnet34", *common[6:]], f"{ckpt} holds a resnet18; --arch resnet34"),
                           ([*common[:-4], "--checkpoint", str(tmp_path / "junk.pt")],
                            f"{tmp_path / 'junk.pt'}: not a checkpoint this example can read")):
        (tmp_path / "junk.pt").write_bytes(b"garbage")
        said = _run(args, tmp_path, code=1)
        assert said.startswith(f"train_imagenet.py: error: {expected}"), said
        assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said


def _lrs(printed) -> list:
    return [float(line.split(" lr ")[1].split()[0]) for line in printed.splitlines() if " lr " in line]


@pytest.mark.slow
def test_a_resume_with_another_batch_size_keeps_the_schedule_and_stops_at_epochs(photos_dataset, tmp_path):
    """The schedule follows the epochs trained, not a count of batches of one size: a resume with
    half the batch size continues the same cosine and stops at --epochs; a checkpoint at --epochs
    trains nothing more at any batch size."""
    import math

    _, _, out = photos_dataset  # 60 samples: 7 batches of 8 an epoch (drop_last), 15 of 4
    ckpt = str(tmp_path / "ckpt.pt")
    common = ["--train", out, "--arch", "resnet18", "--epochs", "2", "--size", "32", "--checkpoint", ckpt,
              "--log-every", "1", "--warmup-epochs", "0", "--lr", "25.6"]  # base lr: batch size / 10
    first = _run([*common, "--batch-size", "8", "--max-steps", "4"], tmp_path)  # 32 samples of epoch 0
    assert "stopped at step 4/14 (epoch 0)" in first
    resumed = _run([*common, "--batch-size", "4"], tmp_path)  # the other 28 (7 batches of 4), then 15
    assert "resumed at step 4 (epoch 0)" in resumed
    assert "step 26/26" in resumed and "stopped at step 26/26 (epoch 2)" in resumed
    shares = [lr / 0.8 for lr in _lrs(first)] + [lr / 0.4 for lr in _lrs(resumed)]  # of the base lr
    assert len(shares) == 26 and shares == sorted(shares, reverse=True)  # never climbs back
    assert shares[-1] < 0.01
    cosine = lambda epochs: 0.5 * (1 + math.cos(math.pi * epochs / 2))  # noqa: E731
    assert shares[3] == pytest.approx(cosine(3 / 7), abs=5e-4)  # the last step of the first run
    assert shares[4] == pytest.approx(cosine(32 / 60), abs=5e-4)  # the resumed one: 32 of 60 samples in
    assert shares[11] == pytest.approx(cosine(1), abs=5e-4)  # epoch 1's first step
    again = _run([*common, "--batch-size", "16"], tmp_path)
    assert "after 2 epochs: --epochs 2 leaves nothing to train" in again
    assert "stopped at step 26/26 (epoch 2)" in again and "loss" not in again


@pytest.mark.slow
def test_torchrun_two_ranks(photos_dataset, tmp_path):
    _, _, out = photos_dataset
    printed = _run(["--train", out, "--arch", "resnet18", "--epochs", "1", "--batch-size", "4", "--size", "32",
                    "--log-every", "1"], tmp_path, torchrun=2)
    assert "step 7/7" in printed  # 60 samples over 2 ranks, batches of 4, drop_last


@pytest.mark.gpu
@pytest.mark.slow
def test_the_examples_train_on_the_gpu(photos_dataset, tmp_path):
    """On a machine with CUDA the examples train there as users run them: train_imagenet.py trains,
    checkpoints, resumes and evaluates, alone and under torchrun (NCCL); train_detection.py and,
    where Ultralytics is installed, train_yolo.py train a few steps."""
    import torch

    _, _, out = photos_dataset
    ckpt = str(tmp_path / "ckpt.pt")
    common = ["--train", out, "--val", out, "--arch", "resnet18", "--epochs", "2", "--batch-size", "8",
              "--size", "32", "--checkpoint", ckpt, "--log-every", "1"]
    assert "step 3/14" in _run(common + ["--max-steps", "3"], tmp_path)
    state = torch.load(ckpt, map_location=None, weights_only=False)
    assert {t.device.type for t in state["model"].values()} == {"cuda"}  # it trained on the GPU
    second = _run(common, tmp_path)
    assert "resumed at step 3 (epoch 0)" in second and "stopped at step 14/14 (epoch 2)" in second
    assert "validation top-1" in second
    printed = _run(["--train", out, "--arch", "resnet18", "--epochs", "1", "--batch-size", "4", "--size", "32",
                    "--log-every", "1"], tmp_path, torchrun=1)
    assert "step 15/15" in printed
    _detection_examples(tmp_path, "0")


def test_detection_examples_train_on_the_cpu(tmp_path):
    """examples/train_detection.py (torchvision) and examples/train_yolo.py (Ultralytics' trainer)."""
    _detection_examples(tmp_path, "cpu")


def _detection_examples(tmp_path, device):
    """train_detection.py (on the GPU where there is one) and train_yolo.py on ``device`` ("cpu", or
    "0" with Ultralytics' AMP check, which gdsdata keeps offline) each train on a small YOLO pack."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from make_detection import generate

    from gdsdata.packing.packer import pack

    generate(str(tmp_path / "src"), 10, classes=3, seed=4, val=0.3)
    data = str(tmp_path / "src" / "yolo" / "data.yaml")
    train = pack(data, str(tmp_path / "train"), format="yolo", workers=1).out
    val = pack(data, str(tmp_path / "val"), format="yolo", split="val", workers=1).out
    here = os.path.join(os.path.dirname(__file__), "..", "examples")
    env = child_env(OMP_NUM_THREADS="1", YOLO_OFFLINE="1")
    done = subprocess.run([sys.executable, os.path.join(here, "train_detection.py"), "--train", train, "--val", val,
                           "--epochs", "1", "--batch-size", "2", "--imgsz", "96", "--max-steps", "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/" in done.stdout and "validation:" in done.stdout
    pytest.importorskip("ultralytics")
    done = subprocess.run([sys.executable, os.path.join(here, "train_yolo.py"), "--train", train, "--val", val,
                           "--model", "yolov8n.yaml", "--epochs", "1", "--imgsz", "64", "--batch", "4", "--device",
                           device, "--project", str(tmp_path / "runs"), *(["amp=False"] if device == "cpu" else [])],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "best weights:" in done.stdout and "metrics/mAP50(B)" in done.stdout


@pytest.mark.slow
def test_the_examples_refuse_a_wrong_argument_in_one_line(photos_dataset, tmp_path):
    """A user's slip (no pack there, a pack of the other task, a model torchvision lacks) ends each
    example at once with one line and a non-zero exit, not a traceback after the model is built."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from make_detection import generate

    from gdsdata.packing.packer import pack

    _, _, classes = photos_dataset
    generate(str(tmp_path / "src"), 4, classes=2, seed=4, val=0.5)
    boxes = pack(str(tmp_path / "src" / "yolo" / "data.yaml"), str(tmp_path / "boxes"), format="yolo", workers=1).out
    missing = str(tmp_path / "missing.gds")
    write_photos(str(tmp_path / "two"), 4, classes=2)
    two = pack(str(tmp_path / "two"), str(tmp_path / "two.gds"), workers=1).out
    here = os.path.dirname(EXAMPLE)
    env = child_env(YOLO_OFFLINE="1")
    for script, args, code, said in (
            ("train_imagenet.py", ["--train", missing], 1, f"train_imagenet.py: error: {missing}"),
            ("train_imagenet.py", ["--train", boxes], 1, f"train_imagenet.py: error: {boxes} is a detection dataset"),
            ("train_imagenet.py", ["--train", classes, "--arch", "resnet180"], 2,
             "error: --arch resnet180: not one of torchvision's classifiers"),
            ("train_imagenet.py", ["--train", classes, "--batch-size", "4096"], 1,  # (no batch: trains nothing)
             "train_imagenet.py: error: --batch-size 4096 is more than the"),
            ("train_detection.py", ["--train", classes], 1,
             f"train_detection.py: error: {classes} is a classification dataset"),
            ("train_imagenet.py", ["--train", classes, "--val", two], 1,
             f"train_imagenet.py: error: {two} holds other classes than {classes} (2 against 3, class 2: none "
             f"against 'class2')"),
            ("train_detection.py", ["--train", missing], 1, f"train_detection.py: error: {missing}"),
            ("train_detection.py", ["--train", boxes, "--batch-size", "64"], 1,
             f"train_detection.py: error: --batch-size 64 is more than the 2 images of {boxes}"),
            ("train_yolo.py", ["--train", missing, "--val", boxes, "--device", "cpu"], 1,
             f"train_yolo.py: error: {missing}")):
        done = subprocess.run([sys.executable, os.path.join(here, script), *args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        assert done.returncode == code and said in last and "Traceback" not in done.stderr, (script, done.stderr)
    ckpt = tmp_path / "new" / "folder" / "r18.pt"  # a checkpoint folder not made yet: made, not a crash at the save
    _run(["--train", classes, "--arch", "resnet18", "--epochs", "1", "--batch-size", "8", "--size", "32",
          "--max-steps", "1", "--checkpoint", str(ckpt)], tmp_path)
    assert ckpt.is_file()
