#!/usr/bin/env python3
"""Train an Ultralytics YOLO detector with gdsdata batches, through Ultralytics' own trainer.

    gdsdata pack --format yolo data.yaml /data/det-train.gds
    gdsdata pack --format yolo --split val data.yaml /data/det-val.gds
    python examples/train_yolo.py --train /data/det-train.gds --val /data/det-val.gds \\
        --model yolo11n.yaml --epochs 100 --imgsz 640 --batch 64 --device 0

The model is built from its model YAML (no weights downloaded; pass a .pt you have for
fine-tuning). Everything but the batches is Ultralytics': loss, optimiser, schedule, EMA, AMP,
mAP validation, checkpoints under --project/--name. Training batches are gdsdata.YoloAugment
(mosaic, affine, HSV, flips, with Ultralytics' default hyper-parameters and box rules) built on the
training device; validation batches gdsdata.Letterbox. Extra Ultralytics arguments go after --,
as key=value (e.g. -- mosaic=0.5 lr0=0.02). ``--device 0,1,2,3`` trains on four GPUs with
Ultralytics' own DDP (a process a GPU; --batch is the whole batch, split over them).
"""

import argparse
import os
import sys

os.environ.setdefault("YOLO_OFFLINE", "1")  # no update checks or downloads while training


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="packed detection set (gdsdata pack --format yolo|coco)")
    parser.add_argument("--val", required=True, help="packed validation set")
    parser.add_argument("--model", default="yolo11n.yaml", help="Ultralytics model YAML (or a .pt you have)")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="0" if _cuda() else "cpu")
    parser.add_argument("--project", default="runs/gdsdata",
                        help="folder of the runs (default ./runs/gdsdata); weights and results go to PROJECT/NAME")
    parser.add_argument("--name", default="train", help="this run's folder in PROJECT (reused if it exists)")
    parser.add_argument("extra", nargs="*", help="more Ultralytics arguments, key=value")
    args = parser.parse_args(argv)
    from gdsdata import GdsDataError
    from gdsdata.yolo import DetectionTrainer

    if args.model.endswith(".pt") and not _have(args.model):  # (Ultralytics would download it)
        parser.error(f"--model {args.model}: no such file; a model YAML (yolo11n.yaml) trains from scratch, "
                     f"a .pt must be one you have")
    overrides = {"model": args.model, "epochs": args.epochs, "imgsz": args.imgsz, "batch": args.batch,
                 # absolute: Ultralytics puts a relative project under its own runs_dir setting
                 "device": args.device, "project": os.path.abspath(args.project), "name": args.name, "exist_ok": True,
                 "workers": 0, "plots": False, "pretrained": args.model.endswith(".pt")}
    for item in args.extra:
        key, _, value = item.partition("=")
        overrides[key] = _value(value)
    try:
        trainer = DetectionTrainer(args.train, args.val, overrides=overrides)
    except (GdsDataError, ValueError, TypeError, OSError) as e:  # no pack there, a pack of another kind, an
        # argument Ultralytics does not know or the batches do not follow
        sys.exit(f"train_yolo.py: error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")  # (Ultralytics'
        # own messages run on with diagnostics: their first line says it)
    trainer.train()
    print(f"best weights: {trainer.best}; metrics: "
          + ", ".join(f"{k} {v:.4f}" for k, v in trainer.metrics.items() if k.startswith("metrics/")))


def _have(weights) -> bool:
    """Whether a .pt is here or in Ultralytics' weights folder (where YOLO(...) also looks)."""
    from ultralytics.utils import SETTINGS

    return os.path.isfile(weights) or os.path.isfile(os.path.join(SETTINGS["weights_dir"], weights))


def _cuda():
    import torch

    return torch.cuda.is_available()


def _value(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
