"""What the server tests share: a tiny model's corpus, the server settings they run under, and
helpers to call the server and check its errors.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient

from aiayn.decode.translator import Translator
from aiayn.serve import Decoding, ServerSettings, create_app, serve_in_background
from model_dirs import CORPUS as ALL_LINES

CORPUS = ALL_LINES[:6]  # three English–German pairs
SENTENCES = ["the cat sat", "a dog barked at the moon", "hello world", "the mat", "a test"]
MAX_POSITIONS = 32
DECODING = Decoding(beam_size=2, max_len_a=0.0, max_len_b=4)  # random models rarely stop
SETTINGS = ServerSettings(decoding=DECODING, max_chars=200, max_texts=8, max_beam_size=4)


def direct(translator: Translator, texts: list[str], **options: Any) -> list:
    """What the translator itself says, with the server's default options."""
    values = {**DECODING.__dict__, **options}
    del values["full_attention"]  # the server's, not the translator's
    return translator.translate(texts, **values)


def post_raw(client: TestClient, body: bytes, content_type: str = "application/json"):
    return client.post("/translate", content=body, headers={"content-type": content_type})


def assert_error(response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    message = response.json()["error"]
    assert set(response.json()) == {"error"}
    for fragment in fragments:
        assert fragment in message, message
    return message


def http(url: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    """(status, decoded JSON) with urllib; errors are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@contextmanager
def live(translator: Translator, settings: ServerSettings = SETTINGS) -> Iterator[str]:
    with serve_in_background(create_app(translator, settings)) as url:
        yield url
