"""`labrun queue [--json] [--user U]`: the arguments; the view is labrun.launch.queue's."""

from __future__ import annotations

import getpass
import json


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the view as JSON")
    parser.add_argument("--user", default=None,
                        help="whose labrun sweeps to list (default: you)")


def run(args) -> int:
    from labrun.launch import queue

    view = queue.collect(args.user or getpass.getuser())
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        queue.show(view)
    return 0
