"""`labrun export`, `labrun serve` and `labrun predict` of a text classifier
(task=text_classification, labrun.tasks.text): the session's tiny BERT run (conftest's text_run)
exported to ONNX and run by onnxruntime at batch sizes and lengths the export never saw, and
to a transformers folder that transformers loads by itself; served by a real uvicorn on
127.0.0.1, where concurrent requests share model calls and each still gets its lone answer;
predicted from a CSV of the run's val texts. A model of text pairs, trained for one short
epoch, goes the same way with pairs.

Cheap on purpose (the suite's budget): one export per format, one server for every request."""

from __future__ import annotations

import csv
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import torch
from tokenizers import Tokenizer

from conftest import PROJECT, run_labrun, run_train
from labrun import cli
from labrun.deploy import runtime
from labrun.deploy.served import serving
from labrun.models import hf
from labrun.tasks import text

MAX_BATCH = 8
HEADER = "x-batch-size"
# float32 rounding: onnxruntime may sum in another order for a batch of 8 than for one (as
# tests/test_serve_batching.py allows).
SAME_ANSWER_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def exported(text_run, tmp_path_factory) -> dict[str, Path]:
    """The run's best checkpoint as ONNX and TorchScript (each parity-checked on its val texts)
    and as a transformers folder, through `labrun export` (in-process: its start-up costs seconds)."""
    folder = tmp_path_factory.mktemp("text-export")
    paths = {"onnx": folder / "best.onnx", "torchscript": folder / "best.pt",
             "hf": folder / "best-hf"}
    for fmt, out in paths.items():
        assert cli.main(["export", str(text_run), "--format", fmt, "--out", str(out)]) == 0
    return paths


@pytest.fixture(scope="module")
def checkpoint(text_run) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's classifier in eager PyTorch, built here from the config it carries."""
    state = torch.load(text_run / "checkpoints" / "best.pt", weights_only=True)
    model = hf.from_config(state["hf"]["config"], len(state["class_names"]))
    model.load_state_dict(state["model"])
    return model.eval(), state


@pytest.fixture(scope="module")
def val_rows(text_assets) -> list[dict[str, str]]:
    with open(text_assets / "data" / "val.csv", newline="", encoding="utf-8") as stream:
        return list(csv.DictReader(stream))


def tokenized(state: dict, texts: list[str]) -> dict[str, torch.Tensor]:
    """The texts as the run's val loader gives them: its tokenizer, cut at max_length, padded
    to the longest with pad_id and an attention mask."""
    tokenizer = Tokenizer.from_str(state["tokenizer"]["json"])
    tokenizer.enable_truncation(state["text"]["max_length"])
    tokenizer.enable_padding(pad_id=state["text"]["pad_id"])
    encodings = tokenizer.encode_batch(texts)
    return {"input_ids": torch.tensor([e.ids for e in encodings]),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
            "token_type_ids": torch.tensor([e.type_ids for e in encodings])}


def eager_logits(checkpoint, texts: list[str]) -> torch.Tensor:
    model, state = checkpoint
    with torch.no_grad():
        return model(**tokenized(state, texts)).logits


def test_the_onnx_export_keeps_batch_and_sequence_dynamic_with_the_eager_logits(
        exported, checkpoint, val_rows):
    _, state = checkpoint
    session = onnxruntime.InferenceSession(str(exported["onnx"]),
                                           providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        (name, ["batch", "sequence"]) for name in text.INPUTS]
    texts = [row["text"] for row in val_rows[:5]]
    # Batch 5 padded to its longest, and one text alone at its own, shorter, length.
    shortest = min(texts, key=len)
    lengths = set()
    for batch in (texts, [shortest]):
        inputs = tokenized(state, batch)
        lengths.add(inputs["input_ids"].shape[1])
        got = session.run(None, {name: t.numpy() for name, t in inputs.items()})[0]
        torch.testing.assert_close(torch.from_numpy(got), eager_logits(checkpoint, batch),
                                   rtol=1e-4, atol=1e-4)
    assert len(lengths) == 2
    meta = json.loads(runtime.metadata_path(exported["onnx"]).read_text())
    assert (meta["task"], meta["deploy"], meta["class_names"]) == (
        "text_classification", "labrun.tasks.text", ["sport", "tech", "weather"])
    assert meta["tokenizer"] == state["tokenizer"] and meta["token_types"] is True
    assert (meta["max_length"], meta["pairs"], meta["hf"]["name"]) == (64, False,
                                                                       "labrun/tiny-bert")
    parity = meta["parity"]
    assert parity["passed"] and parity["texts_from"].startswith("16 val texts")
    assert parity["shapes"][0][0] == 16 and parity["shapes"][1][0] == 1


def test_torchscript_answers_as_onnx_does(exported, val_rows):
    """The traced file in its runtime, with its several inputs, through the serving class."""
    texts = [row["text"] for row in val_rows[:6]]
    onnx, traced = (text.load(exported[fmt]) for fmt in ("onnx", "torchscript"))
    assert (onnx.device, traced.device) == ("cpu", "cpu")
    for a, b in zip(onnx.predict(texts), traced.predict(texts), strict=True):
        assert_same(b, a, "torchscript")
    meta = json.loads(runtime.metadata_path(exported["torchscript"]).read_text())
    assert meta["format"] == "torchscript" and meta["parity"]["passed"]


def test_the_hf_export_loads_in_transformers_with_the_same_logits_and_named_labels(
        exported, checkpoint, val_rows):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(exported["hf"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported["hf"])
    assert model.config.id2label == {0: "sport", 1: "tech", 2: "weather"}
    assert model.config.label2id == {"sport": 0, "tech": 1, "weather": 2}
    texts = [row["text"] for row in val_rows[:6]] + ["goal " * 200]  # cut at max_length
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    _, state = checkpoint
    ours = tokenized(state, texts)
    assert torch.equal(inputs["input_ids"], ours["input_ids"])
    assert inputs["input_ids"].shape[1] == 64
    with torch.no_grad():
        got = model(**inputs).logits
    torch.testing.assert_close(got, eager_logits(checkpoint, texts), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """`labrun serve` of the ONNX export, one model call at a time and a long gathering delay:
    concurrent requests then share model calls even on a loaded machine."""
    log = tmp_path_factory.mktemp("text-server") / "server.log"
    try:
        with serving(exported["onnx"], log, cwd=PROJECT,
                     args=("--max-batch", str(MAX_BATCH), "--max-delay-ms", "200",
                           "--model-calls", "1")) as served:
            yield served.url
    finally:
        print(log.read_text()[-3000:])


def classify(url: str, body) -> httpx.Response:
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
    return httpx.post(f"{url}/predict", timeout=60, **kwargs)


def assert_same(got: dict, expected: dict, name: str) -> None:
    assert got["label"] == expected["label"] and got["probs"].keys() == expected["probs"].keys()
    worst = max(abs(got["probs"][c] - expected["probs"][c]) for c in got["probs"])
    assert worst <= SAME_ANSWER_TOLERANCE, (name, worst, got, expected)


def test_a_text_and_a_list_get_the_checkpoints_probabilities(server, checkpoint, val_rows):
    texts = [row["text"] for row in val_rows[:3]]
    one = classify(server, {"text": texts[0]})
    assert one.status_code == 200, one.text
    answers = [one.json()] + classify(server, {"texts": texts}).json()["results"]
    expected = eager_logits(checkpoint, texts).double().softmax(1)
    for answer, probs in zip(answers, [expected[0], *expected], strict=True):
        assert list(answer["probs"]) == ["sport", "tech", "weather"]
        assert answer["label"] == ["sport", "tech", "weather"][int(probs.argmax())]
        np.testing.assert_allclose(list(answer["probs"].values()), probs.numpy(), atol=1e-5)


def distinct_texts(checkpoint, val_rows, count: int) -> list[str]:
    """`count` val texts of many lengths (in a shared call each is padded to the longest of
    the call) whose answers alone differ by far more than the tolerance: were two alike, a
    swap of the two could not show."""
    by_length = sorted({row["text"] for row in val_rows}, key=len)
    chosen: dict[str, torch.Tensor] = {}
    for t in by_length[::5] + by_length:
        probs = eager_logits(checkpoint, [t])[0].softmax(0)
        if t not in chosen and all((probs - p).abs().max() > 20 * SAME_ANSWER_TOLERANCE
                                   for p in chosen.values()):
            chosen[t] = probs
        if len(chosen) == count:
            return list(chosen)
    raise AssertionError(f"only {len(chosen)} val texts with distinct answers")


def test_concurrent_requests_share_model_calls_and_each_gets_its_lone_answer(
        server, checkpoint, val_rows):
    texts = distinct_texts(checkpoint, val_rows, 12)
    alone = {}
    for t in texts:
        answer = classify(server, {"text": t})
        assert answer.headers[HEADER] == "1"
        alone[t] = answer.json()
    start = threading.Barrier(len(texts))
    answers: dict[str, httpx.Response] = {}

    def ask(t: str) -> None:
        start.wait()
        answers[t] = classify(server, {"text": t})

    threads = [threading.Thread(target=ask, args=(t,)) for t in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sizes = []
    for t in texts:
        assert answers[t].status_code == 200, answers[t].text
        assert_same(answers[t].json(), alone[t], t)
        sizes.append(int(answers[t].headers[HEADER]))
    assert 1 < max(sizes) <= MAX_BATCH, sizes  # gathered: padded together in one call


BAD_REQUESTS = [
    ({}, 422, "send either 'text' or 'texts'"),
    ({"text": "a", "texts": ["b"]}, 422, "send either 'text' or 'texts'"),
    ({"text": ""}, 422, "text=\"\": give a non-empty string"),
    ({"text": "   "}, 422, "give a non-empty string"),
    ({"text": 3}, 422, "text=3"),
    ({"texts": "a goal"}, 422, "texts=\"a goal\": give a non-empty list"),
    ({"texts": []}, 422, "texts=[]"),
    ({"texts": ["fine", None]}, 422, "texts[1]=null"),
    ({"texts": ["a"] * (text.MAX_TEXTS + 1)}, 413, f"send at most {text.MAX_TEXTS}"),
    ({"text": "a", "text_pair": "b"}, 422, "this model classifies single texts"),
    ({"txt": "a"}, 422, "unknown field 'txt'"),
    (b"\xff\xfe{}", 400, "not UTF-8"),
    (b"text=a", 400, "not JSON"),
    (b'["a"]', 400, "not an object"),
]


def test_bad_requests_get_a_4xx_in_one_line_and_the_server_stays_healthy(server):
    for body, status, message in BAD_REQUESTS:
        answer = classify(server, body)
        assert answer.status_code == status, (body, answer.text)
        error = answer.json()["error"]
        assert message in error and "\n" not in error, (body, error)
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert (health["status"], health["task"], health["num_classes"], health["pairs"]) == (
        "ok", "text_classification", 3, False)
    answer = httpx.post(f"{server}/generate", json={"prompt": "a"}, timeout=10)
    assert answer.status_code == 404 and "POST /predict" in answer.json()["error"]
    assert classify(server, {"text": "the storm and rain"}).status_code == 200


def test_predict_writes_the_labels_of_a_csv_and_prints_a_txt(exported, checkpoint, val_rows,
                                                             tmp_path, capsys):
    rows = val_rows[:40]
    source = tmp_path / "texts.csv"
    with open(source, "w", newline="", encoding="utf-8") as stream:
        writer = csv.DictWriter(stream, ["label", "text"])  # the text not the first column
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "labels.csv"
    run_labrun("predict", str(exported["onnx"]), str(source), "--csv", str(out))
    with open(out, newline="", encoding="utf-8") as stream:
        written = list(csv.DictReader(stream))
    assert list(written[0]) == ["row", "text", "label", "prob", "prob_sport", "prob_tech",
                                "prob_weather"]
    assert [r["text"] for r in written] == [r["text"] for r in rows]
    # The checkpoint's own answers, and so nearly all of them right (the run's val/acc is
    # 0.9 or more: test_text_classification.py).
    names = ["sport", "tech", "weather"]
    expected = eager_logits(checkpoint, [r["text"] for r in rows]).softmax(1)
    assert [w["label"] for w in written] == [names[int(i)] for i in expected.argmax(1)]
    np.testing.assert_allclose([float(w["prob"]) for w in written],
                               expected.max(1).values.numpy(), atol=1e-5)
    right = sum(w["label"] == r["label"] for w, r in zip(written, rows, strict=True))
    assert right >= 0.9 * len(rows), right

    lines = tmp_path / "texts.txt"
    lines.write_text("".join(f"{r['text']}\n" for r in rows[:3]))
    assert cli.main(["predict", str(exported["onnx"]), str(lines)]) == 0
    printed = capsys.readouterr().out.splitlines()[-3:]
    labels = [w["label"] for w in written[:3]]
    assert [line.split(" (")[0] for line in printed] == labels
    assert all(line.endswith(")") and 0 < float(line.split("(")[1][:-1]) <= 1
               for line in printed)
    # A mistake in the file is one line, with nothing loaded.
    lines.write_text("a goal\n\nrain\n")
    assert cli.main(["predict", str(exported["onnx"]), str(lines)]) == 2
    assert "texts.txt, line 2: empty" in capsys.readouterr().err


def test_a_model_of_pairs_exports_serves_and_predicts_pairs(text_assets, tmp_path, capsys):
    """Pairs end to end: trained (one short epoch: the answers are compared with the
    checkpoint's, not with the truth), exported to ONNX with its token types, served, and
    predicted from a CSV's two columns."""
    data = tmp_path / "pairs"
    data.mkdir()
    topics = ["rain", "goal", "chip"]
    for split, count in {"train": 48, "val": 12}.items():
        rows = [{"premise": f"the {topics[i % 3]} {'and more ' * (i % 5)}today",
                 "hypothesis": f"it was about {topics[(i // 3) % 3]}",
                 "label": "yes" if i % 3 == (i // 3) % 3 else "no"} for i in range(count)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    run_train("experiment=text_tiny", f"dataset.path={data}", "dataset.text_column=premise",
              "dataset.text_pair_column=hypothesis", "trainer.max_epochs=1",
              f"paths.weights_cache={text_assets / 'weights'}",
              f"paths.data_dir={tmp_path / 'processed'}", run_dir=run_dir)
    out = tmp_path / "pairs.onnx"
    assert cli.main(["export", str(run_dir), "--format", "onnx", "--out", str(out)]) == 0
    meta = json.loads(runtime.metadata_path(out).read_text())
    assert (meta["pairs"], meta["token_types"], meta["class_names"]) == (True, True,
                                                                         ["no", "yes"])
    assert meta["parity"]["passed"]

    state = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    model = hf.from_config(state["hf"]["config"], 2)
    model.load_state_dict(state["model"])
    pairs = [(r["premise"], r["hypothesis"]) for r in rows[:4]]
    tokenizer = Tokenizer.from_str(state["tokenizer"]["json"])
    tokenizer.enable_truncation(state["text"]["max_length"])
    tokenizer.enable_padding(pad_id=state["text"]["pad_id"])
    encodings = tokenizer.encode_batch(pairs)
    assert all(1 in e.type_ids for e in encodings)  # the second text: token type 1
    with torch.no_grad():
        expected = model.eval()(**{
            key: torch.tensor([getattr(e, field) for e in encodings])
            for key, field in (("input_ids", "ids"), ("attention_mask", "attention_mask"),
                               ("token_type_ids", "type_ids"))}).logits.double().softmax(1)

    with serving(out, tmp_path / "server.log", cwd=PROJECT) as served:
        one = classify(served.url, {"text": pairs[0][0], "text_pair": pairs[0][1]})
        many = classify(served.url, {"texts": [list(p) for p in pairs]})
        lone = classify(served.url, {"text": pairs[0][0]})
        health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert one.status_code == 200 and many.status_code == 200, (one.text, many.text)
    for answer, probs in zip([one.json(), *many.json()["results"]], [expected[0], *expected],
                             strict=True):
        assert answer["label"] == ["no", "yes"][int(probs.argmax())]
        np.testing.assert_allclose(list(answer["probs"].values()), probs.numpy(), atol=1e-5)
    assert lone.status_code == 422 and "missing field 'text_pair'" in lone.json()["error"]
    assert health["pairs"] is True

    source, written = tmp_path / "pairs.csv", tmp_path / "labels.csv"
    with open(source, "w", newline="", encoding="utf-8") as stream:
        writer = csv.DictWriter(stream, ["premise", "hypothesis"])
        writer.writeheader()
        writer.writerows({"premise": a, "hypothesis": b} for a, b in pairs)
    assert cli.main(["predict", str(out), str(source), "--csv", str(written), "--text-column",
                     "premise", "--text-pair-column", "hypothesis"]) == 0
    with open(written, newline="", encoding="utf-8") as stream:
        predicted = list(csv.DictReader(stream))
    assert list(predicted[0])[:5] == ["row", "premise", "hypothesis", "label", "prob"]
    assert [(r["premise"], r["hypothesis"]) for r in predicted] == pairs
    np.testing.assert_allclose([float(r["prob_yes"]) for r in predicted],
                               expected[:, 1].numpy(), atol=1e-5)
    # A single text is no input of a model of pairs: one line.
    lines = tmp_path / "texts.txt"
    lines.write_text("the rain today\n")
    assert cli.main(["predict", str(out), str(lines)]) == 2
    assert "this model classifies pairs of texts" in capsys.readouterr().err
