"""`labrun export RUN_DIR|CHECKPOINT`: the arguments; the export is labrun.deploy.export's."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from labrun.core.errors import LabrunError
from labrun.deploy import export
from labrun.deploy.export import DEFAULT_OPSET, FORMATS
from labrun.deploy.runtime import metadata_path

log = logging.getLogger(__name__)


def configure(parser) -> None:
    parser.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                        help="a run folder (uses checkpoints/best.pt) or a checkpoint file")
    # No argparse choices: a run's deploy module may add formats (EXTRA_FORMATS), known only
    # once its checkpoint is read; export() refuses any other in one line.
    parser.add_argument("--format", default="onnx", dest="fmt",
                        help=f"{', '.join(FORMATS)} (default onnx), or a format the run's "
                             f"task adds (its deploy module's EXTRA_FORMATS, such as hf)")
    parser.add_argument("--fp16", action="store_true",
                        help="export a half-precision model (needs a CUDA GPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file (default: RUN_DIR/export/<which><suffix>)")
    parser.add_argument("--which", choices=("best", "last"), default="best",
                        help="checkpoint of a run folder to export (default best)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                        help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument("--exporter", choices=("auto", "dynamo", "legacy"), default="auto",
                        help="ONNX exporter: auto tries dynamo, then legacy (default auto)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the parity check against eager PyTorch")


def run(args) -> int:
    if args.fp16 and not torch.cuda.is_available():
        raise LabrunError(export.FP16_NEEDS_GPU)
    result = export.export(Path(args.source), out=args.out, fmt=args.fmt, which=args.which,
                           fp16=args.fp16, opset=args.opset, exporter=args.exporter,
                           check_data=None if args.no_check else "val", verbose=True)
    if metadata_path(result.path).is_file():  # a task's own format may carry none
        log.info("metadata: %s", metadata_path(result.path))
    return 0
