"""Reading request bodies: JSON or form data, with a 4xx error that says what to fix.

LibreTranslate's clients send form data (urlencoded or multipart) or JSON, and put fields in the
query string too; aiayn's clients send JSON. :func:`read_request` reads any of these under the
``--max-body-bytes`` limit and turns an unreadable body into an :class:`ApiError`; validating
the fields is :func:`aiayn.serve.schemas.parse_body`'s job. JSON is parsed here, not by FastAPI,
so that every failure has a message naming the line, byte or limit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from aiayn.serve.connections import BodyTimeout
from aiayn.serve.schemas import ApiError, ClientGone, describe_json

__all__ = ["read_request"]


async def read_request(request: Request, limit: int) -> tuple[str, dict[str, Any]]:
    """("json", object) or ("form", fields) from the body, with 4xx errors for bad bodies.

    JSON is read as UTF-8 (NaN and Infinity refused); form data (urlencoded or multipart) is
    LibreTranslate's, and fields in the query string count too, as in LibreTranslate. A
    urlencoded body that starts with ``{`` is taken as JSON: it is what ``curl -d '{...}'``
    sends; but not from a browser (a request with ``Origin``), where it is the mark of a
    cross-site form trying to pass for JSON without a preflight: 415.
    """
    body = await _read_body(request, limit)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not body.strip() and request.query_params:  # POST /translate?q=...&target=...
        return "form", dict(request.query_params)
    if content_type == "multipart/form-data":
        return "form", {**dict(request.query_params), **await _parse_multipart(request, body)}
    urlencoded = content_type == "application/x-www-form-urlencoded"
    if urlencoded and not body.lstrip().startswith(b"{"):
        return "form", {**dict(request.query_params), **_parse_urlencoded(body)}
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
    data = _parse_json(body)
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


def _decode_utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400,
            f"the request body is not valid UTF-8: byte 0x{body[error.start]:02x} at "
            f"position {error.start}",
        ) from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in JSON")


def _parse_json(body: bytes) -> Any:
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


def _parse_urlencoded(body: bytes) -> dict[str, Any]:
    text = _decode_utf8(body)
    try:
        pairs = parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError as error:
        raise ApiError(
            400, f"the form data is not valid UTF-8 once percent-decoded: {error.reason}"
        ) from None
    return _fields(pairs)


async def _parse_multipart(request: Request, body: bytes) -> dict[str, Any]:
    """Fields of a multipart body, parsed by Starlette's public ``Request.form()`` (which
    uses python-multipart) on a request that replays the body already read under the size
    limit."""

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        async with Request(request.scope, replay).form() as form:
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
