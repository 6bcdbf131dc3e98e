"""The project's conf/ on Hydra's search path, ahead of labrun's own groups (pkg://labrun.conf):
its options add to labrun's groups (`model=mynet`), an option of the same name replaces
labrun's, its own train.yaml (if any) is the primary config, and its untracked conf/local/
holds one person's settings (`optional local@_global_: default`). The project is
labrun.core.project's: the nearest folder upwards from the working folder that declares
[tool.labrun] in its pyproject.toml. Hydra finds search path plugins only in `hydra_plugins`."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from labrun.core.project import project_dir


class LabrunProjectSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        project = project_dir()
        if project is not None and (project / "conf").is_dir():
            search_path.prepend(provider="labrun-project", path=f"file://{project / 'conf'}")
