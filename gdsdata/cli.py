"""The ``gdsdata`` command: pack, inspect, verify, doctor. The only module that prints.

Every error gdsdata raises on purpose becomes one line on stderr and exit status 1; usage errors exit 2;
Ctrl-C 130 and SIGTERM 143, after the same clean-up.
"""

import argparse
import codecs
import json
import logging
import os
import signal
import sys
from types import SimpleNamespace

from gdsdata import __version__
from gdsdata.settings import parse_size


def _size(text: str) -> int:
    """Parse '512M', '1G', '4096' into bytes."""
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no size (at least 1 byte)")
    return size


def _integer(low: int, high: int | None = None):
    """An argparse type: an integer in low..high, else a usage error (exit status 2) saying the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}" if high is not None else
                                             f"{value} is below {low}")
        return value

    parse.__name__ = "integer"  # (argparse names the type in its message: "invalid integer value")
    return parse


def _skip_limit(text: str):
    """An argparse type: --max-skipped's count or share (a usage error for anything else)."""
    from gdsdata.args import SHARE, skip_limit

    try:
        return skip_limit(text)
    except ValueError:
        given = text.strip()
        below = given.startswith("-") and (given[1:].isdigit() or SHARE.fullmatch(given[1:]) is not None)
        over = SHARE.fullmatch(given) is not None  # (a share skip_limit refuses is one over 100%)
        raise argparse.ArgumentTypeError(f"{given} is below 0" if below else f"{given} is over 100%"
                                         if over else f"{text!r} is neither a count of files (10) nor a share of "
                                         f"them (0.5%)") from None


def _path(text: str) -> str:
    """An argparse type: a path, not an empty string (a usage error: see ``args.given_path``)."""
    from gdsdata.args import given_path

    try:
        return given_path("the path", text)
    except ValueError:
        raise argparse.ArgumentTypeError("an empty path (a shell variable left unset?); name the folder, \".\" for "
                                         "the current one") from None


def _packed_options(out) -> dict:
    """How the dataset at ``out`` stored its images (its index's record of the pack's options), or
    nothing where there is none to read (the append then says why it cannot go on)."""
    from gdsdata.errors import GdsDataError
    from gdsdata.format import index as index_io
    from gdsdata.packing.packer import packed_options

    try:
        return packed_options(index_io.load(out, shards=False).meta)  # (the append checks the shards)
    except (GdsDataError, OSError, ValueError):
        return {}


def _images(n: int) -> str:
    return f"{n} image{'' if n == 1 else 's'}"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _cmd_pack(args):
    from gdsdata.packing.prepare import PackOptions
    from gdsdata.packing.packer import pack

    args.annotations = args.paths[0] if args.format == "coco" else None
    args.src, args.out = args.paths[-2:]
    given = {k: v for k, v in (("codec", args.codec), ("quality", args.quality), ("max_side", args.max_side),
                               ("raw_size", args.size)) if v is not None}
    held = _packed_options(args.out) if args.append else {}  # an append stores images as the dataset's were
    options = PackOptions(**{**held, **given, "max_pixels": args.max_pixels})
    if args.ray is not None:
        return _pack_on_ray(args, options)
    result = pack(args.src, args.out, options=options, shard_size=args.shard_size,
                  alignment=args.alignment, workers=args.workers, strict=args.strict,
                  overwrite=args.overwrite, progress=_progress(args), num_parts=args.num_parts,
                  part=args.part or 0, resume=args.resume, append=args.append,
                  allow_empty_classes=args.allow_empty_classes, format=args.format,
                  split=args.split, annotations=args.annotations, shard_roots=args.shard_root,
                  max_skipped=args.max_skipped)
    rate = f"{result.new / result.seconds:.0f} images/s" if result.seconds else "-"
    whole = f"{_images(result.packed)} in {result.shards} shard(s), {_human(result.bytes)}"
    if args.append and not result.new:
        left_out = result.skipped or (result.labels or {}).get("left_out")
        held = "the rest" if left_out else "every image"
        print(f"nothing to append: {args.out} holds {held} of {args.src} already ({whole}; unchanged)")
    elif result.finished_before:
        print(f"nothing to resume: {args.out} is finished, packed from {args.src} with these options ({whole}; "
              f"unchanged)")
    elif args.append:
        print(f"appended {_images(result.new)} in {result.seconds:.1f} s ({rate}): {args.out} now holds {whole}")
    elif result.resumed_shards:  # (the time and rate are the images packed by this run)
        print(f"packed {whole}: {result.new} of them by this run, in {result.seconds:.1f} s ({rate})")
    else:
        print(f"packed {whole} in {result.seconds:.1f} s ({rate})")
    print(f"  stored as is: {result.packed - result.converted}, converted: {result.converted}, "
          f"resized: {result.resized}")
    if result.relabeled:
        names = ", ".join(result.relabeled[:5]) + (" ..." if len(result.relabeled) > 5 else "")
        print(f"  new classes sort among the old ones (ImageFolder's labels): {len(result.relabeled)} class(es) "
              f"of the dataset got a new label ({names}); models trained on its old labels do not match them")
    if result.resumed_shards:
        print(f"  resumed: kept {result.resumed_shards} shard(s) ({result.packed - result.new} images) of the "
              f"interrupted pack")
    _print_repaired(result.repaired)
    if result.labels is not None:
        _print_labels(result, args.append)
    _print_left_out(result.skipped, result.ignored, result.unreadable, result.special)
    empty = _empty_classes(result.report_path) if result.labels is None else []  # (detection: boxes per class)
    if empty:
        where = " in this part (other parts may hold them)" if args.num_parts > 1 else ""  # (--ray returned above)
        print(_one_line(f"  {len(empty)} class(es) hold no sample{where}: {', '.join(empty[:10])}"
                        f"{' ...' if len(empty) > 10 else ''}"))
    if result.report_path:
        print(f"  report: {result.report_path}")
    elif result.finished_before:
        print("  report: none (missing or unreadable: the pack that finished the dataset may have been stopped "
              "before writing it); the dataset is complete")
    elif not (args.append and not result.new):
        print("  report: none (it could not be written: is the disk full?); the dataset is complete")
    return 0


def _empty_classes(report_path) -> list:
    """The classes without samples a pack's report names (none without a report)."""
    from gdsdata.errors import GdsDataError
    from gdsdata.format.shards import open_regular

    try:
        with open(open_regular(report_path, what="a report"), encoding="utf-8") as f:
            return list(json.load(f).get("empty_classes") or [])
    except (OSError, ValueError, TypeError, GdsDataError):
        return []


def _print_left_out(skipped, ignored, unreadable, special):
    """What a pack left out, as its report lists it: each list's first ten, with the reasons."""
    if skipped:
        _print_entries(f"  skipped {len(skipped)} file(s), each with its reason:", skipped)
    if ignored:
        names = ", ".join(str(name) for name in ignored[:5]) + (f" and {len(ignored) - 5} more" if len(ignored) > 5
                                                                 else "")
        print(_one_line(f"  ignored {len(ignored)} file(s) or sample(s) holding no labelled image (files not images "
                        f"or beside the class folders, tar samples without an image or a .cls): {names} "
                        f"(pack_report.json lists them)"))
    for what, entries in (("could not read", unreadable), ("left out", special)):  # (special: each says how)
        if entries:
            _print_entries(f"  {what} {len(entries)} folder(s) or file(s):", entries)


def _print_repaired(repaired):
    """The JPEGs libjpeg decodes only with warnings, which a pack stores as PIL decodes them."""
    if repaired:
        _print_entries(f"  {len(repaired)} JPEG(s) decode only with libjpeg's warnings (damaged or odd data): "
                       f"stored as PIL decodes them (re-encoded), each with the warning:", repaired, shown=5)


def _print_entries(heading, entries, shown=10):
    """A report list's heading, its first ``shown`` entries with their reasons, and how many more."""
    print(heading)
    for item in entries[:shown]:
        print(_one_line(f"    {item.get('path') or item.get('label')}: {item['reason']}"))
    if len(entries) > shown:
        print(f"    ... {len(entries) - shown} more (pack_report.json lists them all)")


def _print_labels(result, appended: bool):
    labels = result.labels
    if appended and not result.new:  # (nothing appended: only what the new files' labels left out)
        if labels.get("left_out"):
            _print_entries(f"  images left out for their labels: {len(labels['left_out'])}", labels["left_out"],
                           shown=5)
        return
    if appended:  # (the report's negatives count the appended images)
        print(f"  boxes: {result.boxes} in all; appended images without objects (kept as negatives): "
              f"{labels['negatives']}")
    else:
        print(f"  boxes: {result.boxes}, images without objects (kept as negatives): {labels['negatives']}")
    if labels.get("no_label_file"):
        print(_one_line(f"  no labels: {labels['no_label_file']}; every image was packed without objects"))
    left_out = {entry["path"] for entry in labels.get("left_out") or []}
    records = [entry for entry in labels["bad_labels"] if entry["path"] not in left_out]  # (COCO: a record left
    # out whose file another record names, or one whose file the listing could not read)
    for entries, what in ((labels.get("left_out") or [], "images left out for their labels"),
                          (records, "image records left out (their files packed from another record, or unreadable)"),
                          (labels["dropped"], "boxes dropped"), (labels["clipped"], "boxes clipped to the image"),
                          (labels["duplicates"], "duplicate boxes removed"),
                          (labels["orphans"], "labels without an image")):
        if entries:
            _print_entries(f"  {what}: {len(entries)}", entries, shown=5)


def _pack_on_ray(args, options):
    from gdsdata.packing.ray import pack_on_ray

    summary = pack_on_ray(args.src, args.out, address=args.ray or None,
                          num_parts=args.num_parts if args.num_parts > 1 else 0, options=options,
                          shard_size=args.shard_size, alignment=args.alignment, strict=args.strict,
                          overwrite=args.overwrite, progress=_progress(args),
                          allow_empty_classes=args.allow_empty_classes, format=args.format,
                          split=args.split, annotations=args.annotations, shard_roots=args.shard_root,
                          max_skipped=args.max_skipped)
    report = summary["report"]
    rate = f"{summary['samples'] / summary['seconds']:.0f} images/s" if summary["seconds"] else "-"
    print(f"packed {_images(summary['samples'])} in {summary['shards']} shard(s), {_human(report['bytes'])} into "
          f"{summary['out']} in {summary['seconds']:.1f} s ({rate}, Ray's start and stop included): "
          f"{summary['parts']} part(s) on {summary['cpus']} CPU(s)")
    print(f"  stored as is: {report['packed'] - report['converted']}, converted: {report['converted']}, "
          f"resized: {report['resized']}")
    _print_repaired(report.get("repaired"))
    if report.get("labels"):  # (a detection source: what its labels got wrong, as a local pack says it)
        _print_labels(SimpleNamespace(labels=report["labels"], boxes=summary["boxes"], new=summary["samples"]), False)
    _print_left_out(report["skipped"], report["ignored"], report["unreadable"], report["special"])
    print(f"  report: {summary['report_path']}")
    return 0


_QUIET = "no progress (a bar where stderr is a terminal, else a line a minute, as in a job's log)"


def _progress(args) -> bool:
    """Progress unless --quiet: a bar where stderr is a terminal, a line a minute in a log file."""
    return not args.quiet


def _pack_usage(args) -> str | None:
    """What is wrong with how pack was called (a usage error, exit status 2), or None."""
    wanted = 3 if args.format == "coco" else 2
    if len(args.paths) != wanted:
        return ("--format coco takes ANNOTATIONS.json IMAGES OUT" if args.format == "coco" else
                f"pack takes SRC OUT (got {len(args.paths)} paths; --format coco takes three)")
    if args.ray is not None and (args.resume or args.append or args.part is not None):
        return "--ray packs every part itself (and retries them); it goes with none of --resume, --append or --part"
    if args.append and (args.resume or args.overwrite or args.num_parts > 1 or args.part is not None):
        return "--append goes with none of --resume, --overwrite or --num-parts/--part"
    if args.resume and args.overwrite:
        return "--resume keeps what an interrupted pack finished, --overwrite replaces it: give one of them"
    if args.part is not None and args.num_parts == 1:
        return "--part goes with --num-parts N (the source split into N parts)"
    if args.part is None and args.num_parts > 1 and args.ray is None:
        return (f"--num-parts {args.num_parts} packs one part a run: give --part K (0..{args.num_parts - 1}) on each "
                f"machine and join them with gdsdata merge, or --ray to pack every part")
    if args.part is not None and args.part >= args.num_parts:
        return f"--part {args.part} is not one of the {args.num_parts} part(s) (0..{args.num_parts - 1})"
    if args.alignment < 64 or args.alignment & (args.alignment - 1):
        return f"--alignment {args.alignment} is not a power of two of at least 64"
    if args.shard_size < 2 * args.alignment:
        return f"--shard-size {args.shard_size} is under twice the alignment ({2 * args.alignment} bytes)"
    if args.split is not None and args.format != "yolo":
        instead = ("a COCO pack takes the images its annotations JSON lists" if args.format == "coco" else
                   "a folder of class folders has none: give the split's own folder as SRC")
        return f"--split picks a split of a YOLO dataset (--format yolo); {instead}"
    if args.size and (args.codec or "jpeg") != "raw" and not args.append:
        return "--size (the shorter side of raw pixels) goes with --codec raw; JPEGs are downscaled with --max-side"
    return None


def _cmd_merge(args):
    from gdsdata.packing.merge import merge

    summary = merge(args.parts, args.out, copy=args.copy, overwrite=args.overwrite, progress=_progress(args),
                    max_skipped=args.max_skipped)
    print(f"merged {summary['parts']} dataset(s) into {summary['out']}: {summary['samples']} samples, "
          f"{summary['shards']} shard(s) {'/'.join(summary['shards_placed'])}")
    if summary.get("report_path"):  # (parts of one pack: their files left out, joined)
        print(f"  report: {summary['report_path']}")
    return 0


def _cmd_inspect(args):
    from gdsdata.commands.info import info as describe

    info = describe(args.dataset)
    if args.json:
        print(json.dumps(info, indent=2))
        return 1 if info["problems"] else 0  # (the problems are in it)
    print(f"{info['path']}: {info['samples']} samples, {info['classes']} classes, {info['shards']} shard(s)")
    print(f"  format version {info['format_version']}, created {info['created']} by gdsdata "
          f"{info['gdsdata_version']}")
    print(f"  payload {_human(info['payload_bytes'])} in {_human(info['shard_bytes'])} of shards; "
          f"alignment {info['alignment']} B, overhead {info['alignment_overhead'] * 100:.2f} %")
    where = info["shard_folders"]
    if list(where["folders"]) != [os.path.realpath(info["path"])]:
        print(f"  shards in {len(where['folders'])} folder(s) on {where['devices']} device(s): "
              + ", ".join(f"{folder} ({n})" for folder, n in where["folders"].items()))
    sizes, w, h = info["sample_bytes"], info["width"], info["height"]
    print(f"  sample size min/mean/max: {_human(sizes['min'])} / {_human(sizes['mean'])} / {_human(sizes['max'])}")
    print(f"  width {w['min']}-{w['max']} (mean {w['mean']}), height {h['min']}-{h['max']} (mean {h['mean']})")
    print(f"  codecs: {', '.join(f'{k} {v}' for k, v in info['codecs'].items())}; "
          f"subsampling: {', '.join(f'{k} {v}' for k, v in info['subsampling'].items())}")
    print(f"  stored as is: {info['stored_as_is']}, converted at pack time: {info['converted']}, "
          f"resized: {info['resized']}")
    if info["part"]:
        print(f"  part {info['part']['part']} of {info['part']['num_parts']} of its source "
              f"(items {info['part']['first_item']}..{info['part']['first_item'] + info['part']['items'] - 1})")
    if info["merged_from"]:
        parts = info["merged_from"]
        if all(".gdsdata-parts-" in path for path in parts):  # pack --ray's own parts, removed once merged
            print(f"  packed in {len(parts)} part(s) on Ray, then merged")
        else:
            print(f"  merged from {len(parts)} part(s): " + ", ".join(
                path if os.path.exists(path) else f"{path} (no longer there)" for path in parts))
    for added in info["appended"]:
        print(f"  appended {added['samples']} sample(s) from {added['source']}")
    counts = list(info["per_class"].items())
    shown = counts if len(counts) <= 12 else counts[:6] + [("...", "")] + counts[-5:]
    detect = info.get("detection")
    heading = "  boxes per class: " if detect else "  per class: "
    print(heading + ", ".join(f"{name} {n}".strip() for name, n in shown))
    if detect:
        per_image = detect["boxes_per_image"]
        small, medium, large = detect["small_medium_large"]
        print(f"  detection ({detect['format']}): {detect['boxes']} boxes, per image min/mean/max {per_image['min']}/"
              f"{per_image['mean']}/{per_image['max']}, {detect['negatives']} image(s) without objects, "
              f"{detect['crowd']} crowd region(s); boxes small/medium/large by box area (COCO's 32 and 96 px; "
              f"COCOeval uses the annotations' area): {small}/{medium}/{large}")
        if detect["resized_images"]:
            print(f"  (in the stored images' pixels: {_images(detect['resized_images'])} were downscaled at pack "
                  f"time, so their boxes count smaller than in the annotated images)")
    for line in info["problems"]:
        print(f"bad: {line}", file=sys.stderr)
    if info["problems"]:
        print(f"gdsdata: {len(info['problems'])} shard(s) of {args.dataset} are damaged, so it does not open "
              f"(gdsdata verify checks every sample)", file=sys.stderr)
        return 1
    return 0


def _cmd_verify(args):
    from gdsdata.commands.verify import verify
    from gdsdata.errors import GdsDataError

    failed = 0
    for dataset in args.datasets:  # each one checked, whatever an earlier one held
        try:
            problems = verify(dataset, decode_samples=not args.checksums_only, progress=_progress(args))
        except (GdsDataError, OSError) as e:
            if len(args.datasets) == 1:
                raise
            print(f"gdsdata: error: {_said(e)}", file=sys.stderr)
            failed += 1
            continue
        for line in problems:
            print(f"bad: {line}", file=sys.stderr)
        if problems:
            print(f"gdsdata: verify found {len(problems)} problem(s) in {dataset}", file=sys.stderr)
            failed += 1
        else:
            print(f"{dataset}: all checksums match" + ("" if args.checksums_only else " and every sample decodes"))
    return 1 if failed else 0


def _cmd_doctor(args):
    from gdsdata.commands.doctor import path_fields, report

    info = report()
    if args.dataset:
        import torch

        from gdsdata.dataset import GDSDataset

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        with GDSDataset(args.dataset, device=device) as ds:
            info["dataset"] = args.dataset
            info.update(path_fields(ds.load_path))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>22}: {value}")
    return 0


class _Defaults:
    """PackOptions' defaults without importing PIL at start-up."""

    @property
    def max_pixels(self):
        return 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS


PACK_DEFAULTS = _Defaults()


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other error of the CLI (exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, an option no command knows said by the command it was given to."""
        argv = list(sys.argv[1:] if args is None else args)
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        typed = next((a for a in argv if not a.startswith("-")), None)
        if typed in commands:  # an alias's usage and errors named as typed (info, not inspect)
            commands[typed].prog = f"{self.prog} {typed}"
        parsed, extra = self.parse_known_args(argv, namespace)
        command = getattr(parsed, "command", None)
        if extra:
            before = command in argv and argv.index(extra[0]) < argv.index(command) if extra[0] in argv else False
            parser = self if before else commands.get(command, self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        problem = getattr(parsed, "usage", lambda args: None)(parsed)
        if problem is not None:
            commands[command].error(problem)
        return parsed


def _either_side(parser, top=False):
    """-v and -q, given before the command (``top``: the top level's parser, whose defaults count)
    or after it (a command's: set only where given, so that one given before stays)."""
    default = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr", **default)
    parser.add_argument("-q", "--quiet", action="store_true", help=_QUIET, **default)


def build_parser():
    parser = _Parser(prog="gdsdata", description="Pack images into GPU-ready shards, "
                                     "merge, inspect and verify them, and check what this machine's GPU path is.")
    parser.add_argument("--version", action="version", version=f"gdsdata {__version__}")
    _either_side(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack an image folder, LMDB, tar shards or a detection set into a dataset",
                       usage="gdsdata pack [options] SRC OUT\n       gdsdata pack --format yolo [--split S] SRC OUT\n"
                             "       gdsdata pack --format coco [options] ANNOTATIONS.json IMAGES OUT",
                       description="Validate, normalise and pack SRC into OUT. SRC: an ImageFolder tree "
                       "(one subfolder per class), an LMDB of (image bytes, label) pickles, or WebDataset-style "
                       "tar shards (image + .cls per sample); with --format yolo an Ultralytics data YAML or "
                       "dataset folder (images/<split>, labels/<split>); with --format coco the instances JSON "
                       "and the images folder.")
    p.add_argument("paths", nargs="+", metavar="SRC OUT", type=_path,
                   help="an ImageFolder tree SRC/CLASS/IMAGE, an LMDB, or .tar shards (a path or an fsspec "
                   "URL: s3://, gs://, az://, ...; detection sources: a path), and the dataset folder to create "
                   "(a path)")
    p.add_argument("--format", choices=("folder", "yolo", "coco"), default="folder",
                   help="folder (classification, default), yolo or coco (detection: boxes packed with the images)")
    p.add_argument("--split", help="--format yolo: the split to pack (a data YAML's or a dataset folder's default: "
                                    "train; an images folder holding split folders needs it)")
    p.add_argument("--shard-size", type=_size, default=1 << 30, metavar="SIZE",
                   help="target shard size (default 1G)")
    p.add_argument("--shard-root", action="append", default=[], metavar="DIR", type=_path,
                   help="a folder on another drive to spread the shards over (repeat, one per drive); OUT holds "
                        "the index and a link to each shard")
    p.add_argument("--alignment", type=_size, default=4096, metavar="BYTES",
                   help="payload alignment, a power of two (default 4096)")
    p.add_argument("--workers", type=_integer(0, 4096), default=0,
                   help="packing processes (default 0: one per core, at least two); 1: in this process alone, "
                        "without the stall bound on an image")
    p.add_argument("--codec", choices=("jpeg", "raw"),
                   help="jpeg (default) or raw decoded pixels (--append: the dataset's, as the next three)")
    p.add_argument("--quality", type=_integer(1, 100),
                   help="JPEG quality for re-encoded images, 4:4:4 chroma (default 95)")
    p.add_argument("--max-side", type=_integer(0), metavar="PX",
                   help="downscale images whose longer side exceeds PX (default: keep)")
    p.add_argument("--size", type=_integer(0), metavar="PX",
                   help="raw codec: downscale so the shorter side is PX (default: keep)")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first bad or unreadable file or folder instead of skipping it")
    p.add_argument("--max-skipped", type=_skip_limit, metavar="N|P%",
                   help="stop as --strict does once more files than N (or P%% of the files) are skipped, "
                        "unreadable or (detection) left out for their labels; a part counts its own files, "
                        "--ray all of them before the merge")
    p.add_argument("--max-pixels", type=_integer(0), default=PACK_DEFAULTS.max_pixels, metavar="N",
                   help=f"refuse images that declare more pixels, before decoding them "
                        f"(default {PACK_DEFAULTS.max_pixels:,}, Pillow's; 0: no limit)")
    p.add_argument("--allow-empty-classes", action="store_true",
                   help="keep class folders without images as classes (torchvision's ImageFolder refuses them)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in OUT")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted pack into OUT, keeping its finished shards (same options)")
    p.add_argument("--append", action="store_true",
                   help="add the images (and classes) of SRC that OUT does not hold yet, as new shards")
    p.add_argument("--num-parts", type=_integer(1), default=1, metavar="N",
                   help="split the source into N contiguous parts (for packing on many machines) ...")
    p.add_argument("--part", type=_integer(0), metavar="K",
                   help="... and pack part K (0-based); join with merge")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="pack the parts as Ray tasks (retried when they fail), then merge them: on the cluster at "
                        "ADDRESS, or a local Ray without one; --num-parts overrides the part count chosen from the "
                        "source size and the cluster's CPUs. OUT must be on a filesystem every node sees")
    _either_side(p)
    p.set_defaults(run=_cmd_pack, usage=_pack_usage)

    p = sub.add_parser("merge", help="join datasets packed as parts into one",
                       description="Join PARTS (in this order) into OUT without copying shard data "
                       "(hard links, or symbolic links across filesystems).")
    p.add_argument("parts", nargs="+", metavar="PARTS", type=_path, help="part datasets")
    p.add_argument("out", metavar="OUT", type=_path, help="merged dataset folder to create")
    p.add_argument("--copy", action="store_true", help="copy shard data instead of linking it")
    p.add_argument("--max-skipped", type=_skip_limit, metavar="N|P%",
                   help="refuse the merge when the parts left out more than N files together (or P%% of their "
                        "files: skipped, unreadable or left out for their labels), as their pack_report.json "
                        "files list")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in OUT")
    _either_side(p)
    p.set_defaults(run=_cmd_merge)

    p = sub.add_parser("inspect", aliases=["info"], help="show what a dataset holds",
                       description="Show what DATASET holds: samples and classes, shards, payload and alignment "
                       "overhead, image sizes, codecs and chroma subsampling, what was converted at pack time, "
                       "where it came from (parts, merges, appends) and the count per class.")
    p.add_argument("dataset", metavar="DATASET", type=_path, help="a packed dataset folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _either_side(p)
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser("verify", help="check checksums and decodability of every sample",
                       description="Check each DATASET's index, every shard and every sample's CRC-32, and "
                       "decode every sample on the CPU. Each problem is one line on stderr naming the sample; the "
                       "exit status is 1 when any is found in any of them.")
    p.add_argument("datasets", nargs="+", metavar="DATASET", type=_path, help="a packed dataset folder")
    p.add_argument("--checksums-only", action="store_true", help="skip decoding")
    _either_side(p)
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("doctor", help="show GPU, driver, kvikio/GDS and nvJPEG status",
                       description="Show what this machine gives the GPU path: the GPU and driver, torch and "
                       "kvikio, whether cuFile runs GPUDirect Storage or compatibility mode (and why), nvJPEG and "
                       "its hardware engines, and the settings in effect; with DATASET, the path its samples take "
                       "on DEVICE.")
    p.add_argument("dataset", nargs="?", metavar="DATASET", type=_path, help="a packed dataset: show how it loads")
    p.add_argument("--device", default=None, help="for DATASET: cpu or cuda (default: cuda where torch sees a GPU)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _either_side(p)
    p.set_defaults(run=_cmd_doctor)
    return parser


def _names_as_read(error):
    """The CLI's output encoding errors: a file name's bytes that are not UTF-8 (Python's surrogate
    escapes) written as the bytes they were, as Python writes them under a UTF-8 locale; any other
    character the encoding lacks as a backslash escape."""
    if isinstance(error, UnicodeEncodeError):
        chunk = error.object[error.start:error.end]
        if all(0xDC80 <= ord(c) <= 0xDCFF for c in chunk):
            return bytes(ord(c) - 0xDC00 for c in chunk), error.end
        return codecs.backslashreplace_errors(error)
    raise error


def _output_takes_any_name():
    """Strict output streams (PYTHONIOENCODING=utf-8 sets them so) would fail a finished pack, or an
    inspect, on a file name that is not UTF-8: they take such names as ``_names_as_read`` does."""
    codecs.register_error("gdsdata-names", _names_as_read)
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="gdsdata-names")


def main(argv=None):
    _output_takes_any_name()
    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:  # help piped into a reader that stopped early (| head)
        if _stdout_closed():
            return 1
        raise
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from gdsdata.errors import GdsDataError

    if args.command in ("pack", "merge"):  # what OUT held before: an interrupt says whether it still does
        from gdsdata.format.index import stamp

        args.before = stamp((args.paths[-1] if args.paths else "") if args.command == "pack" else args.out)
    try:
        return args.run(args)
    except BrokenPipeError as e:
        if _stdout_closed():
            return 1
        print(f"gdsdata: error: {e.strerror or e}", file=sys.stderr)
    except (GdsDataError, ValueError, OSError) as e:
        print(f"gdsdata: error: {_said(e)}", file=sys.stderr)
    except KeyboardInterrupt as e:
        from gdsdata.errors import Terminated

        how, code = ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)
        print(f"gdsdata: {how}{_left_behind(args)}", file=sys.stderr)
        return code
    return 1


def _said(error: Exception) -> str:
    """An error in one line: a system error's file and reason (not Python's "[Errno N]" form), else
    its message; control characters (a file name's newline, a terminal's escape) escaped."""
    where = f"{error.filename}: " if getattr(error, "filename", None) else ""
    return _one_line(where + (error.strerror if isinstance(error, OSError) and error.strerror else str(error)))


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def _one_line(text: str) -> str:
    """``text`` as the terminal shows it on one line: its control characters as escapes."""
    return text.translate(_CONTROL)


def _stdout_closed() -> bool:
    """Whether the broken pipe is standard output's (piped into a reader that stopped early, ``|
    head``): then the rest of the output goes nowhere, quietly, as Python's docs advise."""
    try:
        sys.stdout.flush()
        closed = _reader_gone(sys.stdout.fileno())  # (the failed write may have emptied the buffer)
    except BrokenPipeError:
        closed = True
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
    return closed


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe whose reading end is closed (poll reports an error on it)."""
    import select

    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def run():
    """The ``gdsdata`` command itself: ``main``, then the exit. SIGTERM unwinds as Ctrl-C does. After
    either, or a packing worker that even SIGKILL has not ended yet (in an uninterruptible wait in the
    kernel), the process ends at once (everything is written and closed by then): waiting at exit for
    the pool's helper threads, which a killed worker can leave blocked on a pipe or on itself, could hang."""
    global _COMMAND_PID
    _COMMAND_PID = os.getpid()
    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where the caller ignores Ctrl-C)
        signal.signal(signal.SIGINT, _interrupt)
    code = main()
    # the command is over: a TERM now ends the exit at once, not as an exception inside an atexit hook (Ray's)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    packer = sys.modules.get("gdsdata.packing.packer")  # (imported only where the command packed)
    if code in (130, 143) or (packer is not None and packer.workers_left()):  # (a worker the kernel holds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


_COMMAND_PID = None


def _terminate(signum, frame):
    if os.getpid() != _COMMAND_PID:  # a packing worker forked with this handler, not yet its own: it just ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    from gdsdata.errors import Terminated

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding: a second TERM (Slurm repeats it) waits for it
    _quiet_unraisable()
    raise Terminated()


def _interrupt(signum, frame):
    if os.getpid() != _COMMAND_PID:  # a packing worker forked with this handler: Ctrl-C is the parent's to report
        return
    _quiet_unraisable()
    raise KeyboardInterrupt


def _quiet_unraisable():
    """The command unwinds from Ctrl-C or SIGTERM, which can land inside any Python code, also
    inside the standard library's (multiprocessing's ``Finalize`` interrupted in its ``__init__``
    fails later in its finaliser): what Python could then only print as "Exception ignored in ..."
    with a traceback goes to the debug log; the command's one line says what ended it."""
    def hook(unraisable):
        logging.getLogger("gdsdata.cli").debug(
            "while stopping, in %r: %s", unraisable.object, unraisable.exc_value,
            exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))

    sys.unraisablehook = hook


def _left_behind(args) -> str:
    """What an interrupted pack or merge left in OUT, in a few words."""
    out = getattr(args, "out", None)
    if not out or args.command not in ("pack", "merge"):
        return ""
    from gdsdata.format import layout as fmt

    try:
        names = os.listdir(out)
    except OSError:
        return f"; {out} was not written"
    if fmt.INDEX_NAME in names:
        from gdsdata.format.index import stamp

        if stamp(out) != getattr(args, "before", None):  # (an index is replaced whole, by a rename)
            return f"; {out} holds the {'appended' if getattr(args, 'append', False) else 'new'} dataset (the " \
                   f"signal came once it was complete)"
        return f"; {out} is as it was"
    journals = sum(name.endswith(fmt.JOURNAL_SUFFIX) for name in names)
    if journals and args.command == "pack":
        return f"; {journals} finished shard(s) kept in {out}: run the same command with --resume to finish"
    return f"; {out} holds no dataset"


if __name__ == "__main__":
    run()
