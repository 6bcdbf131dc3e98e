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
    project_name()    its name, as its pyproject.toml gives it
    own_packages()    the project's own packages, trusted as labrun's own modules are
    site_dir()        the lab's folder, LABRUN_SITE: what the lab sets once for everyone, in
                      its conf/ (site/default.yaml, site/cluster/lab.yaml...); None unset
    layer_conf_dirs() the config folders over labrun's, as Hydra searches them: the project's
                      conf/, then the lab's
    TRAIN_COMMAND     `labrun train` as a subprocess
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from labrun.core.errors import ConfigError

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


SITE_VARIABLE = "LABRUN_SITE"


def site_dir() -> Path | None:
    """The lab's folder, which LABRUN_SITE names; a name that is no folder with a conf/ in it,
    or a YAML file there that does not parse, is refused in one line naming it, before
    anything is composed (Hydra's own parse error names no file)."""
    import yaml

    named = os.environ.get(SITE_VARIABLE)
    if not named:
        return None
    site = Path(named).expanduser()
    if not (site / "conf").is_dir():
        raise ConfigError(f"{SITE_VARIABLE}={named}: no such lab folder (it must hold conf/, "
                          f"with conf/site/default.yaml for the lab's settings); fix the path "
                          f"or unset {SITE_VARIABLE}")
    for path in sorted((site / "conf").rglob("*.yaml")):
        try:
            yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as error:
            mark = getattr(error, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{SITE_VARIABLE}={named}: {path}{where} is not readable YAML "
                              f"({getattr(error, 'problem', None) or error}); the lab's "
                              f"folder needs fixing") from None
    return site


def layer_conf_dirs() -> list[Path]:
    """The project's conf/ and the lab's, those that exist, in the order Hydra's search path
    has them (hydra_plugins/labrun_launcher/labrun_project.py puts them there)."""
    project, site = project_dir(), site_dir()
    folders = [project / "conf" if project is not None else None,
               site / "conf" if site is not None else None]
    return [folder.resolve() for folder in folders if folder is not None and folder.is_dir()]


# A [tool.labrun] table or one of its sub-tables; read as text, as tomllib is Python 3.11's.
DECLARATION = re.compile(r"^\s*\[tool\.labrun[.\]]", re.MULTILINE)


def own_packages(project: Path | None) -> tuple[str, ...]:
    """The project's own top-level packages (src/NAME/__init__.py, or NAME/__init__.py without
    a src/ layout): its code, which labrun trusts as its own (a checkpoint's `_target_`s)."""
    if project is None:
        return ()
    code = project / "src" if (project / "src").is_dir() else project
    return tuple(sorted(init.parent.name for init in code.glob("*/__init__.py")))


PROJECT_TABLE = re.compile(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", re.MULTILINE | re.DOTALL)
NAME_LINE = re.compile(r"""^name\s*=\s*["']([^"']+)""", re.MULTILINE)


def project_name(project: Path) -> str:
    """The project's name: its pyproject.toml's [project] name, else its folder's."""
    try:
        table = PROJECT_TABLE.search((project / "pyproject.toml").read_text())
    except (OSError, UnicodeDecodeError):
        table = None
    name = NAME_LINE.search(table.group(1)) if table else None
    return name.group(1) if name else project.name


def declares_project(pyproject: Path) -> bool:
    try:
        return DECLARATION.search(pyproject.read_text()) is not None
    except (OSError, UnicodeDecodeError):
        return False
