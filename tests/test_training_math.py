"""The numbers the loop must get right: gradient accumulation, schedules, the uint8 pipeline,
and the out-of-memory fallback of trainer.micro_batch_size=auto."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import even_labels_env, even_labels_task, read_counts, read_summary, run_train
from labrun.data import EpochSampler
from labrun.data.image.transforms import (
    BatchNormalizer,
    TrainTransform,
    ValTransform,
    normalize_on_device,
)
from labrun.train import schedules


def test_accumulating_micro_batches_equals_one_big_batch(tmp_path):
    common = ["trainer.batch_size=32", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
              "optimizer=sgd", "model.dropout=0", "trainer.deterministic=true"]
    run_train(*common, "trainer.micro_batch_size=32", run_dir=tmp_path / "big")
    run_train(*common, "trainer.micro_batch_size=8", run_dir=tmp_path / "accum")
    big = torch.load(tmp_path / "big/checkpoints/last.pt", weights_only=True)["model"]
    accum = torch.load(tmp_path / "accum/checkpoints/last.pt", weights_only=True)["model"]
    for key in big:
        torch.testing.assert_close(accum[key], big[key], rtol=1e-5, atol=1e-6)
    assert read_summary(tmp_path / "accum")["step"] == 4
    # Both runs did train: SGD with momentum keeps state only after a real step.
    for name in ("big", "accum"):
        state = torch.load(tmp_path / name / "checkpoints/last.pt", weights_only=True)
        assert state["optimizer"]["state"], f"{name}: the optimizer never stepped"


def test_micro_batches_holding_different_numbers_of_items_equal_one_big_batch(tmp_path):
    """The loss is divided by the items of the whole optimizer step, not averaged per
    micro-batch: averaging each micro-batch over its own items would weigh an item of a
    micro-batch with few items more than one of a full micro-batch."""
    lab = even_labels_task(tmp_path / "lab")
    common = ["trainer.batch_size=32", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
              "optimizer=sgd", "model.dropout=0", "trainer.deterministic=true",
              "task._target_=labtask.EvenLabels"]
    for name, micro in (("big", 32), ("accum", 8)):
        run_train(*common, f"trainer.micro_batch_size={micro}", run_dir=tmp_path / name,
                  env=even_labels_env(lab, tmp_path / f"{name}.counts"))
    big = torch.load(tmp_path / "big/checkpoints/last.pt", weights_only=True)["model"]
    accum = torch.load(tmp_path / "accum/checkpoints/last.pt", weights_only=True)["model"]
    for key in big:
        torch.testing.assert_close(accum[key], big[key], rtol=1e-5, atol=1e-6)
    # The same items in all, and micro-batches of 8 holding different numbers of them: the
    # comparison above tells the two divisions apart.
    counts = {name: read_counts(tmp_path / f"{name}.counts") for name in ("big", "accum")}
    assert len(counts["big"]) == 4 and len(counts["accum"]) == 16
    assert sum(counts["big"]) == sum(counts["accum"])
    assert len(set(counts["accum"])) > 1, counts


def test_cosine_schedule_warms_up_then_decays():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = schedules.cosine(optimizer, steps_per_epoch=10, total_steps=30, warmup_epochs=1)
    lrs = []
    for _ in range(30):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] < lrs[5] < lrs[9] <= 1.0  # warm-up
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] < 0.02  # then cosine down to ~0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def test_step_schedule():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = schedules.step(optimizer, steps_per_epoch=2, total_steps=8, step_epochs=1,
                               gamma=0.5)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_schedules_in_steps_for_a_step_budget():
    """A step budget's forms: warm-up in steps, cosine over the whole budget, a step decay every
    N steps; given in steps, the epoch forms are not used."""
    def lrs(scheduler, optimizer, steps):
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cosine = lrs(schedules.cosine(optimizer, steps_per_epoch=1000, total_steps=20,
                                  warmup_epochs=1, warmup_steps=4), optimizer, 20)
    assert cosine[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert cosine[12] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert cosine[-1] < 0.01  # down to ~0 at the budget's end, not an epoch's
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    stepped = lrs(schedules.step(optimizer, steps_per_epoch=1000, total_steps=7,
                                 step_epochs=30, step_every_n_steps=3, gamma=0.5), optimizer, 7)
    assert stepped == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_sampler_shards_pads_and_resumes_mid_epoch():
    full = EpochSampler(10, seed=1, rank=0, world_size=1, multiple=4)
    assert len(full.indices()) == 8 and full.steps_per_epoch() == 2  # whole steps only
    ranks = [EpochSampler(10, seed=1, rank=r, world_size=3) for r in range(3)]
    shards = [r.indices() for r in ranks]
    assert all(len(s) == 4 for s in shards)  # 10 samples padded to 12 across 3 ranks
    assert set().union(*shards) == set(range(10))
    sampler = EpochSampler(10, seed=1)
    sampler.set_epoch(2)
    order = [i for _, i in sampler]
    sampler.set_epoch(2, start=6)
    assert [i for _, i in sampler] == order[6:]
    sampler.set_epoch(3)
    assert [i for _, i in sampler] != order  # a new order each epoch
    evaluation = [EpochSampler(10, 0, r, 3, shuffle=False, pad=False).indices() for r in range(3)]
    assert sorted(sum(evaluation, [])) == list(range(10))  # every sample counted once


def test_transforms_stay_uint8_and_are_seeded():
    image = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    train = TrainTransform(224)
    a = train(image, np.random.default_rng([1, 2, 3]))
    b = train(image, np.random.default_rng([1, 2, 3]))
    c = train(image, np.random.default_rng([1, 2, 4]))
    assert a.dtype == torch.uint8 and a.shape == (3, 224, 224)
    assert torch.equal(a, b) and not torch.equal(a, c)
    val = ValTransform(224)(image)
    assert val.dtype == torch.uint8 and val.shape == (3, 224, 224)


def test_batch_normalizer_reuses_one_cpu_buffer_and_normalizes_exactly():
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    normalize = BatchNormalizer(mean, std)
    first, second = (torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8) for _ in range(2))
    out = normalize(first)
    assert out.dtype == torch.float32 and torch.equal(out, normalize_on_device(first, mean, std))
    address = out.data_ptr()
    out = normalize(second)
    assert out.data_ptr() == address  # the same memory, written again
    assert torch.equal(out, normalize_on_device(second, mean, std))
    last = normalize(second[:3])  # a smaller last batch gets a buffer of its own shape
    assert last.shape == (3, 3, 8, 8) and torch.equal(last, out[:3])


@pytest.mark.parametrize("batch, limit, expected", [(32, 8, 8), (100, 12, 10)])
def test_out_of_memory_halves_the_micro_batch(composed, tmp_path, monkeypatch, batch, limit,
                                              expected):
    """A CUDA out-of-memory error is injected (no GPU here): batches above `limit` images fail.
    The micro-batch always divides the batch: 100 -> 50 -> 25 -> 10, not 12."""
    from labrun import models
    from labrun.train import job as run

    real_build = models.build

    class FailsAbove8(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if self.training and x.shape[0] > limit:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return self.inner(x)

    monkeypatch.setattr(models, "build", lambda *a, **k: FailsAbove8(real_build(*a, **k)))
    cfg = composed(f"trainer.batch_size={batch}", "trainer.max_epochs=1", "logger=none",
                   "trainer.limit_train_batches=3", "dataset.num_workers=0",
                   "trainer.progress=none")
    run.train(cfg)
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["step"] == 3
    state = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)
    assert state["data"]["micro_batch_size"] == expected
