"""`labrun convert text`: text to token folders (labrun.data.tokens), with the bytes tokenizer,
a lab's tokenizer.json and a byte-level BPE trained on the text; bad input refused in one line
with nothing written; a convert that fails leaves no folder a run could read. The text is the
documentation that ships inside every CPython (pydoc_data.topics): real prose and code, here
without a download."""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest

from conftest import LABRUN
from labrun.core.errors import DataError
from labrun.data import tokens


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two text files: Python's own documentation topics, split in two."""
    from pydoc_data.topics import topics

    folder = tmp_path_factory.mktemp("corpus")
    names = sorted(topics)
    half = len(names) // 2
    for index, part in enumerate((names[:half], names[half:])):
        (folder / f"topics-{index}.txt").write_text("".join(topics[n] for n in part))
    return folder


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LABRUN, "convert", "text", *args], capture_output=True, text=True,
                          timeout=300)


def test_bytes_tokens_are_the_texts_bytes_each_file_split_into_train_and_val(corpus, tmp_path):
    out = tmp_path / "bytes"
    result = convert(str(corpus), str(out), "--tokenizer", "bytes")
    assert result.returncode == 0, result.stderr
    meta = tokens.read_meta(out)
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == {"kind": "bytes", "sha256": None, "spec": "bytes"}
    assert not (out / "tokens.json").with_name("tokenizer.json").exists()
    files = sorted(corpus.glob("*.txt"))
    assert meta["sources"] == [str(f) for f in files]
    train, val = tokens.read_split(out, "train"), tokens.read_split(out, "val")
    assert isinstance(train, np.memmap)
    # Each file's start went to train and its end to val, at a line break near 90%.
    expected_train, expected_val = b"", b""
    for path in files:
        text = path.read_text()
        first, second = tokens.split_text(text, 0.1)
        assert first + second == text and first.endswith("\n")
        assert 0.85 < len(first) / len(text) <= 0.9
        expected_train += first.encode()
        expected_val += second.encode()
    assert train.tobytes() == np.frombuffer(expected_train, np.uint8).astype(np.uint16).tobytes()
    assert val.tobytes() == np.frombuffer(expected_val, np.uint8).astype(np.uint16).tobytes()
    assert meta["tokens"] == {"train": len(expected_train), "val": len(expected_val)}
    assert f"wrote {out}: {len(expected_train):,} train and {len(expected_val):,} val tokens" \
        in result.stdout


def test_a_trained_bpe_round_trips_the_text_and_its_file_is_recorded(corpus, tmp_path):
    from tokenizers import Tokenizer

    out = tmp_path / "bpe"
    result = convert(str(corpus / "topics-0.txt"), str(out), "--tokenizer", "train:1000")
    assert result.returncode == 0, result.stderr
    meta = tokens.read_meta(out)
    saved = out / "tokenizer.json"
    assert meta["vocab_size"] == 1000 and meta["tokenizer"]["kind"] == "trained"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(saved.read_bytes()).hexdigest()
    tokenizer = Tokenizer.from_file(str(saved))
    ids = [*tokens.read_split(out, "train").tolist(), *tokens.read_split(out, "val").tolist()]
    assert max(ids) < 1000
    assert tokenizer.decode(ids) == (corpus / "topics-0.txt").read_text()
    # Merges learnt: fewer tokens than bytes.
    assert len(ids) < 0.5 * len((corpus / "topics-0.txt").read_bytes())


def test_a_labs_tokenizer_file_is_used_copied_and_hashed(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A lab's word-level vocabulary above 65,536 entries, the text's words at its far end, so
    # that their ids need uint32 token files.
    text = (corpus / "topics-1.txt").read_text()
    words = sorted(set(text.split()))
    vocabulary = {"[UNK]": 0, **{f"filler{i}": i for i in range(1, 70_000)}}
    vocabulary.update({word: 70_000 + i for i, word in enumerate(words)})
    lab = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="[UNK]"))
    lab.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    lab_file = tmp_path / "lab-tokenizer.json"
    lab.save(str(lab_file))
    out = tmp_path / "lab"
    result = convert(str(corpus / "topics-1.txt"), str(out), "--tokenizer", str(lab_file))
    assert result.returncode == 0, result.stderr
    meta = tokens.read_meta(out)
    assert meta["tokenizer"]["kind"] == "file"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(lab_file.read_bytes()).hexdigest()
    assert (out / "tokenizer.json").read_bytes() == lab_file.read_bytes()
    # A vocabulary above 65,536: uint32 token files.
    assert meta["vocab_size"] == lab.get_vocab_size() > 2 ** 16 and meta["dtype"] == "uint32"
    first, _ = tokens.split_text(text, 0.1)
    expected = [e.ids for e in lab.encode_batch(first.splitlines(keepends=True))]
    train = tokens.read_split(out, "train").tolist()
    assert train == [i for ids in expected for i in ids] and max(train) >= 2 ** 16


@pytest.mark.parametrize("case, message", [
    ("binary", "data.bin is a binary file, not text; leave it out"),
    ("latin-1", "latin.txt is not UTF-8 text (byte 3: invalid continuation byte)"),
    ("empty folder", "no text file (.txt, .md, .rst, .text) under"),
    ("empty file", "no text in"),
    ("bad tokenizer file", "not a tokenizers file"),
    ("bad spec", "--tokenizer train:abc: give the vocabulary size after train:"),
    ("missing tokenizer", "--tokenizer nowhere.json: no such file"),
    ("exists", "exists; add --force to replace it"),
])
def test_bad_input_is_refused_naming_it_and_writes_nothing(tmp_path, case, message):
    text = tmp_path / "text.txt"
    text.write_text("Some text.\nMore text.\n" * 20)
    out = tmp_path / "out"
    spec = "bytes"
    source = text
    if case == "binary":
        source = tmp_path / "data.bin"
        source.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    elif case == "latin-1":
        source = tmp_path / "latin.txt"
        source.write_bytes("caf\u00e9 \u00e9t\u00e9".encode("latin-1"))
    elif case == "empty folder":
        source = tmp_path / "empty"
        source.mkdir()
    elif case == "empty file":
        source = tmp_path / "empty.txt"
        source.write_text("")
    elif case == "bad tokenizer file":
        spec = str(tmp_path / "tokenizer.json")
        (tmp_path / "tokenizer.json").write_text("{not json")
    elif case == "bad spec":
        spec = "train:abc"
    elif case == "missing tokenizer":
        spec = "nowhere.json"
    elif case == "exists":
        out.mkdir()
        (out / "kept.txt").write_text("a lab's file")
    with pytest.raises(DataError) as refused:
        tokens.convert_text([source], out, spec)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    if case == "exists":
        assert [p.name for p in out.iterdir()] == ["kept.txt"]
    else:
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


def test_the_command_refuses_in_one_line_with_exit_2(tmp_path):
    source = tmp_path / "data.bin"
    source.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    result = convert(str(source), str(tmp_path / "out"), "--tokenizer", "bytes")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"error: {source} is a binary file, not text; leave "
                                          f"it out"], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_convert_that_fails_midway_leaves_no_folder_and_force_replaces_whole(
        corpus, tmp_path, monkeypatch):
    out = tmp_path / "tokens"
    tokens.convert_text([corpus], out, "bytes")
    before = (out / "train.bin").read_bytes()

    # A convert interrupted after its first tokens are written: the old folder stays as it
    # was, and no partial folder is left.
    def interrupt(done):
        raise KeyboardInterrupt  # Ctrl-C once the first piece of tokens is written
    with pytest.raises(KeyboardInterrupt):
        tokens.convert_text([corpus], out, "bytes", force=True, val_fraction=0.2,
                            progress=interrupt)
    assert (out / "train.bin").read_bytes() == before
    assert tokens.read_meta(out)["tokens"]["train"] == len(before) // 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]

    # --force replaces it whole once the new folder is complete; the progress it reports
    # adds up to the sources' bytes.
    done = []
    tokens.convert_text([corpus], out, "bytes", force=True, val_fraction=0.2,
                        progress=done.append)
    assert sum(done) == sum(path.stat().st_size for path in corpus.glob("*.txt"))
    assert tokens.read_meta(out)["tokens"]["train"] < len(before) // 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]


def test_a_token_file_cut_short_is_named_with_the_fix(corpus, tmp_path):
    out = tmp_path / "tokens"
    tokens.convert_text([corpus / "topics-0.txt"], out, "bytes")
    data = (out / "val.bin").read_bytes()
    (out / "val.bin").write_bytes(data[:-10])
    with pytest.raises(DataError, match=rf"val\.bin is {len(data) - 10:,} bytes, not the "
                                        rf"{len(data):,} bytes tokens\.json records .*--force"):
        tokens.read_split(out, "train")
    (out / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val\.bin is missing"):
        tokens.read_meta(out)
    with pytest.raises(DataError, match="is not a token folder"):
        tokens.read_meta(corpus)
    assert json.loads((out / "tokens.json").read_text())["format"] == tokens.FORMAT


def test_labrun_convert_images_is_the_image_convert(tmp_path):
    """`labrun convert images SRC OUT` and `labrun convert SRC OUT` are one command."""
    for form in (["images"], []):
        result = subprocess.run([LABRUN, "convert", *form, "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "--storage" in result.stdout, result.stdout
    result = subprocess.run([LABRUN, "convert", "text", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "--tokenizer" in result.stdout, result.stdout
