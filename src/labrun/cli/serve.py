"""`labrun serve MODEL`: the arguments; the server is labrun.deploy.serve's."""

from __future__ import annotations

from labrun.deploy import serve
from labrun.deploy.serve import HEADER_TIMEOUT_S


def configure(parser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="exported .onnx / .pt file, a run folder or a checkpoint")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="server processes (default 1)")
    parser.add_argument("--max-upload-mb", type=float, default=10.0,
                        help="largest request body accepted, in MB (default 10)")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                        help="seconds a client has to send a request's headers before it is "
                             f"disconnected (default {HEADER_TIMEOUT_S:.0f})")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def run(args) -> int:
    return serve.serve(args.model, host=args.host, port=args.port, workers=args.workers,
                       max_upload_mb=args.max_upload_mb, header_timeout=args.header_timeout,
                       log_level=args.log_level)
