"""`labrun convert det SRC OUT.h5`: a detection dataset to one HDF5 file (dataset=det_hdf5).

    labrun convert det data/raw/coco data/processed/coco.h5
    labrun convert det data/raw/parts/data.yaml data/processed/parts.h5

SRC is a COCO folder (SRC/annotations/instances_SPLIT*.json beside the SPLIT image folders:
data/detection/coco.py) or a YOLO data.yaml (data/detection/yolo.py); the file's layout and
the conversion: data/detection/hdf5.py.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from labrun.data.detection.hdf5 import convert


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC",
                        help="a COCO folder (SRC/annotations/instances_*.json) or a YOLO "
                             "data.yaml")
    parser.add_argument("out", metavar="OUT.h5", help="the HDF5 file to write")
    parser.add_argument("--force", action="store_true", help="overwrite OUT.h5 if it exists")


def run(args: argparse.Namespace) -> int:
    convert(args.src, args.out, force=args.force, console=Console(soft_wrap=True))
    return 0
