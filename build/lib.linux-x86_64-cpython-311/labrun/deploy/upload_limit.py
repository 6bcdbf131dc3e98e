"""UploadLimit: the outermost ASGI layer of `labrun serve`, which stops request bodies at
--max-upload-mb. Written by hand: uvicorn sets no limit on the size of a request body."""

from __future__ import annotations

import json


class UploadLimit:
    """The outermost ASGI layer: a body over the limit gets 413 without being read.

    A declared Content-Length over the limit is refused before any byte is read; a body without
    one (chunked) is counted as it streams and cut off at the limit. Whatever the app then
    answers about the body it could not finish reading is replaced by the 413. An answer sent
    before the app read the body to its end (a 422 for a raw image body, say) closes the
    connection: uvicorn would otherwise read and discard the rest to keep it alive, a chunked
    body without end included.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.refuse(send)
            return
        unread = b"transfer-encoding" in headers or declared not in (None, b"0")  # a body
        received, over, answered = 0, False, False

        async def limited_receive():
            nonlocal received, over, unread
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
                unread = message.get("more_body", False)
            return message

        async def guarded_send(message) -> None:
            nonlocal answered
            if over:
                if not answered and message["type"] == "http.response.start":
                    answered = True
                    await self.refuse(send)
                return
            if message["type"] == "http.response.start":
                answered = True
                if unread:  # answered before the body was read to its end: close, don't drain
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not answered:
            await self.refuse(send)

    async def refuse(self, send) -> None:
        limit_mb = self.max_bytes / 2**20
        body = json.dumps({"error": f"upload larger than the {limit_mb:g} MB limit "
                                    f"(labrun serve --max-upload-mb)"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
