"""`labrun compare --exact A B`: two runs of the same job with the same seed are identical bit
for bit (logged rows, summary.json, every checkpoint), what measures time is left out and
named; another learning rate, one checkpoint value one ulp away and a checkpoint on one side
only are differences, named; a folder that is not a run is one line, exit 2."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_labrun, run_train
from labrun.views import exact

# The default job, tiny: 6 steps, validated (and checkpointed) at steps 3 and 6, so each run
# writes 3 logged rows and 4 checkpoint files (step-3, step-6, last, best). About 7 s a run.
TINY = ["trainer.max_steps=6", "trainer.val_every_n_steps=3", "trainer.limit_val_batches=2",
        "checkpoint.every_n_steps=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three tiny runs, trained once for the file: a and b the same job with the same seed, in
    two folders; lr the same job with another learning rate."""
    folder = tmp_path_factory.mktemp("exact")
    for name, extra in (("a", []), ("b", []), ("lr", ["optimizer.lr=0.01"])):
        run_train(*TINY, *extra, run_dir=folder / name)
    return {name: folder / name for name in ("a", "b", "lr")}


def compare_exact(a: Path, b: Path) -> tuple[int, list[str]]:
    result = run_labrun("compare", "--exact", str(a), str(b), check=False)
    assert result.stderr.strip() == "", result.stderr
    return result.returncode, result.stdout.strip().splitlines()


def test_the_same_job_twice_is_identical_and_what_measures_time_is_named(runs):
    code, lines = compare_exact(runs["a"], runs["b"])
    assert code == 0, "\n".join(lines)
    assert re.fullmatch(r"identical: 3 logged rows, 4 checkpoints \(\d+ tensors\), summary",
                        lines[-1]), lines[-1]
    left_out = "\n".join(line for line in lines if line.startswith("left out"))
    for key in ("time", "started_at", "ended_at", "perf/samples_per_s", "perf/data_wait_frac",
                "config[paths][run_dir]"):
        assert key in left_out, left_out


def test_another_learning_rate_is_different_and_the_keys_are_named(runs):
    code, lines = compare_exact(runs["a"], runs["lr"])
    assert code == 1
    assert lines[-1].startswith("DIFFERENT: ")
    # The first differences are the logged rows', in order: step 3's validation comes first.
    assert any(line.startswith("metrics.jsonl row 1 (step 3): val/loss ") for line in lines)
    assert any(line.startswith("summary.json: train/loss ") for line in lines)
    # Within a checkpoint the config comes first: the cause of the rest.
    assert any(line.startswith("checkpoints/best.pt: config[optimizer][lr]: ")
               and line.endswith(" vs 0.01") for line in lines), "\n".join(lines)


def test_one_value_of_one_tensor_one_ulp_away_and_a_missing_checkpoint(runs, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(runs["b"], copy)  # copies: last.pt is no longer a link to step-6 and best
    last = copy / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    name = next(iter(state["model"]))
    values = state["model"][name].view(-1)
    values[5] = torch.nextafter(values[5], torch.tensor(float("inf")))
    torch.save(state, last)
    (copy / "checkpoints" / "step-00000003.pt").unlink()

    code, lines = compare_exact(runs["a"], copy)
    assert code == 1
    found = [line for line in lines if line.startswith("checkpoints/")]
    assert len(found) == 2, "\n".join(lines)
    assert found[0].startswith(f"checkpoints/last.pt: model[{name}]: 1 of {values.numel()} "
                               f"values differ, first at "
                               f"{exact.position(5, state['model'][name].shape)}: ")
    assert found[1] == "checkpoints/step-00000003.pt: only in A"
    assert lines[-1].startswith("DIFFERENT: 2 differences")


@pytest.mark.parametrize("case", ["missing", "not a run", "three paths", "with --csv"])
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, case):
    args = {"missing": [tmp_path / "nowhere", runs["a"]],
            "not a run": [tmp_path, runs["a"]],
            "three paths": [runs["a"], runs["b"], runs["lr"]],
            "with --csv": [runs["a"], runs["b"], "--csv", tmp_path / "t.csv"]}[case]
    result = run_labrun("compare", "--exact", *map(str, args), check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    expected = {"missing": str(tmp_path / "nowhere"), "not a run": "not a run folder",
                "three paths": "exactly two", "with --csv": "--csv"}[case]
    assert expected in result.stderr


def test_bits_decide_nan_equals_nan_in_the_same_place_and_minus_zero_is_not_zero():
    nan = float("nan")
    assert exact.tensor_difference(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) is None
    assert exact.tensor_difference(torch.tensor([nan, 1.0]), torch.tensor([1.0, nan]))
    assert exact.tensor_difference(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert exact.tensor_difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64)) \
        == "dtype torch.float32 vs torch.float64"
    assert exact.value_difference(nan, nan) is None
    assert exact.value_difference(1, 1.0) == "1 vs 1.0"
