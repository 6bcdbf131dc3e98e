"""`labrun convert [images] SRC_DIR OUT.h5` and `labrun convert --verify FILE.h5`: the
arguments; the conversion is labrun.data.image.convert. `labrun convert text ...` is cli/convert_text,
`labrun convert seg ...` (segmentation folders) cli/convert_seg, `labrun convert det ...` (COCO
and YOLO detection data) cli/convert_det.

    labrun convert data/raw/imagenet data/processed/imagenet.h5 --max-side 512 --workers 16
    labrun convert images data/raw/cifar data/processed/cifar.h5 --storage raw
    labrun convert --verify data/processed/imagenet.h5
"""

from __future__ import annotations

import argparse

from rich.console import Console

from labrun.core.errors import LabrunError
from labrun.data.image import hdf5
from labrun.data.image.convert import Options, convert, cpu_count, verify

# labrun convert images ... is this module too, for one argument style with `convert text`.
SUBCOMMANDS = {"images": "labrun.cli.convert", "text": "labrun.cli.convert_text",
               "seg": "labrun.cli.convert_seg", "det": "labrun.cli.convert_det"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", nargs="?", metavar="SRC_DIR",
                        help="image folder: SRC_DIR/{train,val,test}/<class>/* or SRC_DIR/<class>/*")
    parser.add_argument("out", nargs="?", metavar="OUT.h5", help="the HDF5 file to write")
    parser.add_argument("--verify", metavar="FILE.h5",
                        help="check FILE.h5 instead: structure, counts, every sample decodes")
    parser.add_argument("--storage", choices=hdf5.STORAGES, default="jpeg",
                        help="jpeg: encoded bytes (default); raw: decoded pixels of one size, "
                             "for small images such as CIFAR")
    parser.add_argument("--max-side", type=int, metavar="N",
                        help="jpeg: re-encode images whose longer side exceeds N down to N")
    parser.add_argument("--quality", type=int, default=90, metavar="Q",
                        help="JPEG quality of re-encoded images (default: 90)")
    parser.add_argument("--size", type=int, metavar="N",
                        help="raw: resize the short side to N and centre-crop N x N (default: "
                             "all images must already share one size)")
    parser.add_argument("--workers", type=int, default=cpu_count(), metavar="N",
                        help="encoding processes (default: the usable cores)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT.h5 if it exists")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first corrupt or non-image file instead of skipping it")


def run(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)  # long paths stay on one line in logs
    if args.verify:
        if args.src or args.out:
            raise LabrunError("--verify takes only the file to check: labrun convert --verify FILE.h5")
        verify(args.verify, args.workers, console)
        return 0
    if not (args.src and args.out):
        raise LabrunError("give SRC_DIR and OUT.h5 (labrun convert SRC_DIR OUT.h5), "
                          "or check a file with labrun convert --verify FILE.h5")
    for flag, value in (("--max-side", args.max_side), ("--size", args.size)):
        if value is not None and value <= 0:
            raise LabrunError(f"{flag}={value} must be a positive number")
    if args.workers < 0:
        raise LabrunError(f"--workers={args.workers} must be 0 or more (0: no extra processes)")
    if not 1 <= args.quality <= 100:
        raise LabrunError(f"--quality={args.quality} must be between 1 and 100")
    if args.storage == "jpeg" and args.size:
        raise LabrunError("--size is for --storage raw; with jpeg storage use --max-side")
    if args.storage == "raw" and args.max_side:
        raise LabrunError("--max-side is for --storage jpeg; with raw storage use --size")
    options = Options(args.storage, args.max_side, args.quality, args.size)
    convert(args.src, args.out, options, workers=args.workers, force=args.force,
            strict=args.strict, console=console)
    return 0
