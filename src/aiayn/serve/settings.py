"""What ``aiayn serve`` is configured with: `ServerSettings` (defaults, batching, limits, access)
and `Decoding` (one request's decoding).

Apart from the application so that it imports neither FastAPI nor PyTorch: the CLI generates
``aiayn serve``'s flags from these fields and their ``Attributes:`` docs while building its
parser, which must stay fast and work without the ``serve`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiayn.decode.options import DecodingOptions
from aiayn.errors import UserValueError
from aiayn.serve.keys import ApiKey

__all__ = [
    "BODY_VALUES_FOR_OPTIONS",
    "CALL_OUTPUT_TOKENS",
    "INTEGER_LIMITS",
    "SERVER_MAX_LENGTH_PENALTY",
    "Decoding",
    "ServerSettings",
    "call_budget",
]

# Bounds of the decoding options a request may set, whatever the server's settings. Limits that
# depend on the server (--max-beam-size, --max-texts, --max-chars) are added to the OpenAPI
# schema per app.
# The largest α a request to the server may ask for, and the server's default may be: a policy,
# tighter than the arithmetic's guard that DecodingOptions applies
# (decode.options.MAX_FINITE_LENGTH_PENALTY, 10); GNMT tuned 0.6-1.0, the default is 1.0.
SERVER_MAX_LENGTH_PENALTY = 5.0
# Values a request body may hold beyond its texts: every option of either API, with room to spare.
BODY_VALUES_FOR_OPTIONS = 32


@dataclass(frozen=True)
class Decoding(DecodingOptions):
    """The decoding of one request: its `DecodingOptions` (the one home of the paper's §6.1
    defaults and of their checks) and whether to return attention. Frozen, so requests with
    equal decodings share model calls (the batcher groups by it)."""

    return_attention: bool = False
    full_attention: bool = False
    """With ``return_attention``: every layer's and head's maps kept, not only their average.
    A field of its own so that calls that keep the average alone are batched apart and their
    maps freed as soon as the average is taken."""


@dataclass(frozen=True)
class ServerSettings:
    """How the server decodes by default, how it batches, and what it refuses.

    ``docs/serving.md`` says what each limit protects. Costs are in the unit of
    :meth:`aiayn.decode.costs.DecodingCosts.cost` with the output-length limit: source tokens ×
    beam size × most output tokens, both with EOS, a bound on a search's work whatever the
    model prefers.

    Attributes:
        decoding: Defaults; a request may change beam_size, n_best, length_penalty and
            return_attention (not the length limits, so no request can make decoding slow).
        max_chars: Longest text, in characters (Unicode code points).
        max_texts: Most texts in one request.
        max_queue: Most requests waiting for the model; more get 429.
        max_beam_size: Largest beam a request may ask for.
        max_body_bytes: Largest request body.
        batching: Merge concurrent requests into one model call (False: one call each).
        batch_wait_ms: How long a request may wait for others to join its call (no wait while
            requests come one at a time; see :mod:`aiayn.serve.batcher`).
        max_batch_cost: Budget of one model call that holds several texts. A short request
            waits for the call in progress, then its own: calls of texts under this budget
            keep that short. Unset: about one of the translator's own batches, 128 ×
            ``max_tokens`` (2^19 on a CPU, 2^21 on a GPU, by default); a larger call batches
            no more, and makes everyone in it wait longer. A text that alone costs more runs
            in a call of its own, up to ``max_text_cost``.
        max_text_cost: Most one text may cost (413 beyond): the longest call a single text
            can make, hence the longest any request may wait behind one other text; lower it
            to shorten that wait.
        max_request_cost: Budget of one request, all its texts together (413 beyond).
        max_attention_values: Most attention values one answer may hold: texts × T × S (the
            last layer's head average), × layers × heads with ``full_attention`` (413 beyond).
        busy_after_s: ``GET /health`` says "busy" once the oldest unanswered request has
            waited this long.
        timeout_keep_alive_s: An idle kept-alive connection is closed after this.
        timeout_head_s: A request's line and headers must arrive within this (a new
            connection that sends nothing is closed after it too).
        timeout_body_s: A request's body must arrive within this (408 beyond).
        max_connections: Open connections; more are closed at once (and uvicorn answers 503
            beyond as many requests in progress).
        api_keys: The keys clients may send (``api_key``), with their limits.
        require_api_key: Refuse requests without a key (403).
        key_requests_per_minute: Default request rate of a key (429 beyond).
        key_chars_per_minute: Default characters per minute of a key (429 beyond).
        cors_origins: Origins (``https://example.org``) whose pages may call the API; none
            by default; POSTs from other origins are refused (:mod:`aiayn.serve.policy`).
        docs: Serve ``/docs`` and ``/redoc`` (they load scripts from a CDN).
    """

    decoding: Decoding = field(default_factory=Decoding)
    max_chars: int = 5000
    max_texts: int = 64
    max_queue: int = 256
    max_beam_size: int = 16
    max_body_bytes: int = 4 * 1024 * 1024
    batching: bool = True
    batch_wait_ms: float = 5.0
    max_batch_cost: int | None = None
    max_text_cost: int = 2**23
    max_request_cost: int = 2**25
    max_attention_values: int = 2**21
    busy_after_s: float = 2.0
    timeout_keep_alive_s: float = 5.0
    timeout_head_s: float = 10.0
    timeout_body_s: float = 30.0
    max_connections: int = 256
    api_keys: tuple[ApiKey, ...] = ()
    require_api_key: bool = False
    key_requests_per_minute: int = 60
    key_chars_per_minute: int = 100_000
    cors_origins: tuple[str, ...] = ()
    docs: bool = False

    def __post_init__(self) -> None:
        budget = () if self.max_batch_cost is None else ("max_batch_cost",)  # None: the default
        for name in (*INTEGER_LIMITS, *budget):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserValueError(f"{name} ({value!r}) must be an integer >= 1")
        if not self.batch_wait_ms >= 0:
            raise UserValueError(f"batch_wait_ms ({self.batch_wait_ms}) must be >= 0")
        for name in ("busy_after_s", "timeout_keep_alive_s", "timeout_head_s", "timeout_body_s"):
            if not getattr(self, name) > 0:
                raise UserValueError(f"{name} ({getattr(self, name)}) must be > 0")
        if not 1 <= self.decoding.beam_size <= self.max_beam_size:
            raise UserValueError(
                f"the default beam size ({self.decoding.beam_size}) must be between 1 and "
                f"max_beam_size ({self.max_beam_size})"
            )
        if not 0 <= self.decoding.length_penalty <= SERVER_MAX_LENGTH_PENALTY:
            raise UserValueError(
                f"the default length penalty ({self.decoding.length_penalty}) must be between "
                f"0 and {SERVER_MAX_LENGTH_PENALTY}"
            )
        if self.require_api_key and not self.api_keys:
            raise UserValueError("require_api_key needs api_keys (--api-keys or $AIAYN_API_KEYS)")

    @property
    def max_body_values(self) -> int:
        """Most values (JSON values or form fields) a request body may hold: ``max_texts`` texts
        and the options. Checked before a body is parsed (413 beyond), so that 4 MiB of tiny
        values cannot cost what millions of objects and their validation errors cost."""
        return self.max_texts + BODY_VALUES_FOR_OPTIONS


CALL_OUTPUT_TOKENS = 128
"""The default call budget is this × the translator's batch budget (`call_budget`).

A text's cost is S × rows × T (source tokens, beam, most output tokens); a translator batch holds
``max_tokens`` of S × rows. So a call of 128 × ``max_tokens`` holds one batch of sentences
whose output may run to 128 tokens (a 78-token source at the default limit of input + 50), or
a few batches of shorter ones: 2^19 on a CPU (``max_tokens`` 4096, some 29 Bible sentences at
beam 4), 2^21 on a GPU (16384). On a 2-core AMD EPYC, one thread, the recipe's 2+2 model
decoded about 2^18 a second in calls of 30 sentences or more (BENCHMARKS.md, "Serving"): a
call of 2^19 takes ~2 s there; one of 2^23, the budget before, would take ~30 s."""


def call_budget(settings: ServerSettings, max_tokens: int) -> int:
    """The budget of one model call: ``settings.max_batch_cost``, or where it is None
    `CALL_OUTPUT_TOKENS` × ``max_tokens``, the batch budget of the translator that serves."""
    if settings.max_batch_cost is not None:
        return settings.max_batch_cost
    return CALL_OUTPUT_TOKENS * max_tokens


INTEGER_LIMITS = (
    "max_chars",
    "max_texts",
    "max_queue",
    "max_beam_size",
    "max_body_bytes",
    "max_text_cost",
    "max_request_cost",
    "max_attention_values",
    "max_connections",
    "key_requests_per_minute",
    "key_chars_per_minute",
)  # shown in /info and named in errors by their flag: --max-chars, ...
