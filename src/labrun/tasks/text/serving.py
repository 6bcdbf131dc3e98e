"""A text classifier served (`labrun serve`: TextClassifier and POST /predict, concurrent
requests batched into one model call) and run over a file (`labrun predict`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import HTTPException, Response
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from labrun.core.errors import LabrunError
from labrun.data.text import PaddingCollate
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.tasks.text.export import TASK
from labrun.tasks.text.inputs import RequestError, TextInput, parse_request, read_texts

log = logging.getLogger(__name__)


class TextClassifier:
    """An exported text classifier (labrun export of a task=text_classification run) with its
    tokenizer, from the metadata alone: texts in, a label and the classes' probabilities out."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        from tokenizers import Tokenizer

        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = meta = runtime.read_metadata(self.model_path, task=TASK)
        self.class_names: list[str] = list(meta["class_names"])
        self.max_length, self.pairs = int(meta["max_length"]), bool(meta["pairs"])
        self.token_types = bool(meta["token_types"])
        # Tokenized as data/text/ does for training: cut at max_length, padded by the batch.
        self.tokenizer = Tokenizer.from_str(meta["tokenizer"]["json"])
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)
        self.collate = PaddingCollate(int(meta["pad_id"]), 1)  # the val loader's padding
        self.runtime = runtime.open_runtime(self.model_path, meta["format"], threads)
        # One real inference now: a model that cannot run fails at start-up, not per request.
        self.logits(self.encode([("a", "b") if self.pairs else "a"]))

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> str:
        return self.runtime.device

    def encode(self, texts: Sequence[TextInput]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Each text's (token ids, token types, 0), as the run's token cache holds them."""
        return [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64), 0)
                for e in self.tokenizer.encode_batch(list(texts))]

    def logits(self, encoded: Sequence[tuple[np.ndarray, np.ndarray, int]]) -> np.ndarray:
        """The texts' logits, in one model call, padded to the longest of them."""
        ids, mask, types, _ = self.collate(encoded)
        inputs = (ids, mask, types) if self.token_types else (ids, mask)
        return self.runtime(*(t.numpy() for t in inputs))

    def answers(self, logits: np.ndarray) -> list[dict[str, Any]]:
        probs = torch.from_numpy(np.asarray(logits)).double().softmax(dim=1)
        return [{"label": self.class_names[int(row.argmax())],
                 "probs": dict(zip(self.class_names, row.tolist(), strict=True))}
                for row in probs]

    def predict(self, texts: Sequence[TextInput]) -> list[dict[str, Any]]:
        return self.answers(self.logits(self.encode(texts)))


def load(path: Path, threads: int | None = None) -> TextClassifier:
    return TextClassifier(path, threads)


def describe(model: TextClassifier) -> str:
    kind = "pairs of texts" if model.pairs else "texts"
    return (f"text classifier of {kind}, {model.num_classes} classes, up to {model.max_length} "
            f"tokens")


def health(model: TextClassifier) -> dict[str, Any]:
    return {"task": TASK, "num_classes": model.num_classes, "pairs": model.pairs,
            "max_length": model.max_length}


def add_routes(app, model: TextClassifier, server) -> None:
    """POST /predict: each request's texts tokenized in the thread pool, then batched with
    other requests' texts into model calls (the server's batcher)."""
    batcher = server.batcher(model.logits)

    @app.post("/predict")
    async def predict(request: HTTPRequest, response: Response) -> dict[str, Any]:
        # The body is read and checked here rather than by a pydantic model, so that each bad
        # body (not UTF-8, not JSON, a field missing or of the wrong type) gets its own line.
        try:
            asked = parse_request(await request.body(), model.pairs)
        except RequestError as error:
            raise HTTPException(error.status, str(error)) from None
        encoded = await run_in_threadpool(model.encode, asked.texts)
        answers = model.answers(np.stack(await server.batched(batcher, encoded, response)))
        return answers[0] if asked.single else {"results": answers}



def predict_arguments(parser) -> None:
    parser.add_argument("input", type=Path, metavar="FILE",
                        help="a .txt file (a text a line) or a .csv file (a text a row)")
    parser.add_argument("--csv", type=Path, default=None, metavar="OUT",
                        help="write row,text,label,prob and a prob_CLASS column per class here "
                             "instead of printing")
    parser.add_argument("--text-column", default="text", help="the .csv's text column")
    parser.add_argument("--text-pair-column", default="text_pair",
                        help="the .csv's second text, for a model of pairs")
    parser.add_argument("--batch-size", type=int, default=32)


def predict(args, open_model: Callable[[], TextClassifier]) -> int:
    """Print `label (prob)` for each text, in order (or write them as CSV rows)."""
    if args.batch_size < 1:
        raise LabrunError("--batch-size must be 1 or more")
    texts = read_texts(args.input, args.text_column, args.text_pair_column)
    model = open_model()
    pairs = model.pairs
    if pairs and not all(isinstance(text, tuple) for text in texts):
        raise LabrunError(f"{args.input}: this model classifies pairs of texts; give a .csv "
                          f"with the columns {args.text_column} and {args.text_pair_column}")
    if not pairs:  # a pair column a .csv happens to have is no input of this model
        texts = [text[0] if isinstance(text, tuple) else text for text in texts]
    rows = []
    for start in range(0, len(texts), args.batch_size):
        chunk = texts[start:start + args.batch_size]
        for i, (text, answer) in enumerate(zip(chunk, model.predict(chunk), strict=True)):
            prob = answer["probs"][answer["label"]]
            if args.csv is None:
                print(f"{answer['label']} ({prob:.4f})")
            rows.append([start + i + 1, *((text,) if isinstance(text, str) else text),
                         answer["label"], prob, *answer["probs"].values()])
    if args.csv is not None:
        header = ["row", args.text_column, *([args.text_pair_column] if pairs else []),
                  "label", "prob", *(f"prob_{name}" for name in model.class_names)]
        predicting.write_csv(args.csv, header, rows)
        log.info("%d texts predicted -> %s", len(rows), args.csv)
    return 0
