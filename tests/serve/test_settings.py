"""Tests for aiayn.serve.settings: a server's settings refuse values no server could run with,
in one line naming the field, before anything listens; `aiayn serve`'s flags that set them are
tested in tests/serve/test_app.py."""

from __future__ import annotations

from typing import Any

import pytest

from aiayn.errors import UserValueError
from aiayn.serve.keys import ApiKey
from aiayn.serve.settings import (
    BODY_VALUES_FOR_OPTIONS,
    INTEGER_LIMITS,
    SERVER_MAX_LENGTH_PENALTY,
    Decoding,
    ServerSettings,
)


def test_the_defaults_make_a_server() -> None:
    settings = ServerSettings()
    assert settings.max_body_values == settings.max_texts + BODY_VALUES_FOR_OPTIONS


@pytest.mark.parametrize("name", INTEGER_LIMITS)
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_limit_is_an_integer_of_at_least_1(name: str, value: Any) -> None:
    with pytest.raises(UserValueError, match=rf"^{name} \({value!r}\) must be an integer >= 1$"):
        ServerSettings(**{name: value})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_batch_cost": 0}, r"^max_batch_cost \(0\) must be an integer >= 1$"),
        ({"batch_wait_ms": -1.0}, r"^batch_wait_ms \(-1.0\) must be >= 0$"),
        ({"timeout_body_s": 0.0}, r"^timeout_body_s \(0.0\) must be > 0$"),
        ({"busy_after_s": float("nan")}, r"^busy_after_s \(nan\) must be > 0$"),
        (
            {"decoding": Decoding(beam_size=8), "max_beam_size": 4},
            r"^the default beam size \(8\) must be between 1 and max_beam_size \(4\)$",
        ),
        (
            {"decoding": Decoding(length_penalty=SERVER_MAX_LENGTH_PENALTY + 1)},
            rf"^the default length penalty \({SERVER_MAX_LENGTH_PENALTY + 1}\) must be between 0 "
            rf"and {SERVER_MAX_LENGTH_PENALTY}$",
        ),
        ({"require_api_key": True}, r"^require_api_key needs api_keys"),
    ],
)
def test_settings_no_server_could_run_with_are_refused_naming_the_field(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserValueError, match=message):
        ServerSettings(**values)


def test_required_keys_with_keys_are_taken() -> None:
    settings = ServerSettings(require_api_key=True, api_keys=(ApiKey("k"),))
    assert settings.require_api_key
