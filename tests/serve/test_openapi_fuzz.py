"""Schemathesis against the OpenAPI schema the server publishes: generated requests (valid and
invalid) for every operation, checking that none gets a 5xx, that every status code and answer
matches the schema, and that content types are as documented. Bounded: 15 examples per
operation and mode (valid, invalid), a few seconds in all.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from aiayn.serve import create_app  # noqa: E402

from .helpers import SETTINGS  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_the_api_conforms_to_its_schema(translator) -> None:
    """Each operation in turn (schemathesis' pytest plugin does not run on this pytest)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(translator, SETTINGS))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/translate", "/detect", "/info", "/health"}
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,  # the same cases every run: a failure reproduces
        )
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS)

        try:
            check()
        except Unsatisfiable:  # an operation with no inputs has no invalid ones
            assert mode is GenerationMode.NEGATIVE and operation.method == "get"
