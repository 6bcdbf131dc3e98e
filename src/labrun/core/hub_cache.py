"""The Hugging Face hub cache, read offline: where a model's snapshot is, at which commit, and
whether a run may load it. The one owner of that layout; models/hf.py builds the model from a
snapshot, data/text/ reads its tokenizer (both rooms above this one).

    WEIGHTS/hub/models--ORG--NAME/refs/main                  the commit `main` was at
    WEIGHTS/hub/models--ORG--NAME/snapshots/COMMIT/          config.json, model.safetensors,
                                                             tokenizer.json (and its companions)

WEIGHTS is the lab's `paths.weights_cache` (as for timm's weights), then the user's HF_HOME.
Only the file system is read: nothing here imports huggingface_hub or reaches the network.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrun.core.errors import ConfigError

COMMIT = re.compile(r"[0-9a-f]{40}")
# What a snapshot must hold for a run: the model's config, its weights, the fast tokenizer.
CONFIG, WEIGHTS, SHARDED, TOKENIZER = ("config.json", "model.safetensors",
                                       "model.safetensors.index.json", "tokenizer.json")
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# The files `labrun weights fetch model=hf` takes from the hub: the model's and the tokenizer's,
# never pickled weights nor other frameworks' copies.
FETCHED = (CONFIG, WEIGHTS, SHARDED, "model-*.safetensors", TOKENIZER, "tokenizer_config.json",
           "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
           "sentencepiece.bpe.model", "spiece.model")
OFFLINE = "HF_HUB_OFFLINE"


def hub_offline(on: bool = True) -> None:
    """huggingface_hub's offline mode, for this process and those it starts: on in every job
    (it reads snapshots from the cache and must never reach for the hub: a compute node would
    wait on it), off in `labrun weights fetch`, the one command that goes online (a shell may
    export HF_HUB_OFFLINE=1). The library reads HF_HUB_OFFLINE once, when it is first imported;
    where that has happened already, in whatever order this process imported things, its
    constant is set as well, so the switch holds whatever was imported before it."""
    os.environ[OFFLINE] = "1" if on else "0"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = on


@dataclass(frozen=True)
class Snapshot:
    """A model's files at one commit, in a hub cache."""

    name: str  # the hub's repository id: bert-base-uncased, org/model
    revision: str  # the commit
    folder: Path  # .../snapshots/COMMIT

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / TOKENIZER

    def config(self) -> dict[str, Any]:
        return json.loads((self.folder / CONFIG).read_text(encoding="utf-8"))

    def record(self) -> dict[str, Any]:
        """What a run records of it (provenance and every checkpoint)."""
        return {"name": self.name, "revision": self.revision}


def hub_caches(weights_cache: str | None) -> list[Path]:
    """Where a model's snapshot may be, in the order it is looked for: the lab's weights cache
    (WEIGHTS/hub, as timm's weights), then HF_HUB_CACHE (HF_HOME/hub)."""
    caches = [Path(weights_cache).expanduser() / "hub"] if weights_cache else []
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    own = os.environ.get("HF_HUB_CACHE") or str(Path(home) / "hub")
    return list(dict.fromkeys([*caches, Path(own).expanduser()]))


def repo_folder(hub: Path, name: str) -> Path:
    """The hub cache's folder of repository `name` (its own naming: models--ORG--NAME)."""
    return hub / f"models--{name.replace('/', '--')}"


def fetch_command(name: str, revision: str | None, weights_cache: str | None) -> str:
    return (f"labrun weights fetch model=hf model.name={name}"
            f"{f' model.revision={revision}' if revision else ''}"
            f"{f' paths.weights_cache={weights_cache}' if weights_cache else ''}")


def locate(name: str, revision: str | None, weights_cache: str | None) -> Snapshot:
    """The snapshot of `name` at `revision` (None: refs/main's commit), checked to hold what a
    run loads; one ConfigError line naming where it looked and the command that fetches it
    otherwise."""
    if not name or name == "???":
        raise ConfigError("model=hf needs model.name: the hub's id of the model, as in "
                          "model.name=bert-base-uncased")
    caches = hub_caches(weights_cache)
    for hub in caches:
        commit = _commit(repo_folder(hub, name), revision or "main")
        if commit is not None:
            snapshot = Snapshot(name, commit, repo_folder(hub, name) / "snapshots" / commit)
            check(snapshot, weights_cache)
            return snapshot
    others = len(caches) - 1
    raise ConfigError(
        f"model.name={name}{f' model.revision={revision}' if revision else ''}: not in the "
        f"weights cache (looked in {repo_folder(caches[0], name)}"
        f"{f' and {others} more place' if others else ''}); fetch it on a machine with "
        f"internet: {fetch_command(name, revision, weights_cache)}")


def _commit(repo: Path, revision: str) -> str | None:
    """The commit `revision` names in a repository's cache folder: itself when it is one of its
    snapshots, else what refs/REVISION records (a branch or a tag)."""
    if COMMIT.fullmatch(revision):
        return revision if (repo / "snapshots" / revision).is_dir() else None
    ref = repo / "refs" / revision
    if not ref.is_file():
        return None
    commit = ref.read_text().strip()
    return commit if (repo / "snapshots" / commit).is_dir() else None


def check(snapshot: Snapshot, weights_cache: str | None = None) -> None:
    """Refuse a snapshot a run could not load safely: no config, no tokenizer.json, weights
    only pickled, or a config that asks for the model's own code."""
    folder, name = snapshot.folder, snapshot.name
    fetch = fetch_command(name, snapshot.revision, weights_cache)
    if not (folder / CONFIG).is_file():
        raise ConfigError(f"model.name={name}: {folder} has no {CONFIG}; fetch it again: {fetch}")
    if not ((folder / WEIGHTS).is_file() or (folder / SHARDED).is_file()):
        pickled = [file for file in PICKLED if (folder / file).is_file()]
        raise ConfigError(
            f"model.name={name}: {folder} holds "
            f"{f'pickled weights only ({pickled[0]})' if pickled else 'no weights'}; labrun "
            f"loads safetensors only (a pickle runs code when read): use a model published "
            f"with {WEIGHTS}, or convert it with transformers' save_pretrained("
            f"safe_serialization=True)")
    if not (folder / TOKENIZER).is_file():
        raise ConfigError(f"model.name={name}: {folder} has no {TOKENIZER} (a fast tokenizer's "
                          f"file, which dataset=text tokenizes with); fetch it again: {fetch}")
    config = snapshot.config()
    if config.get("auto_map"):
        raise ConfigError(f"model.name={name} needs code of its own (auto_map in its "
                          f"{CONFIG}): labrun never runs a model's remote code "
                          f"(trust_remote_code); choose a model transformers implements")
