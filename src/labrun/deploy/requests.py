"""What a task's JSON route reads (labrun.tasks.lm's POST /generate, labrun.tasks.text's POST
/predict): a body that must be one JSON object, and the error that a route turns into a 4xx.

The routes read the body themselves rather than through a pydantic model, so that each bad
body (not UTF-8, not JSON, not an object, a field missing or of the wrong type) gets its own
line saying what to send instead."""

from __future__ import annotations

import json
from typing import Any

from labrun.core.errors import LabrunError, one_line


class RequestError(LabrunError):
    """A request that cannot be answered; the message says what to send instead."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status  # 400: no readable JSON object; 413: too much at once; 422: a field


def json_object(body: bytes, example: str) -> dict[str, Any]:
    """The body's JSON object; RequestError (400) says what it is instead and shows `example`."""
    try:
        fields = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise RequestError(f"the body is not UTF-8 (byte {error.start}); send a JSON object "
                           f"such as {example}", 400) from None
    except ValueError as error:
        raise RequestError(f"the body is not JSON ({one_line(error)}); send a JSON object "
                           f"such as {example}", 400) from None
    if not isinstance(fields, dict):
        raise RequestError(f"the body is JSON but not an object; send one such as {example}",
                           400)
    return fields
