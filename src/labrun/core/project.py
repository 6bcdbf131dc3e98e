"""Where things are: labrun's own files, which travel inside the package (a wheel holds them),
and the project a command works in, which is the user's repository. The one place that works
either out.

    LABRUN_CONF       the package's config groups (conf/train.yaml and every option), which
                      Hydra reads as pkg://labrun.conf
    SHIPPED_MONITORING  the Prometheus configuration, its rules and the Grafana dashboard
    project_dir()     the project: the nearest folder at or above the working folder whose
                      pyproject.toml has a [tool.labrun] table (labrun's own repository has
                      one; a cluster job's snapshot of a project does too); None outside any
                      project
    TRAIN_COMMAND     `labrun train` as a subprocess
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
LABRUN_CONF = PACKAGE_DIR / "conf"
LABRUN_CONF_MODULE = "labrun.conf"  # Hydra's pkg:// name of LABRUN_CONF
SHIPPED_MONITORING = PACKAGE_DIR / "monitoring" / "shipped"
# The training app as a command of its own (`labrun train`'s, which `python train.py` runs):
# what the benchmarks and `labrun rerun` start.
TRAIN_COMMAND = (sys.executable, "-m", "labrun.cli", "train")


def project_dir(start: Path | None = None) -> Path | None:
    """The project a command run in `start` (default: the working folder) belongs to."""
    folder = (start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        if declares_project(candidate / "pyproject.toml"):
            return candidate
    return None


# A [tool.labrun] table or one of its sub-tables; read as text, as tomllib is Python 3.11's.
DECLARATION = re.compile(r"^\s*\[tool\.labrun[.\]]", re.MULTILINE)


def declares_project(pyproject: Path) -> bool:
    try:
        return DECLARATION.search(pyproject.read_text()) is not None
    except (OSError, UnicodeDecodeError):
        return False
