"""LibreTranslate's API, so that its clients (libretranslatepy, LibreTranslate's web page and
plugins) work unchanged against ``aiayn serve``.

It is a compatibility layer over aiayn's own API, kept apart from it: :data:`router` holds the
routes only LibreTranslate has (``GET /languages``, ``POST /detect``, ``GET /frontend/settings``),
:func:`translate` answers the ``POST /translate`` bodies that are LibreTranslate's (the path is
shared; :mod:`aiayn.serve.app` tells them apart), and :func:`patch_openapi` documents them.

The model translates one language into one other, so ``/detect`` cannot identify languages: it
always answers the model's source language (confidence 100, as LibreTranslate reports a language
it was told), and ``source: "auto"`` means that language. ``api_key`` is checked as LibreTranslate
does (:mod:`aiayn.serve.keys`). ``alternatives`` are distinct from the translation and from each
other, so there may be fewer than asked for.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from aiayn.serve.schemas import (
    ERROR_RESPONSES,
    ApiError,
    Detection,
    Language,
    LibreTranslateRequest,
    LibreTranslateResponse,
    add_to_openapi,
    parse_body,
)

if TYPE_CHECKING:
    from aiayn.serve.app import Service
    from aiayn.serve.settings import Decoding

__all__ = ["LANGUAGE_NAMES", "language_name", "patch_openapi", "router", "translate"]

LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish",
    "fr": "French", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "la": "Latin", "lt": "Lithuanian",
    "lv": "Latvian", "nb": "Norwegian Bokmål", "nl": "Dutch", "pl": "Polish",
    "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}  # fmt: skip

router = APIRouter()


def language_name(code: str) -> str:
    """LibreTranslate shows languages by name; an unknown code stands for itself."""
    return LANGUAGE_NAMES.get(code.lower(), code)


async def translate(service: Service, request: Request, data: dict[str, Any]) -> JSONResponse:
    """A LibreTranslate ``POST /translate``: ``q`` (a string or a list) in, ``translatedText``
    out in the same shape, with ``alternatives`` (the n-best list) on request."""
    body = parse_body(LibreTranslateRequest, data)
    single = isinstance(body.q, str)
    texts = [body.q] if single else list(body.q)
    with service.charged(body.api_key, texts):
        service.check_texts(texts, "q", single=single)
        decoding = _decoding(service, body)
        results = await service.translate(request, texts, decoding, "q")
    fields: dict[str, list[Any]] = {"translatedText": [r.text for r in results]}
    if body.alternatives:
        fields["alternatives"] = [_distinct(r.text, r.hypotheses[1:]) for r in results]
    if body.source == "auto":
        fields["detectedLanguage"] = [_detection(service) for _ in results]
    answer = {key: value[0] for key, value in fields.items()} if single else fields
    return JSONResponse(LibreTranslateResponse(**answer).model_dump(exclude_unset=True))


def _decoding(service: Service, body: LibreTranslateRequest) -> Decoding:
    """The server's decoding with the n-best list ``alternatives`` asks for, after refusing
    what this server cannot do: another language pair, a format other than text, more
    alternatives than its beam allows."""
    _check_language(service, "source", body.source, ("auto", service.src_lang))
    _check_language(service, "target", body.target, (service.tgt_lang,))
    if body.format not in (None, "", "text"):
        raise ApiError(
            400, f"format {body.format!r} is not supported: this server translates plain text"
        )
    settings = service.settings
    n_best = body.alternatives + 1
    if n_best > settings.max_beam_size:
        raise ApiError(
            422,
            f"alternatives ({body.alternatives}) must be at most "
            f"{settings.max_beam_size - 1}: the n-best list comes from a beam of at most "
            f"{settings.max_beam_size} (--max-beam-size)",
        )
    return replace(
        settings.decoding,
        n_best=n_best,
        beam_size=max(settings.decoding.beam_size, n_best),
        return_attention=False,
    )


def _distinct(text: str, hypotheses: list[Any]) -> list[str]:
    """The texts of ``hypotheses`` without ``text`` and without repeats (two token sequences
    can detokenize to the same text), in order."""
    seen = {text}
    found = []
    for hypothesis in hypotheses:
        if hypothesis.text not in seen:
            seen.add(hypothesis.text)
            found.append(hypothesis.text)
    return found


def _check_language(
    service: Service, name: str, code: str | None, allowed: tuple[str, ...]
) -> None:
    if code not in (None, "", *allowed):
        raise ApiError(
            400,
            f"{name} language {code!r} is not supported: this model translates "
            f"{service.src_lang} → {service.tgt_lang} (see GET /languages)",
        )


def _detection(service: Service) -> Detection:
    return Detection(language=service.src_lang, confidence=100.0)


@router.get("/languages", responses={200: {"model": list[Language]}})
async def languages(request: Request) -> JSONResponse:
    """LibreTranslate's language list: the model's source language and its one target."""
    service: Service = request.app.state.service
    src, tgt = service.src_lang, service.tgt_lang
    found = [Language(code=src, name=language_name(src), targets=[tgt])]
    if tgt != src:
        found.append(Language(code=tgt, name=language_name(tgt), targets=[]))
    return JSONResponse([language.model_dump() for language in found])


@router.post("/detect", responses={200: {"model": list[Detection]}, **ERROR_RESPONSES})
async def detect(request: Request) -> JSONResponse:
    """LibreTranslate's language detection; always the model's source language."""
    service: Service = request.app.state.service
    _, data = await service.read(request)
    body = parse_body(LibreTranslateRequest, data)
    texts = [body.q] if isinstance(body.q, str) else list(body.q)
    with service.charged(body.api_key, texts):
        service.check_texts(texts, "q", single=isinstance(body.q, str))
    return JSONResponse([_detection(service).model_dump()])


@router.get("/frontend/settings")
async def frontend_settings(request: Request) -> JSONResponse:
    """LibreTranslate's settings for its web page and clients that read them."""
    service: Service = request.app.state.service
    src, tgt = service.src_lang, service.tgt_lang
    language = {
        "source": {"code": src, "name": language_name(src)},
        "target": {"code": tgt, "name": language_name(tgt)},
    }
    return JSONResponse(
        {
            "charLimit": service.settings.max_chars,
            "frontendTimeout": 500,
            "apiKeys": service.keys.enabled,
            "keyRequired": service.settings.require_api_key,
            "suggestions": False,
            "filesTranslation": False,
            "supportedFilesFormat": [],
            "language": language,
        }
    )


def patch_openapi(schema: dict[str, Any]) -> None:
    """Documents the LibreTranslate bodies that FastAPI cannot see (the routes read them
    themselves): JSON or form data for ``/detect``, and LibreTranslate's request and answer
    as alternatives to aiayn's on ``POST /translate``."""
    add_to_openapi(schema, LibreTranslateRequest, LibreTranslateResponse)
    libre = {"$ref": "#/components/schemas/LibreTranslateRequest"}
    forms = {
        "application/x-www-form-urlencoded": {"schema": libre},
        "multipart/form-data": {"schema": libre},
    }
    translate_op = schema["paths"]["/translate"]["post"]
    translate_body = translate_op["requestBody"]["content"]
    translate_body["application/json"]["schema"]["oneOf"].append(libre)
    translate_body.update(forms)
    detect_op = schema["paths"]["/detect"]["post"]
    detect_op["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": libre}, **forms},
    }
    ok = translate_op["responses"]["200"]["content"]["application/json"]["schema"]
    ok["oneOf"].append({"$ref": "#/components/schemas/LibreTranslateResponse"})
