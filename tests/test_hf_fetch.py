"""`labrun weights fetch model=hf model.name=ID`: a transformer's snapshot fetched from the hub
with huggingface_hub's own downloader into the hub cache's layout, against a stand-in of the
hub's HTTP API on 127.0.0.1 (the machine has no internet): the files a run loads and no pickle,
each file's sha256, nothing asked again once it is there, the refusal of a repository with
pickled weights only, and one line with no network.

The fetch runs in a process of its own: huggingface_hub reads HF_ENDPOINT when it is imported.
What the stand-in answers is what huggingface_hub 2.4's snapshot_download asks: the model's
info at a revision (its commit), the listing of its files at that commit, then a HEAD and a GET
of each file it takes under /REPO/resolve/COMMIT/FILE.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import PROJECT, PYTHON
from labrun.core import hub_cache

pytestmark = pytest.mark.timeout(120)

MODEL = "lab/tiny-bert"
PICKLED = "lab/pickled-bert"  # a model published with pytorch_model.bin only
COMMITS = {MODEL: "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b",
           PICKLED: "0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e"}
LFS = ("model.safetensors", "pytorch_model.bin")  # stored in git LFS on the hub: large files


def model_files() -> dict[str, bytes]:
    """A tiny BERT's files as the hub serves them, and a pickled copy of its weights that the
    fetch must leave on the hub."""
    import torch
    from safetensors.torch import save
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 5,
              "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1,
              "intermediate_size": 8, "max_position_embeddings": 16}
    tensors = {"bert.embeddings.word_embeddings.weight": torch.arange(20.0).reshape(5, 4),
               "bert.embeddings.position_embeddings.weight": torch.ones(16, 4)}
    tokenizer = Tokenizer(models.WordLevel(
        {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "hello": 3, "world": 4}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return {"config.json": json.dumps(config).encode(),
            "model.safetensors": save(tensors),
            "tokenizer.json": tokenizer.to_str().encode(),
            "tokenizer_config.json": b'{"tokenizer_class": "BertTokenizerFast"}',
            "pytorch_model.bin": b"a pickle that must never be fetched"}


class Hub(BaseHTTPRequestHandler):
    """The hub's answers for the repositories in `self.server.repos` ({repo: {file: bytes}}),
    each at its commit in COMMITS; every request is kept in `self.server.requests`."""

    INFO = re.compile(r"/api/models/(.+)/revision/([^/]+)")
    TREE = re.compile(r"/api/models/(.+)/tree/([^/]+)")
    RESOLVE = re.compile(r"/(.+)/resolve/([^/]+)/([^/]+)")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self.answer(body=False)

    def answer(self, body: bool) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(f"{self.command} {path}")
        found = self.INFO.fullmatch(path) or self.TREE.fullmatch(path) or (
            self.RESOLVE.fullmatch(path))
        files = self.server.repos.get(found[1]) if found else None
        # The hub's own error codes, which huggingface_hub turns into its exceptions.
        if files is None:
            return self.missing("RepoNotFound", body)
        repo, revision = found[1], found[2]
        if revision not in ("main", COMMITS[repo]):
            return self.missing("RevisionNotFound", body)
        if found.re is self.INFO:
            self.send(json.dumps({"id": repo, "sha": COMMITS[repo], "siblings": [
                {"rfilename": name} for name in files]}).encode(), body)
        elif found.re is self.TREE:
            self.send(json.dumps([entry(name, data) for name, data in files.items()]).encode(),
                      body)
        elif found[3] not in files:
            self.missing("EntryNotFound", body)
        else:
            data = files[found[3]]
            # The hub's ETag: an LFS file's sha256, a git file's blob hash.
            etag = hashlib.sha256(data).hexdigest() if found[3] in LFS else git_hash(data)
            self.send(data, body, {"X-Repo-Commit": COMMITS[repo], "ETag": f'"{etag}"',
                                   "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})

    def missing(self, code: str, body: bool) -> None:
        self.send(json.dumps({"error": code}).encode(), body, {"X-Error-Code": code}, 404)

    def send(self, data: bytes, body: bool, headers: dict[str, str] | None = None,
             status: int = 200) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args) -> None:  # the requests are kept, not printed
        pass


def git_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def entry(name: str, data: bytes) -> dict:
    """A file in the hub's listing of a commit (/api/models/REPO/tree/COMMIT)."""
    found = {"type": "file", "path": name, "size": len(data), "oid": git_hash(data)}
    if name in LFS:
        found["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return found


@pytest.fixture(scope="module")
def hub():
    files = model_files()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.daemon_threads = True
    server.repos = {MODEL: files, PICKLED: {name: files[name] for name in (
        "config.json", "tokenizer.json", "pytorch_model.bin")}}
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def fetch(hub_url: str, cache: Path, *model: str, network: bool = True
          ) -> subprocess.CompletedProcess:
    """`labrun weights fetch model=hf ...` against the stand-in, with the user's own caches
    out of reach and huggingface_hub's offline mode on, as a run leaves it: the fetch turns it
    off."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("HF_") and key.lower() not in ("http_proxy", "https_proxy")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(cache.parent / "hf_home"), HF_HUB_OFFLINE="1",
               NO_PROXY="127.0.0.1")
    command = [PYTHON, "-m", "labrun.cli", "weights", "fetch", "model=hf", *model,
               f"paths.weights_cache={cache}"]
    # In a network namespace of its own, with no interface but a down loopback: no route.
    return subprocess.run(command if network else ["unshare", "--net", *command], cwd=PROJECT,
                          env=env, capture_output=True, text=True, timeout=120)


def url(hub) -> str:
    return f"http://127.0.0.1:{hub.server_address[1]}"


@pytest.fixture(scope="module")
def fetched(hub, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cache = tmp_path_factory.mktemp("fetched") / "weights"
    return cache, fetch(url(hub), cache, f"model.name={MODEL}")


def test_the_fetch_leaves_the_hub_caches_layout_with_each_files_sha256(hub, fetched):
    cache, result = fetched
    assert result.returncode == 0, result.stdout + result.stderr
    commit = COMMITS[MODEL]
    repo = cache / "hub" / "models--lab--tiny-bert"
    assert (repo / "refs" / "main").read_text() == commit
    snapshot = repo / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert f"GET /{MODEL}/resolve/{commit}/pytorch_model.bin" not in hub.requests
    served = hashlib.sha256(hub.repos[MODEL]["model.safetensors"]).hexdigest()
    assert f"hf:{MODEL}@{commit} model.safetensors sha256 {served}" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == f"hf:{MODEL}@{commit}: {snapshot}"
    # What a run finds: the revision it records.
    assert hub_cache.locate(MODEL, None, str(cache)).revision == commit


def test_a_second_fetch_finds_it_there_and_asks_for_no_file(hub, fetched):
    cache, first = fetched
    assert first.returncode == 0, first.stdout + first.stderr
    before = len(hub.requests)
    again = fetch(url(hub), cache, f"model.name={MODEL}")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already at" in again.stdout.splitlines()[-1]
    assert [r for r in hub.requests[before:] if "/resolve/" in r] == []
    # The same files and hashes as the fetch printed.
    assert again.stdout.splitlines()[:-1] == first.stdout.splitlines()[1:-1]


def test_a_damaged_file_in_the_cache_is_named(hub, fetched, tmp_path):
    cache, first = fetched
    assert first.returncode == 0, first.stdout + first.stderr
    copy = tmp_path / "weights"
    shutil.copytree(cache, copy, symlinks=True)  # the snapshot's links are relative
    snapshot = copy / "hub" / "models--lab--tiny-bert" / "snapshots" / COMMITS[MODEL]
    blob = (snapshot / "model.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[:-4] + b"\0\0\0\0")
    result = fetch(url(hub), copy, f"model.name={MODEL}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not match the published" in lines[0], lines
    assert f"remove {blob}" in lines[0]


def test_a_model_with_pickled_weights_only_is_refused_in_one_line(hub, tmp_path):
    result = fetch(url(hub), tmp_path / "weights", f"model.name={PICKLED}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "safetensors" in lines[0]
    assert not any("pytorch_model.bin" in r for r in hub.requests)


def test_a_fetch_without_a_network_is_one_line_and_leaves_nothing(tmp_path):
    cache = tmp_path / "weights"
    result = fetch("http://127.0.0.1:1", cache, f"model.name={MODEL}", network=False)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not fetch "), lines
    assert "run `labrun weights fetch` on a machine with internet" in lines[0]
    left = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert left == []  # nothing half-downloaded where a run would find it


def test_the_fetch_turns_offline_mode_off_where_huggingface_hub_is_already_imported(
        monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: a process that imported it with
    # the variable on (a run's) keeps it on unless its constant is set too.
    from huggingface_hub import constants

    from labrun.core import hub_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_cache.hub_offline(False)  # what `labrun weights fetch` does first
    assert os.environ["HF_HUB_OFFLINE"] == "0" and not constants.is_offline_mode()
