"""The messages of the HTTP API: request bodies read and validated into clear errors, results
written as JSON.

Two request schemas share ``POST /translate``: :class:`TranslateRequest` (aiayn's, strict:
unknown fields and wrong types are errors) and :class:`LibreTranslateRequest` (LibreTranslate's,
lenient as LibreTranslate is: unknown fields are ignored, form values are strings). Bodies may be
JSON or form data; :func:`read_request` turns any unreadable body into an :class:`ApiError` with
a 4xx status and a message that says what to fix, and :func:`validate` does the same for fields.
The pydantic models also describe the API in the OpenAPI schema.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartParser

from aiayn.translator import TranslationResult

__all__ = [
    "ApiError",
    "LibreTranslateRequest",
    "TranslateRequest",
    "check_texts",
    "read_request",
    "translation_json",
    "validate",
]

ATTENTION_DECIMALS = 4  # enough for a heatmap; keeps (L, H, T, S) JSON-sized


class ApiError(Exception):
    """Answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


# -- schemas ----------------------------------------------------------------------------------


class TranslateRequest(BaseModel):
    """aiayn's request: ``text`` or ``texts``; options left out take the server's defaults."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | None = Field(None, description="One text; the answer has one translation.")
    texts: list[str] | None = Field(None, description="Several texts, translated in one batch.")
    beam_size: int | None = Field(None, ge=1, description="1 = greedy search.")
    n_best: int | None = Field(None, ge=1, description="Hypotheses per text (<= beam_size).")
    length_penalty: float | None = Field(None, ge=0, allow_inf_nan=False, description="α.")
    return_attention: bool = Field(
        False, description="Add the cross-attention of every layer and head."
    )


class LibreTranslateRequest(BaseModel):
    """LibreTranslate's request (JSON or form data); unknown fields are ignored, as there."""

    model_config = ConfigDict(extra="ignore")

    q: str | list[str] = Field(description="The text, or a list of texts.")
    source: str | None = Field(None, description="Source language code, or 'auto'.")
    target: str | None = Field(None, description="Target language code.")
    format: str | None = Field(None, description="'text' (the only one supported).")
    alternatives: int = Field(0, ge=0, description="Extra translations to return per text.")
    api_key: str | None = Field(None, description="Accepted and ignored.")

    @field_validator("q", mode="before")
    @classmethod
    def _string_or_list(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
        if not ok:
            raise ValueError(f"must be a string or a list of strings, got {_describe(value)}")
        return value


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(description="log_prob / length penalty (beam search).")
    log_prob: float | None
    tokens: list[str] = Field(description="Output subword pieces, without EOS.")


class Attention(BaseModel):
    src_tokens: list[str] = Field(description="Source pieces, </s> included: the S columns.")
    tgt_tokens: list[str] = Field(description="Output pieces, </s> included: the T rows.")
    cross: list[list[list[list[float]]]] = Field(
        description="(L, H, T, S) encoder-decoder attention, rounded to 4 decimals."
    )


class Translation(Hypothesis):
    truncated: bool = Field(description="The text was longer than the model accepts and was cut.")
    hypotheses: list[Hypothesis] = Field(description="The n-best list, best first.")
    attention: Attention | None = None


class TranslateResponse(BaseModel):
    translations: list[Translation]


class LibreTranslateResponse(BaseModel):
    translatedText: str | list[str]  # LibreTranslate's names
    alternatives: list[str] | list[list[str]] | None = None
    detectedLanguage: dict[str, Any] | list[dict[str, Any]] | None = None


class Language(BaseModel):
    code: str
    name: str
    targets: list[str]


class Detection(BaseModel):
    language: str
    confidence: float


class ErrorResponse(BaseModel):
    error: str = Field(description="What was wrong, and which limit or field it concerns.")


def check_texts(
    texts: list[str], name: str, *, single: bool, max_texts: int, max_chars: int
) -> None:
    """Refuses texts that are missing, too many, too long, blank, or not encodable as UTF-8 (a
    lone surrogate from JSON): 422, or 413 naming the limit's flag. ``name`` is the field, and
    ``single`` says whether it holds one text (``text``) or a list (``texts[3]``)."""
    if not texts:
        raise ApiError(422, f"{name} is empty: give at least one text")
    if len(texts) > max_texts:
        raise ApiError(
            413,
            f"the request has {len(texts)} texts; the limit is {max_texts} (--max-texts)",
        )
    for i, text in enumerate(texts):
        label = name if single else f"{name}[{i}]"
        if len(text) > max_chars:
            raise ApiError(
                413,
                f"{label} has {len(text)} characters; the limit is {max_chars} (--max-chars)",
            )
        if not text.strip():
            raise ApiError(422, f"{label} is empty: there is nothing to translate")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ApiError(
                422,
                f"{label} is not valid Unicode: an unpaired surrogate "
                f"({text[error.start]!r}) at character {error.start}",
            ) from None


# -- reading requests ---------------------------------------------------------------------------


async def read_request(request: Request, limit: int) -> tuple[str, dict[str, Any]]:
    """("json", object) or ("form", fields) from the body, with 4xx errors for bad bodies.

    JSON is read as UTF-8 (NaN and Infinity refused); form data (urlencoded or multipart) is
    LibreTranslate's, and fields in the query string count too, as in LibreTranslate. A
    urlencoded body that starts with ``{`` is taken as JSON: it is what ``curl -d '{...}'``
    sends.
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
    json_type = content_type in ("", "application/json") or content_type.endswith("+json")
    if not (urlencoded or json_type):
        raise ApiError(
            415,
            f"unsupported Content-Type {content_type!r}: send application/json (or form data "
            "for the LibreTranslate API)",
        )
    data = _parse_json(body)
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, got {_describe(data)}")
    return "json", data


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = f"the request body is larger than {limit} bytes (--max-body-bytes)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_big)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, too_big)
        chunks.append(chunk)
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
    async def stream() -> AsyncIterator[bytes]:
        yield body

    try:
        form = await MultiPartParser(request.headers, stream()).parse()
    except Exception as error:  # python-multipart's and Starlette's parse errors
        raise ApiError(400, f"cannot read the multipart form data: {error}") from None
    pairs = []
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            raise ApiError(422, f"{key}: file uploads are not supported; send the text itself")
        pairs.append((key, value))
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


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model`` filled from ``data``, or a 422 ApiError listing every problem."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ApiError(422, _validation_message(error, model)) from None


def _validation_message(error: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: ``texts[1]: Input should be a valid string (got 3)``."""
    parts = []
    for item in error.errors(include_url=False):
        location = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"]
        ).lstrip(".")
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(model.model_fields)
            parts.append(f"unknown field {location!r} (the fields are: {allowed})")
        elif item["type"] == "missing":
            parts.append(f"missing {location!r}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = "" if item["type"] == "value_error" else f" (got {_describe(item['input'])})"
            parts.append(f"{location}: {message}{got}")
    return "; ".join(parts)


def _describe(value: Any) -> str:
    """A short description of a JSON value for error messages: 3, "abc", true, a list."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- writing answers ----------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    """JSON has no infinities or NaN: such a score becomes null."""
    return x if math.isfinite(x) else None


def translation_json(result: TranslationResult, with_attention: bool) -> dict[str, Any]:
    """One entry of aiayn's answer (:class:`Translation`): the best hypothesis, the n-best
    list, and with ``with_attention`` the cross-attention of every layer and head, rounded."""
    hypotheses = [
        {
            "text": h.text,
            "score": _finite(h.score),
            "log_prob": _finite(h.log_prob),
            "tokens": h.tokens,
        }
        for h in result.hypotheses
    ]
    answer = {**hypotheses[0], "truncated": result.truncated, "hypotheses": hypotheses}
    if with_attention and result.attention_maps is not None:
        cross = result.attention_maps.cross.double()  # (L, H, T, S); float64 rounds exactly
        scale = 10**ATTENTION_DECIMALS
        answer["attention"] = {
            "src_tokens": result.src_tokens,
            "tgt_tokens": result.tgt_tokens,
            "cross": (cross * scale).round().div(scale).tolist(),
        }
    return answer
