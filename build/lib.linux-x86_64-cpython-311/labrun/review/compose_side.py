"""One side of a config review: compose override lists with this side's conf/ and schemas.

    python -m labrun.review.compose_side CONF_DIR CONFIG_NAME TARGETS_JSON > result.json

TARGETS_JSON: [{"name": ..., "overrides": [...]}, ...]; stdout: JSON
    {"facts": {key: [affects_result, resume_safe]} or null when this side has no facts module,
     "results": {name: {"error": null or one line, "stage": "compose" | "validate" | null,
                        "values": {dotted key: value}, "runtime": [keys kept as written]}}}

`labrun configs review` and `labrun configs diff REV:SPEC` run it in a subprocess with the
side's own src/ first on PYTHONPATH: schemas are code, and a revision's configs compose only
with that revision's schemas. A revision older than this module gets today's copy of it (run
against its src/), so it imports nothing of labrun at module level and reaches the side's own
code through the few entry points every revision since the config schemas has had
(`register`, `validate`, and `facts_of` where the facts exist).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import tempfile
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf


def _side_module(*names: str) -> Any:
    """The first of `names` this side has (the schemas moved between revisions)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def main() -> int:
    config_dir, config_name = sys.argv[1], sys.argv[2]
    targets = json.loads(sys.argv[3])
    schema = _side_module("labrun.config.schema", "labrun.config")
    # validate() moved from the schemas into config/validation.py; older sides have it there.
    validator = _side_module("labrun.config.validation", "labrun.config.schema", "labrun.config")
    facts = _side_module("labrun.config.facts")
    if schema is not None and hasattr(schema, "register"):
        schema.register()
    GlobalHydra.instance().clear()
    results: dict[str, Any] = {}
    keys: set[str] = set()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3",
                               job_name="labrun_review"), tempfile.TemporaryDirectory() as spare:
        for target in targets:
            result = compose_one(target["overrides"], config_name, validator, spare)
            results[target["name"]] = result
            keys.update(result["values"])
    table = None
    if facts is not None and hasattr(facts, "facts_of"):
        # Every key and every section above one: a key only the other side has is then
        # described by its sections here, as facts_of itself would describe it.
        sections = {".".join(k.split(".")[:end]) for k in keys for end in range(1, k.count(".") + 1)}
        table = {}
        for key in sorted(keys | sections):
            found = facts.facts_of(key)
            table[key] = [bool(found.affects_result), bool(found.resume_safe)]
    json.dump({"facts": table, "results": results}, sys.stdout, sort_keys=True)
    return 0


def compose_one(overrides: list[str], config_name: str, validator: Any, spare: str
                ) -> dict[str, Any]:
    result: dict[str, Any] = {"error": None, "stage": None, "values": {}, "runtime": []}
    try:
        cfg = compose(config_name, overrides=overrides)
    except Exception as error:  # whatever stops composition is this config's one-line error
        result.update(error=_message(error), stage="compose")
        return result
    values, runtime, missing = flatten(cfg)
    result.update(values=values, runtime=runtime)
    if validator is not None and hasattr(validator, "validate"):
        for key in missing:  # `???` on purpose (dataset.root): given on the command line
            try:
                OmegaConf.update(cfg, key, spare, merge=False)
            except Exception:
                pass
        try:
            # What the configs say, not what this machine holds: paths are stand-ins here, and
            # a preset's pretrained weights need not be in this machine's cache. Older sides'
            # validate() reads no data and takes no read_data.
            if "read_data" in inspect.signature(validator.validate).parameters:
                validator.validate(cfg, read_data=False)
            else:
                validator.validate(cfg)
        except Exception as error:
            result.update(error=_message(error), stage="validate")
    return result


def flatten(cfg: DictConfig) -> tuple[dict[str, Any], list[str], list[str]]:
    """Dotted key -> resolved value (lists and empty mappings are one value); keys that need
    Hydra's runtime or cannot resolve are kept as written."""
    values: dict[str, Any] = {}
    runtime: list[str] = []
    missing: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node.keys():
            path = f"{prefix}{key}"
            if OmegaConf.is_missing(node, key):
                values[path] = "???"
                missing.append(path)
                continue
            try:
                value = node[key]
                if isinstance(value, DictConfig) and len(value):
                    walk(value, f"{path}.")
                    continue
                if isinstance(value, DictConfig | ListConfig):
                    value = OmegaConf.to_container(value, resolve=True)
            except Exception:
                values[path] = str(OmegaConf.to_container(node, resolve=False)[key])
                runtime.append(path)
                continue
            values[path] = value

    walk(cfg, "")
    return values, runtime, missing


def _message(error: BaseException) -> str:
    """The line of Hydra's or the schema's message that says what is wrong: this side's own
    wording (labrun.config.messages, with its "did you mean") where it has one."""
    messages = _side_module("labrun.config.messages")
    try:
        found = messages.user_error_message(error) if messages is not None else None
    except Exception:
        found = None
    if found:
        return str(found).strip().splitlines()[0]
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = lines[0]  # "In 'experiment/x': ..." names the file: kept
    if first.endswith("raised while composing config:") and len(lines) > 1:
        first = lines[1]
    first = re.sub(r"\s*full_key:.*$", "", first)
    # "Could not override 'x'." is followed by Hydra's hint, which names the fix.
    hint = [line for line in lines[1:2] if line.startswith(("To append", "Did you mean"))]
    return " ".join([first, *hint])


if __name__ == "__main__":
    sys.exit(main())
