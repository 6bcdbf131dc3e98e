"""Options that change how a run trains without changing what it computes much, each checked
for an effect that would be missing if labrun ignored it: trainer.grad_clip, model.init_from
into a new head, trainer.channels_last and trainer.compile."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_summary, run_train

# Plain SGD (no momentum, no weight decay, constant rate): a step moves the weights by exactly
# lr x the (clipped) gradient. A clip far below a fresh CNN's gradient norm always engages.
LR, CLIP = 1.0, 0.01
CLIPPED = ["optimizer=sgd", f"optimizer.lr={LR}", "optimizer.momentum=0",
           "optimizer.nesterov=false", "optimizer.weight_decay=0", "schedule=constant",
           f"trainer.grad_clip={CLIP}", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
           "trainer.limit_val_batches=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=10",
           "trainer.deterministic=true"]


@pytest.fixture(scope="module")
def clipped_run(tmp_path_factory) -> Path:
    """A digits run (10 classes) with gradient clipping and a checkpoint after every step; also
    the source checkpoint of the init_from test."""
    run_dir = tmp_path_factory.mktemp("clipped") / "run"
    run_train(*CLIPPED, run_dir=run_dir)
    return run_dir


def weights_at(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / f"step-{step:08d}.pt"
    return torch.load(path, weights_only=True)["model"]


def test_grad_clip_bounds_every_step_to_lr_times_the_clip(clipped_run):
    assert read_summary(clipped_run)["status"] == "completed"
    for step in (1, 2):
        before, after = weights_at(clipped_run, step), weights_at(clipped_run, step + 1)
        moved = torch.cat([(after[k] - before[k]).flatten() for k in before]).norm().item()
        # Unclipped, the step would be lr x the gradient norm, far above lr x clip.
        assert moved == pytest.approx(LR * CLIP, rel=1e-3), f"step {step + 1} moved {moved}"


# A 5-class model: its head cannot take the 10-class source's. lr=1e-30: the run's one step
# moves a weight by at most ~lr (AdamW's normalised update), far below float32's resolution
# at the size of these weights, so the last checkpoint holds the weights the run started from.
TARGET = ["dataset=synthetic", "dataset.num_classes=5", "dataset.num_train=128",
          "dataset.num_val=64", "optimizer.lr=1e-30", "optimizer.weight_decay=0",
          "trainer.max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]


def test_init_from_loads_the_body_and_leaves_a_new_head_initialised(clipped_run, tmp_path):
    source = clipped_run / "checkpoints" / "last.pt"
    result = run_train(*TARGET, f"model.init_from={source}", run_dir=tmp_path / "tuned")
    run_train(*TARGET, run_dir=tmp_path / "fresh")  # the same seed, nothing loaded
    loaded = torch.load(source, weights_only=True)["model"]
    tuned = torch.load(tmp_path / "tuned/checkpoints/last.pt", weights_only=True)["model"]
    fresh = torch.load(tmp_path / "fresh/checkpoints/last.pt", weights_only=True)["model"]

    body = [k for k in tuned if k.startswith("features.")]
    head = [k for k in tuned if k.startswith("head.")]
    assert len(body) == 6 and head == ["head.1.weight", "head.1.bias"]
    for key in body:
        assert not torch.equal(fresh[key], loaded[key])  # so the equality below means loaded
        assert torch.equal(tuned[key], loaded[key]), f"{key} was not loaded"
    assert tuned["head.1.weight"].shape == (5, loaded["head.1.weight"].shape[1])
    for key in head:
        assert torch.equal(tuned[key], fresh[key]), f"{key} is not a fresh head"
    assert ("re-initialised the head for 5 classes: head.1.weight [5, 128], head.1.bias [5]"
            in result.stdout)


def is_channels_last(tensor: torch.Tensor) -> bool:
    # Both checks: a tensor whose layout fits either format would prove nothing.
    return (tensor.is_contiguous(memory_format=torch.channels_last)
            and not tensor.is_contiguous())


def test_channels_last_reaches_every_convolution_in_training(composed, tmp_path, monkeypatch):
    """In-process, because labrun records the memory format nowhere: hooks on the real model's
    convolutions look at the weights and inputs of the training steps."""
    from labrun import models
    from labrun.train import job as run

    seen = []
    real_build = models.build

    def record(module, inputs):
        if module.training:
            seen.append((module.name, is_channels_last(module.weight),
                         is_channels_last(inputs[0])))

    def build_with_hooks(*args, **kwargs):
        model = real_build(*args, **kwargs)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Conv2d):
                module.name = name
                module.register_forward_pre_hook(record)
        return model

    monkeypatch.setattr(models, "build", build_with_hooks)
    cfg = composed("trainer.channels_last=true", "trainer.max_epochs=1", "logger=none",
                   "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                   "dataset.num_workers=0", "trainer.progress=none")
    run.train(cfg)
    assert read_summary(tmp_path / "run")["status"] == "completed"
    assert len(seen) == 2 * 3  # two steps through three convolutions
    for name, weight, inputs in seen:
        assert weight and inputs, f"{name}: weight channels_last {weight}, input {inputs}"


# A guard against a hung run, not a speed check: the first compile of the forward and backward
# graphs builds about a dozen C++ files with g++, which took 6 minutes on the loaded 2-core
# test machine (a minute or two unloaded); 20 minutes leaves room for a slower day.
COMPILE_TIMEOUT_S = 1200


def test_compile_runs_the_model_through_inductor(tmp_path):
    """torch.compile on the CPU generates C++ and builds it: without a compiler it cannot run.
    Inductor writes the code it generates under TORCHINDUCTOR_CACHE_DIR; a run that did not
    compile leaves that folder empty."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++), and there is none")
    cache = tmp_path / "inductor"
    run_train("trainer.compile=true", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
              "trainer.limit_val_batches=1", run_dir=tmp_path / "run",
              env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=COMPILE_TIMEOUT_S)
    assert read_summary(tmp_path / "run")["status"] == "completed"
    generated = list(cache.rglob("*.py")) + list(cache.rglob("*.cpp"))
    assert generated, f"nothing compiled: {cache} holds no generated code"
    # The checkpoint holds the plain model's weights, not the compiled wrapper's.
    state = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
