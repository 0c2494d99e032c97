"""Tests for aiayn.serve.app: every endpoint, every error case (status code and message), the
LibreTranslate API through the real `libretranslatepy` client, batching of concurrent requests
on a live server, and `aiayn serve`'s flags.

The model is tiny with random weights: its translations are garbage, but deterministic, so the
server's answers can be compared with `Translator.translate` called directly. Live servers
listen on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from libretranslatepy import LibreTranslateAPI

from aiayn import checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.serve import Decoding, ServerSettings, create_app, serve_in_background
from aiayn.serve.app import STATIC_DIR
from aiayn.tokenizer import Tokenizer
from aiayn.translator import Translator

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon all night",
    "hello world, this is a small test",
    "die katze sass auf der matte",
    "ein hund bellte die ganze nacht den mond an",
    "hallo welt, das ist ein kleiner test",
]
SENTENCES = ["the cat sat", "a dog barked at the moon", "hello world", "the mat", "a test"]
MAX_POSITIONS = 32
DECODING = Decoding(beam_size=2, max_len_a=0.0, max_len_b=4)  # random models rarely stop
SETTINGS = ServerSettings(decoding=DECODING, max_chars=200, max_texts=8, max_beam_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("server")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=300)
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, max_positions=MAX_POSITIONS)
    return checkpoint.save_model_dir(
        directory / "model",
        Transformer(config),
        tokenizer_file=tokenizer.model_file,
        metadata={"src_lang": "en", "tgt_lang": "de"},
    )


@pytest.fixture(scope="module")
def translator(model_dir: Path) -> Translator:
    return Translator(model_dir)


@pytest.fixture(scope="module")
def client(translator: Translator) -> Iterator[TestClient]:
    with TestClient(create_app(translator, SETTINGS)) as test_client:
        yield test_client


def direct(translator: Translator, texts: list[str], **options: Any) -> list:
    """What the translator itself says, with the server's default options."""
    values = {**DECODING.__dict__, **options}
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


# -- aiayn's API ---------------------------------------------------------------------------------


def test_translate_one_text_as_the_translator_does(client: TestClient, translator) -> None:
    response = client.post("/translate", json={"text": "the cat sat"})
    assert response.status_code == 200
    [answer] = response.json()["translations"]
    [expected] = direct(translator, ["the cat sat"])
    assert answer["text"] == expected.text
    assert answer["tokens"] == expected.tokens
    assert answer["score"] == pytest.approx(expected.score, abs=1e-5)
    assert answer["log_prob"] == pytest.approx(expected.log_prob, abs=1e-5)
    assert answer["truncated"] is False
    assert len(answer["hypotheses"]) == 1 and answer["hypotheses"][0]["text"] == expected.text
    assert "attention" not in answer


def test_translate_texts_in_order_with_options(client: TestClient, translator) -> None:
    body = {"texts": SENTENCES, "beam_size": 3, "n_best": 2, "length_penalty": 1.0}
    answers = client.post("/translate", json=body).json()["translations"]
    expected = direct(translator, SENTENCES, beam_size=3, n_best=2, length_penalty=1.0)
    assert [a["text"] for a in answers] == [e.text for e in expected]
    for answer, result in zip(answers, expected, strict=True):
        assert [h["text"] for h in answer["hypotheses"]] == [h.text for h in result.hypotheses]
        assert [h["score"] for h in answer["hypotheses"]] == pytest.approx(
            [h.score for h in result.hypotheses], abs=1e-5
        )


def test_return_attention_gives_every_layer_and_head_with_labels(
    client: TestClient, translator: Translator
) -> None:
    [answer] = client.post(
        "/translate", json={"text": "a dog barked at the moon", "return_attention": True}
    ).json()["translations"]
    [expected] = direct(translator, ["a dog barked at the moon"], return_attention=True)
    attention = answer["attention"]
    assert attention["src_tokens"] == expected.src_tokens and attention["src_tokens"][-1] == "</s>"
    assert attention["tgt_tokens"] == expected.tgt_tokens
    cross = torch.tensor(attention["cross"], dtype=torch.float64)  # (L, H, T, S)
    config = translator.model.config
    assert cross.shape == (
        config.n_decoder_layers,
        config.n_heads,
        len(expected.tgt_tokens),
        len(expected.src_tokens),
    )
    torch.testing.assert_close(cross, expected.attention_maps.cross.double(), atol=5e-5, rtol=0)
    assert cross.sum(-1).sub(1).abs().max() < 1e-3  # rows are distributions
    compact = json.dumps(attention["cross"], separators=(",", ":"))
    assert len(compact) < 7.5 * cross.numel()  # 4 decimals: "0.0203," is 7 characters


def test_a_long_text_is_truncated_and_says_so(client: TestClient) -> None:
    long = " ".join(CORPUS)[:200]  # within --max-chars, beyond max_positions - 1 tokens
    [answer] = client.post("/translate", json={"text": long}).json()["translations"]
    assert answer["truncated"] is True


def test_info_describes_model_languages_decoding_and_limits(client, translator) -> None:
    info = client.get("/info").json()
    assert info["model"] == translator.model.config.to_dict()
    assert info["parameters"] == sum(p.numel() for p in translator.model.parameters())
    assert info["languages"]["source"] == {"code": "en", "name": "English"}
    assert info["languages"]["target"] == {"code": "de", "name": "German"}
    assert info["decoding"]["beam_size"] == 2 and info["decoding"]["max_len_b"] == 4
    assert info["limits"]["max_chars"] == 200 and info["limits"]["max_texts"] == 8
    assert info["batching"]["enabled"] is True


def test_health_reports_the_worker_and_its_counters(client: TestClient) -> None:
    client.post("/translate", json={"text": "hello"})
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["worker_alive"] is True
    assert health["model_calls"] >= 1 and health["queued"] == 0


def test_openapi_documents_both_request_bodies(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/translate", "/languages", "/detect", "/info", "/health"} <= set(schema["paths"])
    body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]
    refs = [item["$ref"] for item in body["application/json"]["schema"]["oneOf"]]
    assert [ref.rsplit("/", 1)[1] for ref in refs] == ["TranslateRequest", "LibreTranslateRequest"]
    assert "application/x-www-form-urlencoded" in body
    components = schema["components"]["schemas"]
    assert {"text", "texts", "beam_size", "return_attention"} <= set(
        components["TranslateRequest"]["properties"]
    )
    assert {"q", "source", "target", "format"} <= set(
        components["LibreTranslateRequest"]["properties"]
    )


def test_the_page_and_its_assets_are_served_and_work_offline(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for element_id in ('id="source"', 'id="translate"', 'id="heatmap"', 'id="layer"'):
        assert element_id in page.text
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        response = client.get(f"/static/{asset}")
        assert response.status_code == 200 and kind in response.headers["content-type"]
    for file in STATIC_DIR.iterdir():  # no CDN, no fonts or scripts from elsewhere
        text = file.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, file


# -- errors --------------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("body", "status", "fragments"),
    [
        (b'{"text": "a",}', 400, ["not valid JSON", "line 1"]),
        (b'{"text": "caf\xe9"}', 400, ["not valid UTF-8", "0xe9", "position 13"]),
        (b"", 400, ["empty"]),
        (b'{"text": NaN}', 400, ["NaN is not allowed"]),
        (DEEP, 400, ["nested too deeply"]),
        (b'["a"]', 422, ["must be a JSON object, got a list"]),
        (b'{"text": 5}', 422, ["text: Input should be a valid string (got 5)"]),
        (b'{"texts": ["a", 3]}', 422, ["texts[1]: Input should be a valid string (got 3)"]),
        (b'{"texts": "a"}', 422, ["texts: Input should be a valid list"]),
        (b'{"text": "a", "beam": 4}', 422, ["unknown field 'beam'", "beam_size"]),
        (b'{"text": "a", "texts": ["b"]}', 422, ["either 'text' or 'texts', not both"]),
        (b'{"beam_size": 2}', 422, ["missing 'text'", "'texts'", "'q'"]),
        (b'{"text": ""}', 422, ["text is empty"]),
        (b'{"texts": ["a", " \\t "]}', 422, ["texts[1] is empty"]),
        (b'{"texts": []}', 422, ["texts is empty"]),
        (b'{"text": "\\ud800x"}', 422, ["not valid Unicode", "unpaired surrogate"]),
        (b'{"text": "a", "beam_size": true}', 422, ["beam_size", "valid integer (got true)"]),
        (b'{"text": "a", "beam_size": 0}', 422, ["beam_size", "greater than or equal to 1"]),
        (b'{"text": "a", "beam_size": 1.5}', 422, ["beam_size", "valid integer"]),
        (b'{"text": "a", "beam_size": 9}', 422, ["beam_size (9)", "limit 4 (--max-beam-size)"]),
        (b'{"text": "a", "n_best": 3}', 422, ["n_best (3) must be <= beam_size (2)"]),
        (b'{"text": "a", "length_penalty": -1}', 422, ["length_penalty", "greater than"]),
        (b'{"text": "a", "return_attention": "yes"}', 422, ["return_attention", "boolean"]),
    ],
)
def test_bad_requests_get_a_4xx_json_error_that_says_why(
    client: TestClient, body: bytes, status: int, fragments: list[str]
) -> None:
    assert_error(post_raw(client, body), status, *fragments)


def test_other_content_types_are_refused(client: TestClient) -> None:
    response = post_raw(client, b"hello", "text/plain")
    assert_error(response, 415, "unsupported Content-Type 'text/plain'", "application/json")


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ({"text": "x" * 201}, ["text has 201 characters; the limit is 200 (--max-chars)"]),
        ({"texts": ["a", "b" * 250]}, ["texts[1] has 250 characters", "(--max-chars)"]),
        ({"texts": ["a"] * 9}, ["the request has 9 texts; the limit is 8 (--max-texts)"]),
        ({"q": ["a"] * 9}, ["9 texts; the limit is 8 (--max-texts)"]),
    ],
)
def test_size_limits_give_413_naming_the_limit(client, body, fragments) -> None:
    assert_error(client.post("/translate", json=body), 413, *fragments)


def test_the_body_size_limit(translator: Translator) -> None:
    settings = replace(SETTINGS, max_body_bytes=100)
    with TestClient(create_app(translator, settings)) as small:
        response = small.post("/translate", json={"text": "a" * 150})
        assert_error(response, 413, "larger than 100 bytes (--max-body-bytes)")
        assert small.post("/translate", json={"text": "a"}).status_code == 200


def test_unknown_paths_and_methods_answer_json(client: TestClient) -> None:
    assert_error(client.get("/nowhere"), 404, "Not Found: GET /nowhere")
    assert_error(client.get("/translate"), 405, "Method Not Allowed: GET /translate")


def test_a_model_error_is_a_500_and_the_worker_survives(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = translator.translate

    def flaky(texts: list[str], **options: Any) -> list:
        if "boom" in texts:
            raise RuntimeError("the model exploded")
        return real(texts, **options)

    monkeypatch.setattr(translator, "translate", flaky)
    with TestClient(create_app(translator, SETTINGS)) as test_client:
        response = test_client.post("/translate", json={"texts": ["hello", "boom"]})
        assert_error(response, 500, "translation failed: RuntimeError: the model exploded")
        assert test_client.post("/translate", json={"text": "hello"}).status_code == 200
        assert test_client.get("/health").json()["worker_alive"] is True


# -- LibreTranslate's API ------------------------------------------------------------------------


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
    assert answer["alternatives"] == [expected.hypotheses[1].text]
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


def test_curl_style_json_sent_as_form_data_is_read_as_json(client: TestClient) -> None:
    response = post_raw(client, b'{"text": "hello"}', "application/x-www-form-urlencoded")
    assert response.status_code == 200 and "translations" in response.json()


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


# -- live servers ----------------------------------------------------------------------------


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


def test_a_full_queue_answers_429(translator: Translator, monkeypatch) -> None:
    gate, entered = threading.Event(), threading.Event()
    real = translator.translate

    def held(texts: list[str], **options: Any) -> list:
        entered.set()
        gate.wait(30)
        return real(texts, **options)

    monkeypatch.setattr(translator, "translate", held)
    settings = replace(SETTINGS, max_queue=1, batch_wait_ms=0)
    with live(translator, settings) as url, ThreadPoolExecutor(2) as pool:
        try:
            busy = pool.submit(http, url + "/translate", {"text": "hello"})
            assert entered.wait(30)
            waiting = pool.submit(http, url + "/translate", {"text": "the mat"})
            deadline = time.monotonic() + 30
            while http(url + "/health")[1]["queued"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            status, answer = http(url + "/translate", {"text": "a test"})
        finally:
            gate.set()
        assert status == 429
        assert "1 requests are waiting" in answer["error"] and "--max-queue" in answer["error"]
        assert busy.result()[0] == 200 and waiting.result()[0] == 200


def test_load_concurrent_requests_are_batched_without_errors(translator: Translator) -> None:
    """100 requests from 8 threads: all succeed, each with its own translation (as if alone),
    in fewer model calls than requests."""
    settings = replace(SETTINGS, decoding=replace(DECODING, beam_size=1), batch_wait_ms=20)
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i % 7}" for i in range(100)]
    expected = {t: translator.translate([t], **settings.decoding.__dict__)[0].text for t in texts}
    with live(translator, settings) as url:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda t: http(url + "/translate", {"text": t}), texts))
        stats = http(url + "/health")[1]
    assert [status for status, _ in answers] == [200] * 100
    assert [a["translations"][0]["text"] for _, a in answers] == [expected[t] for t in texts]
    assert stats["requests"] == 100 and stats["failed_calls"] == 0
    assert stats["model_calls"] < 100 and stats["largest_call"] > 1


# -- aiayn serve -----------------------------------------------------------------------------


def test_serve_flags_become_settings(model_dir: Path, monkeypatch) -> None:
    seen = {}

    def fake_serve(translator, settings, *, host, port, log_level) -> None:
        seen.update(settings=settings, host=host, port=port, log_level=log_level)

    monkeypatch.setattr("aiayn.serve.serve", fake_serve)
    args = ["serve", "-m", str(model_dir), "--port", "8123", "--beam-size", "2", "--max-len-b",
            "7", "--batch-wait-ms", "2.5", "--max-batch-tokens", "512", "--no-batching",
            "--max-chars", "100", "--max-texts", "3", "--max-queue", "5", "--max-beam-size",
            "6", "--max-body-bytes", "4096", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    settings = seen["settings"]
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    assert settings.decoding == Decoding(beam_size=2, max_len_b=7)
    assert settings == ServerSettings(
        decoding=settings.decoding,
        batching=False,
        batch_wait_ms=2.5,
        max_batch_tokens=512,
        max_chars=100,
        max_texts=3,
        max_queue=5,
        max_beam_size=6,
        max_body_bytes=4096,
    )
    assert main(["serve", "-m", str(model_dir), "--threads", "1"]) == 0
    assert seen["settings"] == ServerSettings()


def test_serve_refuses_bad_settings_before_loading(model_dir: Path, capsys) -> None:
    assert main(["serve", "-m", str(model_dir), "--max-chars", "0"]) == 2
    assert "max_chars (0) must be an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "-m", str(model_dir), "--beam-size", "20"]) == 2
    assert "max_beam_size (16)" in capsys.readouterr().err


@pytest.mark.slow
def test_aiayn_serve_runs_answers_and_stops_cleanly(model_dir: Path) -> None:
    """The real command in its own process: it listens, translates, serves the page, and shuts
    down cleanly on SIGTERM (uvicorn re-raises the signal once it has, hence -SIGTERM)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "aiayn", "serve", "-m", str(model_dir), "--port", str(port),
               "--beam-size", "2", "--max-len-b", "4", "--threads", "1"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http(url + "/health")[0] == 200:
                    break
            except urllib.error.URLError:
                pass
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "aiayn serve did not start"
            time.sleep(0.2)
        status, answer = http(url + "/translate", {"texts": ["the cat", "a dog"]})
        assert status == 200 and len(answer["translations"]) == 2
        with urllib.request.urlopen(url + "/", timeout=30) as page:
            assert b'id="heatmap"' in page.read()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(60)
        finally:
            process.kill()
    log = process.stderr.read()
    assert returncode in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log
