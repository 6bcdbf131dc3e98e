"""`labrun gc SWEEP_DIR`: a finished sweep's checkpoint budget, applied on disk. A dry run
changes nothing; the real one frees what it said, the jobs outside --keep-best lose their
checkpoints (not their metrics), the best job still exports, compare and rerun still read
every job, and a second run frees nothing.
(checkpoint.on_finish in a sweep and in an interrupted run: tests/test_cluster_local.py,
tests/test_resume.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, LABRUN, PROJECT, PYTHON, manifest, read_summary, run_labrun

# Two jobs that keep every checkpoint (on_finish=all, a step file every 2 steps): the lowest
# learning rate barely trains, so the two end with different val/acc.
SWEEP = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
         "checkpoint.every_n_steps=2", "checkpoint.on_finish=all",
         "optimizer.lr=0.003,0.000001"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gc") / "sweep"
    result = subprocess.run([PYTHON, "train.py", "-m", *FAST, *SWEEP,
                             f"hydra.sweep.dir={folder}"], cwd=PROJECT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file()}


def disk_bytes(sweep_dir: Path) -> int:
    out = run_labrun("status", str(sweep_dir), "--json").stdout
    import json

    return json.loads(out)["disk_bytes"]


def test_gc_dry_run_then_for_real_keeps_the_best_job_and_frees_what_it_said(sweep_dir, tmp_path):
    jobs = {row["num"]: Path(row["dir"]) for row in manifest(sweep_dir)["jobs"]}
    overrides = {row["num"]: row["overrides"] for row in manifest(sweep_dir)["jobs"]}
    metric = {num: read_summary(folder)["best/val/acc"] for num, folder in jobs.items()}
    assert metric[0] != metric[1], f"the two jobs tie ({metric}): pick other learning rates"
    best, worse = sorted(jobs, key=lambda num: -metric[num])
    assert len(list((jobs[worse] / "checkpoints").glob("step-*.pt"))) >= 2  # on_finish=all

    status = run_labrun("status", str(sweep_dir)).stdout
    assert re.search(r"disk: [\d.]+ [kM]B, of which checkpoints [\d.]+ [kM]B", status), status
    before, disk_before = files(sweep_dir), disk_bytes(sweep_dir)
    dry = run_labrun("gc", str(sweep_dir), "--keep-best", "1", "--dry-run").stdout
    assert files(sweep_dir) == before, "a dry run removed something"
    would = sorted(Path(p) for p in re.findall(r"^would remove (\S+) ", dry, re.M))
    assert would == sorted((jobs[worse] / "checkpoints").iterdir()), dry

    real = run_labrun("gc", str(sweep_dir), "--keep-best", "1").stdout
    assert sorted(Path(p) for p in re.findall(r"^removed (\S+) ", real, re.M)) == would
    assert not list((jobs[worse] / "checkpoints").iterdir())
    # Its record stays: summary, metrics and config, so compare and rerun still work.
    for name in ("summary.json", "metrics.jsonl", ".hydra/config.yaml"):
        assert (jobs[worse] / name).is_file()
    assert files(sweep_dir / str(best)) == {k.split("/", 1)[1]: v for k, v in before.items()
                                           if k.startswith(f"{best}/")}
    # The bytes it reports freed are what the folder lost (hard links counted once).
    freed = re.search(r"^freed ([\d.]+) (bytes|kB|MB)", real, re.M)
    scale = {"bytes": 1, "kB": 1e3, "MB": 1e6}[freed.group(2)]
    assert abs(disk_before - disk_bytes(sweep_dir) - float(freed.group(1)) * scale) <= scale * 0.1

    run_labrun("export", str(jobs[best]), "--format", "torchscript",
               "--out", str(tmp_path / "best.pt"))
    assert (tmp_path / "best.pt").stat().st_size > 0
    compare = run_labrun("compare", str(sweep_dir)).stdout
    assert f"{metric[worse]:.4f}" in compare
    lr = next(o for o in overrides[worse] if o.startswith("optimizer.lr="))
    rerun = run_labrun("rerun", str(jobs[worse])).stdout  # the command, not run
    assert "train.py" in rerun and lr in rerun, rerun

    again = run_labrun("gc", str(sweep_dir), "--keep-best", "1").stdout
    assert f"freed 0 bytes in 0 files of {sweep_dir}" in again


def test_gc_of_a_folder_that_is_no_sweep_is_one_line(tmp_path):
    result = subprocess.run([LABRUN, "gc", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path} is not a labrun sweep folder (no " \
                                    f"jobs.json)"
