"""The config layers, each said once: labrun's defaults < the lab's (LABRUN_SITE) < the project's
(its conf/) < one person's (the project's untracked conf/local/) < the command line; and
`labrun configs show KEY...`, which names each value's layer and file. Composed in-process as
`labrun train` composes (the same search path plugin), one real command to show it is the app's."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

import labrun
from conftest import LABRUN
from labrun.config import layers
from labrun.core.errors import LabrunError
from labrun.core.project import LABRUN_CONF

KEYS = ["cluster.partition", "paths.weights_cache"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def lab(tmp_path, monkeypatch) -> Path:
    """A lab folder setting the partition (for cluster=lab) and the weights cache."""
    site = tmp_path / "lab-site"
    write(site / "conf" / "site" / "default.yaml",
          "# @package _global_\npaths:\n  weights_cache: /lab/weights\n")
    write(site / "conf" / "site" / "cluster" / "lab.yaml", "partition: lab-gpu\n")
    monkeypatch.setenv("LABRUN_SITE", str(site))
    return site


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project (pyproject.toml with [tool.labrun]) whose folder is the working folder."""
    root = tmp_path / "my-project"
    write(root / "pyproject.toml", '[project]\nname = "my-project"\n\n[tool.labrun]\n')
    (root / "src").mkdir()
    monkeypatch.chdir(root / "src")  # a folder below the project's root finds it too
    return root


def show(*words: str) -> dict[str, tuple]:
    keys = [w for w in words if "=" not in w] or KEYS
    overrides = [w for w in words if "=" in w]
    return {o.key: (o.value, o.layer, o.file)
            for o in layers.show(keys, overrides, LABRUN_CONF, "train")}


def test_labrun_alone_outside_any_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LABRUN_SITE", raising=False)
    shown = show("cluster=lab")
    value, layer, file = shown["cluster.partition"]
    assert (value, layer) == ("gpu", "labrun")
    assert file == str(LABRUN_CONF / "cluster" / "lab.yaml")
    assert shown["paths.weights_cache"][1] == "labrun"


def test_the_lab_layer_sets_keys_for_every_project(lab, project):
    shown = show("cluster=lab")
    assert shown["cluster.partition"] == ("lab-gpu", "lab", str(
        lab / "conf" / "site" / "cluster" / "lab.yaml"))
    assert shown["paths.weights_cache"] == ("/lab/weights", "lab", str(
        lab / "conf" / "site" / "default.yaml"))
    # A key of one cluster option: the lab's cluster/lab.yaml is not read under cluster=local,
    # whose schema has no partition (merged, it would be refused as an unknown key).
    with pytest.raises(LabrunError, match="cluster.partition: no such key"):
        show("cluster=local", "cluster.partition")


def test_the_project_then_the_local_file_then_the_command_line_override_the_lab(lab, project):
    conf = project / "conf"
    project_file = write(conf / "project" / "default.yaml",
                         "# @package _global_\npaths:\n  weights_cache: /project/weights\n")
    shown = show("cluster=lab")
    assert shown["paths.weights_cache"] == ("/project/weights", "project", str(project_file))
    assert shown["cluster.partition"][:2] == ("lab-gpu", "lab")

    local_file = write(conf / "local" / "cluster" / "lab.yaml", "partition: my-share\n")
    shown = show("cluster=lab")
    assert shown["cluster.partition"] == ("my-share", "local", str(local_file))
    assert shown["paths.weights_cache"][1] == "project"

    shown = show("cluster=lab", "cluster.partition=debug", "paths.weights_cache=/tmp/w")
    assert shown["cluster.partition"] == ("debug", "command line", "cluster.partition=debug")
    assert shown["paths.weights_cache"] == ("/tmp/w", "command line",
                                            "paths.weights_cache=/tmp/w")


def test_a_projects_options_add_to_labrun_groups_and_replace_one_of_the_same_name(project):
    conf = project / "conf"
    mine = write(conf / "model" / "mynet.yaml", "defaults:\n  - simple_cnn\n  - _self_\n"
                                                "width: 8\n")
    ours = write(conf / "optimizer" / "adamw.yaml", "defaults:\n  - /schema/optimizer/adamw@_here_"
                                                    "\n  - _self_\n_target_: torch.optim.AdamW\n"
                                                    "_partial_: true\nlr: 0.0123\n")
    shown = show("model=mynet", "model.width", "optimizer.lr")
    assert shown["model.width"] == (8, "project", str(mine))
    assert shown["optimizer.lr"] == (0.0123, "project", str(ours))  # labrun's adamw replaced


def test_a_missing_or_broken_lab_folder_is_one_line_naming_it(tmp_path, monkeypatch, project):
    monkeypatch.setenv("LABRUN_SITE", str(tmp_path / "no-such-lab"))
    with pytest.raises(LabrunError, match="LABRUN_SITE=.*no-such-lab: no such lab folder"):
        show()
    typed = subprocess.run([LABRUN, "train", "--cfg", "job"], capture_output=True, text=True,
                           timeout=120, cwd=project)
    assert typed.returncode == 2 and typed.stderr.count("\n") == 1, typed.stderr
    assert "no-such-lab: no such lab folder" in typed.stderr
    broken = write(tmp_path / "broken-lab" / "conf" / "site" / "default.yaml", "paths: [\n")
    monkeypatch.setenv("LABRUN_SITE", str(tmp_path / "broken-lab"))
    with pytest.raises(LabrunError) as error:
        show()
    assert "\n" not in str(error.value) and f"{broken} line 2 is not readable YAML" in str(
        error.value), error.value
    assert broken.is_file()


def test_labrun_train_composes_with_the_layers(lab, project):
    """The app itself (not only `configs show`) sees the lab's and the project's files."""
    write(project / "conf" / "project" / "default.yaml",
          "# @package _global_\ntrainer:\n  max_epochs: 7\n")
    typed = subprocess.run([LABRUN, "train", "--cfg", "job", "cluster=lab"], capture_output=True,
                           text=True, timeout=120, cwd=project)
    assert typed.returncode == 0, typed.stderr
    assert "partition: lab-gpu" in typed.stdout and "weights_cache: /lab/weights" in typed.stdout
    assert "max_epochs: 7" in typed.stdout


def test_a_projects_own_packages_are_trusted_as_labruns_are(project, tmp_path, monkeypatch):
    from labrun.deploy import hooks

    monkeypatch.delenv("LABRUN_TRUSTED_MODULES", raising=False)
    write(project / "src" / "mylab" / "__init__.py", "")
    assert hooks.untrusted("mylab.models.Net", "model._target_") is None
    assert hooks.untrusted("mylab_other.Net", "model._target_") is not None
    monkeypatch.chdir(tmp_path)  # outside the project, its code is anyone's
    assert "LABRUN_TRUSTED_MODULES=mylab" in str(hooks.untrusted("mylab.models.Net", "model"))


def test_configs_check_in_a_project_checks_its_options_and_names_their_files(project, capsys):
    """`labrun configs check` in a project: labrun's options and the project's, each
    composed over the project's defaults; a broken option of the project is named by its
    file (before, only labrun's own folder was read: the project's options went unchecked)."""
    from labrun.review.check import check

    write(project / "conf" / "model" / "mynet.yaml",
          "defaults:\n  - simple_cnn\n  - _self_\nwidht: 8\n")  # a typo
    write(project / "conf" / "experiment" / "quick.yaml",
          "# @package _global_\ntrainer:\n  max_epochs: 1\n")
    assert check(LABRUN_CONF) == 1
    out = capsys.readouterr().out
    labrun_options = sum(1 for path in LABRUN_CONF.rglob("*.yaml")
                         if len(parts := path.relative_to(LABRUN_CONF).parts) > 1
                         and parts[0] != "hydra")
    assert f"{project / 'conf' / 'model' / 'mynet.yaml'}: model.widht: no such key" in out, out
    # Labrun's options, the defaults, and the project's two: each counted once.
    count = int(re.search(r"in 1 of (\d+) configs composed from (\S+) over (\S+)", out).group(1))
    assert count == labrun_options + 1 + 2, out


def test_a_run_records_its_project_labrun_and_the_lab_files_that_composed_it(lab, project,
                                                                            tmp_path):
    run_dir = tmp_path / "run"
    trained = subprocess.run([LABRUN, "train", "trainer.max_steps=1", "trainer.max_epochs=null",
                              "logger=csv", "dataset.num_workers=0",
                              "trainer.limit_val_batches=1", f"hydra.run.dir={run_dir}"],
                             capture_output=True, text=True, timeout=300, cwd=project)
    assert trained.returncode == 0, trained.stderr[-2000:]
    recorded = {name: json.loads((run_dir / "provenance" / f"{name}.json").read_text())
                for name in ("git", "labrun", "site")}
    assert (recorded["git"]["project"], recorded["git"]["path"]) == ("my-project", str(project))
    assert recorded["labrun"]["version"] == labrun.__version__
    assert Path(recorded["labrun"]["path"]) == Path(labrun.__file__).parent
    default = lab / "conf" / "site" / "default.yaml"
    # cluster=local: the lab's cluster/lab.yaml did not compose this run, and is not named.
    assert recorded["site"] == {"conf": str(lab / "conf"), "files": {
        "site/default.yaml": hashlib.sha256(default.read_bytes()).hexdigest()}}
