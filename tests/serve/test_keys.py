"""Tests for aiayn.serve.keys' rate limiter: who may translate, and how much per minute, on a
clock the test sets (the file format and its errors are in tests/serve/test_hostile.py, the
HTTP answers in tests/serve/test_app.py)."""

from __future__ import annotations

import pytest

from aiayn.serve import keys
from aiayn.serve.keys import ApiKey, KeyRejected, RateLimiter


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The limiter's clock, in seconds: the test moves it."""
    now = [1000.0]
    monkeypatch.setattr(keys.time, "monotonic", lambda: now[0])
    return now


def limiter(*, required: bool = False) -> RateLimiter:
    team = ApiKey("team", requests_per_minute=2, chars_per_minute=100)
    return RateLimiter(
        [team, ApiKey("other")], required=required, requests_per_minute=60, chars_per_minute=1000
    )


def rejected(rates: RateLimiter, key: str | None, chars: int) -> tuple[int, int | None]:
    with pytest.raises(KeyRejected) as caught:
        rates.charge(key, chars)
    return caught.value.status, caught.value.retry_after


def test_a_server_without_keys_ignores_them() -> None:
    rates = RateLimiter([], required=False, requests_per_minute=1, chars_per_minute=1)
    assert not rates.enabled
    for _ in range(3):
        rates.charge("anything", 10**6)


def test_no_key_passes_unless_required_and_an_unknown_key_never(clock: list[float]) -> None:
    limiter().charge(None, 10)
    assert rejected(limiter(required=True), None, 10) == (403, None)
    assert rejected(limiter(), "stolen", 10) == (403, None)


def test_a_key_over_its_requests_waits_for_the_bucket_to_refill(clock: list[float]) -> None:
    rates = limiter()
    rates.charge("team", 10)
    rates.charge("team", 10)
    assert rejected(rates, "team", 10) == (429, 30)  # 2 a minute: one more in 30 s
    clock[0] += 30
    rates.charge("team", 10)
    rates.charge("other", 10)  # each key its own buckets


def test_characters_have_their_own_limit_and_too_many_at_once_is_413(clock: list[float]) -> None:
    rates = limiter()
    rates.charge("team", 90)
    assert rejected(rates, "team", 20) == (429, 6)  # 10 missing of 100 a minute
    assert rejected(rates, "team", 101) == (413, None)  # never fits in a minute


def test_a_refund_gives_back_the_characters_and_the_request_when_asked(
    clock: list[float],
) -> None:
    rates = limiter()
    rates.charge("team", 100)
    rates.refund("team", 100, request=False)  # refused for its content: the request counts
    rates.charge("team", 100)
    assert rejected(rates, "team", 1)[0] == 429
    rates.refund("team", 100, request=True)  # refused by the server: all of it back
    rates.charge("team", 100)


def test_a_keys_repr_hides_the_secret() -> None:
    assert "secret-key" not in repr(ApiKey("secret-key", 1, 2))
