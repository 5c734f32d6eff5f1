"""Fixtures shared by every test package.

PostgreSQL: tests that need it take the `pg_url` fixture, or `pg_schema_url` (one test) or
`pg_module_schema_url` (one module) for a schema of their own. They skip with a visible reason when
SCALETRAIN_TEST_PG_URL is unset; CI sets it together with SCALETRAIN_REQUIRE_PG=1, which turns any
such skip into a failure, so a green CI always means the PostgreSQL tests ran.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine

from telemetry.db import connect

PG_ENV = "SCALETRAIN_TEST_PG_URL"
PG_SKIP_REASON = f"{PG_ENV} is unset: set it to a PostgreSQL URL to run the PostgreSQL tests"


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get(PG_ENV, "")
    if not url:
        pytest.skip(PG_SKIP_REASON)
    return url


@pytest.fixture(scope="session")
def pg_admin(pg_url: str) -> Iterator[Engine]:
    engine = connect(pg_url)
    yield engine
    engine.dispose()


@contextmanager
def fresh_schema(admin: Engine, prefix: str) -> Iterator[str]:
    """The URL of the test PostgreSQL database with a new schema first on its search_path; the
    schema is dropped afterwards."""
    schema = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.begin() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = admin.url.update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def pg_schema_url(pg_admin: Engine) -> Iterator[str]:
    """A fresh schema for one test."""
    with fresh_schema(pg_admin, "telemetry_test") as url:
        yield url


@pytest.fixture(scope="module")
def pg_module_schema_url(pg_admin: Engine) -> Iterator[str]:
    """A fresh schema shared by the tests of one module (whose fixtures are costly to rebuild)."""
    with fresh_schema(pg_admin, "telemetry_module") as url:
        yield url


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("SCALETRAIN_REQUIRE_PG") == "1":
        reason = str(report.longrepr)
        if PG_ENV in reason:
            report.outcome = "failed"
            report.longrepr = f"PostgreSQL test skipped in CI (SCALETRAIN_REQUIRE_PG=1): {reason}"
