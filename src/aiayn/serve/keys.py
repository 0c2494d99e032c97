"""API keys, as LibreTranslate has them: who may translate, and how much per minute.

A key is sent as the ``api_key`` field of ``POST /translate`` and ``POST /detect``: in a JSON
body, or in form data or the query string (with a JSON body only its fields count, as in
LibreTranslate). Keys come from a file (``--api-keys FILE``) and/or the environment
variable ``AIAYN_API_KEYS``; ``--require-api-key`` refuses requests without one. An unknown key
is refused even when keys are optional, as LibreTranslate does (403), and a known key over its
rate gets 429 with ``Retry-After`` (413 for more characters than it may send in a minute). The
server refunds the characters of a request it then refuses, and the request too where the
refusal is its own (a full queue; `RateLimiter.refund`). A server without keys ignores
``api_key``.

The file has one key per line, optionally followed by its own limits, and ``#`` comments::

    # key                     requests/minute  characters/minute
    3f9c0e0b-team-a           120              200000
    7d1a44c2-team-b                                               # the defaults

The limits are token buckets (a full bucket holds one minute's allowance, refilled
continuously), kept in memory: with several worker processes each has its own buckets, so a
key's effective rate is the limit times the number of processes (see ``docs/serving.md``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import UserValueError

__all__ = ["ENV_VAR", "ApiKey", "KeyRejected", "RateLimiter", "load_keys"]

ENV_VAR = "AIAYN_API_KEYS"  # keys separated by commas or whitespace, default limits


@dataclass(frozen=True)
class ApiKey:
    """A key and its limits per minute (None: the server's defaults)."""

    key: str
    requests_per_minute: int | None = None
    chars_per_minute: int | None = None

    def __repr__(self) -> str:  # never print the secret itself
        return f"ApiKey({self.key[:4]}…, {self.requests_per_minute}, {self.chars_per_minute})"


class KeyRejected(Exception):
    """403 (no or unknown key), 413 (more characters than the key may send in a minute) or 429
    (over a limit, with the seconds until it would pass)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def load_keys(file: str | Path | None = None, env: str | None = None) -> tuple[ApiKey, ...]:
    """The keys of ``file`` and of the environment variable's value ``env``. A file that cannot
    be read (missing, a directory, unreadable, not UTF-8) or a malformed line is a one-line
    `UserValueError` (a ``ValueError``) naming the file (and line; never the key)."""
    keys: list[ApiKey] = []
    if file is not None:
        path = Path(file)
        for lineno, line in enumerate(_read_keys_file(path).splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 3 or not all(f.isdigit() and int(f) > 0 for f in fields[1:]):
                raise UserValueError(
                    f"{path}:{lineno}: expected 'KEY [REQUESTS_PER_MINUTE [CHARS_PER_MINUTE]]' "
                    "with positive integers"
                )
            numbers = [int(f) for f in fields[1:]] + [None, None]
            keys.append(ApiKey(fields[0], numbers[0], numbers[1]))
    if env:
        keys.extend(ApiKey(key) for key in env.replace(",", " ").split())
    return tuple(keys)


def _read_keys_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UserValueError(f"{path}: cannot read the API keys file: {reason}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserValueError(
            f"{path}: the API keys file is not UTF-8 (byte 0x{data[error.start]:02x} at "
            f"position {error.start})"
        ) from None


def keys_from_environment() -> str | None:
    return os.environ.get(ENV_VAR)


class _Bucket:
    """A token bucket holding at most ``per_minute`` tokens, refilled at per_minute / 60 s."""

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.tokens = float(per_minute)
        self.updated = time.monotonic()

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.capacity / 60)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` tokens are there (0: now); inf if it never fits."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.tokens) * 60 / self.capacity)


class RateLimiter:
    """Checks a request's key and charges it one request and its characters."""

    def __init__(
        self,
        keys: Iterable[ApiKey],
        *,
        required: bool,
        requests_per_minute: int,
        chars_per_minute: int,
    ) -> None:
        self.keys = {k.key: k for k in keys}
        self.required = required
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {
            k.key: (
                _Bucket(k.requests_per_minute or requests_per_minute),
                _Bucket(k.chars_per_minute or chars_per_minute),
            )
            for k in self.keys.values()
        }
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.keys) or self.required

    def charge(self, key: str | None, chars: int) -> None:
        """Passes, or raises KeyRejected; a refused request is not charged. A server without
        keys ignores ``key``, as LibreTranslate without ``--api-keys`` does."""
        if not self.enabled:
            return
        if not key:
            if self.required:
                raise KeyRejected(403, "this server requires an API key: send 'api_key'")
            return
        buckets = self._buckets.get(key)
        if buckets is None:
            raise KeyRejected(403, "invalid API key")
        requests, characters = buckets
        with self._lock:
            now = time.monotonic()
            requests.refill(now)
            characters.refill(now)
            if chars > characters.capacity:  # never passes: too large, not too early
                raise KeyRejected(
                    413,
                    f"the request has {chars} characters, more than this key may send in a "
                    f"minute ({int(characters.capacity)})",
                )
            wait = max(requests.wait_for(1), characters.wait_for(chars))
            if wait > 0:
                which = "requests" if requests.wait_for(1) > 0 else "characters"
                raise KeyRejected(
                    429,
                    f"this API key is over its limit of {which} per minute; retry in "
                    f"{math.ceil(wait)} s",
                    retry_after=math.ceil(wait),
                )
            requests.tokens -= 1
            characters.tokens -= chars

    def refund(self, key: str | None, chars: int, *, request: bool) -> None:
        """Gives back what `charge` took for a request the server then refused: its
        characters, and with ``request`` the request itself (a refusal of the server's own
        making, such as a full queue, so that a client that retries as told does not spend its
        allowance). A request refused for its content still counts: the requests per minute
        also bound the work a key can make the server do in refusing."""
        buckets = self._buckets.get(key) if key and self.enabled else None
        if buckets is None:
            return
        requests, characters = buckets
        with self._lock:
            if request:
                requests.tokens = min(requests.capacity, requests.tokens + 1)
            characters.tokens = min(characters.capacity, characters.tokens + chars)
