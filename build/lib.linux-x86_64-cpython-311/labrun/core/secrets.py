"""What looks like a credential, and its redaction: provenance, the loggers' copy of the config
and the config review all hide the same values. In core so that every room may use it (config
sits below runs, where provenance lives)."""

from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"(key|token|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted>"


def redact(arg: str) -> str:
    """`wandb.api_key=abc` -> `wandb.api_key=<redacted>`; other arguments unchanged."""
    name, sep, _ = arg.partition("=")
    return f"{name}={REDACTED}" if sep and SECRET_NAME.search(name) else arg


def redact_tree(node: Any) -> Any:
    """A config as plain containers, with the values of credential-like keys redacted."""
    if isinstance(node, dict):
        return {k: REDACTED if SECRET_NAME.search(str(k)) else redact_tree(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [redact_tree(v) for v in node]
    return node


def is_secret_key(dotted: str) -> bool:
    """A dotted key redact_tree would hide: any of its parts looks like a credential."""
    return any(SECRET_NAME.search(part) for part in dotted.split("."))
