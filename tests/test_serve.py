"""`labrun serve` as a real uvicorn process on 127.0.0.1, and `labrun predict` offline: real
JPEGs, every kind of bad request (each followed by a healthy server), and a 500-request load."""

from __future__ import annotations

import csv
import io
import socket
import subprocess
import threading
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import LABRUN, PROJECT, run_labrun
from labrun import inference, models
from labrun.data import digits
from labrun.data.transforms import ValTransform, normalize_on_device
from labrun.serve import serving


@pytest.fixture(scope="module")
def onnx_model(digits_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("served") / "digits.onnx"
    run_labrun("export", str(digits_run), "--format", "onnx", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def server(onnx_model, tmp_path_factory):
    """`labrun serve MODEL` on a free port; yields its base URL; stopped by PID."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    try:
        with serving(onnx_model, log, cwd=PROJECT) as served:
            yield served.url
    finally:
        print(log.read_text()[-3000:])


@pytest.fixture(scope="module")
def jpegs() -> list[tuple[bytes, int]]:
    """Real JPEG files of validation digits (upscaled to 64 px, as a scanner might give them),
    with their labels."""
    val = digits.load(32, 0.2)["val"]
    files = []
    for i in range(0, 40, 5):
        image = cv2.resize(val.load(i), (64, 64), interpolation=cv2.INTER_LINEAR)
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        files.append((buffer.getvalue(), int(val.labels[i])))
    return files


def assert_healthy(url: str, jpeg: bytes) -> None:
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    answer = httpx.post(f"{url}/predict", files={"file": ("ok.jpg", jpeg)}, timeout=10)
    assert answer.status_code == 200 and len(answer.json()["top"]) == 5


def test_health_and_metadata(server):
    health = httpx.get(f"{server}/health").json()
    assert health == {"status": "ok", "model": "digits.onnx", "format": "onnx",
                      "num_classes": 10}
    meta = httpx.get(f"{server}/metadata").json()
    assert meta["class_names"] == [str(d) for d in range(10)] and meta["image_size"] == 32


def test_the_server_decodes_jpegs_no_smaller_than_the_val_resize_needs(onnx_model):
    """The digits run validates at 32 px after resizing the short side to 37 (32 / 0.875): a
    70 px JPEG must not be DCT-decoded to 35 px and upscaled, and the result stays the val
    loader's input (which decodes only the centre crop) within rounding."""
    from labrun.data.decode import open_image

    predictor = inference.Predictor(onnx_model)
    rng = np.random.default_rng(0)
    for (height, width), decoded in (((70, 90), (70, 90)), ((90, 76), (45, 38)),
                                     ((40, 50), (40, 50))):
        image = cv2.GaussianBlur(rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
                                 (0, 0), 2)
        jpeg = cv2.imencode(".jpg", image)[1].tobytes()
        assert predictor.decode(jpeg).shape[:2] == decoded
        served = predictor.preprocess(predictor.decode(jpeg)).int()
        loader = predictor.transform(open_image(jpeg, "turbojpeg")).int()
        assert (served - loader).abs().float().mean() < 4  # the crops round differently


def test_predictions_match_the_offline_predictor(server, onnx_model, jpegs):
    predictor = inference.Predictor(onnx_model)
    correct = 0
    for jpeg, label in jpegs:
        answer = httpx.post(f"{server}/predict?k=3", files={"file": ("digit.jpg", jpeg,
                                                                     "image/jpeg")})
        assert answer.status_code == 200
        top = answer.json()["top"]
        expected = predictor.predict([predictor.decode(jpeg)], k=3)[0]
        assert [t["index"] for t in top] == [t["index"] for t in expected]
        assert [t["class"] for t in top] == [str(t["index"]) for t in top]
        np.testing.assert_allclose([t["prob"] for t in top], [t["prob"] for t in expected],
                                   atol=1e-5)
        correct += top[0]["index"] == label
    assert correct >= len(jpegs) // 2, f"only {correct}/{len(jpegs)} digits right"

    files = [("files", (f"{i}.jpg", jpeg)) for i, (jpeg, _) in enumerate(jpegs[:3])]
    batch = httpx.post(f"{server}/predict/batch?k=2", files=files).json()["results"]
    assert [r["filename"] for r in batch] == ["0.jpg", "1.jpg", "2.jpg"]
    for (jpeg, _), result in zip(jpegs[:3], batch, strict=True):
        single = httpx.post(f"{server}/predict?k=2", files={"file": ("a.jpg", jpeg)}).json()
        assert [t["index"] for t in result["top"]] == [t["index"] for t in single["top"]]


def test_served_probabilities_equal_the_validation_pipeline(server, digits_run):
    """A lossless PNG of a validation image, served, gives the eager model's probabilities
    on that image after the validation loader's transform and the trainer's normalisation."""
    state = torch.load(digits_run / "checkpoints" / "best.pt", weights_only=True)
    model = models.build(OmegaConf.create(state["config"]["model"]), 10).eval()
    model.load_state_dict(state["model"])
    dataset = state["config"]["dataset"]
    mean = torch.tensor(dataset["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(dataset["std"]).view(1, 3, 1, 1)
    transform = ValTransform(dataset["image_size"], dataset["augment"]["val_resize_ratio"])
    val = digits.load(dataset["image_size"], dataset["val_fraction"])["val"]
    for i in range(4):
        buffer = io.BytesIO()
        Image.fromarray(val.load(i)).save(buffer, format="PNG")
        answer = httpx.post(f"{server}/predict?k=10", files={"file": ("v.png", buffer.getvalue())})
        served = {t["index"]: t["prob"] for t in answer.json()["top"]}
        with torch.no_grad():
            x = normalize_on_device(transform(val.load(i))[None], mean, std)
            expected = model(x).double().softmax(1)[0]
        np.testing.assert_allclose([served[c] for c in range(10)], expected.numpy(), atol=1e-5)


def chunks(total: int, head: bytes):
    """A multipart body streamed without Content-Length (chunked): counted by the server."""
    yield head
    for _ in range(total >> 20):
        yield b"\xff" * (1 << 20)
    yield b"\r\n--b--\r\n"


BAD_REQUESTS = {
    "empty body": (422, dict()),
    "empty file": (400, dict(files={"file": ("a.jpg", b"")})),
    "not an image": (400, dict(files={"file": ("a.jpg", b"GIF89a this is not really a gif")})),
    "truncated jpeg": (400, "truncated"),
    "50 MB upload": (413, dict(files={"file": ("big.jpg", b"\xff" * (50 << 20))})),
    "50 MB chunked upload": (413, dict(
        content=chunks(50 << 20, b'--b\r\nContent-Disposition: form-data; name="file"; '
                                 b'filename="big.jpg"\r\n\r\n'),
        headers={"content-type": "multipart/form-data; boundary=b"})),
    "sliver image": (400, "sliver"),
    "wrong field name": (422, "wrong field"),
    "raw image body": (422, "raw body"),
    "path-like filename": (400, "../../etc/passwd"),
    "nested filename": (400, "uploads/a.jpg"),
    "k out of range": (422, "k=0"),
    "batch with a bad file": (400, "bad batch"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_json_and_server_stays_healthy(server, jpegs, case):
    status, request = BAD_REQUESTS[case]
    jpeg = jpegs[0][0]
    url = f"{server}/predict"
    if request == "truncated":
        request = dict(files={"file": ("cut.jpg", jpeg[: len(jpeg) // 2])})
    elif request == "sliver":  # 1 x 5000 px: resizing its short side to 32 px would explode
        buffer = io.BytesIO()
        Image.new("RGB", (5000, 1)).save(buffer, format="PNG")
        request = dict(files={"file": ("sliver.png", buffer.getvalue())})
    elif request == "wrong field":
        request = dict(files={"image": ("a.jpg", jpeg)})
    elif request == "raw body":
        request = dict(content=jpeg, headers={"content-type": "image/jpeg"})
    elif request == "k=0":
        url, request = f"{url}?k=0", dict(files={"file": ("a.jpg", jpeg)})
    elif request == "bad batch":
        url = f"{server}/predict/batch"
        request = dict(files=[("files", ("a.jpg", jpeg)), ("files", ("b.jpg", b"junk"))])
    elif isinstance(request, str):  # a filename
        request = dict(files={"file": (request, jpeg)})
    answer = httpx.post(url, timeout=60, **request)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert isinstance(error, str) and error
    if status == 413:
        assert "10 MB" in error
    assert_healthy(server, jpeg)


def test_windows_client_path_is_reduced_to_its_file_name(server, jpegs):
    """Old browsers sent the client's full path; the multipart parser keeps only the name,
    so the answer echoes no path."""
    files = [("files", ("C:\\Users\\me\\digit.jpg", jpegs[0][0]))]
    answer = httpx.post(f"{server}/predict/batch", files=files)
    assert answer.status_code == 200 and answer.json()["results"][0]["filename"] == "digit.jpg"


def test_declared_oversize_body_is_refused_before_it_is_sent(server, jpegs):
    """Only the headers go out; the 413 must come back without the server waiting for 50 MB."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /predict HTTP/1.1\r\nHost: test\r\n"
                           b"Content-Type: multipart/form-data; boundary=b\r\n"
                           b"Content-Length: 52428800\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):  # the server closes after its 413
            answer += chunk
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 413") and '"error"' in answer, answer
    assert_healthy(server, jpegs[0][0])


def test_500_requests_from_8_clients(server, jpegs):
    failures: list[str] = []
    counter = iter(range(500))
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=server, timeout=60) as session:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                jpeg = jpegs[i % len(jpegs)][0]
                try:
                    answer = session.post("/predict", files={"file": (f"{i}.jpg", jpeg)})
                    if answer.status_code != 200 or len(answer.json()["top"]) != 5:
                        failures.append(f"{i}: {answer.status_code} {answer.text[:100]}")
                except httpx.HTTPError as error:
                    failures.append(f"{i}: {error!r}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"500 requests from 8 clients in {time.perf_counter() - started:.1f} s")
    assert failures == []
    assert_healthy(server, jpegs[0][0])


def test_predict_command_matches_the_server(server, digits_run, jpegs, tmp_path):
    """`labrun predict RUN_DIR` (exported on the fly) answers what the server answers."""
    folder = tmp_path / "images"
    (folder / "nested").mkdir(parents=True)
    for i, (jpeg, _) in enumerate(jpegs[:4]):
        (folder / ("nested" if i % 2 else "") / f"{i}.jpg").write_bytes(jpeg)
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "predictions.csv"
    result = run_labrun("predict", str(digits_run), str(folder), "--k", "3", "--csv", str(out),
                        check=False)
    assert result.returncode == 1  # one file skipped
    assert "skipped" in result.stderr and "broken.jpg" in result.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 4 * 3 and rows[0].keys() == {"path", "rank", "class", "index", "prob"}
    for path in sorted({row["path"] for row in rows}):
        answer = httpx.post(f"{server}/predict?k=3",
                            files={"file": ("a.jpg", Path(path).read_bytes())}).json()["top"]
        mine = [row for row in rows if row["path"] == path]
        assert [int(row["index"]) for row in mine] == [t["index"] for t in answer]
        np.testing.assert_allclose([float(r["prob"]) for r in mine],
                                   [t["prob"] for t in answer], atol=1e-5)


def test_serve_refuses_a_taken_port_in_one_line(onnx_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([LABRUN, "serve", str(onnx_model), "--port", str(port)],
                                capture_output=True, text=True, timeout=60, cwd=PROJECT)
    assert result.returncode == 2 and "cannot listen" in result.stderr, result.stderr
