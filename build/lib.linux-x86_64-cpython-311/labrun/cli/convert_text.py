"""`labrun convert text FILES_OR_DIRS... OUT_DIR --tokenizer SPEC`: text to token files.

    labrun convert text corpus/ data/processed/corpus-bytes --tokenizer bytes
    labrun convert text a.txt b.txt data/processed/ab --tokenizer train:4096
    labrun convert text corpus/ data/processed/corpus --tokenizer lab/tokenizer.json

The folder's layout and the tokenizers: labrun.data.tokens.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from labrun.core.errors import LabrunError
from labrun.data import tokens


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="FILES_OR_DIRS... OUT_DIR",
                        help="text files, or folders whose text files (" +
                             ", ".join(tokens.TEXT_SUFFIXES) + ") are read; then the folder "
                             "to write")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help="bytes (vocabulary 256), PATH/tokenizer.json (a Hugging Face "
                             "tokenizers file) or train:VOCAB (a byte-level BPE trained on "
                             "the text)")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the end of each file that goes to val (default: 0.1)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")


def run(args: argparse.Namespace) -> int:
    if len(args.paths) < 2:
        raise LabrunError("give the text and the folder to write: labrun convert text "
                          "FILES_OR_DIRS... OUT_DIR --tokenizer bytes")
    *sources, out_dir = args.paths
    total = sum(path.stat().st_size for path in tokens.text_files(sources))
    bar = LazyProgress(Console(soft_wrap=True, stderr=True), total)
    try:
        meta = tokens.convert_text(sources, out_dir, args.tokenizer,
                                   val_fraction=args.val_fraction, force=args.force,
                                   progress=bar.advance)
    finally:
        bar.stop()
    counts = meta["tokens"]
    print(f"wrote {out_dir}: {counts['train']:,} train and {counts['val']:,} val tokens "
          f"({meta['dtype']}), vocabulary {meta['vocab_size']:,} ({meta['tokenizer']['kind']})")
    return 0


class LazyProgress:
    """A progress bar over the sources' bytes that appears with the first tokens written: the
    checks before them (a file that is not text, an unknown tokenizer) print their one line
    alone."""

    def __init__(self, console: Console, total: int):
        self.console, self.total = console, total
        self.progress: Progress | None = None

    def advance(self, done: int) -> None:
        if self.progress is None:
            self.progress = Progress(TextColumn("tokenizing"), BarColumn(),
                                     TextColumn("{task.percentage:>3.0f}%"),
                                     TimeRemainingColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task("tokenizing", total=self.total)
        self.progress.advance(self.task, done)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
