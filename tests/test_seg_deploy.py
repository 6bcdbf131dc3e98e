"""`labrun export`, `labrun serve` and `labrun predict` of a segmentation run (task=segmentation):
seg_run (a U-Net trained on dataset=shapes, 32 px, 4 classes) exported to ONNX and TorchScript
with its parity reported, both files run at sizes the export never saw against the eager model,
then `labrun serve RUN` on a real uvicorn on 127.0.0.1 (masks of the upload's size, fractions,
batching, bad uploads) and `labrun predict --out DIR` (mask and overlay PNGs; an --out among
the images refused).

Cheap on purpose: one export per format and one server, shared by every test. Test images are
drawn by dataset=shapes' own `draw`, which gives each image's true mask too."""

from __future__ import annotations

import base64
import io
import itertools
import json
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from omegaconf import OmegaConf
from PIL import Image

from conftest import PROJECT, built_once, run_labrun
from labrun import cli, models
from labrun.data.segmentation.shapes import CLASS_NAMES, draw
from labrun.deploy import export, runtime
from labrun.deploy.served import serving
from labrun.tasks import segmentation

HEADER = "x-batch-size"
# The model reaches a pixel accuracy of about 0.9 on its val split; a broken pipeline (wrong
# normalisation, mask flipped or shifted, resized the wrong way) falls to background's share.
MIN_TRUE_AGREEMENT = 0.7


@pytest.fixture(scope="session")
def exports(seg_run, tmp_path_factory) -> dict[str, Path]:
    """seg_run exported once per format: ONNX by the real `labrun export` command (its report
    kept in export.log), TorchScript in-process; each parity-checked on the run's val images."""
    def build(folder: Path) -> None:
        result = run_labrun("export", str(seg_run), "--format", "onnx",
                            "--out", str(folder / "seg.onnx"))
        (folder / "export.log").write_text(result.stderr)
        export.export(seg_run, out=folder / "seg.torchscript.pt", fmt="torchscript")

    folder = built_once(tmp_path_factory, "seg_exports", build)
    return {"onnx": folder / "seg.onnx", "torchscript": folder / "seg.torchscript.pt",
            "log": folder / "export.log"}


@pytest.fixture(scope="module")
def server(seg_run, tmp_path_factory):
    """`labrun serve RUN` (exported to ONNX on the fly) on a free 127.0.0.1 port; its URL. One
    model call at a time and a 100 ms wait for company, so concurrent requests share calls."""
    log = tmp_path_factory.mktemp("seg-server") / "server.log"
    try:
        with serving(seg_run, log, cwd=PROJECT, args=("--model-calls", "1", "--max-batch", "8",
                                                      "--max-delay-ms", "100")) as served:
            yield served.url
    finally:
        print(log.read_text()[-3000:])


def shapes_image(k: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A drawn image (uint8 HxWx3) and its true mask, different for each k."""
    return draw(np.random.default_rng(1000 + k), size)


def encode(image: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def read_png(data: bytes) -> tuple[np.ndarray, Image.Image]:
    image = Image.open(io.BytesIO(data))
    return np.asarray(image), image


def eager_model(run: Path) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's U-Net in eager PyTorch, built here from its config, and the checkpoint."""
    state = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    model = models.build(OmegaConf.create(state["config"]["model"]), len(state["class_names"]))
    model.load_state_dict(state["model"])
    return model.eval(), state


def post(url: str, name: str, data: bytes, path: str = "/predict") -> httpx.Response:
    return httpx.post(f"{url}{path}", files={"file": (name, data, "image/png")}, timeout=60)


# ---------------------------------------------------------------------------------------------
# Export


def test_exports_pass_parity_on_val_images_and_report_it(exports):
    for fmt in ("onnx", "torchscript"):
        meta = json.loads(runtime.metadata_path(exports[fmt]).read_text())
        parity = meta["parity"]
        assert parity["passed"], parity
        assert parity["argmax_agreement"] >= 0.999
        assert parity["max_abs_diff"] <= parity["tolerance"] <= 1e-4 * 100
        assert parity["images_from"] == "16 validation images of shapes/val"
        # The val batch, and one image alone at a size the example (2x3x32x32) never had.
        assert parity["shapes"] == [[16, 3, 32, 32], [1, 3, 19, 37]]
        assert parity["pixels"] == 16 * 32 * 32 + 19 * 37
        assert meta["task"] == "segmentation" and meta["format"] == fmt
        assert meta["class_names"] == CLASS_NAMES and meta["ignore_index"] == 255
        assert (meta["image_size"], meta["eval_size"]) == (32, "fixed")
        assert meta["mean"] == [0.5] * 3 and meta["std"] == [0.25] * 3
        assert meta["palette"][:2] == [[0, 0, 0], [128, 0, 0]] and len(meta["palette"]) == 4
        assert meta["input"]["shape"] == ["batch", 3, "height", "width"]
    # `labrun export` says both figures.
    assert re.search(r"parity \(dynamo\): 16 validation images of shapes/val, input 16x3x32x32 "
                     r"and 1x3x19x37: argmax agrees on \d+/17087 pixels \(.*\), max abs logit "
                     r"diff \S+ \(tolerance \S+\) -> ok", exports["log"].read_text())
    session = onnxruntime.InferenceSession(str(exports["onnx"]),
                                           providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 3, "height", "width"]


def test_exports_give_the_eager_argmax_at_sizes_they_never_saw(seg_run, exports):
    model, _ = eager_model(seg_run)
    session = onnxruntime.InferenceSession(str(exports["onnx"]),
                                           providers=["CPUExecutionProvider"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated
        traced = torch.jit.load(str(exports["torchscript"]))
    # Neither the example's 2x32x32 nor the parity check's 16x32x32 and 1x19x37.
    for k, (batch, height, width) in enumerate(((3, 24, 40), (1, 45, 29))):
        images = torch.stack([torch.from_numpy(shapes_image(10 * k + i, 48)[0]).permute(2, 0, 1)
                              for i in range(batch)]).float()
        x = (F.interpolate(images, size=(height, width), mode="bilinear", antialias=True)
             / 255 - 0.5) / 0.25
        with torch.no_grad():
            expected = model(x)
            scripted = traced(x)
        onnx = torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
        allowed = 1e-4 * max(1.0, expected.abs().max().item())
        for logits in (onnx, scripted):
            assert logits.shape == (batch, 4, height, width)
            assert (logits - expected).abs().max().item() <= allowed
            agree = (logits.argmax(1) == expected.argmax(1)).float().mean().item()
            assert agree >= 0.999


def test_a_failed_parity_check_names_both_figures_and_writes_nothing(seg_run, tmp_path,
                                                                     monkeypatch):
    # An agreement no file reaches: the check must fail, and say both figures in one line.
    monkeypatch.setattr(segmentation, "MIN_AGREEMENT", 1.01)
    with pytest.raises(Exception, match="argmax agrees on .* max abs logit diff") as error:
        export.export(seg_run, out=tmp_path / "m.torchscript.pt", fmt="torchscript",
                      check_data="random")
    assert "\n" not in str(error.value)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# Serving


def test_serve_answers_masks_of_the_upload_size_with_class_fractions(server):
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health["num_classes"] == 4
    agreements = []
    for k in range(6):
        image, truth = shapes_image(k)
        answer = post(server, f"{k}.png", encode(image))
        assert answer.status_code == 200, answer.text
        body = answer.json()
        mask, png = read_png(base64.b64decode(body["mask"]))
        assert png.mode == "P" and mask.shape == truth.shape  # class indices, the image's size
        assert set(np.unique(mask)) <= {0, 1, 2, 3}
        assert list(body["fractions"]) == CLASS_NAMES
        assert sum(body["fractions"].values()) == pytest.approx(1, abs=1e-4)
        shares = np.bincount(mask.ravel(), minlength=4) / mask.size
        assert list(body["fractions"].values()) == pytest.approx(shares.tolist(), abs=1e-5)
        agreements.append((mask == truth).mean())
    assert np.mean(agreements) >= MIN_TRUE_AGREEMENT, agreements
    # A non-square JPEG: resized to 32x32 for the model, its mask back to 60x36.
    image, _ = shapes_image(7, 48)
    stretched = np.asarray(Image.fromarray(image).resize((60, 36), Image.BILINEAR))
    answer = post(server, "wide.jpg", encode(stretched, "JPEG"))
    assert answer.status_code == 200, answer.text
    mask, _ = read_png(base64.b64decode(answer.json()["mask"]))
    assert mask.shape == (36, 60)


# The share of pixels a mask may differ by from the same image's mask when alone: onnxruntime
# may sum in another order for a batch than for one image, which can turn a near tie between two
# classes. Measured here: batched masks equal the lone ones to the pixel, while the test's images'
# masks differ from each other by 13% of their pixels at least.
SAME_MASK_TOLERANCE = 0.01


def mask_of(answer: dict) -> np.ndarray:
    return read_png(base64.b64decode(answer["mask"]))[0]


def assert_same_mask(got: np.ndarray, alone: np.ndarray, name: str) -> float:
    """The share of pixels `got` differs by from the image's lone mask, within the tolerance."""
    differ = (got != alone).mean()
    assert differ <= SAME_MASK_TOLERANCE, (name, differ)
    return differ


def test_requests_share_model_calls_and_each_gets_its_own_mask(server):
    files = [(f"{k}.png", encode(shapes_image(20 + k)[0])) for k in range(6)]
    alone = {}
    for name, data in files:
        answer = post(server, name, data)
        assert answer.status_code == 200 and answer.headers[HEADER] == "1", answer.text
        alone[name] = mask_of(answer.json())
    # The images must tell callers apart: were two masks alike within the tolerance, an answer
    # that went to the other caller could not show. Every pair differs by more.
    apart = {(a, b): (first != second).mean()
             for (a, first), (b, second) in itertools.combinations(alone.items(), 2)}
    assert min(apart.values()) > SAME_MASK_TOLERANCE, apart
    with ThreadPoolExecutor(len(files)) as pool:
        together = list(pool.map(lambda f: post(server, *f), files))
    assert all(r.status_code == 200 for r in together)
    assert max(int(r.headers[HEADER]) for r in together) > 1  # batched
    differ = [assert_same_mask(mask_of(answer.json()), alone[name], name)
              for (name, _), answer in zip(files, together, strict=True)]
    # One request's files share one model call, and each gets its own answer: its lone one.
    batch = httpx.post(f"{server}/predict/batch", timeout=60,
                       files=[("files", (name, data, "image/png")) for name, data in files[:3]])
    assert batch.status_code == 200, batch.text
    assert batch.headers[HEADER] == "3,3,3"
    results = batch.json()["results"]
    assert [r["filename"] for r in results] == ["0.png", "1.png", "2.png"]
    differ += [assert_same_mask(mask_of(r), alone[r["filename"]], r["filename"])
               for r in results]
    print(f"masks of different images differ by {min(apart.values()):.3f} of their pixels at "
          f"least; batched answers differ from the lone ones by {max(differ):.4f} at most")


def test_bad_uploads_get_a_4xx_and_the_server_goes_on(server):
    good = encode(shapes_image(0)[0])
    for name, data, status in (("notes.png", b"not an image at all", 400),
                               ("cut.png", good[:len(good) // 2], 400),
                               ("empty.png", b"", 400),
                               ("../up.png", good, 400)):
        answer = post(server, name, data)
        assert answer.status_code == status, (name, answer.text)
        assert answer.json()["error"]
    missing = httpx.post(f"{server}/predict", files={"image": ("a.png", good)}, timeout=30)
    assert missing.status_code == 422 and "multipart field 'file'" in missing.json()["error"]
    assert post(server, "fine.png", good).status_code == 200


# ---------------------------------------------------------------------------------------------
# Predict


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """Four PNG images (one not square) and a file that is no image; the true masks by stem."""
    folder = tmp_path_factory.mktemp("seg-images")
    truths = {}
    for k in range(3):
        image, truths[f"shape{k}"] = shapes_image(40 + k)
        (folder / f"shape{k}.png").write_bytes(encode(image))
    image, _ = shapes_image(43, 48)
    (folder / "wide.png").write_bytes(encode(np.ascontiguousarray(image[:30])))  # 48 x 30
    (folder / "broken.png").write_bytes(b"no image")
    return folder, truths


def test_predict_writes_mask_and_overlay_pngs_into_out(exports, image_folder, tmp_path):
    folder, truths = image_folder
    out = tmp_path / "masks"
    result = run_labrun("predict", str(exports["onnx"]), str(folder), "--out", str(out),
                        check=False)
    assert result.returncode == 1, result.stderr  # broken.png was skipped, and said so
    assert "skipped" in result.stderr and "broken.png" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{stem}{suffix}.png" for stem in ("shape0", "shape1", "shape2", "wide")
        for suffix in ("", "_overlay"))
    assert len(result.stdout.splitlines()) == 4 and "circle" in result.stdout
    segmenter = segmentation.Segmenter(exports["onnx"])
    agreements = []
    for stem in ("shape0", "shape1", "shape2", "wide"):
        source = folder / f"{stem}.png"
        size = Image.open(source).size
        mask, png = read_png((out / f"{stem}.png").read_bytes())
        assert png.mode == "P" and png.size == size
        assert np.array_equal(mask, segmenter.segment(source.read_bytes()))  # the server's code
        overlay = Image.open(out / f"{stem}_overlay.png")
        assert overlay.mode == "RGB" and overlay.size == size
        if stem in truths:
            agreements.append((mask == truths[stem]).mean())
    assert np.mean(agreements) >= MIN_TRUE_AGREEMENT, agreements
    assert sorted(p.name for p in folder.iterdir()) == [  # nothing written among the images
        "broken.png", "shape0.png", "shape1.png", "shape2.png", "wide.png"]


def test_predict_refuses_an_out_among_the_images_or_none(exports, image_folder, capsys):
    folder, _ = image_folder
    before = sorted(folder.iterdir())
    for args in (["--out", str(folder)], ["--out", str(folder / ".." / folder.name)], []):
        assert cli.main(["predict", str(exports["onnx"]), str(folder / "shape0.png"),
                         *args]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("error: ") and "--out" in error and "\n" not in error, error
    assert sorted(folder.iterdir()) == before  # nothing written
