#!/usr/bin/env python3
"""The training client: how fast a real train step runs when each input pipeline feeds it.

A torchvision ResNet train step (bf16 autocast, channels_last, SGD with momentum, cudnn.benchmark,
batch 256, 224 px) consumes batches from each input, in one run over the same images:

  synthetic   random GPU tensors made once: the model's own ceiling
  gdsdata     gdsdata.Loader over the packed JPEGs (RandomResizedCrop 224 + flip + normalise fp16);
              gdsdata:BACKEND forces an nvJPEG backend by nvJPEG's name: hardware, hardware_device,
              gpu_hybrid or gpu_hybrid_device (decode_backend, staging=device for *_device);
              gdsdata:nocrc turns checksums off (what they cost), gdsdata:bilinear resamples
              without antialiasing (what torchvision v2's antialiased default costs),
              gdsdata:direct streams from storage (io_engine=direct: the page cache dropped, or the
              pack's files evicted, before the row; every epoch then comes from the drive),
              gdsdata:direct_block the same with shuffle="block" (each shuffle window's whole blocks
              read at once), gdsdata:prefetchN with N batches ready ahead (Loader(prefetch=N);
              2 by default); any input with :queuesN (gdsdata:queues8, dali:queues32) runs its row
              with CUDA_DEVICE_MAX_CONNECTIONS=N (gdsdata's import sets 32 where the environment
              does not; CUDA's default 8)
  raw         the same over a raw-pixel pack of the images (shorter side 256), each sample's CRC-32
              checked where it lands in GPU staging (the GPU kernel, by default); raw:nocrc without
              (what the checksums cost)
  dali        DALI's file reader + mixed random-crop decode + resize + crop_mirror_normalize fp16
              (when nvidia.dali imports)
  dataloader  torch DataLoader + ImageFolder + PIL (RandomResizedCrop, flip, normalise), --workers

Every (model, input, stream) row runs in a fresh process: a warm-up epoch, then --epochs timed
epochs (median images/s); with ``--rounds N`` every row runs once a round, the rounds one after
another, and the table gives each row's median over the rounds, its fraction of synthetic the
median of each round's ratio to that round's synthetic row (ResNet-18's fraction moves by a few
points between processes). CPU-seconds per 1,000 images count the whole process (the training
thread and DataLoader workers included); "GPU MiB" is the device memory in use during the timed
epochs beyond what the same process used after training on synthetic input (the model, its
activations and the CUDA context), i.e. what the input pipeline holds. A row also gives the share
of the host's CPU time its hypervisor took during the timed epochs ("steal", where above 0), and the
system block the host's speed, so that runs on a busy or slow host can be told apart; and, where
NVML answers, the GPU's median SM clock and power over the timed epochs and how often NVML said
the power cap or heat held its clocks down, so that a row run at lower clocks can be told apart too.
``--streams current,side,high`` adds rows with the train step on a side stream, and on a side stream
of the highest priority (whose kernels the GPU schedules before the pipeline's). A row that makes no
step for --stall seconds is a hang.

    python bench/train.py --dir /tmp/bench --out results/                 # the table
    python bench/train.py --dir /tmp/bench --models resnet18 --inputs synthetic,gdsdata --rounds 5
    python bench/train.py --dir /tmp/bench --soak 10 --inputs gdsdata     # hangs in 10 processes each
    python bench/train.py --dir /tmp/bench --inputs synthetic,gdsdata --profile 20   # GPU time per batch
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, HERE)

BATCH = 256
INPUTS = ("synthetic", "gdsdata", "raw", "dali", "dataloader")
# CUDA's hardware work queues as the bench was started (before its own import of gdsdata sets them):
# what every row gets but gdsdata's and raw's (their processes import gdsdata first, as a training
# script does)
QUEUES = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


# --- one row, in its own process ------------------------------------------------------------------
def _device_used():
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


class _Model:
    """A torchvision classifier's train step, on the current stream, a side stream, or a side stream of the
    highest priority (``high``: the GPU's block scheduler serves its kernels before the pipeline's)."""

    def __init__(self, name, stream="current"):
        import torch
        import torchvision

        torch.backends.cudnn.benchmark = True
        self.torch = torch
        self.model = getattr(torchvision.models, name)(num_classes=1000).cuda().to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
        self.loss = torch.nn.CrossEntropyLoss()
        priority = torch.cuda.Stream.priority_range()[1] if stream == "high" else 0  # (least, greatest)
        self.stream = None if stream == "current" else torch.cuda.Stream(priority=priority)

    def step(self, images, labels):
        torch = self.torch
        if self.stream is not None:  # the input was made on the current stream
            self.stream.wait_stream(torch.cuda.current_stream())
            images.record_stream(self.stream)
            labels.record_stream(self.stream)
        with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
            with torch.autocast("cuda", torch.bfloat16):
                loss = self.loss(self.model(images.contiguous(memory_format=torch.channels_last)), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _synthetic(count):
    import torch

    images = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.float16)
    labels = torch.randint(0, 1000, (BATCH,), device="cuda")

    def epoch():
        for _ in range(count // BATCH):
            yield images, labels

    return epoch


def _gdsdata(root, antialias=True, verify=None, shuffle=True, prefetch=2):
    import gdsdata

    ds = gdsdata.GDSDataset(root, device="cuda", verify_checksums=verify)
    loader = gdsdata.Loader(ds, BATCH, shuffle=shuffle, drop_last=True, prefetch=prefetch,
                            transform=gdsdata.RandomResizedCrop(224, dtype="float16", antialias=antialias))
    state = {"epoch": 0}

    def epoch():
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        yield from loader

    epoch.path = ds.path.describe() if hasattr(ds, "path") else ds.load_path.describe()
    epoch.stats = loader.stats
    return epoch


def _dali(src, threads):
    import nvidia.dali
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    from peers import MEAN, STD

    @pipeline_def(batch_size=BATCH, num_threads=threads, device_id=0, prefetch_queue_depth=2)
    def train():
        jpegs, labels = fn.readers.file(file_root=src, random_shuffle=True, name="r")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW",
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip())
        return images, labels.gpu()

    pipe = train()
    pipe.build()
    iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="r", auto_reset=True,
                                   last_batch_policy=LastBatchPolicy.DROP)

    def epoch():
        for out in iterator:
            yield out[0]["images"], out[0]["labels"].view(-1).long()

    epoch.path = f"DALI {nvidia.dali.__version__}, {threads} threads"
    return epoch


def _dataloader(src, workers):
    import torch
    from torchvision import transforms
    from torchvision.datasets import ImageFolder
    from peers import MEAN, STD

    transform = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    loader = torch.utils.data.DataLoader(ImageFolder(src, transform=transform), batch_size=BATCH, shuffle=True,
                                         num_workers=workers, pin_memory=True, drop_last=True,
                                         persistent_workers=True, prefetch_factor=4)

    def epoch():
        for images, labels in loader:
            yield images.cuda(non_blocking=True).half(), labels.cuda(non_blocking=True)

    epoch.path = f"DataLoader, {workers} workers"
    return epoch


def _without_queues(name: str) -> str:
    """An input's name without its ``:queuesN`` (CUDA_DEVICE_MAX_CONNECTIONS=N for its row)."""
    base, _, queues = name.rpartition(":queues")
    return base if base and queues.isdigit() else name


def _variant(name):
    """The settings of a ``gdsdata:NAME`` input: an nvJPEG backend by nvJPEG's name, ``nocrc`` (no
    checksums) or ``direct`` (streaming reads past the page cache)."""
    if name == "nocrc":
        return {"verify_checksums": False}
    if name in ("direct", "direct_block"):
        return {"io_engine": "direct"}
    device = name.endswith("_device")
    return {"decode_backend": name.removesuffix("_device"), "staging": "device" if device else "host"}


def run_row(args):
    """One (model, input, stream) row in this process; prints one JSON line."""
    import torch

    from common import GpuClocks, ThreadCpu, cpu_seconds, host_cpu_times, steal_pct

    source = _without_queues(args.input)  # (":queuesN" on any input: the row's environment, set by spawn)
    if source.startswith(("gdsdata", "raw")):
        import gdsdata  # noqa: F401 - first, as a training script would: it sets CUDA's work queues before CUDA starts
    model = _Model(args.model, args.stream)
    progress = {"steps": 0, "t": time.monotonic()}

    def watchdog():  # a pipeline without a watchdog of its own that hangs still ends the row
        while True:
            time.sleep(1)
            if time.monotonic() - progress["t"] > args.stall:
                print(json.dumps({"hang": True, "steps": progress["steps"]}), flush=True)
                import faulthandler

                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    warm = _synthetic(BATCH * 10)
    for images, labels in warm():  # the model's kernels chosen and its memory in use before the input
        model.step(images, labels)
    torch.cuda.synchronize()
    del warm, images, labels
    baseline = _device_used()
    if source == "synthetic":
        epoch = _synthetic(args.count)
    elif source.startswith("gdsdata"):
        if ":" in source:
            from gdsdata import settings

            variant = source.split(":", 1)[1]
            settings.set(**({} if variant == "bilinear" or variant.startswith("prefetch") else _variant(variant)))
            if variant.startswith("direct"):  # from the drive: nothing of the pack in the page cache
                from common import drop_caches

                drop_caches([os.path.join(d, f) for d, _, files in os.walk(args.jpeg) for f in files])
        epoch = _gdsdata(args.jpeg, antialias=source != "gdsdata:bilinear",
                         shuffle="block" if source == "gdsdata:direct_block" else True,
                         prefetch=int(source.split(":prefetch", 1)[1]) if ":prefetch" in source else 2)
    elif source in ("raw", "raw:nocrc"):
        epoch = _gdsdata(args.raw, verify=False if source == "raw:nocrc" else None)
    elif source == "dali":
        epoch = _dali(args.src, args.workers)
    elif source == "dataloader":
        epoch = _dataloader(args.src, args.workers)
    else:
        raise SystemExit(f"unknown input {args.input!r}")
    rates, cpu, used, steps, stages, host = [], [], [], 0, None, None
    clocks, threads, timed_steps = GpuClocks(_nvml_index(torch)), ThreadCpu(), 0
    for e in range(1 + args.epochs):
        if e == 1:
            host = host_cpu_times()
            clocks.start()  # the GPU's clocks and power over the timed epochs
            threads.start()  # and each thread's CPU time
            if hasattr(epoch, "stats"):
                stages = epoch.stats()
        torch.cuda.synchronize()
        t0, c0, n = time.perf_counter(), cpu_seconds(), 0
        for images, labels in epoch():
            model.step(images, labels)
            n += images.shape[0]
            steps += 1
            progress["steps"], progress["t"] = steps, time.monotonic()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if e:  # the first epoch warms the pipeline
            rates.append(n / seconds)
            cpu.append((cpu_seconds() - c0) / n * 1000)
            used.append(_device_used() - baseline)
            timed_steps += n // BATCH
    steal = steal_pct(host, host_cpu_times())  # the hypervisor's share of the host's CPU over the timed epochs
    gpu_clocks, thread_cpu = clocks.stop(), threads.stop(timed_steps)
    if stages is not None:  # the Loader's stage times over the timed epochs, ms per batch
        from common import stage_ms

        stages = stage_ms(epoch.stats(), stages)
    profiled = None
    if args.profile:  # (on synthetic input: the step's own kernel time, to set beside the others)
        try:  # after the timed epochs: whatever happens here leaves the row's figures as measured
            profiled = gpu_profile(model, epoch, args.profile, trace=args.trace and os.path.join(
                args.trace, f"{args.model}-{args.input.replace(':', '-')}-{args.stream}-{os.getpid()}"))
        except Exception as e:  # noqa: BLE001 - reported in the row instead
            profiled = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps({"hang": False, "model": args.model, "input": args.input, "stream": args.stream,
                      "stages_ms_per_batch": stages, "gpu_profile": profiled,
                      "path": getattr(epoch, "path", ""), "images_per_s": statistics.median(rates),
                      "rates": rates, "cpu_s_per_1k": statistics.median(cpu),
                      "gpu_mib": max(used) / 2**20, "steps": steps, "host_steal_pct": steal,
                      "cuda_queues": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or "8 (CUDA's default)",
                      "gpu_clocks": gpu_clocks, "thread_cpu_ms_per_batch": thread_cpu}), flush=True)
    os._exit(0)  # no teardown: DataLoader workers and pipelines end with the process


def _nvml_index(torch):
    """NVML's index of the current CUDA device (they differ under CUDA_VISIBLE_DEVICES)."""
    try:
        return torch.cuda._get_nvml_device_index(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a torch without it: CUDA's own order
        return torch.cuda.current_device()


def gpu_profile(model, epoch, steps, skip=5, trace=None):
    """What the GPU does per batch over ``steps`` train steps inside an epoch (torch.profiler, after
    ``skip`` steps): the busiest stream's kernel time (the step's), the input pipeline's kernels on the
    other streams by name, and the copies; the whole timeline also to ``trace``-NNsteps.json.gz (a Chrome
    trace; bench/timeline.py reads it) when given."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    batches = iter(epoch())
    for _, (images, labels) in zip(range(skip), batches):
        model.step(images, labels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        done = 0
        for _, (images, labels) in zip(range(steps), batches):  # (an epoch shorter than asked: what it has)
            model.step(images, labels)
            done += 1
        torch.cuda.synchronize()
    steps = max(done, 1)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        if trace:
            import gzip
            import shutil

            os.makedirs(os.path.dirname(trace), exist_ok=True)
            with open(f.name, "rb") as src, gzip.open(f"{trace}-{steps}steps.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        events = [e for e in json.load(open(f.name))["traceEvents"]
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not events:  # no GPU activity recorded (no CUDA, or a profiler without CUPTI)
        return None
    from timeline import step_stream, stream_of

    step_on = step_stream(events)
    pipeline = {}
    for e in events:
        if stream_of(e) != step_on:
            key = "copies" if e["cat"] != "kernel" else e["name"][:60]
            pipeline[key] = pipeline.get(key, 0.0) + e["dur"] / 1e3 / steps
    return {"steps": steps,
            "step_kernels_ms": round(sum(e["dur"] for e in events if stream_of(e) == step_on) / 1e3 / steps, 3),
            "pipeline_ms": {k: round(v, 3) for k, v in sorted(pipeline.items(), key=lambda kv: -kv[1])[:8]}}


# --- the run ----------------------------------------------------------------------------------------
def prepare(args):
    import gdsdata
    from common import image_set

    src = image_set(os.path.join(args.dir, f"images-n{args.noise:g}"), args.count, classes=100, noise=args.noise,
                    quality=92)
    jpeg, raw = os.path.join(args.dir, f"jpeg-n{args.noise:g}.gds"), os.path.join(args.dir, f"raw-n{args.noise:g}.gds")
    for root, options in ((jpeg, None), (raw, gdsdata.PackOptions(codec="raw", raw_size=256))):
        if not os.path.exists(os.path.join(root, "index.gdsi")):
            gdsdata.pack(src, root, overwrite=True, options=options)
    from common import warm

    warm([os.path.join(dirpath, f) for r in (jpeg, raw) for dirpath, _, files in os.walk(r) for f in files]
         + [os.path.join(dirpath, f) for dirpath, _, files in os.walk(src) for f in files])
    return src, jpeg, raw


def spawn(args, model, source, stream, paths):
    src, jpeg, raw = paths
    command = [sys.executable, os.path.abspath(__file__), "--row", model, source, stream, "--src", src,
               "--jpeg", jpeg, "--raw", raw, "--count", str(args.count), "--epochs", str(args.epochs),
               "--workers", str(args.workers), "--stall", str(args.stall), "--profile", str(args.profile)]
    if args.trace:
        command += ["--trace", os.path.abspath(args.trace)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    queues = source.rpartition(":queues")[2] if _without_queues(source) != source else QUEUES
    if queues is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = queues
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.row_timeout, env=env)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = e.stdout or "", e.stderr or "", "timeout"
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    result = None
    for line in out.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
    if result is None or result.get("hang"):
        kind = "hang" if (result and result.get("hang")) or rc == "timeout" else f"failed (rc {rc})"
        print(f"  {model} {source} {stream}: {kind}\n{err[-3000:]}", flush=True)
        return {"model": model, "input": source, "stream": stream, "failed": kind,
                "seconds": time.monotonic() - t0, "stderr": err[-3000:]}
    result["seconds"] = time.monotonic() - t0
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="working folder for images and datasets")
    parser.add_argument("--count", type=int, default=10000, help="images (default 10000)")
    parser.add_argument("--noise", type=float, default=11.0, help="image set noise (11: ~80 KB ImageNet-like JPEGs)")
    parser.add_argument("--models", default="resnet50,resnet18")
    parser.add_argument("--inputs", default=",".join(INPUTS), help=f"comma-separated, of {', '.join(INPUTS)}")
    parser.add_argument("--streams", default="current",
                        help="comma-separated, of current, side, high (a side stream of the highest priority)")
    parser.add_argument("--side-inputs", default="synthetic,gdsdata",
                        help="the inputs that get side or high stream rows too")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per row, after one warm-up epoch")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers / DALI threads")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds without a step that make a hang")
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row once a round, N rounds in turn; the table gives medians over rounds")
    parser.add_argument("--soak", type=int, default=0,
                        help="instead of the table: N fresh processes per row, --epochs epochs each, hangs counted")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="per row, STEPS more steps under torch.profiler: the step's and the pipeline's GPU "
                             "time per batch")
    parser.add_argument("--trace", metavar="DIR",
                        help="with --profile: each row's GPU timeline there, as a gzipped Chrome trace")
    parser.add_argument("--out", default="bench-results", help="folder for train.json")
    parser.add_argument("--chart", nargs=2, metavar=("JSON", "PNG"), help="draw train.json as a chart and exit")
    parser.add_argument("--row", nargs=3, metavar=("MODEL", "INPUT", "STREAM"), help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--jpeg", help=argparse.SUPPRESS)
    parser.add_argument("--raw", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        args.model, args.input, args.stream = args.row
        return run_row(args)
    if args.chart:
        return chart(*args.chart)

    unknown = [i for i in args.inputs.split(",") if i and not (
        _without_queues(i) in (*INPUTS, "raw:nocrc") or (i.startswith("gdsdata:") and i != "gdsdata:"))]
    if unknown:  # (said before the images are made, not by each row after its warm-up)
        parser.error(f"unknown input(s) {', '.join(unknown)}: of {', '.join(INPUTS)}, raw:nocrc, gdsdata:VARIANT, "
                     f"each also with :queuesN")
    from common import print_system_block, system_block

    os.makedirs(args.out, exist_ok=True)
    system = system_block()
    print_system_block(system)
    paths = prepare(args)
    if not args.models:
        return
    models, streams = args.models.split(","), args.streams.split(",")
    inputs = [i for i in args.inputs.split(",") if i]
    if any(_without_queues(i) == "dali" for i in inputs):
        try:
            import nvidia.dali  # noqa: F401
        except ImportError as e:
            print(f"DALI not importable ({e}): its rows skipped")
            inputs = [i for i in inputs if _without_queues(i) != "dali"]
    results = []
    if args.soak:
        print(f"\n== soak: {args.soak} fresh processes per row, {1 + args.epochs} epochs each ==")
        for model in models:
            for source in inputs:
                for stream in streams:
                    runs, row = [], {"model": model, "input": source, "stream": stream}
                    results.append(row)
                    for k in range(args.soak):  # each process reported and saved as it ends
                        runs.append(spawn(args, model, source, stream, paths))
                        done = runs[-1]
                        print(f"    process {k + 1}/{args.soak}: " + (done["failed"] if done.get("failed") else
                              f"{done['images_per_s']:.0f} images/s, {done['seconds']:.0f} s"), flush=True)
                        row.update(processes=len(runs), not_finished=sum(1 for r in runs if r.get("failed")),
                                   runs=runs)
                        _write(args, system, results)
                    hangs = sum(1 for r in runs if r.get("failed"))
                    rates = [r["images_per_s"] for r in runs if not r.get("failed")]
                    path = next((r.get("path") for r in runs if r.get("path")), "")
                    print(f"  {model:<9} {source:<10} {stream:<7} processes {len(runs)}  not finished {hangs}  "
                          f"images/s {min(rates, default=0):.0f}-{max(rates, default=0):.0f}  [{path}]", flush=True)
        return
    print(f"\n== training client: batch {BATCH}, {args.epochs} timed epochs of {args.count} images after one "
          f"warm-up, a fresh process per row" + (f", {args.rounds} rounds" if args.rounds > 1 else "") + " ==")
    side_inputs = set(args.side_inputs.split(","))
    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"-- round {round_ + 1} of {args.rounds}", flush=True)
        for model in models:
            for stream in streams:
                for source in inputs:
                    if stream != "current" and source not in side_inputs:
                        continue
                    result = spawn(args, model, source, stream, paths)
                    result["round"] = round_
                    results.append(result)
                    _print_row(result)
                    _write(args, system, results)
    table = summary(results)
    print("\n== summary" + (f": medians over {args.rounds} rounds" if args.rounds > 1 else "") + " ==")
    print(f"{'model':<9} {'stream':<7} {'input':<10} {'images/s':>9} {'of synthetic':>13} {'CPU-s/1k':>9} "
          f"{'GPU MiB':>8}" + ("  each round's fraction" if args.rounds > 1 else ""))
    for r in table:
        if r.get("failed"):
            print(f"{r['model']:<9} {r['stream']:<7} {r['input']:<10} {r['failed']:>9}")
            continue
        fraction = f"{r['of_synthetic']:.3f}" if r["of_synthetic"] is not None else "-"
        rounds = "  " + " ".join(f"{f:.3f}" for f in r["fractions"]) if args.rounds > 1 and r["fractions"] else ""
        print(f"{r['model']:<9} {r['stream']:<7} {r['input']:<10} {r['images_per_s']:>9.0f} {fraction:>13} "
              f"{r['cpu_s_per_1k']:>9.2f} {r['gpu_mib']:>8.0f}{rounds}")
    _write(args, system, results, table)
    try:
        chart(os.path.join(args.out, "train.json"), os.path.join(args.out, "train.png"))
    except ImportError:
        print("chart skipped (matplotlib missing)")


def _print_row(result):
    if result.get("failed"):  # spawn has said so, with the row's stderr
        return
    model, source, stream = result["model"], result["input"], result["stream"]
    print(f"  {model:<9} {source:<10} {stream:<7} {result['images_per_s']:>8.0f} images/s  "
          f"{result['cpu_s_per_1k']:.2f} CPU-s/1k  {result['gpu_mib']:>6.0f} MiB  [{result['path']}]"
          f"  queues {result.get('cuda_queues', 8)}"
          + (f"  steal {result['host_steal_pct']} %" if result.get("host_steal_pct") else ""), flush=True)
    if result.get("gpu_clocks"):
        c = result["gpu_clocks"]
        print(f"      GPU: SM {c['sm_mhz']:.0f} MHz, {c['watts']} W (medians), at the power cap "
              f"{c['power_capped_pct']} % and slowed down {c['slowed_pct']} % of the time", flush=True)
    if result.get("thread_cpu_ms_per_batch"):
        print("      CPU ms per batch by thread: " + ", ".join(
              f"{k} {v}" for k, v in list(result["thread_cpu_ms_per_batch"].items())[:10]), flush=True)
    if result.get("stages_ms_per_batch"):
        print("      ms per batch: " + ", ".join(f"{k} {v}" for k, v in result["stages_ms_per_batch"].items()),
              flush=True)
    if result.get("gpu_profile") and "error" not in result["gpu_profile"]:
        gp = result["gpu_profile"]
        print(f"      GPU ms per batch: the step's kernels {gp['step_kernels_ms']}" + ("; the pipeline's: " + ", ".join(
              f"{k} {v}" for k, v in gp["pipeline_ms"].items()) if gp["pipeline_ms"] else ""), flush=True)


def summary(results) -> list:
    """One row per (model, stream, input), in first-run order: the median over rounds of images/s,
    CPU-s/1k and GPU MiB, and of each round's ratio to the same round's synthetic row (a round
    without one, or a row that failed, gives no ratio). A row that failed in every round stays failed."""
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["stream"], r["input"]), []).append(r)
    ceilings = {(r["model"], r["stream"], r.get("round", 0)): r["images_per_s"] for r in results
                if r["input"] == "synthetic" and not r.get("failed")}
    table = []
    for (model, stream, source), runs in groups.items():
        done = [r for r in runs if not r.get("failed")]
        if not done:
            table.append({"model": model, "stream": stream, "input": source, "failed": runs[0]["failed"]})
            continue
        fractions = [r["images_per_s"] / ceilings[key] for r in done
                     if (key := (model, stream, r.get("round", 0))) in ceilings]
        table.append({"model": model, "stream": stream, "input": source, "rounds": len(done),
                      "images_per_s": statistics.median(r["images_per_s"] for r in done),
                      "cpu_s_per_1k": statistics.median(r["cpu_s_per_1k"] for r in done),
                      "gpu_mib": statistics.median(r["gpu_mib"] for r in done),
                      "fractions": fractions, "of_synthetic": statistics.median(fractions) if fractions else None,
                      "path": done[0].get("path", "")})
    return table


def chart(path_json, path_png):
    """Bars of each input's training images/s as a fraction of the synthetic rate, per model and stream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path_json) as f:
        data = json.load(f)
    rows = [r for r in data.get("summary") or summary(data["results"])
            if not r.get("failed") and r["input"] != "synthetic" and r["of_synthetic"] is not None]
    if not rows:  # a fraction needs the model's synthetic row
        print("chart skipped (no row beside its model's synthetic row)")
        return
    named = {"current": "", "side": " (side stream)", "high": " (high-priority stream)"}
    labels = [f"{r['model']} {r['input']}{named[r['stream']]}" for r in rows]
    fractions = [r["of_synthetic"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4))
    bars = ax.barh(labels[::-1], fractions[::-1], color=["#76b900" if "gdsdata" in label or " raw" in label
                                                          else "#888888" for label in labels[::-1]])
    for bar, r in zip(bars, rows[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {bar.get_width():.3f} ({r['images_per_s']:,.0f}/s)", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, 1.25)
    ax.set_xlabel("training images/s as a fraction of the same model on synthetic GPU input")
    system = data["system"]
    ax.set_title(f"{system.get('gpu', '?')}, {system.get('io mode', '').split(':')[0]} mode, batch 256, "
                 f"commit {system.get('commit', '?')}, {system.get('date', '')}", fontsize=9, loc="right")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def _write(args, system, results, table=None):
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump({"system": system, "results": results, "summary": table}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
