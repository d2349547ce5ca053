#!/usr/bin/env python3
"""Train an ImageNet classifier on gdsdata batches: DDP, bf16 autocast, channels_last, exact resume.

    gdsdata pack /data/imagenet/train /data/train.gds
    gdsdata pack /data/imagenet/val /data/val.gds
    torchrun --nproc_per_node=8 examples/train_imagenet.py --train /data/train.gds --val /data/val.gds \\
        --arch resnet50 --epochs 90 --checkpoint /ckpt/resnet50.pt

Evaluate a checkpoint on the validation set alone (top-1, CenterCrop) with --evaluate:

    python examples/train_imagenet.py --train /data/train.gds --val /data/val.gds --arch resnet50 \\
        --checkpoint /ckpt/resnet50.pt --evaluate

It evaluates at the crop size the checkpoint trained at, unless --size says otherwise.

Run it again with the same --checkpoint after an interruption: it resumes mid-epoch, at the exact
batch the checkpoint was written after (the Loader's state_dict is part of the checkpoint), also with
another --batch-size or number of processes: the learning-rate schedule follows the training's
progress in epochs (from the Loader's state), not a count of batches, and training stops at --epochs.
Without a GPU it trains on the CPU (gloo), in float32 (bf16 autocast is slow on CPUs without bf16
instructions), which is how the tests run it.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision

import gdsdata


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="packed training set (gdsdata pack)")
    parser.add_argument("--val", help="packed validation set")
    parser.add_argument("--arch", default="resnet50", help="a torchvision.models classifier")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256, scaled linearly")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-5)
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--size", type=int, help="training crop (default 224; a checkpoint's own when resuming "
                        "or evaluating one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="path to write every --checkpoint-every steps and resume from")
    parser.add_argument("--checkpoint-every", type=int, default=1000, help="steps")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop once this many steps are done in all, resumed ones included (0: all epochs)")
    parser.add_argument("--log-every", type=int, default=100, help="print a line every this many steps")
    parser.add_argument("--evaluate", action="store_true",
                        help="evaluate the --checkpoint's model on --val (top-1) and stop, training nothing")
    args = parser.parse_args(argv)
    if args.evaluate and not (args.val and args.checkpoint):
        parser.error("--evaluate takes the model of --checkpoint and evaluates it on --val: give both")
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        parser.error(f"--arch {args.arch}: not one of torchvision's classifiers (resnet50, resnet18, vit_b_16, ...)")
    return args


def open_dataset(path, device):
    """The packed classification set at ``path``; a missing or unusable one ends the run in one line."""
    try:
        ds = gdsdata.GDSDataset(path, device=device)
    except gdsdata.GdsDataError as e:
        sys.exit(f"train_imagenet.py: error: {e}")
    if ds.task != "classify":
        sys.exit(f"train_imagenet.py: error: {path} is a detection dataset (boxes per image); this example trains "
                 f"classifiers (examples/train_yolo.py and train_detection.py train detectors)")
    return ds


def _first_difference(a, b) -> str:
    """Where two class lists first differ, in words."""
    k = next((k for k, (x, y) in enumerate(zip(a.classes, b.classes)) if x != y), min(len(a.classes), len(b.classes)))
    name = lambda ds: repr(ds.classes[k]) if k < len(ds.classes) else "none"  # noqa: E731
    return f"class {k}: {name(a)} against {name(b)}"


def setup():
    """(rank, world size, device): one process per GPU under torchrun, or a single process."""
    if "RANK" in os.environ:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, device


def lr_at(progress, step, epochs, warmup, base):
    """The learning rate of the step that takes training from ``progress`` to ``progress + step``,
    all in epochs (fractions of one too): linear warm-up over ``warmup`` epochs, then cosine decay to
    zero at ``epochs``. In epochs, not batches, so that a resume with another batch size or world
    size keeps the schedule."""
    if progress < warmup:
        return base * min(1.0, (progress + step) / warmup)
    return 0.5 * base * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(step, epochs - warmup))))


def evaluate(model, loader, device, world):
    """Top-1 accuracy over every sample once: each rank marks its samples by dataset index (a rank's
    share is padded with repeats where the ranks do not divide the samples: they count once)."""
    model.eval()
    dataset = loader.dataset
    while isinstance(dataset, torch.utils.data.Subset):  # indices() are the GDSDataset's own
        dataset = dataset.dataset
    size = len(dataset)
    correct = torch.zeros(size, device=device)
    seen = torch.zeros(size, device=device)
    batches = loader.indices()  # this rank's batches, as dataset indices (asked before the pass starts)
    with torch.no_grad(), autocast(device):
        for (images, labels), indices in zip(loader, batches, strict=True):
            logits = model(images.contiguous(memory_format=torch.channels_last))
            at = torch.as_tensor(indices, device=device)
            correct[at] = (logits.argmax(1) == labels).float()
            seen[at] = 1
    if world > 1:
        dist.all_reduce(correct, op=dist.ReduceOp.MAX)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    model.train()
    return (correct.sum() / seen.sum().clamp(min=1)).item()


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup()
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    state = None  # the checkpoint to resume from or evaluate
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = load_checkpoint(args.checkpoint, device, args.arch)
    elif args.evaluate:
        sys.exit(f"train_imagenet.py: error: {args.checkpoint}: no such checkpoint to evaluate")
    size = args.size or (state or {}).get("size") or 224  # a model trained at one size is evaluated at it
    if state is not None and state.get("size", size) != size and rank == 0:
        print(f"the checkpoint trained at --size {state['size']}; going on at --size {size}", flush=True)

    # images come as float16 on the GPU, float32 on the CPU; labels as int64, on the same device
    train_ds = open_dataset(args.train, device)  # (its classes size the model, also for --evaluate)
    val = None
    if args.val:
        val_ds = open_dataset(args.val, device)
        if val_ds.classes != train_ds.classes:  # a label means another class there: top-1 would mean nothing
            sys.exit(f"train_imagenet.py: error: {args.val} holds other classes than {args.train} "
                     f"({len(val_ds.classes)} against {len(train_ds.classes)}, {_first_difference(val_ds, train_ds)})")
        val = gdsdata.Loader(val_ds, args.batch_size, shuffle=False,
                             transform=gdsdata.CenterCrop(size))  # resized to size / 0.875 (rounded) first

    model = getattr(torchvision.models, args.arch)(num_classes=len(train_ds.classes))
    model = model.to(device, memory_format=torch.channels_last)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                          else None)
    base_lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    if args.evaluate:  # the checkpoint's model alone (any --train, batch size, seed ...), on --val
        try:
            getattr(model, "module", model).load_state_dict(state["model"])
        except RuntimeError as e:
            sys.exit(f"train_imagenet.py: error: {args.checkpoint}: {' '.join(str(e).split())[:300]}")
        top1 = evaluate(model, val, device, world)
        if rank == 0:
            print(f"{args.checkpoint} (step {state['step']}): validation top-1 {top1 * 100:.2f} %", flush=True)
        val.close()
        if world > 1:
            dist.destroy_process_group()
        return
    train = gdsdata.Loader(train_ds, args.batch_size, shuffle=True, seed=args.seed, drop_last=True,
                           transform=gdsdata.RandomResizedCrop(size, seed=args.seed))
    steps_per_epoch = len(train)  # batches per epoch for this rank, at this batch size and world size
    if not steps_per_epoch:  # (drop_last: a smaller last batch would be one of another shape)
        share = f"each of {world} processes' share of " if world > 1 else ""
        if world > 1:
            dist.destroy_process_group()
        sys.exit(f"train_imagenet.py: error: --batch-size {args.batch_size} is more than {share}the "
                 f"{len(train_ds)} images of {args.train}" if rank == 0 else 1)  # (said once, by rank 0)
    if args.checkpoint:  # its folder made now, not found missing at the first save, after hours of training
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    step = 0  # optimizer steps taken, resumed ones included (of whatever batch size they had)
    if state is not None:
        try:  # the loader first: it tells another dataset (or another batch size, seed...) apart
            train.load_state_dict(state["loader"])  # the same on every rank: where the epoch stands
            getattr(model, "module", model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, RuntimeError, KeyError) as e:
            reason = " ".join(str(e).split()).removeprefix("cannot resume: ")
            sys.exit(f"cannot resume from {args.checkpoint}: {reason[:300]}{' ...' if len(reason) > 300 else ''}")
        step = state["step"]
        if rank == 0:
            print(f"resumed at step {step} (epoch {train.epoch})", flush=True)
        if train.epoch >= args.epochs and rank == 0:
            print(f"the checkpoint is at step {step}, after {train.epoch} epochs: --epochs {args.epochs} leaves "
                  f"nothing to train", flush=True)
    # the steps this run ends at: those taken, the rest of this epoch (a resume: at this batch and
    # world size), the epochs after it
    left = train.batches_left() + (args.epochs - train.epoch - 1) * steps_per_epoch if train.epoch < args.epochs else 0
    total_steps = step + left

    t0, seen = time.perf_counter(), 0
    while train.epoch < args.epochs and not (args.max_steps and step >= args.max_steps):
        epoch = train.epoch  # after a full epoch the loader is at the next one; a resume sets it too
        train.set_epoch(epoch)  # as with DistributedSampler (here a no-op: the epoch it holds, a resume kept)
        done = steps_per_epoch - train.batches_left()  # the share of the epoch already trained, in these batches
        for images, labels in train:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(epoch + done / steps_per_epoch, 1 / steps_per_epoch, args.epochs,
                                    args.warmup_epochs, base_lr)
            with autocast(device):
                loss = criterion(model(images.contiguous(memory_format=torch.channels_last)), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            done += 1
            seen += labels.numel() * world
            if rank == 0 and step % args.log_every == 0:
                rate = seen / (time.perf_counter() - t0)
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.3f} "
                      f"lr {optimizer.param_groups[0]['lr']:.4f} {rate:.0f} images/s", flush=True)
            if args.checkpoint and step % args.checkpoint_every == 0:
                save(args.checkpoint, model, optimizer, train, step, rank, args.arch, size)
            if args.max_steps and step >= args.max_steps:
                break
        if val is not None and not (args.max_steps and step >= args.max_steps):
            top1 = evaluate(model, val, device, world)
            if rank == 0:
                print(f"epoch {epoch}: validation top-1 {top1 * 100:.2f} %", flush=True)
        if args.checkpoint and train.epoch > epoch:  # the epoch over and validated: a resume starts the next one
            save(args.checkpoint, model, optimizer, train, step, rank, args.arch, size)
    if args.checkpoint:
        save(args.checkpoint, model, optimizer, train, step, rank, args.arch, size)
    if rank == 0:
        print(f"stopped at step {step}/{max(step, total_steps)} (epoch {train.epoch})" +
              (f", checkpoint {args.checkpoint}" if args.checkpoint else ""), flush=True)
    train.close()
    if world > 1:
        dist.destroy_process_group()


def autocast(device):
    """bf16 autocast on a GPU; none on the CPU (slow there without bf16 instructions)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


def load_checkpoint(path, device, arch) -> dict:
    """The checkpoint at ``path``; one that cannot be read, or is of another --arch, ends the run in
    one line."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of a damaged file
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        sys.exit(f"train_imagenet.py: error: {path}: not a checkpoint this example can read ({reason})")
    if not isinstance(state, dict) or not {"model", "optimizer", "loader", "step"} <= set(state):
        sys.exit(f"train_imagenet.py: error: {path}: not a checkpoint of this example (no model, optimizer, loader "
                 f"and step in it)")
    if state.get("arch", arch) != arch:
        sys.exit(f"train_imagenet.py: error: {path} holds a {state['arch']}; --arch {arch} builds another model")
    return state


def save(path, model, optimizer, loader, step, rank, arch, size):
    """Rank 0 writes the model (and its --arch and --size), the optimizer and the Loader's state (the
    same on every rank), atomically: a crash while writing leaves the previous checkpoint."""
    if rank != 0:
        return
    tmp = f"{path}.tmp"
    torch.save({"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(), "step": step, "arch": arch, "size": size}, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("train_imagenet.py: interrupted; the last checkpoint written stands (run again to resume)",
              file=sys.stderr)
        sys.exit(130)
