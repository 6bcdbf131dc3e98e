"""labrun's OmegaConf resolvers, registered when labrun.config is first imported: every process
that composes, loads or resolves a config imports it first (a SLURM job's too, which resolves
the config it was handed without running train.py's module code).

    ${labrun.token:}                          a short random token per launch (run folder names)
    ${labrun.unless:${trainer.max_steps},12}  12, unless the first value is set (then null)
    ${labrun.amp_multiple:${precision.name}}  8 under mixed precision (fp16, bf16), else 1
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from omegaconf import OmegaConf


def run_token() -> str:
    """A short random token that keeps run folders started in the same second apart.

    Kept in the environment so that every process of one launch (sweep jobs, DDP ranks)
    resolves the same folder name.
    """
    return os.environ.setdefault("LABRUN_RUN_TOKEN", secrets.token_hex(2))


def unless(given: Any, value: Any) -> Any:
    """The epoch budget of conf/train.yaml: its epochs unless a step budget is given."""
    return value if given is None else None


def amp_multiple(precision: str) -> int:
    """What dataset=text pads a batch's length to a multiple of: 8 under mixed precision, the
    tensor cores' tile for fp16 and bf16 matrix products; 1 in fp32, where padding buys
    nothing."""
    return 8 if precision in ("fp16", "bf16") else 1


def register() -> None:
    for name, resolver in (("labrun.token", run_token), ("labrun.unless", unless),
                           ("labrun.amp_multiple", amp_multiple)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
