"""What the server does about connections that cost it without asking for anything.

Uvicorn (0.3x–0.5x, h11) closes a keep-alive connection idle ``timeout_keep_alive`` seconds
*after a response*, and ``limit_concurrency`` answers 503 once that many connections or tasks
exist; but it sets no deadline on a new connection that sends nothing, on a request head sent
one byte at a time, or on a body that trickles in. Each of those holds a file descriptor, and
a few hundred exhaust the process's limit (then ``/health`` itself cannot be accepted). This
module adds the deadlines:

* :func:`deadline_protocol`: uvicorn's h11 protocol with a **head deadline** (the request line
  and headers must be complete within ``head_timeout_s`` of the connection opening, or of the
  first byte of the next request on a kept-alive connection: a deadline, not an idle timer,
  so trickling does not extend it) and a **connection cap** (a connection beyond
  ``max_connections`` is closed as soon as it is accepted, before it costs anything else).
  Both close silently: a flood must not become a flood of log lines.
* :class:`BodyDeadline`: an ASGI middleware that gives the whole request body
  ``body_timeout_s`` from the app's first read; past it the read raises :class:`BodyTimeout`,
  answered 408 by the app.
* :class:`RedactQuery`: a filter for uvicorn's access log that replaces the values of ``q``,
  ``api_key`` (and any other field listed) in logged query strings with ``REDACTED``: texts
  and keys stay out of logs. Bodies are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

__all__ = ["BodyDeadline", "BodyTimeout", "RedactQuery", "deadline_protocol", "fit_fd_limit"]

SECRET_FIELDS = ("q", "api_key", "text", "texts")


def deadline_protocol(head_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """Uvicorn's h11 protocol class with a head deadline and a connection cap (``http=``)."""

    class DeadlineH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.connections.discard(self)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            if waiting_for_head and self._head_timer is None:
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the head is in; the body has its own deadline

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()  # arms uvicorn's keep-alive timer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

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

    return DeadlineH11Protocol


def fit_fd_limit(max_connections: int, spare: int = 64) -> int:
    """Raises the soft file-descriptor limit to fit ``max_connections`` + ``spare`` if the hard
    limit allows, else lowers the cap to fit (with a warning); returns the cap to use."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < needed:
            cap = max(1, soft - spare)
            logger.warning(
                "the file-descriptor limit (%d) cannot hold --max-connections %d; using %d",
                soft,
                max_connections,
                cap,
            )
            return cap
    return max_connections


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
    whose arguments are (client, method, path with query, HTTP version, status)."""

    def __init__(self, fields: tuple[str, ...] = SECRET_FIELDS) -> None:
        super().__init__()
        self.fields = set(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], self.redact(args[2]), *args[3:])
        return True

    def redact(self, path: str) -> str:
        base, sep, query = path.partition("?")
        if not sep:
            return path
        pairs: list[Any] = parse_qsl(query, keep_blank_values=True)
        redacted = [(k, "REDACTED" if k in self.fields else v) for k, v in pairs]
        return f"{base}?{urlencode(redacted)}"


def install_access_log_filter() -> None:
    """Adds :class:`RedactQuery` to uvicorn's access logger, once."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQuery) for f in access.filters):
        access.addFilter(RedactQuery())
