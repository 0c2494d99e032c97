"""Reading request bodies (aiayn.serve.requests): the count of JSON values that decides, before
parsing, whether a body holds too many; and what the server answers around that limit.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import quote_plus, unquote_plus

import pytest
from fastapi.testclient import TestClient

from aiayn.decode.translator import Translator
from aiayn.serve import create_app, requests
from aiayn.serve.requests import _unquote_plus, too_many_json_values

from .helpers import SETTINGS, assert_error, post_raw

TRICKY = ',[]{}":\\ aé€😀\n\t'  # what strings may hold that looks like JSON syntax


def values(document: Any) -> int:
    """The reference: every value below the top-level one, counted on the parsed document."""
    if isinstance(document, dict):
        return sum(1 + values(v) for v in document.values())
    if isinstance(document, list):
        return sum(1 + values(v) for v in document)
    return 0


def random_document(rng: random.Random, depth: int = 0) -> Any:
    """Objects and lists (none empty) of strings full of JSON syntax, numbers, and literals."""
    kind = rng.choice(["object", "list"] if depth == 0 else ["object", "list", "scalar", "text"])
    if depth >= 3 or kind == "scalar":
        return rng.choice([0, -1.5e-3, 12345678901234567890, True, False, None])
    if kind == "text":
        return "".join(rng.choice(TRICKY) for _ in range(rng.randrange(0, 40)))
    size = rng.randrange(1, 6)
    if kind == "list":
        return [random_document(rng, depth + 1) for _ in range(size)]
    keys = ("".join(rng.choice(TRICKY) for _ in range(rng.randrange(0, 8))) for _ in range(size))
    return {key: random_document(rng, depth + 1) for key in keys}


def test_the_count_of_json_values_agrees_with_the_parsed_document() -> None:
    """Parity with a count on json.loads' result, for documents whose strings hold commas,
    brackets, escaped quotes and backslashes, in both spellings of non-ASCII."""
    rng = random.Random(0)
    through_strings = 0
    for _ in range(500):
        document = random_document(rng)
        body = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode()
        n = values(document)
        assert not too_many_json_values(body, n), body
        if n:
            assert too_many_json_values(body, n - 1), body
        through_strings += body.count(b",") + body.count(b"[") + body.count(b"{") > n
    assert through_strings > 100  # the second stage (syntax inside strings) was exercised


def test_empty_containers_count_once_more() -> None:
    """The count is an upper bound: an empty list or object counts as one value more."""
    assert values(json.loads(b'{"a": [], "b": {}}')) == 2
    assert too_many_json_values(b'{"a": [], "b": {}}', 3)
    assert not too_many_json_values(b'{"a": [], "b": {}}', 4)


def test_commas_inside_texts_are_not_values(client: TestClient) -> None:
    """A text full of commas and escaped quotes is a legitimate request, far under the limit
    of values (8 texts + 32 here) although it holds hundreds of ',' and '['."""
    text = '"a", [b], {c}, \\d, ' * 9
    response = client.post("/translate", json={"texts": [text[:200]] * 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["translations"]) == 3


def test_a_body_with_one_value_too_many_is_refused(client: TestClient) -> None:
    limit = SETTINGS.max_body_values
    assert limit == SETTINGS.max_texts + 32
    options = {f"x{i}": 0 for i in range(limit)}  # unknown fields: 422 if they were read
    assert_error(client.post("/translate", json={"text": "a", **options}), 413, f"{limit} values")
    del options["x0"]
    assert_error(client.post("/translate", json={"text": "a", **options}), 422, "unknown field")


def test_form_bodies_count_fields(client: TestClient) -> None:
    limit = SETTINGS.max_body_values
    form = "&".join(["q=a"] + [f"x{i}=" for i in range(limit)]).encode()
    urlencoded = "application/x-www-form-urlencoded"
    assert_error(post_raw(client, form, urlencoded), 413, f"more than {limit} values")
    fields = {f"x{i}": "" for i in range(limit)}
    response = client.post("/translate", data={"q": "a", **fields}, files={"f": ("f", b"")})
    assert_error(response, 413, f"more than {limit} values")  # multipart


def test_nesting_deeper_than_the_parser_goes_is_a_400(translator: Translator) -> None:
    """Where --max-texts lets a body hold 100,000 values, 100,000 nested lists get past the
    count and json.loads refuses them."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with TestClient(create_app(translator, replace(SETTINGS, max_texts=100_000))) as roomy:
        assert_error(post_raw(roomy, deep), 400, "nested too deeply")


@pytest.mark.parametrize("field", ["texts", "q"])
def test_an_error_answer_names_five_problems_and_counts_the_others(
    client: TestClient, field: str
) -> None:
    """Old server: one line for each of two million wrong values (a 116 MB answer)."""
    response = client.post("/translate", json={field: list(range(30))})
    message = assert_error(response, 422)
    if field == "texts":
        assert message.count("Input should be a valid string") == 5
        assert message.endswith("; and 25 more problems")
    else:  # LibreTranslate's validator says it once for the field
        assert "must be a string or a list of strings" in message
    unknown = {f"x{i}": 0 for i in range(30)}
    message = assert_error(client.post("/translate", json={"text": "a", **unknown}), 422)
    assert message.count("unknown field") == 5 and message.endswith("and 25 more problems")
    assert len(message) < 1500


@pytest.mark.parametrize("piece", [3, 4, 7, 1 << 16])
def test_form_values_are_percent_decoded_as_urllib_does(piece: int) -> None:
    """Parity with urllib's unquote_plus (UTF-8, strict) for slices of any size: an escape cut
    at a slice's end is not split."""
    rng = random.Random(piece)
    for _ in range(2000):
        raw = "".join(rng.choice("ab+%é€😀 &=%2F") for _ in range(rng.randrange(0, 60)))
        encoded = quote_plus(raw) if rng.random() < 0.5 else raw
        try:
            expected: str | type = unquote_plus(encoded, errors="strict")
        except UnicodeDecodeError:
            expected = UnicodeDecodeError
        try:
            decoded: str | type = _unquote_plus(encoded, piece)
        except UnicodeDecodeError:
            decoded = UnicodeDecodeError
        assert decoded == expected, encoded


def test_form_bodies_are_decoded_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Percent-decoding is Python code (~1 s for 4 MiB of escapes): held mid-decoding, the
    server still answers /health. Were it decoded on the event loop, /health would wait for the
    hold to time out (30 s, a guard), and the decoding would find it unreleased."""
    entered, released, waits = threading.Event(), threading.Event(), []

    def held(*args: Any) -> Any:
        entered.set()
        waits.append(released.wait(30))  # True: released by the test, not by the guard
        return parse(*args)

    parse = requests._parse_urlencoded
    monkeypatch.setattr(requests, "_parse_urlencoded", held)
    with ThreadPoolExecutor(1) as pool:
        form = pool.submit(post_raw, client, b"q=the+cat", "application/x-www-form-urlencoded")
        assert entered.wait(30)
        health = client.get("/health")
        released.set()
        assert health.status_code == 200
        assert form.result().status_code < 500
    assert waits == [True]


def test_the_query_string_is_read_as_a_form_body_is(client: TestClient) -> None:
    """LibreTranslate's clients put fields in the query string too. It was read leniently
    (Starlette's ``query_params``): invalid UTF-8 became U+FFFD and was translated, and of a
    repeated ``q`` only the last was kept, where a form body refuses the one and lists the
    other."""
    response = client.post("/translate?q=the+cat&q=the+dog&source=en&target=de")
    assert response.status_code == 200, response.text
    assert len(response.json()["translatedText"]) == 2  # both texts, as from a form body
    assert_error(client.post("/translate?q=%ff"), 400, "query string", "UTF-8")
    limit = SETTINGS.max_body_values
    many = "&".join(f"x{i}=1" for i in range(limit + 1))
    assert_error(client.post(f"/translate?q=a&{many}"), 413, "query string", f"{limit} values")


def test_the_query_string_of_a_json_request_is_not_read(client: TestClient) -> None:
    """With a JSON body only its fields count (as in LibreTranslate), so a query string it
    carries is not read either, and cannot make the request fail."""
    response = client.post("/translate?x=%ff&y=1", json={"text": "the cat"})
    assert response.status_code == 200, response.text
