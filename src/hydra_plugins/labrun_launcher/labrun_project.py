"""The layers' config folders on Hydra's search path, ahead of labrun's own groups
(pkg://labrun.conf): the project's conf/, then the lab's (LABRUN_SITE/conf). An option of a
group there adds to labrun's (`model=mynet`), one of the same name replaces labrun's, and the
layers' own files (site/, project/, local/: conf/train.yaml's defaults list) set keys over
labrun's defaults. The project is labrun.core.project's: the nearest folder upwards from the
working folder that declares [tool.labrun] in its pyproject.toml. Hydra finds search path
plugins only in `hydra_plugins`."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from labrun.core.project import layer_conf_dirs, site_dir


class LabrunProjectSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # A LABRUN_SITE that is no such folder: one line, before anything.
        site = site_dir()
        site_conf = (site / "conf").resolve() if site is not None else None
        for folder in reversed(layer_conf_dirs()):  # prepended: the lab's, then the project's
            provider = "labrun-site" if folder == site_conf else "labrun-project"
            search_path.prepend(provider=provider, path=f"file://{folder}")
