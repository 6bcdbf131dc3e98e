"""A task owns its life after training through the deploy module it names (labrun.deploy.hooks):
nothing in labrun branches on a task's kind, checkpoints and exports written before tasks named
their deploy modules still export, serve and predict with the answers they gave then, and a
task without deploy hooks is refused in one line. (The out-of-tree task that exports, serves
and predicts with its own hooks: tests/test_example_task.py.)"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import PROJECT, run_labrun
from labrun import cli
from labrun.deploy import export, load
from labrun.deploy.served import serving
from labrun.tasks import lm

FIXTURES = PROJECT / "tests" / "fixtures" / "before_task_hooks"
ANSWERS = json.loads((FIXTURES / "answers.json").read_text())
IMAGES = FIXTURES / "images"

# What a dispatch on a task's kind looks like: labrun.deploy read these before tasks named
# their deploy modules; the task's own module is where such knowledge belongs.
DISPATCH = [r'==\s*"lm"', r'"tokenizer" in state', r"\bsegmentation\.TASK\b", r"\blm\.TASK\b",
            r"isinstance\([^)]*\b(Segmenter|LanguageModel)\b", r"REQUIRED_KEYS\["]


def dispatches(root: Path) -> list[str]:
    """Each `file:line: text` under `root` that picks behaviour by a task's kind, outside the
    tasks' own modules (labrun/tasks/ and train/task.py, where the kinds are defined)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("tasks/") or relative == "train/task.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if any(re.search(pattern, line) for pattern in DISPATCH):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_nothing_in_labrun_dispatches_on_a_tasks_kind():
    assert dispatches(PROJECT / "src" / "labrun") == []


def test_the_dispatch_rule_finds_each_pattern(tmp_path):
    """The rule itself, on lines like those labrun.deploy had before."""
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "old.py").write_text(
        'language = state.get("task") == "lm" or "tokenizer" in state\n'
        "if state.get('task') == segmentation.TASK: pass\n"
        "if isinstance(predictor, lm.LanguageModel): pass\n"
        "keys = REQUIRED_KEYS[kind]\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "lm.py").write_text('TASK = "lm"\nok = task == "lm"\n')
    assert len(dispatches(tmp_path)) == 4


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> Path:
    """A copy of the fixtures (an export or a predict may write beside what it reads)."""
    copy = tmp_path_factory.mktemp("before-hooks") / "fixtures"
    shutil.copytree(FIXTURES, copy)
    return copy


def top3(csv_file: Path) -> dict[str, list[tuple[int, float]]]:
    answers: dict[str, list[tuple[int, float]]] = {}
    for row in csv.DictReader(csv_file.open()):
        answers.setdefault(Path(row["path"]).name, []).append((int(row["index"]),
                                                               float(row["prob"])))
    return answers


@pytest.mark.parametrize("source", ["cls.onnx", "cls.pt"])
def test_an_older_image_classifier_predicts_what_it_predicted(old, source, tmp_path):
    out = tmp_path / "top3.csv"
    run_labrun("predict", str(old / source), str(old / "images" / "digit0.png"),
               str(old / "images" / "digit7.png"), "--k", "3", "--csv", str(out))
    expected = {name: [(t["index"], t["prob"]) for t in top]
                for name, top in ANSWERS[source].items()}
    assert top3(out) == expected


def test_an_older_segmenter_predicts_the_masks_it_predicted(old, tmp_path):
    out = tmp_path / "masks"
    result = run_labrun("predict", str(old / "seg.onnx"), str(old / "images" / "shape0.png"),
                        str(old / "images" / "shape1.png"), "--out", str(out))
    for name, expected in ANSWERS["seg.onnx"].items():
        mask = np.asarray(Image.open(out / name))
        assert list(mask.shape) == expected["shape"]
        assert hashlib.sha256(mask.tobytes()).hexdigest() == expected["mask_sha256"]
        shares = "  ".join(f"{c} {s:.4f}" for c, s in expected["fractions"].items())
        assert f"{old / 'images' / name}  {shares}" in result.stdout


def test_an_older_checkpoint_exports_with_the_deploy_module_its_task_had(old, tmp_path):
    """Checkpoints from before `deploy` name their task, or nothing (an image classifier).
    In-process: `labrun export` itself runs in test_export.py and test_lm_deploy.py."""
    for name, task in (("cls", "classification"), ("seg", "segmentation"), ("lm", "lm")):
        assert "deploy" not in torch.load(old / f"{name}.pt", weights_only=True)
        out = tmp_path / f"{name}.onnx"
        export.export(old / f"{name}.pt", out=out, check_data=None)
        meta = json.loads(Path(f"{out}.json").read_text())
        assert (meta["deploy"], meta["task"]) == (f"labrun.tasks.{task}", task)
    # The language model exported now answers as the older export of the same checkpoint.
    model, _ = load.load(tmp_path / "lm.onnx")
    assert model.generate(lm.Request("the quick", 8, temperature=0.0, seed=1)) == ANSWERS["lm.pt"]


def test_an_older_language_model_export_serves_what_it_served(old, tmp_path):
    with serving(old / "lm.onnx", tmp_path / "server.log", cwd=PROJECT) as served:
        answer = httpx.post(f"{served.url}/generate", timeout=30, json={
            "prompt": "the quick", "max_tokens": 8, "temperature": 0, "seed": 1})
        health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert answer.status_code == 200 and answer.json() == ANSWERS["lm.onnx"]
    assert health["task"] == "lm"


def test_a_task_without_deploy_hooks_is_refused_by_export_in_one_line(old, tmp_path, capsys):
    """A checkpoint of a task whose class names no deploy module (no `deploy`, no class
    names, as the regression example's were): one line naming what it lacks; no file."""
    state = torch.load(old / "cls.pt", weights_only=True)
    state["class_names"] = []
    state["config"]["task"] = {"_target_": "mylab.tasks.Ranking"}
    state["deploy"] = None
    checkpoint = tmp_path / "ranking.pt"
    torch.save(state, checkpoint)
    assert cli.main(["export", str(checkpoint), "--out", str(tmp_path / "x.onnx")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "mylab.tasks.Ranking names no deploy hooks" in error
    assert "`deploy` attribute" in error
    assert not list(tmp_path.glob("x.onnx*"))
    # A deploy module that lacks hooks is named with them.
    state["deploy"] = "labrun.tasks"  # a package, not a deploy module
    torch.save(state, checkpoint)
    assert cli.main(["export", str(checkpoint), "--out", str(tmp_path / "x.onnx")]) == 2
    error = capsys.readouterr().err.strip()
    assert "lacks the deploy hooks TASK, REQUIRED_KEYS" in error and "\n" not in error
