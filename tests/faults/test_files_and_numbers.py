"""Broken checkpoints, a full disk, non-finite losses, hostile checkpoints and secrets."""

from __future__ import annotations

import json
import os

import torch

from conftest import read_summary, run_train

SHORT = ["trainer.max_epochs=2", "trainer.limit_train_batches=6", "checkpoint.every_n_steps=2",
         "trainer.deterministic=true"]


def test_truncated_newest_checkpoint_is_named_and_skipped(tmp_path, fault):
    record = fault("truncated / corrupt newest checkpoint")
    run_dir = tmp_path / "run"
    run_train(*SHORT, run_dir=run_dir)
    newest = run_dir / "checkpoints" / "step-00000012.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # last.pt is the same file
    result = run_train(*SHORT, "trainer.max_epochs=3", run_dir=run_dir)
    used = "resuming from" in result.stdout and "step-00000010.pt" in result.stdout
    named = "step-00000012.pt" in result.stderr or "last.pt" in result.stderr
    record.trial(used and named, note=f"newest truncated: named={named}, resumed from the "
                                      f"previous one={used}")
    assert used and named and read_summary(run_dir)["status"] == "completed"

    for path in (run_dir / "checkpoints").glob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    result = run_train(*SHORT, "trainer.max_epochs=4", run_dir=run_dir, check=False)
    last_line = result.stderr.strip().splitlines()[-1]
    clear = result.returncode == 2 and "checkpoint.resume=never" in last_line
    record.trial(clear, note=f"all corrupt: exit {result.returncode}, says: {last_line}")
    assert clear and "Traceback" not in result.stderr


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


def test_disk_full_while_saving(tmp_path, fault):
    """ENOSPC from the checkpoint writer (injected through sitecustomize on PYTHONPATH)."""
    record = fault("disk full while saving")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(DISK_FULL)
    run_dir = tmp_path / "run"
    result = run_train(*SHORT, run_dir=run_dir, check=False,
                       env={"PYTHONPATH": str(inject), "LABRUN_TEST_ENOSPC_AT": "3"})
    summary = read_summary(run_dir)
    intact = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    survived = (result.returncode == 2 and summary["status"] == "failed"
                and "No space left on device" in summary["error"] and intact == 4)
    record.trial(survived, lost=intact != 4,
                 note=f"ENOSPC on the 3rd save: exit {result.returncode}, summary error "
                      f"'{summary['error']}', last good checkpoint step {intact}")
    assert survived
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_non_finite_loss(tmp_path, fault):
    record = fault("loss becomes NaN/Inf")
    stop = run_train("trainer.max_epochs=1", "optimizer.lr=1e30", "optimizer=sgd",
                     run_dir=tmp_path / "stop", check=False)
    summary = read_summary(tmp_path / "stop")
    stopped = (stop.returncode == 2 and summary["status"] == "failed"
               and "loss became" in summary["error"] and "at step" in summary["error"])
    record.trial(stopped, note=f"nan_policy=stop: {summary['error']}")
    assert stopped

    skip = run_train("trainer.max_epochs=1", "optimizer.lr=1e30", "optimizer=sgd",
                     "trainer.nan_policy=skip", run_dir=tmp_path / "skip")
    skipped = "step skipped" in skip.stdout
    record.trial(skipped and read_summary(tmp_path / "skip")["status"] == "completed",
                 note="nan_policy=skip: non-finite steps skipped, the run completed")
    assert skipped

    scaled = run_train("trainer.max_epochs=1", "optimizer.lr=1e30", "optimizer=sgd",
                       "precision=fp16", run_dir=tmp_path / "fp16", check=False)
    if "running bf16 instead" not in scaled.stderr:
        state = torch.load(tmp_path / "fp16" / "checkpoints" / "last.pt", weights_only=True)
        ok = read_summary(tmp_path / "fp16")["status"] == "completed" and \
            state["scaler"]["scale"] < 65536.0
        record.trial(ok, note=f"fp16: GradScaler skipped the steps, scale now "
                              f"{state['scaler']['scale']:g}")
        assert ok


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/labrun-fault-pwned",))


def test_a_checkpoint_that_runs_code_is_refused_by_resume(tmp_path, fault):
    record = fault("checkpoint that runs code on load")
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCode()}, evil)
    result = run_train(f"checkpoint.resume={evil}", run_dir=tmp_path / "run", check=False)
    refused = (result.returncode == 2 and "weights_only" in result.stderr
               and not os.path.exists("/tmp/labrun-fault-pwned"))
    record.trial(refused, note=f"resume: exit {result.returncode}: "
                               f"{result.stderr.strip().splitlines()[-1]}")
    assert refused


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
    record.trial(not leaked, lost=False,
                 note=f"3 secrets in the environment; found in: {leaked or 'nothing'}")
    assert not leaked
    command = json.loads((run_dir / "provenance" / "command.json").read_text())
    assert command["overrides"]  # provenance was written, just without the secrets

