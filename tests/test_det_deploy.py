"""`labrun export`, serving and `labrun predict` of a detection run (task=detection): det_run
(FCOS on dataset=shapes_boxes, 96 px, 3 classes) exported to ONNX once, with the box decoding
and NMS in the graph and its parity against the eager detector recorded; a tampered score fails
that parity; TorchScript traces the same graph, passes its parity and answers as the ONNX file
does; the exported file served by labrun.deploy.serve's app on a real uvicorn on
127.0.0.1 answers boxes in the upload's own pixels (an upload of another size than the model's,
checked against eager PyTorch on the letterboxed image mapped back by this test's own
arithmetic), filters by score_threshold and max_detections, and batches concurrent requests
each to its lone answer; `labrun predict --out DIR` writes a JSON and an overlay PNG per image;
a detector other than FCOS is refused by the export in one line.

Cheap on purpose: one ONNX export and one in-process server, shared by every test (the
TorchScript test exports its own)."""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import built_once
from labrun import cli, models
from labrun.core.errors import LabrunError
from labrun.data.detection import transforms
from labrun.data.detection.boxes import Objects
from labrun.data.detection.shapes import CLASS_NAMES, draw
from labrun.deploy import export, runtime, serve
from labrun.deploy.served import free_port
from labrun.tasks import detection
from labrun.tasks.detection import export as plans
from labrun.tasks.detection import graph, serving
from labrun.train.checkpoint import for_inference

HEADER = "x-batch-size"
SIZE = 96  # experiment=det_shapes' dataset.image_size


@pytest.fixture(scope="session")
def det_export(det_run, tmp_path_factory) -> Path:
    """det_run's best checkpoint exported to ONNX once, parity-checked on its val images."""
    folder = built_once(tmp_path_factory, "det_export", lambda folder: export.export(
        det_run, out=folder / "det.onnx", fmt="onnx", verbose=True))
    return folder / "det.onnx"


def eager_detector(run: Path) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's FCOS in eager PyTorch, built here from its config, and the checkpoint."""
    state = for_inference(torch.load(run / "checkpoints" / "best.pt", weights_only=True))
    cfg = state["config"]
    model = models.build(OmegaConf.create(cfg["model"]), len(state["class_names"]),
                         image_size=cfg["dataset"]["image_size"])
    model.load_state_dict(state["model"])
    return model.eval(), state


def shapes_image(k: int) -> np.ndarray:
    """A drawn shapes_boxes image (uint8 96x96x3), different for each k."""
    return draw(np.random.default_rng(1000 + k), SIZE)[0]


def encode(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def post(url: str, name: str, data: bytes, path: str = "/predict", **params) -> httpx.Response:
    return httpx.post(f"{url}{path}", files={"file": (name, data, "image/png")}, params=params,
                      timeout=60)


def assert_same_answer(got: dict, expected: dict, box_tolerance: float, what: str) -> None:
    """The same detections (labels, boxes within box_tolerance px, scores within 1e-3), each
    matched once, whatever the order of near-equal scores."""
    assert len(got["boxes"]) == len(expected["boxes"]), (what, got, expected)
    free = list(range(len(got["boxes"])))
    for box, label, score in zip(expected["boxes"], expected["labels"], expected["scores"],
                                 strict=True):
        fits = [j for j in free if got["labels"][j] == label
                and abs(got["scores"][j] - score) <= 1e-3
                and np.abs(np.subtract(got["boxes"][j], box)).max() <= box_tolerance]
        assert fits, (what, label, score, box, got)
        free.remove(fits[0])


# ---------------------------------------------------------------------------------------------
# Export


def test_onnx_export_passes_parity_on_val_images_and_records_it(det_export):
    meta = json.loads(runtime.metadata_path(det_export).read_text())
    parity = meta["parity"]
    assert parity["passed"], parity
    assert parity["images_from"] == "16 validation images of shapes_boxes/val"
    # The val images as one batch, and the first alone: the batch axis is dynamic.
    assert parity["shapes"] == [[16, 3, SIZE, SIZE], [1, 3, SIZE, SIZE]]
    assert parity["eager"] >= 16 and parity["unmatched"] == 0
    assert parity["matched"] + parity["unmatched_at_margin"] >= parity["eager"]
    assert parity["min_iou"] >= 0.99 and parity["max_score_diff"] <= 1e-3
    assert (meta["task"], meta["deploy"], meta["format"]) == (
        "detection", "labrun.tasks.detection", "onnx")
    assert meta["class_names"] == CLASS_NAMES and meta["image_size"] == SIZE
    assert meta["pad_value"] == 114 and meta["score_threshold"] == pytest.approx(0.05)
    assert meta["detections_per_image"] == 100 and meta["label_offset"] == 1
    assert meta["input"]["shape"] == ["batch", 3, SIZE, SIZE]
    assert "letterboxed" in meta["input"]["values"] and "/ 255" in meta["input"]["values"]
    assert meta["output"]["columns"] == ["image", "x1", "y1", "x2", "y2", "score", "label"]
    session = onnxruntime.InferenceSession(str(det_export), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "batch"
    assert [o.name for o in session.get_outputs()] == ["detections"]


def test_a_tampered_score_fails_parity_in_one_line(det_run, det_export):
    _, state = eager_detector(det_run)
    target = export.Target("onnx", torch.float32, "cpu", "val")
    plan = detection.export_plan(state, det_run / "checkpoints" / "best.pt", target)
    images = plans.parity_images(state["config"]["dataset"], plan.metadata, "val")
    honest = plans.parity(det_export, target, plan.model, images, plan.metadata)
    assert honest["passed"] and honest["eager"] > 0, honest

    class Tampered(export.Target):
        def runtime(self, path):
            run = super().runtime(path)

            def tampered(batch):
                rows = run(batch).copy()
                rows[:, 5] -= 0.01  # every score, a hundredth lower
                return rows
            return tampered

    tampered = Tampered(target.fmt, target.dtype, target.device, target.check_data)
    broken = plans.parity(det_export, tampered, plan.model,
                              images, plan.metadata)
    assert not broken["passed"] and broken["unmatched"] > 0
    assert broken["failure"].startswith("parity check failed: ")
    assert "have no match" in broken["failure"] and "\n" not in broken["failure"]


def test_torchscript_export_passes_parity_and_serves_the_onnx_answers(det_run, det_export,
                                                                       tmp_path):
    out = tmp_path / "det.torchscript.pt"
    exported = export.export(det_run, out=out, fmt="torchscript")
    parity = exported.metadata["parity"]
    assert parity["passed"] and parity["eager"] >= 16 and parity["unmatched"] == 0, parity
    assert exported.metadata["exporter"] == "torch.jit.trace"
    data = encode(shapes_image(2))
    scripted = serving.Detector(out).detections(data)
    assert scripted["boxes"]
    assert_same_answer(scripted, serving.Detector(det_export).detections(data), 0.01, "ts")


# ---------------------------------------------------------------------------------------------
# Serving


@pytest.fixture(scope="module")
def server(det_export):
    """labrun.deploy.serve's app of the exported file on uvicorn on a free 127.0.0.1 port, in
    this process; its URL. One model call at a time and a 100 ms wait for company, so that
    concurrent requests share calls."""
    import uvicorn

    detector = detection.load(det_export, threads=1)
    app = serve.create_app(detector, 10 * 2**20, max_batch=8, max_delay_ms=100, model_calls=1)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(15)


def test_serve_answers_boxes_in_the_uploads_own_pixels(server, det_run):
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert (health["num_classes"], health["image_size"]) == (3, SIZE)
    # 150 x 110: letterboxed to 96 x 70 (scale 0.64) on the 96 x 96 canvas, 13 rows down.
    upload = np.asarray(Image.fromarray(shapes_image(0)).resize((150, 110), Image.BILINEAR))
    answer = post(server, "wide.png", encode(upload))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"boxes", "labels", "label_ids", "scores"}
    assert body["labels"] == [CLASS_NAMES[i] for i in body["label_ids"]]
    assert body["scores"] == sorted(body["scores"], reverse=True)
    # Eager PyTorch on the letterboxed upload, each box taken back by this test's arithmetic.
    model, _ = eager_detector(det_run)
    canvas, _ = transforms.letterbox(upload, Objects.none(), SIZE)
    with torch.inference_mode():
        found = model(canvas[None].float() / 255)[0]
    keep = (found["labels"] >= 1) & (found["scores"] >= 0.05)
    scale_x, scale_y, top = 96 / 150, 70 / 110, (96 - 70) // 2
    boxes = found["boxes"][keep].double()
    boxes[:, 0::2] = (boxes[:, 0::2] / scale_x).clamp(0, 150)
    boxes[:, 1::2] = ((boxes[:, 1::2] - top) / scale_y).clamp(0, 110)
    expected = {"boxes": boxes.tolist(),
                "labels": [CLASS_NAMES[i - 1] for i in found["labels"][keep].tolist()],
                "scores": found["scores"][keep].tolist()}
    assert len(expected["boxes"]) > 0
    assert_same_answer(body, expected, 1.0, "wide.png")
    for x1, y1, x2, y2 in body["boxes"]:
        assert 0 <= x1 <= x2 <= 150 and 0 <= y1 <= y2 <= 110


def test_score_threshold_and_max_detections_filter_the_answer(server):
    data = encode(shapes_image(1))
    everything = post(server, "a.png", data).json()
    assert len(everything["scores"]) >= 2 and min(everything["scores"]) >= 0.05
    threshold = everything["scores"][len(everything["scores"]) // 2]
    high = post(server, "a.png", data, score_threshold=threshold).json()
    kept = [i for i, score in enumerate(everything["scores"]) if score >= threshold]
    assert 0 < len(high["scores"]) == len(kept) < len(everything["scores"])
    assert high == {key: [value[i] for i in kept] for key, value in everything.items()}
    first = post(server, "a.png", data, max_detections=1).json()
    assert first == {key: value[:1] for key, value in everything.items()}
    for params in ({"score_threshold": 1.5}, {"max_detections": 0}):
        refused = post(server, "a.png", data, **params)
        assert refused.status_code == 422 and refused.json()["error"], params


def test_concurrent_requests_share_model_calls_and_each_gets_its_lone_answer(server):
    files = [(f"{k}.png", encode(shapes_image(20 + k))) for k in range(6)]
    alone = {}
    for name, data in files:
        answer = post(server, name, data)
        assert answer.status_code == 200 and answer.headers[HEADER] == "1", answer.text
        alone[name] = answer.json()
    assert len({json.dumps(a["boxes"]) for a in alone.values()}) == len(files)  # all differ
    with ThreadPoolExecutor(len(files)) as pool:
        together = list(pool.map(lambda f: post(server, *f), files))
    assert all(r.status_code == 200 for r in together)
    assert max(int(r.headers[HEADER]) for r in together) > 1  # batched
    for (name, _), answer in zip(files, together, strict=True):
        assert_same_answer(answer.json(), alone[name], 0.01, name)
    batch = httpx.post(f"{server}/predict/batch", timeout=60,
                       files=[("files", (name, data, "image/png")) for name, data in files[:3]])
    assert batch.status_code == 200, batch.text
    assert batch.headers[HEADER] == "3,3,3"
    for result in batch.json()["results"]:
        assert_same_answer(result, alone[result["filename"]], 0.01, result["filename"])


# ---------------------------------------------------------------------------------------------
# Predict


def test_predict_writes_a_json_and_an_overlay_png_per_image(det_export, tmp_path, capsys,
                                                             caplog):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "square.png").write_bytes(encode(shapes_image(40)))
    wide = np.asarray(Image.fromarray(shapes_image(41)).resize((150, 110), Image.BILINEAR))
    (folder / "wide.png").write_bytes(encode(wide))
    (folder / "broken.png").write_bytes(b"no image")
    out = tmp_path / "boxes"
    assert cli.main(["predict", str(det_export), str(folder), "--out", str(out)]) == 1
    printed = capsys.readouterr()
    assert "skipped" in caplog.text and "broken.png" in caplog.text  # and said so
    assert sorted(p.name for p in out.iterdir()) == [
        "square.json", "square_overlay.png", "wide.json", "wide_overlay.png"]
    assert len(printed.out.splitlines()) == 2 and " boxes" in printed.out
    detector = serving.Detector(det_export)
    for stem, size in (("square", (SIZE, SIZE)), ("wide", (150, 110))):
        source = folder / f"{stem}.png"
        written = json.loads((out / f"{stem}.json").read_text())
        assert (written["width"], written["height"]) == size
        answer = {key: written[key] for key in ("boxes", "labels", "label_ids", "scores")}
        # The server's answer (from a model call of its own: within float noise).
        assert_same_answer(answer, detector.detections(source.read_bytes()), 0.01, stem)
        assert answer["boxes"]
        overlay = Image.open(out / f"{stem}_overlay.png")
        assert overlay.mode == "RGB" and overlay.size == size
        drawn = np.asarray(overlay).astype(int) - np.asarray(Image.open(source)).astype(int)
        assert (np.abs(drawn).sum(2) > 0).mean() > 0.01  # boxes and names drawn on it
    assert sorted(p.name for p in folder.iterdir()) == ["broken.png", "square.png", "wide.png"]
    # An --out among the images is refused, before anything is written.
    assert cli.main(["predict", str(det_export), str(folder), "--out", str(folder)]) == 2
    assert "--out" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["broken.png", "square.png", "wide.png"]


def test_a_detector_without_an_in_graph_export_is_refused_in_one_line():
    from labrun.models.detection import torchvision_det_model

    model = torchvision_det_model(3, "ssdlite320_mobilenet_v3_large", SIZE).eval()
    with pytest.raises(LabrunError, match="has no export with its decoding and NMS") as error:
        graph.graph_of(model, SIZE, "ssdlite320_mobilenet_v3_large")
    assert "model=fcos" in str(error.value) and "\n" not in str(error.value)
