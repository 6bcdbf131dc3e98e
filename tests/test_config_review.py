"""`labrun configs review`: a temporary git repository made from a copy of conf/ and src/, with
one commit per kind of change, each reviewed against the commit before it (both sides composed
in subprocesses with their own src/, as in a pull request); `configs diff REV:SPEC`; the
workflow that posts the review on a pull request."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PROJECT
from labrun import cli
from labrun.core.project import LABRUN_CONF
from labrun.core.secrets import REDACTED
from labrun.review.review import _changes, review
from labrun.review.review_render import MARKER, markdown

# What a review composes: the defaults, every preset in conf/experiment/, and the override list
# the fixture writes into conf/review.yaml.
EXPERIMENTS = ["defaults", *(f"experiment={path.stem}"
                             for path in sorted((LABRUN_CONF / "experiment").glob("*.yaml"))),
               "lr_sweep"]
N = len(EXPERIMENTS)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


def edit(repo: Path, relative: str, old: str, new: str) -> None:
    path = repo / relative
    text = path.read_text()
    assert old in text, f"{old!r} is no longer in {relative}: update the test's edit"
    path.write_text(text.replace(old, new))


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """Commits: the copy (with an override list in conf/review.yaml), then one per change."""
    repo = tmp_path_factory.mktemp("review") / "project"
    shutil.copytree(LABRUN_CONF, repo / "conf",
                    ignore=shutil.ignore_patterns("local", "review.yaml", "__pycache__"))
    shutil.copytree(PROJECT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "conf" / "review.yaml").write_text(
        "reviews:\n  lr_sweep: [experiment=resnet18_cifar10, optimizer.lr=0.05, "
        "+api_token=hunter2]\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "user.name", "test")
    commit(repo, "base")
    # 1. a shared default: AdamW, used by the defaults and digits_fast, not by the SGD presets
    edit(repo, "conf/optimizer/adamw.yaml", "lr: 3.0e-3", "lr: 1.0e-3")
    commit(repo, "shared default")
    # 2. one experiment
    edit(repo, "conf/experiment/resnet18_cifar10.yaml", "optimizer:\n  lr: 0.1",
         "optimizer:\n  lr: 0.1\n  momentum: 0.95")
    commit(repo, "one experiment")
    # 3. a new option in a group, and a copy of an option under a new name (a rename)
    (repo / "conf" / "optimizer" / "adamw_lowwd.yaml").write_text(
        (repo / "conf" / "optimizer" / "adamw.yaml").read_text().replace(
            "weight_decay: 0.05", "weight_decay: 0.01"))
    (repo / "conf" / "schedule" / "cosine.yaml").rename(repo / "conf" / "schedule" / "cos.yaml")
    for path in (repo / "conf").rglob("*.yaml"):
        text = path.read_text()
        if "schedule: cosine" in text:
            path.write_text(text.replace("schedule: cosine", "schedule: cos"))
    commit(repo, "new option")
    # 4. rename a key in the schema and its YAML, which an experiment overrides: SGD's momentum
    edit(repo, "src/labrun/config/schema.py", "class SGDConfig(OptimizerConfig):\n    momentum:",
         "class SGDConfig(OptimizerConfig):\n    beta:")
    edit(repo, "conf/optimizer/sgd.yaml", "momentum: 0.9", "beta: 0.9")
    commit(repo, "renamed key")
    # 5. only a resume-safe key that changes no result
    edit(repo, "conf/train.yaml", "  batch_size: 64\n", "  batch_size: 64\n  progress: log\n")
    commit(repo, "resume-safe key")
    return repo


def effects(repo: Path, rev: str):
    found = review(repo, f"{rev}~1", rev)
    by_name = {e.name: e for e in found.experiments}
    assert sorted(by_name) == sorted(EXPERIMENTS), sorted(by_name)
    table = {name: (e.status, [(c.key, c.old, c.new, c.affects_result, c.blocks_resume)
                               for c in e.changes])
             for name, e in by_name.items()}
    return found, table


def test_shared_default_changes_every_experiment_that_uses_it(repo):
    found, table = effects(repo, "HEAD~4")
    change = ("optimizer.lr", 0.003, 0.001, True, True)
    assert table["defaults"] == ("changes results", [change])
    assert table["experiment=digits_fast"] == ("changes results", [change])
    assert table["experiment=resnet18_cifar10"] == ("unchanged", [])
    assert table["lr_sweep"] == ("unchanged", [])
    assert found.groups == {"changed": ["optimizer/adamw"]}
    assert found.summary() == f"2 of {N} experiments change results"
    assert found.exit_code == 0


def test_one_experiment_and_the_override_list_built_on_it(repo):
    found, table = effects(repo, "HEAD~3")
    change = ("optimizer.momentum", 0.9, 0.95, True, True)
    assert table["experiment=resnet18_cifar10"] == ("changes results", [change])
    assert table["lr_sweep"] == ("changes results", [change])
    assert table["defaults"] == table["experiment=digits_fast"] == ("unchanged", [])
    assert found.summary() == f"2 of {N} experiments change results"


def test_new_option_and_a_renamed_one_change_no_experiment(repo):
    found, table = effects(repo, "HEAD~2")
    assert all(table[n] == ("unchanged", []) for n in EXPERIMENTS)
    assert found.groups == {"added": ["optimizer/adamw_lowwd"],
                            "renamed": ["schedule/cosine -> schedule/cos"],
                            "changed": ["experiment/finetune_resnet18",
                                        "experiment/resnet18_cifar10"]}  # name cos now
    assert found.exit_code == 0


def test_renamed_key_an_experiment_overrides_no_longer_composes(repo):
    found, table = effects(repo, "HEAD~1")
    for name in ("experiment=resnet18_cifar10", "lr_sweep"):
        status, changes = table[name]
        assert status == "no longer composes" and changes == []
    error = next(e.error for e in found.experiments if e.name == "lr_sweep")
    assert "momentum" in error, error
    assert table["defaults"] == ("unchanged", [])
    # A preset on SGD that does not set momentum composes, with the renamed key.
    assert table["experiment=finetune_resnet18"] == ("changes results", [
        ("optimizer.beta", None, 0.9, True, False),
        ("optimizer.momentum", 0.9, None, True, True)])
    assert found.summary() == f"1 of {N} experiments change results; 2 no longer compose"
    assert found.exit_code == 1
    # The override list's credential-looking value never reaches the output.
    assert "hunter2" not in found.to_json() and "+api_token=<redacted>" in found.to_json()
    # ... nor does a changed value of such a key (this schema has none to change in a commit).
    [change] = _changes({"logger.api_key": "old"}, {"logger.api_key": "new"}, None, None)
    assert (change.old, change.new) == (REDACTED, REDACTED)


def test_resume_safe_key_changes_no_result_and_markdown_is_stable(repo, tmp_path):
    found, table = effects(repo, "HEAD")
    change = ("trainer.progress", "auto", "log", False, False)
    assert table["defaults"] == ("changes other keys", [change])
    assert table["experiment=digits_fast"] == ("changes other keys", [change])
    # The SGD presets still fail, with the same error as at BASE: not this change's doing.
    assert table["lr_sweep"] == ("fails at BASE too", [])
    assert found.exit_code == 0
    first = tmp_path / "a.md"
    code = cli.main(["configs", "review", "HEAD~1", "--head", "HEAD", "--repo", str(repo),
                     "--markdown", str(first)])
    assert code == 0
    again = markdown(review(repo, "HEAD~1", "HEAD"))
    assert first.read_text() == again
    assert again.startswith(MARKER + "\n")
    assert "| `defaults` |  | `trainer.progress` | changes other keys |" in again


def test_review_of_the_work_tree_leaves_it_alone(repo):
    (repo / "conf" / "experiment" / "digits_fast.yaml").write_text(  # uncommitted
        "# @package _global_\ntrainer:\n  max_epochs: 7\n")
    status = git(repo, "status", "--porcelain")
    found = review(repo, "HEAD")
    digits = next(e for e in found.experiments if e.name == "experiment=digits_fast")
    assert ("trainer.max_epochs", 3, 7, True, False) in [
        (c.key, c.old, c.new, c.affects_result, c.blocks_resume) for c in digits.changes]
    assert git(repo, "status", "--porcelain") == status
    git(repo, "checkout", "-q", "--", "conf")


def test_diff_at_a_revision(repo, capsys):
    code = cli.main(["configs", "diff", "HEAD~5:experiment=digits_fast",
                     "HEAD:experiment=digits_fast", "--config-dir", str(repo / "conf")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[2:-1] == ["optimizer.lr: 0.003 -> 0.001", "trainer.progress: auto -> log"]


def test_workflow_comments_once_and_falls_back_to_the_job_summary():
    flow = yaml.safe_load((PROJECT / ".github" / "workflows" / "config-review.yml").read_text())
    assert "pull_request" in flow[True]  # YAML 1.1 reads the key `on` as true
    assert flow["permissions"] == {"contents": "read", "pull-requests": "write"}
    steps = flow["jobs"]["review"]["steps"]
    comment = next(s for s in steps if "github-script" in s.get("uses", ""))
    assert f'marker = "{MARKER}"' in comment["with"]["script"]
    assert "updateComment" in comment["with"]["script"]
    assert "head.repo.full_name == github.repository" in comment["if"]
    summary = "\n".join(s.get("run", "") for s in steps)
    assert "GITHUB_STEP_SUMMARY" in summary
    # A failed composition fails the check, after the review has been posted.
    assert "exit 1" in steps[-1]["run"] and "steps.review.outputs.status" in steps[-1]["if"]
