"""``aiayn serve``: the HTTP service. Its batching, limit, connection and access flags are the
fields of `ServerSettings`, generated with their documentation and defaults."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aiayn.cli.common import add_search_options, load_translator, search_options
from aiayn.cli.flags import add_dataclass_flags, dataclass_values, integer
from aiayn.serve.settings import ServerSettings  # no FastAPI, no torch: --help stays fast

# Fields whose flag drops the unit suffix (the flags predate the fields' names).
_FLAG_NAMES = {
    "timeout_keep_alive_s": "--timeout-keep-alive",
    "timeout_head_s": "--timeout-head",
    "timeout_body_s": "--timeout-body",
}
_GROUPS = {
    "batching": ("batch_wait_ms", "max_batch_cost", "batching"),
    "limits (a request over one gets a 4xx error naming it)": (
        "max_chars",
        "max_texts",
        "max_queue",
        "max_beam_size",
        "max_body_bytes",
        "max_text_cost",
        "max_request_cost",
        "max_attention_values",
        "busy_after_s",
    ),
    "connections": ("timeout_keep_alive_s", "timeout_head_s", "timeout_body_s", "max_connections"),
    "access (see docs/serving.md)": (
        "require_api_key",
        "key_requests_per_minute",
        "key_chars_per_minute",
        "docs",
    ),
}
# Not flags of their own field: the defaults come from the search flags, the keys from a file,
# the origins from a repeatable flag.
_BY_HAND = {"decoding", "api_keys", "cors_origins"}


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP: JSON API, LibreTranslate API and a web page",
        description="Serve translations over HTTP: POST /translate (aiayn's JSON API, and "
        "LibreTranslate's), GET /languages, POST /detect, GET /info, GET /health, the OpenAPI "
        "schema at /openapi.json, and at / a web page that translates and draws the "
        "attention. Concurrent requests are batched into one model call. The search flags "
        "set the defaults that requests may override (beam size, n-best, length penalty).",
    )
    add_search_options(p, backend=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )
    groups = {}
    for title, names in _GROUPS.items():
        groups[title] = g = p.add_argument_group(title)
        add_dataclass_flags(g, ServerSettings, only=names, names=_FLAG_NAMES)
    g = groups["access (see docs/serving.md)"]
    g.add_argument(
        "--api-keys",
        type=Path,
        metavar="FILE",
        help="API keys, one a line, optionally with requests and characters per minute; "
        "keys in $AIAYN_API_KEYS count too",
    )
    g.add_argument(
        "--cors-origin",
        action="append",
        dest="cors_origins",
        metavar="ORIGIN",
        help="an origin (https://example.org) whose pages may call the API; repeatable; "
        "POSTs from other origins are refused",
    )
    p.set_defaults(run=_run_serve)


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: refused as the flag is read, not by the socket
    once the model is loaded."""
    value = integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def _run_serve(args: argparse.Namespace) -> int:
    from aiayn.serve import Decoding, serve
    from aiayn.serve.keys import keys_from_environment, load_keys

    options = search_options(args)
    settings = ServerSettings(
        decoding=Decoding(**dataclasses.asdict(options)),
        api_keys=load_keys(args.api_keys, keys_from_environment()),
        cors_origins=tuple(args.cors_origins or ()),
        **dataclass_values(ServerSettings, args, skip=_BY_HAND),
    )
    translator = load_translator(args)
    translator.translate(["a"], beam_size=1, max_len_a=0, max_len_b=1)  # fail before listening
    serve(translator, settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0
