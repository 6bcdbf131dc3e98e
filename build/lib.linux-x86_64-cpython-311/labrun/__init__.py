"""labrun: a configuration-driven experiment runner for a deep-learning lab."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("labrun")  # git's, through setuptools-scm (pyproject.toml)
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"
