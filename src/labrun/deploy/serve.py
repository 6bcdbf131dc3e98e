"""`labrun serve MODEL`: an exported model behind FastAPI on uvicorn, its routes its task's.

    GET  /health     {"status": "ok", "model", "format", "device", ...and the task's fields}
    GET  /metadata   the metadata JSON written by `labrun export`
    GET  /metrics    Prometheus metrics, of all --workers (labrun.monitoring.serve_metrics)

and the routes of the model's task, which its deploy module adds (labrun.deploy.hooks):

    image classifier   POST /predict?k=5 (multipart field `file`) -> {"top": [{"class",
                       "index", "prob"}, ...]}; POST /predict/batch (fields `files`) ->
                       {"results": [{"filename", "top"}, ...]}      (labrun.tasks.classification)
    segmentation       POST /predict -> {"mask": PNG of class indices, as base64, "fractions":
                       {class: share of the pixels}}; /predict/batch  (labrun.tasks.segmentation)
    language model     POST /generate JSON {"prompt", "max_tokens", "temperature", "seed"} ->
                       {"text", "tokens", "token_ids", "prompt_tokens", "seed"} (labrun.tasks.lm)

A request for a route the server does not have is a 404 that says what it does answer.

MODEL is an exported .onnx or .pt file (with its metadata JSON), a run folder or a checkpoint
(exported to ONNX in a temp folder first). A bad request (no file, not an image, truncated, too
big, a path as filename) gets a 4xx answer with {"error": "..."} and never takes the server down.
Request bodies stop at --max-upload-mb, and a client that has not sent a whole request head
within --header-timeout seconds is disconnected (HeaderDeadlineProtocol), so slow clients cannot
hold every connection.

What every task's routes share is the Server's: uploads decoded and prepared in the thread pool
(the model's prepare), dynamic batching (concurrent requests' inputs share one model call of up
to --max-batch, gathered for at most --max-delay-ms after the first: labrun.deploy.batching;
each answer's X-Batch-Size header says how many inputs its model call took), model calls in
their own threads, off the event loop (on a CPU, one call per core plus one, each on one
thread), and a failed model call as its request's 5xx.
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import logging
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from labrun.core import probes
from labrun.core.errors import LabrunError, one_line
from labrun.deploy import batching, hooks, load
from labrun.deploy import runtime as inference
from labrun.deploy.upload_limit import UploadLimit
from labrun.monitoring import serve_metrics

log = logging.getLogger(__name__)

MAX_BATCH_FILES = 64
# Past this many open connections and tasks, uvicorn answers 503 instead of queueing more
# uploads in memory.
MAX_CONCURRENCY = 128
# Seconds a client has to send a whole request head, from connecting or from the end of its
# previous answer. Without a deadline (uvicorn has none), 128 clients trickling header bytes
# (slowloris) would hold every connection slot and everyone else would get 503.
HEADER_TIMEOUT_S = 10.0
# With --workers N, uvicorn's supervisor pings each worker and kills and restarts one that does
# not answer within this many seconds (uvicorn's default: 5). A worker answers only once it is
# running, and it starts by importing labrun.deploy.serve (torch, onnxruntime, FastAPI): 17 s
# measured on a loaded 2-core machine, where the 5 s default restarted every worker forever.
WORKER_HEALTHCHECK_TIMEOUT_S = 60
ENV_MODEL, ENV_MAX_BYTES, ENV_CORES = ("LABRUN_SERVE_MODEL", "LABRUN_SERVE_MAX_UPLOAD_BYTES",
                                       "LABRUN_SERVE_CORES")
ENV_HEADER_TIMEOUT = "LABRUN_SERVE_HEADER_TIMEOUT_S"
# Dynamic batching's defaults (labrun.deploy.batching says how they were measured).
MAX_BATCH, MAX_DELAY_MS = batching.MAX_BATCH, batching.MAX_DELAY_MS
ENV_MAX_BATCH, ENV_MAX_DELAY_MS = "LABRUN_SERVE_MAX_BATCH", "LABRUN_SERVE_MAX_DELAY_MS"
ENV_MODEL_CALLS = "LABRUN_SERVE_MODEL_CALLS"  # empty: batching.model_calls' default
# On each answer: how many images the model call that answered it took (/predict/batch: one
# number per file, in order), to see batching at work from a client.
BATCH_SIZE_HEADER = "X-Batch-Size"
# What a server answers with: the served model its task's deploy module loads (hooks: load).
ServedModel = Any


def serve(model: str | Path, *, host: str = "127.0.0.1", port: int = 8000, workers: int = 1,
          max_upload_mb: float = 10.0, header_timeout: float = HEADER_TIMEOUT_S,
          log_level: str = "info", max_batch: int = MAX_BATCH,
          max_delay_ms: float = MAX_DELAY_MS, model_calls: int | None = None) -> int:
    """Serve MODEL until the server is stopped (Ctrl-C, SIGTERM)."""
    import uvicorn

    if workers < 1:
        raise LabrunError(f"--workers={workers} must be 1 or more")
    if max_upload_mb <= 0:
        raise LabrunError(f"--max-upload-mb={max_upload_mb} must be greater than 0")
    if header_timeout <= 0:
        raise LabrunError(f"--header-timeout={header_timeout} must be greater than 0")
    if max_batch < 1:
        raise LabrunError(f"--max-batch={max_batch} must be 1 or more (1: no batching)")
    if max_delay_ms < 0:
        raise LabrunError(f"--max-delay-ms={max_delay_ms:g} must be 0 or more")
    if model_calls is not None and model_calls < 1:
        raise LabrunError(f"--model-calls={model_calls} must be 1 or more")
    probes.check_port(host, port, "pick another --port or --host")  # before the model loads
    max_bytes = int(max_upload_mb * 2**20)
    cores = inference.default_threads(workers)  # each worker's share
    predictor, tmp, calls = load_model(model, cores, model_calls)
    metrics_folder = serve_metrics.prepare(workers)  # before uvicorn starts the workers
    try:
        meta = predictor.metadata
        if not is_loopback(host):
            log.warning("warning: binding %s: the server is reachable from other machines "
                        "and has no authentication", host)
        deploy = hooks.of_metadata(meta, predictor.model_path)
        what, routes = deploy.describe(predictor), deploy.USAGE
        log.info("serving %s (%s, %s; %d model calls at once on the %s, %d intra-op thread%s "
                 "each) on http://%s:%d  %s; GET /health, GET /metadata, GET /metrics", model,
                 meta["format"], what, calls, predictor.device.upper(), predictor.threads,
                 "" if predictor.threads == 1 else "s", host, port, routes)
        os.environ[ENV_HEADER_TIMEOUT] = str(header_timeout)  # for every worker process
        # The protocol by name: a worker process then imports labrun.deploy.serve when its server
        # starts, after it began answering the supervisor's pings, not while it unpickles its
        # config (the class itself would be imported before the first answer).
        common = dict(host=host, port=port, log_level=log_level,
                      limit_concurrency=MAX_CONCURRENCY,
                      http=f"{__name__}:{HeaderDeadlineProtocol.__name__}")
        if workers == 1:
            uvicorn.run(create_app(predictor, max_bytes, max_batch=max_batch,
                                   max_delay_ms=max_delay_ms, model_calls=calls), **common)
        else:
            # Each worker process builds its own app from the (exported) model file.
            os.environ.update({ENV_MODEL: str(predictor.model_path), ENV_MAX_BYTES: str(max_bytes),
                               ENV_CORES: str(cores), ENV_MAX_BATCH: str(max_batch),
                               ENV_MAX_DELAY_MS: str(max_delay_ms),
                               ENV_MODEL_CALLS: "" if model_calls is None else str(model_calls)})
            del predictor
            if "timeout_worker_healthcheck" in inspect.signature(uvicorn.run).parameters:
                common["timeout_worker_healthcheck"] = WORKER_HEALTHCHECK_TIMEOUT_S
            uvicorn.run("labrun.deploy.serve:app_from_env", factory=True, workers=workers,
                        **common)
    finally:
        load.remove_folder(tmp)
        serve_metrics.cleanup(metrics_folder)
    return 0


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request head (HEADER_TIMEOUT_S).

    h11's rather than httptools': httptools' C parser answered 10% more requests/s without a
    model (`labrun bench serve`'s free-model server, medians of 6 alternating rounds: 338 and 343
    against 303 and 315), but it takes a request head of any size, where h11 refuses one over
    16 KiB (tests/faults/test_server.py, huge headers).

    The deadline starts when the connection opens, or when the first byte of a next request on
    a kept-alive connection arrives (uvicorn's keep-alive timeout covers the silence before it),
    and ends when h11 has the whole head, which is when uvicorn starts a new request cycle.
    A slow body is the upload limit's business, not this deadline's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = float(os.environ.get(ENV_HEADER_TIMEOUT, HEADER_TIMEOUT_S))
        self.head_deadline: Any = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_deadline()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # these bytes begin a request head
            self._start_deadline()
        super().data_received(data)
        if self.cycle is not cycle:  # the head is complete: a new request cycle began
            self._stop_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self.head_deadline is None:
            self.head_deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _stop_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _too_slow(self) -> None:
        self.head_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # still no whole head
            self.transport.close()


def app_from_env():
    """uvicorn's app factory for --workers N: each worker loads the model once."""
    requested = os.environ[ENV_MODEL_CALLS]
    predictor, _, calls = load_model(os.environ[ENV_MODEL], int(os.environ[ENV_CORES]),
                                     int(requested) if requested else None)
    return create_app(predictor, int(os.environ[ENV_MAX_BYTES]),
                      max_batch=int(os.environ[ENV_MAX_BATCH]),
                      max_delay_ms=float(os.environ[ENV_MAX_DELAY_MS]), model_calls=calls)


def load_model(model: str | Path, cores: int, model_calls: int | None
               ) -> tuple[ServedModel, Path | None, int]:
    """The predictor (load.load: whatever the model's task is served with), its temp folder,
    and how many model calls run at once."""
    # Intra-op threads are fixed when the model loads, before its device is known: they are
    # shared out as on a CPU (on a GPU, where one call runs at a time, they barely matter).
    threads = batching.threads_per_call(cores, batching.model_calls("cpu", cores, model_calls))
    predictor, tmp = load.load(model, threads, task=None)
    return predictor, tmp, batching.model_calls(predictor.device, cores, model_calls)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---------------------------------------------------------------------------------------------
# The application


def create_app(predictor: ServedModel, max_upload_bytes: int, *, max_batch: int = MAX_BATCH,
               max_delay_ms: float = MAX_DELAY_MS, model_calls: int = 1):
    """The app of any task's served model: what every server answers, and its task's routes."""
    deploy = hooks.of_metadata(predictor.metadata, predictor.model_path)
    server = Server(predictor, max_batch=max_batch, max_delay_ms=max_delay_ms,
                    model_calls=model_calls)
    app = new_app(predictor, server.lifespan, deploy.USAGE)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": predictor.model_path.name,
                "format": predictor.metadata["format"], **deploy.health(predictor),
                "device": predictor.device, "model_calls": model_calls,
                "threads_per_call": predictor.threads}

    @app.get("/metadata")
    def metadata() -> dict[str, Any]:
        return predictor.metadata

    deploy.add_routes(app, predictor, server)
    return outer_layers(app, predictor, max_upload_bytes)


class Server:
    """What a task's routes are built on (its deploy module's add_routes(app, model, server)).

    Decoding and preprocessing run per request in the thread pool, where the decoders release
    the GIL, so concurrent requests use every core; a bad upload fails its own request there,
    before any model call. Model calls go through a batcher (batched inputs) or call_model
    (one request's call, such as a language model's token after token), at most model_calls
    at once, off the event loop."""

    def __init__(self, model: ServedModel, *, max_batch: int, max_delay_ms: float,
                 model_calls: int):
        self.model = model
        self.max_batch, self.max_delay_ms, self.model_calls = max_batch, max_delay_ms, model_calls
        self.batchers: list[batching.Batcher] = []
        self.limiter: Any = None  # call_model's, made in the server's event loop

    def batcher(self, run_batch) -> batching.Batcher:
        """A batcher of `run_batch` (a list of inputs -> their answers, in order), started and
        closed with the server. Every call goes through it, --max-batch 1 included."""
        batcher = batching.Batcher(run_batch, max_batch=self.max_batch,
                                   max_delay_ms=self.max_delay_ms, model_calls=self.model_calls)
        self.batchers.append(batcher)
        return batcher

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        import anyio

        self.limiter = anyio.CapacityLimiter(self.model_calls)
        for batcher in self.batchers:
            batcher.start()
        yield
        for batcher in self.batchers:
            await batcher.close()  # after uvicorn has answered the requests in flight

    async def prepared(self, uploads: list[UploadFile], fields: list[str]) -> list[Any]:
        """Each upload as the model's prepare() makes it, or a 400 naming the field."""
        return await run_in_threadpool(lambda: [
            read_upload(self.model, upload, field)
            for upload, field in zip(uploads, fields, strict=True)])

    async def batched(self, batcher: batching.Batcher, inputs: list[Any], response: Response
                      ) -> list[Any]:
        """Each input's answer from the batcher's model calls; the X-Batch-Size header says
        how many inputs each call took (one number per input, in order)."""
        answers = await infer(batcher.submit_many(inputs))
        response.headers[BATCH_SIZE_HEADER] = ",".join(str(size) for _, size in answers)
        return [answer for answer, _ in answers]

    async def call_model(self, function, *args) -> Any:
        """function(*args) in a thread of its own, at most model_calls at once."""
        import anyio

        return await anyio.to_thread.run_sync(function, *args, limiter=self.limiter)

    @staticmethod
    def check_batch(files: list[UploadFile]) -> None:
        if len(files) > MAX_BATCH_FILES:
            raise HTTPException(413, f"{len(files)} files; send at most {MAX_BATCH_FILES} "
                                     f"per batch")


def new_app(predictor: ServedModel, lifespan, usage: str) -> FastAPI:
    """A FastAPI app whose every error answer is {"error": "..."}; a route it does not have
    answers with `usage`, what it does answer."""
    app = FastAPI(title="labrun serve", version=str(predictor.metadata.get("versions", {})
                                                    .get("labrun", "")), lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        detail = str(error.detail)
        if error.status_code == 404 and "route" not in request.scope:  # no route matched
            detail = f"no route {request.method} {request.url.path}: this server answers {usage}"
        return JSONResponse({"error": detail}, status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": describe_validation(error)}, status_code=422)

    return app


def outer_layers(app: FastAPI, predictor: ServedModel, max_upload_bytes: int):
    """The app inside its upload limit, inside its metrics (labrun.monitoring.serve_metrics)."""
    return serve_metrics.ServeMetrics(UploadLimit(app, max_upload_bytes), app.routes,
                                      model=predictor.model_path.name,
                                      model_format=predictor.metadata["format"])


async def infer(pending):
    """A batcher's answer; its failure as this request's 5xx (the server goes on)."""
    try:
        return await pending
    except batching.BatcherClosed:
        raise HTTPException(503, "the server is shutting down; try again") from None
    except Exception as error:  # noqa: BLE001 - the model failed on this request's batch
        raise HTTPException(500, f"inference failed: {one_line(error)}") from None


def read_upload(predictor: ServedModel, upload: UploadFile, field: str) -> Any:
    """The upload's image, prepared for the model (its prepare), or a 400 naming it."""
    name = upload.filename or ""
    if is_path_like(name):
        raise HTTPException(400, f"{field}: the filename must be a plain file name, not a "
                                 f"path: {name[:100]!r}")
    try:
        return predictor.prepare(upload.file.read())
    except inference.ImageError as error:
        raise HTTPException(400, f"{field} ({name[:100]}): {error}") from None


def is_path_like(name: str) -> bool:
    """Browsers send a bare file name; a separator, a '..' or a control character is a crafted
    request (nothing here writes by that name, but it is refused rather than echoed back)."""
    if any(ord(c) < 32 for c in name):
        return True
    plain = PurePosixPath(name).name == name and PureWindowsPath(name).name == name
    return not plain or name in (".", "..")


def describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        location = [str(x) for x in item.get("loc", ()) if x not in ("body", "query")]
        field = ".".join(location) or "request"
        if item.get("type") == "missing" and field in ("file", "files"):
            parts.append(f"no multipart field '{field}': send the image(s) as "
                         f"multipart/form-data field '{field}'")
        else:
            parts.append(f"{field}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"
