"""What the server does about connections that cost it without asking for anything, and about
request heads that no client needs to send.

The server speaks HTTP/1.1 through uvicorn's httptools protocol: llhttp (Node.js's parser)
refuses the framings that request smuggling relies on (``Content-Length`` together with
``Transfer-Encoding``, two ``Content-Length`` values, bare LF line ends, obsolete line folding),
where h11 answered a request with both headers, and then the request hidden in its body, on the
same connection. Uvicorn closes a keep-alive connection idle ``timeout_keep_alive`` seconds
*after a response*, and ``limit_concurrency`` answers 503 once that many connections or tasks
exist; but it sets no deadline on a new connection that sends nothing, on a request head sent
one byte at a time, or on a body that trickles in, and no limit on the size of a request head.
Each of those holds a file descriptor, and a few hundred exhaust the process's limit (then
``/health`` itself cannot be accepted). This module adds the deadlines and the limits:

* :func:`guarded_protocol`: uvicorn's httptools protocol with

  - a **head deadline**: the request line and headers must be complete within
    ``head_timeout_s`` of the connection opening, or of the first byte of the next request on a
    kept-alive connection (a deadline, not an idle timer, so trickling does not extend it);
  - **head limits**: a request target (path and query) over :data:`MAX_TARGET_BYTES` is
    answered 414, a head over :data:`MAX_HEAD_BYTES` 431, an HTTP version other than 1.0 and
    1.1 505, a transfer coding other than ``chunked`` 501, an HTTP/1.1 request without one
    ``Host``, an HTTP/1.0 one with ``Transfer-Encoding`` (:func:`check_framing`) and any other
    request llhttp cannot parse 400, each with ``Connection: close``;
  - a **connection cap**: a connection beyond ``max_connections`` is closed as soon as it is
    accepted, before it costs anything else.

  Deadline and cap close silently: a flood must not become a flood of log lines; a refused head
  is one line at INFO.
* :class:`BodyDeadline`: an ASGI middleware that gives the whole request body
  ``body_timeout_s`` from the app's first read; past it the read raises :class:`BodyTimeout`,
  answered 408 by the app.
* :class:`RedactQuery`: replaces the values of ``q``, ``api_key`` (and any other field listed)
  in the query strings of uvicorn's access log lines with ``REDACTED``: texts and keys stay out
  of logs. The guarded protocol applies it to the lines of its own connections, so the
  process-wide ``uvicorn.access`` logger gets no filter. Bodies are never logged.
* :func:`connection_cap`: the connection cap that fits the process's file-descriptor limit,
  which this module reads and never changes (``aiayn serve`` raises it, at start:
  :func:`aiayn.serve.app.serve`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_HEAD_BYTES",
    "MAX_TARGET_BYTES",
    "BodyDeadline",
    "BodyTimeout",
    "RedactQuery",
    "RedactedAccessLog",
    "connection_cap",
    "guarded_protocol",
]

SECRET_FIELDS = ("q", "api_key", "text", "texts")
MAX_TARGET_BYTES = 8 * 1024  # the request target, path and query: 414 beyond (nginx: 8 KiB)
MAX_HEAD_BYTES = 16 * 1024  # the request line and headers together: 431 beyond
HTTP_VERSIONS = ("1.0", "1.1")


class HeadRefused(Exception):
    """A request head the server will not read: answered ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def guarded_protocol(head_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """Uvicorn's httptools protocol class (``http=``) with a head deadline, head limits, HTTP/1.x
    only, and a connection cap (see the module docstring)."""

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True  # waiting for a request head, or for the rest of one
        _head_begun = False  # llhttp has seen the head's first byte
        _head_bytes = 0  # bytes fed while the head was incomplete: an upper bound on its size
        _header_bytes = 0  # the head's size, counted exactly from what llhttp has parsed

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Texts and keys out of the access log, without a filter on the process's logger.
            self.access_logger = RedactedAccessLog(self.access_logger)  # type: ignore[assignment]

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.connections.discard(self)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._in_head and self._head_timer is None and not self._answering():
                self._arm()
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:  # as uvicorn does (no WebSockets here)
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError as error:
                self._refuse(_refusal(error))
                return
            if self._in_head and self._head_begun:
                # httptools buffers a header until it is complete: bound what it may hold
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(_head_too_large())

        # llhttp's callbacks (an exception in one aborts the parse: see data_received)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_begun = True, True
            self._head_bytes = self._header_bytes = 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._header_bytes += len(url)
            if len(self.url) > MAX_TARGET_BYTES:
                raise HeadRefused(
                    414,
                    f"the request target (path and query) is longer than {MAX_TARGET_BYTES} "
                    "bytes: send the fields in a POST body",
                )

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
            if self._header_bytes > MAX_HEAD_BYTES:
                raise _head_too_large()
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            version = self.parser.get_http_version()
            if version not in HTTP_VERSIONS:
                raise HeadRefused(505, _version_message(f"HTTP/{version}"))
            check_framing(version, self.headers)
            self._in_head, self._head_begun = False, False
            self._disarm()  # the head is in; the body has its own deadline
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()  # arms uvicorn's keep-alive timer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _refuse(self, refusal: HeadRefused) -> None:
            """Answers ``refusal`` as ``{"error": ...}`` and closes the connection (only closes
            it while the answer to an earlier request is being sent)."""
            self._disarm()
            if self.transport.is_closing():
                return
            if self._answering():
                self.transport.close()
                return
            client = "{}:{}".format(*self.client) if self.client else "?"
            logger.info("%s - request refused: %d %s", client, refusal.status, refusal.message)
            body = json.dumps({"error": refusal.message}).encode()
            head = (
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
                "connection: close\r\n\r\n"
            )
            self.transport.write(STATUS_LINE[refusal.status] + head.encode() + body)
            self.transport.close()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def check_framing(version: str, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuses a head that names its host or frames its body in a way this server does not
    read (RFC 9112): an HTTP/1.1 request needs exactly one ``Host`` (§3.2; HTTP/1.0 needs
    none), an HTTP/1.0 request no ``Transfer-Encoding`` (§6.1: a 1.0 recipient cannot rely on
    it), and a body's only transfer coding may be ``chunked``: any other (``gzip, chunked``)
    is 501, as the body would otherwise be read as if it were plain. ``headers`` are uvicorn's,
    names lowercased. llhttp has already refused ``Transfer-Encoding`` with
    ``Content-Length``, and codings that do not end in ``chunked``."""
    hosts = sum(name == b"host" for name, _ in headers)
    if version == "1.1" and hosts != 1:
        raise HeadRefused(400, f"an HTTP/1.1 request needs one Host header, not {hosts}")
    codings = [value for name, value in headers if name == b"transfer-encoding"]
    if not codings:
        return
    if version == "1.0":
        raise HeadRefused(400, "an HTTP/1.0 request has no Transfer-Encoding: send Content-Length")
    coding = b",".join(codings).decode("latin-1")
    if [part.strip().lower() for part in coding.split(",")] != ["chunked"]:
        raise HeadRefused(
            501,
            f"Transfer-Encoding {coding!r} is not supported: send the body as it is, with "
            "Content-Length or Transfer-Encoding: chunked",
        )


def _head_too_large() -> HeadRefused:
    return HeadRefused(431, f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes")


def _version_message(version: str) -> str:
    return f"{version} is not supported: this server speaks HTTP/1.0 and HTTP/1.1"


def _refusal(error: httptools.HttpParserError) -> HeadRefused:
    """The answer to a parse error: ours if a callback refused the head, else llhttp's reason
    (505 for a version it does not know, 400 otherwise)."""
    if isinstance(error.__context__, HeadRefused):
        return error.__context__
    reason = str(error)
    if reason == "Invalid HTTP version":
        return HeadRefused(505, _version_message("the request's HTTP version"))
    return HeadRefused(400, f"malformed HTTP request: {reason}")


FD_SPARE = 64
"""File descriptors kept for what is not a client connection: the model's files, logs, pipes."""


def connection_cap(max_connections: int, spare: int = FD_SPARE) -> int:
    """``max_connections``, lowered (with a warning) to what the process's soft limit on open
    files holds beside ``spare`` other descriptors. Reads the limit, never changes it: raising
    it is the entry point's (``runtime.configure(open_files=...)``, which ``aiayn serve``
    calls)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + spare
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    cap = max(1, soft - spare)
    logger.warning(
        "the file-descriptor limit (%d) cannot hold --max-connections %d; using %d",
        soft,
        max_connections,
        cap,
    )
    return cap


class BodyTimeout(Exception):
    """The request body did not arrive within ``body_timeout_s``."""


class BodyDeadline:
    """ASGI middleware: the body of an HTTP request must arrive within ``body_timeout_s`` of
    the app's first read; a later read raises :class:`BodyTimeout`."""

    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        body_done = False

        async def timed_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:  # after the body, receive() waits for a disconnect: no deadline
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.body_timeout_s
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                raise BodyTimeout(
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    "(--timeout-body)"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


class RedactQuery(logging.Filter):
    """Redacts the values of ``fields`` in the query strings of uvicorn's access log lines,
    whose arguments are (client, method, path with query, HTTP version, status). A filter, for
    a program that configures uvicorn's logging itself; the guarded protocol redacts its own
    lines (:class:`RedactedAccessLog`)."""

    def __init__(self, fields: tuple[str, ...] = SECRET_FIELDS) -> None:
        super().__init__()
        self.fields = set(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = self.redact_args(record.args)
        return True

    def redact_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """An access line's arguments with the path's query redacted."""
        if len(args) >= 3 and isinstance(args[2], str):
            return (*args[:2], self.redact(args[2]), *args[3:])
        return args

    def redact(self, path: str) -> str:
        base, sep, query = path.partition("?")
        if not sep:
            return path
        pairs: list[Any] = parse_qsl(query, keep_blank_values=True)
        redacted = [(k, "REDACTED" if k in self.fields else v) for k, v in pairs]
        return f"{base}?{urlencode(redacted)}"


class RedactedAccessLog(logging.LoggerAdapter):
    """Uvicorn's access logger as one connection's protocol uses it: the same logger, handlers
    and format, with each line's query redacted by :class:`RedactQuery` on its way in. Nothing
    is added to the process-wide ``uvicorn.access`` logger, so other servers in the process,
    and the program's own logging, are left as they were."""

    def __init__(self, logger: logging.Logger, redact: RedactQuery | None = None) -> None:
        super().__init__(logger, {})
        self.redactor = redact or RedactQuery()

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.log(level, msg, *self.redactor.redact_args(args), **kwargs)
