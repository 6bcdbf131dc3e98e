"""Where settings come from besides the command line: the environment variables
LABRUN_DATA_DIR / LABRUN_OUTPUT_ROOT (conf/paths/default.yaml) and the optional, untracked
conf/local/default.yaml (conf/train.yaml's defaults list), as the README describes them; and a
run tagged with a new top-level key (`+tag=x`) that is resumed and rerun.

Composition claims are checked in-process (compose, as tests/test_config.py does); where a run
folder lands, and resume and rerun, with the real train.py and labrun commands. The per-user
file is written into a temporary config dir, never into this checkout's conf/.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from conftest import LABRUN, PROJECT, PYTHON, read_summary, run_labrun, run_train
from labrun.cli.hydra_app import user_error_message
from labrun.config import schema as config
from labrun.core.project import LABRUN_CONF

CONF = LABRUN_CONF
ENV_KEYS = ("LABRUN_DATA_DIR", "LABRUN_OUTPUT_ROOT")
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]


@pytest.fixture(autouse=True)
def hydra_conf(monkeypatch):
    # The defaults must not depend on what the shell running the tests has set.
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def composed(*overrides: str):
    """The config `python train.py OVERRIDES` runs with, Hydra's own part (run folder) included;
    paths.run_dir, which only a running job can resolve, is given."""
    return compose("train", overrides=["paths.run_dir=/tmp/x", *overrides],
                   return_hydra_config=True)


# ---------------------------------------------------------------------------------------------
# Environment variables


def test_data_dir_variable_moves_every_data_path(monkeypatch, tmp_path):
    default = composed("dataset=cifar10")
    assert (default.paths.data_dir, default.paths.raw_dir, default.dataset.root) == \
        ("data", "data/raw", "data/raw/cifar10")

    data = tmp_path / "shared-data"
    monkeypatch.setenv("LABRUN_DATA_DIR", str(data))
    cfg = composed("dataset=cifar10")
    assert cfg.paths.data_dir == str(data)
    assert cfg.paths.raw_dir == f"{data}/raw" and cfg.paths.processed_dir == f"{data}/processed"
    assert cfg.dataset.root == f"{data}/raw/cifar10"  # where CIFAR-10 is downloaded
    assert cfg.paths.output_root == "outputs"  # results stay where they were


def test_output_root_variable_moves_the_run_folder(monkeypatch, tmp_path):
    assert composed().hydra.run.dir.startswith("outputs/")
    monkeypatch.setenv("LABRUN_OUTPUT_ROOT", str(tmp_path / "results"))
    cfg = composed()
    assert cfg.paths.output_root == str(tmp_path / "results")
    assert cfg.hydra.run.dir.startswith(f"{tmp_path}/results/")
    assert cfg.paths.data_dir == "data"  # the other paths stay


def test_a_run_lands_under_output_root_then_resumes_and_reruns_with_its_tag(tmp_path):
    """One real run with LABRUN_OUTPUT_ROOT and no hydra.run.dir, tagged with a new top-level
    key; `labrun resume` continues it and `labrun rerun --exec` repeats it, both keeping the tag
    (the root takes new keys, sections do not: labrun.config.schema.NewKeys)."""
    first_root, rerun_root = tmp_path / "results", tmp_path / "rerun-results"
    run_train(*SHORT, "+tag=smoke", env={"LABRUN_OUTPUT_ROOT": str(first_root)})
    runs = list(first_root.glob("*/*"))  # DATE/TIME-TOKEN
    assert len(runs) == 1, runs
    run_dir = runs[0]
    assert read_summary(run_dir)["status"] == "completed"
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert saved["tag"] == "smoke"
    first_step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]

    resumed = run_labrun("resume", str(run_dir), "trainer.max_epochs=2")
    assert f"resuming from {run_dir}/checkpoints/" in resumed.stdout, resumed.stdout
    assert f"(step {first_step})" in resumed.stdout
    assert "+tag=smoke" in resumed.stdout  # the command it ran
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] == 2 and state["step"] > first_step

    rerun = subprocess.run([LABRUN, "rerun", str(run_dir), "--exec"], cwd=PROJECT,
                           capture_output=True, text=True, timeout=300,  # a 2-step run, slowly
                           env={**os.environ, "LABRUN_OUTPUT_ROOT": str(rerun_root)})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    reruns = list(rerun_root.glob("*/*"))
    assert len(reruns) == 1, reruns
    assert yaml.safe_load((reruns[0] / ".hydra" / "config.yaml").read_text())["tag"] == "smoke"
    assert read_summary(reruns[0])["status"] == "completed"


# ---------------------------------------------------------------------------------------------
# conf/local/default.yaml: `optional local@_global_: default` in conf/train.yaml, so the file
# is written the obvious way, without a package header (with `optional local: default` its keys
# landed under `local.` and were refused).


LOCAL = """\
paths:
  data_dir: {data}
trainer:
  max_epochs: 2
"""


@pytest.fixture
def local_dir(tmp_path):
    """A config dir holding only local/default.yaml, searched after conf/ as `--config-dir`
    would add it (the checkout's own conf/local/ is one person's and untouched)."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text(LOCAL.format(data=tmp_path / "my-data"))
    return tmp_path


def with_local(local_dir, *overrides: str):
    return composed(f"hydra.searchpath=[file://{local_dir}]", *overrides)


def test_local_file_overrides_the_defaults(local_dir):
    without = composed()
    cfg = with_local(local_dir)
    assert cfg.hydra.runtime.choices["local@_global_"] == "default"
    assert without.trainer.max_epochs != 2 and cfg.trainer.max_epochs == 2
    assert cfg.paths.data_dir == str(local_dir / "my-data")
    assert cfg.paths.raw_dir == f"{local_dir}/my-data/raw"  # derived paths follow


def test_command_line_beats_local_file_which_beats_the_environment(local_dir, monkeypatch):
    monkeypatch.setenv("LABRUN_DATA_DIR", "/from/the/environment")
    cfg = with_local(local_dir, "trainer.max_epochs=5")
    assert cfg.trainer.max_epochs == 5
    assert cfg.paths.data_dir == str(local_dir / "my-data")  # written down: the variable unread


def test_a_mistake_in_the_local_file_is_one_line_naming_the_key(local_dir):
    (local_dir / "local" / "default.yaml").write_text(
        "trainer:\n  max_epoch: 2\n")
    with pytest.raises(Exception) as caught:
        with_local(local_dir)
    message = user_error_message(caught.value)
    assert message is not None and "\n" not in message, repr(caught.value)
    assert "trainer.max_epoch" in message and "did you mean trainer.max_epochs" in message


def test_train_py_reads_local_file_from_config_dir(local_dir):
    """The real command line: `--config-dir` adds the folder to the search path."""
    job = subprocess.run([PYTHON, "train.py", "--config-dir", str(local_dir), "--cfg", "job"],
                         cwd=PROJECT, capture_output=True, text=True, check=True,
                         timeout=120).stdout  # composing only; generous for a loaded machine
    cfg = OmegaConf.create(job)
    assert cfg.trainer.max_epochs == 2 and cfg.paths.data_dir == str(local_dir / "my-data")
