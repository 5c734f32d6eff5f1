"""Helpers of the UI tests: the real run's settings and opening a page of the app in AppTest."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from streamlit.testing.v1 import AppTest

from ui.launch import APP_PATH
from ui.source import DB_ENV

SDC_STEP, STRAGGLER_RANK = 6, 1
RUN = [
    "--ranks", "2", "--steps", "12", "--ckpt-every", "4", "--log-every", "1",
    "--dim", "64", "--n-layers", "2", "--seq-len", "64", "--global-batch", "8",
    "--inject-straggler", f"rank={STRAGGLER_RANK},delay=0.1",
    "--inject-sdc", f"step={SDC_STEP},rank=0",
]  # fmt: skip


@dataclass(frozen=True)
class RealRun:
    db_url: str
    run_id: str
    summary: dict


OVERVIEW, RUN_HEALTH = "pages/overview.py", "pages/run_health.py"


def open_page(
    monkeypatch: pytest.MonkeyPatch, url: str | None, page: str = OVERVIEW, **params: str
) -> AppTest:
    """The app on `page` with the database `url` (None: none given) and query parameters, run as
    `scaletrain ui` runs it; fails on any exception the page raised."""
    if url is not None:
        monkeypatch.setenv(DB_ENV, url)
    app = AppTest.from_file(str(APP_PATH), default_timeout=60)
    app.run()
    if page != OVERVIEW:
        for name, value in params.items():
            app.query_params[name] = value
        app.switch_page(page).run()
    assert not app.exception, app.exception
    return app
