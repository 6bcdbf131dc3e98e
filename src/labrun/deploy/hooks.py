"""A task's deploy hooks: the module a task names, which export, serving and `labrun predict`
go through. Nothing in labrun.deploy branches on what kind of model it handles.

A training task (labrun.train.task's protocol) names its deploy module by its dotted path, in
its `deploy` attribute. The trainer records that path in every checkpoint ("deploy"), `labrun
export` in the export's metadata, and export, serving and predict import the module from there:
they read a checkpoint or an exported file, never the task object, and the deploy module sits
above labrun.deploy (labrun's own in labrun.tasks, a lab's in its own package), which a task in
labrun.train could not import. A module outside labrun is imported only when it is trusted as a
config's `_target_` is (the project's own packages, LABRUN_TRUSTED_MODULES): a checkpoint could
name any module.

A deploy module defines:

    TASK                        the task's name, in the export's metadata and in messages
    REQUIRED_KEYS               the metadata keys its serving reads (checked when one loads)
    USAGE                       what a client sends: `labrun serve`'s start line, and the answer
                                to a request for a route the server does not have
    export_plan(state, checkpoint, target) -> export.Plan
                                what the exported model takes and returns: the eager model with
                                the checkpoint's weights, an example input and its dynamic axes,
                                the parity check, and the metadata serving needs
    load(path, threads) -> served model
                                the exported file in its runtime, with what it needs to answer
                                (attributes model_path, metadata, threads, device)
    describe(model) -> str      what `labrun serve` says it serves
    health(model) -> dict       the task's own fields of GET /health (beside status, model,
                                format, device, model_calls, threads_per_call)
    add_routes(app, model, server)
                                its HTTP routes on the FastAPI app; `server` (labrun.deploy.
                                serve.Server) has the batcher, the uploads and the errors
    predict_arguments(parser)   `labrun predict MODEL ...`: the inputs and options it takes
    predict(args, open_model) -> exit code
                                what it does with them; open_model() loads the model, after
                                the arguments are checked (nothing loads for a mistake)

and may define:

    EXTRA_FORMATS               {format: write(state, checkpoint, out) -> export.Exported}:
                                `labrun export --format FORMAT` beside onnx and torchscript,
                                written by the module alone (labrun.tasks.text's hf: a folder
                                transformers loads); `out` defaults to EXPORT_DIR/best-FORMAT

docs/plugins.md ("Add a task") walks through them with examples/regression.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from labrun.core import trust
from labrun.core.errors import LabrunError, one_line
from labrun.core.trust import TRUSTED_TARGETS

# A checkpoint's model `_target_`s and deploy module outside TRUSTED_TARGETS and these are
# refused unless LABRUN_TRUSTED_MODULES (comma-separated prefixes) names them: building a
# model or importing a module runs its code, and a checkpoint could name any.
TRUSTED_DEPLOY = ("labrun.tasks.",)
TRUSTED_DATA = ("labrun.data.",)  # a dataset's `_target_`, which a parity check calls
# Checkpoints and exports written before tasks named their deploy modules name a task instead,
# or nothing at all (an image classifier's, which every export was at first).
BEFORE_DEPLOY_MODULES = {"classification": "labrun.tasks.classification",
                         "lm": "labrun.tasks.lm",
                         "segmentation": "labrun.tasks.segmentation",
                         "detection": "labrun.tasks.detection"}
HOOKS = ("TASK", "REQUIRED_KEYS", "USAGE", "export_plan", "load", "describe", "health",
         "add_routes")
PREDICT_HOOKS = ("predict_arguments", "predict")


def untrusted(dotted: str, key: str, ours: tuple[str, ...] = TRUSTED_TARGETS
              ) -> LabrunError | None:
    """The refusal of `dotted` (a class, function or module named by `key`), or None when it
    is within `ours`, the project's own packages (the code of the project this command runs
    in) or the lab's LABRUN_TRUSTED_MODULES: each a package or module (`mylab` trusts mylab
    and mylab.*, not mylab_other) or a prefix ending in a dot."""
    if trust.trusted(dotted, ours):
        return None
    trusted = trust.trusted_prefixes(ours)
    module = dotted.split(".")[0]
    return LabrunError(f"{key}={dotted} is outside the trusted modules ({', '.join(trusted)}); "
                       f"if you trust this checkpoint, set LABRUN_TRUSTED_MODULES={module}")


def of_checkpoint(state: dict[str, Any], checkpoint: Path) -> ModuleType:
    """The deploy module a checkpoint names; one line naming what is missing otherwise."""
    dotted = state.get("deploy")
    if not dotted:
        dotted = _before_deploy_modules(state)
    if not dotted:
        task = (state.get("config") or {}).get("task", {}).get("_target_", "its task")
        raise LabrunError(
            f"{checkpoint}: {task} names no deploy hooks, so its model cannot be exported or "
            f"served: give the task class a `deploy` attribute with the dotted path of its "
            f"deploy module (docs/plugins.md, Add a task), then train or resume the run again")
    return _import(dotted, f"{checkpoint}: deploy")


def of_metadata(meta: dict[str, Any], path: Path) -> ModuleType:
    """The deploy module an export's metadata names (its task's, for an older export)."""
    dotted = meta.get("deploy") or BEFORE_DEPLOY_MODULES.get(str(meta.get("task",
                                                                           "classification")))
    if not dotted:
        raise LabrunError(f"{path}: its metadata names no deploy module (task "
                          f"{meta.get('task')!r}); export the model again")
    return _import(dotted, f"{path}: deploy")


def _before_deploy_modules(state: dict[str, Any]) -> str | None:
    if "task" in state:
        return BEFORE_DEPLOY_MODULES.get(str(state["task"]))
    # Image classifiers' checkpoints named no task; any other task's had no class names.
    return BEFORE_DEPLOY_MODULES["classification"] if state.get("class_names") else None


def _import(dotted: str, key: str) -> ModuleType:
    refusal = untrusted(dotted, key, TRUSTED_DEPLOY)
    if refusal is not None:
        raise refusal
    try:
        module = importlib.import_module(dotted)
    except ImportError as error:
        raise LabrunError(f"{key}={dotted} cannot be imported ({one_line(error)}); install "
                          f"the package that holds it in this environment") from None
    missing = [name for name in HOOKS if not hasattr(module, name)]
    if missing:
        raise LabrunError(f"{key}={dotted} lacks the deploy hooks {', '.join(missing)} "
                          f"(labrun.deploy.hooks lists them)")
    return module


def can_predict(module: ModuleType) -> bool:
    return all(hasattr(module, name) for name in PREDICT_HOOKS)
