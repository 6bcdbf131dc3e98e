"""One place knows where a job runs (issue 24): outside core/environment.py and the schedulers
(core/scheduler/, on core/probes.py's SLURM client helpers), no module reads a SLURM or
torchrun variable or runs a SLURM command; they ask the Environment and the Scheduler. The
rule holds for the source tree, and it bites: one SLURM_JOB_ID read put back into
train/trainer.py is reported."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

from conftest import PROJECT

SRC = PROJECT / "src"
# Where the knowledge lives (paths below src/labrun/).
ALLOWED = ("core/environment.py", "core/probes.py", "core/scheduler/")

COMMANDS = ("sbatch", "squeue", "sacct", "sacctmgr", "scontrol", "sinfo", "sshare", "sprio",
            "scancel", "srun", "salloc")
TORCHRUN_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
# A string that names a SLURM variable (or starts building one's name, f"SLURM_{x}"), or that
# is a SLURM command to run: the command alone (["squeue", ...], shutil.which("sacct")) or a
# command line ("scontrol show hostnames ...", "squeue -h ..."). Prose that mentions a command
# ("sinfo ok", "sinfo not found: ...") is no use of it.
SLURM_VARIABLE = re.compile(r"SLURM_[A-Z0-9_]*")
COMMAND_LINE = re.compile(rf"({'|'.join(COMMANDS)})(\s+(-|show|update|hold|release|requeue)\b.*)?",
                          re.DOTALL)


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def uses(source: str) -> list[tuple[int, str]]:
    """(line, string) of each string in the code (docstrings and comments are prose) that names
    a SLURM or torchrun variable or a SLURM command."""
    tree = ast.parse(source)
    prose = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value.strip()
            if (SLURM_VARIABLE.fullmatch(text) or COMMAND_LINE.fullmatch(text)
                    or text in TORCHRUN_VARIABLES):
                found.append((node.lineno, text))
    return sorted(found)


def offenders(src: Path) -> dict[str, list[tuple[int, str]]]:
    """Each module of labrun (and its Hydra plugins) outside the allowed places that uses a
    scheduler's or torchrun's names itself."""
    result = {}
    for path in sorted(src.rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        inside = relative.removeprefix("labrun/")
        if inside.startswith(ALLOWED):
            continue
        found = uses(path.read_text())
        if found:
            result[relative] = found
    return result


def test_only_the_environment_and_the_schedulers_know_where_a_job_runs():
    assert offenders(SRC) == {}


def test_the_rule_bites_on_a_slurm_variable_read_in_the_trainer(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    trainer = copy / "labrun" / "train" / "trainer.py"
    trainer.write_text(trainer.read_text() + '\n\nJOB = os.environ["SLURM_JOB_ID"]\n')
    line = len(trainer.read_text().splitlines())
    assert offenders(copy) == {"labrun/train/trainer.py": [(line, "SLURM_JOB_ID")]}


def test_what_counts_as_a_use():
    code = '''
"""Docstrings may say squeue and SLURM_JOB_ID."""
import os, subprocess
# so may comments: sacct, SLURM_PROCID
a = os.environ.get("SLURM_ARRAY_TASK_ID")
b = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
c = subprocess.run(["sacct", "-j", "1"])
d = subprocess.run("scontrol show hostnames node[1-2]", shell=True)
e = int(os.environ["LOCAL_RANK"])
f = "sinfo ok; partitions: gpu"
g = f"install slurm-client, or set SLURM_CONF"
'''
    assert uses(code) == [(5, "SLURM_ARRAY_TASK_ID"), (6, "SLURM_"), (7, "sacct"),
                          (8, "scontrol show hostnames node[1-2]"), (9, "LOCAL_RANK")]

