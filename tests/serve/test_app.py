"""Tests for aiayn.serve.app: aiayn's endpoints, every error case (status code and message),
batching of concurrent requests on a live server, and `aiayn serve`'s flags. LibreTranslate's
API is in test_libretranslate.py.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.cli import main
from aiayn.decode.costs import DecodingCosts
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.serve import Decoding, ServerSettings, create_app
from aiayn.serve.app import STATIC_DIR, _answer, _translated
from aiayn.serve.keys import ApiKey
from aiayn.serve.schemas import TranslateResponse, Translation
from aiayn.serve.settings import call_budget

from .helpers import (
    CORPUS,
    DECODING,
    SENTENCES,
    SETTINGS,
    assert_error,
    direct,
    http,
    live,
    post_raw,
)

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


def test_return_attention_gives_the_last_layers_head_average_with_labels(
    client: TestClient, translator: Translator
) -> None:
    [answer] = client.post(
        "/translate", json={"text": "a dog barked at the moon", "return_attention": True}
    ).json()["translations"]
    [expected] = direct(translator, ["a dog barked at the moon"], return_attention=True)
    attention = answer["attention"]
    assert attention["src_tokens"] == expected.src_tokens and attention["src_tokens"][-1] == "</s>"
    assert attention["tgt_tokens"] == expected.tgt_tokens
    assert "cross" not in attention
    mean = torch.tensor(attention["mean"], dtype=torch.float64)  # (T, S)
    torch.testing.assert_close(mean, expected.attention.double(), atol=5e-5, rtol=0)


def test_full_attention_gives_every_layer_and_head(
    client: TestClient, translator: Translator
) -> None:
    body = {"text": "a dog barked at the moon", "return_attention": True, "full_attention": True}
    [answer] = client.post("/translate", json=body).json()["translations"]
    [expected] = direct(translator, ["a dog barked at the moon"], return_attention=True)
    cross = torch.tensor(answer["attention"]["cross"], dtype=torch.float64)  # (L, H, T, S)
    config = translator.model.config
    assert cross.shape == (
        config.n_decoder_layers,
        config.n_heads,
        len(expected.tgt_tokens),
        len(expected.src_tokens),
    )
    torch.testing.assert_close(cross, expected.attention_maps.cross.double(), atol=5e-5, rtol=0)
    assert cross.sum(-1).sub(1).abs().max() < 1e-3  # rows are distributions
    compact = json.dumps(answer["attention"]["cross"], separators=(",", ":"))
    assert len(compact) < 7.5 * cross.numel()  # 4 decimals: "0.0203," is 7 characters


def test_the_server_makes_the_cross_attention_maps_only(
    client: TestClient, translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer holds cross-attention only; the encoder's (L, H, S, S) maps, which
    --max-attention-values does not count, were made and kept for every such answer."""
    made = []
    attention = translator.backend.attention

    def recorded(sources, outputs, kinds=None):
        maps = attention(sources, outputs, kinds)
        made.extend(maps)
        return maps

    monkeypatch.setattr(translator.backend, "attention", recorded)
    for full in (False, True):
        body = {"text": "a dog barked", "return_attention": True, "full_attention": full}
        assert client.post("/translate", json=body).status_code == 200
    assert len(made) == 2
    assert all(m.encoder is None and m.decoder is None and m.cross is not None for m in made)
    [result] = translator.translate(["a dog barked"], return_attention=True)
    assert result.attention_maps.encoder is not None  # a library call still gets every map


def test_an_averaged_answer_keeps_no_layer_or_head_maps(translator: Translator) -> None:
    """--max-attention-values counts T x S a text for the average: the server's model call
    keeps that average alone, not the (L, H, T, S) maps a text it is taken over (they held
    the whole batch's maps until the answer was built); full_attention keeps and counts them."""
    text = ["a dog barked"]
    [mean] = _translated(translator, text, Decoding(return_attention=True))
    [every] = _translated(translator, text, Decoding(return_attention=True, full_attention=True))
    assert mean.attention_maps is None
    torch.testing.assert_close(mean.attention, every.attention_maps.cross[-1].mean(dim=0))
    assert every.attention_maps.encoder is None and every.attention_maps.cross is not None


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
        (DEEP, 413, ["more than 40 values"]),  # each "[" opens a value: refused unparsed
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


def test_a_text_over_the_call_budget_runs_alone_and_one_over_max_text_cost_is_refused(
    translator: Translator,
) -> None:
    """The call budget (--max-batch-cost) only decides how texts share calls; what one text may
    cost is --max-text-cost's to say."""
    texts = ["the cat sat", "a dog barked at the moon"]
    pricing = DecodingCosts(translator.tokenizer, translator.source_limits)
    costs = pricing.costs(texts, DECODING.rows_per_sentence, max_len_a=0, max_len_b=4)
    settings = replace(SETTINGS, max_batch_cost=1, max_text_cost=max(costs))
    with TestClient(create_app(translator, settings)) as small:
        assert small.get("/info").json()["batching"]["max_batch_cost"] == 1
        response = small.post("/translate", json={"texts": texts})
        assert response.status_code == 200, response.text
        assert [t["text"] for t in response.json()["translations"]] == [
            r.text for r in direct(translator, texts)
        ]
        assert small.get("/health").json()["model_calls"] == 2  # one call a text
    settings = replace(SETTINGS, max_text_cost=costs[1] - 1)
    with TestClient(create_app(translator, settings)) as small:
        response = small.post("/translate", json={"texts": texts})
        message = f"texts[1] would cost {costs[1]}"
        assert_error(response, 413, message, f"{costs[1] - 1} (--max-text-cost)")


def test_the_call_budget_defaults_to_about_one_of_the_translators_batches(
    translator: Translator,
) -> None:
    assert SETTINGS.max_batch_cost is None
    assert call_budget(SETTINGS, 4096) == 2**19  # a CPU's default --max-tokens
    assert call_budget(SETTINGS, 16384) == 2**21  # a GPU's
    assert call_budget(replace(SETTINGS, max_batch_cost=5), 16384) == 5
    with TestClient(create_app(translator, SETTINGS)) as default:
        info = default.get("/info").json()
        assert info["batching"]["max_batch_cost"] == 128 * translator.max_tokens
        assert info["limits"]["max_text_cost"] == SETTINGS.max_text_cost == 2**23
        assert f"one text at most {2**23}" in default.get("/openapi.json").text
    for value in (0, -1, 1.5, True):
        with pytest.raises(UserValueError, match="max_batch_cost"):
            replace(SETTINGS, max_batch_cost=value)


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


def test_curl_style_json_sent_as_form_data_is_read_as_json(client: TestClient) -> None:
    response = post_raw(client, b'{"text": "hello"}', "application/x-www-form-urlencoded")
    assert response.status_code == 200 and "translations" in response.json()


# -- live servers ----------------------------------------------------------------------------


def test_a_full_queue_answers_429(translator: Translator, monkeypatch) -> None:
    gate, entered = threading.Event(), threading.Event()
    real = translator.translate

    def held(texts: list[str], **options: Any) -> list:
        entered.set()
        gate.wait(30)
        return real(texts, **options)

    monkeypatch.setattr(translator, "translate", held)
    key = ApiKey("k", requests_per_minute=3)
    settings = replace(SETTINGS, max_queue=1, batch_wait_ms=0, api_keys=(key,))
    with live(translator, settings) as url, ThreadPoolExecutor(2) as pool:
        try:
            busy = pool.submit(http, url + "/translate", {"text": "hello", "api_key": "k"})
            assert entered.wait(30)
            waiting = pool.submit(http, url + "/translate", {"text": "the mat", "api_key": "k"})
            deadline = time.monotonic() + 30
            while http(url + "/health")[1]["queued"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            status, answer = http(url + "/translate", {"text": "a test", "api_key": "k"})
        finally:
            gate.set()
        assert status == 429
        assert "1 requests are waiting" in answer["error"] and "--max-queue" in answer["error"]
        assert busy.result()[0] == 200 and waiting.result()[0] == 200
        # the refused request did not spend the key's third request of the minute
        assert http(url + "/translate", {"text": "a test", "api_key": "k"})[0] == 200


def test_load_concurrent_requests_are_batched_without_errors(translator: Translator) -> None:
    """100 requests from 8 threads: all succeed, each with its own translation (as if alone),
    in fewer model calls than requests."""
    settings = replace(SETTINGS, decoding=replace(DECODING, beam_size=1), batch_wait_ms=20)
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i % 7}" for i in range(100)]
    expected = {t: direct(translator, [t], beam_size=1)[0].text for t in texts}
    with live(translator, settings) as url:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda t: http(url + "/translate", {"text": t}), texts))
        stats = http(url + "/health")[1]
    assert [status for status, _ in answers] == [200] * 100
    assert [a["translations"][0]["text"] for _, a in answers] == [expected[t] for t in texts]
    assert stats["requests"] == 100 and stats["failed_calls"] == 0
    assert stats["model_calls"] < 100 and stats["largest_call"] > 1


# -- aiayn serve -----------------------------------------------------------------------------


def test_serve_flags_become_settings(model_dir: Path, monkeypatch, tmp_path: Path) -> None:
    seen = {}

    def fake_serve(translator, settings, *, host, port, log_level) -> None:
        seen.update(settings=settings, host=host, port=port, log_level=log_level)

    monkeypatch.setattr("aiayn.serve.serve", fake_serve)
    monkeypatch.setenv("AIAYN_API_KEYS", "from-env")
    keys = tmp_path / "keys.txt"
    keys.write_text("# key  requests/min  chars/min\nalpha 5 500\nbeta\n", encoding="utf-8")
    args = ["serve", "-m", str(model_dir), "--port", "8123", "--beam-size", "2", "--max-len-b",
            "7", "--batch-wait-ms", "2.5", "--max-batch-cost", "512", "--no-batching",
            "--max-chars", "100", "--max-texts", "3", "--max-queue", "5", "--max-beam-size",
            "6", "--max-body-bytes", "4096", "--threads", "1", "--max-request-cost", "1024",
            "--max-text-cost", "768",
            "--max-attention-values", "99", "--busy-after-s", "0.5", "--timeout-keep-alive",
            "2", "--timeout-head", "3", "--timeout-body", "4", "--max-connections", "10",
            "--api-keys", str(keys), "--require-api-key", "--key-requests-per-minute", "7",
            "--key-chars-per-minute", "70", "--cors-origin", "https://a.example",
            "--cors-origin", "https://b.example", "--docs"]  # fmt: skip
    assert main(args) == 0
    settings = seen["settings"]
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    assert settings.decoding == Decoding(beam_size=2, max_len_b=7)
    assert settings == ServerSettings(
        decoding=settings.decoding,
        batching=False,
        batch_wait_ms=2.5,
        max_batch_cost=512,
        max_chars=100,
        max_texts=3,
        max_queue=5,
        max_beam_size=6,
        max_body_bytes=4096,
        max_request_cost=1024,
        max_text_cost=768,
        max_attention_values=99,
        busy_after_s=0.5,
        timeout_keep_alive_s=2,
        timeout_head_s=3,
        timeout_body_s=4,
        max_connections=10,
        api_keys=(ApiKey("alpha", 5, 500), ApiKey("beta"), ApiKey("from-env")),
        require_api_key=True,
        key_requests_per_minute=7,
        key_chars_per_minute=70,
        cors_origins=("https://a.example", "https://b.example"),
        docs=True,
    )
    monkeypatch.delenv("AIAYN_API_KEYS")
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


def test_the_answer_is_the_response_model_rendered(translator: Translator) -> None:
    """The answer is rendered a translation at a time, off the event loop: it is still what
    TranslateResponse says, with and without attention."""
    results = direct(translator, SENTENCES[:3], return_attention=True)
    for with_attention, full in [(False, False), (True, False), (True, True)]:
        translations = [Translation.from_result(r, with_attention, full=full) for r in results]
        expected = TranslateResponse(translations=translations).model_dump(exclude_unset=True)
        assert json.loads(_answer(results, with_attention, full)) == expected
