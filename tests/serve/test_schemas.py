"""Tests for aiayn.serve.schemas: real answers of a live app validate against the pydantic
response models (the schema and the payload are one), and request validation errors read as
one line per problem.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter

from aiayn.serve.schemas import (
    ApiError,
    Detection,
    ErrorResponse,
    Language,
    LibreTranslateResponse,
    TranslateRequest,
    TranslateResponse,
    parse_body,
)


def strictly(model: type[BaseModel], payload: object) -> BaseModel:
    """``payload`` as ``model``, and dumped back it is the payload itself: no field the model
    lacks, none it has that the payload does not."""
    parsed = model.model_validate(payload, strict=True)
    assert parsed.model_dump(exclude_unset=True) == payload
    return parsed


@pytest.mark.parametrize(
    "body",
    [
        {"text": "the cat sat"},
        {"texts": ["the cat", "a dog barked"], "beam_size": 3, "n_best": 2},
        {"text": "a dog barked at the moon", "return_attention": True},
    ],
)
def test_aiayn_answers_are_translate_responses(client: TestClient, body: dict) -> None:
    payload = client.post("/translate", json=body).json()
    answer = strictly(TranslateResponse, payload)
    assert (answer.translations[0].attention is not None) == body.get("return_attention", False)


@pytest.mark.parametrize(
    "body",
    [
        {"q": "the cat sat"},
        {"q": ["the cat", "a dog"], "source": "auto", "alternatives": 1},
        {"q": "the cat", "source": "auto", "alternatives": 1},
    ],
)
def test_libretranslate_answers_are_libretranslate_responses(client, body: dict) -> None:
    strictly(LibreTranslateResponse, client.post("/translate", json=body).json())


def test_language_detection_and_error_answers_match_their_models(client: TestClient) -> None:
    assert TypeAdapter(list[Language]).validate_python(client.get("/languages").json())
    detections = client.post("/detect", json={"q": "hello"}).json()
    assert TypeAdapter(list[Detection]).validate_python(detections, strict=True)
    for response in (client.post("/translate", json={"text": ""}), client.get("/nowhere")):
        strictly(ErrorResponse, response.json())


def test_the_openapi_schema_describes_the_answers_with_these_models(client) -> None:
    schema = client.get("/openapi.json").json()
    ok = schema["paths"]["/translate"]["post"]["responses"]["200"]["content"]["application/json"]
    refs = [item["$ref"].rsplit("/", 1)[1] for item in ok["schema"]["oneOf"]]
    assert refs == ["TranslateResponse", "LibreTranslateResponse"]
    assert {"HypothesisJSON", "Translation", "Attention"} <= set(schema["components"]["schemas"])


def test_parse_body_gives_one_422_listing_every_problem() -> None:
    with pytest.raises(ApiError) as error:
        parse_body(TranslateRequest, {"texts": ["a", 3], "beam": 4, "beam_size": 0})
    assert error.value.status == 422
    message = error.value.message
    assert "texts[1]: Input should be a valid string (got 3)" in message
    assert "unknown field 'beam'" in message and "beam_size" in message
    assert message.count("; ") == 2
    assert parse_body(TranslateRequest, {"text": "a"}).text == "a"
