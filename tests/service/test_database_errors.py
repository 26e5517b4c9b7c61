"""What an HTTP client learns of a database failure: a 503 ``database_unavailable`` with
Retry-After and nothing of the server; the service's log keeps the details."""

from __future__ import annotations

import json
import logging

import pytest

from specrag.errors import DatabaseUnavailableError
from specrag.service.http.wire import describe_error

DETAIL = (
    "the database at host db.internal port 5433 database rag user specrag refused a statement: "
    'relation "passages" does not exist'
)


def test_a_database_failure_is_a_503_naming_nothing_of_the_server(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="specrag.service.http.wire")
    info = describe_error(DatabaseUnavailableError(DETAIL))
    body = json.dumps(info.body())
    assert (info.status, info.code, info.type) == (503, "database_unavailable", "database_unavailable")
    assert info.retry_after_s is not None and info.retry_after_s >= 1
    assert all(secret not in body for secret in ("db.internal", "5433", "specrag", "passages", "rag "))
    assert DETAIL in caplog.text
