"""The regression task's life after training: its deploy hooks (labrun.deploy.hooks lists them),
which `labrun export`, `labrun serve` and `labrun predict` import by the name the task gives
(Regression.deploy). The project's own package, so labrun trusts it in the project's folder
(elsewhere, only with LABRUN_TRUSTED_MODULES=regression):

    labrun export RUN_DIR                        # RUN_DIR/export/best.onnx, parity-checked
    labrun serve RUN_DIR/export/best.onnx        # POST /predict {"age": 0.04, ..., "s6": -0.02}
    labrun predict RUN_DIR/export/best.onnx rows.csv --out predictions.csv

The model takes a batch of the ten features as load_diabetes gives them and answers the
standardised target; what is served and predicted is the disease progression itself (the
target's mean and spread from training, in the export's metadata).
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import HTTPException, Request, Response

from labrun.core.errors import LabrunError, one_line
from labrun.deploy import runtime
from labrun.deploy.export import BATCH_AXIS, Plan, Target, build_data, build_model

log = logging.getLogger(__name__)

TASK = "regression"
REQUIRED_KEYS = ("feature_names", "target_mean", "target_std")
USAGE = 'POST /predict with a JSON object of the features, such as {"age": 0.04, ...}'


# ---------------------------------------------------------------------------------------------
# Export


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """A batch of feature rows in, the standardised target out; checked on the val rows."""
    names = list(state["feature_names"])
    model = build_model(state["config"], {"features": len(names)}, state["model"], checkpoint)
    check = None
    if target.check_data is not None:
        rows = parity_rows(state["config"]["dataset"], len(names), target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, rows)

    metadata = {"input": {"name": "input", "shape": ["batch", len(names)], "dtype": "float32"},
                "output": {"name": "logits", "shape": ["batch", 1],
                           "values": "the target, standardised by target_mean and target_std"},
                "feature_names": names, "target_mean": state["target_mean"],
                "target_std": state["target_std"]}
    example = torch.zeros(2, len(names), device=target.device, dtype=target.dtype)
    return Plan(model, example, BATCH_AXIS, check, report_parity, metadata)


def parity_rows(dataset: dict[str, Any], features: int, data: str) -> tuple[torch.Tensor, str]:
    if data == "val":
        try:
            return build_data(dataset).rows["val"].features, "the val rows"
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random rows
            reason = f"val rows unavailable: {one_line(error)}"
    else:
        reason = "random input requested"
    rows = torch.randn(64, features, generator=torch.Generator().manual_seed(0)) * 0.05
    return rows, f"64 random rows ({reason})"


def parity(path: Path, target: Target, reference: torch.nn.Module,
           rows: tuple[torch.Tensor, str]) -> dict[str, Any]:
    """The exported file against eager PyTorch on every row at once and on one alone."""
    batch, rows_from = rows
    run = target.runtime(path)
    with torch.inference_mode():
        eager = reference(batch.to(target.device)).float().cpu()
    inputs = batch.to(target.dtype).numpy()
    diff = max(float(np.abs(run(inputs) - eager.numpy()).max()),
               float(np.abs(run(inputs[:1]) - eager[:1].numpy()).max()))
    tolerance = target.tolerance * max(1.0, eager.abs().max().item())
    passed = diff <= tolerance
    return {"rows": len(batch), "rows_from": rows_from, "max_abs_diff": diff,
            "tolerance": tolerance, "passed": passed,
            "failure": None if passed else f"parity check failed: max abs diff {diff:.2e} > "
                                           f"{tolerance:.2e}"}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    log.info(f"parity ({exporter}): {check['rows_from']} ({check['rows']}), max abs diff "
             f"{check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e}) -> "
             f"{'ok' if check['passed'] else 'FAILED'}")


# ---------------------------------------------------------------------------------------------
# Serving


class Regressor:
    """The exported model: rows of features in, disease progression out."""

    def __init__(self, path: Path, threads: int | None = None):
        self.model_path, self.threads = Path(path), threads
        self.metadata = meta = runtime.read_metadata(self.model_path, task=TASK)
        self.names: list[str] = list(meta["feature_names"])
        self.mean, self.std = float(meta["target_mean"]), float(meta["target_std"])
        self.runtime = runtime.open_runtime(self.model_path, meta["format"], threads)
        self.predict(np.zeros((1, len(self.names)), dtype=np.float32))  # fails now, not later

    @property
    def device(self) -> str:
        return self.runtime.device

    def predict(self, rows: np.ndarray) -> np.ndarray:
        return self.runtime(rows.astype(np.float32))[:, 0] * self.std + self.mean

    def row(self, fields: Any) -> np.ndarray:
        """A JSON object (or CSV row) of every feature, by name -> the model's input row."""
        if not isinstance(fields, dict):
            raise LabrunError(f"send a JSON object of the features {', '.join(self.names)}")
        missing = [name for name in self.names if name not in fields]
        unknown = sorted(set(fields) - set(self.names))
        if missing or unknown:
            raise LabrunError(f"the features are {', '.join(self.names)}"
                              + (f"; missing {', '.join(missing)}" if missing else "")
                              + (f"; unknown {', '.join(unknown)}" if unknown else ""))
        try:
            return np.array([float(fields[name]) for name in self.names], dtype=np.float32)
        except (TypeError, ValueError):
            raise LabrunError("every feature must be a number") from None


def load(path: Path, threads: int | None = None) -> Regressor:
    return Regressor(path, threads)


def describe(model: Regressor) -> str:
    return f"regression on {len(model.names)} features"


def health(model: Regressor) -> dict[str, Any]:
    return {"task": TASK, "features": model.names}


def add_routes(app, model: Regressor, server) -> None:
    batcher = server.batcher(lambda rows: list(model.predict(np.stack(rows))))

    @app.post("/predict")
    async def predict(request: Request, response: Response) -> dict[str, float]:
        try:
            row = model.row(json.loads(await request.body()))
        except ValueError as error:  # not JSON
            raise HTTPException(400, f"the body is not JSON ({one_line(error)})") from None
        except LabrunError as error:
            raise HTTPException(422, str(error)) from None
        [value] = await server.batched(batcher, [row], response)
        return {"value": float(value)}


# ---------------------------------------------------------------------------------------------
# labrun predict


def predict_arguments(parser) -> None:
    parser.add_argument("rows", type=Path, metavar="ROWS.csv",
                        help="a CSV with a header naming the ten features")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.csv",
                        help="the rows with a `prediction` column (default: printed)")


def predict(args, open_model: Callable[[], Regressor]) -> int:
    if not args.rows.is_file():
        raise LabrunError(f"{args.rows}: no such file")
    with open(args.rows, newline="") as f:
        records = list(csv.DictReader(f))
    if not records:
        raise LabrunError(f"{args.rows}: no rows below its header")
    model = open_model()
    try:
        inputs = np.stack([model.row(record) for record in records])
    except LabrunError as error:
        raise LabrunError(f"{args.rows}: {error}") from None
    out = open(args.out, "w", newline="") if args.out else sys.stdout  # noqa: SIM115
    try:
        writer = csv.writer(out)
        writer.writerow([*model.names, "prediction"])
        for record, value in zip(records, model.predict(inputs).tolist(), strict=True):
            writer.writerow([*(record[name] for name in model.names), value])
    finally:
        if args.out:
            out.close()
    return 0
