"""Which modules labrun may import when something it reads names them: importing a module runs
its code. A checkpoint or an export could name any (deploy/hooks.py refuses the rest), and a
config's keys are checked against its targets' signatures only where importing the target to
read its signature is safe (config/keys.py).

    TRUSTED_TARGETS   the model libraries' and labrun's model modules: a checkpoint's models
    trusted(dotted, ours)
                      within `ours`, the project's own packages (the code of the project this
                      command runs in) or the lab's LABRUN_TRUSTED_MODULES
"""

from __future__ import annotations

import os

from labrun.core import project

TRUSTED_TARGETS = ("labrun.models.", "torchvision.models.", "torch.nn.", "timm.")
TRUSTED_VARIABLE = "LABRUN_TRUSTED_MODULES"


def trusted_prefixes(ours: tuple[str, ...]) -> tuple[str, ...]:
    """`ours`, then the project's own packages and LABRUN_TRUSTED_MODULES (comma-separated):
    each a package or module (`mylab` trusts mylab and mylab.*, not mylab_other) or a prefix
    ending in a dot."""
    named = os.environ.get(TRUSTED_VARIABLE, "").split(",")
    named += project.own_packages(project.project_dir())
    return ours + tuple(p.strip() if p.strip().endswith(".") else p.strip() + "."
                        for p in named if p.strip())


def trusted(dotted: str, ours: tuple[str, ...]) -> bool:
    """Whether `dotted` (a module, or a class or function in one) may be imported."""
    if (dotted + ".").startswith(ours):
        return True  # without reading the project's folder: most targets are labrun's own
    return (dotted + ".").startswith(trusted_prefixes(ours))
