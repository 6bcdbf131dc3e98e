"""`labrun convert seg SRC_DIR OUT.h5`: a segmentation folder to one HDF5 file (dataset=seg_hdf5).

    labrun convert seg data/raw/voc data/processed/voc.h5
    labrun convert seg data/raw/cells data/processed/cells.h5 --num-classes 3

SRC_DIR is a segfolder (SRC_DIR/images/ and SRC_DIR/masks/, or SRC_DIR/{train,val,test}/...:
data/segmentation/segfolder.py); the file's layout and the conversion: data/segmentation/hdf5.py.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from labrun.core.errors import LabrunError
from labrun.data.image.convert import cpu_count
from labrun.data.segmentation.hdf5 import convert


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC_DIR",
                        help="segmentation folder: SRC_DIR/images/ and SRC_DIR/masks/ with "
                             "matching stems, optionally under SRC_DIR/{train,val,test}/")
    parser.add_argument("out", metavar="OUT.h5", help="the HDF5 file to write")
    parser.add_argument("--num-classes", type=int, metavar="N",
                        help="mask values 0..N-1, for a folder without classes.txt")
    parser.add_argument("--workers", type=int, default=cpu_count(), metavar="N",
                        help="processes that check the pairs (default: the usable cores)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT.h5 if it exists")


def run(args: argparse.Namespace) -> int:
    if args.num_classes is not None and args.num_classes <= 0:
        raise LabrunError(f"--num-classes={args.num_classes} must be a positive number")
    if args.workers < 0:
        raise LabrunError(f"--workers={args.workers} must be 0 or more (0: no extra processes)")
    convert(args.src, args.out, num_classes=args.num_classes, workers=args.workers,
            force=args.force, console=Console(soft_wrap=True))
    return 0
