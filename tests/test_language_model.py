"""The language-modelling pieces, in-process and tiny: labrun.models.gpt (its shapes, that no
position sees a later token, the tied head, the refusals, that it learns a sequence) and the
task (train/task.py LanguageModelling: the summed loss over the tokens it scores, its count,
its metrics); then a whole run from a token folder (dataset=tokens) that resumes exactly, and
the README's experiment=char_lm against the byte-unigram perplexity of its text."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess

import numpy as np
import pytest
import torch

from conftest import (
    assert_identical,
    final_weights,
    read_metrics,
    read_summary,
    run_train,
    start_train,
    wait_for,
)
from labrun.core.errors import ConfigError
from labrun.models.gpt import GPT
from labrun.train.task import LanguageModelling

TINY = {"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_next_token_logits_for_every_position():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    ids = torch.randint(0, 50, (3, 16))
    assert model(ids).shape == (3, 16, 50)
    assert model(ids[:, :5]).shape == (3, 5, 50)  # shorter windows too


def test_no_position_sees_a_later_token():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    ids = torch.randint(0, 50, (2, 16))
    later = ids.clone()
    later[:, 9:] = (later[:, 9:] + 1) % 50  # every token from position 9 on changed
    with torch.no_grad():
        before, after = model(ids), model(later)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 9:], after[:, 9:], atol=1e-3)


def test_the_head_is_the_token_embedding():
    model = GPT(**TINY)
    assert model.head.weight is model.token_embedding.weight
    # One matrix, saved once: a state dict round trip keeps them one.
    copy = GPT(**TINY)
    copy.load_state_dict(model.state_dict())
    assert copy.head.weight is copy.token_embedding.weight
    assert torch.equal(copy.head.weight, model.token_embedding.weight)
    counted = sum(p.numel() for p in model.parameters())
    assert counted < sum(p.numel() for p in model.state_dict().values())  # not counted twice


def test_refusals_name_the_keys():
    with pytest.raises(ConfigError, match=r"model\.n_embd=30 is not a multiple of "
                                          r"model\.n_head=4"):
        GPT(50, 16, n_head=4, n_embd=30)
    with pytest.raises(ValueError, match="a window of 17 tokens is longer than the model's "
                                         "block_size=16"):
        GPT(**TINY)(torch.zeros((1, 17), dtype=torch.long))


def test_it_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = GPT(**TINY)
    sequence = torch.arange(17).repeat(2, 1) % 7  # 0..6 over and over: each token predicts the next
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        logits = model(sequence[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50),
                                                 sequence[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 3.0  # about ln(50) untrained
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_the_task_sums_the_loss_over_the_tokens_it_scores_and_counts_them():
    torch.manual_seed(0)
    task, model = LanguageModelling(), GPT(**TINY).eval()
    inputs = torch.randint(0, 50, (2, 8))
    targets = torch.randint(0, 50, (2, 8))
    targets[0, 5:] = LanguageModelling.IGNORE  # padding: not scored
    batch = task.prepare((inputs, targets), torch.device("cpu"))
    count = task.count((inputs, targets))
    assert isinstance(count, torch.Tensor) and int(count) == 13
    with torch.no_grad():
        logits = model(inputs)
        scored = targets != LanguageModelling.IGNORE
        mean = torch.nn.functional.cross_entropy(logits[scored], targets[scored])
        torch.testing.assert_close(task.loss(model, batch), mean * 13)
        sums = task.eval_sums(model, batch)
    right = (logits.argmax(-1)[scored] == targets[scored]).sum()
    assert sums[1] == right and sums[2] == 13
    metrics = task.eval_metrics(sums.double(), "val")
    assert set(metrics) == {f"val/{name}" for name in task.metric_names}
    assert metrics["val/loss"] == pytest.approx(mean.item(), rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(mean.item()), rel=1e-5)
    assert metrics["val/acc"] == pytest.approx(right.item() / 13)


def test_the_task_builds_the_model_for_the_datas_vocabulary_and_window():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"_target_": "labrun.models.gpt.GPT", "_partial_": True,
                            "n_layer": 1, "n_head": 2, "n_embd": 16, "init_from": None})
    model = LanguageModelling().build_model(cfg, {"vocab_size": 256, "block_size": 32})
    assert isinstance(model, GPT) and model.vocab_size == 256 and model.block_size == 32


# A tiny language model on Python's own documentation, bytes as tokens: seconds on the CPU. A
# step budget of 30 (far inside one epoch), validated every 8 steps and at the budget's end;
# judged by val/loss, the task's own monitor (conf/task/lm.yaml).
LM = ["dataset=tokens", "dataset.block_size=32", "model=gpt", "model.n_layer=1",
      "model.n_head=2", "model.n_embd=32", "task=lm", "trainer.max_steps=30",
      "trainer.val_every_n_steps=8", "trainer.log_every_n_steps=4", "trainer.limit_val_batches=4",
      "trainer.batch_size=16", "schedule.warmup_steps=4", "checkpoint.every_n_steps=5",
      "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    from pydoc_data.topics import topics

    from labrun.data import tokens

    folder = tmp_path_factory.mktemp("lm")
    (folder / "topics.txt").write_text("".join(topics.values()))
    tokens.convert_text([folder / "topics.txt"], folder / "bytes", "bytes")
    return folder / "bytes"


@pytest.fixture(scope="module")
def whole_run(token_folder, tmp_path_factory):
    """The LM run, uninterrupted: what the runs below that stop and resume must end as."""
    run_dir = tmp_path_factory.mktemp("lm-whole") / "run"
    run_train(*LM, f"dataset.path={token_folder}", run_dir=run_dir)
    return run_dir


def val_points(run_dir) -> list[tuple[int, float]]:
    return [(m["step"], m["val/loss"]) for m in read_metrics(run_dir) if "val/loss" in m]


def test_a_language_model_trains_to_a_step_budget_validating_mid_epoch(whole_run):
    summary = read_summary(whole_run)
    assert summary["status"] == "completed" and summary["step"] == 30 and summary["epoch"] == 0
    assert summary["monitor"] == "val/loss" and summary["mode"] == "min"
    assert summary["val/ppl"] == pytest.approx(math.exp(summary["val/loss"]))
    assert summary["val/loss"] < math.log(256)  # better than a uniform guess over the bytes
    metrics = read_metrics(whole_run)
    validated = [m for m in metrics if "val/loss" in m]
    assert [m["step"] for m in validated] == [8, 16, 24, 30]  # every 8, then the budget's end
    assert validated[-1]["best/val/loss"] == min(m["val/loss"] for m in validated)
    logged = [m for m in metrics if "perf/samples_per_s" in m]
    assert [m["step"] for m in logged] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert all(m["perf/tokens_per_s"] == pytest.approx(32 * m["perf/samples_per_s"])
               for m in logged)
    state = torch.load(whole_run / "checkpoints" / "last.pt", weights_only=True)
    assert state["tokenizer"]["kind"] == "bytes" and state["class_names"] == []
    best = torch.load(whole_run / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == min(validated, key=lambda m: m["val/loss"])["step"]


def test_status_shows_a_language_models_rate_in_tokens(whole_run, capsys):
    from labrun import cli

    assert cli.main(["status", str(whole_run), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    logged = [m for m in read_metrics(whole_run) if "perf/tokens_per_s" in m]
    assert job["unit"] == "tok/s" and job["verdict"] != "no data yet"
    # The steady windows' tokens/s: within what its points logged.
    assert min(m["perf/tokens_per_s"] for m in logged) <= job["rate"]
    assert job["rate"] <= max(m["perf/tokens_per_s"] for m in logged)


def test_killed_with_sigkill_it_resumes_in_its_folder_bit_identical(whole_run, token_folder,
                                                                     tmp_path):
    """kill -9 once the step-10 checkpoint is on disk (20 steps before the end: mid-training
    however fast the machine), then the same command again: it resumes from the newest
    checkpoint, mid-epoch and between validations, and ends as the uninterrupted run (the
    same windows, the same dropout of none), every validation once, bit for bit."""
    run_dir = tmp_path / "run"
    proc = start_train(*LM, f"dataset.path={token_folder}", run_dir=run_dir,
                       output=subprocess.DEVNULL)
    try:
        wait_for(run_dir / "checkpoints" / "step-00000010.pt", proc)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL  # died by the kill, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert read_summary(run_dir)["status"] == "running"  # as a kill -9 leaves it
    result = run_train(*LM, f"dataset.path={token_folder}", run_dir=run_dir)
    resumed_at = re.search(r"resuming from .* \(step (\d+)\)", result.stdout)
    assert resumed_at and 10 <= int(resumed_at[1]) < 30, result.stdout[-2000:]  # mid-training
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), final_weights(whole_run))
    assert val_points(run_dir) == val_points(whole_run)


def byte_unigram_perplexity(folder) -> float:
    """The perplexity on val of a model that ignores context: each byte's frequency in train
    (add-one smoothed, for a byte train never holds)."""
    from labrun.data import tokens

    train, val = tokens.read_split(folder, "train"), tokens.read_split(folder, "val")
    counts = np.bincount(train, minlength=256) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(np.exp(-log_p[val].mean()))


def test_char_lm_learns_pythons_docs_to_under_half_the_byte_unigram_perplexity(tmp_path):
    """The README's `python train.py experiment=char_lm`, whole: its text converted on first
    use, then a few minutes of training on this CPU."""
    processed = tmp_path / "processed"
    run_dir = tmp_path / "run"
    run_train("experiment=char_lm", f"paths.processed_dir={processed}", run_dir=run_dir,
              timeout=1200)
    folder = processed / "python_docs-bytes"
    assert json.loads((folder / "tokens.json").read_text())["vocab_size"] == 256
    unigram = byte_unigram_perplexity(folder)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["monitor"] == "val/loss"
    assert summary["val/ppl"] < unigram / 2, (summary["val/ppl"], unigram)
