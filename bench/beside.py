#!/usr/bin/env python3
"""What the GPU input path costs a train step on the same GPU, stage by stage.

Where the training client (bench/train.py) gives one figure per input, this splits the JPEG path's:
one batch of its work a train step, on a side stream, from a thread of its own (as the Loader's
threads do), beside bench/train.py's own train step on synthetic input:

  step alone        the train step, nothing beside it
  decode            the batch decoded by nvJPEG from its staging buffer (the dataset's own decoder;
                    the batches are read into staging once, before: the training client times the reads)
  decode + resize   the same, then RandomResizedCrop(224) fp16 NCHW, antialiased (torchvision v2's
                    default) or plain bilinear
  decode, placed    nvJPEG's hardware decode of a batch of the same JPEGs (the first 256 of the
                    set, from pinned memory, into one buffer), each row's waits polled alike, placed
                    (--places, --outputs) on a thread in torch's context ("a thread": the control,
                    gdsdata's place), on a thread with a CUDA context of its own (cuCtxCreate: its
                    own driver state, memory and streams), or in a spawned process (its own context;
                    each batch asked for over a pipe); nvJPEG writing RGB interleaved (a conversion
                    kernel an image) or YUV planes (no kernel of nvJPEG's own, but a copy a plane:
                    docs/design.md). Without MPS the GPU runs one context's kernels at a time, so
                    another context's rows also pay those turns (RGB's kernels most). The pixels are
                    not used: these rows say what the decode's place costs the step, not a pipeline

images/s as a fraction of the step alone, the modes interleaved pass by pass (alternating their
order), medians over --passes. Before that, the resize kernels alone: their GPU time a batch
(torch.profiler) over the same decoded batches.

    python bench/beside.py --dir /tmp/beside --out results/
"""

import argparse
import ctypes
import functools
import glob
import io
import json
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import begin, image_set  # noqa: E402
from train import BATCH, _Model  # noqa: E402

import gdsdata  # noqa: E402
from gdsdata import stall  # noqa: E402
from gdsdata import transforms as T  # noqa: E402
from gdsdata._native import cuda, nvjpeg  # noqa: E402

RESIZES = {"antialiased": True, "bilinear": False}
PLACES = ("thread", "context", "process")
OUTPUTS = ("rgb", "yuv")
_OUTPUT_YUV = 1  # nvjpegOutputFormat_t
_WAIT = 60.0  # seconds any wait of this bench may last before it is called a hang
_ANSWER = _WAIT + 10  # a placed decode's answer: past its own bounded wait, which says it first, naming itself


def dataset(folder, count):
    """``count`` ImageNet-like JPEGs (bench/train.py's set) packed once; the GPU dataset over them."""
    src = image_set(os.path.join(folder, f"images-{count}"), count, classes=8, noise=11.0, quality=92)
    root = os.path.join(folder, f"jpeg-{count}.gds")
    if not os.path.exists(os.path.join(root, "index.gdsi")):
        gdsdata.pack(src, root, overwrite=True)
    return gdsdata.GDSDataset(root, device="cuda")


class Input:
    """The JPEG path's GPU work for batch ``k`` (of the dataset's whole batches, in turn, each read into
    its staging buffer once) on ``stream``: nvJPEG's decode, then the resize if asked."""

    def __init__(self, ds):
        self.ds = ds
        batches = [list(range(b * BATCH, (b + 1) * BATCH)) for b in range(len(ds) // BATCH)]
        ds.reserve_staging(len(batches))
        self.staged = [ds.read_staged(indices) for indices in batches]
        # the crops made once, as a Loader's transform is, not once a batch
        self.transforms = {aa: gdsdata.RandomResizedCrop(224, dtype="float16", antialias=aa) for aa in RESIZES.values()}
        torch.cuda.synchronize()  # reads still in flight on the GPU (device staging) have landed

    def decode(self, k, stream):
        """Batch ``k`` decoded on ``stream`` from its staging buffer, which stays held for the next
        use (the dataset's ``decode_staged`` hands the buffer back after one decode: hence its
        decoder itself), as the Loader's decode thread decodes; the arena is freed when the returned
        batch goes."""
        staged = self.staged[k % len(self.staged)]
        with torch.cuda.stream(stream):
            return self.ds._backend.decoder.decode(staged.tensor, staged.job, stream), staged.indices

    def __call__(self, k, stream, antialias=None):
        batch, indices = self.decode(k, stream)
        if antialias is not None:
            with torch.cuda.stream(stream):
                self.resize(batch, indices, k, antialias)

    def close(self):
        for staged in self.staged:
            self.ds.release_staged(staged)
        self.ds.close()

    def resize(self, batch, indices, k, antialias):
        transform = self.transforms[antialias]
        params = transform.params(batch.heights, batch.widths, indices, epoch=k)
        T.apply(transform, batch.buffer, batch.offsets, batch.heights, batch.widths, batch.channels, params)


def read_jpegs(folder, count):
    """(bitstreams, [(height, width, chroma (horizontal, vertical) subsampling)]) of the first
    ``count`` three-component JPEGs under ``folder``."""
    from PIL import Image, JpegImagePlugin

    factors = {0: (1, 1), 1: (2, 1), 2: (2, 2)}  # PIL's sampling codes: 4:4:4, 4:2:2, 4:2:0
    streams, shapes = [], []
    for path in sorted(glob.glob(os.path.join(folder, "*", "*.jpg"))):
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as image:
            sampling = JpegImagePlugin.get_sampling(image)
            if image.mode != "RGB" or sampling not in factors:
                continue
            shapes.append((image.height, image.width, factors[sampling]))
        streams.append(data)
        if len(streams) == count:
            return streams, shapes
    raise SystemExit(f"bench/beside.py: {folder} holds {len(streams)} RGB JPEGs, {count} needed")


def plane_layout(shapes, output):
    """Where nvJPEG writes each image of a batch in one buffer: ([(offsets, pitches)] a plane, bytes
    an image), for ``shapes`` [(height, width, (horizontal, vertical) chroma subsampling)]: RGB
    interleaved (one plane, 3 bytes a pixel), or YUV (Y, then Cb and Cr at the subsampled size)."""
    heights = np.array([s[0] for s in shapes], np.int64)
    widths = np.array([s[1] for s in shapes], np.int64)
    if output == "rgb":
        shapes_ = [(heights, widths * 3)]
    else:
        across = np.array([s[2][0] for s in shapes], np.int64)
        down = np.array([s[2][1] for s in shapes], np.int64)
        chroma = (-(-heights // down), -(-widths // across))
        shapes_ = [(heights, widths), chroma, chroma]
    sizes = sum(rows * pitch for rows, pitch in shapes_)
    at = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    planes = []
    for rows, pitch in shapes_:
        planes.append((at, pitch))
        at = at + rows * pitch
    return planes, sizes


class _OwnContext:
    """A CUDA context of its own, made current on the calling thread, with the memory and stream the
    decode needs allocated in it."""

    def __init__(self, device_index):
        lib = cuda._driver()
        self.lib = lib
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self._check("cuInit", lib.cuInit(0))
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), device_index))
        self._check("cuCtxCreate", lib.cuCtxCreate_v2(ctypes.byref(context), 0, device))
        self._check("cuCtxSetCurrent", lib.cuCtxSetCurrent(context))
        self.handle = context

    def _check(self, call, status):
        cuda._check(self.lib, call, status)

    def pinned(self, size):
        pointer = ctypes.c_void_p()
        self._check("cuMemHostAlloc", self.lib.cuMemHostAlloc(ctypes.byref(pointer), ctypes.c_size_t(size), 1))
        return pointer.value, np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(pointer.value))

    def device(self, size):
        pointer = ctypes.c_uint64()
        self._check("cuMemAlloc", self.lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)))
        return pointer.value

    def close(self):
        """Destroy the context, and with it the memory and stream made in it (on the thread it is
        current on, once nothing of it runs)."""
        self._check("cuCtxDestroy", self.lib.cuCtxDestroy_v2(self.handle))

    def stream(self) -> "_DriverStream":
        handle = ctypes.c_void_p()
        self._check("cuStreamCreate", self.lib.cuStreamCreate(ctypes.byref(handle), 1))
        return _DriverStream(self, handle.value)


class _DriverStream:
    """A stream of an ``_OwnContext``, waited for as torch's are (``stall.wait`` polls ``query``)."""

    def __init__(self, context, handle):
        self.context, self.cuda_stream = context, handle

    def query(self) -> bool:
        status = self.context.lib.cuStreamQuery(ctypes.c_void_p(self.cuda_stream))
        if status != 600:  # CUDA_ERROR_NOT_READY
            self.context._check("cuStreamQuery", status)
        return status == 0


class Decode:
    """nvJPEG's hardware decoder over one batch of bitstreams in pinned memory, into one output
    buffer: in torch's context, or (``own_context``) in a context of its own made current on the
    calling thread. ``run()`` decodes the batch and waits for it; returns its seconds."""

    def __init__(self, streams, shapes, output, own_context=False):
        self.context = _OwnContext(0) if own_context else None
        self.nvjpeg = nvjpeg.BatchedDecoder("hardware")
        lengths = np.array([len(s) for s in streams], np.uint64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        total = int(lengths.sum())
        if self.context:
            base, host = self.context.pinned(total)
        else:
            self._staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            base, host = self._staging.data_ptr(), self._staging.numpy()
        for stream, start in zip(streams, starts):
            host[int(start):int(start) + len(stream)] = np.frombuffer(stream, np.uint8)
        self.data, self.lengths = np.uint64(base) + starts, lengths
        planes, sizes = plane_layout(shapes, output)
        if self.context:
            out, self.stream = self.context.device(int(sizes.sum())), self.context.stream()
        else:
            self._out = torch.empty(int(sizes.sum()), dtype=torch.uint8, device="cuda")
            out, self.stream = self._out.data_ptr(), torch.cuda.Stream()
        self.images = np.zeros(len(streams), self.nvjpeg._image_t)
        for k, (offsets, pitch) in enumerate(planes):
            self.images["channel"][:, k] = np.uint64(out) + offsets.astype(np.uint64)
            self.images["pitch"][:, k] = pitch
        code = nvjpeg.OUTPUT_RGBI if output == "rgb" else _OUTPUT_YUV
        lib = self.nvjpeg.lib
        nvjpeg._check("nvjpegDecodeBatchedInitialize", lib.nvjpegDecodeBatchedInitialize(
            self.nvjpeg.handle, self.nvjpeg.state, len(streams), 1, code))

    def run(self) -> float:
        t0 = time.perf_counter()
        lib = self.nvjpeg.lib
        nvjpeg._check("nvjpegDecodeBatched", lib.nvjpegDecodeBatched(
            self.nvjpeg.handle, self.nvjpeg.state, self.data.ctypes.data, self.lengths.ctypes.data,
            self.images.ctypes.data, ctypes.c_void_p(self.stream.cuda_stream)))
        stall.wait(self.stream, "a decode of bench/beside.py", _WAIT)
        return time.perf_counter() - t0

    def close(self):
        self.nvjpeg.close()
        if self.context:
            self.context.close()


class _Worker:
    """A thread that makes a ``Decode`` (in torch's context, or in a context of its own made current
    on it) and decodes a batch each time it is asked, as gdsdata's decode thread makes its decoder
    and decodes on it: what a spawned process does, inside the training process."""

    def __init__(self, streams, shapes, output, own_context):
        self._asks, self._answers = queue.Queue(), queue.Queue()
        self._thread = threading.Thread(target=self._serve, args=(streams, shapes, output, own_context), daemon=True)
        self._thread.start()
        try:
            _seconds(self._answer(120))
        except RuntimeError:
            self._asks.put(None)  # (its loop ends once the decoder it makes is made, or its making failed)
            raise

    def _answer(self, timeout):
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the decode thread did not answer within {timeout:g} s") from None

    def _serve(self, streams, shapes, output, own_context):
        _serve(lambda: Decode(streams, shapes, output, own_context), lambda: self._asks.get() is not None,
               self._answers.put)

    def run(self) -> float:
        self._asks.put(True)
        return _seconds(self._answer(_ANSWER))

    def close(self):
        self._asks.put(None)
        self._thread.join(timeout=_ANSWER)


def _serve(make, asked, answer):
    """A placed decode's loop, on its thread or in its process: ``make()`` the ``Decode`` and decode
    once, then ``answer`` 0.0 (or why it failed, as a string) and a batch's seconds each time
    ``asked()`` is true; the decoder destroyed where it was made once ``asked()`` is false."""
    try:
        decode = make()
        decode.run()
    except Exception as e:  # noqa: BLE001 - answered: the caller raises it
        answer(f"{type(e).__name__}: {e}")
        return
    answer(0.0)
    while asked():
        try:
            answer(decode.run())
        except Exception as e:  # noqa: BLE001 - answered: the caller raises it
            answer(f"{type(e).__name__}: {e}")
    decode.close()


def _seconds(answer) -> float:
    """A placed decode's answer: its seconds, or (a string) why it failed, raised."""
    if isinstance(answer, str):
        raise RuntimeError(answer)
    return answer


def _child(connection, streams, shapes, output):
    """A spawned process's decode loop: a batch decoded each time it is asked."""
    _serve(lambda: Decode(streams, shapes, output), connection.recv, connection.send)


class _Process:
    """A spawned process (its own CUDA context) decoding a batch each time it is asked, over a pipe."""

    def __init__(self, streams, shapes, output):
        self._connection, theirs = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_child, args=(theirs, streams, shapes, output), daemon=True)
        self._process.start()
        theirs.close()  # (the child's end: once it is gone, this end reads end-of-file)
        try:
            _seconds(self._recv(120))
        except RuntimeError:
            self.close()
            raise

    def _recv(self, timeout):
        try:
            if self._connection.poll(timeout):
                return self._connection.recv()
        except EOFError:
            pass
        self._process.join(timeout=1)
        raise RuntimeError(f"the decode process did not answer within {timeout:g} s (exit code "
                           f"{self._process.exitcode})")

    def run(self) -> float:
        self._connection.send(True)
        return _seconds(self._recv(_ANSWER))

    def close(self):
        try:
            self._connection.send(False)
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=_ANSWER)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)


def placements(jpegs, places, outputs) -> tuple:
    """({row name: its decoder}, {row name: why it could not be made}) for the placed decode rows."""
    made, failed = {}, {}
    for place in places:
        for output in outputs:
            name = f"decode {output}, {'a thread' if place == 'thread' else 'own ' + place}"
            try:
                made[name] = (_Process(*jpegs, output) if place == "process"
                              else _Worker(*jpegs, output, own_context=place == "context"))
            except Exception as e:  # noqa: BLE001 - said, recorded, and the row left out
                failed[name] = f"{type(e).__name__}: {e}"
                print(f"{name}: {failed[name]}", flush=True)
    return made, failed


def kernel_ms(inputs, antialias, batches=16) -> float:
    """GPU time a batch of the resize kernels alone (torch.profiler), over decoded batches kept aside."""
    stream = torch.cuda.current_stream()
    decoded = [inputs.decode(k, stream) for k in range(4)]
    for k in range(4):
        inputs.resize(*decoded[k % 4], k, antialias)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for k in range(batches):
            inputs.resize(*decoded[k % 4], k, antialias)
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name) / 1e3 / batches


class WorkFailed(RuntimeError):
    """The input work beside the step failed or stopped making progress (not the step itself)."""


def rate(model, work, steps, images, labels) -> tuple:
    """(images/s, batches of input work a step) over ``steps`` train steps while a thread does
    ``work(k, stream)`` on a side stream, a batch for each step the loop has issued (at most two
    ahead, as the Loader's prefetch); ``work`` None: the step alone. ``WorkFailed`` where the work
    failed."""
    tokens, stop, failed, done = threading.Semaphore(2), threading.Event(), [], [0]
    side = torch.cuda.Stream()

    def feed():
        try:
            while not stop.is_set():
                if tokens.acquire(timeout=0.1):
                    work(done[0], side)
                    side.synchronize()
                    done[0] += 1
        except BaseException as e:  # noqa: BLE001 - raised by the pass
            failed.append(e)

    feeder = threading.Thread(target=feed, daemon=True) if work is not None else None
    if feeder is not None:
        feeder.start()
    try:
        torch.cuda.synchronize()
        t0, first = time.perf_counter(), done[0]
        for _ in range(steps):
            model.step(images, labels)
            tokens.release()
        torch.cuda.synchronize()
        seconds, batches = time.perf_counter() - t0, done[0] - first
    finally:
        stop.set()
    if feeder is not None:
        feeder.join(timeout=_WAIT)
        if feeder.is_alive():
            raise WorkFailed(f"the input work beside the step made no progress for {_WAIT:g} s")
    if failed:
        raise WorkFailed(f"{type(failed[0]).__name__}: {failed[0]}") from failed[0]
    return steps * BATCH / seconds, (batches / steps if work is not None else 0.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="working folder for the images and their pack")
    parser.add_argument("--count", type=int, default=2048, help=f"images, at least {BATCH} (default 2048: 8 batches)")
    parser.add_argument("--models", default="resnet18,resnet50", help="torchvision models of the train step")
    parser.add_argument("--steps", default="",
                        help="steps a pass: one count for every model, or one each (default: 100 for resnet18, 36 "
                             "for any other: about 2 s a pass on an H100)")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--places", default=",".join(PLACES),
                        help=f"where the placed decode rows decode, of {', '.join(PLACES)} ('' for none)")
    parser.add_argument("--outputs", default=",".join(OUTPUTS), help=f"their nvJPEG output, of {', '.join(OUTPUTS)}")
    parser.add_argument("--out", default="bench-results", help="folder for beside.json")
    args, system = begin(parser, argv)
    places = [p for p in args.places.split(",") if p]
    outputs = [o for o in args.outputs.split(",") if o]
    unknown = [p for p in places if p not in PLACES] + [o for o in outputs if o not in OUTPUTS]
    if unknown:
        parser.error(f"unknown place(s) or output(s): {', '.join(unknown)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    steps = [int(s) for s in args.steps.split(",") if s.strip()] or [100 if m == "resnet18" else 36 for m in models]
    if len(steps) == 1:
        steps *= len(models)
    if len(steps) != len(models):
        parser.error(f"--steps takes one count, or one per model ({len(models)})")
    if args.count < BATCH:
        parser.error(f"--count is at least {BATCH} (a batch)")
    if not torch.cuda.is_available():
        print("bench/beside.py needs a CUDA GPU")
        return 1
    inputs = Input(dataset(args.dir, args.count))
    elsewhere, failed = placements(read_jpegs(os.path.join(args.dir, f"images-{args.count}"), BATCH), places,
                                   outputs)
    print(f"path: {inputs.ds.load_path.describe()}")
    results = {"arguments": vars(args), "decode backend": inputs.ds.load_path.backend, "rows not made": failed,
               "rows dropped": {}, "kernel_ms": {name: kernel_ms(inputs, aa) for name, aa in RESIZES.items()}}
    print(f"\n== resize kernels alone, GPU ms a batch of {BATCH} (RandomResizedCrop 224, fp16 NCHW; the kernels' "
          f"time under torch.profiler) ==")
    for name, ms in results["kernel_ms"].items():
        print(f"{name:<12} {ms:7.3f}")
    modes = {"step alone": None, "decode": inputs,
             **{f"decode + {name} resize": functools.partial(inputs, antialias=aa) for name, aa in RESIZES.items()},
             **{name: (lambda k, stream, run=decoder.run: run()) for name, decoder in elsewhere.items()}}
    images = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.float16)
    labels = torch.randint(0, 1000, (BATCH,), device="cuda")
    try:
        for name, count in zip(models, steps):
            _model_rows(name, count, args.passes, modes, elsewhere, results, images, labels)
    finally:
        inputs.close()
        for decoder in elsewhere.values():
            decoder.close()
        with open(os.path.join(args.out, "beside.json"), "w") as f:
            json.dump({"system": system, "results": results}, f, indent=2, default=str)
    return 0


def _model_rows(name, count, passes, modes, elsewhere, results, images, labels):
    """One model's rows: each mode warmed up, then ``passes`` passes of ``count`` steps, interleaved;
    a placed row whose decode fails is said, recorded and dropped (from ``modes`` and ``elsewhere``,
    its decoder closed)."""
    model = _Model(name)
    runs = {mode: [] for mode in modes}

    def timed(mode, steps):
        try:
            return rate(model, modes[mode], steps, images, labels)
        except WorkFailed as e:
            if mode not in elsewhere:
                raise
            results["rows dropped"][mode] = f"{name}: {e}"
            print(f"{mode}: dropped ({e})", flush=True)
            del modes[mode], runs[mode]
            elsewhere.pop(mode).close()
            return None

    for mode in list(modes):  # cuDNN's choices made, the kernels compiled, the decoder created
        timed(mode, 15)
    for p in range(passes):
        for mode in (list(modes) if p % 2 == 0 else list(modes)[::-1]):
            if mode in modes:
                result = timed(mode, count)
                if result is not None:
                    runs[mode].append(result)
    report(name, count, passes, runs, results.setdefault(name, {}))


def report(name, count, passes, runs, rows):
    """Print a model's table (and fill ``rows``, its part of beside.json)."""
    alone = statistics.median(r for r, _ in runs["step alone"])
    print(f"\n== {name} train step (bf16, channels_last, SGD, batch {BATCH}) with a batch of input work a "
          f"step beside it; median of {passes} passes of {count} steps ==")
    print(f"{'beside the step':<28} {'images/s':>9} {'of the step alone':>18} {'batches/step':>13}  each pass")
    for mode, values in runs.items():
        rates = [r for r, _ in values]
        median = statistics.median(rates)
        per_step = statistics.median(b for _, b in values)
        rows[mode] = {"images_per_s": median, "of_step_alone": median / alone, "rates": rates,
                      "batches_per_step": [b for _, b in values]}
        print(f"{mode:<28} {median:9.0f} {median / alone:18.4f} {per_step:13.2f}  "
              + " ".join(f"{v:.0f}" for v in rates))


if __name__ == "__main__":
    sys.exit(main())
