"""What browsers are told and allowed: security headers, cross-origin requests, HEAD.

One pure ASGI middleware, :class:`BrowserPolicy`, applied to every response:

* **Security headers.** ``Content-Security-Policy`` (scripts, styles, fetches from this origin
  only, no inline script, no framing: ``frame-ancestors 'none'``), ``X-Content-Type-Options:
  nosniff``, ``Referrer-Policy: no-referrer``, ``X-Frame-Options: DENY``. ``/docs`` and
  ``/redoc`` (off unless ``--docs``) get a policy that lets them load Swagger UI / ReDoc from
  their CDN and run their inline bootstrap script.
* **Cross-origin requests.** A browser sends ``Origin`` with every cross-origin request and
  with same-origin POSTs. A request whose method is not GET/HEAD/OPTIONS and whose ``Origin``
  is neither this server's own (``scheme://Host``) nor one of ``--cors-origin`` is refused
  with 403 *before* the app sees it: a page elsewhere cannot make a visitor's browser spend
  this server's model (a "simple" POST, form-encoded or text/plain, needs no preflight, so
  the browser would send it and only hide the answer). Allowed origins get CORS headers
  (and preflights answered); without ``--cors-origin`` there are none. Clients that are not
  browsers send no ``Origin`` and are not concerned. (A form-encoded body holding JSON, which
  the server reads as JSON for ``curl -d``, is refused with 415 when it carries an ``Origin``:
  see :mod:`aiayn.serve.requests`.)
* **HEAD** on any GET route: answered as GET without the body (FastAPI routes declare GET only).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PAGE_CSP", "BrowserPolicy"]

PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
DOCS_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com; "
    "font-src https://fonts.gstatic.com; img-src 'self' data: https://fastapi.tiangolo.com "
    "https://cdn.redoc.ly; worker-src blob:; connect-src 'self'; frame-ancestors 'none'"
)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class BrowserPolicy:
    """ASGI middleware: security headers, the origin check and CORS, HEAD as GET."""

    def __init__(self, app: ASGIApp, allowed_origins: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = {origin.rstrip("/").lower() for origin in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        allowed = origin is not None and (
            "*" in self.allowed or origin.rstrip("/").lower() in self.allowed
        )
        method = scope["method"]
        cross_site = origin is not None and not allowed and method not in SAFE_METHODS
        if cross_site and origin.rstrip("/").lower() != _own_origin(scope, headers):  # type: ignore[union-attr]
            await _refuse(send, origin)  # type: ignore[arg-type]
            return
        extra = _security_headers(scope["path"])
        if allowed:
            extra += [
                (b"access-control-allow-origin", origin.encode("latin-1")),  # type: ignore[union-attr]
                (b"vary", b"Origin"),
            ]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                await _preflight(send, extra)
                return
        head = method == "HEAD"
        if head:
            scope = {**scope, "method": "GET"}

        async def send_with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app(scope, receive, send_with_policy)


def _own_origin(scope: Scope, headers: Headers) -> str:
    """``scheme://host[:port]`` as the client addressed this server (the Host header)."""
    scheme = scope.get("scheme", "http")
    forwarded = headers.get("x-forwarded-proto")  # set by a reverse proxy that ends TLS
    if forwarded:
        scheme = forwarded.split(",")[0].strip()
    host = headers.get("host", "").lower()
    default = {"http": ":80", "https": ":443"}.get(scheme, "")
    return f"{scheme}://{host.removesuffix(default)}"


def _security_headers(path: str) -> list[tuple[bytes, bytes]]:
    csp = DOCS_CSP if path in ("/docs", "/redoc", "/docs/oauth2-redirect") else PAGE_CSP
    return [
        (b"content-security-policy", csp.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"x-frame-options", b"DENY"),
    ]


async def _refuse(send: Send, origin: str) -> None:
    body = json.dumps(
        {
            "error": f"cross-origin request from {origin} refused: this server allows "
            "POSTs from its own pages and from the origins given with --cors-origin"
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *_security_headers(""),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _preflight(send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [
        *extra,
        (b"access-control-allow-methods", b"GET, POST, HEAD"),
        (b"access-control-allow-headers", b"Content-Type"),
        (b"access-control-max-age", b"600"),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
