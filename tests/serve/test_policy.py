"""Tests for aiayn.serve.policy's middleware around a two-route app: security headers, the
refusal of cross-site POSTs, CORS for the origins allowed, and HEAD as GET. The server's own
routes behind it are tested in tests/serve/test_app.py."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="optional: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="optional: pip install -e '.[serve]'")

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from aiayn.serve.policy import PAGE_CSP, BrowserPolicy


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


def client(*origins: str) -> TestClient:
    routes = [Route("/", hello), Route("/translate", hello, methods=["POST"])]
    app = BrowserPolicy(Starlette(routes=routes), allowed_origins=origins)
    return TestClient(app, base_url="http://server.test")


def test_every_answer_carries_the_security_headers() -> None:
    answer = client().get("/")
    assert answer.text == "hello"
    assert answer.headers["content-security-policy"] == PAGE_CSP
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert "access-control-allow-origin" not in answer.headers  # no --cors-origin


def test_a_post_from_another_site_is_refused_before_the_app() -> None:
    answer = client().post("/translate", headers={"Origin": "https://evil.test"})
    assert answer.status_code == 403
    assert "cross-origin request from https://evil.test refused" in answer.json()["error"]
    assert answer.headers["x-frame-options"] == "DENY"


def test_a_post_from_the_servers_own_page_or_a_client_without_origin_passes() -> None:
    own = client().post("/translate", headers={"Origin": "http://server.test"})
    assert (own.status_code, own.text) == (200, "hello")
    assert client().post("/translate").status_code == 200  # curl sends no Origin


def test_an_allowed_origin_gets_cors_headers_and_its_preflight_answered() -> None:
    allowed = client("https://app.test/")  # a trailing slash or capitals are the same origin
    answer = allowed.post("/translate", headers={"Origin": "https://APP.test"})
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "https://APP.test"
    preflight = allowed.options(
        "/translate",
        headers={"Origin": "https://app.test", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 204
    assert "POST" in preflight.headers["access-control-allow-methods"]


def test_head_is_answered_as_get_without_the_body() -> None:
    answer = client().head("/")
    assert answer.status_code == 200
    assert answer.content == b""
    assert answer.headers["content-length"] == "5"
