"""An HTTP translation service: aiayn's JSON API, LibreTranslate's API, and a web page.

``aiayn serve -m MODEL_DIR`` runs :func:`create_app` under uvicorn. Endpoints:

* ``POST /translate`` — two APIs on one path, told apart by the body:

  - **aiayn's**: a JSON object with ``text`` (a string) or ``texts`` (a list), and optional
    ``beam_size``, ``n_best``, ``length_penalty``, ``return_attention``, ``full_attention``
    and ``api_key``. The answer is ``{"translations": [...]}``, one entry per text, in order:
    text, score, log-probability, pieces, the n-best list, ``truncated``, and with
    ``return_attention`` the last layer's encoder-decoder attention averaged over heads, (T, S)
    (with ``full_attention`` also every layer and head, (L, H, T, S)), rounded to 4 decimals,
    with the source and output pieces that label its columns and rows.
  - **LibreTranslate's** (so its clients work unchanged): ``q`` (a string or a list),
    ``source``, ``target``, ``format``, ``alternatives``, ``api_key``, as JSON or form data;
    the answer is ``{"translatedText": ...}``, a string or a list like ``q``. A JSON body
    with ``q`` is a LibreTranslate request; form data always is.

* ``GET /languages``, ``POST /detect``, ``GET /frontend/settings`` — LibreTranslate's
  (:mod:`aiayn.serve.libretranslate`, which also answers its ``POST /translate`` bodies).
* ``GET /info`` (model, parameters, languages, decoding defaults, limits), ``GET /health``
  (worker state, "ok" or "busy", queue and batching counters), ``GET /openapi.json`` (with the
  server's limits as field maxima), and with ``--docs`` ``GET /docs`` and ``/redoc`` (which
  load their scripts from a CDN).
* ``GET /`` — a page that translates and draws the attention (``static/``, no libraries).

Every request's cost (source tokens × beam × output-length limit) and attention size are
checked before it is queued; the texts of concurrent requests are batched fairly by
:class:`aiayn.serve.batcher.Batcher`, and a request whose client hangs up is dropped. Bodies
are read by :mod:`aiayn.serve.requests` and validated, and answers built, by the pydantic
models of :mod:`aiayn.serve.schemas`. API keys are :mod:`aiayn.serve.keys`; security headers,
the origin check and CORS :mod:`aiayn.serve.policy`; connection deadlines, the connection cap
and the request heads refused before the app sees them (400 malformed or ambiguous framing,
414 target too long, 431 head too large, 505 not HTTP/1.x) :mod:`aiayn.serve.connections`.
``docs/serving.md`` says what each limit protects. Every error is a JSON object
``{"error": "..."}`` with a 4xx status saying what to fix (400 unreadable body, 403 key or
origin refused, 408 body too slow, 413 a size, value-count or cost limit, 415 content type, 422
invalid fields, naming the first few, 429 queue full or key over its rate) or 500 if the model
failed; limits name the flag that sets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from aiayn.extras import require

# ruff: noqa: E402  (the imports below need the extra, which this line checks first)
require(
    "serve",
    "fastapi",
    "uvicorn",
    "httptools",
    "python_multipart|multipart",
    needed_by="aiayn.serve",
)

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.config import LOGGING_CONFIG

from aiayn import __version__, runtime
from aiayn.decode.costs import DecodingCosts
from aiayn.decode.results import TranslationResult
from aiayn.decode.translator import Translator
from aiayn.serve import libretranslate
from aiayn.serve.batcher import Batcher, BatcherClosed, QueueFull
from aiayn.serve.connections import FD_SPARE, BodyDeadline, connection_cap, guarded_protocol
from aiayn.serve.keys import KeyRejected, RateLimiter
from aiayn.serve.policy import BrowserPolicy
from aiayn.serve.requests import read_request
from aiayn.serve.schemas import (
    ERROR_RESPONSES,
    ApiError,
    ClientGone,
    TranslateRequest,
    TranslateResponse,
    Translation,
    add_to_openapi,
    check_texts,
    first_problems,
    parse_body,
)
from aiayn.serve.settings import (
    INTEGER_LIMITS,
    SERVER_MAX_LENGTH_PENALTY,
    Decoding,
    ServerSettings,
    call_budget,
)

logger = logging.getLogger(__name__)

__all__ = ["Decoding", "ServerSettings", "Service", "create_app", "serve", "serve_in_background"]

STATIC_DIR = Path(__file__).parent / "static"


# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


class Service:
    """What the routes share: the translator behind its batcher, what its work costs
    (`aiayn.decode.costs.DecodingCosts`: the unit of the budgets), the settings, the key rate
    limiter, and the model's languages. One per application, on ``app.state.service``, so that
    routes are plain module functions (in :data:`router` and
    :data:`aiayn.serve.libretranslate.router`), not closures.
    """

    def __init__(self, translator: Translator, settings: ServerSettings) -> None:
        self.translator = translator
        self.costs = costs = DecodingCosts(translator.tokenizer, translator.source_limits)
        self.settings = settings
        self.batcher: Batcher[TranslationResult] = Batcher(
            lambda texts, decoding: _translated(translator, texts, decoding),
            lambda texts, d: costs.cost(
                texts, d.rows_per_sentence, max_len_a=d.max_len_a, max_len_b=d.max_len_b
            ),
            max_wait_ms=settings.batch_wait_ms,
            max_batch_cost=call_budget(settings, translator.max_tokens),
            max_queue=settings.max_queue,
            batching=settings.batching,
        )
        self.keys = RateLimiter(
            settings.api_keys,
            required=settings.require_api_key,
            requests_per_minute=settings.key_requests_per_minute,
            chars_per_minute=settings.key_chars_per_minute,
        )
        self.src_lang = str(translator.metadata.get("src_lang") or "src")
        self.tgt_lang = str(translator.metadata.get("tgt_lang") or "tgt")
        config = translator.model.config
        self.maps_per_text = config.n_decoder_layers * config.n_heads  # (L, H) of cross-attention
        self.info = _info(self)

    async def read(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The body as ("json" | "form", fields), under ``--max-body-bytes`` and
        ``max_body_values``."""
        limits = self.settings
        return await read_request(request, limits.max_body_bytes, limits.max_body_values)

    def check_texts(self, texts: list[str], name: str, *, single: bool) -> None:
        """Refuses texts over the limits, or blank (see :func:`schemas.check_texts`)."""
        limits = self.settings
        check_texts(
            texts, name, single=single, max_texts=limits.max_texts, max_chars=limits.max_chars
        )

    @contextlib.contextmanager
    def charged(self, api_key: str | None, texts: list[str]) -> Iterator[None]:
        """Checks the API key and charges it the request (403, 413 or 429 otherwise), for a
        block that checks and serves it. A request the block refuses (an ApiError) is refunded
        its characters; where the refusal is the server's own (a full queue, a server closing,
        a failure: 429, 503, 500) the request too. A client that hangs up once its request is
        admitted has spent both."""
        chars = sum(len(text) for text in texts)
        try:
            self.keys.charge(api_key, chars)
        except KeyRejected as error:
            headers = None if error.retry_after is None else {"Retry-After": str(error.retry_after)}
            raise ApiError(error.status, error.message, headers) from None
        try:
            yield
        except ApiError as error:
            self.keys.refund(api_key, chars, request=error.status in (429, 500, 503))
            raise

    async def translate(
        self, request: Request, texts: list[str], decoding: Decoding, name: str
    ) -> list[TranslationResult]:
        """The results from the batcher once the request's cost is admitted; its refusals and
        the model's failures as ApiErrors. Dropped if the client hangs up meanwhile."""
        costs = await asyncio.to_thread(self._admit, texts, decoding, name)
        job = asyncio.ensure_future(self.batcher.submit(texts, decoding, costs))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            abandoned = not job.done()
            if abandoned:  # (cancel() only asks: the job is not cancelled() before it runs again)
                job.cancel()  # the batcher drops its texts not yet translated
        if abandoned:
            raise ClientGone("the client went away while its request waited")
        try:
            return job.result()
        except QueueFull as error:
            raise ApiError(429, str(error), {"Retry-After": "1"}) from None
        except BatcherClosed as error:
            raise ApiError(503, str(error)) from None
        except Exception as error:
            raise ApiError(500, f"translation failed: {type(error).__name__}: {error}") from None

    def _admit(self, texts: list[str], decoding: Decoding, name: str) -> list[int]:
        """Each text's cost, after refusing a request over the cost and attention budgets."""
        lengths = {"max_len_a": decoding.max_len_a, "max_len_b": decoding.max_len_b}
        costs = self.costs.costs(texts, decoding.rows_per_sentence, **lengths)
        limits = self.settings
        unit = "source tokens × beam size × output-length limit"
        for i, cost in enumerate(costs):
            if cost > limits.max_text_cost:
                label = name if len(texts) == 1 else f"{name}[{i}]"
                raise ApiError(
                    413,
                    f"{label} would cost {cost} ({unit}), more than one text may: "
                    f"{limits.max_text_cost} (--max-text-cost); send a shorter text or ask "
                    "for a smaller beam",
                )
        if sum(costs) > limits.max_request_cost:
            raise ApiError(
                413,
                f"the request would cost {sum(costs)} ({unit}); the limit is "
                f"{limits.max_request_cost} (--max-request-cost); send fewer or shorter texts "
                "or ask for a smaller beam",
            )
        if decoding.return_attention:
            bounds = self.costs.search_bounds(texts, **lengths)
            per_map = sum(s * t for s, t in bounds)
            full_attention = decoding.full_attention
            values = per_map * (self.maps_per_text if full_attention else 1)
            if values > limits.max_attention_values:
                what = "every layer's and head's" if full_attention else "the averaged"
                raise ApiError(
                    413,
                    f"{what} attention of this request could hold {values} values; the "
                    f"limit is {limits.max_attention_values} (--max-attention-values)"
                    + ("; leave out full_attention for the average" if full_attention else ""),
                )
        return costs


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: receive() then waits for
    the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(translator: Translator, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI application serving ``translator``; see the module docstring for the API.

    The batching worker starts with the application's lifespan (and, failing that, on the first
    request) and stops with it.
    """
    service = Service(translator, settings or ServerSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.batcher.start()
        yield
        await asyncio.to_thread(service.batcher.close)

    docs = service.settings.docs
    app = FastAPI(
        title="aiayn",
        version=__version__,
        summary="Transformer translation with request batching; LibreTranslate-compatible.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.service = service
    app.state.batcher = service.batcher
    app.state.translator = translator
    app.state.settings = service.settings
    _add_error_handlers(app)
    app.include_router(router)
    app.include_router(libretranslate.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(BodyDeadline, body_timeout_s=service.settings.timeout_body_s)
    app.add_middleware(BrowserPolicy, allowed_origins=service.settings.cors_origins)
    return app


router = APIRouter()  # aiayn's own routes; LibreTranslate's are in its module


@router.post("/translate", responses={200: {"model": TranslateResponse}, **ERROR_RESPONSES})
async def translate(request: Request) -> JSONResponse:
    """Translate with aiayn's API (JSON ``text``/``texts``) or LibreTranslate's (``q``)."""
    service: Service = request.app.state.service
    kind, data = await service.read(request)
    if kind == "json" and "q" not in data:
        return await _translate_aiayn(service, request, data)
    return await libretranslate.translate(service, request, data)


async def _translate_aiayn(
    service: Service, request: Request, data: dict[str, Any]
) -> JSONResponse:
    body = parse_body(TranslateRequest, data)
    if body.text is not None and body.texts is not None:
        raise ApiError(422, "give either 'text' or 'texts', not both")
    if body.text is None and body.texts is None:
        raise ApiError(
            422,
            "missing 'text' (a string) or 'texts' (a list of strings); "
            "LibreTranslate clients send 'q'",
        )
    texts, name = ([body.text], "text") if body.text is not None else (body.texts, "texts")
    with service.charged(body.api_key, texts):
        service.check_texts(texts, name, single=body.text is not None)
        decoding = _decoding(body, service.settings)
        if decoding.return_attention and not service.translator.returns_attention:
            raise ApiError(
                422,
                "this server's model returns no attention maps (a CTranslate2 or ONNX export): "
                "leave out return_attention",
            )
        results = await service.translate(request, texts, decoding, name)
    answer = await asyncio.to_thread(
        _answer, results, decoding.return_attention, decoding.full_attention
    )
    return Response(answer, media_type="application/json")


def _translated(
    translator: Translator, texts: list[str], decoding: Decoding
) -> list[TranslationResult]:
    """One model call of the batcher. An answer holds cross-attention only, so the encoder's
    and the decoder's self-attention maps are never made; without ``full_attention`` only the
    average of the last layer's heads is kept, and every layer's and head's maps, (L, H, T, S)
    a text, are let go at once: ``--max-attention-values`` counts what an answer keeps."""
    options = asdict(decoding)
    del options["full_attention"]
    options["return_attention"] = decoding.return_attention and ["cross"]
    results = translator.translate(texts, **options)
    if decoding.return_attention and not decoding.full_attention:
        results = [replace(result, attention_maps=None) for result in results]
    return results


def _answer(results: list[TranslationResult], with_attention: bool, full: bool) -> bytes:
    """:class:`TranslateResponse` as JSON, built in a worker thread. With attention it may hold
    ``--max-attention-values`` (2 million) numbers, whose conversion to Python lists, validation
    and rendering cost about a second of CPU: done a row (lists) or a translation (validation,
    pydantic's rendering, 6× faster than ``json.dumps``) at a time, each piece holds the
    interpreter, and so the event loop, for a fraction of that."""
    translations = (Translation.from_result(r, with_attention, full=full) for r in results)
    rendered = ",".join(t.model_dump_json(exclude_unset=True) for t in translations)
    return f'{{"translations":[{rendered}]}}'.encode()


def _decoding(body: TranslateRequest, settings: ServerSettings) -> Decoding:
    """The server's defaults with the request's options, within the limits."""
    defaults = settings.decoding
    try:  # DecodingOptions checks the combination (e.g. n_best <= beam_size)
        decoding = replace(
            defaults,
            beam_size=_default(body.beam_size, defaults.beam_size),
            n_best=_default(body.n_best, defaults.n_best),
            length_penalty=_default(body.length_penalty, defaults.length_penalty),
            return_attention=body.return_attention,
            full_attention=body.return_attention and body.full_attention,
        )
    except ValueError as error:
        raise ApiError(422, str(error)) from None
    if decoding.beam_size > settings.max_beam_size:
        raise ApiError(
            422,
            f"beam_size ({decoding.beam_size}) is larger than the limit "
            f"{settings.max_beam_size} (--max-beam-size)",
        )
    return decoding


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


@router.get("/info")
async def get_info(request: Request) -> JSONResponse:
    """The model (config, parameter count, languages), decoding defaults and limits."""
    return JSONResponse(request.app.state.service.info)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the batching worker runs (503 otherwise), with its counters and the queue:
    ``status`` is "busy" once the oldest unanswered request has waited ``--busy-after-s``."""
    service: Service = request.app.state.service
    alive = service.batcher.alive
    stats = service.batcher.stats()
    status = "unavailable" if not alive else "ok"
    if alive and stats["oldest_wait_s"] > service.settings.busy_after_s:
        status = "busy"
    body = {"status": status, "worker_alive": alive}
    return JSONResponse({**body, **stats}, status_code=200 if alive else 503)


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html")


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
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()]
        return JSONResponse({"error": first_problems(problems)}, 422)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone) -> JSONResponse:
        client = request.client.host if request.client else "?"
        logger.info("%s %s from %s: %s", request.method, request.url.path, client, error)
        return JSONResponse({"error": str(error)}, 499)  # nobody reads it (nginx's code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error: {type(error).__name__}: {error}"}, 500)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the request bodies that ``POST /translate`` reads itself."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    add_to_openapi(schema, TranslateRequest)
    operation = schema["paths"]["/translate"]["post"]
    body = {"oneOf": [{"$ref": "#/components/schemas/TranslateRequest"}]}
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    ok = operation["responses"]["200"]["content"]["application/json"]
    ok["schema"] = {"oneOf": [ok["schema"]]}
    libretranslate.patch_openapi(schema)
    _openapi_limits(schema, app.state.service.settings)
    app.openapi_schema = schema
    return schema


def _openapi_limits(schema: dict[str, Any], settings: ServerSettings) -> None:
    """The server's own limits as field maxima in the schema (the models carry only the bounds
    that hold for every server)."""
    components = schema["components"]["schemas"]
    aiayn = components["TranslateRequest"]["properties"]
    libre = components["LibreTranslateRequest"]["properties"]
    for prop in (aiayn["text"], aiayn["texts"], libre["q"]):
        _constrain(prop, maxLength=settings.max_chars, maxItems=settings.max_texts)
    for prop in (aiayn["beam_size"], aiayn["n_best"]):
        _constrain(prop, maximum=settings.max_beam_size)
    _constrain(libre["alternatives"], maximum=settings.max_beam_size - 1)
    components["TranslateRequest"]["description"] += (
        f" A request may cost at most {settings.max_request_cost} (source tokens × beam size "
        f"× output-length limit; one text at most {settings.max_text_cost}), and its "
        f"attention hold at most {settings.max_attention_values} values; more get 413."
    )


def _constrain(prop: dict[str, Any], **limits: int) -> None:
    """Adds ``maxLength`` to string branches, ``maxItems`` (and the items' ``maxLength``) to
    array branches, ``maximum`` to integer branches of a property schema."""
    for branch in prop.get("anyOf", [prop]):
        kind = branch.get("type")
        if kind == "string" and "maxLength" in limits:
            branch["maxLength"] = limits["maxLength"]
        elif kind == "array" and "maxItems" in limits:
            branch["maxItems"] = limits["maxItems"]
            _constrain(branch.get("items", {}), maxLength=limits["maxLength"])
        elif kind == "integer" and "maximum" in limits:
            branch["maximum"] = limits["maximum"]


def _info(service: Service) -> dict[str, Any]:
    """``GET /info``'s answer, computed once: the model, languages, defaults and limits."""
    translator, settings = service.translator, service.settings
    decoding = asdict(settings.decoding)
    del decoding["return_attention"], decoding["full_attention"]
    limits: dict[str, Any] = {name: getattr(settings, name) for name in INTEGER_LIMITS}
    limits.update(
        max_body_values=settings.max_body_values,
        max_length_penalty=SERVER_MAX_LENGTH_PENALTY,
        busy_after_s=settings.busy_after_s,
        timeout_keep_alive_s=settings.timeout_keep_alive_s,
        timeout_head_s=settings.timeout_head_s,
        timeout_body_s=settings.timeout_body_s,
        api_keys=bool(settings.api_keys),
        require_api_key=settings.require_api_key,
    )
    name = libretranslate.language_name
    return {
        "version": __version__,
        "model": translator.model.config.to_dict(),
        # An export (CTranslate2, ONNX) holds its weights outside PyTorch: no count.
        "parameters": (
            sum(p.numel() for p in translator.model.parameters())
            if isinstance(translator.model, torch.nn.Module)
            else None
        ),
        "languages": {
            "source": {"code": service.src_lang, "name": name(service.src_lang)},
            "target": {"code": service.tgt_lang, "name": name(service.tgt_lang)},
        },
        "metadata": translator.metadata,
        "device": str(translator.device),
        "decoding": decoding,
        "limits": limits,
        "batching": {
            "enabled": settings.batching,
            "batch_wait_ms": settings.batch_wait_ms,
            "max_batch_cost": service.batcher.max_batch_cost,
            "translator_max_tokens": translator.max_tokens,
        },
    }


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


SHUTDOWN_GRACE_S = 5
"""How long a shutdown waits for the model call under way, then for the answers being sent
(:class:`_Server`): a shutdown takes at most twice this; what still runs after it is
cancelled."""


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) first closes the batcher: the model
    call under way finishes and the requests waiting for the model are answered 503 "the server
    is shutting down" at once. uvicorn alone lets every request in flight finish first, which
    a queue of costly ones makes minutes."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        service = getattr(self.config.app.state, "service", None)  # None: not create_app's
        if service is not None:
            # the model call under way gets the grace too, not the batcher's own 30 s
            await asyncio.to_thread(service.batcher.close, SHUTDOWN_GRACE_S)
        await super().shutdown(sockets)


def serve(
    translator: Translator,
    settings: ServerSettings | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serves until interrupted: the entry point of ``aiayn serve``, which owns its process.

    The one function of this package that sets what belongs to the process: the limit on open
    files, raised to fit ``max_connections`` (`runtime.configure`), and uvicorn's logging
    configuration (its handlers, and ``log_level`` on its loggers). In a process whose owner
    keeps those, run :func:`create_app` under :func:`uvicorn_config` or
    :func:`serve_in_background` instead.
    """
    settings = settings or ServerSettings()
    runtime.configure(open_files=settings.max_connections + FD_SPARE)
    app = create_app(translator, settings)
    config = uvicorn_config(app, settings, log_level=log_level, log_config=LOGGING_CONFIG)
    config.host, config.port = host, port
    _Server(config).run()


def uvicorn_config(
    app: FastAPI,
    settings: ServerSettings,
    *,
    log_level: str | None,
    log_config: dict[str, Any] | None = None,
) -> uvicorn.Config:
    """Uvicorn's configuration: the httptools parser with the head limits and connection limits
    of :mod:`aiayn.serve.connections` (the cap lowered to fit the file-descriptor limit as it
    is), and texts and keys redacted from the access log.

    Args:
        log_level: The level uvicorn sets on its loggers (process-wide); None leaves them.
        log_config: The `logging.config.dictConfig` uvicorn applies (process-wide); None, the
            default, applies none.
    """
    max_connections = connection_cap(settings.max_connections)
    return uvicorn.Config(
        app,
        log_level=log_level,
        log_config=log_config,
        lifespan="on",
        http=guarded_protocol(settings.timeout_head_s, max_connections),
        timeout_keep_alive=settings.timeout_keep_alive_s,  # type: ignore[arg-type]  # a float works
        limit_concurrency=max_connections,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


@contextlib.contextmanager
def serve_in_background(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str | None = None
) -> Iterator[str]:
    """Runs ``app`` under uvicorn in a thread; yields its base URL (``http://127.0.0.1:PORT``).

    Port 0 picks a free port. The socket is bound before the server starts, so the URL is valid
    as soon as it is yielded. For tests, benchmarks and notebooks; IPv4 only. The process is
    left as it is: the limit on open files (the connection cap fits it), and logging, where
    uvicorn's lines go to the program's own handlers, unless ``log_level`` is given: then
    uvicorn configures its loggers (process-wide) as ``aiayn serve`` does.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_host, bound_port = sock.getsockname()[:2]
    log_config = None if log_level is None else LOGGING_CONFIG
    config = uvicorn_config(app, app.state.settings, log_level=log_level, log_config=log_config)
    server = _Server(config)
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
