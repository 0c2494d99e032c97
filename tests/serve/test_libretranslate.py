"""Tests for aiayn.serve.libretranslate: LibreTranslate's API (JSON, form data, multipart and
query fields; its errors; /languages, /detect, /frontend/settings) and the real
`libretranslatepy` client against a live server, unchanged.
"""

from __future__ import annotations

import json
import urllib.error

import pytest
from fastapi.testclient import TestClient
from libretranslatepy import LibreTranslateAPI

from aiayn.decode.translator import Translator
from aiayn.serve.libretranslate import language_name

from .helpers import SENTENCES, assert_error, direct, live, post_raw


def test_libretranslate_json_string_and_list(client: TestClient, translator) -> None:
    expected = [r.text for r in direct(translator, SENTENCES[:2])]
    one = client.post("/translate", json={"q": SENTENCES[0], "source": "en", "target": "de"})
    assert one.status_code == 200 and one.json() == {"translatedText": expected[0]}
    many = client.post("/translate", json={"q": SENTENCES[:2], "source": "en", "target": "de"})
    assert many.json() == {"translatedText": expected}


def test_libretranslate_form_data_multipart_and_query(client: TestClient, translator) -> None:
    [expected] = [r.text for r in direct(translator, ["the cat sat"])]
    fields = {"q": "the cat sat", "source": "en", "target": "de", "api_key": "ignored"}
    urlencoded = client.post("/translate", data=fields)
    assert urlencoded.json() == {"translatedText": expected}
    multipart = client.post("/translate", data=fields, files={"unused": (None, "x")})
    assert multipart.request.headers["content-type"].startswith("multipart/form-data")
    assert multipart.json() == {"translatedText": expected}
    query = client.post("/translate", params=fields)
    assert query.json() == {"translatedText": expected}


def test_libretranslate_auto_source_and_alternatives(client: TestClient, translator) -> None:
    body = {"q": "the cat sat", "source": "auto", "target": "de", "alternatives": 1}
    answer = client.post("/translate", json=body).json()
    [expected] = direct(translator, ["the cat sat"], n_best=2)
    assert answer["translatedText"] == expected.text
    # distinct from the translation: this model's second hypothesis detokenizes to the same
    # text, so there is no alternative to give
    others = [h.text for h in expected.hypotheses[1:] if h.text != expected.text]
    assert answer["alternatives"] == others
    assert answer["detectedLanguage"] == {"language": "en", "confidence": 100.0}
    body["q"] = ["the cat sat", "hello"]
    answer = client.post("/translate", json=body).json()
    assert len(answer["alternatives"]) == 2 and len(answer["detectedLanguage"]) == 2


@pytest.mark.parametrize(
    ("fields", "status", "fragments"),
    [
        ({"q": "a", "source": "fr", "target": "de"}, 400, ["source language 'fr'", "en → de"]),
        ({"q": "a", "source": "en", "target": "es"}, 400, ["target language 'es'"]),
        ({"q": "a", "format": "html"}, 400, ["format 'html' is not supported"]),
        ({"source": "en", "target": "de"}, 422, ["missing 'q'"]),
        ({"q": "", "source": "en", "target": "de"}, 422, ["q is empty"]),
        ({"q": "a", "alternatives": "many"}, 422, ["alternatives", "valid integer"]),
        ({"q": "a", "alternatives": "4"}, 422, ["alternatives (4) must be at most 3"]),
        ({"q": "a" * 201}, 413, ["q has 201 characters; the limit is 200 (--max-chars)"]),
    ],
)
def test_libretranslate_errors(client: TestClient, fields, status, fragments) -> None:
    assert_error(client.post("/translate", data=fields), status, *fragments)


def test_libretranslate_json_errors(client: TestClient) -> None:
    assert_error(client.post("/translate", json={"q": 5}), 422, "q: must be a string or a list")
    assert_error(client.post("/translate", json={"q": ["a", ""]}), 422, "q[1] is empty")
    response = post_raw(client, b"q=caf%E9", "application/x-www-form-urlencoded")
    assert_error(response, 400, "not valid UTF-8")
    response = client.post("/translate", files={"q": ("text.txt", b"hello")})
    assert_error(response, 422, "file uploads are not supported")


def test_languages_detect_and_frontend_settings(client: TestClient) -> None:
    assert client.get("/languages").json() == [
        {"code": "en", "name": "English", "targets": ["de"]},
        {"code": "de", "name": "German", "targets": []},
    ]
    detections = [{"language": "en", "confidence": 100.0}]
    assert client.post("/detect", data={"q": "hello"}).json() == detections
    assert client.post("/detect", json={"q": "hello"}).json() == detections
    assert_error(client.post("/detect", data={"source": "en"}), 422, "missing 'q'")
    assert_error(client.post("/detect"), 400, "the request body is empty")
    settings = client.get("/frontend/settings").json()
    assert settings["charLimit"] == 200 and settings["keyRequired"] is False
    assert settings["language"]["target"] == {"code": "de", "name": "German"}


def test_language_names_are_libretranslates_and_unknown_codes_stand_for_themselves() -> None:
    assert language_name("EN") == "English" and language_name("xx") == "xx"


def test_the_libretranslatepy_client_works_unchanged(translator: Translator) -> None:
    [expected] = [r.text for r in direct(translator, ["the cat sat"])]
    with live(translator) as url:
        for api in (LibreTranslateAPI(url), LibreTranslateAPI(url + "/", api_key="secret")):
            assert api.translate("the cat sat", "en", "de") == expected
            assert api.languages()[0] == {"code": "en", "name": "English", "targets": ["de"]}
            assert api.detect("the cat sat") == [{"language": "en", "confidence": 100.0}]
        with pytest.raises(urllib.error.HTTPError) as refused:
            LibreTranslateAPI(url).translate("the cat sat", "en", "fr")
        assert refused.value.code == 400
        assert "target language 'fr'" in json.loads(refused.value.read())["error"]
