"""--api-key and --allowed-origins: who may call the server, and from which web origins (vLLM's flags).

    add_access_middleware(app, api_key="sk-...", allowed_origins=["https://ui.example"])

api_key: every /v1/* request needs `Authorization: Bearer <key>` (compared in constant time); without it the
answer is 401 in the OpenAI error shape (code "invalid_api_key"). As in vLLM only /v1 is guarded: /health,
/ping, /version, /metrics, /tokenize and /detokenize stay open for probes and scrapers, and a CORS preflight
(OPTIONS) is never refused for want of a key (browsers send it without credentials).
allowed_origins: Starlette's CORSMiddleware (all methods and headers, credentials allowed), outermost, so
a preflight is answered before the key check; ["*"] allows any origin. None: no CORS headers at all.
"""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from ddtree.server.errors import error_body

GUARDED_PREFIX = "/v1"


class ApiKeyMiddleware:
    """Plain ASGI (no BaseHTTPMiddleware): streaming responses and disconnect checks pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(GUARDED_PREFIX):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                message = ("Incorrect API key provided" if got else
                           "Missing API key: send the header 'Authorization: Bearer <key>' (--api-key)")
                response = JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_access_middleware(app, api_key: str | None, allowed_origins: list[str] | None) -> None:
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:                 # added last = outermost: preflights never reach the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"])
