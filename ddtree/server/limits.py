"""What bounds one client's cost to the server: body size, time to send a request, connections, shutdown.

    limits = Limits(max_request_bytes=8 << 20)              # `ddtree serve` flags (docs/interfaces.md 11)
    app.add_middleware(BodyLimit, limits=limits, count=...) # the body read whole, bounded, before a route
    uvicorn.Config(app, http=deadline_protocol(limits), timeout_graceful_shutdown=limits.shutdown_timeout_s, ...)
    endpoint_label(app, scope) -> a route's path or "other" (metric labels from a fixed set)
    shown(text) -> text cut to a length fit to echo in an error message

A body is read before any route sees it: past `max_request_bytes` (declared in Content-Length or
counted while reading) it is a 413, not sent whole within `body_timeout_s` a 408; both close the
connection. A connection that has not sent a whole request head within `head_timeout_s` of opening
(or of its last response) is closed, and more than `max_connections` open at once are closed at
accept, so idle or slow clients cannot hold the file descriptors. Shutdown waits for requests in
flight at most `shutdown_timeout_s`, then cancels them.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields

import click

from ddtree.cli_types import FiniteFloatRange
from ddtree.server.errors import error_body

SHOWN_CHARS = 80                # longest piece of client text echoed in an error message


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 8 << 20    # a body; Kimi's 262144-token context as text or ids fits
    max_json_depth: int = 32            # nesting of arrays / objects in a body (a tool schema included)
    max_json_values: int | None = None  # values in a body; None: the context + 65536 (validate.py)
    body_timeout_s: float = 30.0        # headers received -> whole body received
    head_timeout_s: float = 10.0        # connection open (or last response) -> whole request head
    max_connections: int = 512          # open at once; more are closed at accept
    shutdown_timeout_s: float = 30.0            # SIGTERM: requests in flight get this long, then are cancelled


def limit_options(command):
    """The click options of every Limits field (`ddtree serve --max-request-bytes N ...`); the command gets
    them as keyword arguments, `Limits(**kwargs)` takes them back."""
    helps = {"max_request_bytes": "Largest request body in bytes; more is a 413.",
             "max_json_depth": "Deepest nesting of arrays / objects in a body; more is a 400.",
             "max_json_values": "Most JSON values in a body (default: the context + 65536); more is a 400.",
             "body_timeout_s": "Seconds a client has to send a whole body once its headers came; then a 408.",
             "head_timeout_s": "Seconds a connection may stay open without a whole request head; then closed.",
             "max_connections": "Connections open at once; more are closed at accept.",
             "shutdown_timeout_s": "Seconds SIGTERM waits for requests in flight before cancelling them."}
    for f in reversed(fields(Limits)):
        flag = "--" + (f.name[:-2] + "_seconds" if f.name.endswith("_s") else f.name).replace("_", "-")
        kind = FiniteFloatRange(0.1, 86400.0) if f.name.endswith("_s") else click.IntRange(min=1)
        command = click.option(flag, f.name, type=kind, default=f.default, show_default=f.default is not None,
                               help=helps[f.name])(command)
    return command


def shown(text: str, n: int = SHOWN_CHARS) -> str:
    """text as echoed back to a client: at most n characters, and how many were cut."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def endpoint_label(app, scope) -> str:
    """The path of the route a request matches (templates such as /v1/models/{name:path} as written),
    or "other": a fixed set of label values, however many paths clients try."""
    from starlette.routing import Match  # starlette: the serve extra
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return route.path
    return "other"


class BodyLimit:
    """ASGI middleware: a POST's body read whole under the size and time limits, then handed on."""

    def __init__(self, app, limits: Limits, count=None):
        self.app, self.limits = app, limits
        self.count = count or (lambda scope, status: None)     # (scope, status) of each refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await self.refuse(scope, send, 413, f"the request body is {int(declared)} bytes; this "
                                     f"server takes at most {limit} (--max-request-bytes)", "request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return                              # the client is gone: nobody to answer
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > limit:
                        return await self.refuse(scope, send, 413, f"the request body is over {limit} bytes "
                                                 "(--max-request-bytes)", "request_too_large")
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self.refuse(scope, send, 408, f"the request body did not arrive within "
                                     f"{self.limits.body_timeout_s:g} s ({size} bytes came)", "request_timeout")
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                          # later: http.disconnect when the client goes

        await self.app(scope, replay, send)

    async def refuse(self, scope, send, status: int, message: str, code: str) -> None:
        self.count(scope, status)
        payload = json.dumps(error_body(status, message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def deadline_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with a deadline on each request head and a cap on open connections."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # uvicorn: the serve extra

    class DeadlineH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.close()                           # over the cap: closed at accept
                return
            self._arm_head_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_head_deadline()

        def _arm_head_deadline(self):
            cycle = self.cycle

            def expire():
                serving = self.cycle is not None and not self.cycle.response_complete
                if self.cycle is cycle and not serving and not self.transport.is_closing():
                    self.transport.close()              # no whole request head since the deadline was set
            self.loop.call_later(limits.head_timeout_s, expire)

    return DeadlineH11Protocol
