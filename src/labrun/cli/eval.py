"""`labrun eval RUN_DIR|CHECKPOINT [--split test] [KEY=VALUE ...]`: a run's checkpoint (best.pt
by default) evaluated on a split of its own dataset or, with overrides, of another one; the
result goes to RUN/eval/<dataset>-<split>-<checkpoint>.json (with the number of processes that
evaluated it, world_size) and is printed.

    labrun eval outputs/2026-12-03/10-00-00-ab12 --split test
    labrun eval RUN/checkpoints/last.pt --split val dataset=imagefolder dataset.root=/data/shifted

The config is the run's own: its overrides composed again from conf/, then the command line's
(`labrun compare --metric eval/<file stem>/<metric>` ranks by a result).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INTERMIXED = True  # KEY=VALUE overrides before or after --split (cli/__init__.py)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT",
                        help="a run folder (its checkpoints/best.pt) or one of its checkpoints")
    parser.add_argument("--split", default="test", help="the split to evaluate (default: test)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="train.py's overrides on top of the run's: dataset=..., "
                             "trainer.devices=2, trainer.accelerator=cpu")


def run(args) -> int:
    from labrun.core.errors import LabrunError
    from labrun.runs import lock_holder
    from labrun.train.evaluate import evaluate

    checkpoint, folder = locate(args.target)
    holder = lock_holder.live_holder(folder.lock_path)
    if holder is not None:  # its checkpoints change under us, and it may write eval/ too
        raise LabrunError(lock_holder.busy_message(folder.lock_path, holder))
    cfg = compose(folder, args.overrides)
    outcome = evaluate(cfg, checkpoint, args.split)
    record = {"checkpoint": str(checkpoint.resolve()), "dataset": str(cfg.dataset.name),
              "split": args.split, "world_size": outcome["world_size"],
              "metrics": outcome["metrics"]}
    path = folder.eval_path(str(cfg.dataset.name), args.split, checkpoint.stem)
    folder.write_eval(path, record)
    print(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return 0


def locate(target: Path):
    """(checkpoint, its run folder): a run folder's best.pt, or a checkpoint inside one."""
    from labrun.core.errors import LabrunError
    from labrun.runs.rundir import RunDir

    if target.is_dir():
        folder = RunDir(target)
        checkpoint = folder.checkpoint_path("best")
        if not checkpoint.is_file():
            raise LabrunError(f"{target} has no checkpoints/best.pt; name a checkpoint: "
                              f"labrun eval {target}/checkpoints/last.pt")
        return checkpoint, folder
    folder = RunDir.of_checkpoint(target)
    if not target.is_file() or folder is None or not folder.is_run():
        raise LabrunError(f"{target}: not a run folder nor a checkpoint in one "
                          f"(RUN/checkpoints/NAME.pt)")
    return target, folder


def compose(folder, overrides: list[str]):
    """The run's config as train.py composed it, then `overrides`; the starting weights are
    the checkpoint's, and every batch of the split counts."""
    from hydra import compose as hydra_compose

    from labrun.config import validation
    from labrun.config.resolve import PRIMARY, hydra_context
    from labrun.core.errors import LabrunError, first_line
    from labrun.core.project import LABRUN_CONF

    own = folder.try_overrides()
    if own is None:
        raise LabrunError(f"{folder.path}: no readable .hydra/overrides.yaml to compose the "
                          f"run's config from")
    # A group chosen again (dataset=other) starts from that option: the run's keys of the
    # group it replaces would not fit it.
    chosen = {o.split("=", 1)[0] for o in overrides if "=" in o and "." not in o.split("=")[0]}
    own = [o for o in own if o.lstrip("+~").split("=", 1)[0].split(".")[0] not in chosen]
    try:
        with hydra_context(LABRUN_CONF, PRIMARY):
            cfg = hydra_compose(PRIMARY, overrides=[
                *own, *overrides, f"paths.run_dir={folder.path}",
                "trainer.limit_val_batches=null", "logger=none"])
    except Exception as error:  # Hydra's own error for an unknown option or key: one line
        raise LabrunError(first_line(str(error))) from None
    # The checkpoint's weights, not the library's nor a file's (keys a project's own model
    # section, without labrun's model schema, may not have).
    if cfg.model.get("pretrained"):
        cfg.model.pretrained = False
    if cfg.model.get("init_from"):
        cfg.model.init_from = None
    validation.validate(cfg)
    return cfg
