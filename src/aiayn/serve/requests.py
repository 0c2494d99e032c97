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
built from it. Percent-decoding form data is Python code (4 MiB of ``%XX`` take about 0.3 s):
it runs in a worker thread, which gives the event loop the interpreter back every few
milliseconds, and in slices, so that its memory stays a few times the body's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

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
        fields = await asyncio.to_thread(
            _parse_multipart, request.headers["content-type"], body, max_values
        )
        return "form", {**query(), **fields}
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


def _parse_multipart(content_type: str, body: bytes, max_values: int) -> dict[str, Any]:
    """Fields of a multipart body (RFC 7578), read by python-multipart's parser on the bytes
    already read under the size limit, as strictly as a urlencoded body: a value or a field
    name that is not UTF-8 is a 400 (Starlette's ``Request.form()`` read it as Latin-1), and
    so is a body that is not multipart or ends before its closing boundary (which
    ``Request.form()`` read as a form without fields); a file is a 422, more than
    ``max_values`` parts a 413."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "the multipart Content-Type has no boundary")
    delimiter = "--" + boundary.decode("latin-1")
    pairs: list[tuple[str, str]] = []
    headers: dict[bytes, bytes] = {}  # the part's, names lowercased
    field, value, data = bytearray(), bytearray(), bytearray()  # as the parser reads them
    ended = False

    def header_end() -> None:
        headers[bytes(field).lower()] = bytes(value)
        field.clear()
        value.clear()

    def headers_finished() -> None:
        if len(pairs) >= max_values:
            raise _too_many_values(max_values)
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise ApiError(400, "a multipart part has no name (Content-Disposition: form-data)")
        name = _decode_utf8(options[b"name"], "name of a multipart field")
        if b"filename" in options:
            raise ApiError(422, f"{name}: file uploads are not supported; send the text itself")
        pairs.append((name, ""))

    def part_end() -> None:
        name = pairs[-1][0]
        pairs[-1] = (name, _decode_utf8(bytes(data), f"multipart field {name!r}"))
        headers.clear()
        data.clear()

    def end() -> None:
        nonlocal ended
        ended = True

    callbacks: Any = {
        "on_header_field": lambda chunk, start, end: field.extend(chunk[start:end]),
        "on_header_value": lambda chunk, start, end: value.extend(chunk[start:end]),
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": lambda chunk, start, end: data.extend(chunk[start:end]),
        "on_part_end": part_end,
        "on_end": end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except MultipartParseError as error:  # python-multipart's words: "Expected boundary ..."
        raise ApiError(
            400, f"cannot read the multipart form data (boundary {delimiter!r}): {error}"
        ) from None
    if not ended:
        raise ApiError(
            400, f"the multipart form data ends before its closing boundary '{delimiter}--'"
        )
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
