"""Reading request bodies: JSON or form data, with a 4xx error that says what to fix.

LibreTranslate's clients send form data (urlencoded or multipart) or JSON, and put fields in the
query string too; aiayn's clients send JSON. :func:`read_request` reads any of these under the
``--max-body-bytes`` limit and turns an unreadable body into an :class:`ApiError`; validating
the fields is :func:`aiayn.serve.schemas.parse_body`'s job. JSON is parsed here, not by FastAPI,
so that every failure has a message naming the line, byte or limit.

A body's cost is bounded by its size and by the number of values it holds (JSON values or form
fields, ``ServerSettings.max_body_values``): 4 MiB of JSON can hold two million numbers, which
cost ``json.loads`` 0.1 s and 16 MiB, and pydantic, listing an error for each, 18 s, 2.5 GB and
a 116 MB answer. The values are counted on the raw bytes first, by a few passes of C code
(:func:`too_many_json_values`), and a body with too many is refused (413) before anything is
built from it. Percent-decoding form data is Python code (4 MiB of ``%XX`` take half a second):
it runs in a worker thread, which gives the event loop the interpreter back every few
milliseconds, and in slices, so that its memory stays a few times the body's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from aiayn.serve.connections import BodyTimeout
from aiayn.serve.schemas import ApiError, ClientGone, describe_json

__all__ = ["read_request", "too_many_json_values"]


async def read_request(
    request: Request, max_bytes: int, max_values: int
) -> tuple[str, dict[str, Any]]:
    """("json", object) or ("form", fields) from the body, with 4xx errors for bad bodies: 413
    beyond ``max_bytes`` bytes or ``max_values`` values (JSON values or form fields).

    JSON is read as UTF-8 (NaN and Infinity refused); form data (urlencoded or multipart) is
    LibreTranslate's, and fields in the query string count too, as in LibreTranslate (with
    form data or no body: a JSON body's fields alone count there too), read as strictly as a
    urlencoded body (invalid UTF-8 is a 400, a repeated ``q`` a list). A
    urlencoded body that starts with ``{`` is taken as JSON: it is what ``curl -d '{...}'``
    sends; but not from a browser (a request with ``Origin``), where it is the mark of a
    cross-site form trying to pass for JSON without a preflight: 415.
    """
    body = await _read_body(request, max_bytes)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw_query = request.scope.get("query_string", b"")

    def query() -> dict[str, Any]:
        """The query string's fields, read as a urlencoded body is (strict UTF-8, a repeated
        field a list), bounded by the request target's limit (8 KiB); only where they count."""
        return _parse_urlencoded(raw_query, max_values, "query string") if raw_query else {}

    if not body.strip() and raw_query:  # POST /translate?q=...&target=...
        return "form", query()
    if content_type == "multipart/form-data":
        return "form", {**query(), **await _parse_multipart(request, body, max_values)}
    urlencoded = content_type == "application/x-www-form-urlencoded"
    if urlencoded and not body.lstrip().startswith(b"{"):
        fields = await asyncio.to_thread(_parse_urlencoded, body, max_values)
        return "form", {**query(), **fields}
    if urlencoded and "origin" in request.headers:
        raise ApiError(
            415,
            "a JSON body sent as application/x-www-form-urlencoded from a browser is refused: "
            "send Content-Type: application/json",
        )
    json_type = content_type in ("", "application/json") or content_type.endswith("+json")
    if not (urlencoded or json_type):
        raise ApiError(
            415,
            f"unsupported Content-Type {content_type!r}: send application/json (or form data "
            "for the LibreTranslate API)",
        )
    data = _parse_json(body, max_values)
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, got {describe_json(data)}")
    return "json", data


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = f"the request body is larger than {limit} bytes (--max-body-bytes)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_big)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, too_big)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client went away after {size} bytes of the body") from None
    except BodyTimeout as error:
        raise ApiError(408, str(error), {"Connection": "close"}) from None
    return b"".join(chunks)


def _decode_utf8(body: bytes, what: str = "request body") -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400,
            f"the {what} is not valid UTF-8: byte 0x{body[error.start]:02x} at "
            f"position {error.start}",
        ) from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in JSON")


def _too_many_values(max_values: int, what: str = "request body") -> ApiError:
    return ApiError(
        413,
        f"the {what} holds more than {max_values} values (JSON values or form fields); "
        "a request has at most --max-texts texts and a few options",
    )


def too_many_json_values(body: bytes, limit: int) -> bool:
    """Whether the JSON document ``body`` holds more than ``limit`` values below the top-level
    one, decided on the bytes by a few passes of C code, before any value is built.

    Every such value follows a ``,`` or opens its container, so the ``,``, ``[`` and ``{``
    outside strings count them (an empty list or object counts once more). Syntax inside
    strings is told apart only when the plain count is over ``limit``: escaped backslashes and
    quotes are dropped, so that every ``"`` left opens or closes a string, and only the bytes
    between strings are counted. A string is a value or an object's key, and an object has no
    more keys than values, so more than 2 × (``limit`` + 1) strings are too many values too.
    For invalid JSON, which ``json.loads`` refuses anyway, the answer is only a guess.
    """
    if body.count(b",") + body.count(b"[") + body.count(b"{") <= limit:
        return False
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    if plain.count(b'"') > 4 * (limit + 1):
        return True
    between = plain.split(b'"')[::2]  # outside strings
    separators = sum(part.count(b",") + part.count(b"[") + part.count(b"{") for part in between)
    return separators > limit


def _parse_json(body: bytes, max_values: int) -> Any:
    if too_many_json_values(body, max_values):
        raise _too_many_values(max_values)
    text = _decode_utf8(body).removeprefix("\ufeff")
    if not text.strip():
        raise ApiError(
            400,
            'the request body is empty: send a JSON object such as {"text": "Hello"} '
            '(or {"q": "Hello"} for the LibreTranslate API)',
        )
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise ApiError(
            400,
            f"the request body is not valid JSON: {error.msg} (line {error.lineno}, "
            f"column {error.colno})",
        ) from None
    except (ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None


def _parse_urlencoded(body: bytes, max_values: int, what: str = "request body") -> dict[str, Any]:
    """Fields as ``parse_qsl(keep_blank_values=True)`` reads them (``+`` is a space, UTF-8
    strictly), percent-decoded in slices: ``parse_qsl`` splits a value at every ``%``, and 4 MiB
    of ``%XX`` held 1.4 million pieces at once (325 MiB). ``what`` names the data in errors
    (the request body, or the query string)."""
    text = _decode_utf8(body, what)
    if text.count("&") + 1 > max_values:  # counted before anything is decoded
        raise _too_many_values(max_values, what)
    try:
        pairs = [
            (_unquote_plus(name), _unquote_plus(value))
            for name, _, value in (field.partition("=") for field in text.split("&") if field)
        ]
    except UnicodeDecodeError as error:
        form = "form data" if what == "request body" else what
        raise ApiError(
            400, f"the {form} is not valid UTF-8 once percent-decoded: {error.reason}"
        ) from None
    return _fields(pairs)


def _unquote_plus(text: str, piece: int = 1 << 16) -> str:
    """``urllib.parse.unquote_plus`` (UTF-8, strict), ``piece`` characters at a time: cut before
    a ``%`` that is too close to the end of a piece to have its two hex digits in it."""
    decoded = bytearray()
    start = 0
    while start < len(text):
        end = min(start + piece, len(text))
        if end < len(text):
            cut = text.rfind("%", end - 2, end)
            end = cut if cut > start else end
        decoded += unquote_to_bytes(text[start:end].replace("+", " "))
        start = end
    return decoded.decode("utf-8")


async def _parse_multipart(request: Request, body: bytes, max_values: int) -> dict[str, Any]:
    """Fields of a multipart body, parsed by Starlette's public ``Request.form()`` (which
    uses python-multipart, and stops at ``max_values`` parts) on a request that replays the
    body already read under the size limit."""

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        replayed = Request(request.scope, replay)
        async with replayed.form(max_fields=max_values, max_files=max_values) as form:
            pairs = []
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    raise ApiError(
                        422, f"{key}: file uploads are not supported; send the text itself"
                    )
                pairs.append((key, value))
    except ApiError:
        raise
    except HTTPException as error:  # Starlette's answer to a malformed body
        if str(error.detail).startswith("Too many"):  # fields or files
            raise _too_many_values(max_values) from None
        raise ApiError(400, f"cannot read the multipart form data: {error.detail}") from None
    except Exception as error:  # python-multipart's own parse errors
        raise ApiError(400, f"cannot read the multipart form data: {error}") from None
    return _fields(pairs)


def _fields(pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Form fields as a dict; a repeated ``q`` becomes a list."""
    fields: dict[str, Any] = {}
    for key, value in pairs:
        if key == "q" and key in fields:
            previous = fields[key]
            fields[key] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            fields[key] = value
    return fields
