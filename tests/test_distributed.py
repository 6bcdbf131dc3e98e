"""`python train.py trainer.devices=2`: two local processes (DDP with gloo on the CPU, started the
way torchrun does) train one run. Every rank leaves its own record, ranks/rank-N.json, so the
tests see that both processes trained, not only that the run completed: rank 0 alone writes
metrics.jsonl, summary.json and the checkpoints, and would write the same files if rank 1 had
never taken a step.

The result is the one a single process gets with the same global batch (trainer.batch_size is
global: each of N ranks takes batch_size/N samples of every step, rank r every N-th sample of
the step's share of the shuffled order, so the two ranks of a step see exactly the samples one
process would). A Ctrl-C interrupts a 2-process run with a checkpoint, and `labrun resume`
finishes it bit-identical to an uninterrupted 2-process run.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from conftest import (
    DDP_LOSS_TOLERANCE,
    DDP_SHORT,
    DDP_WEIGHT_TOLERANCE,
    FAST,
    PROJECT,
    PYTHON,
    even_labels_env,
    even_labels_task,
    final_weights,
    max_difference,
    rank_records,
    read_counts,
    read_metrics,
    read_summary,
    run_labrun,
    run_train,
    wait_for,
)


def assert_both_ranks_trained(records: list[dict], steps: int, status: str = "completed",
                              resumed_from: int = 0) -> None:
    """Two records from two distinct processes of one world of 2, each of which took the
    `steps` optimizer steps of the segment itself."""
    assert len(records) == 2, f"{len(records)} rank records: {records}"
    assert [r["rank"] for r in records] == [0, 1]
    assert sorted(r["local_rank"] for r in records) == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert len({r["pid"] for r in records}) == 2, "both records come from one process"
    assert len({r["host"] for r in records}) == 1  # both on this machine
    assert steps > 0
    for record in records:
        assert record["optimizer_steps"] == steps, record
        assert record["resumed_from_step"] == resumed_from, record
        assert record["step"] == resumed_from + steps, record
        assert record["status"] == status, record


def test_two_local_processes_train_one_run(tmp_path, ddp_short_one_process):
    two, one = tmp_path / "two", ddp_short_one_process
    run_train("trainer.devices=2", *DDP_SHORT, run_dir=two)
    summary = read_summary(two)
    assert summary["status"] == "completed" and summary["step"] == 8
    steps = [p["step"] for p in read_metrics(two) if "train/loss" in p]
    assert steps == sorted(set(steps)), "a rank other than 0 wrote metrics too"
    assert not (two / "errors").exists()
    records = rank_records(two)
    assert_both_ranks_trained(records, steps=8)
    assert os.getpid() not in {r["pid"] for r in records}  # sanity: not this test's process

    # The same global batch in one process: the same result, up to the order of float sums.
    assert [r["world_size"] for r in rank_records(one)] == [1]
    difference = max_difference(final_weights(two), final_weights(one))
    print(f"devices=2 vs devices=1: weights differ by at most {difference:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE
    loss_two, loss_one = summary["val/loss"], read_summary(one)["val/loss"]
    assert abs(loss_two - loss_one) <= DDP_LOSS_TOLERANCE, (loss_two, loss_one)


def test_a_language_model_in_two_processes_equals_one(tmp_path):
    """task=lm's count is a tensor of scored tokens, summed across the ranks on the device:
    two processes of 8 windows each step end where one process of 16 does."""
    lm = ["dataset=python_docs", f"paths.processed_dir={tmp_path / 'processed'}",
          "dataset.block_size=32", "model=gpt", "model.n_layer=1", "model.n_head=2",
          "model.n_embd=32", "task=lm", "trainer.max_steps=8", "trainer.val_every_n_steps=8",
          "trainer.batch_size=16", "trainer.limit_val_batches=4", "trainer.log_every_n_steps=4"]
    run_train("trainer.devices=2", *lm, run_dir=tmp_path / "two")
    run_train("trainer.devices=1", *lm, run_dir=tmp_path / "one",
              env={"OMP_NUM_THREADS": "1"})
    assert_both_ranks_trained(rank_records(tmp_path / "two"), steps=8)
    difference = max_difference(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    print(f"LM, devices=2 vs devices=1: weights differ by at most {difference:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE
    loss_two, loss_one = (read_summary(tmp_path / d)["val/loss"] for d in ("two", "one"))
    assert abs(loss_two - loss_one) <= DDP_LOSS_TOLERANCE, (loss_two, loss_one)


def test_micro_batches_and_ranks_holding_different_numbers_of_items_equal_one_batch(tmp_path):
    """4 micro-batches on 2 ranks, each holding its own number of items (EvenLabels ignores odd
    labels): every rank divides by the items of the whole step, summed across the ranks, so
    the result is one process's with the step's 64 samples in one batch."""
    lab = even_labels_task(tmp_path / "lab")
    common = [*DDP_SHORT, "task._target_=labtask.EvenLabels"]
    run_train("trainer.devices=2", "trainer.micro_batch_size=16", *common,
              run_dir=tmp_path / "two", env=even_labels_env(lab, tmp_path / "two.counts"))
    run_train("trainer.devices=1", *common, run_dir=tmp_path / "one",
              env={**even_labels_env(lab, tmp_path / "one.counts"), "OMP_NUM_THREADS": "1"})
    assert_both_ranks_trained(rank_records(tmp_path / "two"), steps=8)
    difference = max_difference(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    assert difference <= DDP_WEIGHT_TOLERANCE, difference
    # The same items in all, in micro-batches of 16 that held different numbers of them.
    two, one = read_counts(tmp_path / "two.counts"), read_counts(tmp_path / "one.counts")
    assert len(two) == 8 * 4 and len(one) == 8 and sum(two) == sum(one)
    assert len(set(two)) > 1, two


# Four micro-batches of a language model's windows, each padded differently (targets of
# LanguageModelling.IGNORE are not scored): 2 per rank on two ranks.
GRAD_VOCAB, GRAD_WINDOW = 40, 8


def padded_micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    from labrun.train.task import LanguageModelling

    generator = torch.Generator().manual_seed(0)
    batches = []
    for padding in ((0, 0, 1, 2), (5, 7, 6, 0), (1, 1, 1, 1), (7, 3, 2, 7)):
        tokens = torch.randint(GRAD_VOCAB, (len(padding), GRAD_WINDOW + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        for row, pad in enumerate(padding):
            targets[row, GRAD_WINDOW - pad:] = LanguageModelling.IGNORE
        batches.append((inputs, targets))
    return batches


def float64_gpt() -> torch.nn.Module:
    from labrun.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=GRAD_VOCAB, block_size=GRAD_WINDOW, n_layer=1, n_head=2,
               n_embd=16).double()


def rank_gradient(rank: int, init_file: str, out: str) -> None:
    """One of two gloo ranks: the Trainer's own backward over this rank's two micro-batches
    (the Trainer's attributes it reads, and nothing else, around a float64 model)."""
    import contextlib
    import functools
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from labrun.train.task import LanguageModelling
    from labrun.train.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = float64_gpt()
        trainer = SimpleNamespace(
            task=LanguageModelling(), device=torch.device("cpu"),
            dist=SimpleNamespace(enabled=True, world_size=2, rank=rank),
            net=DistributedDataParallel(model), autocast=contextlib.nullcontext,
            scaler=torch.amp.GradScaler("cpu", enabled=False))
        trainer.per_rank_items = functools.partial(Trainer.per_rank_items, trainer)
        step_loss, _ = Trainer.backward(trainer, padded_micro_batches()[2 * rank:2 * rank + 2])
        torch.save({"loss": step_loss, "grads": {name: p.grad for name, p in
                                                 model.named_parameters()}}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_padded_micro_batches_on_two_ranks_give_one_batchs_gradient_in_float64(tmp_path):
    """The accumulation rule itself, in float64 where rounding cannot hide a wrong divisor: 4
    micro-batches holding 29, 14, 28 and 13 scored tokens, 2 on each of two DDP ranks, leave
    every rank with the gradient of one batch of all 84 tokens."""
    import torch.multiprocessing as mp

    from labrun.train.task import LanguageModelling

    out = str(tmp_path / "gradient")
    mp.spawn(rank_gradient, args=(str(tmp_path / "init"), out), nprocs=2)
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]

    micro_batches = padded_micro_batches()
    counts = [int((targets != LanguageModelling.IGNORE).sum()) for _, targets in micro_batches]
    assert counts == [29, 14, 28, 13]  # rank 0: 43 tokens, rank 1: 41
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches, strict=True))
    model = float64_gpt()
    loss = LanguageModelling().loss(model, (inputs, targets)) / sum(counts)
    loss.backward()
    for rank in ranks:
        # The step's loss is for logs, kept in float32 whatever the model's type.
        torch.testing.assert_close(rank["loss"].double(), loss.detach(), rtol=1e-6, atol=0)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(rank["grads"][name], parameter.grad, rtol=1e-9,
                                       atol=1e-15, msg=name)

    # Averaging each micro-batch over its own tokens, then over the micro-batches, would give
    # another gradient, far beyond the tolerance above.
    model.zero_grad()
    sum(LanguageModelling().loss(model, batch) / count / len(counts)
        for batch, count in zip(micro_batches, counts, strict=True)).backward()
    averaged = dict(model.named_parameters())["token_embedding.weight"].grad
    assert (averaged - ranks[0]["grads"]["token_embedding.weight"]).abs().max() > 1e-4


def test_frozen_layers_stay_out_of_ddps_reduction_and_groups_keep_their_rates(tmp_path):
    """model.freeze in two processes: DDP reduces only the parameters that train (freezing after
    DDP wrapped the model would leave it waiting for gradients that never come), the frozen
    ones stay bit-identical from step to step, the others move, at their group's rate."""
    run_train("trainer.devices=2", "dataset=synthetic", "dataset.num_train=128",
              "dataset.num_val=32", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
              "trainer.batch_size=32", "checkpoint.every_n_steps=1", "checkpoint.keep_last=5",
              "model.freeze=[features.0.*]", "optimizer.groups=[{params: 'head.*', lr_mult: 10}]",
              run_dir=tmp_path / "run")
    assert_both_ranks_trained(rank_records(tmp_path / "run"), steps=2)
    first, last = (torch.load(tmp_path / f"run/checkpoints/step-{s:08d}.pt", weights_only=True)
                   for s in (1, 2))
    frozen = ["features.0.0.weight", "features.0.0.bias"]
    for key in first["model"]:
        same = torch.equal(first["model"][key], last["model"][key])
        assert same == (key in frozen), f"{key}: {'unchanged' if same else 'moved'}"
    groups = last["optimizer"]["param_groups"]
    assert [len(g["params"]) for g in groups] == [4, 2]  # features.1-2 at lr, head.1 at 10 lr
    assert groups[1]["initial_lr"] == pytest.approx(10 * groups[0]["initial_lr"])


def test_a_user_error_in_two_local_processes_is_one_line(tmp_path):
    result = run_train("trainer.devices=2", "dataset=synthetic", "dataset.num_train=4",
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert "fewer than one optimizer step" in lines[-1] and "Traceback" not in result.stderr


# Two epochs of 12 steps, a checkpoint every 5: the Ctrl-C comes right after step 5, with 19
# steps still to go (an all-reduce each), seconds of training however fast the machine is.
RESUMABLE = ["trainer.devices=2", "trainer.max_epochs=2", "trainer.limit_train_batches=12",
             "trainer.deterministic=true", "checkpoint.every_n_steps=5",
             "trainer.limit_val_batches=2", "model.dropout=0"]
TOTAL_STEPS = 24
# Generous: a 2-process run of 24 steps takes a minute or two when other tests load the 2 cores;
# the limits only stop a hung run from blocking the suite.
RUN_TIMEOUT = 900


def test_ctrl_c_stops_two_processes_and_resume_finishes_identically(tmp_path):
    reference = tmp_path / "reference"
    run_train(*RESUMABLE, run_dir=reference, timeout=RUN_TIMEOUT)
    assert_both_ranks_trained(rank_records(reference), steps=TOTAL_STEPS)

    run_dir = tmp_path / "run"
    # Its own session, so that the Ctrl-C reaches the launcher and both workers, as a terminal's
    # does (the whole foreground process group), and not this test.
    proc = subprocess.Popen([PYTHON, str(PROJECT / "train.py"), *FAST, *RESUMABLE,
                             f"hydra.run.dir={run_dir}"], cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Start-up of two processes plus 5 steps, on a loaded machine: minutes, not seconds.
        wait_for(run_dir / "checkpoints" / "step-00000005.pt", proc, timeout=RUN_TIMEOUT)
        os.killpg(proc.pid, signal.SIGINT)
        # Both ranks stop at the next step boundary; 300 s only stops a hang.
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = read_summary(run_dir)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].endswith(f"resume with: labrun resume {run_dir}")
    assert summary["status"] == "interrupted" and 5 <= summary["step"] < TOTAL_STEPS
    stopped_at = summary["step"]
    first = rank_records(run_dir)
    assert_both_ranks_trained(first, steps=stopped_at, status="interrupted")
    # The checkpoint of the step where both ranks stopped, which the resume starts from.
    assert (run_dir / "checkpoints" / f"step-{stopped_at:08d}.pt").exists()

    result = run_labrun("resume", str(run_dir), timeout=RUN_TIMEOUT)
    assert f"(step {stopped_at})" in result.stdout, result.stdout[-2000:]  # "resuming from"
    assert read_summary(run_dir)["status"] == "completed"
    again = rank_records(run_dir)
    # Both ranks ran again, as new processes, from the checkpoint to the end.
    assert_both_ranks_trained(again, steps=TOTAL_STEPS - stopped_at, resumed_from=stopped_at)
    assert not {r["pid"] for r in first} & {r["pid"] for r in again}

    # gloo adds the two ranks' gradients in a fixed order: the resumed run is bit-identical.
    resumed, uninterrupted = final_weights(run_dir), final_weights(reference)
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), f"{key} differs"
