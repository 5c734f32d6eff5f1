"""Fixtures shared by every test package.

PostgreSQL: tests that need it take the `pg_url` fixture. They skip with a visible reason when
SCALETRAIN_TEST_PG_URL is unset; CI sets it together with SCALETRAIN_REQUIRE_PG=1, which turns
any such skip into a failure, so a green CI always means the PostgreSQL tests ran.
"""

from __future__ import annotations

import os

import pytest

PG_ENV = "SCALETRAIN_TEST_PG_URL"
PG_SKIP_REASON = f"{PG_ENV} is unset: set it to a PostgreSQL URL to run the PostgreSQL tests"


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get(PG_ENV, "")
    if not url:
        pytest.skip(PG_SKIP_REASON)
    return url


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("SCALETRAIN_REQUIRE_PG") == "1":
        reason = str(report.longrepr)
        if PG_ENV in reason:
            report.outcome = "failed"
            report.longrepr = f"PostgreSQL test skipped in CI (SCALETRAIN_REQUIRE_PG=1): {reason}"
