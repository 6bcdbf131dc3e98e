"""`labrun predict MODEL IMAGE_OR_DIR... [--out DIR]`: the arguments; the work is labrun.deploy.predict's."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="exported .onnx / .pt file, a run folder or a checkpoint")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="IMAGE_OR_DIR",
                        help="image files, or folders searched recursively for images")
    parser.add_argument("--k", type=int, default=5, help="classes per image (default 5)")
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="write path,rank,class,index,prob rows here instead of printing")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="a segmentation model's masks: DIR/<stem>.png (class indices) and "
                             "DIR/<stem>_overlay.png; not the images' own folder")
    parser.add_argument("--batch-size", type=int, default=32)


def run(args) -> int:
    from labrun.deploy import predict

    return predict.predict(args.model, args.inputs, k=args.k, csv_file=args.csv, out=args.out,
                           batch_size=args.batch_size)
