"""trainer.ema: the exponential moving average of the weights (train/ema.py). It is the average
of the weights each optimizer step left (checked by hand from the checkpoints of every step);
it changes nothing the run trains; a resumed run continues it bit for bit; validation, the test
split, `labrun eval` and `labrun export` use it; its keys are checked like any other."""

from __future__ import annotations

import contextlib
import math
import subprocess
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from conftest import assert_identical, read_metrics, read_summary, run_train, start_train
from labrun import cli
from labrun import data as labrun_data
from labrun.train.ema import WeightEma, decay_at
from labrun.train.evaluation import evaluation_sums

DECAY, WARMUP = 0.9, 2  # far from 0.9999 / 2000, so that 8 steps make an average unlike the weights
# Two epochs of 4 steps on synthetic data with a test split, a checkpoint after every step (all
# kept): each step's trained weights are on disk.
RUN = ["dataset=synthetic", "dataset.num_train=128", "dataset.num_val=64", "dataset.num_test=64",
       "trainer.batch_size=32", "trainer.max_epochs=2", "trainer.deterministic=true",
       "schedule=constant", "checkpoint.every_n_steps=1", "checkpoint.keep_last=20",
       f"trainer.ema_decay={DECAY}", f"trainer.ema_warmup_steps={WARMUP}"]
STEPS = 8


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"train.py failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same run with trainer.ema=true and without it, trained side by side."""
    base = tmp_path_factory.mktemp("ema")
    folders = {"on": base / "on", "off": base / "off"}
    procs = [start_train(*RUN, "trainer.ema=true", run_dir=folders["on"]),
             start_train(*RUN, run_dir=folders["off"])]
    for proc in procs:
        finish(proc)
    return folders


def checkpoint(run_dir: Path, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / name, weights_only=True)


def test_the_ema_is_the_average_of_each_steps_weights(runs):
    """From every step's trained weights, by hand: the first copied, then
    ema = d * ema + (1 - d) * weights with d = decay * (1 - exp(-n / warmup)), in float64."""
    average = None
    for step in range(1, STEPS + 1):
        state = checkpoint(runs["on"], f"step-{step:08d}.pt")
        weights = {k: v.double() for k, v in state["model"].items()}
        if average is None:
            average = weights
        else:
            d = DECAY * (1 - math.exp(-step / WARMUP))
            assert d == decay_at(step, DECAY, WARMUP)
            average = {k: d * average[k] + (1 - d) * weights[k] for k in weights}
        assert state["ema"]["updates"] == step
        ema = state["ema"]["model"]
        assert ema.keys() == weights.keys()
        for key in weights:
            assert torch.allclose(ema[key].double(), average[key], rtol=1e-5, atol=1e-6), key
    # An average unlike the last weights: the test would see an EMA that copied them.
    last = checkpoint(runs["on"], "last.pt")
    assert last["inference_weights"] == "ema"
    assert max((last["ema"]["model"][k] - last["model"][k]).abs().max().item()
               for k in last["model"]) > 1e-3


def test_ema_off_trains_the_same_weights_and_keeps_no_ema(runs):
    """The EMA changes nothing the run trains: the same weights at every step, no RNG drawn.
    Off (the default), a checkpoint holds no EMA; on, validation judges the EMA's weights."""
    for step in range(1, STEPS + 1):
        name = f"step-{step:08d}.pt"
        off, on = checkpoint(runs["off"], name), checkpoint(runs["on"], name)
        assert_identical(off["model"], on["model"])
        assert "ema" not in off and "inference_weights" not in off
    val = [[p["val/loss"] for p in read_metrics(runs[k]) if "val/loss" in p] for k in ("on", "off")]
    assert len(val[0]) == len(val[1]) == 2 and val[0] != val[1]
    train = [[p["train/loss"] for p in read_metrics(runs[k]) if "train/loss" in p]
             for k in ("on", "off")]
    assert train[0] == train[1]


def test_a_resumed_run_continues_the_ema_bit_for_bit(runs, tmp_path):
    """From the checkpoint of step 3 (mid-epoch) in a new folder: at the end the same EMA, its
    count and the same trained weights as the run that went through step 3 itself."""
    path = runs["on"] / "checkpoints" / "step-00000003.pt"
    run_dir = tmp_path / "resumed"
    run_train(*RUN, "trainer.ema=true", f"checkpoint.resume={path}", run_dir=run_dir)
    resumed, through = checkpoint(run_dir, "last.pt"), checkpoint(runs["on"], "last.pt")
    assert resumed["ema"]["updates"] == through["ema"]["updates"] == STEPS
    assert_identical(resumed["ema"]["model"], through["ema"]["model"])
    assert_identical(resumed["model"], through["model"])
    assert read_summary(run_dir)["test/loss"] == read_summary(runs["on"])["test/loss"]


def evaluate_by_hand(run_dir: Path, weights: dict, split: str) -> dict[str, float]:
    """The task's metrics of `weights` on `split`, with the run's own data, model and task."""
    cfg = OmegaConf.create(checkpoint(run_dir, "best.pt")["config"])
    dataset = labrun_data.build(cfg.dataset)
    task = instantiate(cfg.task)
    model = task.build_model(cfg.model, dataset.info)
    model.load_state_dict(weights)
    task.setup(dataset.info, torch.device("cpu"), torch.contiguous_format)
    loader = dataset.loader(split, micro_batch_size=32, seed=cfg.seed, rank=0, world_size=1)
    sums = evaluation_sums(model, task, loader, torch.device("cpu"), contextlib.nullcontext)
    return task.eval_metrics(sums, split)


def test_test_split_eval_and_export_use_the_ema(runs, tmp_path):
    import json

    run = runs["on"]
    best = checkpoint(run, "best.pt")
    by_hand = evaluate_by_hand(run, best["ema"]["model"], "test")
    trained = evaluate_by_hand(run, best["model"], "test")
    assert by_hand["test/loss"] != pytest.approx(trained["test/loss"], rel=1e-4)
    # The run's own test figures (best.pt's EMA) and `labrun eval`'s.
    summary = read_summary(run)
    assert cli.main(["eval", str(run), "--split", "test"]) == 0
    record = json.loads((run / "eval" / "synthetic-test-best.json").read_text())
    for name, value in by_hand.items():
        assert summary[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
        assert record["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name

    # `labrun export` (and so serve and predict): the exported model computes the EMA's outputs.
    from labrun.deploy import export
    from labrun.models import build

    out = tmp_path / "model.torchscript.pt"
    exported = export.export(run, out=out, fmt="torchscript", check_data=None)
    assert exported.metadata["source"]["weights"] == "ema"
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = torch.jit.load(str(out))(x)
    for weights, same in ((best["ema"]["model"], True), (best["model"], False)):
        model = build(OmegaConf.create(best["config"]["model"]), num_classes=10).eval()
        model.load_state_dict(weights)
        with torch.inference_mode():
            assert torch.allclose(logits, model(x), atol=1e-5) == same


def test_weight_ema_averages_float_buffers_and_keeps_counters():
    """use_buffers: BatchNorm's running statistics are averaged like the weights; its
    num_batches_tracked is the model's count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = WeightEma(model, decay=0.5, warmup_steps=0)
    expected = None
    for _ in range(3):
        model(torch.randn(8, 3))  # train mode: the running statistics move
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        now = {k: v.clone().double() for k, v in model.state_dict().items()}
        expected = now if expected is None else {k: 0.5 * expected[k] + 0.5 * now[k] for k in now}
    got = ema.module.state_dict()
    for key in ("0.weight", "1.weight", "1.running_mean", "1.running_var"):
        assert torch.allclose(got[key].double(), expected[key], atol=1e-6), key
    assert got["1.num_batches_tracked"].item() == 3 and ema.updates == 3
    assert int(ema.n_averaged) == 3


@pytest.mark.parametrize("override, names, hint", [
    ("trainer.emma=true", "trainer.emma", "did you mean trainer.ema"),
    ("trainer.ema_decy=0.99", "trainer.ema_decy", "did you mean trainer.ema_decay"),
    ("trainer.ema_decay=1.5", "trainer.ema_decay=1.5", "[0, 1)"),
    ("trainer.ema_warmup_steps=-1", "trainer.ema_warmup_steps=-1", "0 or more"),
])
def test_a_misspelt_or_impossible_ema_key_is_refused(override, names, hint, composed):
    from labrun.cli.hydra_app import user_error_message
    from labrun.config import validation

    validation.validate(composed("trainer.ema=true", "trainer.ema_decay=0.99",
                                 "trainer.ema_warmup_steps=0"))  # spelt right: taken
    with pytest.raises(Exception) as caught:
        validation.validate(composed(override))
    message = user_error_message(caught.value)
    assert message is not None and names in message and "\n" not in message, caught.value
    assert hint in message, message
