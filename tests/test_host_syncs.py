"""The training loop does not wait for the device between log points.

On a GPU, `.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.cpu()`, `.numpy()`,
`.to("cpu")`, a tensor formatted into a string and `torch.cuda.synchronize()` make the host wait
until every queued kernel has run, so one per step keeps the GPU's queue empty. There is no GPU
here, so a callback counts those calls instead: it wraps them and counts the calls made from
labrun's own code (torch's optimizers read their CPU step counters with `.item()`, which costs
no wait, and are not counted; nor is labrun's data pipeline, which works on host tensors before
a batch moves to the device). Each optimizer step that is not a log point (nor a checkpoint,
nor an epoch's end) must make none: in fp32 and bf16, in one process and in two (DDP over gloo:
the ranks agree on stop signals every few steps, at log points here), with gradient clipping,
and in fp16, whose GradScaler checks for infinities with a sync of its own every step (the
precision's need, counted apart: torch's code, one a step at most).

A detector synchronises inside its own code, where no wrapped method sees it: torchvision's
FCOS matches boxes with boolean masks and reads its foreground count in training (and runs NMS
in evaluation), in ops whose output shape or value the host must read. For task=detection the callback also counts
those ops per step, at the dispatcher (a TorchDispatchMode over each step), by the first caller
outside torch: the figure every step pays on a GPU, stated as it is rather than hidden by a
counter that only sees labrun's frames.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_train

COUNTER = '''
import json, sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import labrun
from labrun.train.callbacks import Callback

LABRUN = str(Path(labrun.__file__).parent)
TORCH = str(Path(torch.__file__).parent) + "/"  # the slash: torchvision's folder is beside it
HERE = __file__
# Ops whose result the host must read on a GPU (CUDA's sync debug mode flags each): a scalar
# read, and outputs whose shape depends on the values (masks, nonzero, unique, NMS).
WAITING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive",
               "_unique2", "unique_dim", "repeat_interleave", "bincount", "is_nonzero",
               "equal", "nms"}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
# The data pipeline works on host tensors (the epoch's sample order, the uint8 batches) before
# a batch moves to the device: no call there waits for a GPU, whatever the run's device.
HOST_DATA = str(Path(labrun.__file__).parent / "data")
SCALER = str(Path(torch.__file__).parent / "amp" / "grad_scaler.py")
METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy",
           "__format__", "__repr__", "__str__")


class CountHostSyncs(Callback):
    """Counts per step: from the start of one Trainer.train_step to the start of the next, so
    that a step's count holds all its work (its log point, checkpoint and stop check too)."""

    def __init__(self, out, ops=False):
        self.out, self.step, self.calls, self.sites, self.per_step = out, 0, 0, {}, {}
        self.scaler_calls, self.scaler_per_step = 0, {}
        self.ops = CountWaitingOps() if ops else None  # per step: {caller: count}
        self.ops_per_step = {}

    def on_fit_start(self, trainer):
        for name in METHODS:
            setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        to = torch.Tensor.to

        def counted_to(tensor, *args, **kwargs):
            # "cpu" spelled out: a copy to the host (the trainer moves batches with its own
            # device, which on this CPU is the host too, and is no such copy on a GPU).
            if (args and args[0] == "cpu") or kwargs.get("device") == "cpu":
                self._count(sys._getframe(1))
            return to(tensor, *args, **kwargs)
        torch.Tensor.to = counted_to
        # No CUDA here: the call is counted, and does nothing.
        torch.cuda.synchronize = lambda *args, **kwargs: self._count(sys._getframe(1))
        train_step = trainer.train_step

        def counted_step(*args):
            self._close_step()
            self.step += 1
            if self.ops is None:
                return train_step(*args)
            with self.ops:
                return train_step(*args)
        trainer.train_step = counted_step

    def _close_step(self):
        if self.step:
            self.per_step[self.step] = self.calls
            self.scaler_per_step[self.step] = self.scaler_calls
            if self.ops is not None:
                self.ops_per_step[self.step] = dict(self.ops.found)
                self.ops.found.clear()
        self.calls = self.scaler_calls = 0

    def _count(self, caller):
        where = caller.f_code.co_filename
        if where.startswith(LABRUN) and not where.startswith(HOST_DATA):
            self.calls += 1
            self.sites.setdefault(self.step, []).append(f"{where}:{caller.f_lineno}")
        elif where == SCALER:
            self.scaler_calls += 1

    def _counting(self, method):
        def counted(tensor, *args, **kwargs):
            self._count(sys._getframe(1))
            return method(tensor, *args, **kwargs)
        return counted

    def on_fit_end(self, trainer, status):
        self._close_step()
        Path(f"{self.out}.rank{trainer.dist.rank}").write_text(json.dumps(
            {"per_step": self.per_step, "sites": self.sites, "status": status,
             "scaler_per_step": self.scaler_per_step, "ops_per_step": self.ops_per_step,
             "log_every": trainer.cfg.trainer.log_every_n_steps,
             "steps_per_epoch": trainer.steps_per_epoch,
             "compiler_imported": "torch._dynamo" in sys.modules}))


class CountWaitingOps(TorchDispatchMode):
    """Counts the ops in WAITING_OPS (and indexing by a boolean mask) by who called them: the
    first frame outside torch (and this file), as `train/...py:LINE` (labrun's) or
    `torchvision/...py:LINE`; or `backward` for the gradients' ops, which autograd's engine runs
    for the forward's own (the backward of a boolean index is indexed by that mask too)."""

    def __init__(self):
        super().__init__()
        self.found = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in WAITING_OPS or (name in BOOL_INDEXED and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple))
                          else ()))):
            frame, backward = sys._getframe(1), False
            while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                         or frame.f_code.co_filename == HERE):
                backward |= frame.f_code.co_filename.startswith(TORCH + "autograd/")
                frame = frame.f_back
            where = "?" if frame is None else frame.f_code.co_filename
            for root in (LABRUN, str(Path(TORCH).parent)):
                where = where.removeprefix(root.rstrip("/") + "/")
            site = (f"backward {name}" if backward
                    else f"{where}:{frame.f_lineno if frame else 0} {name}")
            self.found[site] = self.found.get(site, 0) + 1
        return func(*args, **(kwargs or {}))
'''

# 12 steps, a log point every 5: steps 1-4, 6-9 and 11 are between log points.
STEPS = ["trainer.max_epochs=1", "trainer.limit_train_batches=12", "trainer.log_every_n_steps=5",
         "trainer.limit_val_batches=1", "optimizer=sgd"]
CNN = ["model.dropout=0"]


# A tiny language model on CPython's docs (dataset=python_docs converts them into tmp_path).
LM = ["dataset=python_docs", "dataset.block_size=32", "model=gpt", "model.n_layer=1",
      "model.n_head=2", "model.n_embd=32", "task=lm", "trainer.batch_size=16"]


# A tiny U-Net on dataset=shapes (task=segmentation: a count of scored pixels, a confusion matrix).
SEGMENTATION = ["experiment=seg_shapes", "model.width=4", "model.depth=2", "trainer.batch_size=8"]


# One process in fp32 with gradient clipping, two (DDP) in bf16, and one in fp16 (GradScaler):
# between them the step's paths that could sync (the loss and its non-finite check, autocast,
# clipping's norm, the scaler, DDP's reduction), at a fraction of the cost of every pairing;
# and the language-modelling task's (a count of scored tokens, a loss over them), and
# segmentation's (a count of scored pixels).
@pytest.mark.parametrize(("devices", "precision", "extra"), [
    (1, "fp32", [*CNN, "trainer.grad_clip=1.0"]), (2, "bf16", CNN), (1, "fp16", CNN),
    (1, "fp32", LM), (1, "fp32", SEGMENTATION)],
    ids=["fp32-clip", "ddp-bf16", "fp16", "lm", "segmentation"])
def test_no_host_sync_between_log_points(tmp_path, precision, devices, extra):
    extra = [*extra, f"paths.processed_dir={tmp_path / 'processed'}"]
    (tmp_path / "synccount.py").write_text(COUNTER)
    out = tmp_path / "syncs.json"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run_train(*STEPS, *extra, f"precision={precision}", f"trainer.devices={devices}",
              "+callbacks.syncs._target_=synccount.CountHostSyncs", f"+callbacks.syncs.out={out}",
              run_dir=tmp_path / "run", env=env)
    for rank in range(devices):
        found = json.loads((tmp_path / f"syncs.json.rank{rank}").read_text())
        assert found["status"] == "completed"
        per_step = {int(step): calls for step, calls in found["per_step"].items()}
        assert sorted(per_step) == list(range(1, 13))
        between = {step: calls for step, calls in per_step.items()
                   if step % found["log_every"] and step % found["steps_per_epoch"]}
        assert sorted(between) == [1, 2, 3, 4, 6, 7, 8, 9, 11]
        syncing = {step: found["sites"].get(str(step)) for step, calls in between.items()
                   if calls}
        print(f"rank {rank}: host syncs per step {per_step}")
        assert not syncing, f"rank {rank}: host syncs between log points: {syncing}"
        # Nor did the run import torch's compiler, which it does not use (train/eager.py):
        # DDP's constructor alone imports it, to ask the compiler how it treats DDP.
        assert found["compiler_imported"] == (devices > 1)
        # The counter does see the syncs a log point makes (the logged train/loss), so a zero
        # above is the loop's, not a counter that counts nothing.
        assert per_step[5] >= 1
        # fp16's GradScaler: its own check for infinities, at most one a step (the precision's
        # need; labrun adds none around it). Without a scaler, none.
        scaler = {step: found["scaler_per_step"][str(step)] for step in between}
        print(f"rank {rank}: the scaler's own syncs per step {found['scaler_per_step']}")
        assert set(scaler.values()) == ({1} if precision == "fp16" else {0}), scaler


# task=detection: FCOS at 64 px on dataset=shapes_boxes, 12 steps of 8 images.
DETECTION = ["experiment=det_shapes", "dataset.image_size=64", "dataset.num_train=96",
             "dataset.num_val=8", "trainer.batch_size=8"]


def test_a_detectors_own_host_syncs_are_counted_and_labrun_adds_none(tmp_path):
    """labrun's frames make no host sync between log points, as for every task; the detector's
    own (torchvision's FCOS: its loss's box matching and foreground count) are counted at the
    dispatcher, every step, and all of them come from torchvision's code."""
    (tmp_path / "synccount.py").write_text(COUNTER)
    out = tmp_path / "syncs.json"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run_train(*STEPS, *DETECTION, "+callbacks.syncs._target_=synccount.CountHostSyncs",
              f"+callbacks.syncs.out={out}", "+callbacks.syncs.ops=true",
              run_dir=tmp_path / "run", env=env)
    found = json.loads((tmp_path / "syncs.json.rank0").read_text())
    assert found["status"] == "completed"
    between = [step for step in range(1, 13)
               if step % found["log_every"] and step % found["steps_per_epoch"]]
    sites = {step: found["sites"].get(str(step)) for step in between
             if found["per_step"][str(step)]}
    assert not sites, f"labrun's host syncs between log points: {sites}"
    ops = {step: found["ops_per_step"][str(step)] for step in between}
    print("waiting ops per step between log points, by caller:")
    for step, calls in ops.items():
        print(f"  step {step}: {sum(calls.values())}  {calls}")
    ours = {step: [site for site in calls if not site.startswith(("torchvision/", "backward "))]
            for step, calls in ops.items()}
    assert not any(ours.values()), f"waiting ops outside torchvision's code: {ours}"
    # The detector's own: every step waits on the host, some 4 times an image (its transform's
    # and its box matching's, fewer for an image with nothing to match) and 19 a batch (its
    # loss's masks and foreground count, 7 of them in the backward): 50 or 51 at 8 images.
    totals = [sum(calls.values()) for calls in ops.values()]
    assert min(totals) > 0, ops
