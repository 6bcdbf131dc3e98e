"""What a user sends a text classifier: a POST /predict body, or `labrun predict`'s file,
each text checked, the first problem named in one line with its fix."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from labrun.core.errors import LabrunError
from labrun.deploy.requests import RequestError, json_object

MAX_TEXTS = 64  # texts one request may send: a model call's worth (--max-batch is 16)


TextInput = str | tuple[str, str]  # a text, or a pair


@dataclass(frozen=True)
class Request:
    texts: list[TextInput]
    single: bool  # {"text": ...}: one answer; {"texts": [...]}: {"results": [...]}


def parse_request(body: bytes, pairs: bool) -> Request:
    """A POST /predict body -> its texts; RequestError names the first problem and the fix."""
    example = ('{"text": "...", "text_pair": "..."}' if pairs else '{"text": "..."}')
    fields = json_object(body, example)
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
