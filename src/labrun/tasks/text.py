"""A text classifier's life after training (labrun.train.text_task.TextClassification's deploy
hooks, labrun.deploy.hooks): what its export takes and returns, how it is served and predicted.

    export   export_plan     input_ids, attention_mask (and token_type_ids, for a model that
                             takes them: BERT's), int64 [batch, sequence], both axes dynamic, in;
                             class logits out; checked on a batch of the run's val texts and on
                             its shortest text alone (two batch sizes, two lengths)
             metadata        class names, the tokenizer (its JSON text), max_length, pairs,
                             pad_id, token_types, the transformers snapshot: what serving needs,
                             with nothing else
             EXTRA_FORMATS   hf: a folder that transformers' AutoModelForSequenceClassification
                             and AutoTokenizer load, id2label naming the classes
    serving  TextClassifier  the exported file in its runtime, with its tokenizer: texts in,
                             tokenized, truncated and padded as the run's val loader does, the
                             label and every class's probability out
             add_routes      POST /predict JSON {"text": "..."} -> {"label", "probs"}, or
                             {"texts": ["...", ...]} -> {"results": [...]}; a model of pairs
                             takes {"text", "text_pair"} or {"texts": [[a, b], ...]}
    predict  FILE [--csv OUT] [--text-column text] [--text-pair-column text_pair]: a .txt file
             (a text a line) or a .csv; `label (prob)` a line, or a CSV row per text

Concurrent requests share model calls (the server's batcher): their texts are padded to the
longest of the call with the attention mask saying which tokens are padding, so each answer is
its lone answer up to float rounding.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from fastapi import HTTPException, Response
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from labrun.core.errors import LabrunError, one_line
from labrun.data.text import PaddingCollate
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.deploy.export import Exported, Plan, Target, build_data

log = logging.getLogger(__name__)

TASK = "text_classification"
REQUIRED_KEYS = ("class_names", "tokenizer", "max_length", "pairs", "pad_id", "token_types")
EXAMPLE_REQUEST = '{"text": "..."} or {"texts": ["...", "..."]}'
USAGE = (f"POST /predict with a JSON body such as {EXAMPLE_REQUEST} (a model of text pairs: "
         f'{{"text": "...", "text_pair": "..."}} or {{"texts": [["...", "..."], ...]}})')
PARITY_TEXTS = 16
MAX_TEXTS = 64  # texts one request may send: a model call's worth (--max-batch is 16)
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# What transformers' save_pretrained and a tokenizer's save_pretrained write: an existing
# --out folder holding only these is an earlier export, replaced; any other is refused.
HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
# The special tokens of a transformers tokenizer, by role, as BERT's and RoBERTa's vocabularies
# spell them: the roles whose token the tokenizer has are set on the exported one.
SPECIAL_TOKENS = {"pad_token": ("[PAD]", "<pad>"), "unk_token": ("[UNK]", "<unk>"),
                  "cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"),
                  "mask_token": ("[MASK]", "<mask>")}


# ---------------------------------------------------------------------------------------------
# Export


class Logits(torch.nn.Module):
    """A transformers classifier as an exporter sees it: tensors in, logits out (its output is
    a ModelOutput, and a model without token types takes none)."""

    def __init__(self, model: torch.nn.Module, token_types: bool):
        super().__init__()
        self.model, self.token_types = model, token_types

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


def build_model(state: dict[str, Any], checkpoint: Path) -> torch.nn.Module:
    """The checkpoint's classifier in eager PyTorch, built from the transformers config it
    carries (never from the weights cache, which the run's config names and which need not
    exist where it is exported), with its inference weights."""
    from labrun.models import hf

    missing = [key for key in ("class_names", "tokenizer", "text", "hf") if key not in state]
    if missing or "config" not in state.get("hf", {}):
        raise LabrunError(f"{checkpoint}: a text classifier's checkpoint without "
                          f"{', '.join(missing) or 'hf.config'}; train the run again with this "
                          f"labrun (labrun rerun RUN_DIR --exec)")
    model = hf.from_config(dict(state["hf"]["config"]), len(state["class_names"]))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise LabrunError(f"{checkpoint}: the weights do not fit the model its config builds "
                          f"({one_line(error)})") from None
    return model.eval()


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Token ids, attention mask (and token types) in, class logits out, batch and sequence
    dynamic; checked on the run's val texts."""
    from labrun.train.text_task import takes_token_types

    model = build_model(state, checkpoint)
    token_types = takes_token_types(model)
    config = state["hf"]["config"]
    # The longest sequence: what the position embedding knows (a longer one is the model's
    # own error); the tokenizer cuts texts at max_length, below it.
    longest = config.get("max_position_embeddings")
    check = None
    if target.check_data is not None:
        batches = parity_batches(state, target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, batches)

    length = min(int(state["text"]["max_length"]), longest or 1 << 30)
    example = example_input(int(config.get("vocab_size", 2)), length,
                            int(state["text"]["pad_id"]), token_types)
    return Plan(Logits(model, token_types).eval(),
                tuple(t.to(target.device) for t in example),
                {0: ("batch", None), 1: ("sequence", longest)}, check, report_parity,
                metadata(state, token_types), inputs=INPUTS[:len(example)])


def example_input(vocab_size: int, length: int, pad_id: int, token_types: bool
                  ) -> tuple[torch.Tensor, ...]:
    """Two texts to trace with, of `length` tokens and of half as many padded to it (sizes
    other than 0 and 1, which torch.export would take for constants; padding, so that no
    exporter specialises the graph to a mask of ones)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    ids[1, length // 2:] = pad_id
    return (ids, mask, torch.zeros_like(ids))[:3 if token_types else 2]


def parity_batches(state: dict[str, Any], data: str) -> tuple[tuple[torch.Tensor, ...], str]:
    """A batch of (input_ids, attention_mask, token_type_ids) as the run's val loader makes it,
    or of seeded random ids when the val texts cannot be read; with where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            dataset = state["config"].get("dataset", {})
            loader = build_data(dataset).loader("val", micro_batch_size=PARITY_TEXTS, seed=0)
            ids, mask, types, _ = next(iter(loader))
            return (ids, mask, types), f"{len(ids)} val texts of {dataset.get('path')}"
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random ids
            reason = f"validation texts unavailable: {one_line(error)}"
    generator = torch.Generator().manual_seed(0)
    vocab = int(state["hf"]["config"].get("vocab_size", 2))
    lengths = torch.randint(2, int(state["text"]["max_length"]) + 1, (PARITY_TEXTS,),
                            generator=generator)
    width = int(lengths.max())
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(0, vocab, (PARITY_TEXTS, width), generator=generator)
    ids = ids.where(mask.bool(), int(state["text"]["pad_id"]))
    return (ids, mask, torch.zeros_like(ids)), f"{PARITY_TEXTS} random texts ({reason})"


def parity(path: Path, target: Target, reference: torch.nn.Module,
           batches: tuple[tuple[torch.Tensor, ...], str]) -> dict[str, Any]:
    """The exported file in its own runtime against the eager fp32 model: the whole batch,
    padded to its longest text, and its shortest text alone at its own length. Two batch sizes
    and two lengths prove both axes dynamic; the padded rows prove the mask is honoured.

    The tolerance is relative to the largest eager logit (at least 1); a top-1 flip counts
    only where the eager top two are further apart than twice what it allows."""
    (ids, mask, types), texts_from = batches
    shortest = int(mask.sum(1).argmin())
    own = int(mask[shortest].sum())
    inputs = 3 if reference.token_types else 2
    run = target.runtime(path)
    diff, allowed, agree, mismatches, shapes = 0.0, 0.0, 0, 0, []
    for batch in ((ids, mask, types), tuple(t[shortest:shortest + 1, :own]
                                            for t in (ids, mask, types))):
        batch = batch[:inputs]
        with torch.inference_mode():
            eager = reference(*(t.to(target.device) for t in batch)).float().cpu()
        exported = torch.from_numpy(run(*(t.numpy() for t in batch)))
        allowed = max(allowed, target.tolerance * max(1.0, eager.abs().max().item()))
        diff = max(diff, (exported - eager).abs().max().item())
        top2 = eager.topk(min(2, eager.shape[1]), dim=1).values
        differs = exported.argmax(1) != eager.argmax(1)
        mismatches += int((differs & (top2[:, 0] - top2[:, -1] > 2 * allowed)).sum())
        agree += int((~differs).sum())
        shapes.append(list(batch[0].shape))
    passed = diff <= allowed and mismatches == 0
    return {"texts": len(ids), "texts_from": texts_from, "shapes": shapes,
            "max_abs_diff": diff, "tolerance": allowed, "top1_agree": agree,
            "top1_mismatches": mismatches, "passed": passed,
            "failure": None if passed else (
                f"parity check failed: max abs diff {diff:.2e} > {allowed:.2e} or top-1 "
                f"differs on {mismatches} text(s)")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    shapes = " and ".join("x".join(map(str, shape)) for shape in check["shapes"])
    log.info(f"parity ({exporter}): {check['texts_from']}, token ids {shapes}: max abs diff "
             f"{check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e}), top-1 agrees "
             f"on {check['top1_agree']}/{check['texts'] + 1} -> {verdict}")


def metadata(state: dict[str, Any], token_types: bool) -> dict[str, Any]:
    """What the export's metadata carries for serving, beside the keys every export has."""
    names, text = list(state["class_names"]), state["text"]
    inputs = INPUTS[:3 if token_types else 2]
    return {"inputs": [{"name": name, "shape": ["batch", "sequence"], "dtype": "int64"}
                       for name in inputs],
            "output": {"name": "logits", "shape": ["batch", len(names)]},
            "class_names": names, "num_classes": len(names),
            "tokenizer": dict(state["tokenizer"]), "max_length": int(text["max_length"]),
            "pairs": bool(text["pairs"]), "pad_id": int(text["pad_id"]),
            "token_types": token_types,
            "hf": {key: state["hf"].get(key) for key in ("name", "revision")}}


# ---------------------------------------------------------------------------------------------
# Export: a folder transformers loads (`labrun export RUN --format hf`)


def export_hf(state: dict[str, Any], checkpoint: Path, out: Path) -> Exported:
    """The classifier and its tokenizer as transformers' save_pretrained writes them, the
    labels named: AutoModelForSequenceClassification.from_pretrained(out) and
    AutoTokenizer.from_pretrained(out) load them, with no labrun."""
    from labrun.train.text_task import takes_token_types

    if out.exists() and not (out.is_dir() and {p.name for p in out.iterdir()} <= HF_FILES):
        raise LabrunError(f"--out {out} exists and is not an earlier hf export; give a new "
                          f"folder")
    model = build_model(state, checkpoint)
    names = list(state["class_names"])
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {name: i for i, name in enumerate(names)}
    tokenizer = hf_tokenizer(state["tokenizer"]["json"], int(state["text"]["max_length"]),
                             takes_token_types(model))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    try:
        model.save_pretrained(tmp)  # safetensors: transformers' default since 4.35
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)  # the folder appears whole, or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, {"format": "hf", "task": TASK, "class_names": names,
                          "hf": {key: state["hf"].get(key) for key in ("name", "revision")}})


def hf_tokenizer(tokenizer_json: str, max_length: int, token_types: bool) -> Any:
    """The run's tokenizer as transformers' fast tokenizer: its special tokens set by role, and
    model_max_length, so that `truncation=True` cuts where the run did."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_padding()
    tokenizer.no_truncation()  # transformers' call arguments decide, as for any model
    roles = {}
    for role, spellings in SPECIAL_TOKENS.items():
        found = [token for token in spellings if tokenizer.token_to_id(token) is not None]
        if found:
            roles[role] = found[0]
    model_inputs = list(INPUTS[:3 if token_types else 2])  # DistilBERT takes no token types
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length,
                                   model_input_names=model_inputs, **roles)


EXTRA_FORMATS: dict[str, Callable[[dict[str, Any], Path, Path], Exported]] = {"hf": export_hf}


# ---------------------------------------------------------------------------------------------
# Serving: a request in


class RequestError(LabrunError):
    """A /predict request that cannot be answered; the message says what to send instead."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status  # 400: no readable JSON object; 413: too many texts; 422: a field


TextInput = str | tuple[str, str]  # a text, or a pair


@dataclass(frozen=True)
class Request:
    texts: list[TextInput]
    single: bool  # {"text": ...}: one answer; {"texts": [...]}: {"results": [...]}


def parse_request(body: bytes, pairs: bool) -> Request:
    """A POST /predict body -> its texts; RequestError names the first problem and the fix."""
    example = ('{"text": "...", "text_pair": "..."}' if pairs else '{"text": "..."}')
    try:
        fields = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise RequestError(f"the body is not UTF-8 (byte {error.start}); send a JSON object "
                           f"such as {example}", 400) from None
    except ValueError as error:
        raise RequestError(f"the body is not JSON ({one_line(error)}); send a JSON object "
                           f"such as {example}", 400) from None
    if not isinstance(fields, dict):
        raise RequestError(f"the body is JSON but not an object; send one such as {example}",
                           400)
    known = ("text", "text_pair", "texts") if pairs else ("text", "texts")
    unknown = sorted(set(fields) - set(known))
    if unknown:
        fix = " (this model classifies single texts)" if "text_pair" in unknown else ""
        raise RequestError(f"unknown field {', '.join(map(repr, unknown))}{fix}: the fields "
                           f"are {', '.join(known)}")
    if ("text" in fields) == ("texts" in fields):
        raise RequestError(f"send either 'text' or 'texts' (a list), such as {example}")
    if "text" in fields:
        text = checked_text(fields["text"], "text")
        if not pairs:
            return Request([text], single=True)
        if "text_pair" not in fields:
            raise RequestError("missing field 'text_pair': this model classifies pairs of "
                               "texts; send {\"text\": \"...\", \"text_pair\": \"...\"}")
        return Request([(text, checked_text(fields["text_pair"], "text_pair"))], single=True)
    if "text_pair" in fields:
        raise RequestError("'text_pair' goes with 'text'; in 'texts', give each pair as a list "
                           "[text, text_pair]")
    texts = fields["texts"]
    if not isinstance(texts, list) or not texts:
        bad("texts", texts, f"a non-empty list of {'pairs [text, text_pair]' if pairs else 'texts'}")
    if len(texts) > MAX_TEXTS:
        raise RequestError(f"{len(texts)} texts; send at most {MAX_TEXTS} per request", 413)
    if not pairs:
        return Request([checked_text(t, f"texts[{i}]") for i, t in enumerate(texts)], False)
    found: list[TextInput] = []
    for i, pair in enumerate(texts):
        if not isinstance(pair, list) or len(pair) != 2:
            bad(f"texts[{i}]", pair, "a pair [text, text_pair]")
        found.append((checked_text(pair[0], f"texts[{i}][0]"),
                      checked_text(pair[1], f"texts[{i}][1]")))
    return Request(found, single=False)


def checked_text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        bad(name, value, "a non-empty string")
    return value


def bad(name: str, value: Any, wanted: str) -> NoReturn:
    raise RequestError(f"{name}={json.dumps(value)[:60]}: give {wanted}")


# ---------------------------------------------------------------------------------------------
# Serving: the model and an answer out


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
        # Tokenized as data/text.py does for training: cut at max_length, padded by the batch.
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


# ---------------------------------------------------------------------------------------------
# labrun predict


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


def read_texts(path: Path, text_column: str, pair_column: str) -> list[TextInput]:
    """The texts of a .txt file (a text a line) or of a .csv file's text column, each checked,
    before any model loads; pairs where the .csv also has `pair_column`."""
    if not path.is_file():
        raise LabrunError(f"{path}: no such file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LabrunError(f"{path}: not UTF-8 (byte {error.start}); convert it to UTF-8"
                          ) from None
    if path.suffix.lower() == ".txt":
        lines = content.splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise LabrunError(f"{path}, line {number}: empty; a .txt file holds a text a "
                                  f"line: remove the line")
        return lines
    if path.suffix.lower() != ".csv":
        raise LabrunError(f"{path}: labrun predict reads texts from a .txt file (a text a "
                          f"line) or a .csv file (--text-column)")
    reader = csv.DictReader(io.StringIO(content, newline=""))  # quoted newlines kept
    columns = reader.fieldnames or []
    if text_column not in columns:
        raise LabrunError(f"{path}: no column {text_column!r} (it has {', '.join(columns)}); "
                          f"name the text column with --text-column")
    needed = [text_column] + ([pair_column] if pair_column in columns else [])
    texts: list[TextInput] = []
    for number, row in enumerate(reader, start=1):
        values = [row[column] or "" for column in needed]
        if not all(value.strip() for value in values):
            raise LabrunError(f"{path}, row {number}: an empty text; remove the row or give "
                              f"it text")
        texts.append(values[0] if len(values) == 1 else (values[0], values[1]))
    if not texts:
        raise LabrunError(f"{path} holds no text")
    return texts
