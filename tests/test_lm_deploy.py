"""`labrun export` and `labrun serve` of a language model (task=lm): tiny GPTs trained for real
(train.py), exported to TorchScript and ONNX and run by their own runtimes at batch sizes and
lengths the export never saw, then served by a real uvicorn on 127.0.0.1: POST /generate
seeded and greedy against the checkpoint's own model, every kind of bad request a 4xx with
the server still healthy; and a BPE run whose checkpoint alone exports and decodes.

Cheap on purpose (the suite's budget): two runs of a 1-layer, 32-wide GPT on 16-token windows,
trained at once; one export per format; one server for every request test."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import httpx
import onnxruntime
import pytest
import torch
from omegaconf import OmegaConf

from conftest import PROJECT, run_labrun, start_train
from labrun import models
from labrun.core.errors import LabrunError
from labrun.data import tokens
from labrun.deploy import export, load, runtime
from labrun.deploy.served import serving
from labrun.tasks import classification, lm

# Four lines over and over: in 200 steps (a second) a 1-layer model learns enough of them that
# its greedy continuation is text, not one repeated byte (a space, the most frequent, before).
TEXT = ("the quick brown fox jumps over the lazy dog.\n"
        "abcdefghijklmnopqrstuvwxyz\n"
        "pack my box with five dozen liquor jugs.\n"
        "0123456789\n") * 300
BLOCK = 16
LM = ["dataset=tokens", f"dataset.block_size={BLOCK}", "model=gpt", "model.n_layer=1",
      "model.n_head=2", "model.n_embd=32", "task=lm", "trainer.limit_val_batches=2",
      "trainer.batch_size=16", "schedule.warmup_steps=5", "optimizer.lr=0.03"]
# Longer than the window: the server must crop it to the last BLOCK tokens, as nanoGPT does.
PROMPT = "pack my box with five dozen liquor jugs.\n0123"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """{"bytes": run, "bpe": run}: the bytes tokenizer (200 steps) and a byte-level BPE of 300
    trained on the same text by convert (20 steps: it only has to exist), trained at the same
    time (each run is mostly Python's start-up, which two cores overlap)."""
    folder = tmp_path_factory.mktemp("lm-deploy")
    (folder / "text.txt").write_text(TEXT)
    started = {}
    try:
        # The BPE run's model has sizes of its own: a vocabulary padded from 300 to 320 (ids
        # that stand for no text) and positions for windows twice its 16 tokens.
        for name, spec, steps, sizes in (
                ("bytes", "bytes", 200, []),
                ("bpe", "train:300", 20, ["model.vocab_size=320", "model.block_size=32"])):
            tokens.convert_text([folder / "text.txt"], folder / f"tokens-{name}", spec)
            log = open(folder / f"{name}.log", "w")  # noqa: SIM115 - closed below
            started[name] = (start_train(*LM, f"dataset.path={folder / f'tokens-{name}'}",
                                         f"trainer.max_steps={steps}",
                                         f"trainer.val_every_n_steps={steps}", *sizes,
                                         run_dir=folder / name, output=log), log)
        for name, (proc, _) in started.items():
            assert proc.wait(timeout=300) == 0, (folder / f"{name}.log").read_text()[-3000:]
    finally:
        for proc, log in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return {name: folder / name for name in started}


@pytest.fixture(scope="module")
def exported(runs) -> dict[str, export.Exported]:
    """The bytes run exported in each format, parity-checked on its val tokens."""
    return {fmt: export.export(runs["bytes"], fmt=fmt) for fmt in ("onnx", "torchscript")}


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """`labrun serve` of the ONNX export on a free 127.0.0.1 port; its base URL."""
    log = tmp_path_factory.mktemp("lm-server") / "server.log"
    try:
        with serving(exported["onnx"].path, log, cwd=PROJECT) as served:
            yield served.url
    finally:
        print(log.read_text()[-3000:])


def eager_model(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's GPT in eager PyTorch, built here from its config, and the checkpoint."""
    state = torch.load(checkpoint, weights_only=True)
    model = models.build(OmegaConf.create(state["config"]["model"]),
                         vocab_size=state["vocab_size"], block_size=state["block_size"])
    model.load_state_dict(state["model"])
    return model.eval(), state


def greedy(model: torch.nn.Module, ids: list[int], count: int, vocab: int | None = None
           ) -> list[int]:
    """The argmax continuation, each step on the last BLOCK tokens, among the first `vocab`
    ids (a padded vocabulary's others stand for no text)."""
    ids, new = list(ids), []
    for _ in range(count):
        with torch.no_grad():
            new.append(int(model(torch.tensor([ids[-BLOCK:]]))[0, -1, :vocab].argmax()))
        ids.append(new[-1])
    return new


def generate(url: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        kwargs["json"] = body
    else:
        kwargs["content"] = body
    return httpx.post(f"{url}/generate", timeout=30, **kwargs)


def test_exports_keep_batch_and_sequence_dynamic_with_the_eager_logits(runs, exported):
    model, _ = eager_model(runs["bytes"] / "checkpoints" / "best.pt")
    session = onnxruntime.InferenceSession(str(exported["onnx"].path),
                                           providers=["CPUExecutionProvider"])
    assert [i.shape for i in session.get_inputs()] == [["batch", "sequence"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated
        module = torch.jit.load(str(exported["torchscript"].path))
    generator = torch.Generator().manual_seed(1)
    # Neither shape is one the export traced (2 x 16) or checked (16 x 16, 1 x 8).
    for shape in ((3, BLOCK), (5, 7)):
        ids = torch.randint(0, 256, shape, generator=generator)
        with torch.no_grad():
            expected, traced = model(ids), module(ids)
        onnx = torch.from_numpy(session.run(None, {"input": ids.numpy()})[0])
        assert onnx.shape == expected.shape == (*shape, 256)
        torch.testing.assert_close(onnx, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(traced, expected, rtol=1e-5, atol=1e-5)
    for fmt, result in exported.items():
        meta = json.loads(runtime.metadata_path(result.path).read_text())
        assert (meta["format"], meta["task"], meta["vocab_size"], meta["block_size"]) == (
            fmt, "lm", 256, BLOCK)
        assert meta["tokenizer"]["kind"] == "bytes" and meta["input"]["dtype"] == "int64"
        parity = meta["parity"]
        assert parity["passed"] and parity["windows_from"].endswith("tokens-bytes val")
        assert parity["shapes"] == [[16, BLOCK], [1, BLOCK // 2]]
        assert parity["top1_agree"] == parity["positions"] == 16 * BLOCK + BLOCK // 2


def test_greedy_generation_is_the_checkpoints_argmax_continuation(server, runs):
    model, _ = eager_model(runs["bytes"] / "checkpoints" / "best.pt")
    expected = greedy(model, list(PROMPT.encode()), 24)
    assert len(set(expected)) > 1, "the model repeats one byte: too little to compare"
    answer = generate(server, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["token_ids"] == expected and got["tokens"] == 24
    assert got["prompt_tokens"] == len(PROMPT.encode())
    assert got["text"] == bytes(expected).decode("utf-8", errors="replace")


def test_sampling_is_deterministic_for_a_seed(server):
    asked = {"prompt": "pack my", "max_tokens": 32, "temperature": 1.0, "seed": 7}
    first, again = generate(server, asked).json(), generate(server, asked).json()
    assert first == again and first["seed"] == 7
    other = generate(server, {**asked, "seed": 8}).json()
    assert other["token_ids"] != first["token_ids"]  # the seed is what was drawn from
    # Without a seed, the answer names the one it drew, which replays it.
    unseeded = generate(server, {"prompt": "pack my", "max_tokens": 32}).json()
    replayed = generate(server, {**asked, "seed": unseeded["seed"]}).json()
    assert replayed["token_ids"] == unseeded["token_ids"]


BAD_REQUESTS = [
    ({"prompt": "", "max_tokens": 4}, 422, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, 422, "max_tokens=0"),
    ({"prompt": "a", "max_tokens": lm.MAX_TOKENS + 1}, 422, f"from 1 to {lm.MAX_TOKENS}"),
    ({"prompt": "a", "max_tokens": 4, "temperature": -0.5}, 422, "temperature=-0.5"),
    ({"prompt": "a", "max_tokens": 4, "seed": -1}, 422, "seed=-1"),
    ({"prompt": "a", "max_tokens": "4"}, 422, "max_tokens=\"4\""),
    ({"max_tokens": 4}, 422, "missing field 'prompt'"),
    ({"prompt": "a"}, 422, "missing field 'max_tokens'"),
    ({"prompt": "a", "max_tokens": 4, "temprature": 1}, 422, "unknown field 'temprature'"),
    (b"\xff\xfe{}", 400, "not UTF-8"),
    (b"prompt=a&max_tokens=4", 400, "not JSON"),
    (b'["a", 4]', 400, "not an object"),
    (b'{"prompt": "a", "max_tokens": 4, "temperature": NaN}', 422, "temperature=NaN"),
]


def test_bad_requests_get_a_4xx_and_the_server_stays_healthy(server):
    for body, status, message in BAD_REQUESTS:
        answer = generate(server, body)
        assert answer.status_code == status, (body, answer.text)
        error = answer.json()["error"]
        assert message in error and "\n" not in error, (body, error)
        assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    # /predict is an image classifier's: named as such, with the route to use.
    answer = httpx.post(f"{server}/predict", files={"file": ("a.jpg", b"\xff\xd8")}, timeout=10)
    assert answer.status_code == 404 and "POST /generate" in answer.json()["error"]
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert (health["status"], health["task"], health["vocab_size"], health["block_size"]) == (
        "ok", "lm", 256, BLOCK)
    assert httpx.get(f"{server}/metadata", timeout=10).json()["tokenizer"] == {
        "kind": "bytes", "sha256": None, "spec": "bytes"}
    ok = generate(server, {"prompt": "the", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["tokens"] == 3


def test_a_bpe_checkpoint_alone_exports_and_decodes_with_its_tokenizer(runs, tmp_path):
    """The checkpoint is copied away from its run and its token folder is deleted: what
    serving loads (load.load, as `labrun serve CHECKPOINT` does) has only the checkpoint."""
    from tokenizers import Tokenizer

    token_folder = runs["bpe"].parent / "tokens-bpe"
    tokenizer_json = (token_folder / "tokenizer.json").read_text()
    checkpoint = tmp_path / "bpe.pt"
    shutil.copy(runs["bpe"] / "checkpoints" / "best.pt", checkpoint)
    shutil.rmtree(token_folder)
    model, state = eager_model(checkpoint)
    # The checkpoint records the data's sizes, beside the padded model they trained.
    assert state["task"] == "lm" and (state["vocab_size"], state["block_size"]) == (300, BLOCK)
    assert (model.vocab_size, model.block_size) == (320, 2 * BLOCK)
    assert state["tokenizer"]["kind"] == "trained" and state["tokenizer"]["json"] == tokenizer_json

    served, folder = load.load(checkpoint, task=None)
    try:
        assert isinstance(served, lm.LanguageModel)
        assert served.metadata["tokenizer"]["json"] == tokenizer_json
        assert served.metadata["output"]["shape"] == ["batch", "sequence", 320]
        answer = served.generate(lm.Request(PROMPT, 12, temperature=0.0))
    finally:
        load.remove_folder(folder)
    reference = Tokenizer.from_str(tokenizer_json)  # the library itself, not labrun's codec
    prompt = reference.encode(PROMPT, add_special_tokens=False).ids
    expected = greedy(model, prompt, 12, vocab=300)
    assert answer["prompt_tokens"] == len(prompt) < len(PROMPT.encode())  # merged pieces
    assert answer["token_ids"] == expected
    assert answer["text"] == reference.decode(expected)


def test_the_bytes_codec_replaces_a_cut_character_and_other_checks_refuse_in_one_line(
        runs, exported, tmp_path):
    codec = tokens.codec({"kind": "bytes"})
    assert codec.encode("é!") == [0xC3, 0xA9, 0x21]
    assert codec.decode([0x68, 0x69, 0xE2, 0x82]) == "hi\ufffd"  # "€" cut after 2 of 3 bytes
    # An image predictor (`labrun predict`) given a language model's export names both.
    with pytest.raises(LabrunError, match="task=lm run, not task=classification"):
        classification.Predictor(exported["onnx"].path)
    # A language model's checkpoint from before export knew them lacks vocab and window.
    state = torch.load(runs["bytes"] / "checkpoints" / "best.pt", weights_only=True)
    for key in ("task", "vocab_size", "block_size"):
        del state[key]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    with pytest.raises(LabrunError, match="without vocab_size, block_size .*train the run again"):
        export.export(old, out=tmp_path / "old.onnx")
    assert not list(tmp_path.glob("*.onnx"))  # refused before anything was written


def test_the_real_commands_export_serve_and_eval_a_language_model_run(runs, tmp_path):
    """`labrun export RUN`, `labrun serve RUN_DIR` and `labrun eval RUN` as typed, each of a
    language model's run (the in-process calls above go around the command lines)."""
    run_dir = runs["bytes"]
    out = tmp_path / "lm.torchscript.pt"
    exported = run_labrun("export", str(run_dir), "--format", "torchscript", "--out", str(out))
    meta = json.loads(runtime.metadata_path(out).read_text())
    assert (meta["task"], meta["deploy"], meta["format"]) == ("lm", "labrun.tasks.lm",
                                                              "torchscript")
    assert meta["parity"]["passed"] and "next token agrees" in exported.stderr

    model, _ = eager_model(run_dir / "checkpoints" / "best.pt")
    expected = greedy(model, list(PROMPT.encode()), 12)
    with serving(run_dir, tmp_path / "server.log", cwd=PROJECT) as served:  # the run folder
        answer = generate(served.url, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["token_ids"] == expected

    result = run_labrun("eval", str(run_dir), "--split", "val")
    [written] = (run_dir / "eval").glob("*-val-best.json")
    record = json.loads(written.read_text())
    metrics = record["metrics"]
    assert record["split"] == "val" and "val/loss" in result.stdout
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-9)
    # It learnt the four lines: far below a uniform guess over 256 bytes (ln 256 = 5.5).
    assert metrics["val/loss"] < 2.5 and 0.3 < metrics["val/acc"] <= 1
