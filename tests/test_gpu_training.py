"""The GPU path beside a training loop, and stalls on the GPU (pytest -m gpu; skipped without CUDA).

A model training on the same GPU is what made nvJPEG's hardware decoder hang; these tests train one
with the stall watchdog armed, so that a hang fails the test instead of hanging it.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import write_photos

import gdsdata
from gdsdata import settings
from gdsdata import stall
from gdsdata.packing.packer import pack

pytestmark = pytest.mark.gpu
PATHS = [("host", "hardware"), ("device", "hardware"), ("host", "gpu_hybrid")]


@pytest.fixture(scope="module")
def training_set(tmp_path_factory):
    """192 photos in 4 classes."""
    src = str(tmp_path_factory.mktemp("train_src"))
    write_photos(src, 192, classes=4, start_seed=900, scale=0.6)
    out = str(tmp_path_factory.mktemp("train") / "ds")
    pack(src, out, workers=2)
    return out


def small_convnet():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 4))


@pytest.mark.parametrize("staging, backend", PATHS, ids=[f"{b}-{s}" for s, b in PATHS])
def test_a_model_trains_500_steps_on_loader_batches(training_set, staging, backend):
    """bf16 autocast, channels_last, SGD, no synchronisation per step: the loop the decoder hung
    beside. The watchdog is armed: a stall raises StallError and fails the test."""
    torch.backends.cudnn.benchmark = True
    model = small_convnet().cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with settings.set(staging=staging, decode_backend=backend, stall_timeout=30):
        ds = gdsdata.GDSDataset(training_set, device="cuda")
        loader = gdsdata.Loader(ds, 32, shuffle="full", drop_last=True,
                                transform=gdsdata.RandomResizedCrop(96, dtype="float16"))
        steps, losses = 0, []
        for epoch in range(200):
            loader.set_epoch(epoch)
            for images, labels in loader:
                with torch.autocast("cuda", torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(
                        model(images.contiguous(memory_format=torch.channels_last)), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
                if steps % 50 == 0:
                    losses.append(loss.item())
            if steps >= 500:
                break
        torch.cuda.synchronize()
        ds.close()
    assert steps >= 500
    assert all(torch.isfinite(torch.tensor(losses)))


SPIN = """
import triton
import triton.language as tl


@triton.jit
def spin(flag):
    value = tl.load(flag, volatile=True)
    while value == 0:
        value = tl.load(flag, volatile=True)
"""


def _spin_kernel(tmp_path):
    """A GPU kernel that runs until ``flag`` (an int32 CUDA tensor) is set: GPU work that never ends."""
    pytest.importorskip("triton")
    path = tmp_path / "spin_kernel.py"
    path.write_text(SPIN)
    sys.path.insert(0, str(tmp_path))
    try:
        import spin_kernel
    finally:
        sys.path.remove(str(tmp_path))
    return spin_kernel.spin


def test_a_wait_on_gpu_work_that_never_ends_is_bounded(tmp_path):
    spin = _spin_kernel(tmp_path)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stuck = torch.cuda.Stream()
    with torch.cuda.stream(stuck):
        spin[(1,)](flag)
        event = torch.cuda.Event()
        event.record(stuck)
    try:
        with pytest.raises(gdsdata.StallError, match="the thing waited for"):
            stall.wait(event, "the thing waited for", timeout=1.0)
    finally:
        with torch.cuda.stream(torch.cuda.Stream()):
            flag.fill_(1)
        event.synchronize()


def test_a_decode_stuck_on_the_gpu_raises_in_the_training_loop(training_set, tmp_path):
    """The decode thread waits for GPU work that does not finish (as a hung nvJPEG call does): the
    loop gets a StallError naming the decode thread, the batch and the call; once the GPU work ends,
    the stuck thread ends too."""
    spin = _spin_kernel(tmp_path)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    ds = gdsdata.GDSDataset(training_set, device="cuda")
    original, calls = ds._backend.decode, {"n": 0}

    def decode(staged, stream=None):
        calls["n"] += 1
        if calls["n"] == 3:
            spin[(1,)](flag)  # on the decode thread's stream
            event = torch.cuda.Event()
            event.record()
            stall.wait(event, "nvjpegDecodeBatched (stand-in)", timeout=120)
        return original(staged, stream)

    ds._backend.decode = decode
    loader = gdsdata.Loader(ds, 32, shuffle=None, transform=gdsdata.CenterCrop(64))
    try:
        with settings.set(stall_timeout=2.0), pytest.raises(gdsdata.StallError) as caught:
            for _ in loader:
                pass
        message = str(caught.value)
        assert "decode thread" in message and "batch 2 of epoch 0" in message
        assert "nvjpegDecodeBatched (stand-in)" in message
    finally:
        with torch.cuda.stream(torch.cuda.Stream()):
            flag.fill_(1)
        torch.cuda.synchronize()
        ds.close()


def test_the_interpreter_exits_after_a_stall_with_gpu_work_stuck(training_set, tmp_path):
    """Nothing left behind keeps the process alive: the GPU work never ends here."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import gdsdata
        from gdsdata import settings
        from gdsdata import stall
        from spin_kernel import spin
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        ds = gdsdata.GDSDataset({training_set!r}, device="cuda")
        original = ds._backend.decode

        def decode(staged, stream=None):
            spin[(1,)](flag)
            event = torch.cuda.Event()
            event.record()
            stall.wait(event, "stuck forever", timeout=3600)
            return original(staged, stream)

        ds._backend.decode = decode
        try:
            with settings.set(stall_timeout=2.0):
                for _ in gdsdata.Loader(ds, 32, transform=gdsdata.CenterCrop(64)):
                    pass
        except gdsdata.StallError as e:
            print("raised:", e, flush=True)
    """))
    (tmp_path / "spin_kernel.py").write_text(SPIN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "raised:" in done.stdout, done.stderr[-2000:]
    assert "stuck forever" in done.stdout
