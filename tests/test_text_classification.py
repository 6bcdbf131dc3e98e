"""Text classification (model=hf, dataset=text, task=text_classification) with nothing
downloaded: a tiny BERT and a labelled corpus made by tests/text_fixtures.py, the preset
experiment=text_tiny trained for real, offline in a network namespace of its own."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    DDP_LOSS_TOLERANCE,
    DDP_WEIGHT_TOLERANCE,
    assert_identical,
    final_weights,
    max_difference,
    read_metrics,
    read_summary,
    run_train,
    start_train,
    text_preset,
    wait_for,
)
from labrun.core.errors import ConfigError, DataError


def test_text_tiny_learns_offline_and_logs_tokens_and_padding(text_run, text_assets):
    summary = read_summary(text_run)
    assert summary["status"] == "completed"
    assert summary["best/val/f1"] >= 0.9, summary  # the monitor
    validations = [m for m in read_metrics(text_run) if "val/acc" in m]
    assert validations[-1]["val/acc"] >= 0.9
    assert set(validations[-1]) >= {"val/f1/sport", "val/f1/tech", "val/f1/weather"}
    logged = [m for m in read_metrics(text_run) if "perf/tokens_per_s" in m]
    assert logged and all(m["perf/tokens_per_s"] > 0 for m in logged)
    assert all(0 <= m["perf/padding_frac"] < 1 for m in logged)
    import torch

    state = torch.load(text_run / "checkpoints" / "last.pt", weights_only=True)
    commit = (text_assets / "weights" / "hub" / "models--labrun--tiny-bert" / "refs" /
              "main").read_text()
    assert state["hf"]["name"] == "labrun/tiny-bert" and state["hf"]["revision"] == commit
    assert state["hf"]["offline"] is True  # huggingface_hub was offline when the model loaded
    assert state["class_names"] == ["sport", "tech", "weather"]
    assert json.loads(state["tokenizer"]["json"])["model"]["type"] == "WordPiece"


def test_eval_gives_the_best_validations_figures_again(text_run, tmp_path):
    import shutil

    from labrun import cli

    run = shutil.copytree(text_run, tmp_path / "run")  # eval writes into the run's folder
    assert cli.main(["eval", str(run), "--split", "val"]) == 0
    evaluated = json.loads((run / "eval" / "text-val-best.json").read_text())["metrics"]
    best = read_summary(run)["best/val/f1"]
    logged = next(m for m in read_metrics(run) if m.get("val/f1") == best)
    assert {k: v for k, v in evaluated.items() if k != "val/loss"} == {
        k: v for k, v in logged.items() if k.startswith("val/") and k != "val/loss"}
    assert evaluated["val/loss"] == pytest.approx(logged["val/loss"], abs=1e-6)


def test_killed_mid_epoch_resumes_to_identical_weights(text_run, text_assets, tmp_path):
    """kill -9 after the checkpoint at step 20, mid-way through epoch 1: the resumed run draws
    the rest of that epoch's length-grouped batches and ends bit for bit as the whole run."""
    run_dir = tmp_path / "run"
    proc = start_train(*text_preset(text_assets), run_dir=run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000020.pt", proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run had ended before the kill"
    result = run_train(*text_preset(text_assets), run_dir=run_dir)
    assert "resuming from" in result.stdout
    assert_identical(final_weights(run_dir), final_weights(text_run))
    steps = [m["step"] for m in read_metrics(run_dir) if "train/loss" in m]
    assert len(steps) == len(set(steps))


def test_a_model_missing_from_the_cache_is_refused_before_data_loads(text_assets, tmp_path):
    result = run_train(*text_preset(text_assets, "model.name=lab/absent-bert",
                               f"paths.data_dir={tmp_path / 'processed'}"),
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "model.name=lab/absent-bert: not in the weights cache" in lines[0]
    assert "labrun weights fetch model=hf model.name=lab/absent-bert" in lines[0]
    assert not (tmp_path / "processed").exists()  # no token cache begun


def test_texts_longer_than_the_models_positions_are_refused_before_data_loads(text_assets,
                                                                              composed):
    from labrun.config import validation

    cfg = composed(*text_preset(text_assets, "dataset.max_length=512"))
    with pytest.raises(ConfigError, match=r"dataset.max_length=512 is beyond the 128 "
                                          r"positions labrun/tiny-bert knows"):
        validation.validate(cfg)


def load(assets: Path, tmp_path: Path, path: Path, **keys):
    from labrun.data import text

    return text.load(str(path), "labrun/tiny-bert", str(tmp_path / "cache"),
                     weights_cache=str(assets / "weights"), **keys)


def test_bad_rows_are_refused_naming_the_file_and_row(text_assets, tmp_path):
    def refused(name: str, content: bytes, **keys) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError) as raised:
            load(text_assets, tmp_path, path, **keys)
        return str(raised.value)

    assert refused("a.csv", b"text,topic\nrain today,weather\n").startswith(
        f"{tmp_path / 'a.csv'}, row 1: no column 'label'")
    assert "row 2: label 'cooking' is not one of the class names (sport, weather)" in refused(
        "b.csv", b"text,label\nrain,weather\nsoup,cooking\n", class_names=["sport", "weather"])
    assert "row 2: the 'text' text is empty" in refused(
        "c.jsonl", b'{"text": "rain", "label": "weather"}\n{"text": " ", "label": "sport"}\n')
    assert "line 3: not UTF-8" in refused("d.csv", b"text,label\nrain,weather\ngo\xff,sport\n")
    assert not any((tmp_path / "cache").glob("*/meta.json"))  # nothing cached of bad data


def test_pairs_truncation_and_the_shared_cache(text_assets, tmp_path):
    data = tmp_path / "pairs"
    data.mkdir()
    rows = [{"premise": f"the storm {'and rain ' * (i % 9)}", "hypothesis": "it was wet",
             "label": ["yes", "no"][i % 2]} for i in range(40)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = dict(text_column="premise", text_pair_column="hypothesis", max_length=16)
    loaded = load(text_assets, tmp_path, data, **keys)
    assert loaded.info["pairs"] and loaded.info["class_names"] == ["no", "yes"]
    assert loaded.splits == {"train": 36, "val": 4}
    # Truncated: the examples whose whole encoding is longer than 16 tokens.
    from tokenizers import Tokenizer

    whole = Tokenizer.from_str(loaded.tokenizer["json"])
    expected = sum(1 for r in rows if len(whole.encode(r["premise"], r["hypothesis"])) > 16)
    assert sum(loaded.meta["truncated"].values()) == expected > 0
    ids, mask, types, labels = next(iter(loaded.loader("train", micro_batch_size=8, seed=0)))
    assert ids.shape[1] <= 16 and (types * mask).sum() > 0  # the second text's token types
    again = load(text_assets, tmp_path, data, **keys)
    assert again.folder == loaded.folder  # the same data and tokenizer: the same cache


def test_length_grouping_cuts_padding_and_resumes_where_it_stopped(text_assets, tmp_path):
    from labrun.data.text import LengthGroupedSampler

    loaded = load(text_assets, tmp_path, text_assets / "data")
    lengths = np.diff(np.load(loaded.folder / "train" / "starts.npy"))

    def padding(grouped: bool) -> float:
        loaded.length_grouped = grouped
        tokens = cells = 0
        for _, mask, _, _ in loaded.loader("train", micro_batch_size=16, seed=3):
            tokens, cells = tokens + int(mask.sum()), cells + mask.numel()
        return 1 - tokens / cells

    assert padding(True) < 0.5 * padding(False)
    sampler = LengthGroupedSampler(lengths, seed=3, multiple=16, micro_batch_size=16)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.set_epoch(2, start=40)
    assert list(sampler) == whole[40:]
    assert sorted(i for _, i in whole) == sorted(set(i for _, i in whole))
    ranks = [LengthGroupedSampler(lengths, seed=3, rank=r, world_size=2, micro_batch_size=8)
             for r in (0, 1)]
    assert len(set(i for s in ranks for _, i in s)) == len(lengths)


def test_macro_f1_is_sklearns(text_assets):
    import torch
    from sklearn.metrics import f1_score

    from labrun.train.text_task import TextClassification

    rng = np.random.default_rng(0)
    truth, predicted = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    predicted[truth == 3] = 3  # a class always found
    predicted[predicted == 2] = 1  # a class never predicted
    task = TextClassification()
    task.class_names = ["a", "b", "c", "d"]
    confusion = torch.bincount(torch.from_numpy(truth * 4 + predicted), minlength=16)
    metrics = task.eval_metrics(torch.cat([torch.tensor([1.0, 200.0]), confusion.double()]),
                                "val")
    assert metrics["val/f1"] == pytest.approx(f1_score(truth, predicted, average="macro"))
    per_class = f1_score(truth, predicted, average=None)
    assert [metrics[f"val/f1/{name}"] for name in "abcd"] == pytest.approx(per_class)
    assert metrics["val/f1/c"] == 0.0  # never predicted
    assert metrics["val/acc"] == pytest.approx((truth == predicted).mean())


def test_the_offline_switch_holds_whatever_was_imported_before_it(monkeypatch):
    import huggingface_hub.constants as constants

    from labrun.core import hub_cache

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # imported before, online
    hub_cache.hub_offline()
    assert constants.HF_HUB_OFFLINE is True
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"  # and for every process the job starts


def test_a_model_with_its_own_code_or_pickled_weights_is_refused(text_assets, tmp_path):
    import shutil

    from labrun.core import hub_cache

    cache = tmp_path / "weights"
    shutil.copytree(text_assets / "weights", cache)
    snapshot = hub_cache.locate("labrun/tiny-bert", None, str(cache))
    config = snapshot.config()
    (snapshot.folder / "config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoModel": "modeling.Tiny"}}))
    with pytest.raises(ConfigError, match="labrun never runs a model's remote code"):
        hub_cache.locate("labrun/tiny-bert", None, str(cache))
    (snapshot.folder / "config.json").write_text(json.dumps(config))
    (snapshot.folder / "model.safetensors").rename(snapshot.folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pickled weights only \(pytorch_model.bin\)"):
        hub_cache.locate("labrun/tiny-bert", None, str(cache))


def test_two_processes_train_as_one(text_assets, tmp_path):
    """Each rank pads its own half of a step's length-grouped examples; the loss counts
    examples, the same on every rank: two processes of 8 texts end where one of 16 does, and
    their confusion matrices sum to one's val figures. Dropout off: each rank draws its own."""
    common = text_preset(text_assets, "model.dropout=0.0", "trainer.max_epochs=null",
                         "trainer.max_steps=8",
                         "trainer.val_every_n_steps=8", "trainer.log_every_n_steps=4")
    run_train("trainer.devices=2", *common, run_dir=tmp_path / "two")
    run_train(*common, run_dir=tmp_path / "one")
    difference = max_difference(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    print(f"text, devices=2 vs devices=1: weights differ by at most {difference:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE
    two, one = (read_summary(tmp_path / d) for d in ("two", "one"))
    assert abs(two["val/loss"] - one["val/loss"]) <= DDP_LOSS_TOLERANCE
    assert (two["val/acc"], two["val/f1"]) == (one["val/acc"], one["val/f1"])


def test_the_head_is_what_lies_outside_the_body_and_trains_at_its_own_rate(text_assets):
    from omegaconf import OmegaConf

    from labrun import models
    from labrun.train import fine_tuning, initial_weights

    model_cfg = OmegaConf.create({"_target_": "labrun.models.hf.hf_model", "_partial_": True,
                                  "name": "labrun/tiny-bert",
                                  "weights_cache": str(text_assets / "weights")})
    model = models.build(model_cfg, 3)
    head = initial_weights.head_keys(model_cfg, model, 3)
    assert head == {"classifier.weight", "classifier.bias"}  # BERT's pooler is the body's
    groups = fine_tuning.parameters(model, OmegaConf.create({"lr": 0.1, "backbone_lr_mult": 0.01}),
                                    lambda: head)
    assert [(len(g["params"]), g["lr"]) for g in groups] == [
        (2, 0.1), (len(list(model.parameters())) - 2, pytest.approx(0.001))]


def test_parquet_and_a_datasets_folder_read_as_csv_does(text_assets, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"{word} today", "label": label} for word, label in
            [("rain", "weather"), ("goal", "sport"), ("chip", "tech")] * 10]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    split = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": split, "validation": split.select(range(6))}).save_to_disk(
        str(tmp_path / "saved"))
    from_parquet = load(text_assets, tmp_path, tmp_path / "train.parquet")
    from_folder = load(text_assets, tmp_path, tmp_path / "saved")
    assert from_parquet.splits == {"train": 27, "val": 3}  # val held out: 10 %
    assert from_folder.splits == {"train": 30, "val": 6}  # its own validation split
    assert from_parquet.info["class_names"] == from_folder.info["class_names"] == [
        "sport", "tech", "weather"]


def test_integer_labels_are_ids_and_digit_names_stay_names(text_assets, tmp_path):
    rows = "text,label\n" + "".join(f"{w} today,{n}\n" for w, n in
                                     [("rain", 2), ("goal", 0), ("storm", 10)] * 4)
    (tmp_path / "ids.csv").write_text(rows)
    loaded = load(text_assets, tmp_path, tmp_path / "ids.csv", val_fraction=0.25)
    assert loaded.info["class_names"] == [str(n) for n in range(11)]  # 10 after 2, 1 kept
    labels = np.concatenate([np.load(loaded.folder / s / "labels.npy") for s in ("train", "val")])
    assert sorted(set(labels.tolist())) == [0, 2, 10]
    named = load(text_assets, tmp_path, tmp_path / "ids.csv", val_fraction=0.25,
                 class_names=["10", "2", "0"])  # names that are digits: matched as names
    labels = np.load(named.folder / "train" / "labels.npy").tolist()
    assert set(labels) == {0, 1, 2} and len(labels) == 9


def test_under_amp_a_batch_is_padded_to_a_multiple_of_8(text_assets, tmp_path, composed):
    assert composed("dataset=text", "precision=bf16").dataset.pad_to_multiple_of == 8
    assert composed("dataset=text", "precision=fp32").dataset.pad_to_multiple_of == 1
    loaded = load(text_assets, tmp_path, text_assets / "data", pad_to_multiple_of=8)
    widths = {ids.shape[1] for ids, mask, _, _ in loaded.loader("val", micro_batch_size=16,
                                                                  seed=0)}
    assert widths and all(width % 8 == 0 for width in widths)
