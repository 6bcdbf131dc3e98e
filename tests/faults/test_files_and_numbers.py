"""Broken checkpoints, a full disk, non-finite losses, hostile checkpoints and secrets.

Each row's "data lost" comes from the shared checks in faults/conftest.py, run once the
resumed or retried run has ended: metrics.jsonl lines up to the resumed step against a run that
had no fault, the checkpoints keep_last should keep, and the files given to the run as input."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from conftest import final_weights, read_summary, run_train, same_weights
from faults.conftest import (
    checkpoints_lost,
    hash_inputs,
    inputs_changed,
    load_checkpoint,
    metrics_lost,
    saved_steps,
)
from labrun.train.precision import _cpu_autocast_supports

# Two epochs of 6 steps, a checkpoint every 2 steps and a metrics line every 2 steps (so that
# there are lines before each fault to compare).
SHORT = ["trainer.max_epochs=2", "trainer.limit_train_batches=6", "checkpoint.every_n_steps=2",
         "trainer.log_every_n_steps=2", "trainer.deterministic=true"]
EVERY_N, PER_EPOCH, KEEP_LAST = 2, 6, 3  # SHORT's schedule; keep_last is the default
RESUMED = re.compile(r"resuming from (\S+) \(step (\d+)\)")


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory):
    """An uninterrupted SHORT run: what a run that met a fault and was retried must match."""
    run_dir = tmp_path_factory.mktemp("short_reference") / "run"
    run_train(*SHORT, run_dir=run_dir)
    return run_dir


def test_truncated_newest_checkpoint_is_named_and_skipped(tmp_path, fault):
    record = fault("truncated / corrupt newest checkpoint")
    run_dir = tmp_path / "run"
    run_train(*SHORT, run_dir=run_dir)
    before = tmp_path / "before"  # the run's own metrics.jsonl before the fault
    before.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", before / "metrics.jsonl")
    newest = run_dir / "checkpoints" / "step-00000012.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # last.pt is the same file
    result = run_train(*SHORT, "trainer.max_epochs=3", run_dir=run_dir)
    resumed = RESUMED.search(result.stdout)
    used = resumed is not None and resumed.group(1).endswith("step-00000010.pt")
    named = "step-00000012.pt" in result.stderr or "last.pt" in result.stderr
    completed = read_summary(run_dir)["status"] == "completed"
    lost = ((metrics_lost(run_dir, before, int(resumed.group(2))) if resumed else
             ["did not resume"])
            + checkpoints_lost(run_dir, KEEP_LAST, saved_steps(EVERY_N, PER_EPOCH, 18)))
    record.trial(used and named and completed, lost=bool(lost),
                 note=f"newest truncated: named={named}, resumed from the previous one={used}, "
                      f"completed={completed}; lost: {'; '.join(lost) or 'nothing'}")
    assert used and named and completed and not lost

    # Every checkpoint unreadable: a clear refusal, and the refused run changes no file (the
    # broken checkpoints stay for inspection, metrics.jsonl is not cut back).
    for path in (run_dir / "checkpoints").glob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    inputs = [run_dir / "checkpoints", run_dir / "metrics.jsonl"]
    hashes = hash_inputs(inputs)
    result = run_train(*SHORT, "trainer.max_epochs=4", run_dir=run_dir, check=False)
    last_line = result.stderr.strip().splitlines()[-1]
    clear = (result.returncode == 2 and "checkpoint.resume=never" in last_line
             and "Traceback" not in result.stderr)
    changed = inputs_changed(hashes, inputs)
    record.trial(clear, lost=bool(changed),
                 note=f"all corrupt: exit {result.returncode}, says: {last_line}; files the "
                      f"refused run changed: {changed or 'none'}")
    assert clear and not changed


DISK_FULL = """
import errno, os, torch
real_save = torch.save
calls = {"n": 0}
def save(obj, f, *args, **kwargs):
    calls["n"] += 1
    if calls["n"] >= int(os.environ["LABRUN_TEST_ENOSPC_AT"]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(obj, f, *args, **kwargs)
torch.save = save
"""


def test_disk_full_while_saving(tmp_path, short_reference, fault):
    """ENOSPC from the checkpoint writer (injected through sitecustomize on PYTHONPATH), then
    the disk has room again and the run is retried."""
    record = fault("disk full while saving")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(DISK_FULL)
    run_dir = tmp_path / "run"
    result = run_train(*SHORT, run_dir=run_dir, check=False,
                       env={"PYTHONPATH": str(inject), "LABRUN_TEST_ENOSPC_AT": "3"})
    summary = read_summary(run_dir)
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").glob(".*.tmp"))
    failed_clearly = (result.returncode == 2 and summary["status"] == "failed"
                      and "No space left on device" in summary["error"] and not leftovers)
    # The two saves before the disk filled up (steps 2 and 4) must be intact.
    kept = checkpoints_lost(run_dir, KEEP_LAST, saved_steps(EVERY_N, PER_EPOCH, 4))

    retry = run_train(*SHORT, run_dir=run_dir, check=False)
    resumed = RESUMED.search(retry.stdout)
    completed = retry.returncode == 0 and read_summary(run_dir)["status"] == "completed"
    identical = completed and same_weights(final_weights(run_dir), final_weights(short_reference))
    lost = kept + ((metrics_lost(run_dir, short_reference, int(resumed.group(2))) if resumed
                    else ["did not resume"])
                   + checkpoints_lost(run_dir, KEEP_LAST, saved_steps(EVERY_N, PER_EPOCH, 12)))
    survived = failed_clearly and resumed is not None and identical
    record.trial(survived, lost=bool(lost),
                 note=f"ENOSPC on the 3rd save: exit {result.returncode}, summary error "
                      f"'{summary['error']}', temporary files left: {leftovers or 'none'}; "
                      f"retried: resumed from step {resumed.group(2) if resumed else 'nothing'}, "
                      f"torch.equal to an uninterrupted run={identical}; "
                      f"lost: {'; '.join(lost) or 'nothing'}")
    assert survived and not lost


# A learning rate that makes the loss non-finite at the second step: the first step's update
# (lr 1e30) sends the logits to infinity. A checkpoint after every step, so that there are
# checkpoints from before the fault that must survive it. Six steps and two validation batches
# are enough to see it (fp16 autocast on CPU is slow).
# Batches of 16: the loss explodes at the first steps whatever the batch, and fp16's CPU
# autocast takes several times as long as fp32 per image.
EXPLODE = ["trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=2",
           "optimizer.lr=1e30", "optimizer=sgd", "trainer.batch_size=16"]


def test_non_finite_loss_stops_and_keeps_the_good_checkpoints(tmp_path, fault):
    record = fault("loss becomes NaN/Inf")
    run_dir = tmp_path / "stop"
    result = run_train(*EXPLODE, "checkpoint.every_n_steps=1", run_dir=run_dir, check=False)
    error = read_summary(run_dir)["error"] or ""
    found = re.search(r"loss became \S+ at step (\d+) .*the last good checkpoint is (\S+);",
                      error)
    last_good = load_checkpoint(run_dir / "checkpoints" / "last.pt")[0]
    stopped = (result.returncode == 2 and read_summary(run_dir)["status"] == "failed"
               and found is not None and last_good is not None
               and found.group(2).endswith(f"step-{last_good['step']:08d}.pt"))
    bad_step = int(found.group(1)) if found else None
    saved = list(range(1, bad_step)) if bad_step else []  # every step before the bad one
    lost = checkpoints_lost(run_dir, KEEP_LAST, saved) if saved else None
    record.trial(stopped, lost=None if lost is None else bool(lost),
                 note=f"nan_policy=stop: {error}; "
                      + (f"lost: {'; '.join(lost) or 'nothing'}" if lost is not None else
                         "cannot tell: no checkpoint was saved before the non-finite step"))
    assert stopped and not lost


def test_non_finite_loss_skip_policy(tmp_path, fault):
    record = fault("loss becomes NaN/Inf")
    run_dir = tmp_path / "skip"
    result = run_train(*EXPLODE, "checkpoint.every_n_steps=1", "trainer.nan_policy=skip",
                       run_dir=run_dir)
    skipped = "step skipped" in result.stdout
    completed = read_summary(run_dir)["status"] == "completed"
    last = read_summary(run_dir)["step"]
    # Non-finite weights in a kept checkpoint would be a lost model: checkpoints_lost checks.
    lost = checkpoints_lost(run_dir, KEEP_LAST, saved_steps(1, last, last))
    record.trial(skipped and completed, lost=bool(lost),
                 note=f"nan_policy=skip: non-finite steps skipped={skipped}, completed="
                      f"{completed}; lost: {'; '.join(lost) or 'nothing'}")
    assert skipped and completed and not lost


def test_non_finite_loss_fp16_grad_scaler(tmp_path, fault):
    if not _cpu_autocast_supports(torch.float16):  # labrun's own probe before it falls back
        pytest.skip("CPU autocast cannot do float16 on this machine (labrun runs bf16 "
                    "instead), so fp16's GradScaler cannot be tested here")
    record = fault("loss becomes NaN/Inf")
    run_dir = tmp_path / "fp16"
    result = run_train(*EXPLODE, "precision=fp16", run_dir=run_dir, check=False)
    if "running bf16 instead" in result.stderr:
        pytest.skip("labrun fell back to bf16 (CPU autocast without float16)")
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    init_scale = state["config"]["precision"]["init_scale"]
    ok = (result.returncode == 0 and read_summary(run_dir)["status"] == "completed"
          and state["scaler"]["scale"] < init_scale)
    last = read_summary(run_dir)["step"]
    lost = checkpoints_lost(run_dir, KEEP_LAST, saved_steps(0, last, last))
    record.trial(ok, lost=bool(lost),
                 note=f"fp16: GradScaler skipped the steps, scale {init_scale:g} -> "
                      f"{state['scaler']['scale']:g}; lost: {'; '.join(lost) or 'nothing'}")
    assert ok and not lost


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_runs_code_is_refused_by_resume(tmp_path, fault):
    record = fault("checkpoint that runs code on load")
    evil, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"model": {}, "payload": RunsCode(marker)}, evil)
    hashes = hash_inputs([evil])
    result = run_train(f"checkpoint.resume={evil}", run_dir=tmp_path / "run", check=False)
    refused = (result.returncode == 2 and "weights_only" in result.stderr
               and not marker.exists())
    changed = inputs_changed(hashes, [evil])
    record.trial(refused, lost=bool(changed),
                 note=f"resume: exit {result.returncode}: "
                      f"{result.stderr.strip().splitlines()[-1]}; the given checkpoint "
                      f"{'changed: ' + str(changed) if changed else 'is unchanged'}")
    assert refused and not changed


def test_no_secret_reaches_the_run_folder_logs_or_wandb(tmp_path, fault):
    record = fault("secrets in provenance, logs, W&B config")
    secrets = {"WANDB_API_KEY": "wandbsecret0123456789", "HF_TOKEN": "hfsecret0123456789",
               "AWS_SECRET_ACCESS_KEY": "awssecret0123456789"}
    run_dir = tmp_path / "run"
    result = run_train("logger=wandb", "logger.mode=offline", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=2", run_dir=run_dir,
                       env={**secrets, "NETRC": "/nonexistent"})
    leaked = []
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaked += [f"{path.relative_to(run_dir)}" for s in secrets.values()
                       if s.encode() in data]
    leaked += [name for name, s in secrets.items() if s in result.stdout + result.stderr]
    record.trial(not leaked, lost=None,
                 note=f"3 secrets in the environment; found in: {leaked or 'nothing'} (data "
                      f"lost cannot tell: this fault is about leaks, no data is at stake)")
    assert not leaked
    command = json.loads((run_dir / "provenance" / "command.json").read_text())
    assert command["overrides"]  # provenance was written, just without the secrets
