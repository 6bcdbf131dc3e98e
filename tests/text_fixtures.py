"""What the text classification tests read, made here with nothing downloaded: a labelled corpus
(three topics, words drawn from each topic's list among shared filler) and a tiny BERT (2
layers, hidden size 64, from a BertConfig) with a WordPiece tokenizer of its words
(`tokenizers`), saved in the hub cache's layout as `labrun weights fetch model=hf` leaves a
model (safetensors weights, refs/main naming the snapshot's commit)."""

from __future__ import annotations

import csv
import hashlib
import json
import random
from pathlib import Path

TOPICS = {
    "sport": ["goal", "match", "team", "score", "coach", "league", "player", "referee"],
    "weather": ["rain", "storm", "sunny", "cloud", "wind", "forecast", "snow", "humid"],
    "tech": ["laptop", "software", "chip", "network", "server", "code", "battery", "screen"],
}
FILLER = ["the", "a", "today", "we", "saw", "about", "very", "and", "then", "it", "was", "news",
          "people", "said", "that", "this", "week", "again", "more", "new"]
MODEL = "labrun/tiny-bert"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentence(rng: random.Random, topic: str) -> str:
    words = [rng.choice(FILLER) for _ in range(rng.randint(2, 24))]
    for _ in range(rng.randint(2, 4)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(TOPICS[topic]))
    return " ".join(words).capitalize() + "."


def write_corpus(folder: Path, train: int = 600, val: int = 150, seed: int = 0) -> Path:
    """train.csv and val.csv (columns text, label: the topic's name) under `folder`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("val", val)):
        with open(folder / f"{split}.csv", "w", newline="", encoding="utf-8") as stream:
            writer = csv.writer(stream)
            writer.writerow(["text", "label"])
            for _ in range(count):
                topic = rng.choice(sorted(TOPICS))
                writer.writerow([sentence(rng, topic), topic])
    return folder


def write_tiny_bert(weights_cache: Path, name: str = MODEL, hidden: int = 64) -> str:
    """A tiny BERT and its tokenizer in `weights_cache`/hub, as the hub cache lays a model out;
    returns the snapshot's commit."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    # The vocabulary written out, not trained: a WordPiece trainer breaks ties between words
    # as frequent as each other differently from one process to the next, and a model's ids
    # must be the same in every session. Every word, and each letter alone and as a piece.
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({w for topic in TOPICS.values() for w in topic} | set(FILLER))
    entries = dict.fromkeys([*SPECIALS, *".,!?", *letters, *(f"##{c}" for c in letters),
                             *words])  # "a" is a letter and a word: one id
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(entries)},
                                           unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * hidden,
                        max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    body = BertModel(config)  # a body without a head: the run sizes its own
    commit = hashlib.sha1(f"{name}-{hidden}".encode()).hexdigest()
    repo = weights_cache / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    body.save_pretrained(snapshot, safe_serialization=True)
    tokenizer.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizerFast", "do_lower_case": True,
         "model_max_length": 128}))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit


def write_snapshot_stub(weights_cache: Path, name: str = MODEL) -> None:
    """The files a snapshot is looked up by (config.json, model.safetensors, tokenizer.json and
    refs/main), without a model in them: enough for validation, which only finds it."""
    commit = hashlib.sha1(name.encode()).hexdigest()
    repo = weights_cache / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (snapshot / "model.safetensors").write_bytes(b"")
    (snapshot / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
