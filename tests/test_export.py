"""`labrun export`: a trained run to ONNX and TorchScript through the real command, the parity
check, the metadata, --fp16, and refusing checkpoints that would run code."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_labrun
from labrun import models
from labrun.core.errors import LabrunError
from labrun.data.image import digits
from labrun.deploy import export


@pytest.fixture(scope="module")
def run_copy(digits_run, tmp_path_factory) -> Path:
    """A copy of the shared run, so that export/ written into it stays out of other tests."""
    copy = tmp_path_factory.mktemp("export") / "run"
    shutil.copytree(digits_run, copy)
    return copy


def eager_model(run_dir: Path, which: str = "best") -> torch.nn.Module:
    state = torch.load(run_dir / "checkpoints" / f"{which}.pt", weights_only=True)
    model = models.build(OmegaConf.create(state["config"]["model"]), len(state["class_names"]))
    model.load_state_dict(state["model"])
    return model.eval()


def random_input(batch: int, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))


def check_metadata(path: Path, run_dir: Path, fmt: str, which: str = "best") -> dict:
    meta = json.loads(Path(f"{path}.json").read_text())
    assert meta["format"] == fmt and meta["dtype"] == "float32"
    assert meta["class_names"] == [str(d) for d in range(10)] and meta["num_classes"] == 10
    assert meta["image_size"] == 32 and meta["val_resize_ratio"] == 0.875
    assert meta["mean"] == [0.5, 0.5, 0.5] and meta["std"] == [0.5, 0.5, 0.5]
    assert meta["source"]["run_dir"] == str(run_dir.resolve())
    assert meta["source"]["checkpoint"].endswith(f"checkpoints/{which}.pt")
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["labrun"]
    assert meta["parity"]["passed"] and meta["parity"]["images_from"].endswith("digits/val")
    return meta


def test_onnx_export_passes_parity_on_validation_images(run_copy):
    result = run_labrun("export", str(run_copy), "--format", "onnx")
    print(result.stderr)  # what the command reports (logging) goes to stderr
    assert "parity (dynamo): 32 validation images of digits/val" in result.stderr
    assert "top-1 agrees on 32/32 -> ok" in result.stderr

    path = run_copy / "export" / "best.onnx"
    meta = check_metadata(path, run_copy, "onnx")
    assert meta["exporter"] == "dynamo" and meta["opset"] == export.DEFAULT_OPSET
    assert meta["parity"]["max_abs_diff"] <= meta["parity"]["tolerance"]

    # An independent look: onnxruntime with a batch size never used in the export.
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = random_input(5)
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = eager_model(run_copy)(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_torchscript_export_passes_parity_on_validation_images(run_copy):
    result = run_labrun("export", str(run_copy), "--format", "torchscript")
    print(result.stderr)
    assert "parity (torch.jit.trace): 32 validation images of digits/val" in result.stderr

    path = run_copy / "export" / "best.torchscript.pt"
    check_metadata(path, run_copy, "torchscript")
    module = torch.jit.load(str(path))
    x = random_input(3)
    with torch.no_grad():
        torch.testing.assert_close(module(x), eager_model(run_copy)(x), rtol=1e-5, atol=1e-5)


def test_legacy_exporter_last_checkpoint_and_out(digits_run, tmp_path):
    out = tmp_path / "deploy" / "last.onnx"
    result = run_labrun("export", str(digits_run / "checkpoints" / "last.pt"), "--exporter",
                        "legacy", "--out", str(out), "--opset", "17")
    assert "parity (legacy)" in result.stderr
    meta = check_metadata(out, digits_run, "onnx", which="last")
    assert meta["exporter"] == "legacy" and meta["opset"] == 17


def test_fp16_without_a_gpu_is_one_clear_line(digits_run):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --fp16 works here")
    result = run_labrun("export", str(digits_run), "--fp16", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--fp16" in result.stderr
    assert "Traceback" not in result.stderr


# How far the fp16 export's logits may be from the fp32 model's, as a fraction of the largest
# fp32 logit (at least 1). fp16 keeps 11 significant bits: each operation rounds by up to
# 2^-11 = 4.9e-4 of its value, and the roundings of a few layers add up. Measured on the digits
# run's 359 validation images: 0.0027 with logits up to 5.8 (4.6e-4 of the largest); 4e-3
# allows about 8 times that, and is 2.5 times tighter than the exporter's own check (1e-2).
FP16_TOLERANCE = 4e-3


def test_fp16_export_matches_the_fp32_model(digits_run, tmp_path):
    """The CLI needs CUDA for --fp16; the export code itself runs anywhere (torch and
    onnxruntime both execute fp16 on the CPU), so the half-precision files are made here. The
    exporter's parity verdict must pass, and then this test judges for itself: each file really
    is fp16, and on every validation image its logits are those of the fp32 model run by torch
    from the checkpoint, within FP16_TOLERANCE, with the same top-1 wherever the fp32 top two
    are further apart than twice that."""
    state = torch.load(digits_run / "checkpoints" / "best.pt", weights_only=True)
    dataset = state["config"]["dataset"]
    val = digits.load(dataset["image_size"], dataset["val_fraction"])["val"]
    pixels = torch.stack([torch.from_numpy(val.load(i)).permute(2, 0, 1)
                          for i in range(len(val))]).float() / 255
    x = ((pixels - torch.tensor(dataset["mean"]).view(1, 3, 1, 1))
         / torch.tensor(dataset["std"]).view(1, 3, 1, 1))
    with torch.no_grad():
        fp32 = eager_model(digits_run)(x)
    tolerance = FP16_TOLERANCE * max(1.0, fp32.abs().max().item())
    top2 = fp32.topk(2, dim=1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tolerance
    assert clear.sum() >= len(val) // 2, "too few clear-cut images to compare top-1 on"

    for fmt in ("onnx", "torchscript"):
        out = tmp_path / f"half{export.FORMATS[fmt]}"
        result = export.export(digits_run, out=out, fmt=fmt, fp16=True, device="cpu")
        assert result.metadata["dtype"] == "float16" and result.metadata["parity"]["passed"]
        if fmt == "onnx":
            session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            assert session.get_inputs()[0].type == "tensor(float16)"
            assert session.get_outputs()[0].type == "tensor(float16)"
            half = torch.from_numpy(session.run(None, {"input": x.half().numpy()})[0])
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated
                module = torch.jit.load(str(out))
            assert {p.dtype for p in module.parameters()} == {torch.float16}
            with torch.no_grad():
                half = module(x.half())
        assert half.dtype == torch.float16
        diff = (half.float() - fp32).abs().max().item()
        print(f"{fmt} fp16: max |logit - fp32| {diff:.4f} (tolerance {tolerance:.4f})")
        assert diff <= tolerance, (fmt, diff, tolerance)
        assert torch.equal(half.float().argmax(1)[clear], fp32.argmax(1)[clear]), fmt


class RunsCode:
    """Unpickling this runs a shell command: the attack weights_only=True stops."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_that_runs_code_is_refused_by_export_and_serve(digits_run, tmp_path):
    marker = tmp_path / "code-ran"
    state = torch.load(digits_run / "checkpoints" / "best.pt", weights_only=True)
    state["payload"] = RunsCode(marker)
    evil = tmp_path / "checkpoints" / "best.pt"
    evil.parent.mkdir()
    torch.save(state, evil)

    for command in (["export", str(evil)], ["serve", str(evil), "--port", "0"]):
        # 120 s: it fails on loading the checkpoint, before any export; slack for a loaded
        # machine's slow torch import.
        result = run_labrun(*command, check=False, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "weights_only" in result.stderr and str(evil) in result.stderr
        assert "Traceback" not in result.stderr
    assert not marker.exists()


def test_config_naming_an_untrusted_class_is_refused(digits_run, tmp_path, monkeypatch):
    state = torch.load(digits_run / "checkpoints" / "best.pt", weights_only=True)
    state["config"]["model"]["_target_"] = "os.system"
    crafted = tmp_path / "crafted.pt"
    torch.save(state, crafted)
    with pytest.raises(LabrunError, match="model._target_=os.system.*LABRUN_TRUSTED"):
        export.export(crafted, out=tmp_path / "x.onnx")
    monkeypatch.setenv("LABRUN_TRUSTED_MODULES", "mylab.")
    state["config"]["model"]["_target_"] = "labrun.models.SimpleCNN"
    state["config"]["model"]["norm"] = {"_target_": "subprocess.Popen"}
    torch.save(state, crafted)
    with pytest.raises(LabrunError, match="model.norm._target_=subprocess.Popen"):
        export.export(crafted, out=tmp_path / "x.onnx")


def test_export_never_overwrites_its_checkpoint(digits_run, tmp_path):
    checkpoint = tmp_path / "best.pt"
    shutil.copy(digits_run / "checkpoints" / "best.pt", checkpoint)
    with pytest.raises(LabrunError, match="is the checkpoint being exported"):
        export.export(checkpoint, out=checkpoint, fmt="torchscript")
    assert torch.load(checkpoint, weights_only=True)["step"] > 0


def test_logits_parity_counts_a_top1_flip_only_beyond_what_rounding_may_flip():
    """LogitsParity (the lm's and the text classifier's check): the tolerance is relative to
    the largest eager logit; a flip between two logits closer than twice it is rounding's."""
    eager = torch.tensor([[4.0, 1.0, 0.0], [2.0, 2.0 - 1e-5, 0.0]])
    same = export.LogitsParity(1e-4)
    same.add(eager.clone(), eager)
    assert same.passed and (same.top1_agree, same.positions, same.tolerance) == (2, 2, 4e-4)

    close = eager.clone()
    close[1, 1] += 2e-5  # the near tie flips, within tolerance: agreement drops, no mismatch
    near = export.LogitsParity(1e-4)
    near.add(close, eager)
    assert near.passed and (near.top1_agree, near.top1_mismatches) == (1, 0)

    flipped = eager.clone()
    flipped[0, 1] = 5.0  # a wide margin flipped: a mismatch, and a difference far too big
    wrong = export.LogitsParity(1e-4)
    wrong.add(flipped, eager)
    wrong.add(eager[:1], eager[:1])  # a later call that agrees changes neither
    assert not wrong.passed and (wrong.top1_mismatches, wrong.positions) == (1, 3)
    assert wrong.max_abs_diff == 4.0
