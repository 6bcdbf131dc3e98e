"""`labrun predict MODEL INPUT... [OPTIONS]`: the model argument; its task's deploy module takes
the rest (labrun.deploy.predict)."""

from __future__ import annotations

import argparse


def configure(parser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="exported .onnx / .pt file, a run folder or a checkpoint")
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="INPUT... [OPTIONS]",
                        help="the inputs and options of MODEL's task (`labrun predict MODEL "
                             "--help` lists them): an image classifier's IMAGE_OR_DIR... "
                             "[--k 5] [--csv FILE], a segmentation model's IMAGE_OR_DIR... "
                             "--out DIR, a lab's own task's")


def run(args) -> int:
    from labrun.deploy import predict

    return predict.predict(args.model, args.rest)
