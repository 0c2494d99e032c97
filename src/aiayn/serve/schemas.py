"""The messages of the HTTP API as pydantic models: one description serves three purposes.

Request bodies are validated by the models (:func:`parse_body` turns pydantic's errors into
one clear 422 message), answers are *built* from them (so the payload cannot drift from the
schema), and FastAPI writes the OpenAPI schema from them.

Two request schemas share ``POST /translate``: :class:`TranslateRequest` (aiayn's, strict:
unknown fields and wrong types are errors) and :class:`LibreTranslateRequest` (LibreTranslate's,
lenient as LibreTranslate is: unknown fields are ignored, form values are strings). How bodies
are read (JSON or form data) is :mod:`aiayn.serve.requests`.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from aiayn.decode.results import TranslationHypothesis, TranslationResult
from aiayn.serve.settings import SERVER_MAX_LENGTH_PENALTY
from aiayn.text.tokenizer import stripped

if TYPE_CHECKING:
    import torch

__all__ = [
    "ERROR_RESPONSES",
    "ApiError",
    "Attention",
    "ClientGone",
    "Detection",
    "ErrorResponse",
    "HypothesisJSON",
    "Language",
    "LibreTranslateRequest",
    "LibreTranslateResponse",
    "TranslateRequest",
    "TranslateResponse",
    "Translation",
    "add_to_openapi",
    "check_texts",
    "describe_json",
    "first_problems",
    "parse_body",
]

ATTENTION_DECIMALS = 4  # enough for a heatmap; keeps (L, H, T, S) JSON-sized
MAX_PROBLEMS = 5  # an error answer lists this many problems, then counts the others


class ApiError(Exception):
    """Answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class ClientGone(Exception):
    """The client hung up before its answer was ready (logged as one line, not answered)."""


# -- schemas ----------------------------------------------------------------------------------


class TranslateRequest(BaseModel):
    """aiayn's request: ``text`` or ``texts``; options left out take the server's defaults."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | None = Field(None, description="One text; the answer has one translation.")
    texts: list[str] | None = Field(None, description="Several texts, translated in one batch.")
    beam_size: int | None = Field(None, ge=1, description="1 = greedy search.")
    n_best: int | None = Field(None, ge=1, description="Hypotheses per text (<= beam_size).")
    length_penalty: float | None = Field(
        None, ge=0, le=SERVER_MAX_LENGTH_PENALTY, allow_inf_nan=False, description="α."
    )
    return_attention: bool = Field(
        False,
        description="Add the last decoder layer's encoder-decoder attention, averaged over "
        "heads: (T, S).",
    )
    full_attention: bool = Field(
        False,
        description="With return_attention: every layer and head, (L, H, T, S), within the "
        "server's limit on attention values.",
    )
    api_key: str | None = Field(None, description="The client's API key, if the server has keys.")


class LibreTranslateRequest(BaseModel):
    """LibreTranslate's request (JSON or form data); unknown fields are ignored, as there."""

    model_config = ConfigDict(extra="ignore")

    q: str | list[str] = Field(description="The text, or a list of texts.")
    source: str | None = Field(None, description="Source language code, or 'auto'.")
    target: str | None = Field(None, description="Target language code.")
    format: str | None = Field(None, description="'text' (the only one supported).")
    alternatives: int = Field(0, ge=0, description="Extra translations to return per text.")
    api_key: str | None = Field(None, description="The client's API key, if the server has keys.")

    @field_validator("q", mode="before")
    @classmethod
    def _string_or_list(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
        if not ok:
            raise ValueError(f"must be a string or a list of strings, got {describe_json(value)}")
        return value


class HypothesisJSON(BaseModel):
    """One hypothesis: its text, its scores and its subword pieces."""

    # Docstrings of these models are descriptions in the OpenAPI schema: notes for readers of
    # the code are comments. Answers are dumped with ``exclude_unset=True``, so that optional
    # fields never set (``attention``; LibreTranslate's extras) are absent, not null.

    text: str
    score: float | None = Field(description="log_prob / length penalty (beam search).")
    log_prob: float | None
    tokens: list[str] = Field(description="Output subword pieces, without EOS.")

    @classmethod
    def from_hypothesis(cls, hypothesis: TranslationHypothesis) -> HypothesisJSON:
        return cls(
            text=hypothesis.text,
            score=_finite(hypothesis.score),
            log_prob=_finite(hypothesis.log_prob),
            tokens=hypothesis.tokens,
        )


class Attention(BaseModel):
    src_tokens: list[str] = Field(description="Source pieces, </s> included: the S columns.")
    tgt_tokens: list[str] = Field(description="Output pieces, </s> included: the T rows.")
    mean: list[list[float]] = Field(
        description="(T, S) encoder-decoder attention of the last layer, averaged over heads, "
        "rounded to 4 decimals."
    )
    cross: list[list[list[list[float]]]] | None = Field(
        None,
        description="(L, H, T, S) encoder-decoder attention of every layer and head, rounded "
        "to 4 decimals; with full_attention only.",
    )


class Translation(HypothesisJSON):
    """One entry of aiayn's answer: the best hypothesis, the n-best list, and on request the
    cross-attention."""

    truncated: bool = Field(description="The text was longer than the model accepts and was cut.")
    hypotheses: list[HypothesisJSON] = Field(description="The n-best list, best first.")
    attention: Attention | None = None

    @classmethod
    def from_result(
        cls, result: TranslationResult, with_attention: bool, full: bool = False
    ) -> Translation:
        """``result`` as sent; with ``with_attention`` the last layer's cross-attention
        averaged over heads, and with ``full`` too that of every layer and head, rounded to
        :data:`ATTENTION_DECIMALS` places."""
        hypotheses = [HypothesisJSON.from_hypothesis(h) for h in result.hypotheses]
        fields: dict[str, Any] = {}
        if with_attention and result.attention is not None:
            maps = result.attention_maps
            extra = {}
            if full and maps is not None:  # (L, H, T, S); float64 rounds exactly
                extra = {"cross": _rounded(maps.cross.double())}
            fields["attention"] = Attention(
                src_tokens=result.src_tokens,
                tgt_tokens=result.tgt_tokens,
                mean=_rounded(result.attention.double()),
                **extra,
            )
        best = hypotheses[0].model_dump()
        return cls(**best, truncated=result.truncated, hypotheses=hypotheses, **fields)


class TranslateResponse(BaseModel):
    translations: list[Translation]


class Detection(BaseModel):
    language: str
    confidence: float


class LibreTranslateResponse(BaseModel):
    """LibreTranslate's answer: each field is a list when ``q`` was a list; fields with
    nothing to say are left out, as LibreTranslate does."""

    translatedText: str | list[str]  # LibreTranslate's names
    alternatives: list[str] | list[list[str]] | None = None
    detectedLanguage: Detection | list[Detection] | None = None


class Language(BaseModel):
    code: str
    name: str
    targets: list[str]


class ErrorResponse(BaseModel):
    error: str = Field(description="What was wrong, and which limit or field it concerns.")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 403, 408, 413, 415, 422, 429, 500, 503)
}  # for a route's ``responses=``: the errors it may answer, as documented in OpenAPI


def add_to_openapi(schema: dict[str, Any], *models: type[BaseModel]) -> None:
    """Adds ``models`` to the schema's components: the bodies that routes read themselves
    (:mod:`aiayn.serve.requests`) are not seen by FastAPI."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition


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
        if not stripped(text):
            if left := text.strip():  # nothing but format characters: U+200B, U+FEFF, ...
                what = f"holds only invisible format characters (U+{ord(left[0]):04X}, ...)"
            else:
                what = "is empty"
            raise ApiError(422, f"{label} {what}: there is nothing to translate")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ApiError(
                422,
                f"{label} is not valid Unicode: an unpaired surrogate "
                f"({text[error.start]!r}) at character {error.start}",
            ) from None


def parse_body(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model`` filled from ``data``, or a 422 ApiError naming the first problems."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ApiError(422, _validation_message(error, model)) from None


def first_problems(problems: list[str], total: int | None = None) -> str:
    """The first :data:`MAX_PROBLEMS` of ``problems`` and how many more there are of ``total``
    (default: all of them): an error answer stays short however many values are wrong."""
    shown = problems[:MAX_PROBLEMS]
    more = (len(problems) if total is None else total) - len(shown)
    message = "; ".join(shown)
    return message if more <= 0 else f"{message}; and {more} more problem{'s' * (more > 1)}"


def _validation_message(error: ValidationError, model: type[BaseModel]) -> str:
    """The first problems, each as ``texts[1]: Input should be a valid string (got 3)``, and
    how many more there are."""
    parts = []
    for item in error.errors(include_url=False)[:MAX_PROBLEMS]:
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
            got = "" if item["type"] == "value_error" else f" (got {describe_json(item['input'])})"
            parts.append(f"{location}: {message}{got}")
    return first_problems(parts, total=error.error_count())


def describe_json(value: Any) -> str:
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


def _rounded(values: torch.Tensor) -> Any:
    """Nested lists of ``values`` rounded to :data:`ATTENTION_DECIMALS` places, converted a row
    at a time: never one long call that holds the interpreter (see ``app._answer``)."""
    scale = 10**ATTENTION_DECIMALS
    return _row_by_row((values * scale).round().div(scale))


def _row_by_row(values: torch.Tensor) -> Any:
    if values.dim() <= 1:
        return values.tolist()
    return [_row_by_row(part) for part in values]


def _finite(x: float) -> float | None:
    """JSON has no infinities or NaN: such a score becomes null."""
    return x if math.isfinite(x) else None
