"""An HTTP translation service: aiayn's JSON API, LibreTranslate's API, and a web page.

``aiayn serve -m MODEL_DIR`` runs :func:`create_app` under uvicorn. Endpoints:

* ``POST /translate`` — two APIs on one path, told apart by the body:

  - **aiayn's**: a JSON object with ``text`` (a string) or ``texts`` (a list), and optional
    ``beam_size``, ``n_best``, ``length_penalty`` and ``return_attention``. The answer is
    ``{"translations": [...]}``, one entry per text, in order: text, score, log-probability,
    pieces, the n-best list, ``truncated``, and with ``return_attention`` the encoder-decoder
    attention of every layer and head, (L, H, T, S) nested lists rounded to 4 decimals, with
    the source and output pieces that label its columns and rows.
  - **LibreTranslate's** (so its clients work unchanged): ``q`` (a string or a list),
    ``source``, ``target``, ``format``, ``alternatives``, ``api_key``, as JSON or form data;
    the answer is ``{"translatedText": ...}``, a string or a list like ``q``. A JSON body
    with ``q`` is a LibreTranslate request; form data always is.

* ``GET /languages``, ``POST /detect``, ``GET /frontend/settings`` — LibreTranslate's. The
  model translates one language into one other, so ``/detect`` cannot identify languages: it
  always answers the model's source language (confidence 100, as LibreTranslate reports a
  language it was told), and ``source: "auto"`` means that language.
* ``GET /info`` (model, parameters, languages, decoding defaults, limits), ``GET /health``
  (worker state and batching counters), ``GET /openapi.json``, and ``GET /docs`` (FastAPI's
  Swagger UI, which loads its scripts from a CDN: the one page that needs the internet).
* ``GET /`` — a page that translates and draws the attention (``static/``, no libraries).

Concurrent requests are batched by :class:`aiayn.serve.batcher.Batcher`; bodies are read and
validated by :mod:`aiayn.serve.schemas`. Every error is a JSON object ``{"error": "..."}`` with a
4xx status saying what to fix (400 unreadable body, 413 a size limit, 415 content type, 422
invalid fields, 429 queue full) or 500 if the model failed; limits name the flag that sets
them. The API key is accepted and ignored: put the server behind
a proxy if it needs access control.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn import __version__
from aiayn.serve.batcher import Batcher, BatcherClosed, QueueFull
from aiayn.serve.schemas import (
    ApiError,
    Detection,
    ErrorResponse,
    Language,
    LibreTranslateRequest,
    LibreTranslateResponse,
    TranslateRequest,
    TranslateResponse,
    check_texts,
    read_request,
    translation_json,
    validate,
)
from aiayn.translator import TranslationResult, Translator

logger = logging.getLogger(__name__)

__all__ = ["Decoding", "ServerSettings", "create_app", "serve", "serve_in_background"]

STATIC_DIR = Path(__file__).parent / "static"


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decoding:
    """The search options of one request; requests with equal options share model calls.

    Defaults are the paper's (§6.1), as in :meth:`Translator.translate`.
    """

    beam_size: int = 4
    n_best: int = 1
    length_penalty: float = 0.6
    length_penalty_kind: str = "gnmt"
    max_len_a: float = 1.0
    max_len_b: float = 50
    return_attention: bool = False


@dataclass(frozen=True)
class ServerSettings:
    """How the server decodes by default, how it batches, and what it refuses.

    Attributes:
        decoding: Defaults; a request may change beam_size, n_best, length_penalty and
            return_attention (not the length limits, so no request can make decoding slow).
        max_chars: Longest text, in characters (Unicode code points).
        max_texts: Most texts in one request.
        max_queue: Most requests waiting for the model; more get 429.
        max_beam_size: Largest beam a request may ask for.
        max_body_bytes: Largest request body.
        batching: Merge concurrent requests into one model call (False: one call each).
        batch_wait_ms: How long a request may wait for others to join its call (no wait while
            requests come one at a time; see :mod:`aiayn.serve.batcher`).
        max_batch_tokens: Budget of one call: source tokens (EOS included) × beam size.
    """

    decoding: Decoding = field(default_factory=Decoding)
    max_chars: int = 5000
    max_texts: int = 64
    max_queue: int = 256
    max_beam_size: int = 16
    max_body_bytes: int = 4 * 1024 * 1024
    batching: bool = True
    batch_wait_ms: float = 5.0
    max_batch_tokens: int = 4096

    def __post_init__(self) -> None:
        limits = ("max_chars", "max_texts", "max_queue", "max_beam_size", "max_body_bytes")
        for name in (*limits, "max_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        if not self.batch_wait_ms >= 0:
            raise ValueError(f"batch_wait_ms ({self.batch_wait_ms}) must be >= 0")
        if not 1 <= self.decoding.beam_size <= self.max_beam_size:
            raise ValueError(
                f"the default beam size ({self.decoding.beam_size}) must be between 1 and "
                f"max_beam_size ({self.max_beam_size})"
            )
        if self.decoding.n_best > self.decoding.beam_size:
            raise ValueError(
                f"the default n_best ({self.decoding.n_best}) must be <= the default beam size "
                f"({self.decoding.beam_size})"
            )


# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


def create_app(translator: Translator, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI application serving ``translator``; see the module docstring for the API.

    The batching worker starts with the application's lifespan (and, failing that, on the first
    request) and stops with it.
    """
    settings = settings or ServerSettings()
    batcher: Batcher[TranslationResult] = Batcher(
        lambda texts, decoding: translator.translate(texts, **asdict(decoding)),
        lambda texts, decoding: translator.cost(texts, decoding.beam_size),
        max_wait_ms=settings.batch_wait_ms,
        max_batch_tokens=settings.max_batch_tokens,
        max_queue=settings.max_queue,
        batching=settings.batching,
    )
    src_lang = str(translator.metadata.get("src_lang") or "src")
    tgt_lang = str(translator.metadata.get("tgt_lang") or "tgt")
    info = _info(translator, settings, src_lang, tgt_lang)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await asyncio.to_thread(batcher.close)

    app = FastAPI(
        title="aiayn",
        version=__version__,
        summary="Transformer translation with request batching; LibreTranslate-compatible.",
        lifespan=lifespan,
    )
    app.state.batcher = batcher
    app.state.translator = translator
    app.state.settings = settings
    _add_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    errors = {code: {"model": ErrorResponse} for code in (400, 413, 415, 422, 429, 500, 503)}
    limits = {"max_texts": settings.max_texts, "max_chars": settings.max_chars}

    async def translate_texts(texts: list[str], decoding: Decoding) -> list[TranslationResult]:
        try:
            return await batcher.submit(texts, decoding)
        except QueueFull as error:
            raise ApiError(429, str(error), {"Retry-After": "1"}) from None
        except BatcherClosed as error:
            raise ApiError(503, str(error)) from None
        except Exception as error:
            raise ApiError(500, f"translation failed: {type(error).__name__}: {error}") from None

    def check_language(name: str, code: str | None, allowed: tuple[str, ...]) -> None:
        if code not in (None, "", *allowed):
            raise ApiError(
                400,
                f"{name} language {code!r} is not supported: this model translates "
                f"{src_lang} → {tgt_lang} (see GET /languages)",
            )

    @app.post("/translate", responses={200: {"model": TranslateResponse}, **errors})
    async def translate(request: Request) -> JSONResponse:
        """Translate with aiayn's API (JSON ``text``/``texts``) or LibreTranslate's (``q``)."""
        kind, data = await read_request(request, settings.max_body_bytes)
        if kind == "json" and "q" not in data:
            return await translate_aiayn(data)
        return await translate_libre(data)

    async def translate_aiayn(data: dict[str, Any]) -> JSONResponse:
        body = validate(TranslateRequest, data)
        if body.text is not None and body.texts is not None:
            raise ApiError(422, "give either 'text' or 'texts', not both")
        if body.text is None and body.texts is None:
            raise ApiError(
                422,
                "missing 'text' (a string) or 'texts' (a list of strings); "
                "LibreTranslate clients send 'q'",
            )
        texts, name = ([body.text], "text") if body.text is not None else (body.texts, "texts")
        check_texts(texts, name, single=body.text is not None, **limits)
        decoding = replace(
            settings.decoding,
            beam_size=_default(body.beam_size, settings.decoding.beam_size),
            n_best=_default(body.n_best, settings.decoding.n_best),
            length_penalty=_default(body.length_penalty, settings.decoding.length_penalty),
            return_attention=body.return_attention,
        )
        _check_decoding(decoding, settings)
        results = await translate_texts(texts, decoding)
        return JSONResponse(
            {"translations": [translation_json(r, decoding.return_attention) for r in results]}
        )

    async def translate_libre(data: dict[str, Any]) -> JSONResponse:
        body = validate(LibreTranslateRequest, data)
        single = isinstance(body.q, str)
        texts = [body.q] if single else list(body.q)
        check_texts(texts, "q", single=single, **limits)
        check_language("source", body.source, ("auto", src_lang))
        check_language("target", body.target, (tgt_lang,))
        if body.format not in (None, "", "text"):
            raise ApiError(
                400, f"format {body.format!r} is not supported: this server translates plain text"
            )
        n_best = body.alternatives + 1
        if n_best > settings.max_beam_size:
            raise ApiError(
                422,
                f"alternatives ({body.alternatives}) must be at most "
                f"{settings.max_beam_size - 1}: the n-best list comes from a beam of at most "
                f"{settings.max_beam_size} (--max-beam-size)",
            )
        decoding = replace(
            settings.decoding,
            n_best=n_best,
            beam_size=max(settings.decoding.beam_size, n_best),
            return_attention=False,
        )
        results = await translate_texts(texts, decoding)
        answer: dict[str, Any] = {"translatedText": [r.text for r in results]}
        if body.alternatives:
            answer["alternatives"] = [[h.text for h in r.hypotheses[1:]] for r in results]
        if body.source == "auto":
            answer["detectedLanguage"] = [_detection(src_lang) for _ in results]
        if single:
            answer = {key: value[0] for key, value in answer.items()}
        return JSONResponse(answer)

    @app.get("/languages", responses={200: {"model": list[Language]}})
    async def languages() -> JSONResponse:
        """LibreTranslate's language list: the model's source language and its one target."""
        found = [{"code": src_lang, "name": _language_name(src_lang), "targets": [tgt_lang]}]
        if tgt_lang != src_lang:
            found.append({"code": tgt_lang, "name": _language_name(tgt_lang), "targets": []})
        return JSONResponse(found)

    @app.post("/detect", responses={200: {"model": list[Detection]}, **errors})
    async def detect(request: Request) -> JSONResponse:
        """LibreTranslate's language detection; always the model's source language."""
        _, data = await read_request(request, settings.max_body_bytes)
        body = validate(LibreTranslateRequest, data)
        texts = [body.q] if isinstance(body.q, str) else list(body.q)
        check_texts(texts, "q", single=isinstance(body.q, str), **limits)
        return JSONResponse([_detection(src_lang)])

    @app.get("/frontend/settings")
    async def frontend_settings() -> JSONResponse:
        """LibreTranslate's settings for its web page and clients that read them."""
        language = {
            "source": {"code": src_lang, "name": _language_name(src_lang)},
            "target": {"code": tgt_lang, "name": _language_name(tgt_lang)},
        }
        return JSONResponse(
            {
                "charLimit": settings.max_chars,
                "frontendTimeout": 500,
                "apiKeys": False,
                "keyRequired": False,
                "suggestions": False,
                "filesTranslation": False,
                "supportedFilesFormat": [],
                "language": language,
            }
        )

    @app.get("/info")
    async def get_info() -> JSONResponse:
        """The model (config, parameter count, languages), decoding defaults and limits."""
        return JSONResponse(info)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the batching worker runs (503 otherwise), with its counters."""
        alive = batcher.alive
        body = {"status": "ok" if alive else "unavailable", "worker_alive": alive}
        return JSONResponse({**body, **batcher.stats()}, status_code=200 if alive else 503)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_decoding(decoding: Decoding, settings: ServerSettings) -> None:
    if decoding.beam_size > settings.max_beam_size:
        raise ApiError(
            422,
            f"beam_size ({decoding.beam_size}) is larger than the limit "
            f"{settings.max_beam_size} (--max-beam-size)",
        )
    if decoding.n_best > decoding.beam_size:
        raise ApiError(
            422, f"n_best ({decoding.n_best}) must be <= beam_size ({decoding.beam_size})"
        )


def _detection(language: str) -> dict[str, Any]:
    return {"language": language, "confidence": 100.0}


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": ...}``, FastAPI's and Starlette's own included."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": error.message}, error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{error.detail}: {request.method} {request.url.path}"
        return JSONResponse({"error": message}, error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        return JSONResponse({"error": message}, 422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error: {type(error).__name__}: {error}"}, 500)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the two request bodies that ``POST /translate`` reads itself."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (TranslateRequest, LibreTranslateRequest, LibreTranslateResponse):
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition
    ref = "#/components/schemas/{}".format
    libre = {"$ref": ref("LibreTranslateRequest")}
    for path in ("/translate", "/detect"):
        operation = schema["paths"][path]["post"]
        json_schema = {"oneOf": [{"$ref": ref("TranslateRequest")}, libre]}
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": json_schema if path == "/translate" else libre},
                "application/x-www-form-urlencoded": {"schema": libre},
                "multipart/form-data": {"schema": libre},
            },
        }
    answers = [{"$ref": ref("TranslateResponse")}, {"$ref": ref("LibreTranslateResponse")}]
    ok = schema["paths"]["/translate"]["post"]["responses"]["200"]["content"]["application/json"]
    ok["schema"] = {"oneOf": answers}
    app.openapi_schema = schema
    return schema


# -- facts about the model ----------------------------------------------------------------------

LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish",
    "fr": "French", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "la": "Latin", "lt": "Lithuanian",
    "lv": "Latvian", "nb": "Norwegian Bokmål", "nl": "Dutch", "pl": "Polish",
    "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}  # fmt: skip


def _language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code.lower(), code)


def _info(
    translator: Translator, settings: ServerSettings, src_lang: str, tgt_lang: str
) -> dict[str, Any]:
    decoding = asdict(settings.decoding)
    del decoding["return_attention"]
    limits = {
        name: getattr(settings, name)
        for name in ("max_chars", "max_texts", "max_queue", "max_beam_size", "max_body_bytes")
    }
    return {
        "version": __version__,
        "model": translator.model.config.to_dict(),
        "parameters": sum(p.numel() for p in translator.model.parameters()),
        "languages": {
            "source": {"code": src_lang, "name": _language_name(src_lang)},
            "target": {"code": tgt_lang, "name": _language_name(tgt_lang)},
        },
        "metadata": translator.metadata,
        "device": str(translator.device),
        "decoding": decoding,
        "limits": limits,
        "batching": {
            "enabled": settings.batching,
            "batch_wait_ms": settings.batch_wait_ms,
            "max_batch_tokens": settings.max_batch_tokens,
            "translator_max_tokens": translator.max_tokens,
        },
    }


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def serve(
    translator: Translator,
    settings: ServerSettings | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serves until interrupted (what ``aiayn serve`` runs)."""
    uvicorn.run(create_app(translator, settings), host=host, port=port, log_level=log_level)


@contextlib.contextmanager
def serve_in_background(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> Iterator[str]:
    """Runs ``app`` under uvicorn in a thread; yields its base URL (``http://127.0.0.1:PORT``).

    Port 0 picks a free port. The socket is bound before the server starts, so the URL is valid
    as soon as it is yielded. For tests, benchmarks and notebooks; IPv4 only.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_host, bound_port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="aiayn-server", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {bound_host}:{bound_port} did not start")
            time.sleep(0.01)
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
