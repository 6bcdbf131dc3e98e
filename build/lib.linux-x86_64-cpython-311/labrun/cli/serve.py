"""`labrun serve MODEL`: the arguments; the server is labrun.deploy.serve's."""

from __future__ import annotations

from labrun.deploy import serve
from labrun.deploy.serve import HEADER_TIMEOUT_S, MAX_BATCH, MAX_DELAY_MS


def configure(parser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="exported .onnx / .pt file, a run folder or a checkpoint")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind, for the API and its /metrics (default "
                             "127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1,
                        help="server processes (default 1); /metrics adds up all of them")
    parser.add_argument("--max-upload-mb", type=float, default=10.0,
                        help="largest request body accepted, in MB (default 10)")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                        help="seconds a client has to send a request's headers before it is "
                             f"disconnected (default {HEADER_TIMEOUT_S:.0f})")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH, metavar="N",
                        help="images of concurrent requests run in one model call, at most "
                             f"(default {MAX_BATCH}; 1: one call per image)")
    parser.add_argument("--max-delay-ms", type=float, default=MAX_DELAY_MS, metavar="T",
                        help="how long a request may wait for others to join its model call, "
                             f"in milliseconds (default {MAX_DELAY_MS:g})")
    parser.add_argument("--model-calls", type=int, default=None, metavar="N",
                        help="model calls at once, sharing the cores (default: one on a GPU; "
                             "on a CPU one per core plus one, on one thread each, the most "
                             "requests/s under load; 1: a lone request answered soonest)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def run(args) -> int:
    return serve.serve(args.model, host=args.host, port=args.port, workers=args.workers,
                       max_upload_mb=args.max_upload_mb, header_timeout=args.header_timeout,
                       log_level=args.log_level, max_batch=args.max_batch,
                       max_delay_ms=args.max_delay_ms, model_calls=args.model_calls)
