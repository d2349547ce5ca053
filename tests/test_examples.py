"""The example users copy runs as documented: train, checkpoint, resume mid-epoch, evaluate; under
torchrun too (on the CPU here, gloo)."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_imagenet.py")


def _run(args, tmp_path, torchrun=0):
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), ".."), "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    done = subprocess.run(prefix + [EXAMPLE] + args, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


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


@pytest.mark.slow
def test_torchrun_two_ranks(photos_dataset, tmp_path):
    _, _, out = photos_dataset
    printed = _run(["--train", out, "--arch", "resnet18", "--epochs", "1", "--batch-size", "4", "--size", "32",
                    "--log-every", "1"], tmp_path, torchrun=2)
    assert "step 7/7" in printed  # 60 samples over 2 ranks, batches of 4, drop_last
