"""Where the project lives: the repository that holds `conf/` and `train.py` (labrun is
installed from it in editable mode, src layout). The one place that works it out."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[3]
CONF_DIR = PROJECT_DIR / "conf"
